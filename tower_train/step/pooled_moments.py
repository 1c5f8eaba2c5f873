"""--bn_statistics=per_update: BatchNormalization's moving statistics moved once per update, as
Keras's fit moves them on one batch of G, from the update's pooled batch moments.

Each tower's pass still normalizes its own micro-batch by that micro-batch's moments; the pass
records them (`recorded_moments`). A shard whose n values per channel have mean m_i and (biased)
variance v_i adds n_i, n_i m_i and n_i (v_i + m_i^2); over the update's shards,

    mean = sum n_i m_i / sum n_i,    variance = sum n_i (v_i + m_i^2) / sum n_i - mean^2,

exactly the moments of the update's G examples taken at once, the ones Keras's fit moves the
statistics by. At an applied update each statistic is set from its value before the update
(`TrainingStatistics`' kept copy), whatever the passes moved it to meanwhile:

    moving = moving * momentum + moment * (1 - momentum).
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Sequence

import keras
import tensorflow as tf

from tower_train.errors import UsageError
from tower_train.models.base import TowerModel


def moving_layers(model: TowerModel) -> list[keras.layers.BatchNormalization]:
    """The model's BatchNormalization layers whose moving statistics a training call moves (a
    frozen layer's, or a renormalizing one's, move otherwise or not at all)."""
    return [layer for layer in model._flatten_layers()  # the model itself and every nested layer
            if isinstance(layer, keras.layers.BatchNormalization) and layer.trainable and not layer.renorm]


def moment_shapes(layers: Sequence[keras.layers.BatchNormalization]) -> list[list[int]]:
    """The shapes of `recorded_moments`' sums, in their order: n, n x mean, n x (variance +
    mean^2) of each layer."""
    return [shape for layer in layers for shape in ([], list(layer.moving_mean.shape), list(layer.moving_mean.shape))]


@contextlib.contextmanager
def recorded_moments(layers: Sequence[keras.layers.BatchNormalization]) -> Iterator[list[tf.Tensor]]:
    """Inside, each training call of `layers` records its batch moments; on exit the list holds,
    layer by layer, n, n x mean and n x (variance + mean^2) in float32 (`moment_shapes`).

    Raises:
      UsageError: a layer called more or less than once in the block.
    """
    calls: dict[int, list] = {id(layer): [] for layer in layers}
    for layer in layers:
        # An instance attribute over Keras's own method, for the block only.
        object.__setattr__(layer, "_moments", _recording(layer, layer._moments, calls[id(layer)]))
    sums: list[tf.Tensor] = []
    try:
        yield sums
    finally:
        for layer in layers:
            object.__delattr__(layer, "_moments")
    for layer in layers:
        if len(calls[id(layer)]) != 1:
            raise UsageError(f"--bn_statistics=per_update: layer {layer.name} normalizes "
                             f"{len(calls[id(layer)])} times in one training call, where it moves its "
                             "statistics once per update from its one call's moments; use "
                             "--bn_statistics=per_micro_step")
        sums.extend(calls[id(layer)][0])


def _recording(layer: keras.layers.BatchNormalization, moments: Callable, calls: list) -> Callable:
    """`moments`, Keras's `_moments` of `layer`, recording into `calls` what it returns."""
    def recording(inputs, mask):
        mean, variance = moments(inputs, mask)
        if mask is None:
            count = tf.cast(tf.size(inputs), tf.float32) / tf.cast(tf.size(mean), tf.float32)
        else:  # the values the mask keeps, per channel, as Keras's masked moments count them
            count = tf.reduce_sum(tf.cast(mask, tf.float32))
        shape = layer.moving_mean.shape
        batch_mean, batch_variance = (tf.reshape(tf.cast(m, tf.float32), shape) for m in (mean, variance))
        calls.append((count, count * batch_mean, count * (batch_variance + tf.square(batch_mean))))
        return mean, variance
    return recording


class PooledMoments:
    """Sets the statistics of `layers` at an applied update from the update's pooled moments;
    `statistics` holds them (and their values before the update) on the layout's host."""

    def __init__(self, layers: Sequence[keras.layers.BatchNormalization], statistics) -> None:
        index = {id(variable): i for i, variable in enumerate(statistics.live)}
        self._statistics = statistics
        self._targets = [(layer.momentum, index[id(layer.moving_mean.value)],
                          index[id(layer.moving_variance.value)]) for layer in layers]

    def apply(self, sums: Sequence[tf.Tensor]) -> None:
        """`sums`: `recorded_moments`' sums added up over the update's passes."""
        live, kept = self._statistics.live, self._statistics.kept
        for j, (momentum, mean_at, variance_at) in enumerate(self._targets):
            count, mean_sum, square_sum = sums[3 * j:3 * j + 3]
            mean = mean_sum / count
            variance = square_sum / count - tf.square(mean)
            for at, moment in ((mean_at, mean), (variance_at, variance)):
                value = kept[at].read_value()
                live[at].assign(value * momentum + tf.cast(moment, value.dtype) * (1.0 - momentum))
