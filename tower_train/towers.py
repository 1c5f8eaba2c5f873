"""The three pieces of the tower pattern, kept apart as in tensorpack.

1. `tower_loss_and_gradients` (and `tower_function`, which binds the model):
   what one tower computes, knowing nothing of devices.
2. `run_on_towers`: the placement, which calls a tower function once per device.
3. `average_gradients`: the pure cross-tower reduction.

The gradient math, written down once: a tower's loss is the mean per-example
loss over its shard plus the model's regularization; the update applies the
mean of the tower gradients over N towers and K micro-steps. With equal
shards, that is exactly the gradient of the mean loss over the
G = batch_size x N x K examples of the update (plus the regularization, once).
"""
from __future__ import annotations

from typing import Callable, Sequence, TypeVar

import tensorflow as tf

from models.base import TowerModel
from tower_train.update_rule import LossScale

T = TypeVar("T")


def tower_loss_and_gradients(
    model: TowerModel, images: tf.Tensor, labels: tf.Tensor, loss_scale: tf.Tensor | None = None
) -> tuple[tf.Tensor, list[tf.Tensor]]:
    """One tower's forward and backward pass.

    Args:
      model: the network; its variables may live on another device.
      images: float32 [b, 24, 24, 3], this tower's shard.
      labels: int32 [b].
      loss_scale: float32 scalar S (float16 training) or None (S = 1).

    Returns:
      (loss, gradients): the scalar mean loss over the shard plus the model's
      regularization, and the gradient of S x loss for each of
      `model.trainable_variables` (same order and shapes, float32).
    """
    with tf.GradientTape() as tape:
        logits = model(images, training=True)
        loss = tf.reduce_mean(model.per_example_loss(labels, logits)) + model.regularization()
        scaled = loss if loss_scale is None else loss * loss_scale
    return loss, tape.gradient(scaled, model.trainable_variables)


def tower_function(
    model: TowerModel, loss_scale: LossScale | None = None, jit_compile: bool = False
) -> Callable[[tf.Tensor, tf.Tensor], tuple[tf.Tensor, list[tf.Tensor]]]:
    """`tower_loss_and_gradients` of `model` as a function of (images, labels), reading the
    current loss scale at every call; with `jit_compile`, compiled by XLA for the device it
    is called on (which must hold the model's variables: XLA cannot read another device's)."""
    def tower(images: tf.Tensor, labels: tf.Tensor) -> tuple[tf.Tensor, list[tf.Tensor]]:
        return tower_loss_and_gradients(
            model, images, labels, None if loss_scale is None else loss_scale.value.read_value())

    return tf.function(tower, jit_compile=True) if jit_compile else tower


def run_on_towers(
    tower_fn: Callable[..., T], devices: Sequence[str], shards: Sequence[tuple]
) -> list[T]:
    """Calls `tower_fn(*shards[i])` on `devices[i]`, under name scope `tower_i`.

    Inside one tf.function the calls are independent ops on different
    devices, so the runtime runs the towers concurrently.
    """
    results = []
    for i, (device, shard) in enumerate(zip(devices, shards, strict=True)):
        with tf.device(device), tf.name_scope(f"tower_{i}"):
            results.append(tower_fn(*shard))
    return results


def average_gradients(
    tower_gradients: Sequence[Sequence[tf.Tensor]], num_micro_steps: int = 1
) -> list[tf.Tensor]:
    """The mean gradient over N towers and K micro-steps, on the current device.

    Args:
      tower_gradients: N sequences of V tensors; tower_gradients[i][v] has the
        shape of variable v and is tower i's gradient summed over its
        `num_micro_steps` (K) micro-steps.
      num_micro_steps: K.

    Returns:
      V tensors; element v has the shape of variable v and equals
      sum_i tower_gradients[i][v] / (N * K).
    """
    scale = 1.0 / (len(tower_gradients) * num_micro_steps)
    return [tf.add_n(list(grads)) * scale for grads in zip(*tower_gradients, strict=True)]


def split_batch(images: tf.Tensor, labels: tf.Tensor, num_shards: int) -> list[tuple[tf.Tensor, tf.Tensor]]:
    """A global micro-batch [N*b, ...] as N consecutive shards of b examples."""
    return list(zip(tf.split(images, num_shards), tf.split(labels, num_shards)))
