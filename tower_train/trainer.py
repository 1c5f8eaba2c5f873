"""The outer loop: build the state, restore it, run updates, log, checkpoint, evaluate.

The inner step (what one update computes) lives in the mode modules; this
module only decides when to call it and what to record around it.
"""
from __future__ import annotations

import dataclasses
import math
import os
import shutil
import time
from typing import Callable, ContextManager

import keras
import tensorflow as tf
from absl import logging

from models import model_class
from models.base import TowerModel
from tower_train import data
from tower_train.config import TrainConfig
from tower_train.devices import DevicePlan
from tower_train.errors import TrainingError
from tower_train.cluster import SINGLE_PROCESS, WorkerInfo
from tower_train.modes import Mode, build_mode

_MOMENTUM = 0.9  # the usual value for --optimizer=momentum
_CHECKPOINTS_KEPT = 5  # enough to fall back past a bad one, small enough to ignore


@dataclasses.dataclass
class TrainState:
    """Everything a checkpoint holds: resuming needs no more than this."""

    model: TowerModel
    optimizer: keras.optimizers.Optimizer
    step: tf.Variable  # updates applied (int64)
    examples_seen: tf.Variable  # position in the example stream (int64), so resuming continues it

    def checkpoint(self) -> tf.train.Checkpoint:
        return tf.train.Checkpoint(model=self.model, optimizer=self.optimizer, step=self.step,
                                   examples_seen=self.examples_seen)


@dataclasses.dataclass(frozen=True)
class TrainResult:
    step: int
    loss: float | None  # of the last update; None when there was nothing left to train
    eval_precision: float
    eval_examples: int


def make_optimizer(config: TrainConfig) -> keras.optimizers.Optimizer:
    if config.optimizer == "adam":
        return keras.optimizers.Adam(config.learning_rate)
    return keras.optimizers.SGD(
        config.learning_rate, momentum=_MOMENTUM if config.optimizer == "momentum" else 0.0)


def build_state(config: TrainConfig, variable_scope: ContextManager) -> TrainState:
    """A fresh model, optimizer and counters, every variable created inside `variable_scope`
    (a device scope for tower mode, a strategy's scope otherwise)."""
    keras.utils.set_random_seed(config.seed)
    counter = dict(dtype=tf.int64, trainable=False,
                   aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
    with variable_scope:
        model = model_class(config.model, config.model_module)(num_classes=data.NUM_CLASSES)
        model(tf.zeros([1, data.IMAGE_SIZE, data.IMAGE_SIZE, 3]))
        optimizer = make_optimizer(config)
        optimizer.build(model.trainable_variables)
        step = tf.Variable(0, name="step", **counter)
        examples_seen = tf.Variable(0, name="examples_seen", **counter)
    return TrainState(model, optimizer, step, examples_seen)


def evaluate(model: TowerModel, source: data.ExampleSource, batch_size: int,
             device: str) -> tuple[float, int]:
    """Precision @ 1 over every held-out example exactly once, and how many there were."""
    @tf.function(reduce_retracing=True)
    def count_correct(images: tf.Tensor, labels: tf.Tensor) -> tf.Tensor:
        with tf.device(device):
            predictions = tf.argmax(model(images, training=False), axis=-1, output_type=tf.int32)
            return tf.reduce_sum(tf.cast(tf.equal(predictions, labels), tf.int64))

    correct = total = 0
    for images, labels in data.eval_batches(source, batch_size):
        correct += int(count_correct(images, labels))
        total += int(labels.shape[0])
    return correct / total, total


def describe_layout(config: TrainConfig, mode: Mode) -> str:
    plan = mode.plan
    return (f"mode={config.mode} ({mode.all_reduce} reduction), {len(plan.tower_devices)} tower(s) "
            f"on {', '.join(plan.tower_devices)}, variables on {mode.variables_on}, "
            f"batch per tower {config.batch_size}, accum {config.accum}, "
            f"global batch G = {config.global_batch * mode.worker.count}")


def train(config: TrainConfig, plan: DevicePlan, worker: WorkerInfo = SINGLE_PROCESS,
          heartbeat: Callable[[], None] = lambda: None) -> TrainResult:
    """Trains until `config.max_steps` updates, resuming from train_dir if it holds a checkpoint.

    In multi_worker mode every worker calls this; only the chief's checkpoints
    and summaries land in train_dir, the others write to a temporary
    directory inside it and remove it at the end. `heartbeat` is called after
    every phase that needs the peers (start-up, each update, each save).
    """
    mode = build_mode(config, plan, worker)  # first: a multi-worker strategy must precede other ops
    heartbeat()
    log = _worker_logger(worker)
    if config.deterministic:
        tf.config.experimental.enable_op_determinism()
    source = data.load_source(config.dataset, config.data_dir)
    state = build_state(config, mode.variable_scope())
    checkpoint = state.checkpoint()
    write_dir = config.train_dir if worker.is_chief else os.path.join(
        config.train_dir, f".worker_{worker.index}.tmp")
    manager = tf.train.CheckpointManager(checkpoint, write_dir, max_to_keep=_CHECKPOINTS_KEPT)
    latest = tf.train.latest_checkpoint(config.train_dir)
    if latest:
        checkpoint.restore(latest).assert_existing_objects_matched()
        log("resumed from %s at step %d", latest, _value(state.step))
    inner = mode.inner_step(state, config.accum)
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
    timed_updates, timed_seconds = 0, 0.0
    first_update = True  # it traces the step functions: excluded from the rate
    step = _value(state.step)
    while step < config.max_steps:
        start = time.perf_counter()
        loss = float(inner.run_update(batches))
        seconds = time.perf_counter() - start
        heartbeat()
        state.examples_seen.assign_add(global_batch)
        step = _value(state.step)
        if not math.isfinite(loss):
            raise TrainingError(f"loss is {loss} at step {step}; the last checkpoint is left as it was")
        if not first_update:
            timed_updates += 1
            timed_seconds += seconds
        first_update = False
        if step % config.log_every == 0 or step == config.max_steps:
            _log_progress(log, writer, state, step, loss, global_batch, timed_updates, timed_seconds)
            timed_updates, timed_seconds = 0, 0.0
        if step % config.checkpoint_every == 0 or step == config.max_steps:
            manager.save(checkpoint_number=step)
            heartbeat()
    writer.close()
    if not worker.is_chief:
        shutil.rmtree(write_dir, ignore_errors=True)

    precision, count = evaluate(state.model, source, config.eval_batch_size, plan.tower_devices[0])
    trained = "" if loss is None else f", loss = {loss:.4f}"
    log("done: step %d%s, held-out precision @ 1 = %.4f (%d examples)", step, trained, precision,
        count)
    return TrainResult(step, loss, precision, count)


def _value(variable: tf.Variable) -> int:
    return int(variable.numpy())


def _worker_logger(worker: WorkerInfo):
    if worker.count == 1:
        return logging.info
    return lambda message, *args: logging.info(f"[{worker.name}] {message}", *args)


def _log_progress(log, writer: tf.summary.SummaryWriter, state: TrainState, step: int, loss: float,
                  global_batch: int, timed_updates: int, timed_seconds: float) -> None:
    learning_rate = float(tf.convert_to_tensor(state.optimizer.learning_rate))
    with writer.as_default(step=step):
        tf.summary.scalar("loss", loss)
        tf.summary.scalar("learning_rate", learning_rate)
        if timed_updates:
            tf.summary.scalar("examples_per_sec", global_batch * timed_updates / timed_seconds)
    if timed_updates:
        log("step %d, loss = %.4f (%.1f examples/sec; %.3f sec/update)", step, loss,
                     global_batch * timed_updates / timed_seconds, timed_seconds / timed_updates)
    else:
        log("step %d, loss = %.4f (warm-up: tracing, not timed)", step, loss)
