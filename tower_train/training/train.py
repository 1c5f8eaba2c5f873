"""Training, put together: `train` builds the run (`run.Run`: the state in the mode's scope, its
inner step and stream), restores the checkpoints, makes the hooks and the Controller
(controller.py), runs it, then evaluates and exports; `TrainResult` is what it returns. Nothing
here prints or exits: errors are raised, progress goes to the log and the hooks.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

import keras
from absl import logging

from tower_train.config import TrainConfig
from tower_train.data.source import Source
from tower_train.export import export_saved_model
from tower_train.model_spec import ModelSpec, users_network
from tower_train.numerics import run_numerics, tf32_note
from tower_train.step.modes import Mode
from tower_train.training import checkpoints, run_record
from tower_train.training.controller import Controller
from tower_train.training.evaluation.held_out import EvaluationHook, check_metrics_against, evaluate
from tower_train.training.hooks import Hook
from tower_train.training.keras_callbacks import KerasCallbacks
from tower_train.training.progress import Progress, Summaries, new_history
from tower_train.training.run import Run
from tower_train.training.stop_signals import StopSignals
from tower_train.user_code import call_user_code
from tower_train.workers.cluster import WorkerInfo
from tower_train.workers.peer_watchdog import PeerClock


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
        log("resumed from %s at step %d", latest, int(state.step.numpy()))
    elif initial_step:
        state.step.assign(initial_step)
        state.examples_seen.assign(initial_step * global_batch)
    batches = call_user_code(run.batches, f"{source.name}: preprocess")
    log("%s", run.describe_layout())
    summaries = Summaries(config.train_dir if worker.is_chief else None)
    history = new_history([metric.name for metric in metrics], source.num_classes is not None)
    hooks: list[Hook] = [Progress(config=config, global_batch=global_batch,
                                  first_step=int(state.step.numpy()), summaries=summaries, log=log,
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
                            any_worker=mode.any_worker, one_process=mode.worker.count == 1,
                            watchdog=watchdog,
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
        step = int(state.step.numpy())
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


def _worker_logger(worker: WorkerInfo,
                   level: Callable[..., None] = logging.info) -> Callable[..., None]:
    if worker.count == 1:
        return level
    return lambda message, *args: level(f"[{worker.name}] {message}", *args)

