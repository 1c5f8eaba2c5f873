"""One training run, built one way: the state a checkpoint holds, created in a mode's variable
scope, the mode's inner step and the run's stream of micro-batches.

Every place that trains or times updates builds its run here (`Run.create`): `train.train`,
`compare`, the benchmark and the tests. The mode comes built (`modes.build_mode`), because a
multi-worker strategy must be created before any other TensorFlow op runs.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, ContextManager, Iterator

import keras
import tensorflow as tf

from tower_train.config import TrainConfig
from tower_train.data.source import Source
from tower_train.errors import UsageError
from tower_train.step.inner_step import InnerStep, Shards
from tower_train.model_spec import ModelSpec, build_model
from tower_train.models import TowerModel
from tower_train.step.modes import Mode
from tower_train.step.schedules import MovingAverage, UpdateSchedule, scaled_rate, updates_per_decay
from tower_train.step.update_rule import LossScale, UpdateRule, tensors_finite

_MOMENTUM = 0.9  # the usual value for --optimizer=momentum


@dataclasses.dataclass
class TrainState:
    """Everything a checkpoint holds: resuming needs no more than this."""

    model: TowerModel
    optimizer: keras.optimizers.Optimizer
    step: tf.Variable  # updates applied (int64)
    examples_seen: tf.Variable  # position in the example stream (int64), so resuming continues it
    moving_average: MovingAverage | None  # of the trainable weights; None with --ema_decay=0
    loss_scale: LossScale | None = None  # only with --precision=fp16

    @classmethod
    def create(cls, config: TrainConfig, spec: ModelSpec, source: Source, variable_scope: ContextManager,
               workers: int = 1) -> TrainState:
        """A fresh model, optimizer, counters and moving average, seeded by config.seed, every
        variable created inside `variable_scope` (a device scope for tower mode, a strategy's
        scope otherwise).

        An update consumes G = config.global_batch x workers examples; the source's epoch
        length sets the exponential schedule.
        """
        keras.utils.set_random_seed(config.seed)
        counter = dict(dtype=tf.int64, trainable=False,
                       aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
        with variable_scope:
            model = build_model(spec, source, config, training=True)
            optimizer = make_optimizer(config, config.global_batch * workers, source.train_size,
                                       spec.optimizer)
            optimizer.build(model.trainable_variables)
            step = tf.Variable(0, name="step", **counter)
            examples_seen = tf.Variable(0, name="examples_seen", **counter)
            moving_average = (MovingAverage(model.trainable_variables, config.ema_decay)
                              if config.ema_decay else None)
            loss_scale = LossScale() if config.precision == "fp16" else None
        return cls(model, optimizer, step, examples_seen, moving_average, loss_scale)

    def checkpoint(self) -> tf.train.Checkpoint:
        optional = {"moving_average": self.moving_average, "loss_scale": self.loss_scale}
        kept = {name: value for name, value in optional.items() if value is not None}
        return tf.train.Checkpoint(model=self.model, optimizer=self.optimizer, step=self.step,
                                   examples_seen=self.examples_seen, **kept)

    def update_rule(self, clip_norm: float | None) -> UpdateRule:
        return UpdateRule(self.model, self.optimizer, self.step, clip_norm, self.moving_average,
                          self.loss_scale, tuple(self.float_variables()))

    @functools.cached_property
    def all_finite(self) -> Callable[[], bool]:
        """A function saying whether every float value the checkpoint would hold is finite, built
        and traced once for the state (the restore and every update call it).

        A restored checkpoint is checked with it; after an update the update's own function
        checks the same variables (`UpdateRule.state_finite`). One reduction over the state."""
        floats = self.float_variables()

        @tf.function(autograph=False)
        def all_finite() -> tf.Tensor:
            return tensors_finite(floats)

        return lambda: bool(all_finite())

    def float_variables(self) -> list:
        """The float variables of `checkpoint_variables`: what must stay finite."""
        return [v for v in self.checkpoint_variables() if tf.as_dtype(v.dtype).is_floating]

    def checkpoint_variables(self) -> list:
        variables = [*self.model.variables, *self.optimizer.variables]
        if self.moving_average is not None:
            variables += self.moving_average.averages
        return variables


def make_optimizer(config: TrainConfig, global_batch: int, train_examples: int | None,
                   given: keras.optimizers.Optimizer | None = None) -> keras.optimizers.Optimizer:
    """The optimizer, its rate a schedule of the update index (`optimizer.iterations`).

    `global_batch` is G over all workers: it scales the rate (--scale_lr) and counts epochs.
    `given`: an optimizer object (fit's optimizer=), of which a fresh copy is made here, in the
    variables' scope: its class, rate or schedule and clipping (Keras clips the update's
    gradient in `apply`); the object itself is left untouched.
    """
    if given is not None:
        copy = type(given).from_config(given.get_config())
        # Set by exclude_from_weight_decay(), which get_config() leaves out: the names' pattern,
        # and the variables, which are the run's own where it trains the given model in place.
        for exclusion in ("_exclude_from_weight_decay", "_exclude_from_weight_decay_pattern"):
            if hasattr(given, exclusion):
                setattr(copy, exclusion, getattr(given, exclusion))
        return copy
    if config.lr_schedule == "exponential" and not train_examples:
        raise UsageError("--lr_schedule=exponential: counts epochs, but the data set does not say "
                         "how many training examples it has; give the source a train_size, or use "
                         "--lr_schedule=cosine or constant")
    rate = UpdateSchedule(
        scaled_rate(config.learning_rate, global_batch, config.scale_lr), config.lr_schedule,
        config.warmup_steps, updates_per_decay(train_examples or 1, global_batch), config.max_steps)
    if config.optimizer == "adam":
        return keras.optimizers.Adam(rate)
    return keras.optimizers.SGD(rate, momentum=_MOMENTUM if config.optimizer == "momentum" else 0.0)


@dataclasses.dataclass
class Run:
    """A run's data source, mode and state, and from them its inner step and stream; its options
    are its mode's."""

    source: Source
    mode: Mode
    state: TrainState

    @classmethod
    def create(cls, spec: ModelSpec, source: Source, mode: Mode) -> Run:
        """A fresh state in `mode`'s variable scope, seeded by the mode's config.seed: runs of one
        config start from the same weights, whatever their mode."""
        state = TrainState.create(mode.config, spec, source, mode.variable_scope(), mode.worker.count)
        return cls(source, mode, state)

    @property
    def config(self) -> TrainConfig:
        return self.mode.config

    @functools.cached_property
    def inner(self) -> InnerStep:
        """The mode's inner step, built at first use, so after any restore of the state: it keeps
        a copy of the statistics as they are when it is built (`TrainingStatistics`)."""
        return self.mode.inner_step(self.state, self.source.model_input)

    def batches(self) -> Iterator[Shards]:
        """The training stream from the state's position in it (`examples_seen`): this worker's
        shard, in global micro-batches of this process's towers, raw (`data/source.RawInput`),
        cut into the towers' shards, each prefetched to its tower if that is an accelerator
        (`InnerStep.feed`): the towers preprocess their shards on their own devices."""
        worker = self.mode.worker
        return self.inner.feed(self.source.train_stream(
            seed=self.config.seed, start_position=int(self.state.examples_seen.numpy()),
            micro_batch=self.config.batch_size * len(self.mode.plan.tower_devices),
            shard_index=worker.index, num_shards=worker.count, preprocessed=False))

    def describe_layout(self) -> str:
        config, plan = self.config, self.mode.plan
        shards = (config.batch_size if config.tower_split is None
                  else "/".join(map(str, config.tower_shard_sizes)) + f" (--tower_split={config.tower_split})")
        return (f"mode={config.mode} ({self.mode.all_reduce} reduction), {len(plan.tower_devices)} tower(s) "
                f"on {', '.join(plan.tower_devices)}, variables on {self.mode.placement.describe(self.state.model.trainable_variables)}, "
                f"batch per tower {shards}, accum {config.accum}, "
                f"global batch G = {config.global_batch * self.mode.worker.count}")
