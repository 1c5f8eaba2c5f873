"""Every command-line flag of tower-train, defined here and nowhere else.

Defaults come from `TrainConfig`, where each has its reason; `config_from_flags`
turns the parsed flags into that frozen, validated config.
"""
from __future__ import annotations

from absl import flags

from tower_train.config import (ALL_REDUCE_BY_MODE, DATASETS, MODES, NONFINITE_POLICIES, OPTIMIZERS,
                                PRECISIONS, PS_DEVICES, SCHEDULES, SYNC_BN_MODES, TrainConfig)

_D = TrainConfig()

MODE = flags.DEFINE_string("mode", _D.mode, f"How gradients cross devices: {' | '.join(MODES)}.")
ALL_REDUCE = flags.DEFINE_string(
    "all_reduce", _D.all_reduce,
    "Cross-device reduction of the strategy modes: "
    + "; ".join(f"{mode}: {' | '.join(choices)}" for mode, choices in ALL_REDUCE_BY_MODE.items()) + ".")
COLLECTIVE_TIMEOUT = flags.DEFINE_float(
    "collective_timeout", _D.collective_timeout,
    "multi_worker: seconds a collective waits for a peer before the worker fails.")
NUM_GPUS = flags.DEFINE_integer(
    "num_gpus", _D.num_gpus,
    "Number of towers. With fewer GPUs, GPU 0 (or, with none, the CPU) is split into logical "
    "devices; 0 = one tower on the CPU.")
ACCUM = flags.DEFINE_integer("accum", _D.accum, "Micro-steps accumulated into one update (K).")
BATCH_SIZE = flags.DEFINE_integer("batch_size", _D.batch_size, "Examples per tower per micro-step.")
PS_DEVICE = flags.DEFINE_string(
    "ps_device", _D.ps_device,
    f"Where all variables live: {' | '.join(PS_DEVICES)} (gpu = GPU 0, or the first tower's "
    "device when there is no GPU).")
GPU_MEMORY_MB = flags.DEFINE_integer(
    "gpu_memory_mb", _D.gpu_memory_mb,
    "Memory of each logical GPU when GPU 0 is split (default: its memory / num_gpus).")
MODEL = flags.DEFINE_string("model", _D.model, "Registered network to train (see models/).")
MODEL_MODULE = flags.DEFINE_string(
    "model_module", _D.model_module,
    "Python module to import before looking up --model, so that its @models.register runs.")
DATASET = flags.DEFINE_string("dataset", _D.dataset, f"Input data: {' | '.join(DATASETS)}.")
DATA_DIR = flags.DEFINE_string(
    "data_dir", _D.data_dir, "Directory of the CIFAR-10 binary files (--dataset=cifar10 only).")
MAX_STEPS = flags.DEFINE_integer(
    "max_steps", _D.max_steps, "Train until this many updates (not micro-steps) are done.")
TRAIN_DIR = flags.DEFINE_string(
    "train_dir", _D.train_dir, "Checkpoints and TensorBoard logs; a run here resumes from it.")
SEED = flags.DEFINE_integer("seed", _D.seed, "Fixes the initial weights and the example order.")
OPTIMIZER = flags.DEFINE_string("optimizer", _D.optimizer, f"{' | '.join(OPTIMIZERS)}.")
LEARNING_RATE = flags.DEFINE_float("learning_rate", _D.learning_rate, "Learning rate.")
AUGMENT = flags.DEFINE_bool("augment", _D.augment, "Apply the original's training distortions.")
LOG_EVERY = flags.DEFINE_integer("log_every", _D.log_every, "Updates between progress lines.")
CHECKPOINT_EVERY = flags.DEFINE_integer(
    "checkpoint_every", _D.checkpoint_every, "Updates between checkpoints.")
EVAL_BATCH_SIZE = flags.DEFINE_integer(
    "eval_batch_size", _D.eval_batch_size, "Examples per batch when evaluating held-out data.")
DETERMINISTIC = flags.DEFINE_bool(
    "deterministic", _D.deterministic, "Enable TensorFlow op determinism.")
NONFINITE = flags.DEFINE_string(
    "nonfinite", _D.nonfinite,
    f"An update with a non-finite loss or gradient is never applied; then: "
    f"{' | '.join(NONFINITE_POLICIES)} (stop the run, or skip the update and go on).")
MAX_SKIPPED = flags.DEFINE_integer(
    "max_skipped", _D.max_skipped, "With --nonfinite=skip: stop after this many skipped in a row.")
LR_SCHEDULE = flags.DEFINE_string(
    "lr_schedule", _D.lr_schedule,
    f"{' | '.join(SCHEDULES)}; exponential = x0.1 every 350 epochs of G-example updates, staircase.")
WARMUP_STEPS = flags.DEFINE_integer(
    "warmup_steps", _D.warmup_steps, "Updates of linear learning-rate warm-up.")
SCALE_LR = flags.DEFINE_bool(
    "scale_lr", _D.scale_lr, "Linear scaling rule: learning rate x G / 256.")
CLIP_NORM = flags.DEFINE_float(
    "clip_norm", _D.clip_norm, "Clip the update's mean gradient to this global norm.")
EMA_DECAY = flags.DEFINE_float(
    "ema_decay", _D.ema_decay, "Moving average of the weights, one step per update; 0 = none.")
EVAL_EVERY = flags.DEFINE_integer(
    "eval_every", _D.eval_every, "Updates between held-out evaluations; 0 = only at the end.")
SYNC_BN = flags.DEFINE_bool(
    "sync_bn", _D.sync_bn,
    f"Synchronized BatchNormalization across replicas ({' or '.join(SYNC_BN_MODES)} only).")
EXPORT_DIR = flags.DEFINE_string(
    "export_dir", _D.export_dir, "At the end, write a SavedModel (images -> logits) here.")
PRECISION = flags.DEFINE_string(
    "precision", _D.precision,
    f"{' | '.join(PRECISIONS)}: the towers' compute dtype (Keras mixed precision); fp16 adds "
    "dynamic loss scaling, decided once per update.")
JIT_COMPILE = flags.DEFINE_bool(
    "jit_compile", _D.jit_compile,
    "Compile each tower's forward and backward pass with XLA (towers must hold their variables: "
    "mirrored, or one tower on the parameter device).")
RECOMPUTE = flags.DEFINE_bool(
    "recompute", _D.recompute,
    "Gradient checkpointing: keep only the model's block outputs and recompute each block's "
    "activations in the backward pass (tf.recompute_grad).")


def config_from_flags() -> TrainConfig:
    """The parsed flags as a validated config; raises UsageError on a bad value."""
    return TrainConfig(
        mode=MODE.value, all_reduce=ALL_REDUCE.value, collective_timeout=COLLECTIVE_TIMEOUT.value,
        num_gpus=NUM_GPUS.value, accum=ACCUM.value,
        batch_size=BATCH_SIZE.value, ps_device=PS_DEVICE.value,
        gpu_memory_mb=GPU_MEMORY_MB.value, model=MODEL.value, model_module=MODEL_MODULE.value,
        dataset=DATASET.value, data_dir=DATA_DIR.value, max_steps=MAX_STEPS.value,
        train_dir=TRAIN_DIR.value, seed=SEED.value, optimizer=OPTIMIZER.value,
        learning_rate=LEARNING_RATE.value, augment=AUGMENT.value, log_every=LOG_EVERY.value,
        checkpoint_every=CHECKPOINT_EVERY.value, eval_batch_size=EVAL_BATCH_SIZE.value,
        deterministic=DETERMINISTIC.value, nonfinite=NONFINITE.value, max_skipped=MAX_SKIPPED.value,
        lr_schedule=LR_SCHEDULE.value, warmup_steps=WARMUP_STEPS.value, scale_lr=SCALE_LR.value,
        clip_norm=CLIP_NORM.value, ema_decay=EMA_DECAY.value, eval_every=EVAL_EVERY.value,
        sync_bn=SYNC_BN.value, export_dir=EXPORT_DIR.value, precision=PRECISION.value,
        jit_compile=JIT_COMPILE.value, recompute=RECOMPUTE.value)


def define_benchmark_flags() -> dict[str, flags.FlagHolder]:
    """The flags only `python -m tower_train.benchmark` takes, besides the training flags."""
    return {
        "configs": flags.DEFINE_list(
            "configs", [],
            "What to run, as KIND_kK[_bB][_data] (see tower_train/benchmark.py); default: the "
            "suite for --measure."),
        "measure": flags.DEFINE_string(
            "measure", "time",
            "time: examples/sec, configurations alternating in this process; memory: peak memory "
            "of each configuration in a subprocess of its own."),
        "updates": flags.DEFINE_integer("updates", 5, "Timed updates per configuration per round."),
        "warmup_updates": _define_warmup_updates(),
        "rounds": flags.DEFINE_integer(
            "rounds", 5, "Rounds; each times every configuration once, so machine drift cancels."),
        "output_json": flags.DEFINE_string("output_json", None, "Also write all results here."),
    }


def define_compare_flags() -> dict[str, flags.FlagHolder]:
    """The flags only `python -m tower_train.compare` takes, besides the training flags."""
    return {
        "modes": flags.DEFINE_list(
            "modes", ["tower", "mirrored", "central_storage"],
            "Modes to train side by side, alternating update by update: tower | mirrored | "
            "central_storage (multi_worker needs one process per worker)."),
        "warmup_updates": _define_warmup_updates(),
        "plot": flags.DEFINE_bool(
            "plot", True,
            "Also write <train_dir>/compare.png (needs matplotlib: pip install -e .[plot])."),
    }


def define_eval_flags() -> dict[str, flags.FlagHolder]:
    """The flags only `python -m tower_train.eval` takes, besides the training flags."""
    return {
        "checkpoint": flags.DEFINE_string(
            "checkpoint", None,
            "Checkpoint to evaluate: a path prefix such as <train_dir>/ckpt-30, or a directory "
            "(its latest). Default: the latest checkpoint in --train_dir."),
        "use_ema": flags.DEFINE_bool(
            "use_ema", True,
            "Evaluate the moving average of the weights when the checkpoint holds one "
            "(--ema_decay > 0 in training); --nouse_ema evaluates the trained weights."),
    }


def _define_warmup_updates() -> flags.FlagHolder:
    return flags.DEFINE_integer(
        "warmup_updates", 2,
        "First updates of each configuration left out of examples/sec; the first one traces.")
