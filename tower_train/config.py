"""The explicit, frozen options of one training run, and their validation.

Every option is a field of `TrainConfig` with its default, the reason for that
default (the comment) and its help text (the metadata). `tower_train.flags`
turns every field into an absl flag and `tower_train.fit` takes every field as
a keyword, so an option is written exactly once.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
import os
import stat
import tempfile
import types
import typing

from tower_train.errors import UsageError
from tower_train.rules import (AUTO, HAND_PLACED_MODE, MODE_RULES, MODES, PLACEMENTS, PS_DEVICES, SYNC_BN_MODES,
                                WORKERS_MODE, ModeRules, PlacementRules)



CLUSTERS = ("tf_config", "slurm", "auto")  # where multi_worker's workers learn the cluster
TOWER_WEIGHTS = ("per_update", "per_micro_step")  # how often tower mode's towers fetch the weights
BN_STATISTICS = ("per_micro_step", "per_update")  # when BatchNormalization's moving statistics move
OPTIMIZERS = ("sgd", "momentum", "adam")
NONFINITE_POLICIES = ("stop", "skip")
SCHEDULES = ("constant", "exponential", "cosine")  # of the learning rate; see tower_train.step.schedules
PRECISIONS = ("fp32", "bf16", "fp16")  # compute dtype of the towers; variables stay float32
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # the dtype each precision names
MAX_SEED = 2**32 - 1  # Keras's set_random_seed takes no larger seed
# Shorter, and a healthy worker's one micro-step, or its peers' start-up skew, can run it out.
MIN_COLLECTIVE_TIMEOUT = 10.0
_PATHS = ("train_dir", "data_dir", "export_dir")  # fit() takes a pathlib.Path for these too
AUTO_OR_BOOL = bool | str  # an option that is True, False or AUTO: the --[no]flag, or --flag=auto


def option(default, help: str, main: bool = False):  # noqa: A002 (absl's word for it)
    """A TrainConfig field: its default, its --help text, and whether --help lists it."""
    return dataclasses.field(default=default, metadata={"help": help, "main": main})


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """What to train, where and how. Invalid values raise UsageError on construction."""

    # The classic pattern this project exists for.
    mode: str = option("tower", f"How gradients cross devices: {' | '.join(MODES)}.", main=True)
    # NCCL on whole GPUs; else reduction to one device, or ring across workers.
    all_reduce: str = option(
        "auto", "Cross-device reduction of the strategy modes: "
        + "; ".join(f"{m.name}: {' | '.join(m.all_reduce)}" for m in MODE_RULES.values()) + ".")
    # A peer's start-up takes seconds, and preempted machines take minutes to come back.
    collective_timeout: float = option(
        120.0, "multi_worker: seconds a worker waits on its peers without progress before it fails "
        "(at least 10; local work such as tracing and evaluation is not counted).")
    # TF_CONFIG is what TensorFlow itself reads; Slurm and auto are asked for by name.
    cluster: str = option(
        "tf_config", "multi_worker: where each worker learns the cluster and its place in it: "
        "tf_config (the TF_CONFIG variable) | slurm (the SLURM_* variables of an srun step, "
        "through TensorFlow's SlurmClusterResolver; ports from $TOWER_TRAIN_SLURM_PORT, default "
        "8888) | auto (slurm when SLURM_PROCID is set, else tf_config). See docs/multi-machine.md.")
    # Towers; 1 keeps a plain run plain, as the original's default.
    num_gpus: int = option(
        1, "Number of towers N. With fewer GPUs, GPU 0 (or, with none, the CPU) is split into "
        "logical devices; 0 = one tower on the CPU.", main=True)
    # Micro-steps per update; 1 = no accumulation.
    accum: int = option(1, "Micro-steps K accumulated into one update.", main=True)
    # Examples per tower per micro-step, as in the original.
    batch_size: int = option(128, "Examples per tower per micro-step.", main=True)
    # Equal shares suit equal devices; unequal ones (a slower GPU) want their own split.
    tower_split: str | None = option(
        None, "Tower mode: each tower's share of every micro-batch of num_gpus x batch_size "
        "examples, e.g. 3,1 (each share must come out a whole number of examples); default: "
        "batch_size each. The update stays the weighted mean over its G examples.")
    # Where the benchmark measured each placement fastest (devices.resolve_ps_device).
    ps_device: str = option(
        AUTO, f"Where the variables live: {' | '.join(PS_DEVICES)} (gpu = GPU 0, or the first "
        "tower's device when there is no GPU; spread = tower mode's trainable weights, with their "
        "optimizer slots and averages, cut into byte-balanced slices, one per tower device, each "
        "updated by its device; the counters, BN statistics and the checkpoint's copy on the host). "
        "auto: gpu for one tower on a GPU, else cpu; the device line says which and why.")
    # The weights cannot change inside an update, so K - 1 of K fetches are redundant:
    # cifar10_cnn at N = 4, K = 8 moves 17 MB instead of 137 MB for 17 MB more tower memory.
    tower_weights: str = option(
        "per_update", "Tower mode with accum > 1: per_update copies the trainable weights to each "
        "tower once per update (N x P bytes, one more copy of them on each tower); "
        "per_micro_step reads them from the parameter device at every micro-step "
        "(K x N x P bytes). The update is the same. Default per_update: the weights cannot "
        "change inside an update, so the other K - 1 reads move nothing new.")
    # A preempted machine gives ~30 s between SIGTERM and SIGKILL; an update boundary usually comes
    # much sooner.
    stop_grace_period: float = option(
        30.0, "Seconds a stop signal (SIGTERM, SIGINT, SIGHUP) waits for the end of the current update to "
        "save there; after them the process exits unsaved, its checkpoints intact.")
    # None = GPU 0's memory / N.
    gpu_memory_mb: int | None = option(
        None, "Memory of each logical GPU when GPU 0 is split (default: its memory / num_gpus).")
    # The original tutorial's network.
    model: str = option("cifar10_cnn", "Registered network to train (see docs/models.md).", main=True)
    # Imported first, so that its @register runs before --model is looked up.
    model_module: str | None = option(
        None, "Python module to import before looking up --model (the current directory is "
        "searched first), so that its @tower_train.models.register runs.", main=True)
    # Embedded, so a first run needs no download.
    dataset: str = option(
        "synthetic", "Registered data set: synthetic (embedded), cifar10 (binary files in "
        "--data_dir), or one that --data_module registers.", main=True)
    # Imported first, so that its @tower_train.data.register runs before --dataset is looked up.
    data_module: str | None = option(
        None, "Python module to import before looking up --dataset (the current directory is "
        "searched first), so that its @tower_train.data.register runs.", main=True)
    # Only --dataset=cifar10 reads files.
    data_dir: str | None = option(
        None, "Directory of the CIFAR-10 binary files (--dataset=cifar10 only).")
    # Updates; the main job (4 towers x 8 micro-steps) then takes a few minutes on 2 CPU cores.
    max_steps: int = option(30, "Train until this many updates (not micro-steps) are done.", main=True)
    # As the original's /tmp/cifar10_train, but resumed, never deleted.
    train_dir: str = option(
        "/tmp/tower_train", "Checkpoints and TensorBoard logs; a run here resumes from it.", main=True)
    # Fixes the initial weights and the order of the example stream.
    seed: int = option(0, f"Fixes the initial weights and the example order (0..{MAX_SEED}).")
    # 48% held-out in the main job's 30 updates; the original's sgd at 0.1 gets 16%.
    optimizer: str = option("adam", f"{' | '.join(OPTIMIZERS)}.", main=True)
    # Adam's usual rate; use 0.1 with --optimizer=sgd, as the original.
    learning_rate: float = option(0.001, "Learning rate.", main=True)
    # Distortions slow learning on short runs; the original's are one flag away.
    augment: bool = option(
        False, "Apply the original's training distortions (built-in image data sets only).")
    # Updates between log lines, as the original.
    log_every: int = option(
        10, "Updates between progress lines and TensorBoard points (the first update is always "
        "reported).")
    # Updates between checkpoints; one is also written at the end.
    checkpoint_every: int = option(100, "Updates between checkpoints.")
    # Any size counts every held-out example once.
    eval_batch_size: int = option(500, "Examples per batch when evaluating held-out data.")
    # Op determinism costs speed; turn it on to reproduce bit for bit.
    deterministic: bool = option(False, "Enable TensorFlow op determinism.")
    # A NaN usually means a bug or a bad rate: stop and keep the last good checkpoint.
    nonfinite: str = option(
        "stop", "An update with a non-finite loss or gradient is never applied; then: "
        f"{' | '.join(NONFINITE_POLICIES)} (stop the run, or skip the update and go on).")
    # With --nonfinite=skip, a 6th bad update in a row means the run has diverged.
    max_skipped: int = option(5, "With --nonfinite=skip: stop after this many skipped in a row.")
    # Adam's default needs no decay in a short run; "exponential" is the original's.
    lr_schedule: str = option(
        "constant", f"{' | '.join(SCHEDULES)}; exponential = x0.1 every 350 epochs of G-example "
        "updates, staircase.")
    # Large G with --scale_lr usually wants a few hundred.
    warmup_steps: int = option(0, "Updates of linear learning-rate warm-up.")
    # The linear scaling rule changes the rate the user typed, so only when asked.
    scale_lr: bool = option(False, "Linear scaling rule: learning rate x G / 256.")
    # The original did not clip.
    clip_norm: float | None = option(None, "Clip the update's mean gradient to this global norm.")
    # The original's MOVING_AVERAGE_DECAY; 0 keeps no average.
    ema_decay: float = option(
        0.9999, "Moving average of the weights, one step per update; 0 = none.")
    # 0 = only at the end.
    eval_every: int = option(0, "Updates between held-out evaluations; 0 = only at the end.")
    # Synchronized BatchNorm costs an all-reduce per BN layer per micro-step.
    sync_bn: bool = option(
        False, f"Synchronized BatchNormalization across replicas ({' or '.join(SYNC_BN_MODES)} only).")
    # None = no export.
    export_dir: str | None = option(
        None, "At the end, write a SavedModel (raw features -> logits) here.")
    # The original's; bf16/fp16 pay off only on hardware with fast units for them.
    precision: str = option(
        "fp32", f"{' | '.join(PRECISIONS)}: the towers' compute dtype (Keras mixed precision); "
        "fp16 adds dynamic loss scaling, decided once per update.")
    # Exact: 16-bit sums would round every update's gradient (by up to 2^-8 relative in bf16).
    transfer_precision: str = option(
        "fp32", f"{' | '.join(PRECISIONS)}: the dtype tower mode's gradient sums cross devices in "
        "(reduction and update stay float32); fp16 only with --precision=fp16, whose loss scale "
        "keeps them in range. Default fp32: exact; bf16 halves the gradient bytes and rounds them.")
    # Keras's fit's default: XLA where a GPU computes, off on a CPU, where it is rarely faster.
    jit_compile: AUTO_OR_BOOL = option(
        AUTO, "Compile each tower's forward and backward pass with XLA, over the values of the "
        "weights it is handed (tower mode) or its replica's variables (mirrored, multi_worker); "
        "not with central_storage, whose replicas read the parameter device's variables. auto: "
        "on where GPUs compute the towers and the mode and every layer allow it (Keras's fit "
        "decides so), else off; the device line says which and why.")
    # TensorFlow's own default: Ampere and later GPUs compute float32 matmuls several times faster.
    tf32: bool = option(
        True, "TensorFloat-32 on GPUs: float32 matmuls and convolutions round their inputs to 10 "
        "bits of mantissa (TensorFlow's default); --notf32 computes them in full float32, so an "
        "update matches the CPU's to float32 rounding. No effect on a CPU.")
    # Saves activation memory but costs ~25% more time per update (resnet20).
    recompute: bool = option(
        False, "Gradient checkpointing: keep only the model's block outputs and recompute each "
        "block's activations in the backward pass (tf.recompute_grad).")
    # Keras's fit steps an Embedding so (tower_train.keras.fit's default); off, the CLI keeps the
    # dense step of docs/gradient-math.md and holds no occurrences.
    sparse_steps: bool = option(
        False, "Step a table read by gather (an Embedding's) as Keras's fit does: the optimizer "
        "takes its gradient as a row per occurrence of an index in the update's G examples, "
        "duplicates not summed (Adam's and RMSprop's second moments add each occurrence's square). "
        "Tower mode with --ps_device=cpu or gpu; the others step densely.")
    # The original's towers each moved them; per_update is what Keras's fit at G does.
    bn_statistics: str = option(
        "per_micro_step", f"{' | '.join(BN_STATISTICS)}: when BatchNormalization's moving mean and "
        "variance move: at every tower's pass (N x K times per update), or once per update from "
        "the update's pooled batch moments, as Keras's fit on one batch of G moves them (tower "
        "mode; the strategy modes move them per micro-step and say so). Each pass still "
        "normalizes by its own micro-batch's moments.")

    def __post_init__(self) -> None:
        self._check_types()
        _one_of("mode", self.mode, MODES)
        if self.all_reduce not in self.mode_rules.all_reduce:
            raise UsageError(f"--all_reduce={self.all_reduce}: not for --mode={self.mode}; allowed: "
                             f"{', '.join(self.mode_rules.all_reduce)}")
        if not MIN_COLLECTIVE_TIMEOUT <= self.collective_timeout < math.inf:
            raise UsageError(f"--collective_timeout={self.collective_timeout}: must be seconds >= "
                             f"{MIN_COLLECTIVE_TIMEOUT:g}")
        _one_of("cluster", self.cluster, CLUSTERS)
        if self.cluster != "tf_config" and not self.mode_rules.workers:
            raise UsageError(f"--cluster={self.cluster}: only with --mode={WORKERS_MODE}, not "
                             f"--mode={self.mode}")
        if not (self.stop_grace_period > 0 and math.isfinite(self.stop_grace_period)):
            raise UsageError(f"--stop_grace_period={self.stop_grace_period}: must be seconds > 0")
        _one_of("ps_device", self.ps_device, PS_DEVICES)
        placement = self.placement_rules
        if placement is not None and placement.spread and not self.mode_rules.places_towers:
            raise UsageError(f"--ps_device={self.ps_device}: only with --mode={HAND_PLACED_MODE} (a strategy "
                             f"places the variables itself), not --mode={self.mode}")
        _one_of("tower_weights", self.tower_weights, TOWER_WEIGHTS)
        _one_of("bn_statistics", self.bn_statistics, BN_STATISTICS)
        if self.bn_statistics == "per_update" and self.recompute:
            raise UsageError("--bn_statistics=per_update with --recompute: a recomputed block "
                             "normalizes twice per pass; use --bn_statistics=per_micro_step")
        if self.tower_weights != "per_update" and placement is not None and placement.copies_per_update_only:
            raise UsageError(f"--tower_weights={self.tower_weights}: --ps_device={self.ps_device} sends each "
                             "tower the weights once per update, from every slice's device; use per_update")
        if self.tower_weights != "per_update" and not self.mode_rules.places_towers:
            raise UsageError(f"--tower_weights={self.tower_weights}: only with --mode={HAND_PLACED_MODE} (the "
                             f"strategies place the weights themselves), not --mode={self.mode}")
        _one_of("optimizer", self.optimizer, OPTIMIZERS)
        _one_of("nonfinite", self.nonfinite, NONFINITE_POLICIES)
        _one_of("lr_schedule", self.lr_schedule, SCHEDULES)
        _one_of("precision", self.precision, PRECISIONS)
        _one_of("transfer_precision", self.transfer_precision, PRECISIONS)
        if self.transfer_precision != "fp32" and not self.mode_rules.places_towers:
            raise UsageError(f"--transfer_precision={self.transfer_precision}: only with --mode={HAND_PLACED_MODE} "
                             f"(a strategy's all-reduce would also sum in it), not --mode={self.mode}")
        if self.transfer_precision == "fp16" and self.precision != "fp16":
            raise UsageError(f"--transfer_precision=fp16: only with --precision=fp16, whose loss scale "
                             f"keeps the gradient sums in float16's range (not --precision="
                             f"{self.precision}); use bf16")
        _at_least("warmup_steps", self.warmup_steps, 0)
        _at_least("eval_every", self.eval_every, 0)
        if self.clip_norm is not None and not (self.clip_norm > 0 and math.isfinite(self.clip_norm)):
            raise UsageError(f"--clip_norm={self.clip_norm}: must be a number > 0 (or unset: no clipping)")
        if not 0.0 <= self.ema_decay < 1.0:
            raise UsageError(f"--ema_decay={self.ema_decay}: must be in [0, 1); 0 keeps no average")
        if self.deterministic and self.jit_compile is True:
            raise UsageError("--deterministic with --jit_compile: XLA has no deterministic form of "
                             "some gradients (MaxPool's); use one or the other")
        if self.sync_bn and not self.mode_rules.replica_context:
            raise UsageError(f"--sync_bn: only with --mode={' or '.join(SYNC_BN_MODES)}, not "
                             f"--mode={self.mode} (tower mode normalizes each tower's own shard)")
        _at_least("num_gpus", self.num_gpus, 0)
        for name in ("accum", "batch_size", "max_steps", "log_every", "checkpoint_every",
                     "eval_batch_size", "max_skipped"):
            _at_least(name, getattr(self, name), 1)
        if self.gpu_memory_mb is not None:
            _at_least("gpu_memory_mb", self.gpu_memory_mb, 1)
        if self.tower_split is not None:
            self._check_tower_split()
        _at_least("seed", self.seed, 0)
        if self.seed > MAX_SEED:
            raise UsageError(f"--seed={self.seed}: must be a whole number <= {MAX_SEED}")
        if not (self.learning_rate > 0 and math.isfinite(self.learning_rate)):  # NaN fails both
            raise UsageError(f"--learning_rate={self.learning_rate}: must be a finite number > 0")
        if not self.train_dir:
            raise UsageError("--train_dir is empty: it must name a directory")

    def _check_types(self) -> None:
        """Each option has its field's type (fit() takes any Python value): a whole number for an
        int, a real number for a float (stored as float), a path-like object for a directory
        (stored as str), True or False for a bool; None where the field allows it. NumPy's
        numbers are taken, stored as Python's."""
        hints = typing.get_type_hints(TrainConfig)
        for field in dataclasses.fields(self):
            value, annotation = getattr(self, field.name), hints[field.name]
            if value is None and type(None) in typing.get_args(annotation):
                continue
            kind = option_type(annotation)
            if field.name in _PATHS and isinstance(value, os.PathLike):
                value = os.fspath(value)
            if kind == AUTO_OR_BOOL and value == AUTO:
                continue
            if kind is bool or kind == AUTO_OR_BOOL:
                # NumPy's bool is no subclass of bool; numpy itself is not imported for it.
                valid = isinstance(value, bool) or type(value).__module__ == "numpy" and \
                    type(value).__name__ in ("bool", "bool_")
            elif kind is int:
                valid = isinstance(value, numbers.Integral)
            elif kind is float:
                valid = isinstance(value, numbers.Real)
            else:
                valid = isinstance(value, str)
            if not valid or (kind not in (bool, AUTO_OR_BOOL) and isinstance(value, bool)):
                wanted = {bool: "True or False", int: "a whole number", float: "a number",
                          str: "a path" if field.name in _PATHS else "a string",
                          AUTO_OR_BOOL: f"True, False or {AUTO!r}"}[kind]
                raise UsageError(f"{field.name}={value!r}: must be {wanted}, not a "
                                 f"{type(value).__name__}")
            try:
                plain = bool(value) if kind == AUTO_OR_BOOL else kind(value)  # numpy numbers made plain
            except OverflowError:  # a whole number for a float
                raise UsageError(f"{field.name}: a whole number of {len(str(abs(int(value))))} digits "
                                 "is beyond a float's range") from None
            object.__setattr__(self, field.name, plain)  # frozen

    def _check_tower_split(self) -> None:
        flag = f"--tower_split={self.tower_split}"
        try:
            shares = [int(share) for share in self.tower_split.split(",")]
        except ValueError:
            shares = []
        if not shares or min(shares) < 1:
            raise UsageError(f"{flag}: must be whole numbers >= 1 separated by commas, one per tower")
        if not self.mode_rules.places_towers:
            raise UsageError(f"{flag}: only with --mode={HAND_PLACED_MODE} (the strategies split every micro-batch "
                             f"evenly), not --mode={self.mode}")
        if len(shares) != self.num_towers:
            raise UsageError(f"{flag}: {len(shares)} shares for {self.num_towers} tower(s) "
                             f"(--num_gpus={self.num_gpus}); give one per tower")
        micro = self.batch_size * self.num_towers
        if any(share * micro % sum(shares) for share in shares):
            raise UsageError(f"{flag}: does not cut a micro-batch of {micro} examples (--num_gpus x "
                             f"--batch_size) into whole shards; the shares' sum must divide "
                             f"{micro} x each share")

    @property
    def mode_rules(self) -> ModeRules:
        return MODE_RULES[self.mode]

    @property
    def placement_rules(self) -> PlacementRules | None:
        """--ps_device's rules; None while it is "auto" (the devices decide it: api/startup)."""
        return PLACEMENTS.get(self.ps_device)

    @property
    def tower_shard_sizes(self) -> tuple[int, ...]:
        """Examples of each tower per micro-step: batch_size each, or as --tower_split says."""
        if self.tower_split is None:
            return (self.batch_size,) * self.num_towers
        shares = [int(share) for share in self.tower_split.split(",")]
        micro = self.batch_size * self.num_towers
        return tuple(share * micro // sum(shares) for share in shares)

    @property
    def num_towers(self) -> int:
        """--num_gpus=0 still trains, on one CPU tower."""
        return max(self.num_gpus, 1)

    @property
    def global_batch(self) -> int:
        """G: the examples one update consumes."""
        return self.batch_size * self.num_towers * self.accum


def option_type(annotation: object) -> type:
    """str, int, float, bool or AUTO_OR_BOOL: a field's annotation with an optional None taken
    off."""
    if isinstance(annotation, types.UnionType) and annotation != AUTO_OR_BOOL:
        (annotation,) = [a for a in typing.get_args(annotation) if a is not type(None)]
    return annotation  # type: ignore[return-value]


def _one_of(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise UsageError(f"--{name}={value}: unknown; allowed: {', '.join(allowed)}")


def _at_least(name: str, value: int, minimum: int) -> None:
    if value < minimum:
        raise UsageError(f"--{name}={value}: must be a whole number >= {minimum}")


def check_directories(config: TrainConfig) -> None:
    """The config's directories checked on the filesystem, once, at start-up, before anything is
    written; a TrainConfig itself reads no file, so `dataclasses.replace` probes nothing."""
    check_train_dir(config.train_dir)
    if config.export_dir is not None:
        check_export_dir(config.export_dir)


def check_train_dir(path: str) -> None:
    """Refuses a train_dir that cannot hold checkpoints, before anything is written."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise UsageError(f"--train_dir={path}: is a file, not a directory")
    if os.path.islink(path) and not os.path.exists(path):  # makedirs would fail on it
        raise UsageError(f"--train_dir={path}: is a symbolic link to {os.readlink(path)}, which does "
                         "not exist; make that directory or name another train_dir")
    _check_can_be_made("--train_dir", path)


def _check_can_be_made(flag: str, path: str, inside: str | None = None) -> None:
    """Refuses a directory `inside` (default: `path` itself) that cannot be made: its nearest
    existing ancestor must be a directory where one can be made, which is tried (root passes
    every permission check, and a read-only mount or /proc fails only when tried)."""
    existing = os.path.abspath(path if inside is None else inside)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise UsageError(f"{flag}={path}: {existing} is a file, so the directory cannot be made")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".tower_train_probe_", dir=existing))
    except OSError as e:
        raise UsageError(f"{flag}={path}: cannot make a directory in {existing} ({e.strerror})") from None


def check_export_dir(path: str) -> None:
    """Refuses an export_dir the export at the end could not be moved into: a symbolic link (the
    move would fail on it, and nothing is written through a link), a file, a directory that holds
    anything (an export never overwrites), or one that the run may not replace."""
    if os.path.islink(path):
        raise UsageError(f"--export_dir={path}: is a symbolic link to {os.readlink(path)}; name the "
                         "directory itself (nothing is written through a link)")
    if os.path.exists(path) and not os.path.isdir(path):
        raise UsageError(f"--export_dir={path}: is a file, not a directory; name a new directory "
                         "(nothing is overwritten)")
    if os.path.isdir(path) and os.listdir(path):
        raise UsageError(f"--export_dir={path}: exists and is not empty; name a new directory "
                         "(nothing is overwritten)")
    # The export is staged beside it and moved in: its parent must be writable.
    parent = os.path.dirname(os.path.abspath(path))
    _check_can_be_made("--export_dir", path, inside=parent)
    if os.path.isdir(path) and not _may_replace(path, parent):
        raise UsageError(f"--export_dir={path}: belongs to another user in {parent}, whose sticky "
                         "bit lets only its owner replace it; name a new directory")


def _may_replace(path: str, parent: str) -> bool:
    """Whether this process may rename over `path` in `parent`: in a sticky directory (/tmp)
    only the owner of the entry or of the directory may, or root."""
    parent_stat = os.stat(parent)
    return (not parent_stat.st_mode & stat.S_ISVTX or os.geteuid() in (0, parent_stat.st_uid)
            or os.lstat(path).st_uid == os.geteuid())
