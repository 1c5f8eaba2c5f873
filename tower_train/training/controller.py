"""The outer loop (`Controller`) around a mode's inner step: it runs updates until --max_steps and
around each one applies the policies (refused updates, stop signals), saves checkpoints and
calls its hooks (progress and TensorBoard, held-out evaluation, the user's callbacks). The inner
step, what one update computes, lives in the mode modules; `train.train` puts a run together
around the Controller. Nothing here prints or exits: errors are raised, progress goes to the log
and the hooks.
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import re
import signal
import time
from typing import Callable, Iterator, Mapping, Sequence

import tensorflow as tf
from absl import logging

from tower_train.training import checkpoints
from tower_train.config import TrainConfig
from tower_train.data.source import RUN_OP_ERRORS
from tower_train.errors import Stopped, TrainingError, UsageError, op_error_text, traced_message
from tower_train.training.hooks import Hook, UpdateEvent
from tower_train.step.inner_step import Decision, InnerStep, Shards, UpdateResult
from tower_train.workers.peer_watchdog import PeerClock
from tower_train.training.run import TrainState
from tower_train.training.stop_signals import StopSignals
from tower_train.user_code import UserCodeError

LONG_UPDATE_NOTE = 10.0  # seconds: an update that takes longer says how far it is, this often
# The node TensorFlow names in an op error raised by an iterator's get_next inside a function.
_ITERATOR_OP = re.compile(r"\[\[[^\]]*IteratorGetNext[^\]]*\]\]")


# --------------------------------------------------------------------------------------------------
# The outer loop


@dataclasses.dataclass(frozen=True)
class _Dispatched:
    """An update queued on the devices: its result, read when first asked, and when it began."""

    result: UpdateResult
    start: float


class _InputFailed(Exception):
    """An op error raised while the input pipeline made the next micro-batch, not by the update."""

    def __init__(self, error: tf.errors.OpError):
        super().__init__(error.message)
        self.error = error


class Controller:
    """Runs updates of `inner` until `max_steps`, as orbit's Controller runs its trainer.

    Around each update it applies the policies: a refused update (total weight 0, a float16
    overflow, or a non-finite value under --nonfinite) and a stop signal at the update boundary.
    It saves a checkpoint every `checkpoint_every` updates and at the end, and tells every hook
    of the run (hooks.py), in order: the held-out values one hook returns from `after_update`
    reach every hook as `after_evaluation`. A hook of the user's code (`Hook.user_code`, the
    Keras callbacks) may stop the run at an update boundary, saved, and one may stop it so at a
    non-finite update that --nonfinite=stop would fail on (`Hook.stops_at_nonfinite`: Keras's
    TerminateOnNaN), refused, with a warning. `any_worker` makes a stop
    decision collective (multi_worker), and `one_process` says that there is none to make, so
    that an update may be queued before the last one is read (`run`); `watchdog` hears of every micro-step, update and save,
    and of the first update of the process as local work (it traces the step functions; TF's
    collective timeout still covers its reduction). `describe_error` words an op error of an
    update (the source's `describe_error`, which names a file).
    """

    def __init__(self, *, config: TrainConfig, state: TrainState, inner: InnerStep,
                 batches: Iterator[Shards], writer: checkpoints.CheckpointWriter,
                 hooks: Sequence[Hook], global_batch: int, log: Callable[..., None],
                 warn: Callable[..., None] = logging.warning, stop: StopSignals | None = None,
                 any_worker: Callable[[bool], bool] = bool, one_process: bool = True,
                 watchdog: PeerClock = PeerClock(),
                 describe_error: Callable[[tf.errors.OpError], str] = op_error_text):
        self.config, self.state, self.inner, self.batches = config, state, inner, batches
        self.writer, self.hooks, self.global_batch = writer, hooks, global_batch
        self.log, self.warn = log, warn
        self.stop, self.any_worker, self.watchdog = stop, any_worker, watchdog
        self.describe_error = describe_error
        self.skipped = self.skipped_in_a_row = 0  # updates refused for a non-finite value
        self.empty_in_a_row = 0  # updates refused for a total weight of 0
        self.last_checkpoint: str | None = writer.latest()
        self.last_evaluated: int | None = None  # the update the hooks last heard an evaluation of
        # Whether an update may be queued before the last one is read (`run`): not where a stop
        # decision is collective (multi_worker), the float16 loss scale's log line reads the
        # state, or the step holds state elsewhere. The hooks say which updates they read after.
        self._overlaps = inner.overlaps_updates and one_process and state.loss_scale is None

    def run(self) -> float | None:
        """Trains to max_steps; returns the loss of the last applied update (None if none was).

        An update's result stays on the devices until something needs it. Where nothing does
        after update n (no log line, checkpoint, evaluation, callback or stop, and a step that
        `overlaps_updates`), update n + 1 is queued before n's result is read, so that the host
        never waits on the devices between updates; n's policies then apply one update late,
        which no action of them needs earlier: a refused update was never applied, and a
        non-finite one under --nonfinite=stop stops the run one update later with the same
        message. A stop signal settles the update in flight before it stops, at its boundary."""
        self._step = _value(self.state.step)  # read once: an applied update adds 1, nothing else moves it
        # The stream position after the updates queued so far, written to the state's
        # examples_seen when saved and at the end: an eager assign per update is a host op of its
        # own (0.1 ms, on a small model's update of 2-3 ms).
        self._position = _value(self.state.examples_seen)
        self._last_seconds = 0.0  # the last update's time (`_settle`)
        self._last_read = 0.0  # when the last update's result was read
        self._loss: float | None = None
        if self._step >= self.config.max_steps:
            self.log("step %d already reaches --max_steps=%d: nothing to train", self._step,
                     self.config.max_steps)
        try:
            self._train()
        finally:
            self.state.examples_seen.assign(self._position)
        return self._loss

    def _train(self) -> None:
        """The updates up to max_steps, or to a stop: `run`'s loop."""
        tracing = True
        self._tell("train_begin", saves=False)  # nothing trained yet: an error needs no save
        in_flight: _Dispatched | None = None  # dispatched, its result not read yet
        while in_flight is not None or self._step < self.config.max_steps:
            if in_flight is not None and self._signalled():
                self._settle(in_flight)  # stops there, saved
                in_flight = None
                continue
            dispatched = self._dispatch(self._step + 1 + (in_flight is not None), tracing)
            if in_flight is not None:
                self._settle(in_flight, overlapped=True)
            if not tracing and self._may_overlap(self._step + 1):
                in_flight = dispatched
            else:
                in_flight = None
                if self._settle(dispatched):
                    break
            tracing = False

    def _dispatch(self, number: int, tracing: bool) -> _Dispatched:
        """Queues the next update (`number`, if the one in flight is applied) on the devices."""
        self._tell("update_begin", number)
        start = time.perf_counter()
        # The step may read the update's micro-batches inside one call, unless the last update
        # took long enough that its micro-steps should say how far they are (`_noted`).
        at_once = self.batches if not tracing and self._last_seconds < LONG_UPDATE_NOTE else None
        try:
            with self.watchdog.local_work() if tracing else contextlib.nullcontext():
                result = self.inner.run_update(self._noted(number, start), at_once)
                if tracing:  # the first update traces: its watchdog covers its run too
                    result.applied  # noqa: B018 (the read)
        except _InputFailed as failed:
            raise self._failed(number, failed.error, in_input=True) from None
        except tf.errors.OpError as e:
            if not _fails_the_run(e):
                raise
            raise self._failed(number, e) from None
        except UsageError as e:  # a check of the update's first trace (step/towers.py)
            raise UsageError(traced_message(e)) from None
        self._position += self.global_batch
        return _Dispatched(result, start)

    def _failed(self, number: int, error: tf.errors.OpError, in_input: bool = False) -> TrainingError:
        """The error that ends the run at update `number`, from an op error of its input
        (`in_input`, or an iterator's op inside the update's call that read its micro-batches:
        a malformed, corrupted or deleted file, the user's map or py_function raising) or of the
        update itself (a label out of range, a model's assertion)."""
        where = " in the input pipeline" if in_input or _in_input(error) else ""
        return TrainingError(f"update {number} failed{where}: {self.describe_error(error)}; the last "
                             f"good checkpoint is {self.last_checkpoint or 'none'}")

    def _may_overlap(self, number: int) -> bool:
        """Whether the next update may be queued before the result of update `number` (its
        number if applied) is read: nothing after it needs that result or the state it leaves."""
        return (self._overlaps and number < self.config.max_steps
                and number % self.config.checkpoint_every != 0
                and not any(hook.reads_state(number) for hook in self.hooks)
                and not any(hook.stop_asked() for hook in self.hooks if hook.user_code))

    def _signalled(self) -> bool:
        return self.stop is not None and self.stop.received() is not None

    def _settle(self, update: _Dispatched, overlapped: bool = False) -> bool:
        """Reads `update`'s result and applies the policies and hooks to it; True when the run
        ends after it. `overlapped`: the next update is queued already, so nothing here may
        read or save the state (the Controller made sure nothing needs to: `_may_overlap`)."""
        try:
            result = update.result
            result.applied  # noqa: B018 (the read, which waits for the update)
        except tf.errors.OpError as e:
            if not _fails_the_run(e):
                raise
            raise self._failed(self._step + 1, e) from None
        # An update queued while the one before it ran is timed from that one's read, not from its
        # queueing: the updates' seconds then add up to the time they took, and the log's
        # examples/sec is not halved by overlapped updates counting the same seconds twice.
        read = time.perf_counter()
        seconds = self._last_seconds = read - max(update.start, self._last_read)
        self._last_read = read
        self.watchdog.progress()
        if not result.applied:
            stopping = self._refused(result)
            if not overlapped:
                self._stop_if_asked(self._step)
            if stopping:
                self._save_boundary(self._step)
                self.warn("%s: stopped after update %d, saved %s", stopping, self._step,
                          self.last_checkpoint)
                return True
            return False
        self.skipped_in_a_row = self.empty_in_a_row = 0
        self._step += 1  # the step counted it
        step, self._loss = self._step, result.loss
        if not (result.state_finite and self.inner.held_finite()):
            raise TrainingError(
                f"update {step} had a finite loss ({self._loss:.4g}) and gradient but left non-finite "
                "values in the weights or the optimizer's state (a learning rate too large, or "
                "the optimizer overflowed); stopping without saving them; the last good "
                f"checkpoint is {self.last_checkpoint or 'none'}")
        if not overlapped:
            self._stop_if_asked(step)
        held_out = [values for values in self._tell("after_update", UpdateEvent(
            step, self._loss, seconds, self.state)) if values]
        for values in held_out:
            self.evaluated(step, values)
        if step % self.config.checkpoint_every == 0 or step == self.config.max_steps:
            self._save(step)
        users = [hook for hook in self.hooks if hook.user_code]
        asked = [who for who in (hook.stop_asked() for hook in users) if who]
        # Overlapped, a stop asked since (by the queued update's on_train_batch_begin) is that
        # update's: `_may_overlap` reads it before the next is queued.
        if users and not overlapped and self.any_worker(bool(asked)):
            self._save_boundary(step)
            self.log("%s set model.stop_training: stopped after update %d, saved %s",
                     asked[0] if asked else "a peer's callback", step, self.last_checkpoint)
            return True
        return False

    def evaluated(self, step: int, held_out: Mapping[str, float]) -> None:
        """Tells the hooks of a held-out evaluation after update `step` (its values by name)."""
        self.last_evaluated = step
        self._tell("after_evaluation", step, held_out)

    def end(self) -> None:
        """Tells the hooks that training ended, after its final evaluation."""
        self._tell("train_end")

    def _tell(self, method: str, *args, saves: bool = True) -> list:
        """`method(*args)` of every hook, in order; what each returns. A hook of the user's code
        is called on the current state, which it may read and write; its error (a
        UserCodeError) first saves the training done up to this update boundary (`saves`) and
        says where."""
        results = []
        for hook in self.hooks:
            call = getattr(hook, method)
            if not hook.user_code:
                results.append(call(*args))
                continue
            self.inner.sync_state()
            try:
                results.append(call(*args))
            except UserCodeError as e:
                if not saves:
                    raise
                self._save_boundary(_value(self.state.step))
                saved = self.last_checkpoint or "no checkpoint"
                raise UserCodeError(f"{e}; training is saved in {saved}") from e.__cause__
            self.inner.state_written()
        return results

    def _noted(self, update: int, start: float) -> Iterator[Shards]:
        """The micro-batches, with a log line every LONG_UPDATE_NOTE seconds of an update that
        takes longer, so that a large --accum shows it is alive."""
        note_at = start + LONG_UPDATE_NOTE
        for taken in itertools.count(1):
            now = time.perf_counter()
            if now >= note_at:
                self.log("update %d: micro-step %d of %d (%.0f s so far)", update, taken,
                         self.config.accum, now - start)
                note_at = now + LONG_UPDATE_NOTE
            self.watchdog.progress()
            try:
                batch = next(self.batches)
            except tf.errors.OpError as e:  # of any kind: a py_function's own error is UnknownError
                raise _InputFailed(e) from e
            yield batch

    def _save(self, step: int) -> None:
        self.inner.sync_state()
        self.state.examples_seen.assign(self._position)
        self.last_checkpoint = self.writer.save(step)
        self.watchdog.progress()

    def _save_boundary(self, step: int) -> None:
        """Saves the state at update `step` unless the last checkpoint already holds it."""
        if self.last_checkpoint is None or checkpoints.checkpoint_number(self.last_checkpoint) != step:
            # Else only refused updates followed ckpt-<step>, which holds these weights; writing
            # it again would set this run's own checkpoint aside as passed over.
            self._save(step)

    def _stop_if_asked(self, step: int) -> None:
        signal_number = self.stop.received() if self.stop is not None else None
        if not self.any_worker(signal_number is not None):
            return
        if self.stop is not None:
            self.stop.at_boundary()
        self._save_boundary(step)
        name = signal.Signals(signal_number).name if signal_number else "a peer's signal"
        raise Stopped(f"stopped by {name} after update {step}; saved {self.last_checkpoint}; "
                      "run the same command to resume", signal_number or signal.SIGTERM)

    def _refused(self, result: UpdateResult) -> str | None:
        """Applies the policy for an update that was not applied; raises TrainingError to stop.
        Returns what ends the run here instead, without an error: a non-finite update under
        --nonfinite=stop that a hook stops the run at (`Hook.stops_at_nonfinite`); else None."""
        update = self._step + 1
        if result.decision == Decision.EMPTY:
            self.empty_in_a_row += 1
            if self.empty_in_a_row >= self.config.max_skipped:
                raise TrainingError(f"{self.empty_in_a_row} updates in a row had total weight 0, up to "
                                    f"stream position {self._position}: that reaches "
                                    f"--max_skipped={self.config.max_skipped} (the data's weights are "
                                    f"all 0 there); the last good checkpoint is "
                                    f"{self.last_checkpoint or 'none'}")
            self.log("update %d has total weight 0 (every label weighs 0) and was not applied; "
                     "its examples are passed over", update)
            return None
        if result.decision == Decision.OVERFLOW:
            scale = float(self.state.loss_scale.value.numpy())
            self.log("update %d: float16 gradient overflow; update skipped, loss scale lowered to %g",
                     update, scale)
            return None
        self.skipped_in_a_row += 1
        self.skipped += 1
        last_good = self.last_checkpoint or "none: no checkpoint was written yet"
        what = (f"update {update} has a non-finite loss or gradient (loss = {result.loss}) and was "
                "not applied")
        if self.config.nonfinite == "stop":
            stopper = next(filter(None, (hook.stops_at_nonfinite() for hook in self.hooks)), None)
            if stopper:
                return f"{what}; {stopper} stops the run there (--nonfinite=stop)"
            raise TrainingError(f"{what}; stopping (--nonfinite=stop); the last good checkpoint is "
                                f"{last_good}")
        if self.skipped_in_a_row >= self.config.max_skipped:
            raise TrainingError(f"{what}; {self.skipped_in_a_row} updates in a row skipped reaches "
                                f"--max_skipped={self.config.max_skipped}; the last good checkpoint "
                                f"is {last_good}")
        self.log("%s; skipped (%d in a row, %d in all)", what, self.skipped_in_a_row, self.skipped)
        return None


def _in_input(error: tf.errors.OpError) -> bool:
    """Whether `error` came from an iterator's get_next inside a function (`InnerStep.run_update`'s
    `at_once`), which names its node: of any kind, as a micro-batch's `next()` (`_noted`)."""
    return _ITERATOR_OP.search(error.message) is not None


def _fails_the_run(error: tf.errors.OpError) -> bool:
    """Whether an update's op error is the data's or the model's fault, said in one line."""
    return isinstance(error, RUN_OP_ERRORS) or _in_input(error)


def _value(variable: tf.Variable) -> int:
    return int(variable.numpy())
