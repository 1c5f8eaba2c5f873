"""ResNet-20 for CIFAR (He et al. 2016, section 4.2), for 24x24x3 inputs.

conv 3x3x16 -> 3 stages x 3 basic blocks (16, 32, 64 filters; stages 2 and 3
halve the resolution) -> global average pooling -> dense logits. A basic
block is conv-BN-ReLU-conv-BN, plus the shortcut, then ReLU. The shortcut is
the paper's option A: identity, or subsampling and zero channels when the
shape changes, so it has no weights. 269,722 parameters ("0.27 M").

How to subclass TowerModel with BatchNormalization: take `**kwargs` and pass
them to `super().__init__`, and make every BN layer with `self.batch_norm()`
(here handed to each block as a factory). Then `--sync_bn` reaches them all,
and `call(..., training)` passes `training` on: True normalizes with the
batch statistics and updates the moving ones; False uses the moving ones.
"""
from __future__ import annotations

from typing import Callable

import keras
import tensorflow as tf

from tower_train.models.base import TowerModel, l2_loss
from tower_train.models.registry import register

# The paper's weight decay 1e-4: as 1e-4 x sum(w^2)/2 its gradient is 1e-4 x w.
_WEIGHT_DECAY = 1e-4
# PyTorch's defaults (momentum 0.1 there), which CIFAR ResNet recipes use; a moving average
# that forgets in ~10 steps suits short runs (see docs/batchnorm.md).
_BN = dict(momentum=0.9, epsilon=1e-5)


def _conv(filters: int, stride: int = 1) -> keras.layers.Conv2D:
    return keras.layers.Conv2D(filters, 3, strides=stride, padding="same", use_bias=False,
                               kernel_initializer="he_normal")


class _BasicBlock(keras.layers.Layer):
    """conv-BN-ReLU-conv-BN + shortcut, ReLU."""

    def __init__(self, filters: int, stride: int,
                 batch_norm: Callable[[], keras.layers.BatchNormalization], **kwargs):
        super().__init__(**kwargs)
        self.filters, self.stride = filters, stride
        self.conv1, self.bn1 = _conv(filters, stride), batch_norm()
        self.conv2, self.bn2 = _conv(filters), batch_norm()

    def call(self, x: tf.Tensor, training: bool = False) -> tf.Tensor:
        y = tf.nn.relu(self.bn1(self.conv1(x), training=training))
        y = self.bn2(self.conv2(y), training=training)
        shortcut = x
        if self.stride > 1 or x.shape[-1] != self.filters:  # option A: subsample, pad channels
            shortcut = x[:, ::self.stride, ::self.stride, :]
            extra = self.filters - x.shape[-1]
            shortcut = tf.pad(shortcut, [[0, 0], [0, 0], [0, 0], [extra // 2, extra - extra // 2]])
        return tf.nn.relu(y + shortcut)


@register("resnet20")
class ResNet20(TowerModel):
    """CIFAR ResNet-20: 3 stages x 3 basic blocks, 16/32/64 filters, BN + ReLU."""

    def __init__(self, num_classes: int, **kwargs):
        super().__init__(num_classes, **kwargs)  # kwargs carry sync_batch_norm (--sync_bn)
        self.stem = _conv(16)
        self.stem_bn = self.batch_norm(**_BN)
        self.blocks = [
            _BasicBlock(filters, 2 if stage > 0 and i == 0 else 1, lambda: self.batch_norm(**_BN))
            for stage, filters in enumerate((16, 32, 64)) for i in range(3)]
        self.pool = keras.layers.GlobalAveragePooling2D()
        self.logits = keras.layers.Dense(num_classes)

    def call(self, images: tf.Tensor, training: bool = False) -> tf.Tensor:
        x = self.run_block(self._stem, images, training)
        for block in self.blocks:  # the 9 basic blocks, the units --recompute recomputes
            x = self.run_block(block, x, training)
        return self.logits(self.pool(x))

    def _stem(self, images: tf.Tensor, training: bool = False) -> tf.Tensor:
        return tf.nn.relu(self.stem_bn(self.stem(images), training=training))

    def regularization(self) -> tf.Tensor:
        # Kernels only: decaying BN's gamma/beta would fight the normalization, as in the paper's recipes.
        kernels = [self.stem.kernel, self.logits.kernel]
        kernels += [conv.kernel for block in self.blocks for conv in (block.conv1, block.conv2)]
        return _WEIGHT_DECAY * tf.add_n([l2_loss(k) for k in kernels])
