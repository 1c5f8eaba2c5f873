"""The inner step under a tf.distribute strategy, with tower mode's semantics.

Used by `--mode=mirrored` (MirroredStrategy), `--mode=multi_worker`
(MultiWorkerMirroredStrategy) and `--mode=central_storage`
(CentralStorageStrategy, whose accumulators cannot be replica-local; see
below). As in tower mode, an update of K micro-steps is K - 1 calls of
`accumulate` and one of `finish`, separate tf.functions:

- `accumulate`: every replica adds its gradients to accumulators that are
  local to it (`synchronization=ON_READ`), so no all-reduce runs.
- `finish`: every replica adds its last micro-step to its accumulators; then
  three scalars are summed across replicas (and workers): sum(w * loss),
  sum(w) = W, and the count of non-finite values (a fourth for a model that
  adds losses of the batch: below), from which `UpdateRule.decide` makes the
  update's `Decision`.
- then, from Python, `apply(W)` if that is APPLIED (W > 0, every replica
  finite, and so the update's loss with the regularization), else `discard`.
  `apply`: every replica scales its local gradient sum by c / W (c = labels
  per shard; `towers` has the math), and one all-reduce per update sums them:
  the gradient of the update's weighted mean loss, exactly what tower mode
  applies. The same all-reduce averages the replicas' BatchNorm
  moving statistics. Each replica adds the regularization's gradient and clips
  its (identical) copy, and the `UpdateRule` applies it in cross-replica
  context, never inside a `tf.cond` (keras#20582), where Keras does not reduce
  it again. `discard` clears the accumulators and puts the BatchNorm
  statistics back: no weight, slot, counter or statistic moves, on any replica.

The weight total W travels in `finish`'s scalar sum, so no collective is added
per micro-step and none for the weights: with unit weights c / W = 1 / (N x K),
which equals `tf.nn.compute_average_loss` with the global batch G (divided, in
float16, by the dynamic loss scale the sums were multiplied by).

A model that adds losses of the batch through Keras (`add_loss`, activity
regularizers) has a second gradient sum per replica, that of those losses;
`apply` scales it by b / G (G examples per update, b per replica and
micro-step) and adds it to the first before the same one all-reduce, and
their scaled sum travels in `finish`'s scalars.

A model with randomness (Dropout) gets, in each replica's pass, the seeds
`towers.pass_seeds` makes of (its generators' seeds, the step counter, the
micro-step, the global replica id): the seeds tower mode gives the tower that
takes the same shard. Each replica counts the micro-steps itself and sets the
count back to 0 with its accumulators.
"""
from __future__ import annotations

from typing import Iterator, Mapping, Sequence

import tensorflow as tf

from tower_train.data.source import Preprocess
from tower_train.step.device_feed import feed_devices, shard_specs
from tower_train.step.inner_step import Batch, BatchSpec, Shards, UpdateResult
from tower_train.step.towers import (labels_per_shard, pass_seeds, regularization_gradients, seed_generator_states,
                                     tower_function)
from tower_train.step.update_rule import TrainingStatistics, UpdateRule
from tower_train.step.update_sums import UpdateSums


class StrategyStep:
    """The inner step of the strategy modes for one model, optimizer and strategy.

    Each call takes this worker's global micro-batch of `local_replicas x b`
    examples (b = `shard_size`) as consecutive shards, one per local replica, in
    replica order, each on its replica's device (`feed`): the same assignment of
    examples as tower mode's.
    """

    def __init__(
        self,
        *,
        strategy: tf.distribute.Strategy,
        rule: UpdateRule,
        accum: int,
        shard_size: int,
        first_replica: int = 0,
        jit_compile: bool = False,
        prepare: Preprocess | None = None,
    ):
        self._strategy = strategy
        model = rule.model
        self._tower = tower_function(model, rule.loss_scale, jit_compile, prepare)
        self._rule = rule
        self._accum = accum
        self._first_replica = first_replica  # global id of this worker's first replica
        self._local_replicas = len(strategy.extended.worker_devices)
        self._shard_sizes = [shard_size] * self._local_replicas  # of this worker's micro-batch
        # b / G: a replica's share of the update's examples (every replica takes equal shards).
        self._replica_share = 1.0 / (strategy.num_replicas_in_sync * accum)
        # CentralStorageStrategy has no replica-local variables: its accumulators are one sum over
        # all replicas on the parameter device (a reduction every micro-step), so each replica
        # counts 1/N of it.
        self._accumulated_share = (1.0 / strategy.num_replicas_in_sync if isinstance(
            strategy, tf.distribute.experimental.CentralStorageStrategy) else 1.0)
        # Even at K = 1: the finiteness of an update must be known before it is applied.
        with strategy.scope():
            local = dict(synchronization=tf.VariableSynchronization.ON_READ,
                         aggregation=tf.VariableAggregation.SUM)
            self._sums = UpdateSums(model, **local)
            self._statistics = TrainingStatistics(model)
            self._generator_states = seed_generator_states(model)  # None: a model without randomness
            if self._generator_states is not None:
                self._micro_step = tf.Variable(tf.constant(0, tf.int64), name="micro_step", trainable=False,
                                               **local)
        self.accumulate = tf.function(self._accumulate, autograph=False)
        self.finish = tf.function(self._finish, autograph=False)
        self.apply = tf.function(self._apply, autograph=False)
        self.discard = tf.function(self._discard, autograph=False)

    def feed(self, dataset: tf.data.Dataset, copy_ahead: bool | None = None) -> Iterator[Shards]:
        """`dataset`'s global micro-batches, each of this worker's replicas' shards copied ahead
        to the replica's device from this worker's host if `copy_ahead` (None: if that device is
        an accelerator; `device_feed.feed_devices`)."""
        devices = self._strategy.extended.worker_devices
        host = tf.DeviceSpec.from_string(devices[0]).replace(device_type="CPU", device_index=0).to_string()
        return feed_devices(dataset, devices, self._shard_sizes, host, copy_ahead)

    def run_update(self, batches: Iterator[Shards], at_once: object | None = None) -> UpdateResult:
        """Takes K micro-batches (`feed`'s) from `batches` and applies one update, or refuses it
        when the total weight is 0 or a non-finite value on any replica would reach the weights.
        `at_once` is not used: the host reads each update's decision between its calls."""
        # A tuple whichever feed gave the shards: a list would trace the functions again.
        for _ in range(self._accum - 1):
            self.accumulate(tuple(next(batches)))
        shards = tuple(next(batches))
        result = UpdateResult(*self.finish(shards))
        if result.applied:
            weights = shards[0][2]  # one per label
            count = labels_per_shard(weights.shape, [weights.shape[0]])[0]
            state_finite = self.apply(tf.constant(count / result.total_weight, tf.float32))
            result = result.with_state_finite(state_finite)
        else:
            self.discard(tf.constant(int(result.decision)))
        return result

    def traced_update(self, spec: BatchSpec) -> list[tuple[object, int]]:
        shards = shard_specs(spec, self._shard_sizes)
        runs = [(self.accumulate.get_concrete_function(shards), self._accum - 1)] if self._accum > 1 else []
        return runs + [(self.finish.get_concrete_function(shards), 1),
                       (self.apply.get_concrete_function(tf.TensorSpec([], tf.float32)), 1)]

    def variable_roles(self) -> Mapping[str, Sequence]:
        model = self._rule.model
        return {"weights": model.trainable_variables,
                "gradients": self._sums.gradient_variables + self._sums.scalar_variables,
                "statistics": model.non_trainable_weights}

    def sync_state(self) -> None:
        pass  # the strategy updates the TrainState's variables in place

    def state_written(self) -> None:
        pass  # the next update reads the TrainState's variables themselves

    def held_finite(self) -> bool:
        return True

    @property
    def overlaps_updates(self) -> bool:
        return False  # the host reads the decision to apply or discard (run_update)

    def _per_replica(self, shards: Shards) -> tf.distribute.DistributedValues:
        def shard(context: tf.distribute.DistributedContext) -> Batch:
            return shards[context.replica_id_in_sync_group - self._first_replica]

        return self._strategy.experimental_distribute_values_from_function(shard)

    def _accumulate(self, shards: Shards) -> None:
        self._micro_step_on_replicas(shards)

    def _micro_step_on_replicas(self, shards: Shards) -> None:
        """Every local replica's pass on its shard, added to its sums; the model's training
        metrics, which live outside the strategy, are updated here in cross-replica context
        from each replica's labels and outputs."""
        labels, outputs = self._strategy.run(self._accumulate_replica, args=(self._per_replica(shards),))
        model = self._rule.model
        if model.tracks_training_metrics:
            local = self._strategy.experimental_local_results
            for replica, replica_outputs in enumerate(local(outputs)):
                model.update_training_metrics(
                    tf.nest.map_structure(lambda value: local(value)[replica], labels), replica_outputs)

    def _accumulate_replica(self, shard: Batch) -> tuple[object, tf.Tensor]:
        """One replica's pass; returns its labels and outputs (for the training metrics)."""
        if self._generator_states is not None:
            replica = tf.distribute.get_replica_context().replica_id_in_sync_group
            seeds = pass_seeds(self._generator_states, self._rule.step.read_value(),
                               self._micro_step.read_value(), replica)
            self._micro_step.assign_add(1)
            shard = (*shard, None, seeds)  # no copy of the weights
        result = self._tower(*shard)
        self._sums.add(result)
        return shard[1], result.outputs

    def _finish(self, shards: Shards) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
        """The last micro-step; returns (the update's weighted mean loss plus the regularization
        of the weights it started from, its total weight, its `Decision`), from [sum(w * loss),
        sum(w), non-finite values] and, for a model that adds losses of the batch, their mean over
        the update's examples, summed over every replica of every worker."""
        self._micro_step_on_replicas(shards)
        scalars = self._strategy.run(self._replica_scalars)
        # Under CentralStorageStrategy the sums are already shared: each replica holds 1/N of them.
        share = tf.constant([self._accumulated_share, self._accumulated_share, 1.0]
                            + [self._accumulated_share] * (self._sums.batch_loss is not None))
        loss_sum, total_weight, nonfinite, *batch_loss = tf.unstack(
            self._strategy.reduce(tf.distribute.ReduceOp.SUM, scalars, axis=None) * share)
        # Where the first copy of the weights lives: computed on the host instead, the
        # regularization would bring the weights it reads there (3.8 MB per update for cifar10_cnn).
        with tf.device(self._strategy.extended.parameter_devices[0]):
            regularization = self._rule.model.update_regularization()
            mean_loss = (tf.math.divide_no_nan(loss_sum, total_weight) + regularization
                         + tf.add_n([0.0, *batch_loss]))
            finite = tf.equal(nonfinite, 0.0) & tf.math.is_finite(mean_loss)
            return mean_loss, total_weight, self._rule.decide(total_weight, finite, mean_loss)

    def _replica_scalars(self) -> tf.Tensor:
        sums = self._sums
        values = [sums.loss.read_value()] + [s.read_value() for s in sums.gradient_variables]
        batch_loss = []
        if sums.batch_loss is not None:
            batch_loss = [sums.batch_loss.read_value() * self._replica_share]
        nonfinite = tf.add_n([tf.reduce_sum(tf.cast(~tf.math.is_finite(v), tf.float32))
                              for v in values + batch_loss])
        return tf.stack([sums.loss.read_value(), sums.weight.read_value(), nonfinite] + batch_loss)

    def _apply(self, count_over_weight: tf.Tensor) -> tf.Tensor:
        """Applies the update on every replica; returns whether the state it leaves is finite."""
        self._strategy.run(self._apply_replica, args=(count_over_weight,))
        # Beside the first copy of the state, as the regularization: only the answer crosses.
        with tf.device(self._strategy.extended.parameter_devices[0]):
            return self._rule.state_finite()

    def _apply_replica(self, count_over_weight: tf.Tensor) -> None:
        scale = count_over_weight * self._accumulated_share
        batch_scale = self._replica_share * self._accumulated_share
        if self._rule.loss_scale is not None:  # float16: the sums hold S x gradients
            scale = scale / self._rule.loss_scale.value.read_value()
            batch_scale = batch_scale / self._rule.loss_scale.value.read_value()
        gradients = [s.read_value() * scale for s in self._sums.gradients]
        if self._sums.batch_gradients:
            gradients = [g + s.read_value() * batch_scale
                         for g, s in zip(gradients, self._sums.batch_gradients, strict=True)]
        context = tf.distribute.get_replica_context()
        replicas = self._strategy.num_replicas_in_sync
        statistics = self._statistics.live
        # The one reduction of the update: every replica gets the mean gradient over all G
        # examples and the mean of the replicas' BatchNorm statistics, which each replica moved
        # over its own shards only (Keras gives them no aggregation, so they drift apart).
        reduced = context.all_reduce(tf.distribute.ReduceOp.SUM,
                                     gradients + [v.read_value() / replicas for v in statistics])
        _, regularization_grads = regularization_gradients(self._rule.model)
        variables = len(gradients)
        mean_grads = [g + r for g, r in zip(reduced[:variables], regularization_grads, strict=True)]
        for statistic, mean in zip(statistics, reduced[variables:], strict=True):
            statistic.assign(mean)
        clipped = self._rule.clip(mean_grads)  # identical on every replica, so no reduction
        # Applied in cross-replica context, where Keras does not reduce the gradients again:
        # each copy of a variable takes the copy of the gradient on its own device.
        context.merge_call(lambda _, *grads: self._rule.apply(list(grads)), args=tuple(clipped))
        self._statistics.keep()
        self._clear()

    def _discard(self, decision: tf.Tensor) -> None:
        self._strategy.run(self._discard_replica)
        self._rule.refuse(decision)

    def _discard_replica(self) -> None:
        self._statistics.restore()
        self._clear()

    def _clear(self) -> None:
        self._sums.clear()
        if self._generator_states is not None:
            self._micro_step.assign(tf.zeros_like(self._micro_step))
