"""The learning rate as a function of the update index, and the moving average of the weights.

Both advance once per **update**: the schedule reads `optimizer.iterations`,
which only `UpdateRule.apply` moves, once per applied update; the moving
average is updated right after it. A micro-step moves neither, so neither
depends on how G is factored into towers and micro-steps.
"""
from __future__ import annotations

import math

import keras
import tensorflow as tf

REFERENCE_BATCH = 256  # the linear scaling rule's base batch (Goyal et al.)
DECAY_EPOCHS = 350.0  # the original's NUM_EPOCHS_PER_DECAY
DECAY_FACTOR = 0.1  # the original's LEARNING_RATE_DECAY_FACTOR


class UpdateSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """Linear warm-up, then a constant, staircase-exponential or cosine rate.

    Args:
      base_rate: the rate after warm-up (already scaled by --scale_lr if asked).
      kind: one of config.SCHEDULES.
      warmup_steps: updates of linear warm-up from base_rate / warmup_steps.
      updates_per_decay: for "exponential", updates between two x0.1 steps.
      total_steps: for "cosine", the update at which the rate reaches 0.
    """

    def __init__(self, base_rate: float, kind: str, warmup_steps: int = 0,
                 updates_per_decay: float = 1.0, total_steps: int = 1):
        self.base_rate = base_rate
        self.kind = kind
        self.warmup_steps = warmup_steps
        self.updates_per_decay = updates_per_decay
        self.total_steps = total_steps

    def __call__(self, step) -> tf.Tensor:
        """The rate of the update that follows `step` applied updates (0-based)."""
        step = tf.cast(step, tf.float32)
        if self.kind == "exponential":
            rate = self.base_rate * tf.pow(DECAY_FACTOR, tf.floor(step / self.updates_per_decay))
        elif self.kind == "cosine":
            decaying = max(self.total_steps - self.warmup_steps, 1)
            progress = tf.clip_by_value((step - self.warmup_steps) / decaying, 0.0, 1.0)
            rate = self.base_rate * 0.5 * (1.0 + tf.cos(math.pi * progress))
        else:
            rate = tf.constant(self.base_rate, tf.float32)
        if self.warmup_steps:
            warm = self.base_rate * (step + 1.0) / self.warmup_steps
            rate = tf.where(step < self.warmup_steps, warm, rate)
        return rate

    def get_config(self) -> dict:
        return dict(base_rate=self.base_rate, kind=self.kind, warmup_steps=self.warmup_steps,
                    updates_per_decay=self.updates_per_decay, total_steps=self.total_steps)


def updates_per_decay(train_examples: int, global_batch: int) -> float:
    """Updates in DECAY_EPOCHS epochs, counted in examples: G per update, not a tower's batch.

    The original divided by the per-tower batch, so with N towers it decayed N times too late.
    """
    return DECAY_EPOCHS * train_examples / global_batch


def scaled_rate(learning_rate: float, global_batch: int, scale: bool) -> float:
    """The linear scaling rule: learning_rate x G / 256 when asked."""
    return learning_rate * global_batch / REFERENCE_BATCH if scale else learning_rate


class MovingAverage(tf.Module):
    """The original's ExponentialMovingAverage of the trainable weights, one step per update.

    decay at update t (1-based) = min(decay, (1 + t) / (10 + t)), as
    tf.train.ExponentialMovingAverage with num_updates: early averages are not
    dominated by the random initial weights. The averages start equal to the
    weights and are created in the caller's variable scope (the parameter device,
    or a strategy's scope), next to the weights.
    """

    def __init__(self, weights: list[tf.Variable], decay: float):
        super().__init__(name="moving_average")
        self.decay = decay
        self.averages = [tf.Variable(tf.convert_to_tensor(w), trainable=False, name=f"average_{i}",
                                     aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
                         for i, w in enumerate(weights)]

    def update(self, weights: list[tf.Variable], update_number: tf.Tensor) -> None:
        """Moves every average towards its weight; `update_number` counts updates from 1.

        In a strategy's cross-replica context every copy is updated from the weight
        copy on its own device, so no value crosses devices.
        """
        t = tf.cast(update_number, tf.float32)
        decay = tf.minimum(self.decay, (1.0 + t) / (10.0 + t))
        extended = tf.distribute.get_strategy().extended
        for average, weight in zip(self.averages, weights, strict=True):
            extended.update(average, lambda a, w: a.assign(decay * a + (1.0 - decay) * w),
                            args=(getattr(weight, "value", weight),), group=False)
