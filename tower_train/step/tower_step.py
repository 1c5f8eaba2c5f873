"""Tower mode's inner step: towers on their devices, variables on the parameter device.

An update of K micro-steps is K - 1 runs of `accumulate` and one of `update`,
each a function of its own, so that no `tf.cond` decides whether to apply. The
first update calls them one by one from Python; later ones, given the feed's
iterator (`run_update`'s `at_once`), run all K in one call that reads the
micro-batches inside it, so that Python's cost per update does not grow with K:

- `accumulate` runs every tower on its shard and adds its gradient, its
  weighted loss sum and its weight sum to accumulators on the tower's own
  device. No gradient crosses devices (the TF analogue of PyTorch DDP's
  `no_sync`).
- `update` runs the last micro-step, then moves the N accumulated sums to the
  parameter device once, combines them into the gradient of the update's
  weighted mean loss (`towers.combine_gradients`), adds the regularization's
  gradient, applies it, and clears the accumulators. Cross-device gradient
  traffic is therefore paid once per update instead of once per micro-step.

The weights cannot change inside an update, so with `tower_weights="per_update"`
and K > 1 each tower off the parameter device keeps a copy of the trainable
weights on its own device, refreshed once at the start of every update
(`refresh_weights`), and its K micro-steps read that: N x P bytes of weights
per update instead of K x N x P. BatchNorm's moving statistics are not copied:
they stay on the parameter device and move tower by tower in program order,
as with direct reads. At K = 1, or with "per_micro_step", the towers read the
parameter device directly.

What crosses devices can be narrower than float32:

- Under `--precision=bf16|fp16` the weights a tower reads in the compute dtype
  (`towers.read_in_compute_dtype`: those of the layers that compute in it) are
  cast to it on the parameter device and travel, or are kept as copies, in it:
  the tower would have rounded them to the same values, so the update is
  bit-identical and their bytes halve. Then, at K = 1 or with
  "per_micro_step", every tower off the parameter device reads the weights the
  parameter device sends it instead of reading the variables itself.
- With `transfer_dtype` bfloat16 or float16 (`--transfer_precision`), each
  tower off the parameter device casts its gradient sums (its gradients at
  K = 1) to it before they leave, and the parameter device casts them back to
  float32 before combining them: half the gradient bytes, each sum rounded
  once. The loss and weight sums (two scalars) stay float32.

A tower on the parameter device casts nothing: nothing of it crosses devices.

Where the weights come from and where the sums go is the placement's `TowerLayout`
(`tower_layout.py`): with `one_device.OneDevice` (`--ps_device=cpu|gpu`) the
`ParameterDeviceLayout` above; with
`--ps_device=spread` the `spread.SpreadLayout`, which keeps the weights in slices on the tower
devices and reduces on their owners. `TowerStep` runs the towers, their sums, seeds and the
settling of the decision, the same for every layout.

A model that adds losses of the batch through Keras (`add_loss`, activity
regularizers) has a second gradient sum per tower, that of those losses,
which the update folds into the first on the tower's device before it
travels (`towers` has the math): more memory and a second backward pass, no
more gradient bytes (each tower waits for the update's total weight W).

A model with randomness (Dropout) gets, in each tower's pass, the seeds
`towers.pass_seeds` makes of (its generators' seeds, the step counter, the
micro-step, the tower), computed on the parameter device; the micro-step is
counted there and set back to 0 at the end of every update.

Under `jit_compile`, with one tower on the parameter device (`--ps_device=gpu`, which `auto`
picks for one tower on a GPU), XLA compiles the whole of `accumulate` and `update`, the
reduction and the optimizer's apply too, as Keras compiles its train step, when every variable
they read is on that device (checked once, from the variables the first update's trace
captures; else the passes alone are compiled, and one line says why). Elsewhere XLA compiles
the towers' passes only: it cannot reach across devices.

An update whose total weight is 0, or whose loss or gradient holds a
non-finite value, is not applied at all: no weight, optimizer slot, counter or
BatchNorm statistic moves. `UpdateRule.decide` decides, and tower mode, which
has no replica context, acts on its decision in a `tf.cond` on the parameter
device.
"""
from __future__ import annotations

import functools
from typing import Callable, Iterator, Mapping, Sequence

import tensorflow as tf
from absl import logging

from tower_train.data.source import Preprocess
from tower_train.devices import HOST_DEVICE, canonical_device
from tower_train.step.device_feed import feed_devices, shard_specs
from tower_train.step.inner_step import BatchSpec, Decision, Shards, UpdateResult
from tower_train.step.pooled_moments import PooledMoments, moment_shapes, moving_layers
from tower_train.step.tower_layout import TowerPlacement, TowerSetup, TowerSums
from tower_train.step.towers import (TowerResult, compiled_towers, labels_per_shard, pass_seeds,
                                     run_on_towers, seed_generator_states, tower_function)
from tower_train.step.update_rule import TrainingStatistics, UpdateRule
from tower_train.step.update_sums import UpdateSums

class TowerStep:
    """The inner step of tower mode for one model, optimizer and device layout."""

    def __init__(self, *, rule: UpdateRule, tower_devices: Sequence[str], placement: TowerPlacement, accum: int,
                 shard_sizes: Sequence[int], jit_compile: bool = False, tower_weights: str = "per_update",
                 transfer_dtype: str = "float32", prepare: Preprocess | None = None, sparse_steps: bool = False,
                 pooled_moments: bool = False):
        """`placement`: where the rule's variables live; it builds the `TowerLayout` (created
        after any restore, `Run.inner`, so a layout's own state starts from the restored one).
        `tower_weights`: "per_update" or "per_micro_step" (`TrainConfig.tower_weights`).
        `transfer_dtype`: the dtype the towers' gradient sums cross devices in (float32, bfloat16
        or float16). `prepare`: the source's `model_input`, which each tower applies to its shard
        of a `data/source.RawInput` batch (`towers.prepared`). `sparse_steps`: the variables
        whose gradient reaches them as occurrences (`TowerModel.sparse_gradients`) are stepped
        with the update's occurrences, as Keras's fit steps them (`TrainConfig.sparse_steps`);
        a `ParameterDeviceLayout`'s only. `pooled_moments`: BN's moving statistics move once per
        update, from its pooled moments (`TrainConfig.bn_statistics`, `pooled_moments`)."""
        model = rule.model
        self._sparse = tuple(j for j, sparse in enumerate(model.sparse_gradients) if sparse and sparse_steps)
        normalizing = moving_layers(model) if pooled_moments else []
        if jit_compile:
            self._run_towers = compiled_towers(model, rule.loss_scale, prepare, self._sparse, normalizing)
        else:
            self._run_towers = functools.partial(run_on_towers, tower_function(
                model, rule.loss_scale, prepare=prepare, sparse=self._sparse, moments=normalizing))
        self._rule = rule
        self._devices = tuple(tower_devices)
        self._shard_sizes = tuple(shard_sizes)  # examples of each tower per micro-step
        self._accum = accum
        self._examples_per_update = sum(shard_sizes) * accum  # G
        self.layout = placement.tower_layout(TowerSetup(rule, self._devices, accum, tower_weights, jit_compile,
                                                        tf.as_dtype(transfer_dtype)))
        self._generator_states = seed_generator_states(model)  # None: a model without randomness
        with tf.device(self.layout.host):
            self._statistics = TrainingStatistics(model)
            self._pooled = PooledMoments(normalizing, self._statistics) if normalizing else None
            if self._generator_states is not None:
                self._micro_step = tf.Variable(0, dtype=tf.int64, trainable=False, name="micro_step")
        # Per tower, on its device, at K > 1: its sums of the update so far.
        self._sums: list[UpdateSums] = []
        if accum > 1:
            for i, device in enumerate(self._devices):
                with tf.device(device):
                    self._sums.append(UpdateSums(model, prefix=f"tower_{i}_", sparse=self._sparse,
                                                 passes_held=accum - 1, moments=moment_shapes(normalizing)))
        self.refresh_weights = tf.function(self._refresh_weights, autograph=False)
        self.accumulate = tf.function(self._accumulate, autograph=False)
        self.update = tf.function(self._update, autograph=False)
        # The device XLA may compile whole updates on: the one tower's, which holds the variables.
        one_device = len(self._devices) == 1 and canonical_device(self._devices[0]) == canonical_device(self.layout.host)
        self._whole_device = canonical_device(self._devices[0]) if jit_compile and one_device else None
        self._steps: tuple[Callable | None, Callable] | None = None  # (accumulate, update), at the first update
        self._micro_steps = tf.function(self._all_micro_steps)  # with AutoGraph: it loops on a tensor

    @property
    def copies_weights(self) -> bool:
        """Whether some tower reads its own copy of the weights (refreshed once per update)."""
        return any(copies is not None for copies in self.layout.copies)

    def feed(self, dataset: tf.data.Dataset, copy_ahead: bool | None = None) -> Iterator[Shards]:
        """`dataset`'s global micro-batches, each tower's shard copied ahead to its device if
        `copy_ahead` (None: if that is an accelerator; `device_feed.feed_devices`)."""
        return feed_devices(dataset, self._devices, self._shard_sizes, HOST_DEVICE, copy_ahead)

    def run_update(self, batches: Iterator[Shards], at_once: object | None = None) -> UpdateResult:
        """Takes K global micro-batches (`feed`'s) from `batches` and applies one update. At K > 1,
        after the first update, the K micro-steps run in one call reading `at_once` (`feed`'s
        iterator) inside it, where given: Python's cost per update then stays that of one call."""
        self.layout.before_update()
        if self.copies_weights:
            self.refresh_weights()
        if at_once is not None and self._accum > 1 and self._steps is not None:
            result = UpdateResult(*self._micro_steps(at_once))
        else:
            # A tuple whichever feed gave the shards: a list would trace the functions again.
            shards = tuple(next(batches))
            accumulate, update = self._step_functions(shards)
            for _ in range(self._accum - 1):
                accumulate(shards)
                shards = tuple(next(batches))
            result = UpdateResult(*update(shards))
        self.layout.after_update(result)
        return result

    def _step_functions(self, shards: Shards) -> tuple[Callable | None, Callable]:
        """(accumulate, update) as the updates call them (accumulate None at K = 1, where it never
        runs): the concrete functions of the first update's shards, whose shapes every
        micro-batch of a stream has (examples of fully known shape, in micro-batches of one size:
        `data/source.py`). Calling a concrete function skips the dispatch on its arguments'
        types that a tf.function makes on every call: a third of the update time of the dense
        model in docs/performance.md's comparison with Keras's fit. Compiled whole by XLA on the
        one device (`_whole_device`) where every variable their traces capture lives there; else
        `accumulate` and `update` as built."""
        if self._steps is None:
            def traced(functions: tuple) -> tuple:
                return (functions[0].get_concrete_function(shards) if self._accum > 1 else None,
                        functions[1].get_concrete_function(shards))

            if self._whole_device is not None:
                compiled = traced(tuple(tf.function(f, jit_compile=True, autograph=False)
                                        for f in (self._accumulate, self._update)))
                elsewhere = sorted({canonical_device(handle.device)
                                    for f in compiled if f is not None for handle in f.captured_inputs
                                    if handle.dtype == tf.resource} - {self._whole_device})
                if elsewhere:
                    logging.warning("--jit_compile: XLA compiles the towers' passes only, not the whole "
                                    "update: it reads variables on %s, not only on %s",
                                    ", ".join(elsewhere), self._whole_device)
                else:
                    self._steps = tuple(f and _called_on(self._whole_device, f) for f in compiled)
            if self._steps is None:
                self._steps = traced((self.accumulate, self.update))
        return self._steps

    def _all_micro_steps(self, iterator) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor, tf.Tensor]:
        """An update's K micro-steps reading `iterator` (`feed`'s): `_step_functions`' accumulate
        K - 1 times in a loop, then its update, called as traced (their graphs are not traced again)."""
        accumulate, update = self._steps
        for _ in tf.range(self._accum - 1):
            accumulate(tuple(iterator.get_next()))
        return update(tuple(iterator.get_next()))

    def sync_state(self) -> None:
        self.layout.sync_state()

    def state_written(self) -> None:
        self.layout.state_written()

    def held_finite(self) -> bool:
        return self.layout.held_finite()

    @property
    def overlaps_updates(self) -> bool:
        return not self.layout.holds_state

    def traced_update(self, spec: BatchSpec) -> list[tuple[object, int]]:
        shards = shard_specs(spec, self._shard_sizes)
        runs = [(self.refresh_weights.get_concrete_function(), 1)] if self.copies_weights else []
        if self._accum > 1:
            runs.append((self.accumulate.get_concrete_function(shards), self._accum - 1))
        return runs + [(self.update.get_concrete_function(shards), 1)]

    def variable_roles(self) -> Mapping[str, Sequence]:
        model = self._rule.model
        layout = self.layout.variable_roles()
        # Every tower's gradient sums, then its loss sums, then its weight sums (and batch losses').
        sums = ([v for tower in self._sums for v in tower.gradient_variables]
                + [v for scalars in zip(*(tower.scalar_variables for tower in self._sums)) for v in scalars])
        return {"weights": model.trainable_variables + layout["weights"], "gradients": sums,
                "statistics": model.non_trainable_weights, "held": layout["held"]}

    def _refresh_weights(self) -> None:
        self.layout.refresh_weights()

    def _towers(self, shards: Shards) -> list:
        shards = [(*shard, weights) for shard, weights in zip(shards, self.layout.tower_weights(), strict=True)]
        if self._generator_states is not None:
            with tf.device(self.layout.host):
                update, micro_step = self._rule.step.read_value(), self._micro_step.read_value()
                shards = [(*shard, pass_seeds(self._generator_states, update, micro_step, i))
                          for i, shard in enumerate(shards)]
                self._micro_step.assign_add(1)
        results = self._run_towers(self._devices, shards)
        model = self._rule.model
        if model.tracks_training_metrics:  # where the metrics live: each tower's outputs come there
            with tf.device(self.layout.host):
                for shard, result in zip(shards, results, strict=True):
                    model.update_training_metrics(shard[1], result.outputs)
        return results

    def _accumulate(self, shards: Shards) -> None:
        """A micro-step that does not update: N shards, [b_i, ...] each on tower i -> nothing."""
        for device, sums, result in zip(self._devices, self._sums, self._towers(shards), strict=True):
            with tf.device(device):
                sums.add(result)

    def _update(self, shards: Shards) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor, tf.Tensor]:
        """The last micro-step of an update; returns (the update's weighted mean loss, its total
        weight, its `Decision`, whether the state it leaves is finite)."""
        results = []
        for i, (device, result) in enumerate(zip(self._devices, self._towers(shards), strict=True)):
            with tf.device(device):  # the update's earlier micro-steps too (none at K = 1)
                results.append(self._sums[i].plus(result) if self._sums else result)
        counts = labels_per_shard(shards[0][2].shape, self._shard_sizes)  # by the weights, one per label
        with tf.device(self.layout.host):
            total_weight = tf.add_n([result.weight_sum for result in results])
            safe_weight = tf.where(total_weight > 0, total_weight, 1.0)  # W = 0 is refused below
        tower_grads = []
        for device, result, count, size in zip(self._devices, results, counts, self._shard_sizes, strict=True):
            with tf.device(device):
                grads = result.gradients
                if result.batch_gradients is not None:
                    # combine_gradients multiplies tower i's sum by c_i / W; the batch losses' must
                    # come out multiplied by b_i / G.
                    factor = safe_weight * (size / (count * self._examples_per_update))
                    grads = [g + b * factor for g, b in zip(grads, result.batch_gradients, strict=True)]
            tower_grads.append(grads)
        mean_loss, decision, apply = self.layout.reduce(TowerSums(
            tower_grads, counts, total_weight, safe_weight,
            lambda regularization: self._mean_loss(results, total_weight, regularization),
            self._sparse, [result.slices for result in results]))
        with tf.device(self.layout.host):
            # The moments of the update's G examples (`pooled_moments`), summed over its towers.
            moments = [tf.add_n(list(parts)) for parts in zip(*(result.moments for result in results))]
            self._settle(decision, apply, moments)
            state_finite = self._rule.state_finite()
        for device, sums in zip(self._devices, self._sums):  # none at K = 1
            with tf.device(device):
                sums.clear()
        if self._generator_states is not None:
            with tf.device(self.layout.host):
                self._micro_step.assign(0)
        return mean_loss, total_weight, decision, state_finite

    def _mean_loss(self, results: Sequence[TowerResult], total_weight: tf.Tensor,
                   regularization: tf.Tensor) -> tf.Tensor:
        """The update's weighted mean loss plus the regularization, on the current device."""
        mean_loss = (tf.math.divide_no_nan(tf.add_n([result.loss_sum for result in results]), total_weight)
                     + regularization)
        if self._rule.model.adds_batch_losses:  # their mean over the update's G examples
            mean_loss += tf.add_n([result.batch_loss * (size / self._examples_per_update)
                                   for result, size in zip(results, self._shard_sizes, strict=True)])
        return mean_loss

    def _settle(self, decision: tf.Tensor, apply: Callable[[], object], moments: Sequence[tf.Tensor]) -> None:
        """On the current device (the layout's host): `apply()` and keep the BN statistics (moved
        by the update's pooled `moments` first, under `pooled_moments`) if the update is
        applied, else put them back and refuse it."""
        def applied() -> None:
            apply()
            if self._pooled is not None:
                self._pooled.apply(moments)
            self._statistics.keep()

        def refused() -> None:
            self._statistics.restore()
            self._rule.refuse(decision)

        tf.cond(tf.equal(decision, int(Decision.APPLIED)), applied, refused)


def _called_on(device: str, function: Callable) -> Callable:
    """`function` called under `device`: an XLA cluster runs where its call is placed."""
    def call(*args):
        with tf.device(device):
            return function(*args)

    return call
