"""Training: the outer loop (`Controller`) around a mode's inner step.

`train` puts the pieces together: the run (`run.Run`: the state built in the
mode's scope, its inner step and stream), the checkpoints, then the Controller, which runs
updates until --max_steps and around each one applies the policies (refused
updates, stop signals), saves checkpoints and calls its hooks (progress and
TensorBoard, held-out evaluation). The inner step,
what one update computes, lives in the mode modules. Nothing here prints or
exits: errors are raised, progress goes to the log and the hooks.
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import signal
import time
from typing import Callable, Iterator, Mapping, Sequence

import keras
import tensorflow as tf
from absl import logging

from tower_train.training import checkpoints
from tower_train.training import run_record
from tower_train.training.keras_callbacks import KerasCallbacks
from tower_train.workers.cluster import WorkerInfo
from tower_train.config import TrainConfig
from tower_train.data.source import RUN_OP_ERRORS, Source
from tower_train.errors import Stopped, TrainingError, UsageError, op_error_text, traced_message
from tower_train.training.evaluation.held_out import EvaluationHook, check_metrics_against, evaluate
from tower_train.export import export_saved_model
from tower_train.training.hooks import Hook, UpdateEvent
from tower_train.step.inner_step import Decision, InnerStep, Shards, UpdateResult
from tower_train.model_spec import ModelSpec, users_network
from tower_train.step.modes import Mode
from tower_train.numerics import run_numerics, tf32_note
from tower_train.workers.peer_watchdog import PeerClock
from tower_train.training.progress import Progress, Summaries, new_history
from tower_train.training.run import Run, TrainState
from tower_train.training.stop_signals import StopSignals
from tower_train.user_code import UserCodeError, call_user_code

LONG_UPDATE_NOTE = 10.0  # seconds: an update that takes longer says how far it is, this often


@dataclasses.dataclass(frozen=True)
class TrainResult:
    """What `fit` returns."""

    step: int  # updates applied, counting from 0 across resumes
    loss: float | None  # of the last update; None when there was nothing left to train
    eval_precision: float | None  # weighted top-1 on the held-out data; None without any
    # Its weighted loss, the regularization once and the batch losses' mean (evaluation/held_out.py);
    # None without any.
    eval_loss: float | None
    eval_examples: int  # held-out examples counted
    eval_metrics: dict[str, float]  # fit(metrics=...) by name; empty without held-out weight
    checkpoint: str | None  # the last checkpoint written (None in a worker that writes none)
    # The trained network, the user's own object (its trained weights, not the moving average):
    # a keras.Model instance given to fit, with the weights copied in; else the one the run made.
    model: keras.Model
    # This call's logged quantities, a list per key, as Keras's History.history (progress.py).
    history: dict[str, list[float]]
    # The callback whose on_train_end set the weights `model` and the eval_ fields are of
    # (EarlyStopping(restore_best_weights=True) restoring its best), which then differ from
    # those of update `step` that `checkpoint` and the export hold; None when they are the same.
    weights_written_by: str | None = None


# --------------------------------------------------------------------------------------------------
# The outer loop


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
    decision collective (multi_worker); `watchdog` hears of every micro-step, update and save,
    and of the first update of the process as local work (it traces the step functions; TF's
    collective timeout still covers its reduction). `describe_error` words an op error of an
    update (the source's `describe_error`, which names a file).
    """

    def __init__(self, *, config: TrainConfig, state: TrainState, inner: InnerStep,
                 batches: Iterator[Shards], writer: checkpoints.CheckpointWriter,
                 hooks: Sequence[Hook], global_batch: int, log: Callable[..., None],
                 warn: Callable[..., None] = logging.warning, stop: StopSignals | None = None,
                 any_worker: Callable[[bool], bool] = bool,
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

    def run(self) -> float | None:
        """Trains to max_steps; returns the loss of the last applied update (None if none was)."""
        loss = None
        step = _value(self.state.step)  # read once: an applied update adds 1, nothing else moves it
        if step >= self.config.max_steps:
            self.log("step %d already reaches --max_steps=%d: nothing to train", step,
                     self.config.max_steps)
        tracing = True
        self._tell("train_begin", saves=False)  # nothing trained yet: an error needs no save
        while step < self.config.max_steps:
            self._tell("update_begin", step + 1)
            start = time.perf_counter()
            try:
                with self.watchdog.local_work() if tracing else contextlib.nullcontext():
                    result = self.inner.run_update(self._noted(step + 1, start))
                tracing = False
            except _InputFailed as failed:
                # A malformed, corrupted or deleted file; the user's map or py_function raising.
                raise TrainingError(f"update {step + 1} failed in the input "
                                    f"pipeline: {self.describe_error(failed.error)}; the last good "
                                    f"checkpoint is {self.last_checkpoint or 'none'}") from None
            except RUN_OP_ERRORS as e:
                # A label out of range, a model's assertion.
                raise TrainingError(f"update {step + 1} failed: "
                                    f"{self.describe_error(e)}; the last good checkpoint is "
                                    f"{self.last_checkpoint or 'none'}") from None
            except UsageError as e:  # a check of the update's first trace (step/towers.py)
                raise UsageError(traced_message(e)) from None
            seconds = time.perf_counter() - start
            self.watchdog.progress()
            self.state.examples_seen.assign_add(self.global_batch)
            if not result.applied:
                stopping = self._refused(result)
                self._stop_if_asked(step)
                if stopping:
                    self._save_boundary(step)
                    self.warn("%s: stopped after update %d, saved %s", stopping, step,
                              self.last_checkpoint)
                    break
                continue
            self.skipped_in_a_row = self.empty_in_a_row = 0
            step, loss = step + 1, result.loss  # the step counted it
            if not (result.state_finite and self.inner.held_finite()):
                raise TrainingError(
                    f"update {step} had a finite loss ({loss:.4g}) and gradient but left non-finite "
                    "values in the weights or the optimizer's state (a learning rate too large, or "
                    "the optimizer overflowed); stopping without saving them; the last good "
                    f"checkpoint is {self.last_checkpoint or 'none'}")
            self._stop_if_asked(step)
            held_out = [values for values in self._tell("after_update", UpdateEvent(
                step, loss, seconds, self.state)) if values]
            for values in held_out:
                self.evaluated(step, values)
            if step % self.config.checkpoint_every == 0 or step == self.config.max_steps:
                self._save(step)
            users = [hook for hook in self.hooks if hook.user_code]
            asked = [who for who in (hook.stop_asked() for hook in users) if who]
            if users and self.any_worker(bool(asked)):
                self._save_boundary(step)
                self.log("%s set model.stop_training: stopped after update %d, saved %s",
                         asked[0] if asked else "a peer's callback", step, self.last_checkpoint)
                break
        return loss

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
        update = _value(self.state.step) + 1
        if result.decision == Decision.EMPTY:
            self.empty_in_a_row += 1
            if self.empty_in_a_row >= self.config.max_skipped:
                raise TrainingError(f"{self.empty_in_a_row} updates in a row had total weight 0, up to "
                                    f"stream position {_value(self.state.examples_seen)}: that reaches "
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


# --------------------------------------------------------------------------------------------------


def train(config: TrainConfig, spec: ModelSpec, source: Source, mode: Mode,
          watchdog: PeerClock = PeerClock(), stop: StopSignals | None = None,
          live_progress: bool = False, callbacks: Sequence[keras.callbacks.Callback] = (),
          metrics: Sequence[keras.metrics.Metric] = (), initial_step: int = 0) -> TrainResult:
    """Trains until `config.max_steps` updates, resuming from train_dir if it holds a checkpoint.

    `mode` was built first (`modes.build_mode`: a multi-worker strategy must precede other
    ops). In multi_worker mode every worker calls this; only the chief's checkpoints and
    summaries land in train_dir. When `stop` has received a signal, the run saves at the end
    of the current update and raises Stopped. `live_progress` draws a live progress line
    (a terminal) instead of log lines. `callbacks`: the user's Keras callbacks (keras_callbacks.py).
    `metrics`: Keras metrics computed at every held-out evaluation (evaluation/held_out.py).
    `initial_step`: where a run that finds no checkpoint starts, as if it had trained that many
    updates: its step count, its place in the data stream and its seeds continue from there,
    as an uninterrupted run's would (`tower_train.keras.fit`'s initial_epoch).
    """
    with run_numerics(config.deterministic, config.tf32):
        return _train(config, spec, source, mode, watchdog, stop, live_progress, callbacks,
                      metrics, initial_step)


def _train(config: TrainConfig, spec: ModelSpec, source: Source, mode: Mode, watchdog: PeerClock,
           stop: StopSignals | None, live_progress: bool,
           callbacks: Sequence[keras.callbacks.Callback],
           metrics: Sequence[keras.metrics.Metric], initial_step: int = 0) -> TrainResult:
    worker, plan = mode.worker, mode.plan
    log = _worker_logger(worker)
    global_batch = config.global_batch * worker.count
    optimizer = config.optimizer if spec.optimizer is None else type(spec.optimizer).__name__
    record = run_record.RunRecord(spec.name, config.model_module, source.name, config.seed,
                               optimizer, global_batch, config.ema_decay > 0)
    checkpoints.check_same_run(config.train_dir, record)
    with watchdog.local_work():  # building and restoring: TF's collective timeout covers their waits
        run = Run.create(spec, source, mode)
        state = run.state
        check_metrics_against(metrics, state.model, source, config.eval_batch_size)
        log("%s%s", plan.message, tf32_note(plan.tower_devices, config.tf32))
        checkpoint = state.checkpoint()
        writer = checkpoints.CheckpointWriter(checkpoint, config.train_dir, record, worker.is_chief,
                                              worker.index)
        latest = writer.restore(state.all_finite)
    if latest:
        log("resumed from %s at step %d", latest, _value(state.step))
    elif initial_step:
        state.step.assign(initial_step)
        state.examples_seen.assign(initial_step * global_batch)
    batches = call_user_code(run.batches, f"{source.name}: preprocess")
    log("%s", run.describe_layout())
    summaries = Summaries(config.train_dir if worker.is_chief else None)
    history = new_history([metric.name for metric in metrics], source.num_classes is not None)
    hooks: list[Hook] = [Progress(config=config, global_batch=global_batch,
                                  first_step=_value(state.step), summaries=summaries, log=log,
                                  live=live_progress and worker.is_chief, history=history)]
    if config.eval_every:
        hooks.append(EvaluationHook(source=source, batch_size=config.eval_batch_size,
                                    devices=plan.tower_devices, every=config.eval_every,
                                    max_steps=config.max_steps, log=log, watchdog=watchdog,
                                    metrics=metrics, sync_state=run.inner.sync_state))
    keras_callbacks = None
    if callbacks:
        network = users_network(state.model)
        # The callbacks that change the learning rate (ReduceLROnPlateau, LearningRateScheduler)
        # read model.optimizer, which only compile() sets: the run's, set untracked, so that the
        # checkpoint's object graph stays the same.
        object.__setattr__(network, "optimizer", state.optimizer)
        keras_callbacks = KerasCallbacks(callbacks=callbacks, model=network)
        hooks.append(keras_callbacks)
    controller = Controller(config=config, state=state, inner=run.inner, batches=batches,
                            writer=writer, hooks=hooks, global_batch=global_batch, log=log,
                            warn=_worker_logger(worker, logging.warning), stop=stop,
                            any_worker=mode.any_worker, watchdog=watchdog,
                            describe_error=source.describe_error)
    if stop is not None:
        stop.listen(config.stop_grace_period, config.train_dir)
    try:  # the summaries stay open for the final held-out evaluation
        try:
            loss = controller.run()
        finally:
            controller.batches = batches = None  # stops the input pipeline's work ahead
            for hook in hooks:
                hook.close()
            writer.close()
            if stop is not None:
                stop.close()

        run.inner.sync_state()  # what the evaluation, the export and the caller read
        if state.optimizer.use_ema:
            # As Keras's fit ends: the optimizer's moving average becomes the weights. The last
            # checkpoint keeps the trained ones, which a resumed run continues.
            with mode.variable_scope():
                state.optimizer.finalize_variable_values(state.model.trainable_variables)
            log("the optimizer's moving average (use_ema, ema_momentum=%s) set the weights, as "
                "Keras's fit does; the checkpoint holds the trained weights",
                state.optimizer.ema_momentum)
        # Each step of the end is timed in the log, so a pause after the last update is never
        # silent.
        with watchdog.local_work():
            started = time.perf_counter()
            evaluation = evaluate(state.model, source, config.eval_batch_size, plan.tower_devices,
                                  metrics)
            log("held-out evaluation: %d examples in %.2f s", evaluation.examples,
                time.perf_counter() - started)
            if config.export_dir and worker.is_chief:
                log("exporting a SavedModel to %s", config.export_dir)
                started = time.perf_counter()
                export_saved_model(spec, source, state.model, state.moving_average,
                                   config.export_dir)
                log("exported in %.2f s", time.perf_counter() - started)
        step = _value(state.step)
        # A callback can stop the run right after the hook evaluated.
        if evaluation.loss is not None and controller.last_evaluated != step:
            controller.evaluated(step, evaluation.scalars())
    finally:
        summaries.close()
    controller.end()
    weights_written_by = keras_callbacks.weights_written_by if keras_callbacks else None
    if weights_written_by:  # the result's evaluation is of the weights the result hands back
        with watchdog.local_work():
            evaluation = evaluate(state.model, source, config.eval_batch_size, plan.tower_devices,
                                  metrics)
        holders = [(controller.last_checkpoint if worker.is_chief else None) or "the last checkpoint"]
        holders += ["the export"] if config.export_dir and worker.is_chief else []
        log("%s set the weights: TrainResult.model and its held-out evaluation are of them, not of "
            "update %d, which %s %s", weights_written_by, step, " and ".join(holders),
            "hold" if len(holders) > 1 else "holds")
    trained = "" if loss is None else f", loss = {loss:.4f}"
    held_out = ("no held-out examples" if evaluation.loss is None
                else f"held-out {evaluation.describe()} ({evaluation.examples} examples)")
    log("done: step %d%s; %s", step, trained, held_out)
    return TrainResult(step=step, loss=loss, eval_precision=evaluation.precision,
                       eval_loss=evaluation.loss, eval_examples=evaluation.examples,
                       eval_metrics=evaluation.metrics,
                       checkpoint=controller.last_checkpoint if worker.is_chief else None,
                       model=spec.hand_back(state.model), history=history,
                       weights_written_by=weights_written_by)


def _value(variable: tf.Variable) -> int:
    return int(variable.numpy())


def _worker_logger(worker: WorkerInfo,
                   level: Callable[..., None] = logging.info) -> Callable[..., None]:
    if worker.count == 1:
        return level
    return lambda message, *args: level(f"[{worker.name}] {message}", *args)

