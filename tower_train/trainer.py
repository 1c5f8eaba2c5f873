"""The outer loop: build the state, restore it, run updates, log, checkpoint, evaluate.

The inner step (what one update computes) lives in the mode modules; this
module only decides when to call it and what to record around it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import signal
import shutil
import time
from typing import Callable, ContextManager, Iterator

import keras
import tensorflow as tf
from absl import logging

from models import model_class
from models.base import TowerModel
from tower_train import data
from tower_train.config import RUN_FILE, TrainConfig
from tower_train.devices import DevicePlan
from tower_train.errors import Stopped, TrainingError, UsageError
from tower_train.evaluation import evaluate
from tower_train.export import export_saved_model
from tower_train.cluster import SINGLE_PROCESS, WorkerInfo
from tower_train.modes import Mode, build_mode
from tower_train.schedules import MovingAverage, UpdateSchedule, scaled_rate, updates_per_decay
from tower_train.stop_signals import StopSignals
from tower_train.update_rule import LossScale, UpdateRule

_MOMENTUM = 0.9  # the usual value for --optimizer=momentum
_CHECKPOINTS_KEPT = 5  # enough to fall back past a bad one, small enough to ignore
# Keras's mixed-precision policies: the towers compute in the first dtype, variables stay float32.
_DTYPE_POLICIES = {"fp32": "float32", "bf16": "mixed_bfloat16", "fp16": "mixed_float16"}


@dataclasses.dataclass
class TrainState:
    """Everything a checkpoint holds: resuming needs no more than this."""

    model: TowerModel
    optimizer: keras.optimizers.Optimizer
    step: tf.Variable  # updates applied (int64)
    examples_seen: tf.Variable  # position in the example stream (int64), so resuming continues it
    moving_average: MovingAverage | None  # of the trainable weights; None with --ema_decay=0
    loss_scale: LossScale | None = None  # only with --precision=fp16

    def checkpoint(self) -> tf.train.Checkpoint:
        optional = {"moving_average": self.moving_average, "loss_scale": self.loss_scale}
        kept = {name: value for name, value in optional.items() if value is not None}
        return tf.train.Checkpoint(model=self.model, optimizer=self.optimizer, step=self.step,
                                   examples_seen=self.examples_seen, **kept)

    def update_rule(self, clip_norm: float | None) -> UpdateRule:
        return UpdateRule(self.model, self.optimizer, self.step, clip_norm, self.moving_average,
                          self.loss_scale)


@dataclasses.dataclass(frozen=True)
class TrainResult:
    step: int
    loss: float | None  # of the last update; None when there was nothing left to train
    eval_precision: float
    eval_examples: int


def make_optimizer(config: TrainConfig, global_batch: int, train_examples: int) -> keras.optimizers.Optimizer:
    """The optimizer, its rate a schedule of the update index (`optimizer.iterations`).

    `global_batch` is G over all workers: it scales the rate (--scale_lr) and counts epochs.
    """
    rate = UpdateSchedule(
        scaled_rate(config.learning_rate, global_batch, config.scale_lr), config.lr_schedule,
        config.warmup_steps, updates_per_decay(train_examples, global_batch), config.max_steps)
    if config.optimizer == "adam":
        return keras.optimizers.Adam(rate)
    return keras.optimizers.SGD(rate, momentum=_MOMENTUM if config.optimizer == "momentum" else 0.0)


def build_state(config: TrainConfig, variable_scope: ContextManager, train_examples: int,
                workers: int = 1) -> TrainState:
    """A fresh model, optimizer, counters and moving average, every variable created inside
    `variable_scope` (a device scope for tower mode, a strategy's scope otherwise).

    `train_examples` and `workers` set the schedule: an epoch is train_examples, and an
    update consumes G = config.global_batch x workers of them.
    """
    keras.utils.set_random_seed(config.seed)
    counter = dict(dtype=tf.int64, trainable=False,
                   aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
    with variable_scope:
        model = _build_model(config)
        optimizer = make_optimizer(config, config.global_batch * workers, train_examples)
        optimizer.build(model.trainable_variables)
        step = tf.Variable(0, name="step", **counter)
        examples_seen = tf.Variable(0, name="examples_seen", **counter)
        moving_average = (MovingAverage(model.trainable_variables, config.ema_decay)
                          if config.ema_decay else None)
        loss_scale = LossScale() if config.precision == "fp16" else None
    return TrainState(model, optimizer, step, examples_seen, moving_average, loss_scale)


@contextlib.contextmanager
def _dtype_policy(precision: str) -> Iterator[None]:
    """Keras reads the policy when a layer is made, so it is set only while the model is built."""
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(_DTYPE_POLICIES[precision])
    try:
        yield
    finally:
        keras.config.set_dtype_policy(previous)


def _build_model(config: TrainConfig) -> TowerModel:
    with _dtype_policy(config.precision):
        return _build_model_in_policy(config)


def _build_model_in_policy(config: TrainConfig) -> TowerModel:
    cls = model_class(config.model, config.model_module)
    # A flag's TowerModel kwarg is passed only when set, so that a model whose __init__ takes
    # num_classes alone still trains without it.
    asked = {flag: kwarg for flag, kwarg, on in (("--sync_bn", "sync_batch_norm", config.sync_bn),
                                                ("--recompute", "recompute", config.recompute)) if on}
    try:
        model = cls(num_classes=data.NUM_CLASSES, **{kwarg: True for kwarg in asked.values()})
    except TypeError as e:  # its __init__ does not pass **kwargs on to TowerModel
        if not asked:
            raise
        raise UsageError(f"{' '.join(asked)}: --model={config.model} does not accept "
                         f"{', '.join(asked.values())} "
                         f"({str(e).splitlines()[0] if str(e) else 'TypeError'})") from None
    model(tf.zeros([1, data.IMAGE_SIZE, data.IMAGE_SIZE, 3]))
    if config.recompute and not model.runs_blocks:
        raise UsageError(f"--recompute: --model={config.model} runs no block through "
                         "self.run_block, so there is nothing to recompute (see README, \"Adding a model\")")
    if config.sync_bn and not any(isinstance(layer, keras.layers.BatchNormalization)
                                  for layer in model._flatten_layers()):  # every nested layer
        raise UsageError(f"--sync_bn: --model={config.model} has no BatchNormalization layer")
    if config.mode == "central_storage" and model.non_trainable_variables:
        raise UsageError(f"--mode=central_storage: --model={config.model} has moving statistics "
                         "(BatchNormalization), which CentralStorageStrategy cannot update from its "
                         "replicas; use --mode=tower or mirrored")
    return model


def describe_layout(config: TrainConfig, mode: Mode) -> str:
    plan = mode.plan
    return (f"mode={config.mode} ({mode.all_reduce} reduction), {len(plan.tower_devices)} tower(s) "
            f"on {', '.join(plan.tower_devices)}, variables on {mode.variables_on}, "
            f"batch per tower {config.batch_size}, accum {config.accum}, "
            f"global batch G = {config.global_batch * mode.worker.count}")


def train(config: TrainConfig, plan: DevicePlan, worker: WorkerInfo = SINGLE_PROCESS,
          heartbeat: Callable[[], None] = lambda: None,
          stop: StopSignals | None = None) -> TrainResult:
    """Trains until `config.max_steps` updates, resuming from train_dir if it holds a checkpoint.

    In multi_worker mode every worker calls this; only the chief's checkpoints
    and summaries land in train_dir, the others write to a temporary
    directory inside it and remove it at the end. `heartbeat` is called after
    every phase that needs the peers (start-up, each update, each save).
    When `stop` has received a signal, the run saves at the end of the current
    update and raises Stopped.
    """
    mode = build_mode(config, plan, worker)  # first: a multi-worker strategy must precede other ops
    heartbeat()
    if stop is not None:
        stop.listen()
    log = _worker_logger(worker)
    if config.deterministic:
        tf.config.experimental.enable_op_determinism()
    source = data.load_source(config.dataset, config.data_dir)
    run_record = _check_same_run(config, worker)
    state = build_state(config, mode.variable_scope(), len(source.train_labels), worker.count)
    log("%s", plan.message)
    checkpoint = state.checkpoint()
    write_dir = config.train_dir if worker.is_chief else os.path.join(
        config.train_dir, f".worker_{worker.index}.tmp")
    manager = tf.train.CheckpointManager(checkpoint, write_dir, max_to_keep=_CHECKPOINTS_KEPT)
    latest = _restore_latest_readable(checkpoint, config.train_dir, log)
    if latest:
        log("resumed from %s at step %d", latest, _value(state.step))
    inner = mode.inner_step(state, config.accum, config.clip_norm, config.jit_compile)
    batches = iter(data.train_stream(
        source, seed=config.seed, start_position=_value(state.examples_seen),
        micro_batch=config.batch_size * len(plan.tower_devices), augment=config.augment,
        shard_index=worker.index, num_shards=worker.count))
    log("%s", describe_layout(config, mode))
    writer = (tf.summary.create_file_writer(config.train_dir) if worker.is_chief
              else tf.summary.create_noop_writer())
    global_batch = config.global_batch * worker.count

    if _value(state.step) >= config.max_steps:
        log("step %d already reaches --max_steps=%d: nothing to train",
            _value(state.step), config.max_steps)
    loss = None
    skipped = skipped_in_a_row = 0  # updates not applied for a non-finite value
    timed_updates, timed_seconds = 0, 0.0
    first_update = True  # it traces the step functions: excluded from the rate
    step = _value(state.step)
    try:
        while step < config.max_steps:
            start = time.perf_counter()
            loss, applied = inner.run_update(batches)
            loss = float(loss)
            seconds = time.perf_counter() - start
            heartbeat()
            state.examples_seen.assign_add(global_batch)
            if not applied and _is_overflow(state.loss_scale, loss):
                _overflow(log, writer, _value(state.step) + 1, state.loss_scale)
                continue
            if not applied:
                skipped_in_a_row += 1
                skipped += 1
                _nonfinite(config, log, writer, _value(state.step) + 1, loss, skipped_in_a_row, skipped,
                           tf.train.latest_checkpoint(config.train_dir))
                continue
            skipped_in_a_row = 0
            step = _value(state.step)
            signal_number = stop.received() if stop is not None else None
            if mode.any_worker(signal_number is not None):
                _save(manager, step, worker, config.train_dir, run_record)
                heartbeat()
                name = signal.Signals(signal_number).name if signal_number else "a peer's signal"
                saved = os.path.join(config.train_dir, f"ckpt-{step}")
                raise Stopped(f"stopped by {name} after update {step}; saved {saved}; "
                              "run the same command to resume", signal_number or signal.SIGTERM)
            if not first_update:
                timed_updates += 1
                timed_seconds += seconds
            first_update = False
            if step % config.log_every == 0 or step == config.max_steps:
                _log_progress(log, writer, state, step, loss, global_batch, timed_updates, timed_seconds)
                timed_updates, timed_seconds = 0, 0.0
            if step % config.checkpoint_every == 0 or step == config.max_steps:
                _save(manager, step, worker, config.train_dir, run_record)
                heartbeat()
            if config.eval_every and step % config.eval_every == 0 and step != config.max_steps:
                precision, count = evaluate(state.model, source, config.eval_batch_size,
                                            plan.tower_devices)
                with writer.as_default(step=step):
                    tf.summary.scalar("eval_precision", precision)
                log("step %d, held-out precision @ 1 = %.4f (%d examples)", step, precision, count)
    finally:
        writer.close()
        if not worker.is_chief:
            shutil.rmtree(write_dir, ignore_errors=True)

    precision, count = evaluate(state.model, source, config.eval_batch_size, plan.tower_devices)
    if config.export_dir and worker.is_chief:
        log("exporting a SavedModel to %s", config.export_dir)
        export_saved_model(state.model, state.moving_average, config.export_dir)
    trained = "" if loss is None else f", loss = {loss:.4f}"
    log("done: step %d%s, held-out precision @ 1 = %.4f (%d examples)", step, trained, precision,
        count)
    return TrainResult(step, loss, precision, count)


def _run_record(config: TrainConfig, worker: WorkerInfo) -> dict:
    """What must not change for a checkpoint to be resumed: the model, the data, the order of
    the examples, the optimizer's slots, whether it keeps a moving average, and G (any
    factoring of G is fine: that is the promise)."""
    return {"model": config.model, "dataset": config.dataset, "seed": config.seed,
            "optimizer": config.optimizer, "global_batch": config.global_batch * worker.count,
            "moving_average": config.ema_decay > 0}


def _check_same_run(config: TrainConfig, worker: WorkerInfo) -> dict:
    """Refuses to resume a train_dir written by a different model or layout; returns this run's record."""
    record = _run_record(config, worker)
    path = os.path.join(config.train_dir, RUN_FILE)
    if not os.path.exists(path):
        return record
    try:
        with open(path) as f:
            saved = json.load(f)
    except (OSError, ValueError) as e:
        raise UsageError(f"--train_dir={config.train_dir}: {RUN_FILE} is unreadable ({e})") from None
    differ = [f"{key} {saved.get(key)!r} there, {value!r} here" for key, value in record.items()
              if saved.get(key) != value]
    if differ:
        raise UsageError(f"--train_dir={config.train_dir} holds another run: " + "; ".join(differ)
                         + " (global_batch = batch_size x towers x workers x accum); "
                         "use the same values to resume, or a new --train_dir")
    return record


def _restore_latest_readable(checkpoint: tf.train.Checkpoint, train_dir: str, log) -> str | None:
    """Restores the newest checkpoint that reads back whole; says so when it skips a bad one."""
    state = tf.train.get_checkpoint_state(train_dir)
    paths = list(reversed(state.all_model_checkpoint_paths)) if state else []
    failures = []
    for path in paths:
        try:
            checkpoint.restore(path).assert_existing_objects_matched()
            if failures:
                logging.warning("%s; resuming from the older %s", "; ".join(failures), path)
            return path
        # TF's reader fails on a damaged file in all of these ways, depending on where it is cut.
        except (tf.errors.OpError, AssertionError, ValueError, IndexError, KeyError) as e:
            failures.append(f"checkpoint {path} is unreadable ({str(e).splitlines()[0][:160]})")
    if failures:
        raise UsageError(f"--train_dir={train_dir}: no readable checkpoint: {failures[0]}")
    return None


def _save(manager: tf.train.CheckpointManager, step: int, worker: WorkerInfo, train_dir: str,
          run_record: dict) -> None:
    manager.save(checkpoint_number=step)
    path = os.path.join(train_dir, RUN_FILE)
    if worker.is_chief and not os.path.exists(path):
        with open(path, "w") as f:
            json.dump(run_record, f, indent=1)


def _nonfinite(config: TrainConfig, log, writer: tf.summary.SummaryWriter, update: int, loss: float,
               in_a_row: int, in_all: int, last_good: str | None) -> None:
    """Applies --nonfinite to an update that was not applied; raises TrainingError to stop."""
    what = f"update {update} has a non-finite loss or gradient (loss = {loss}) and was not applied"
    if config.nonfinite == "stop":
        raise TrainingError(f"{what}; stopping (--nonfinite=stop); the last good checkpoint is "
                            f"{last_good or 'none: no checkpoint was written yet'}")
    with writer.as_default(step=update):
        tf.summary.scalar("skipped_updates", in_all)
    if in_a_row >= config.max_skipped:
        raise TrainingError(f"{what}; {in_a_row} updates in a row skipped reaches --max_skipped="
                            f"{config.max_skipped}; the last good checkpoint is {last_good or 'none'}")
    log("%s; skipped (%d in a row, %d in all)", what, in_a_row, in_all)


def _is_overflow(loss_scale: LossScale | None, loss: float) -> bool:
    """Whether a refused update was a float16 gradient overflow, which the loss scale handles,
    rather than a non-finite update for --nonfinite: the loss is finite and the halved scale
    is still >= 1. Below 1 the scale no longer guards float16's range, so the gradient itself
    is non-finite, and halving on forever would never stop the run."""
    return loss_scale is not None and math.isfinite(loss) and float(loss_scale.value.numpy()) >= 1.0


def _overflow(log, writer: tf.summary.SummaryWriter, update: int, loss_scale: LossScale) -> None:
    """A float16 gradient overflow: the update was skipped and the scale halved, as designed;
    it does not count against --nonfinite."""
    scale = float(loss_scale.value.numpy())
    with writer.as_default(step=update):
        tf.summary.scalar("loss_scale", scale)
    log("update %d: float16 gradient overflow; update skipped, loss scale lowered to %g", update, scale)


def _value(variable: tf.Variable) -> int:
    return int(variable.numpy())


def _worker_logger(worker: WorkerInfo):
    if worker.count == 1:
        return logging.info
    return lambda message, *args: logging.info(f"[{worker.name}] {message}", *args)


def _log_progress(log, writer: tf.summary.SummaryWriter, state: TrainState, step: int, loss: float,
                  global_batch: int, timed_updates: int, timed_seconds: float) -> None:
    learning_rate = float(tf.convert_to_tensor(state.optimizer.learning_rate))
    scale = "" if state.loss_scale is None else f", loss scale {state.loss_scale.value.numpy():g}"
    with writer.as_default(step=step):
        tf.summary.scalar("loss", loss)
        tf.summary.scalar("learning_rate", learning_rate)
        if state.loss_scale is not None:
            tf.summary.scalar("loss_scale", state.loss_scale.value)
        if timed_updates:
            tf.summary.scalar("examples_per_sec", global_batch * timed_updates / timed_seconds)
    if timed_updates:
        log("step %d, loss = %.4f%s (%.1f examples/sec; %.3f sec/update)", step, loss, scale,
            global_batch * timed_updates / timed_seconds, timed_seconds / timed_updates)
    else:
        log("step %d, loss = %.4f%s (warm-up: tracing, not timed)", step, loss, scale)
