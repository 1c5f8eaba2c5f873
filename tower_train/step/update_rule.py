"""What happens once per update, and only then, in every mode.

Clip the update's mean gradient, apply it, count the update, move the moving
average and, in float16, the loss scale. The learning-rate schedule reads `optimizer.iterations`, which the
apply moves. A micro-step does none of this, so the learning rate, the
clipping, the average and the step counter depend only on how many updates
were applied, never on N or K (unlike keras#19990, where Keras's own
accumulation advanced some of them per micro-step).
"""
from __future__ import annotations

import dataclasses
from typing import Mapping

import keras
import tensorflow as tf

from tower_train.step.inner_step import Decision
from tower_train.models.base import TowerModel
from tower_train.step.schedules import MovingAverage


class LossScale(tf.Module):
    """Dynamic loss scaling for float16, one decision per update.

    Every micro-step's tower loss is multiplied by `value`, so the small
    gradients of float16 activations do not flush to zero; the accumulated
    gradient is divided by it once, at the update. An update whose gradient is
    non-finite (an overflow) is skipped on every tower and replica, and the
    scale halves; after `GROWTH_UPDATES` finite updates in a row it doubles.
    This is Keras's LossScaleOptimizer policy, moved from the micro-step to the
    update: Keras's would also count micro-steps. Create it in the variables'
    scope; it is checkpointed, so a resumed run continues with the same scale.
    """

    INITIAL = 2.0 ** 15  # Keras's initial scale
    GROWTH_UPDATES = 2000  # Keras's dynamic_growth_steps, counted in updates

    def __init__(self):
        super().__init__(name="loss_scale")
        replicated = dict(trainable=False, aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
        self.value = tf.Variable(self.INITIAL, name="value", **replicated)
        self.good_updates = tf.Variable(0, dtype=tf.int64, name="good_updates", **replicated)

    def unscale(self, gradients: list[tf.Tensor]) -> list[tf.Tensor]:
        return [g / self.value for g in gradients]

    def after_applied(self) -> None:
        grow = self.good_updates + 1 >= self.GROWTH_UPDATES
        self.value.assign(tf.where(grow, self.value * 2.0, self.value))
        self.good_updates.assign(tf.where(grow, tf.constant(0, tf.int64), self.good_updates + 1))

    def after_refused(self) -> None:
        self.value.assign(self.value / 2.0)
        self.good_updates.assign(0)


def tensors_finite(values) -> tf.Tensor:
    """A bool scalar: whether every element of every tensor (or variable) in `values` is finite,
    on the current device."""
    return tf.reduce_all(tf.stack([tf.reduce_all(tf.math.is_finite(v)) for v in values]))


@dataclasses.dataclass(frozen=True)
class UpdateRule:
    model: TowerModel
    optimizer: keras.optimizers.Optimizer
    step: tf.Variable  # updates applied (int64)
    clip_norm: float | None = None
    moving_average: MovingAverage | None = None
    loss_scale: LossScale | None = None  # only with --precision=fp16
    # The float variables a checkpoint holds (TrainState.float_variables), which `state_finite`
    # reads after the update; none: nothing to check.
    checked: tuple = ()

    def clip(self, mean_gradients: list[tf.Tensor], norm: tf.Tensor | None = None,
             sparse: Mapping[int, tf.IndexedSlices] | None = None) -> list:
        """The update's gradient (of the weighted mean loss over all G examples, plus the
        regularization) rescaled to a global norm of at most `clip_norm`, then clipped as the
        optimizer's own `clipnorm`, `global_clipnorm` or `clipvalue` says, as Keras's `apply`
        clips a batch's gradient. Keras's own fit under a strategy would clip each replica's
        share instead. `norm`: the whole gradient's global norm (`global_norm`) when
        `mean_gradients` are only part of it, as one device's slices (where the optimizer may
        not clip: model_spec refuses it). `sparse`: by variable index, the gradient's
        occurrences (sparse steps: `towers.combine_slices`), which replace that variable's dense
        gradient from here on; `clip_norm` still reads the dense gradient's norm, and the
        optimizer clips the occurrences as Keras's `apply` does."""
        gradients = list(mean_gradients)
        if sparse:
            if self.clip_norm is not None and norm is None:
                norm = tf.linalg.global_norm(gradients)
            gradients = [sparse.get(j, g) for j, g in enumerate(gradients)]
        if self.clip_norm is not None:
            gradients = tf.clip_by_global_norm(gradients, self.clip_norm, use_norm=norm)[0]
        return self.optimizer._clip_gradients(gradients)

    @staticmethod
    def half_squared_norm(gradients: list[tf.Tensor]) -> tf.Tensor:
        """sum(g ** 2) / 2 over `gradients`, part of a gradient: what `global_norm` adds up."""
        return tf.reduce_sum(tf.stack([tf.nn.l2_loss(g) for g in gradients]))

    @staticmethod
    def global_norm(half_squared_norms: list[tf.Tensor]) -> tf.Tensor:
        """The global norm of a gradient from `half_squared_norm` of each of its parts, as
        tf.clip_by_global_norm computes it from its tensors'."""
        return tf.sqrt(tf.reduce_sum(tf.stack(half_squared_norms)) * 2.0)

    def apply(self, clipped_gradients: list) -> None:
        """Applies the clipped mean gradient (`clip`) as Keras's `Optimizer.apply` applies a
        batch's: the optimizer's weight decay, the step of each variable, the layers'
        constraints, and the optimizer's moving average (`use_ema`). A sparse-stepped variable's
        gradient is its occurrences (`clip`'s `sparse`), which `update_step` takes as under
        Keras's fit. In a strategy, call it in cross-replica context with gradients that are
        already reduced.

        Keras's `apply_gradients` all-reduces the gradients it is given whenever a strategy is
        active, clipping each replica's share before that, so it would reduce them a second time
        and clip something else than the update's gradient. Its pieces are called here instead,
        on the update's mean gradient, in Keras's order: each copy of a variable takes the copy
        of the gradient on its own device. The rate is read once, from the schedule at
        `optimizer.iterations`, before that moves, as is the weight decay's.
        """
        optimizer, variables = self.optimizer, self.model.trainable_variables
        rate = optimizer.learning_rate
        extended = tf.distribute.get_strategy().extended
        for gradient, variable in zip(clipped_gradients, variables, strict=True):
            decays = optimizer.weight_decay is not None and optimizer._use_weight_decay(variable)
            extended.update(variable.value, self._update_variable, args=(gradient, rate),
                            kwargs=dict(decays=decays), group=False)
        for variable in variables:
            if variable.constraint is not None:
                variable.assign(variable.constraint(variable))
        if optimizer.use_ema:  # before the count moves: Keras's first update sets the average
            optimizer._update_model_variables_moving_average(variables)
            if optimizer.ema_overwrite_frequency:
                tf.cond(tf.equal((optimizer.iterations + 1) % optimizer.ema_overwrite_frequency, 0),
                        lambda: optimizer._overwrite_model_variables_with_average_value(variables),
                        lambda: None)
        self.count_update()
        if self.moving_average is not None:
            self.moving_average.update(variables, self.step)

    def count_update(self) -> None:
        """Counts an applied update: the optimizer's iterations (the rate's schedule reads them),
        the step, and the loss scale's run of finite updates (fp16)."""
        self.optimizer.iterations.assign_add(1)
        self.step.assign_add(1)
        if self.loss_scale is not None:
            self.loss_scale.after_applied()

    def state_finite(self) -> tf.Tensor:
        """A bool scalar: whether every float value a checkpoint would hold is finite. Read in
        the update's own function, after its apply: a finite loss and gradient can still leave
        inf or NaN behind (a huge learning rate, an optimizer's moments overflowing), which must
        never reach a checkpoint, and asking here costs no call and no wait of its own."""
        return tensors_finite(self.checked) if self.checked else tf.constant(True)

    def decide(self, total_weight: tf.Tensor, finite: tf.Tensor, loss: tf.Tensor) -> tf.Tensor:
        """The update's `Decision` (int32), from its total weight W, whether its loss and
        gradient are all finite, and its loss. Every mode decides here, before anything moves.

        A refused float16 update is an overflow, which the loss scale handles, only while its
        loss is finite and the halved scale is still >= 1. Below 1 the scale no longer guards
        float16's range, so the gradient itself is non-finite, and halving on forever would
        never stop the run.
        """
        refused = tf.constant(int(Decision.NONFINITE))
        if self.loss_scale is not None:
            overflow = tf.math.is_finite(loss) & (self.loss_scale.value / 2.0 >= 1.0)
            refused = tf.where(overflow, int(Decision.OVERFLOW), refused)
        return tf.where(total_weight <= 0, int(Decision.EMPTY),
                        tf.where(finite, int(Decision.APPLIED), refused))

    def refuse(self, decision: tf.Tensor) -> None:
        """Records an update that was not applied: only the loss scale (fp16) reacts, halving
        for a non-finite update (never for an empty one). In a strategy, call it in
        cross-replica context."""
        if self.loss_scale is not None:
            tf.cond(tf.equal(decision, int(Decision.EMPTY)), lambda: None, self.loss_scale.after_refused)

    def _update_variable(self, variable: tf.Variable, gradient: tf.Tensor, rate: tf.Tensor,
                         decays: bool) -> None:
        """One copy of a variable decayed, when the optimizer decays it, then stepped: Keras's
        `_apply_weight_decay` then `update_step`, which under a strategy must run in a replica's
        context where this runs in the cross-replica one."""
        if decays:
            variable.assign_sub(variable * tf.cast(self.optimizer.weight_decay, variable.dtype)
                                * tf.cast(rate, variable.dtype))
        self.optimizer.update_step(gradient, variable, rate)


class TrainingStatistics:
    """The model's non-trainable state that training moves (BatchNorm's moving statistics),
    and a copy of it as of the last applied update.

    The statistics move inside every tower call, micro-step by micro-step, before anyone
    knows whether the update will be applied; `restore` undoes that for a refused update,
    so a non-finite batch cannot poison them. Create it in the variables' scope (the
    parameter device, or a strategy's scope).
    """

    def __init__(self, model: TowerModel):
        # The weights, not the variables: a SeedGenerator's state is no statistic, and never moves.
        self.live = [v.value for v in model.non_trainable_weights]
        self._kept = [tf.Variable(tf.convert_to_tensor(v), trainable=False, name=f"kept_statistic_{i}",
                                  aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
                      for i, v in enumerate(self.live)]

    @property
    def kept(self) -> list[tf.Variable]:
        """The statistics as of the last applied update, in the order of `live`."""
        return self._kept

    def keep(self) -> None:
        for kept, live in zip(self._kept, self.live, strict=True):
            kept.assign(live.read_value())

    def restore(self) -> None:
        for kept, live in zip(self._kept, self.live, strict=True):
            live.assign(kept.read_value())
