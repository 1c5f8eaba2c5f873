"""The inner step under a tf.distribute strategy, with tower mode's semantics.

Used by `--mode=mirrored` (MirroredStrategy), `--mode=multi_worker`
(MultiWorkerMirroredStrategy) and `--mode=central_storage`
(CentralStorageStrategy, whose accumulators cannot be replica-local; see
below). As in tower mode, an update of K micro-steps is K - 1 calls of
`accumulate` and one of `finish`, separate tf.functions:

- `accumulate`: every replica adds its gradients to accumulators that are
  local to it (`synchronization=ON_READ`), so no all-reduce runs.
- `finish`: every replica adds its last micro-step to its accumulators and
  counts the non-finite values in them and in its loss; only these two
  scalars are summed across replicas.
- then, from Python, `apply` if every replica was finite, else `discard`.
  `apply`: every replica scales its local sum by 1 / (N x K), N being the
  replicas of all workers, and one all-reduce per update sums them: the mean
  over the N x K shards, exactly the gradient tower mode applies. The same
  all-reduce averages the replicas' BatchNorm moving statistics. Each replica
  clips its (identical) copy, and the `UpdateRule` applies it in
  cross-replica context, never inside a `tf.cond` (keras#20582), where Keras
  does not reduce it again. `discard` clears the accumulators and puts the
  BatchNorm statistics back: no weight, slot, counter or statistic moves, on
  any replica.

The loss scaling is written once, here: scale = 1 / (N x K) on a per-shard
mean, which equals `tf.nn.compute_average_loss` with the global batch G
(divided, in float16, by the dynamic loss scale the sums were multiplied by).
"""
from __future__ import annotations

from typing import Iterator

import tensorflow as tf

from tower_train.towers import tower_function
from tower_train.update_rule import TrainingStatistics, UpdateRule


class StrategyStep:
    """The inner step of the strategy modes for one model, optimizer and strategy.

    Each call takes this worker's global micro-batch of `local_replicas x b`
    examples, which it splits into consecutive shards, one per local replica,
    in replica order: the same assignment of examples as tower mode's.
    """

    def __init__(
        self,
        strategy: tf.distribute.Strategy,
        rule: UpdateRule,
        accum: int,
        first_replica: int = 0,
        jit_compile: bool = False,
    ):
        self._strategy = strategy
        model = rule.model
        self._tower = tower_function(model, rule.loss_scale, jit_compile)
        self._rule = rule
        self._accum = accum
        self._first_replica = first_replica  # global id of this worker's first replica
        self._local_replicas = len(strategy.extended.worker_devices)
        self._scale = 1.0 / (strategy.num_replicas_in_sync * accum)
        # CentralStorageStrategy has no replica-local variables: its accumulators are one sum over
        # all replicas on the parameter device (a reduction every micro-step), so each replica
        # counts 1/N of it.
        self._accumulated_share = (1.0 / strategy.num_replicas_in_sync if isinstance(
            strategy, tf.distribute.experimental.CentralStorageStrategy) else 1.0)
        # Even at K = 1: the finiteness of an update must be known before it is applied.
        with strategy.scope():
            local = dict(trainable=False, synchronization=tf.VariableSynchronization.ON_READ,
                         aggregation=tf.VariableAggregation.SUM)
            self._grad_sums = [tf.Variable(tf.zeros(v.shape, v.dtype), name=f"grad_sum_{j}", **local)
                               for j, v in enumerate(model.trainable_variables)]
            self._loss_sum = tf.Variable(0.0, name="loss_sum", **local)
            self._statistics = TrainingStatistics(model)
        self.accumulate = tf.function(self._accumulate)
        self.finish = tf.function(self._finish)
        self.apply = tf.function(self._apply)
        self.discard = tf.function(self._discard)

    def run_update(self, batches: Iterator[tuple[tf.Tensor, tf.Tensor]]) -> tuple[tf.Tensor, bool]:
        """Takes K micro-batches from `batches` and applies one update.

        Returns (mean loss over all workers, applied): applied is False when a
        non-finite value on any replica kept the update from being applied.
        """
        for _ in range(self._accum - 1):
            self.accumulate(*next(batches))
        loss, nonfinite = self.finish(*next(batches))
        applied = int(nonfinite) == 0
        (self.apply if applied else self.discard)()
        return loss, applied

    def _per_replica(self, images: tf.Tensor, labels: tf.Tensor) -> tf.distribute.DistributedValues:
        shards = (tf.split(images, self._local_replicas), tf.split(labels, self._local_replicas))

        def shard(context: tf.distribute.DistributedContext) -> tuple[tf.Tensor, tf.Tensor]:
            local_id = context.replica_id_in_sync_group - self._first_replica
            return shards[0][local_id], shards[1][local_id]

        return self._strategy.experimental_distribute_values_from_function(shard)

    def _accumulate(self, images: tf.Tensor, labels: tf.Tensor) -> None:
        self._strategy.run(self._accumulate_replica, args=(self._per_replica(images, labels),))

    def _accumulate_replica(self, shard: tuple[tf.Tensor, tf.Tensor]) -> tf.Tensor:
        loss, grads = self._tower(*shard)
        for grad_sum, grad in zip(self._grad_sums, grads, strict=True):
            grad_sum.assign_add(grad)
        self._loss_sum.assign_add(loss)
        return tf.identity(self._loss_sum.read_value())

    def _finish(self, images: tf.Tensor, labels: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        """The last micro-step: (mean loss of the update, count of non-finite values), both global."""
        loss_sums = self._strategy.run(self._accumulate_replica, args=(self._per_replica(images, labels),))
        nonfinite = self._strategy.run(self._count_nonfinite)
        sum_ = tf.distribute.ReduceOp.SUM
        # Under CentralStorageStrategy the sums are already shared: each replica holds 1/N of them.
        return (self._strategy.reduce(sum_, loss_sums, axis=None) * self._scale * self._accumulated_share,
                self._strategy.reduce(sum_, nonfinite, axis=None))

    def _count_nonfinite(self) -> tf.Tensor:
        values = [self._loss_sum.read_value()] + [s.read_value() for s in self._grad_sums]
        return tf.add_n([tf.reduce_sum(tf.cast(~tf.math.is_finite(v), tf.int32)) for v in values])

    def _apply(self) -> None:
        self._strategy.run(self._apply_replica)

    def _apply_replica(self) -> None:
        scale = self._scale * self._accumulated_share
        if self._rule.loss_scale is not None:  # float16: the sums hold S x gradients
            scale = scale / self._rule.loss_scale.value.read_value()
        context = tf.distribute.get_replica_context()
        replicas = self._strategy.num_replicas_in_sync
        statistics = self._statistics.live
        # The one reduction of the update: every replica gets the mean gradient over all G
        # examples and the mean of the replicas' BatchNorm statistics, which each replica moved
        # over its own shards only (Keras gives them no aggregation, so they drift apart).
        reduced = context.all_reduce(tf.distribute.ReduceOp.SUM,
                                     [s.read_value() * scale for s in self._grad_sums]
                                     + [v.read_value() / replicas for v in statistics])
        mean_grads = reduced[:len(self._grad_sums)]
        for statistic, mean in zip(statistics, reduced[len(self._grad_sums):], strict=True):
            statistic.assign(mean)
        clipped = self._rule.clip(mean_grads)  # identical on every replica, so no reduction
        # Applied in cross-replica context, where Keras does not reduce the gradients again:
        # each copy of a variable takes the copy of the gradient on its own device.
        context.merge_call(lambda _, *grads: self._rule.apply(list(grads)), args=tuple(clipped))
        self._statistics.keep()
        self._clear()

    def _discard(self) -> None:
        self._strategy.run(self._discard_replica)
        self._rule.refuse()

    def _discard_replica(self) -> None:
        self._statistics.restore()
        self._clear()

    def _clear(self) -> None:
        for grad_sum in self._grad_sums:
            grad_sum.assign(tf.zeros_like(grad_sum))
        self._loss_sum.assign(tf.zeros_like(self._loss_sum))
