"""Tower mode's inner step: towers on their devices, variables on the parameter device.

An update of K micro-steps is K - 1 calls of `accumulate` and one of `update`,
each a separate tf.function, so that no `tf.cond` decides whether to apply:

- `accumulate` runs every tower on its shard and adds its gradients to
  accumulators on the tower's own device. Nothing crosses devices except the
  variable reads (the TF analogue of PyTorch DDP's `no_sync`).
- `update` runs the last micro-step, then moves the N accumulated gradients to
  the parameter device once, averages them over N x K, applies them, and clears
  the accumulators. Cross-device gradient traffic is therefore paid once per
  update instead of once per micro-step: K times less.

An update whose mean loss or averaged gradient holds a non-finite value is not
applied at all: no weight, optimizer slot, counter or BatchNorm statistic moves. Tower mode has no
replica context, so a `tf.cond` on the parameter device decides.
"""
from __future__ import annotations

from typing import Iterator, Sequence

import tensorflow as tf

from tower_train.update_rule import TrainingStatistics, UpdateRule
from tower_train.towers import average_gradients, run_on_towers, split_batch, tower_function


class TowerStep:
    """The inner step of tower mode for one model, optimizer and device layout."""

    def __init__(self, rule: UpdateRule, tower_devices: Sequence[str], param_device: str, accum: int,
                 jit_compile: bool = False):
        model = rule.model
        self._tower = tower_function(model, rule.loss_scale, jit_compile)
        self._rule = rule
        self._devices = tuple(tower_devices)
        self._param_device = param_device
        self._accum = accum
        with tf.device(param_device):
            self._statistics = TrainingStatistics(model)
        # One gradient sum and one loss sum per tower, on that tower's device.
        self._grad_sums: list[list[tf.Variable]] = []
        self._loss_sums: list[tf.Variable] = []
        if accum > 1:
            for i, device in enumerate(self._devices):
                with tf.device(device):
                    self._grad_sums.append([
                        tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False,
                                    name=f"tower_{i}_grad_sum_{j}")
                        for j, v in enumerate(model.trainable_variables)])
                    self._loss_sums.append(tf.Variable(0.0, trainable=False, name=f"tower_{i}_loss_sum"))
        self.accumulate = tf.function(self._accumulate)
        self.update = tf.function(self._update)

    def run_update(self, batches: Iterator[tuple[tf.Tensor, tf.Tensor]]) -> tuple[tf.Tensor, tf.Tensor]:
        """Takes K global micro-batches from `batches` and applies one update.

        Returns (mean loss, applied): applied is False when a non-finite value kept
        the update from being applied.
        """
        for _ in range(self._accum - 1):
            self.accumulate(*next(batches))
        return self.update(*next(batches))

    def _towers(self, images: tf.Tensor, labels: tf.Tensor) -> list[tuple[tf.Tensor, list[tf.Tensor]]]:
        return run_on_towers(self._tower, self._devices, split_batch(images, labels, len(self._devices)))

    def _accumulate(self, images: tf.Tensor, labels: tf.Tensor) -> None:
        """A micro-step that does not update: [N*b, 24, 24, 3], [N*b] -> nothing."""
        for device, (loss, grads), grad_sums, loss_sum in zip(
                self._devices, self._towers(images, labels), self._grad_sums, self._loss_sums,
                strict=True):
            with tf.device(device):
                for grad_sum, grad in zip(grad_sums, grads, strict=True):
                    grad_sum.assign_add(grad)
                loss_sum.assign_add(loss)

    def _update(self, images: tf.Tensor, labels: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        """The last micro-step of an update; returns the mean loss over its N x K shards and
        whether the update was applied."""
        tower_grads, tower_losses = [], []
        for i, (device, (loss, grads)) in enumerate(zip(self._devices, self._towers(images, labels))):
            with tf.device(device):
                if self._grad_sums:
                    grads = [s.read_value() + g for s, g in zip(self._grad_sums[i], grads, strict=True)]
                    loss = self._loss_sums[i].read_value() + loss
            tower_grads.append(grads)
            tower_losses.append(loss)
        with tf.device(self._param_device):
            mean_grads = average_gradients(tower_grads, self._accum)
            if self._rule.loss_scale is not None:
                mean_grads = self._rule.loss_scale.unscale(mean_grads)
            mean_loss = tf.add_n(tower_losses) / (len(self._devices) * self._accum)
            finite = tf.reduce_all(tf.stack(
                [tf.math.is_finite(mean_loss)] + [tf.reduce_all(tf.math.is_finite(g)) for g in mean_grads]))

            def apply() -> tf.Tensor:
                self._rule.apply(self._rule.clip(mean_grads))
                self._statistics.keep()
                return tf.constant(True)

            def refuse() -> tf.Tensor:
                self._statistics.restore()
                self._rule.refuse()
                return tf.constant(False)

            applied = tf.cond(finite, apply, refuse)
        for device, grad_sums, loss_sum in zip(self._devices, self._grad_sums, self._loss_sums):
            with tf.device(device):
                for grad_sum in grad_sums:
                    grad_sum.assign(tf.zeros_like(grad_sum))
                loss_sum.assign(0.0)
        return mean_loss, applied
