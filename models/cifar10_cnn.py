"""The original TF tutorial's CIFAR-10 network (cifar10.py `inference`).

conv1 5x5x64 -> max-pool 3/2 -> LRN -> conv2 5x5x64 -> LRN -> max-pool 3/2
-> local3 384 -> local4 192 -> linear logits. About 1.07 M parameters.
Weight decay 0.004 x l2_loss on local3 and local4 only, as in the original.
"""
from __future__ import annotations

import keras
import tensorflow as tf

from tower_train.models.base import TowerModel, l2_loss
from tower_train.models.registry import register

_WEIGHT_DECAY = 0.004  # the original's wd for local3 and local4


def _dense(units: int, stddev: float, bias: float, activation: str | None) -> keras.layers.Dense:
    return keras.layers.Dense(
        units, activation=activation,
        kernel_initializer=keras.initializers.TruncatedNormal(stddev=stddev),
        bias_initializer=keras.initializers.Constant(bias))


def _conv(bias: float) -> keras.layers.Conv2D:
    return keras.layers.Conv2D(
        64, 5, padding="same", activation="relu",
        kernel_initializer=keras.initializers.TruncatedNormal(stddev=5e-2),
        bias_initializer=keras.initializers.Constant(bias))


def _lrn(x: tf.Tensor) -> tf.Tensor:
    # In float32 whatever the compute dtype: a normalization, and TF has no bfloat16 LRN kernel
    # on the CPU nor a float16 one on the GPU.
    normalized = tf.nn.local_response_normalization(
        tf.cast(x, tf.float32), depth_radius=4, bias=1.0, alpha=0.001 / 9.0, beta=0.75)
    return tf.cast(normalized, x.dtype)


@register("cifar10_cnn")
class Cifar10CNN(TowerModel):
    """The original tutorial's network, for 24x24x3 inputs."""

    def __init__(self, num_classes: int, **kwargs):
        super().__init__(num_classes, **kwargs)
        self.conv1 = _conv(bias=0.0)
        self.conv2 = _conv(bias=0.1)
        self.pool = keras.layers.MaxPooling2D(pool_size=3, strides=2, padding="same")
        self.flatten = keras.layers.Flatten()
        self.local3 = _dense(384, stddev=0.04, bias=0.1, activation="relu")
        self.local4 = _dense(192, stddev=0.04, bias=0.1, activation="relu")
        self.softmax_linear = _dense(num_classes, stddev=1 / 192.0, bias=0.0, activation=None)

    def call(self, images: tf.Tensor, training: bool = False) -> tf.Tensor:
        x = self.run_block(self._stage1, images, training)
        x = self.run_block(self._stage2, x, training)
        x = self.run_block(self.local3, self.flatten(x), training)
        x = self.run_block(self.local4, x, training)
        return self.softmax_linear(x)

    # The blocks --recompute recomputes (see TowerModel.run_block).
    def _stage1(self, x: tf.Tensor, training: bool = False) -> tf.Tensor:
        return _lrn(self.pool(self.conv1(x)))

    def _stage2(self, x: tf.Tensor, training: bool = False) -> tf.Tensor:
        return self.pool(_lrn(self.conv2(x)))

    def regularization(self) -> tf.Tensor:
        return _WEIGHT_DECAY * (l2_loss(self.local3.kernel) + l2_loss(self.local4.kernel))
