"""The inner step under a tf.distribute strategy, with tower mode's semantics.

Used by `--mode=mirrored` (MirroredStrategy), `--mode=multi_worker`
(MultiWorkerMirroredStrategy) and `--mode=central_storage`
(CentralStorageStrategy, whose accumulators cannot be replica-local; see
below). As in tower mode, an update of K micro-steps is K - 1 calls of
`accumulate` and one of `update`, separate tf.functions:

- `accumulate`: every replica adds its gradients to accumulators that are
  local to it (`synchronization=ON_READ`), so no all-reduce runs.
- `update`: every replica adds its last micro-step and scales its local sum by
  1 / (N x K), N being the replicas of all workers. `apply_gradients`, called
  in replica context and never inside a `tf.cond` (keras#20582), then sums
  them across replicas: one all-reduce per update, of the mean over the
  N x K shards, exactly the gradient tower mode applies.

The loss scaling is written once, here: scale = 1 / (N x K) on a per-shard
mean, which equals `tf.nn.compute_average_loss` with the global batch G.
"""
from __future__ import annotations

from typing import Iterator

import keras
import tensorflow as tf

from models.base import TowerModel
from tower_train.towers import tower_loss_and_gradients


class StrategyStep:
    """The inner step of the strategy modes for one model, optimizer and strategy.

    Each call takes this worker's global micro-batch of `local_replicas x b`
    examples, which it splits into consecutive shards, one per local replica,
    in replica order: the same assignment of examples as tower mode's.
    """

    def __init__(
        self,
        strategy: tf.distribute.Strategy,
        model: TowerModel,
        optimizer: keras.optimizers.Optimizer,
        step: tf.Variable,
        accum: int,
        first_replica: int = 0,
    ):
        self._strategy = strategy
        self._model = model
        self._optimizer = optimizer
        self._step = step
        self._accum = accum
        self._first_replica = first_replica  # global id of this worker's first replica
        self._local_replicas = len(strategy.extended.worker_devices)
        self._scale = 1.0 / (strategy.num_replicas_in_sync * accum)
        # CentralStorageStrategy has no replica-local variables: its accumulators are one sum over
        # all replicas on the parameter device (a reduction every micro-step), so each replica
        # adds back 1/N of it.
        self._accumulated_share = (1.0 / strategy.num_replicas_in_sync if isinstance(
            strategy, tf.distribute.experimental.CentralStorageStrategy) else 1.0)
        self._grad_sums: list[tf.Variable] = []
        self._loss_sum: tf.Variable | None = None
        if accum > 1:
            with strategy.scope():
                local = dict(trainable=False, synchronization=tf.VariableSynchronization.ON_READ,
                             aggregation=tf.VariableAggregation.SUM)
                self._grad_sums = [tf.Variable(tf.zeros(v.shape, v.dtype), name=f"grad_sum_{j}", **local)
                                   for j, v in enumerate(model.trainable_variables)]
                self._loss_sum = tf.Variable(0.0, name="loss_sum", **local)
        self.accumulate = tf.function(self._accumulate)
        self.update = tf.function(self._update)

    def run_update(self, batches: Iterator[tuple[tf.Tensor, tf.Tensor]]) -> tf.Tensor:
        """Takes K micro-batches from `batches`, applies one update, returns its mean loss over all workers."""
        for _ in range(self._accum - 1):
            self.accumulate(*next(batches))
        return self.update(*next(batches))

    def _per_replica(self, images: tf.Tensor, labels: tf.Tensor) -> tf.distribute.DistributedValues:
        shards = (tf.split(images, self._local_replicas), tf.split(labels, self._local_replicas))

        def shard(context: tf.distribute.DistributedContext) -> tuple[tf.Tensor, tf.Tensor]:
            local_id = context.replica_id_in_sync_group - self._first_replica
            return shards[0][local_id], shards[1][local_id]

        return self._strategy.experimental_distribute_values_from_function(shard)

    def _accumulate(self, images: tf.Tensor, labels: tf.Tensor) -> None:
        self._strategy.run(self._accumulate_replica, args=(self._per_replica(images, labels),))

    def _accumulate_replica(self, shard: tuple[tf.Tensor, tf.Tensor]) -> None:
        loss, grads = tower_loss_and_gradients(self._model, *shard)
        for grad_sum, grad in zip(self._grad_sums, grads, strict=True):
            grad_sum.assign_add(grad)
        self._loss_sum.assign_add(loss)

    def _update(self, images: tf.Tensor, labels: tf.Tensor) -> tf.Tensor:
        losses = self._strategy.run(self._update_replica, args=(self._per_replica(images, labels),))
        return self._strategy.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None)

    def _update_replica(self, shard: tuple[tf.Tensor, tf.Tensor]) -> tf.Tensor:
        loss, grads = tower_loss_and_gradients(self._model, *shard)
        if self._grad_sums:
            share = self._accumulated_share
            grads = [s.read_value() * share + g for s, g in zip(self._grad_sums, grads, strict=True)]
            loss = self._loss_sum.read_value() * share + loss
        # Keras all-reduces (SUM) these in replica context: the one reduction of the update.
        self._optimizer.apply_gradients(
            zip([g * self._scale for g in grads], self._model.trainable_variables))
        self._step.assign_add(1)
        for grad_sum in self._grad_sums:
            grad_sum.assign(tf.zeros_like(grad_sum))
        if self._loss_sum is not None:
            self._loss_sum.assign(tf.zeros_like(self._loss_sum))
        return loss * self._scale
