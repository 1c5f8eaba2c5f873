"""Held-out evaluation, shared by training (`--eval_every`: `EvaluationHook`, and its last
line) and `python -m tower_train.eval`.

Precision @ 1 is weighted top-1 over the labels' last axis: the sum of the
weights of the labels whose logits' argmax is right, over the sum of all
weights. For one label per example and no weights that is the fraction of
examples classified right; for a sequence model, the fraction of (real, weight
1) tokens. The held-out loss is the weighted mean of the model's per-label loss,
sum(w * per_example_loss) / sum(w), plus the model's regularization once
(`update_regularization`: regularization() and the Keras weight regularizers), plus
the mean over the held-out examples of the losses a call adds through Keras
(`add_loss`, activity regularizers), as Keras's val_loss counts both. `metrics=[...]` (of `fit` and
`evaluate_checkpoint`) adds Keras metrics. All of them count every held-out example exactly once, whatever the eval
batch size and the number of towers N:

* `Source.eval_batches` reads the examples once, in order; the last batch may be
  partial.
* Each batch of b examples is cut into N contiguous shards: shard i holds
  positions floor(i * b / N) .. floor((i + 1) * b / N) - 1. The shards cover the
  batch without overlap, and their sizes differ by at most one (a shard is empty
  when b < N).
* Shard i's outputs, weighted correct-count, weight sum and weighted loss sum are
  computed on tower device i; the N sums of each are added in float64.
* A Keras metric is one object: the shards' outputs, put back in the batch's order,
  update it once per batch with the labels and weights (`sample_weight`), so its
  state is that of one pass over the whole set, never a mean of per-tower values.
"""
from __future__ import annotations

import dataclasses
import time
import weakref
from typing import Callable, Sequence

import keras
import numpy as np
import tensorflow as tf

from tower_train.workers.peer_watchdog import PeerClock
from tower_train.data.source import RUN_OP_ERRORS, Source, describe_nest, rows
from tower_train.errors import TrainingError, UsageError
from tower_train.training.hooks import Hook, UpdateEvent
from tower_train.user_code import call_user_code

# The names the held-out quantities already have in TrainResult.history (val_<name>).
_REPORTED = ("step", "precision", "loss")


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """One held-out evaluation. precision, loss and metrics are None / empty when no held-out
    label has any weight; precision is None for targets (no classes: data/source.py)."""

    examples: int  # held-out examples counted
    precision: float | None  # weighted precision @ 1
    # The weighted mean per-label loss, the regularization once, the batch losses' mean.
    loss: float | None
    metrics: dict[str, float]  # each Keras metric's name -> its result

    def describe(self) -> str:
        """"precision @ 1 = P, loss = L[, <metric> = V ...]", as the log lines give it."""
        values = {"precision @ 1": self.precision, "loss": self.loss, **self.metrics}
        return ", ".join(f"{name} = {value:.4f}" for name, value in values.items()
                         if value is not None)

    def scalars(self) -> dict[str, float]:
        """Its quantities by TensorBoard tag: val_<name>, as in TrainResult.history and the
        callbacks' logs (Keras's names)."""
        values = {"val_precision": self.precision, "val_loss": self.loss,
                  **{f"val_{name}": value for name, value in self.metrics.items()}}
        return {tag: value for tag, value in values.items() if value is not None}


def check_metrics(metrics: object) -> list[str | keras.metrics.Metric]:
    """`fit`'s `metrics=` (given, not None), checked: each a name `keras.metrics.get` knows or a
    `keras.metrics.Metric` object. Names stay names, made into metrics by `make_metrics` once the
    devices are split.

    Raises:
      UsageError: no list or tuple, an unknown name, something that is no metric, or a metric
        whose name another held-out quantity already has.
    """
    if not isinstance(metrics, (list, tuple)):
        raise UsageError(f"metrics={type(metrics).__name__}: expected a list of Keras metric names "
                         "or keras.metrics.Metric objects")
    names = []
    for index, metric in enumerate(metrics):
        if isinstance(metric, str):
            if metric in ("accuracy", "acc"):
                raise UsageError(f"metrics[{index}]={metric!r}: Keras's Accuracy compares the "
                                 "outputs with the labels exactly, which logits never equal; name "
                                 "'sparse_categorical_accuracy' (precision @ 1 is reported anyway)")
            # Made in a graph of its own and dropped: a metric made eagerly creates variables,
            # which would start TensorFlow's runtime before fit splits the devices.
            with tf.Graph().as_default():
                try:
                    metric = keras.metrics.get(metric)
                except ValueError:
                    raise UsageError(f"metrics[{index}]={metric!r}: not a Keras metric name "
                                     "(keras.metrics), such as 'sparse_top_k_categorical_accuracy'"
                                     ) from None
        if not isinstance(metric, keras.metrics.Metric):
            instantiate = (f" (a class must be instantiated: {metric.__name__}())"
                           if isinstance(metric, type) else "")
            raise UsageError(f"metrics[{index}]={metric!r}: not a Keras metric name or "
                             f"keras.metrics.Metric object{instantiate}")
        names.append(metric.name)
    for index, name in enumerate(names):
        if name in _REPORTED or name in names[:index]:
            raise UsageError(f"metrics[{index}]: its name {name!r} is taken (by "
                             f"{'the held-out ' + name if name in _REPORTED else 'another metric'}"
                             f"); give it another: name=...")
    return list(metrics)


def make_metrics(metrics: Sequence[str | keras.metrics.Metric]) -> list[keras.metrics.Metric]:
    """`check_metrics`'s list as metric objects: a name made by `keras.metrics.get`, an object
    used as it is (its state reset before each evaluation, so afterwards it holds the last
    one's). Call once the devices are split (a multi-worker strategy made first)."""
    return [keras.metrics.get(metric) if isinstance(metric, str) else metric for metric in metrics]


def check_metrics_against(metrics: Sequence[keras.metrics.Metric], model, source: Source,
                          batch_size: int) -> None:
    """Updates each metric once with the model's outputs on the first held-out batch of
    `batch_size` and its labels and weights, as evaluation will, so that a metric that cannot
    take them fails before training; then resets it. A real batch, not one example: on one,
    broadcasting lets a metric take [1] labels beside [1, C] outputs that it refuses for [B].
    Without held-out examples (nothing to evaluate), one example of the training data's shape.

    Raises:
      UsageError: a metric's update fails (one line naming it and the shapes), or its result is
        not one number (it could not be logged).
    """
    if not metrics:
        return
    batch = next(iter(source.eval_batches(batch_size)), None)
    if batch is None:
        features = call_user_code(source.example_input, f"{source.name}: preprocess")
        labels = source.example_labels()
        weights = tf.ones([1, *source.weight_shape], tf.float32)
    else:
        features, labels, weights = batch
    outputs = tf.cast(model(features, training=False), tf.float32)
    for metric in metrics:
        result = update_metric(metric, labels, outputs, weights, lambda: metric.result())
        metric.reset_state()
        if tf.convert_to_tensor(result).shape.rank != 0:
            raise UsageError(f"{_metric_call(metric, labels, outputs)}: its result has shape "
                             f"{tf.convert_to_tensor(result).shape.as_list()}, not one number to "
                             "log (for F1Score and the like: average='macro' or 'micro')")


def _metric_call(metric: keras.metrics.Metric, labels: tf.Tensor, outputs: tf.Tensor) -> str:
    return (f"metrics: {metric.name}, on outputs {outputs.dtype.name} {outputs.shape.as_list()} and "
            f"labels {describe_nest(labels)}")


def update_metric(metric: keras.metrics.Metric, labels: tf.Tensor, outputs: tf.Tensor,
                  weights: tf.Tensor, then: Callable[[], object] = lambda: None) -> object:
    """`metric.update_state` on a batch, then `then()`: an error in either is one line naming the
    metric and the shapes (`user_code.call_user_code`)."""
    return call_user_code(lambda: (metric.update_state(labels, outputs, sample_weight=weights), then())[1],
                          _metric_call(metric, labels, outputs))


def shard_bounds(batch: int, num_shards: int) -> list[tuple[int, int]]:
    """[start, end) of each of `num_shards` contiguous shards of a batch of `batch` examples.

    The same arithmetic `shard_pass` runs in the graph; sizes differ by at most one.
    """
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    cuts = [i * batch // num_shards for i in range(num_shards + 1)]
    return list(zip(cuts[:-1], cuts[1:]))


def shard_pass(model, devices: Sequence[str], keep_outputs: bool = False,
               classes: bool = True) -> Callable:
    """A compiled (features, labels, weights) -> float64 [4]: the weight of the correct top-1
    predictions, the weight of all labels, the sum of weight x per-label loss and the sum over
    examples of the losses the call added through Keras (each a mean over its shard); with
    `keep_outputs`, also each shard's outputs (float32; an empty shard's is [0]). Without
    `classes` (targets) no prediction is counted correct.

    features [b, ...] as the model takes them, labels int [b, ...] (or targets), weights float32
    of the labels' shape (the loss's, for targets), any b >= 0. The batch is split into
    len(devices) shards (`shard_bounds`); shard i's outputs and sums are computed on devices[i].
    """
    devices = tuple(devices)
    if not devices:
        raise ValueError("evaluation needs at least one device")

    # autograph=False: the loop over devices is unrolled at trace time, there is no
    # tensor-dependent Python control flow to convert.
    @tf.function(reduce_retracing=True, autograph=False)
    def run_shards(features: tf.Tensor, labels: tf.Tensor, weights: tf.Tensor):
        batch = tf.shape(weights, out_type=tf.int64)[0]
        sums, outputs = [], []
        for i, device in enumerate(devices):
            start = i * batch // len(devices)
            end = (i + 1) * batch // len(devices)
            # Sliced where the batch is (the host), so each tower receives only its shard.
            shard = (rows(features, slice(start, end)), rows(labels, slice(start, end)),
                     weights[start:end])
            with tf.device(device):
                # An empty shard is not run: some kernels (oneDNN convolutions) refuse a 0-example
                # batch. Its outputs' shape is unknown without running the model, hence [0].
                shard_sums, shard_outputs = tf.cond(
                    end > start,
                    lambda shard=shard, d=device: _run_on(model, *shard, d, classes),
                    lambda: (tf.zeros([4], tf.float64), tf.zeros([0], tf.float32)))
            sums.append(shard_sums)
            outputs.append(shard_outputs)
        return (tf.add_n(sums), tuple(outputs)) if keep_outputs else tf.add_n(sums)

    return run_shards


# Per model: its shard passes by (devices, keep_outputs, classes), so that a run's evaluations after its
# first reuse the traced pass (tracing and a GPU's first convolutions take seconds).
_PASSES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _traced_pass(model, devices: tuple[str, ...], keep_outputs: bool, classes: bool) -> Callable:
    passes = _PASSES.setdefault(model, {})
    if (devices, keep_outputs, classes) not in passes:
        passes[devices, keep_outputs, classes] = shard_pass(model, devices, keep_outputs=keep_outputs, classes=classes)
    return passes[devices, keep_outputs, classes]


def _run_on(model, features: tf.Tensor, labels: tf.Tensor, weights: tf.Tensor,
            device: str, classes: bool) -> tuple[tf.Tensor, tf.Tensor]:
    with tf.device(device):  # again inside the branch: its ops live in their own function graph
        outputs = model(features, training=False)
        losses = tf.cast(model.per_example_loss(labels, outputs), tf.float64)
        weights = tf.cast(weights, tf.float64)
        correct = tf.constant(0.0, tf.float64)
        if classes:
            predictions = tf.argmax(outputs, axis=-1, output_type=labels.dtype)
            correct = tf.reduce_sum(tf.where(tf.equal(predictions, labels), weights,
                                             tf.zeros_like(weights)))
        # Each a mean over the shard's examples: times their number, a sum over them.
        batch_losses = tf.cast(model.batch_loss(), tf.float64) * tf.cast(tf.shape(weights)[0], tf.float64)
        sums = tf.stack([correct, tf.reduce_sum(weights), tf.reduce_sum(weights * losses), batch_losses])
        return sums, tf.cast(outputs, tf.float32)


def evaluate(model, source: Source, batch_size: int, devices: Sequence[str],
             metrics: Sequence[keras.metrics.Metric] = ()) -> Evaluation:
    """Precision @ 1, the held-out loss and `metrics` over every held-out example of `source`
    exactly once (`model`: a TowerModel).

    Each batch of `batch_size` (the last one may be smaller) is spread over the
    tower `devices`, one shard each; see the module docstring. Raises TrainingError, one line,
    when the held-out data fails to be read (a corrupted or deleted file, a label out of range).
    """
    classes = source.num_classes is not None
    run_shards = _traced_pass(model, tuple(devices), bool(metrics), classes)
    for metric in metrics:
        metric.reset_state()
    totals = np.zeros(4)  # float64: correct weight, weight, weighted loss, batch losses
    examples = 0
    try:
        for features, labels, weights in source.eval_batches(batch_size):
            if metrics:
                sums, outputs = run_shards(features, labels, weights)
                batch = int(weights.shape[0])
                # The shards back in the batch's order; an empty one's [0] placeholder left out.
                outputs = tf.concat([shard for shard, (start, end)
                                     in zip(outputs, shard_bounds(batch, len(devices)))
                                     if end > start], axis=0)
                for metric in metrics:
                    update_metric(metric, labels, outputs, weights)
            else:
                sums = run_shards(features, labels, weights)
            totals += sums.numpy()
            examples += int(weights.shape[0])
    except RUN_OP_ERRORS as e:
        raise TrainingError(f"held-out evaluation failed after {examples} examples: "
                            f"{source.describe_error(e)}") from None
    correct, weight, weighted_loss, batch_losses = totals
    if weight <= 0:
        return Evaluation(examples, None, None, {})
    regularization = float(model.update_regularization())
    loss = weighted_loss / weight + regularization + batch_losses / examples
    return Evaluation(examples, float(correct / weight) if classes else None, float(loss),
                      {metric.name: float(metric.result()) for metric in metrics})


class EvaluationHook(Hook):
    """A Controller hook (hooks.py): held-out precision, loss and metrics every `every` updates
    (not at the last: training evaluates then), whose values it hands the hooks after it."""

    def __init__(self, *, source: Source, batch_size: int, devices: Sequence[str], every: int,
                 max_steps: int, log: Callable[..., None], watchdog: PeerClock,
                 metrics: Sequence[keras.metrics.Metric] = (),
                 sync_state: Callable[[], None] = lambda: None):
        """`sync_state`: makes the state's variables current before an evaluation reads them
        (`InnerStep.sync_state`)."""
        self.source, self.batch_size, self.devices = source, batch_size, devices
        self.sync_state = sync_state
        self.every, self.max_steps, self.log = every, max_steps, log
        self.watchdog = watchdog  # an evaluation is local work: no peer wait to time
        self.metrics = metrics

    def reads_state(self, step: int) -> bool:
        return self._evaluates_after(step)

    def _evaluates_after(self, step: int) -> bool:
        return step % self.every == 0 and step != self.max_steps  # training evaluates at the last

    def after_update(self, event: UpdateEvent) -> dict[str, float] | None:
        if not self._evaluates_after(event.step):
            return None
        started = time.perf_counter()
        self.sync_state()
        with self.watchdog.local_work():
            evaluation = evaluate(event.state.model, self.source, self.batch_size, self.devices,
                                  self.metrics)
        if evaluation.loss is None:
            return None
        self.log("step %d, held-out %s (%d examples, %.2f s)", event.step, evaluation.describe(),
                 evaluation.examples, time.perf_counter() - started)
        return evaluation.scalars()
