"""Progress of a run: what a person watching sees, and TensorBoard's scalars.

On a terminal, a live line (tqdm): updates done out of --max_steps, the
examples/sec of the updates since the first, the ETA and the last loss. Else
(a log file, a pipe) a log line right after the first update of the process
and then every --log_every updates:

    step 10, loss = 1.8345 (712.3 examples/sec; 5.751 sec/update)

The first update of a process traces the step functions, so it is reported but
not timed. TensorBoard gets loss, learning rate, examples/sec and, in float16,
the loss scale every --log_every updates, whichever way progress is shown, and
the held-out quantities under their history names (val_loss, ...) at each
held-out evaluation, the final one included (`after_evaluation`). A
summary that cannot be written (a full disk) turns them off with one warning and
training goes on: the checkpoints, which a resume needs, report their own failures.

`new_history` is what `fit` returns as `TrainResult.history`, as Keras's
`History.history`: a list per key, of this call's updates only (a resumed run's
earlier updates are in TensorBoard). "step", "loss" and "learning_rate" at the
same updates as TensorBoard's points; "val_step", "val_precision" (weighted
precision @ 1), "val_loss" and "val_<name>" of each of fit's `metrics` at every
held-out evaluation that counted an example (evaluation/held_out.py).
"""
from __future__ import annotations

from typing import Callable, Mapping, Sequence

import tensorflow as tf
from absl import logging

from tower_train.training.checkpoints import write_failure
from tower_train.config import TrainConfig
from tower_train.training.hooks import Hook, UpdateEvent


HISTORY_KEYS = ("step", "loss", "learning_rate", "val_step", "val_precision", "val_loss")


def learning_rate(optimizer) -> float:
    """The rate the optimizer's schedule gives at its current update count, as logged."""
    return float(tf.convert_to_tensor(optimizer.learning_rate))


def new_history(metric_names: Sequence[str] = (), classes: bool = True) -> dict[str, list[float]]:
    """An empty `TrainResult.history` (see the module docstring), with a key for each of the
    held-out metrics named; without `classes` (targets: data/source.py) no val_precision."""
    keys = [key for key in HISTORY_KEYS if classes or key != "val_precision"]
    return {key: [] for key in (*keys, *(f"val_{name}" for name in metric_names))}


class Summaries:
    """TensorBoard scalars in a directory (None: nowhere), off for good after one failed write."""

    def __init__(self, directory: str | None):
        self._directory = directory
        self._writer = None
        if directory is not None:
            try:
                self._writer = tf.summary.create_file_writer(directory)
            except tf.errors.OpError as e:
                self._turn_off(e)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        if self._writer is None:
            return
        try:
            with self._writer.as_default(step=step):
                for name, value in values.items():
                    tf.summary.scalar(name, value)
        except tf.errors.OpError as e:
            self._turn_off(e)

    def close(self) -> None:
        if self._writer is None:
            return
        try:
            self._writer.close()  # writes what is still queued
        except tf.errors.OpError as e:
            self._turn_off(e)

    def _turn_off(self, error: tf.errors.OpError) -> None:
        self._writer = None
        logging.warning("TensorBoard summaries are off from here: cannot write them to %s (%s); "
                        "training goes on", self._directory, write_failure(error))


class Progress(Hook):
    """A Controller hook (hooks.py) that reports every applied update and every held-out
    evaluation, and records both in `history` (`new_history`)."""

    def __init__(self, *, config: TrainConfig, global_batch: int, first_step: int,
                 summaries: Summaries, log: Callable[..., None], live: bool,
                 history: dict[str, list[float]]):
        self._log_every, self._max_steps = config.log_every, config.max_steps
        self._history = history  # appended to at every TensorBoard point
        self._global_batch, self._summaries, self._log = global_batch, summaries, log
        self._timed_updates, self._timed_seconds = 0, 0.0  # since the last log line
        self._all_updates, self._all_seconds = 0, 0.0  # since the first update: the live rate
        self._reported_first = False
        self._bar = None
        if live and first_step < config.max_steps:
            from tqdm import tqdm

            self._bar = tqdm(total=config.max_steps, initial=first_step, unit="update",
                             dynamic_ncols=True, leave=True)

    def reads_state(self, step: int) -> bool:
        # A log line's learning rate and loss scale; the live bar needs only the event's loss.
        return not self._reported_first or step % self._log_every == 0 or step == self._max_steps

    def after_update(self, event: UpdateEvent) -> None:
        first = not self._reported_first
        self._reported_first = True
        if not first:  # the first update of a process traces: not timed
            self._timed_updates += 1
            self._timed_seconds += event.seconds
            self._all_updates += 1
            self._all_seconds += event.seconds
        state = event.state
        due = event.step % self._log_every == 0 or event.step == self._max_steps
        scale = (float(state.loss_scale.value.numpy())
                 if state.loss_scale is not None and (first or due) else None)
        if due:
            self._write_summaries(event, scale)
        if self._bar is not None:
            self._bar.update(event.step - self._bar.n)
            postfix = {"loss": f"{event.loss:.4f}"}
            if self._all_updates:
                postfix["examples/s"] = f"{self._global_batch * self._all_updates / self._all_seconds:.1f}"
            self._bar.set_postfix(postfix, refresh=True)
        elif first or due:
            self._log_line(event.step, event.loss, scale)
        if due:
            self._timed_updates, self._timed_seconds = 0, 0.0

    def after_evaluation(self, step: int, held_out: Mapping[str, float]) -> None:
        self._history["val_step"].append(step)
        for name, value in held_out.items():
            self._history[name].append(value)
        self._summaries.scalars(step, dict(held_out))

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()

    def _write_summaries(self, event: UpdateEvent, scale: float | None) -> None:
        values = {"loss": event.loss, "learning_rate": learning_rate(event.state.optimizer)}
        if scale is not None:
            values["loss_scale"] = scale
        for key in ("loss", "learning_rate"):
            self._history[key].append(values[key])
        self._history["step"].append(event.step)
        if self._timed_updates:
            values["examples_per_sec"] = self._global_batch * self._timed_updates / self._timed_seconds
        self._summaries.scalars(event.step, values)

    def _log_line(self, step: int, loss: float, scale: float | None) -> None:
        scale_text = "" if scale is None else f", loss scale {scale:g}"
        if self._timed_updates:
            self._log("step %d, loss = %.4f%s (%.1f examples/sec; %.3f sec/update)", step, loss,
                      scale_text, self._global_batch * self._timed_updates / self._timed_seconds,
                      self._timed_seconds / self._timed_updates)
        else:
            self._log("step %d, loss = %.4f%s (warm-up: tracing, not timed)", step, loss, scale_text)
