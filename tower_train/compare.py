"""python -m tower_train.compare: train the single-process modes side by side, same data, same start.

Run commands:
    python -m tower_train.compare --num_gpus=4 --accum=2 --batch_size=32 --max_steps=12
    python -m tower_train.compare --modes=tower,mirrored --optimizer=sgd --learning_rate=0.1 --noplot
    tensorboard --logdir=/tmp/tower_train_compare      # one run per mode, overlaid

Every mode starts from the same seed (so the same initial weights), reads its
own copy of the same example stream and uses the same towers, so all of them
apply the same updates: losses and weights must agree up to float rounding,
and only the time may differ. Updates alternate mode by mode (update 1 of every
mode, then update 2, ...) so that drift of the machine cancels. A mode's figure
is the median over the updates after the warm-up of examples/sec, +/- jitter
(1.4826 x the median absolute deviation, as in `tower_train.benchmark`).

Nothing is checkpointed: train_dir (by default /tmp/tower_train_compare, apart
from training runs) only receives one TensorBoard run per mode
(<train_dir>/<mode>) and the plot <train_dir>/compare.png. It takes the
training flags, --model_module and --data_module among them.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import statistics
import sys
import time
from typing import TYPE_CHECKING

import numpy as np
from absl import flags, logging

from tower_train import cli
from tower_train import flags as tt_flags
from tower_train import startup
from tower_train.cli import command, parse_config
from tower_train.rules import HAND_PLACED_MODE, MODE_RULES, ONE_PROCESS_MODES
from tower_train.errors import UsageError
from tower_train.stats import jitter

if TYPE_CHECKING:
    from tower_train.startup import Started

TRAIN_DIR = "/tmp/tower_train_compare"  # apart from training runs' /tmp/tower_train
COMPARABLE_MODES = ONE_PROCESS_MODES
REFERENCE = HAND_PLACED_MODE  # the classic pattern the strategies are checked against
PLOT_NAME = "compare.png"


@dataclasses.dataclass(frozen=True)
class ModeRun:
    """What one mode did, update by update."""

    mode: str
    losses: list[float]
    seconds: list[float]  # wall time of each update; the first ones include tracing
    weights: list[np.ndarray]  # the trainable variables after the last update


@dataclasses.dataclass(frozen=True)
class Row:
    """One mode's line of the table; the last three are None when tower mode did not run."""

    mode: str
    examples_per_sec: float  # median over the updates after the warm-up
    jitter: float
    ratio_to_tower: float | None
    max_loss_diff: float | None  # largest |loss - tower's loss| over all updates
    max_rel_weight_diff: float | None  # after the last update, see relative_weight_diff


def check_modes(names: list[str]) -> list[str]:
    """The --modes list, or a UsageError naming what is wrong with it."""
    if not names:
        raise UsageError(f"--modes is empty: name one or more of {', '.join(COMPARABLE_MODES)}")
    for name in names:
        if name in MODE_RULES and MODE_RULES[name].workers:
            raise UsageError(f"--modes: {name} needs one process per worker and cannot be "
                             "compared in one process; run two `python -m tower_train "
                             f"--mode={name}` processes instead")
        if name not in COMPARABLE_MODES:
            raise UsageError(f"--modes: {name!r} is unknown; allowed: {', '.join(COMPARABLE_MODES)}")
    if len(set(names)) < len(names):
        raise UsageError(f"--modes={','.join(names)}: a mode is listed twice")
    return names


def compare_modes(run: Started, modes: list[str]) -> dict[str, ModeRun]:
    """Trains every mode for max_steps updates, alternating, from the same start: `run`'s
    config, devices, source and model, each mode's own copy."""
    from tower_train.step.modes import build_mode
    from tower_train.training.run import Run

    config = run.config
    runs, streams = {}, {}
    for m in modes:
        mode_config = dataclasses.replace(config, mode=m, all_reduce="auto")
        # Each run is seeded alike, so every mode starts from the same weights.
        runs[m] = Run.create(run.spec, run.source, build_mode(mode_config, run.plan))
        streams[m] = runs[m].batches()
    losses: dict[str, list[float]] = {m: [] for m in modes}
    seconds: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(config.max_steps):
        for m in modes:
            start = time.perf_counter()
            losses[m].append(runs[m].inner.run_update(streams[m]).loss)  # reading it waits for the device
            seconds[m].append(time.perf_counter() - start)
    for m in modes:
        runs[m].inner.sync_state()
    return {m: ModeRun(m, losses[m], seconds[m],
                       [v.numpy() for v in runs[m].state.model.trainable_variables])
            for m in modes}


def relative_weight_diff(weights: list[np.ndarray], reference: list[np.ndarray]) -> float:
    """max over variables of max|w - w_ref| / max|w_ref|: scale-free, one number per mode."""
    return max(float(np.abs(w - r).max() / (np.abs(r).max() + 1e-12))
               for w, r in zip(weights, reference, strict=True))


def summarize(runs: dict[str, ModeRun], global_batch: int, warmup_updates: int) -> list[Row]:
    """One Row per mode, in the order of `runs`."""
    rates = {m: [global_batch / s for s in run.seconds[warmup_updates:]] for m, run in runs.items()}
    medians = {m: statistics.median(r) for m, r in rates.items()}
    reference = runs.get(REFERENCE)
    rows = []
    for m, run in runs.items():
        row = Row(m, medians[m], jitter(rates[m]), None, None, None)
        if reference is not None:
            row = dataclasses.replace(
                row, ratio_to_tower=medians[m] / medians[REFERENCE],
                max_loss_diff=max(abs(a - b) for a, b in zip(run.losses, reference.losses, strict=True)),
                max_rel_weight_diff=relative_weight_diff(run.weights, reference.weights))
        rows.append(row)
    return rows


def format_table(rows: list[Row], global_batch: int, updates: int, warmup_updates: int) -> str:
    def optional(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    lines = [f"{'mode':<16} {'examples/sec':>22} {'vs tower':>9} {'max |dloss|':>12} "
             f"{'max rel dw':>11}"]
    for r in rows:
        lines.append(f"{r.mode:<16} {r.examples_per_sec:>12.1f} +/- {r.jitter:<7.1f} "
                     f"{optional(r.ratio_to_tower, '.2f'):>9} {optional(r.max_loss_diff, '.1e'):>12} "
                     f"{optional(r.max_rel_weight_diff, '.1e'):>11}")
    lines.append(f"global batch G = {global_batch}, {updates} updates per mode "
                 f"(the first {warmup_updates} not timed)")
    return "\n".join(lines)


def write_summaries(runs: dict[str, ModeRun], train_dir: str, global_batch: int,
                    warmup_updates: int) -> None:
    """Per-update scalars of each mode under <train_dir>/<mode>, so TensorBoard overlays them."""
    import tensorflow as tf

    for m, run in runs.items():
        writer = tf.summary.create_file_writer(os.path.join(train_dir, m))
        with writer.as_default():
            for step, (loss, seconds) in enumerate(zip(run.losses, run.seconds), start=1):
                tf.summary.scalar("loss", loss, step=step)
                # As in training: the warm-up's tracing time would only squash the curve.
                if step > warmup_updates:
                    tf.summary.scalar("examples_per_sec", global_batch / seconds, step=step)
        writer.close()


def plot(runs: dict[str, ModeRun], rows: list[Row], global_batch: int, path: str) -> None:
    """Loss per update (left) and examples/sec +/- jitter (right), as a PNG."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    figure = Figure(figsize=(11, 4.2), layout="constrained")
    FigureCanvasAgg(figure)  # no pyplot: no display, no global backend state
    losses, speed = figure.subplots(1, 2)
    # The curves should coincide: shrinking markers and different dashes keep each one visible.
    for i, (m, run) in enumerate(runs.items()):
        losses.plot(range(1, len(run.losses) + 1), run.losses, label=m,
                    linestyle=("-", "--", ":")[i % 3], marker="os^"[i % 3],
                    markersize=max(9 - 2.5 * i, 3), markerfacecolor="none")
    losses.xaxis.set_major_locator(MaxNLocator(integer=True))
    losses.set(xlabel="update", ylabel="loss", title=f"training loss (G = {global_batch})")
    losses.legend()
    speed.bar([r.mode for r in rows], [r.examples_per_sec for r in rows],
              yerr=[r.jitter for r in rows], capsize=6, color=[f"C{i}" for i in range(len(rows))])
    speed.set(ylabel="examples/sec", title="throughput after warm-up (median +/- jitter)")
    figure.savefig(path, dpi=100)


@functools.cache
def compare_flags() -> dict[str, flags.FlagHolder]:
    """The command's own flags, and its own --train_dir default, set when the command runs:
    importing this module for its functions must change no flag of another command."""
    holders = tt_flags.define_compare_flags()
    flags.FLAGS.set_default("train_dir", TRAIN_DIR)
    flags.FLAGS["train_dir"].help = tt_flags.COMPARE_TRAIN_DIR_HELP
    return holders


def _compare(argv: list[str]) -> int:
    own_flags = compare_flags()
    config = parse_config(argv, __doc__ or "", own_flags, tt_flags.COMPARE_OPTIONS)
    modes = check_modes(own_flags["modes"].value)
    if config.mode != REFERENCE:  # (TrainConfig then allows only --all_reduce=auto)
        raise UsageError(f"--mode={config.mode}: not read here; list the modes in --modes")
    warmup = own_flags["warmup_updates"].value
    if warmup < 1:
        raise UsageError(f"--warmup_updates={warmup}: must be >= 1: the first update traces")
    if config.max_steps <= warmup:
        raise UsageError(f"--max_steps={config.max_steps}: must be greater than "
                         f"--warmup_updates={warmup}, or no update is timed")
    # It writes TensorBoard runs and the plot in train_dir: as a training run, it takes the
    # train_dir's lock, and with it the refusal of a link where it writes (training/run_record.py).
    with startup.start(startup.COMPARE, startup.options_of(config), announce=True) as run:
        runs = compare_modes(run, modes)
        config, global_batch = run.config, run.config.global_batch
        rows = summarize(runs, global_batch, warmup)
        write_summaries(runs, config.train_dir, global_batch, warmup)
        print(format_table(rows, global_batch, config.max_steps, warmup))
        if own_flags["plot"].value:
            if importlib.util.find_spec("matplotlib") is None:
                logging.info("no plot: matplotlib is not installed (pip install -e '.[plot]')")
            else:
                path = os.path.join(config.train_dir, PLOT_NAME)
                plot(runs, rows, global_batch, path)
                print(f"plot: {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Runs `python -m tower_train.compare`; returns the exit status."""
    return command(lambda: _compare(sys.argv if argv is None else argv))


if __name__ == "__main__":
    cli.run(main)
