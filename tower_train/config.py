"""The explicit, frozen configuration of one training run, and its validation.

Every default lives here, each with the reason for it; `tower_train.flags`
defines one absl flag per field and takes its default from this class, so a
default is written exactly once.
"""
from __future__ import annotations

import dataclasses
import os

from tower_train.errors import UsageError

MODES = ("tower", "mirrored", "multi_worker", "central_storage")
ALL_REDUCE_BY_MODE = {
    "tower": ("auto",),  # tower mode reduces on the parameter device, by hand
    "mirrored": ("auto", "nccl", "hierarchical_copy", "one_device"),
    "multi_worker": ("auto", "nccl", "ring"),
    "central_storage": ("auto",),  # the strategy reduces to its parameter device
}
PS_DEVICES = ("cpu", "gpu")
OPTIMIZERS = ("sgd", "momentum", "adam")
NONFINITE_POLICIES = ("stop", "skip")
DATASETS = ("synthetic", "cifar10")
RUN_FILE = "tower_train_run.json"  # in a train_dir: what its checkpoints were trained with
SCHEDULES = ("constant", "exponential", "cosine")  # of the learning rate; see tower_train.schedules
SYNC_BN_MODES = ("mirrored", "multi_worker")  # the modes with a replica context to synchronize in
PRECISIONS = ("fp32", "bf16", "fp16")  # compute dtype of the towers; variables stay float32


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """What to train, where and how. Invalid values raise UsageError on construction."""

    mode: str = "tower"  # the classic pattern this project exists for
    all_reduce: str = "auto"  # nccl on whole GPUs; else reduction to one device, or ring across workers
    collective_timeout: float = 120.0  # seconds a multi_worker collective may wait for a peer before failing
    num_gpus: int = 1  # towers; 1 keeps a plain run plain, as the original's default
    accum: int = 1  # micro-steps per update; 1 = no accumulation
    batch_size: int = 128  # examples per tower per micro-step, as in the original
    ps_device: str = "cpu"  # the original kept the variables on the CPU
    gpu_memory_mb: int | None = None  # per logical GPU when GPU 0 is split; None = its memory / N
    model: str = "cifar10_cnn"  # the original tutorial's network
    model_module: str | None = None  # a module to import so that its @register runs before --model is looked up
    dataset: str = "synthetic"  # embedded, so a first run needs no download
    data_dir: str | None = None  # only --dataset=cifar10 reads files
    max_steps: int = 30  # updates; the main job (4 towers x 8 micro-steps) then takes a few minutes on 2 CPU cores
    train_dir: str = "/tmp/tower_train"  # as the original's /tmp/cifar10_train, but resumed, never deleted
    seed: int = 0  # fixes the initial weights and the order of the example stream
    optimizer: str = "adam"  # 48% held-out in the main job's 30 updates; the original's sgd at 0.1 gets 16%
    learning_rate: float = 0.001  # Adam's usual rate; use 0.1 with --optimizer=sgd, as the original
    augment: bool = False  # distortions slow learning on short runs; the original's are one flag away
    log_every: int = 10  # updates between log lines, as the original
    checkpoint_every: int = 100  # updates between checkpoints; one is also written at the end
    eval_batch_size: int = 500  # held-out examples per evaluation batch; any size counts every example once
    deterministic: bool = False  # op determinism costs speed; turn it on to reproduce bit for bit
    nonfinite: str = "stop"  # a NaN usually means a bug or a bad rate: stop and keep the last good checkpoint
    max_skipped: int = 5  # with --nonfinite=skip, a 6th bad update in a row means the run has diverged
    lr_schedule: str = "constant"  # Adam's default needs no decay in a short run; "exponential" is the original's
    warmup_steps: int = 0  # updates of linear warm-up; large G with --scale_lr usually wants a few hundred
    scale_lr: bool = False  # the linear scaling rule changes the rate the user typed, so only when asked
    clip_norm: float | None = None  # the original did not clip
    ema_decay: float = 0.9999  # the original's MOVING_AVERAGE_DECAY; 0 keeps no average
    eval_every: int = 0  # updates between held-out evaluations during training; 0 = only at the end
    sync_bn: bool = False  # synchronized BatchNorm costs an all-reduce per BN layer per micro-step
    export_dir: str | None = None  # where to write a SavedModel at the end; None = no export
    precision: str = "fp32"  # the original's; bf16/fp16 pay off only on hardware with fast units for them
    jit_compile: bool = False  # XLA is not faster on every model and needs towers that hold their variables
    recompute: bool = False  # saves activation memory but costs ~25% more time per update (resnet20)

    def __post_init__(self) -> None:
        _one_of("mode", self.mode, MODES)
        if self.all_reduce not in ALL_REDUCE_BY_MODE[self.mode]:
            raise UsageError(f"--all_reduce={self.all_reduce}: not for --mode={self.mode}; allowed: "
                             f"{', '.join(ALL_REDUCE_BY_MODE[self.mode])}")
        if not self.collective_timeout > 0:
            raise UsageError(f"--collective_timeout={self.collective_timeout}: must be seconds > 0")
        _one_of("ps_device", self.ps_device, PS_DEVICES)
        _one_of("optimizer", self.optimizer, OPTIMIZERS)
        _one_of("nonfinite", self.nonfinite, NONFINITE_POLICIES)
        _one_of("dataset", self.dataset, DATASETS)
        _one_of("lr_schedule", self.lr_schedule, SCHEDULES)
        _one_of("precision", self.precision, PRECISIONS)
        _at_least("warmup_steps", self.warmup_steps, 0)
        _at_least("eval_every", self.eval_every, 0)
        if self.clip_norm is not None and not self.clip_norm > 0:
            raise UsageError(f"--clip_norm={self.clip_norm}: must be a number > 0 (or unset: no clipping)")
        if not 0.0 <= self.ema_decay < 1.0:
            raise UsageError(f"--ema_decay={self.ema_decay}: must be in [0, 1); 0 keeps no average")
        if self.sync_bn and self.mode not in SYNC_BN_MODES:
            raise UsageError(f"--sync_bn: only with --mode={' or '.join(SYNC_BN_MODES)}, not "
                             f"--mode={self.mode} (tower mode normalizes each tower's own shard)")
        if self.export_dir is not None:
            check_export_dir(self.export_dir)
        _at_least("num_gpus", self.num_gpus, 0)
        for name in ("accum", "batch_size", "max_steps", "log_every", "checkpoint_every",
                     "eval_batch_size", "max_skipped"):
            _at_least(name, getattr(self, name), 1)
        if self.gpu_memory_mb is not None:
            _at_least("gpu_memory_mb", self.gpu_memory_mb, 1)
        _at_least("seed", self.seed, 0)
        if not self.learning_rate > 0:  # also catches NaN
            raise UsageError(f"--learning_rate={self.learning_rate}: must be a number > 0")
        if not self.train_dir:
            raise UsageError("--train_dir is empty: it must name a directory")

    @property
    def num_towers(self) -> int:
        """--num_gpus=0 still trains, on one CPU tower."""
        return max(self.num_gpus, 1)

    @property
    def global_batch(self) -> int:
        """G: the examples one update consumes."""
        return self.batch_size * self.num_towers * self.accum


def _one_of(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise UsageError(f"--{name}={value}: unknown; allowed: {', '.join(allowed)}")


def _at_least(name: str, value: int, minimum: int) -> None:
    if value < minimum:
        raise UsageError(f"--{name}={value}: must be a whole number >= {minimum}")


def check_train_dir(path: str) -> None:
    """Refuses a train_dir that cannot hold checkpoints, before anything is written."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise UsageError(f"--train_dir={path}: is a file, not a directory")
    existing = path
    while not os.path.exists(existing):
        existing = os.path.dirname(existing) or "."
    if not os.path.isdir(existing):
        raise UsageError(f"--train_dir={path}: {existing} is a file, so the directory cannot be made")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"--train_dir={path}: {existing} is not writable")


def check_export_dir(path: str) -> None:
    """Refuses an export_dir that holds anything: an export never overwrites."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise UsageError(f"--export_dir={path}: is a file, not a directory; name a new directory "
                         "(nothing is overwritten)")
    if os.path.isdir(path) and os.listdir(path):
        raise UsageError(f"--export_dir={path}: exists and is not empty; name a new directory "
                         "(nothing is overwritten)")
