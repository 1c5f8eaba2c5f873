"""Shared set-up for tests that build a trainer in this process, and for reading a child's output."""
from __future__ import annotations

import codecs
import functools
import os
import re
import selectors
import subprocess
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

from tower_train.data import source as data
from tower_train.data import catalog
from tower_train.config import TrainConfig
from tower_train.devices import canonical_device, plan_devices
from tower_train.model_spec import resolve_model
from tower_train.models import TowerModel, l2_loss
from tower_train.step.modes import build_mode
from tower_train.training.run import Run


def make_run(model=None, source: data.Source | None = None, **overrides) -> Run:
    """A run (`tower_train.training.run.Run`) of a config (any single-process mode) on this process's
    logical CPUs; `model` as `tower_train.fit` takes it (default: the config's), `source` by
    default the embedded data set."""
    config = TrainConfig(**{"train_dir": "/unused", **overrides})
    source = source or catalog.load_source("synthetic", None, config.augment)
    plan = plan_devices(config.num_gpus, config.ps_device, num_physical_gpus=0)
    return Run.create(resolve_model(model, config, None, source.num_classes), source, build_mode(config, plan))


def host_batches(run: Run):
    """`run.batches()` preprocessed on the host and not fed to the devices: global micro-batches
    of the model's input, for a test that reads or poisons the images (the run's own stream is
    raw, `data/source.RawInput`, for the towers to preprocess); `fed` gives them to the step, which
    takes either."""
    return iter(run.source.train_stream(
        seed=run.config.seed, start_position=int(run.state.examples_seen.numpy()),
        micro_batch=run.config.batch_size * len(run.mode.plan.tower_devices)))


def dataset_of(batches) -> tf.data.Dataset:
    """A finite iterable of global micro-batches, (features, labels, weights) each, as a dataset
    that yields them in order, as the training stream does."""
    return functools.reduce(tf.data.Dataset.concatenate,
                            [tf.data.Dataset.from_tensors(tuple(batch)) for batch in batches])


def fed(inner, batches, copy_ahead=None):
    """Global micro-batches on the host (a finite iterable of (features, labels, weights)) as
    `inner.run_update` takes them: through the step's own `feed`, as training's stream comes;
    `copy_ahead` as `feed` takes it (True: as on accelerators)."""
    return inner.feed(dataset_of(batches), copy_ahead)


def unit_weighted(features, labels) -> tuple:
    """A micro-batch (features, labels) with every label weighing 1, as the data sources give it."""
    return features, labels, np.ones(np.shape(labels), np.float32)


def weights(model) -> list[np.ndarray]:
    return [np.asarray(tf.convert_to_tensor(v)) for v in model.trainable_variables]


# A tiny network and weighted micro-batches for the inner steps' unit tests (test_tower_step.py,
# test_strategy_step.py), and the update they must apply, computed independently.
FEATURES, CLASSES = 4, 3
LR = 0.5
DECAY = 0.01


class TinyNet(TowerModel):
    """float32 [B, 4] -> logits [B, 3], with a regularization; `normalized` puts a BatchNorm
    (moving statistics) between its two Dense layers."""

    def __init__(self, num_classes: int = CLASSES, normalized: bool = False, **kwargs):
        super().__init__(num_classes, **kwargs)
        self.hidden = keras.layers.Dense(5, activation="tanh")
        self.norm = self.batch_norm(momentum=0.5) if normalized else None
        self.logits = keras.layers.Dense(num_classes)

    def call(self, features, training=False):
        x = self.hidden(features)
        if self.norm is not None:
            x = self.norm(x, training=training)
        return self.logits(x)

    def regularization(self):
        return DECAY * l2_loss(self.hidden.kernel)


def micro_batches(shard_sizes, accum, seed=0, zero_weights=False):
    """K global micro-batches of sum(shard_sizes) examples, with weights in [0, 2) (0 for some)."""
    rng = np.random.default_rng(seed)
    size = sum(shard_sizes)
    batches = []
    for _ in range(accum):
        x = rng.normal(size=(size, FEATURES)).astype(np.float32)
        y = rng.integers(0, CLASSES, size).astype(np.int32)
        w = np.where(rng.random(size) < 0.2, 0.0, 2 * rng.random(size)).astype(np.float32)
        batches.append((x, y, np.zeros_like(w) if zero_weights else w))
    return batches


def values(variables) -> list[np.ndarray]:
    return [np.array(tf.convert_to_tensor(v)) for v in variables]


def plain_sgd_step(model, batches):
    """The update's loss and the weights plain SGD gives, on one device over all its examples:
    sum(w * softmax cross-entropy) / sum(w) + DECAY * |hidden kernel|^2 / 2."""
    x, y, w = (tf.constant(np.concatenate(part)) for part in zip(*batches))
    with tf.device("/cpu:0"), tf.GradientTape() as tape:
        losses = tf.nn.sparse_softmax_cross_entropy_with_logits(y, model(x, training=True))
        loss = (tf.reduce_sum(w * losses) / tf.reduce_sum(w)
                + DECAY * tf.reduce_sum(tf.square(model.hidden.kernel)) / 2)
    grads = tape.gradient(loss, model.trainable_variables)
    return float(loss), [v - LR * g.numpy() for v, g in
                         zip(values(model.trainable_variables), grads, strict=True)]


def cross_tower_ops(graph, tower_devices):
    """The ops where a value computed on one tower meets values of other towers: the reductions.

    Each op's tower origins are the towers whose computation its value depends
    on, followed through every data input whatever device the ops in between
    carry; variable reads have none. An op is listed when its value depends on
    two or more towers and one of its inputs on a single tower: a tower's value
    enters it (a sum of the towers' values, or a tower's gradient scaled by the
    update's total weight).
    """
    towers = {canonical_device(d) for d in tower_devices}
    origins, merges = {}, []
    for op in graph.get_operations():  # creation order is a topological order
        inherited = [origins.get(t.op.name, frozenset()) for t in op.inputs]
        own = {canonical_device(op.device)} & towers if op.device else set()
        origins[op.name] = frozenset(own).union(*inherited)
        if len(origins[op.name]) >= 2 and any(len(o) == 1 for o in inherited):
            merges.append(op)
    return merges


def read_until(process: subprocess.Popen, text: str, timeout: float) -> str:
    """Reads the child's stderr (a pipe) until `text` appears; returns everything read so far.

    Fails the test, with the output so far and the child's exit status, if the child's
    stderr ends (it exited, or closed it) before `text`, or if `timeout` seconds pass,
    even while the child is alive but silent: the pipe is polled with a selector and
    read with os.read, never with a blocking readline. On a timeout the child is killed.
    Nothing is left in the pipe object's buffer, so `process.communicate()` reads on
    from exactly where this stopped.
    """
    fd = process.stderr.fileno()
    decoder = codecs.getincrementaldecoder(getattr(process.stderr, "encoding", None) or "utf-8")(
        errors="replace")
    seen = ""
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as selector:
        selector.register(fd, selectors.EVENT_READ)
        while text not in seen:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                process.kill()
                process.wait(timeout=60)
                pytest.fail(f"{text!r} not seen on the stderr of {process.args} within {timeout} s; "
                            f"killed it (status {process.returncode}); its stderr so far:\n{seen[-20000:]}")
            # Whether it had exited is asked before reading: then all it wrote is in the pipe already.
            exited = process.poll() is not None
            ready = selector.select(0 if exited else min(remaining, 0.5))
            chunk = os.read(fd, 1 << 16) if ready else b""
            if chunk:
                seen += decoder.decode(chunk)
            elif ready or exited:  # end of file, or it exited and nothing is left to read
                seen += decoder.decode(b"", final=True)
                if text in seen:
                    break
                try:
                    status = process.wait(timeout=10)
                except subprocess.TimeoutExpired:  # stderr closed, yet it runs on
                    process.kill()
                    status = f"{process.wait(timeout=60)} (killed: it had closed its stderr but ran on)"
                pytest.fail(f"the stderr of {process.args} ended before {text!r} appeared; exit status "
                            f"{status}; its stderr:\n{seen[-20000:]}")
    return seen


def seconds_between(log: str, first: str, second: str) -> float:
    """Seconds between the log lines holding `first` and `second` (absl's time stamps)."""
    def at(text):
        line = next(line for line in log.splitlines() if text in line)
        hours, minutes, seconds = line.split()[1].split(":")
        return int(hours) * 3600 + int(minutes) * 60 + float(seconds)
    return at(second) - at(first)


END_PAUSE_LIMIT = 10.0  # seconds from the last update to `done:`, beyond the logged evaluation and export


def end_pause_seconds(log: str, last_step: int) -> float:
    """The seconds from a run's last update line to its `done:` line that its logged held-out
    evaluation and export do not account for: the checkpoint, the pipeline's release, closing."""
    logged = sum(float(seconds) for seconds in re.findall(
        r"(?:held-out evaluation: \d+ examples in|exported in) ([\d.]+) s", log))
    return seconds_between(log, f"step {last_step}, loss", f"done: step {last_step}") - logged


