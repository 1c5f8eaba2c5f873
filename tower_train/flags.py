"""Every command-line flag of tower-train, defined here and nowhere else.

The training flags are generated from the fields of `TrainConfig`: name,
type, default and help text all come from there, so adding an option is one
field. `config_from_flags` turns the parsed flags into that frozen, validated
config. Which of them each other command reads, and the few flags of its own (eval, compare,
benchmark), follow.
"""
from __future__ import annotations

import dataclasses
import typing

from absl import flags

from tower_train.config import AUTO_OR_BOOL, TrainConfig, option_type

from tower_train.rules import AUTO, ONE_PROCESS_MODES, WORKERS_MODE


class _AutoOrBoolParser(flags.BooleanParser):
    """A boolean flag's values, and AUTO."""

    def parse(self, argument):
        if isinstance(argument, str) and argument.lower() == AUTO:
            return AUTO
        try:
            return super().parse(argument)
        except (TypeError, ValueError):
            raise ValueError(f"unknown; allowed: true, false, {AUTO}") from None


def _define_auto_or_bool(name: str, default, help: str) -> flags.FlagHolder:  # noqa: A002
    """A flag given as --name, --noname or --name=auto: absl's boolean forms, and AUTO."""
    # boolean=True: absl then takes the bare --name and --noname, as for DEFINE_bool.
    return flags.DEFINE_flag(flags.Flag(_AutoOrBoolParser(), flags.ArgumentSerializer(), name, default,
                                        help, boolean=True))


_DEFINE_BY_TYPE = {str: flags.DEFINE_string, int: flags.DEFINE_integer,
                   float: flags.DEFINE_float, bool: flags.DEFINE_bool, AUTO_OR_BOOL: _define_auto_or_bool}


TRAINING_FLAGS: dict[str, flags.FlagHolder] = {
    field.name: _DEFINE_BY_TYPE[option_type(typing.get_type_hints(TrainConfig)[field.name])](
        field.name, field.default, field.metadata["help"])
    for field in dataclasses.fields(TrainConfig)}
MAIN_FLAGS = tuple(field.name for field in dataclasses.fields(TrainConfig) if field.metadata["main"])

# The training options each command other than training reads, which its --help and --helpfull
# show beside its own flags. It takes the others too, so that one flagfile serves every command,
# and ignores them.
_MODEL_AND_DATA = ("model", "model_module", "dataset", "data_module", "data_dir", "precision",
                   "recompute")
_DEVICES = ("num_gpus", "gpu_memory_mb", "deterministic", "tf32")
_UPDATES = ("batch_size", "seed", "augment", "optimizer", "learning_rate", "lr_schedule",
            "warmup_steps", "scale_lr", "clip_norm", "ema_decay", "jit_compile", "sparse_steps",
            "tower_weights", "transfer_precision")
EVAL_OPTIONS = (*_MODEL_AND_DATA, *_DEVICES, "ps_device", "train_dir", "eval_batch_size")
COMPARE_OPTIONS = (*_MODEL_AND_DATA, *_DEVICES, "ps_device", *_UPDATES, "accum", "tower_split",
                   "max_steps", "train_dir")
# Each configuration's name sets its K and split, and a tower kind where the variables live.
BENCHMARK_OPTIONS = (*_MODEL_AND_DATA, *_DEVICES, "ps_device", *_UPDATES)
NORMALIZATION_OPTIONS = (*_MODEL_AND_DATA, *_DEVICES, "batch_size", "accum", "tower_split", "seed",
                         "augment")
EVAL_TRAIN_DIR_HELP = "The run whose latest checkpoint is evaluated (unless --checkpoint names one)."
COMPARE_TRAIN_DIR_HELP = ("One TensorBoard run per mode (<train_dir>/<mode>) and the plot "
                          "<train_dir>/compare.png; nothing is checkpointed.")


def config_from_flags() -> TrainConfig:
    """The parsed flags as a validated config; raises UsageError on a bad value."""
    return TrainConfig(**{name: holder.value for name, holder in TRAINING_FLAGS.items()})


def define_benchmark_flags() -> dict[str, flags.FlagHolder]:
    """The flags only `python -m tower_train.benchmark` takes, besides the training flags."""
    return {
        "configs": flags.DEFINE_list(
            "configs", [],
            "What to run, as KIND_kK[_bB][_sA-B...][_permicro][_data|_tfrecord|_dataset] (see "
            "tower_train/benchmark/__init__.py); "
            "default: the "
            "suite for --measure."),
        "measure": flags.DEFINE_string(
            "measure", "time",
            "time: examples/sec, configurations alternating in this process; memory: peak memory "
            "of each configuration in a subprocess of its own; traffic: bytes per update across "
            "devices, counted from the traced graphs (nothing is run); ops: TensorFlow's profile of "
            "--updates updates, op time per example by op type; keras: seconds per epoch of "
            "tower_train.keras.fit(num_gpus=1) against Keras's own model.fit on an LSTM and a "
            "dense model, --rounds tries each (--configs and the training flags do not apply)."),
        "link_gbps": flags.DEFINE_list(
            "link_gbps", [],
            "With --measure=traffic: link speeds in gigabits per second (e.g. 256 for PCIe 4.0 "
            "x16, 2400 for NVLink 3, 100 for 100 GbE); the report adds the predicted "
            "communication time per update on each."),
        "updates": flags.DEFINE_integer("updates", 5, "Timed updates per configuration per round."),
        "warmup_updates": _define_warmup_updates(),
        "rounds": flags.DEFINE_integer(
            "rounds", 5, "Rounds; each times every configuration once, so machine drift cancels."),
        "output_json": flags.DEFINE_string("output_json", None, "Also write all results here."),
        "slow_tower_ms": flags.DEFINE_float(
            "slow_tower_ms", 0.0,
            "Tower kinds: tower 0 also waits this many milliseconds per example of its shard, a "
            "device slower than the others, to show what --tower_split (_sA-B in a name) saves."),
    }


def define_compare_flags() -> dict[str, flags.FlagHolder]:
    """The flags only `python -m tower_train.compare` takes, besides the training flags."""
    return {
        "modes": flags.DEFINE_list(
            "modes", list(ONE_PROCESS_MODES),
            f"Modes to train side by side, alternating update by update: {' | '.join(ONE_PROCESS_MODES)} "
            f"({WORKERS_MODE} needs one process per worker)."),
        "warmup_updates": _define_warmup_updates(),
        "plot": flags.DEFINE_bool(
            "plot", True,
            "Also write <train_dir>/compare.png (needs matplotlib: pip install -e '.[plot]')."),
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


def define_launch_flags() -> tuple[flags.FlagValues, dict[str, flags.FlagHolder]]:
    """The flags of `python -m tower_train.launch`, in a flag set of their own: the training
    flags follow its `--`, and are parsed apart."""
    launch_flags = flags.FlagValues()
    return launch_flags, {
        "workers": flags.DEFINE_integer(
            "workers", None, "Worker processes to start on this machine (at least 1).",
            flag_values=launch_flags),
        "port": flags.DEFINE_integer(
            "port", None, "Worker i listens on 127.0.0.1:port+i; default: free ports the system "
            "picks.", flag_values=launch_flags),
        "help": flags.DEFINE_bool("help", False, "Show this help and exit.", short_name="h",
                                  flag_values=launch_flags),
    }


def _define_warmup_updates() -> flags.FlagHolder:
    return flags.DEFINE_integer(
        "warmup_updates", 2,
        "First updates of each configuration left out of examples/sec; the first one traces.")
