"""The benchmark's own flags (tower_train/flags.py defines them), besides the training flags."""
from __future__ import annotations

import functools

from absl import flags

from tower_train import flags as tt_flags


@functools.cache
def bench_flags() -> dict[str, flags.FlagHolder]:
    """The benchmark's own flags, defined when a command first needs them: importing the
    package for its pure functions (as the tests do) must not claim flag names that
    `tower_train.compare` defines too."""
    return tt_flags.define_benchmark_flags()
