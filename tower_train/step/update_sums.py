"""What a tower (or a replica) adds up over the micro-steps of one update, in every mode.

`UpdateSums` holds one tower's sums as variables: its gradient sum, sum(w * loss)
and sum(w), and, for a model that adds losses of the batch (`towers` has the
math), their sum and its gradient sum. Tower mode keeps one per tower on the
tower's device (at K > 1); the strategy modes keep one whose variables are local
to each replica (under CentralStorageStrategy, one sum on the parameter
device). Either way a micro-step that does not update `add`s its tower pass, the
update's last micro-step reads `plus` its pass, and the update ends with `clear`.

A variable stepped sparsely (`towers.sparse_occurrences`) also has its passes' occurrences kept,
concatenated: values [occurrences so far, ...] and int64 indices, variables whose first dimension
grows within the update and is emptied by `clear`.
"""
from __future__ import annotations

import tensorflow as tf

from tower_train.models.base import TowerModel
from tower_train.step.towers import TowerResult


class UpdateSums:
    """One tower's sums of an update so far, made in the current device or strategy scope.

    `variable_options` go to every variable (the strategy modes' replica-local
    synchronization); `prefix` starts their names. `sparse`: the indices of the variables whose
    occurrences are kept too, of `passes_held` passes (the micro-steps that `add`). `moments`:
    the shapes of the BN moments' sums the passes record (`pooled_moments.moment_shapes`).
    """

    def __init__(self, model: TowerModel, prefix: str = "", sparse: tuple[int, ...] = (), passes_held: int = 0,
                 moments: list[list[int]] | None = None, **variable_options):
        def zeros(shape, dtype, name: str, grows: bool = False) -> tf.Variable:
            return tf.Variable(tf.zeros([0, *shape[1:]] if grows else shape, dtype), trainable=False,
                               name=prefix + name, shape=[None, *shape[1:]] if grows else None, **variable_options)

        variables = model.trainable_variables
        self.gradients = [zeros(v.shape, v.dtype, f"grad_sum_{j}") for j, v in enumerate(variables)]
        self._passes_held = passes_held
        self.occurrences = [(zeros(variables[j].shape, variables[j].dtype, f"occurrence_values_{j}", True),
                             zeros([0], tf.int64, f"occurrence_indices_{j}", True)) for j in sparse]
        self.moments = [zeros(shape, tf.float32, f"moment_sum_{j}") for j, shape in enumerate(moments or [])]
        self.loss = zeros([], tf.float32, "loss_sum")
        self.weight = zeros([], tf.float32, "weight_sum")
        self.batch_gradients: list[tf.Variable] = []
        self.batch_loss: tf.Variable | None = None
        if model.adds_batch_losses:
            self.batch_gradients = [zeros(v.shape, v.dtype, f"batch_grad_sum_{j}") for j, v in enumerate(variables)]
            self.batch_loss = zeros([], tf.float32, "batch_loss_sum")

    @property
    def gradient_variables(self) -> list[tf.Variable]:
        """The gradient sums, the batch losses' after the loss's."""
        return self.gradients + self.batch_gradients

    @property
    def scalar_variables(self) -> list[tf.Variable]:
        """sum(w * loss), sum(w) and, with losses of the batch, their sum."""
        return [self.loss, self.weight] + ([self.batch_loss] if self.batch_loss is not None else [])

    def add(self, result: TowerResult) -> None:
        """Adds one micro-step's tower pass."""
        for total, value in zip(self.gradient_variables, self._gradients_of(result), strict=True):
            total.assign_add(value)
        for total, value in zip(self.scalar_variables, self._scalars_of(result)):
            total.assign_add(value)
        for (values, indices), slices in zip(self.occurrences, result.slices, strict=True):
            values.assign(tf.concat([values, slices.values], 0))
            indices.assign(tf.concat([indices, slices.indices], 0))
        for total, value in zip(self.moments, result.moments, strict=True):
            total.assign_add(value)

    def plus(self, result: TowerResult) -> TowerResult:
        """The sums with one more tower pass added (the update's last), as a `TowerResult`; the
        variables stay as they are."""
        gradients = [s.read_value() + g for s, g in zip(self.gradients, result.gradients, strict=True)]
        batch_loss, batch_gradients = result.batch_loss, result.batch_gradients
        if self.batch_loss is not None:
            batch_loss = self.batch_loss.read_value() + batch_loss
            batch_gradients = [s.read_value() + g
                               for s, g in zip(self.batch_gradients, batch_gradients, strict=True)]
        slices = tuple(tf.IndexedSlices(tf.concat([self._held(values, new.values), new.values], 0),
                                        tf.concat([self._held(indices, new.indices), new.indices], 0),
                                        new.dense_shape)
                       for (values, indices), new in zip(self.occurrences, result.slices, strict=True))
        moments = tuple(s.read_value() + m for s, m in zip(self.moments, result.moments, strict=True))
        return TowerResult(self.loss.read_value() + result.loss_sum, self.weight.read_value() + result.weight_sum,
                           gradients, batch_loss, batch_gradients, slices=slices, moments=moments)

    def clear(self) -> None:
        for total in self.gradient_variables + self.scalar_variables + self.moments:
            total.assign(tf.zeros_like(total))
        for values, indices in self.occurrences:
            values.assign(values[:0])
            indices.assign(indices[:0])

    def _held(self, variable: tf.Variable, one_pass: tf.Tensor) -> tf.Tensor:
        """The occurrences `variable` holds, with the static shape of `passes_held` passes like
        `one_pass` when that has one (what tower_train.traffic counts)."""
        held = variable.read_value()
        if one_pass.shape[0] is None:
            return held
        return tf.ensure_shape(held, [one_pass.shape[0] * self._passes_held, *one_pass.shape[1:]])

    def _gradients_of(self, result: TowerResult) -> list[tf.Tensor]:
        return list(result.gradients) + (list(result.batch_gradients) if self.batch_gradients else [])

    def _scalars_of(self, result: TowerResult) -> list[tf.Tensor]:
        return [result.loss_sum, result.weight_sum] + ([result.batch_loss] if self.batch_loss is not None else [])
