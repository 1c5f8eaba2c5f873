"""Tower mode's inner step: towers on their devices, variables on the parameter device.

An update of K micro-steps is K - 1 calls of `accumulate` and one of `update`,
each a separate tf.function, so that no `tf.cond` decides whether to apply:

- `accumulate` runs every tower on its shard and adds its gradient, its
  weighted loss sum and its weight sum to accumulators on the tower's own
  device. Nothing crosses devices except the variable reads (the TF analogue
  of PyTorch DDP's `no_sync`).
- `update` runs the last micro-step, then moves the N accumulated sums to the
  parameter device once, combines them into the gradient of the update's
  weighted mean loss (`towers.combine_gradients`), adds the regularization's
  gradient, applies it, and clears the accumulators. Cross-device gradient
  traffic is therefore paid once per update instead of once per micro-step.

An update whose total weight is 0, or whose loss or gradient holds a
non-finite value, is not applied at all: no weight, optimizer slot, counter or
BatchNorm statistic moves. Tower mode has no replica context, so a `tf.cond`
on the parameter device decides.
"""
from __future__ import annotations

from typing import Callable, Iterator, Sequence

import tensorflow as tf

from tower_train.inner_step import Batch, UpdateResult
from tower_train.towers import (TowerResult, combine_gradients, labels_per_shard,
                                regularization_gradients, run_on_towers, split_batch, tower_function)
from tower_train.update_rule import TrainingStatistics, UpdateRule


class TowerStep:
    """The inner step of tower mode for one model, optimizer and device layout."""

    def __init__(self, rule: UpdateRule, tower_devices: Sequence[str], param_device: str, accum: int,
                 shard_sizes: Sequence[int], jit_compile: bool = False,
                 tower: Callable[..., TowerResult] | None = None):
        """`tower`: the tower function, by default `tower_function` of the rule's model; the
        benchmark passes one that simulates a slower device."""
        model = rule.model
        self._tower = tower or tower_function(model, rule.loss_scale, jit_compile)
        self._rule = rule
        self._devices = tuple(tower_devices)
        self._shard_sizes = tuple(shard_sizes)  # examples of each tower per micro-step
        self._param_device = param_device
        self._accum = accum
        with tf.device(param_device):
            self._statistics = TrainingStatistics(model)
        # Per tower, on its device: the gradient sum, sum(w * loss) and sum(w).
        self._grad_sums: list[list[tf.Variable]] = []
        self._loss_sums: list[tf.Variable] = []
        self._weight_sums: list[tf.Variable] = []
        if accum > 1:
            for i, device in enumerate(self._devices):
                with tf.device(device):
                    self._grad_sums.append([
                        tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False,
                                    name=f"tower_{i}_grad_sum_{j}")
                        for j, v in enumerate(model.trainable_variables)])
                    self._loss_sums.append(tf.Variable(0.0, trainable=False, name=f"tower_{i}_loss_sum"))
                    self._weight_sums.append(tf.Variable(0.0, trainable=False, name=f"tower_{i}_weight_sum"))
        self.accumulate = tf.function(self._accumulate)
        self.update = tf.function(self._update)

    def run_update(self, batches: Iterator[Batch]) -> UpdateResult:
        """Takes K global micro-batches from `batches` and applies one update."""
        for _ in range(self._accum - 1):
            self.accumulate(*next(batches))
        return UpdateResult.of(*self.update(*next(batches)))

    def _towers(self, batch: Batch) -> list:
        return run_on_towers(self._tower, self._devices, split_batch(batch, self._shard_sizes))

    def _accumulate(self, features: tf.Tensor, labels: tf.Tensor, weights: tf.Tensor) -> None:
        """A micro-step that does not update: a global micro-batch [N*b, ...] -> nothing."""
        for device, (loss_sum, weight_sum, grads), grad_sums, loss_acc, weight_acc in zip(
                self._devices, self._towers((features, labels, weights)), self._grad_sums,
                self._loss_sums, self._weight_sums, strict=True):
            with tf.device(device):
                for grad_sum, grad in zip(grad_sums, grads, strict=True):
                    grad_sum.assign_add(grad)
                loss_acc.assign_add(loss_sum)
                weight_acc.assign_add(weight_sum)

    def _update(self, features: tf.Tensor, labels: tf.Tensor,
                weights: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
        """The last micro-step of an update; returns (the update's weighted mean loss, its total
        weight, whether it was applied)."""
        tower_grads, loss_sums, weight_sums = [], [], []
        for i, (device, (loss_sum, weight_sum, grads)) in enumerate(
                zip(self._devices, self._towers((features, labels, weights)))):
            with tf.device(device):
                if self._grad_sums:
                    grads = [s.read_value() + g for s, g in zip(self._grad_sums[i], grads, strict=True)]
                    loss_sum = self._loss_sums[i].read_value() + loss_sum
                    weight_sum = self._weight_sums[i].read_value() + weight_sum
            tower_grads.append(grads)
            loss_sums.append(loss_sum)
            weight_sums.append(weight_sum)
        counts = labels_per_shard(labels.shape, self._shard_sizes)
        with tf.device(self._param_device):
            total_weight = tf.add_n(weight_sums)
            regularization, regularization_grads = regularization_gradients(self._rule.model)
            mean_loss = tf.math.divide_no_nan(tf.add_n(loss_sums), total_weight) + regularization
            safe_weight = tf.where(total_weight > 0, total_weight, 1.0)  # W = 0 is refused below
            mean_grads = combine_gradients(tower_grads, counts, safe_weight)
            if self._rule.loss_scale is not None:
                mean_grads = self._rule.loss_scale.unscale(mean_grads)
            mean_grads = [g + r for g, r in zip(mean_grads, regularization_grads, strict=True)]
            finite = tf.reduce_all(tf.stack(
                [tf.math.is_finite(mean_loss)] + [tf.reduce_all(tf.math.is_finite(g)) for g in mean_grads]))

            def apply() -> tf.Tensor:
                self._rule.apply(self._rule.clip(mean_grads))
                self._statistics.keep()
                return tf.constant(True)

            def refuse() -> tf.Tensor:
                self._statistics.restore()
                # Only a non-finite update of some weight is an overflow for the loss scale.
                tf.cond(finite | (total_weight <= 0), lambda: None, self._rule.refuse)
                return tf.constant(False)

            applied = tf.cond(tf.logical_and(finite, total_weight > 0), apply, refuse)
        # No accumulators at K = 1: the loop then does nothing.
        for device, grad_sums, loss_acc, weight_acc in zip(
                self._devices, self._grad_sums, self._loss_sums, self._weight_sums):
            with tf.device(device):
                for grad_sum in grad_sums:
                    grad_sum.assign(tf.zeros_like(grad_sum))
                loss_acc.assign(0.0)
                weight_acc.assign(0.0)
        return mean_loss, total_weight, applied
