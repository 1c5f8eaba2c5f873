"""Tower mode's inner step: towers on their devices, variables on the parameter device.

An update of K micro-steps is K - 1 calls of `accumulate` and one of `update`,
each a separate tf.function, so that no `tf.cond` decides whether to apply:

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

With `--ps_device=spread` (a `SpreadPlacement`) the trainable weights, their slots and averages
live in slices on the tower devices (`spread.SpreadState`) instead, and the host keeps the
counters, the BN statistics and the checkpoint's copy. Every tower keeps a copy of the weights,
joined once per update from the slices (`refresh_weights`, at every K); `update` sends each
slice's owner its rows of every tower's gradient sums, the owners combine and apply them, and
the host decides from one flag (and one partial squared norm, for clipping) per owner. A tower
receives and sends only the rows it does not own, each in the dtype the rule above gives.

A model that adds losses of the batch through Keras (`add_loss`, activity
regularizers) has a second gradient sum per tower, that of those losses,
which the update folds into the first on the tower's device before it
travels (`towers` has the math): more memory and a second backward pass, no
more gradient bytes (each tower waits for the update's total weight W).

A model with randomness (Dropout) gets, in each tower's pass, the seeds
`towers.pass_seeds` makes of (its generators' seeds, the step counter, the
micro-step, the tower), computed on the parameter device; the micro-step is
counted there and set back to 0 at the end of every update.

An update whose total weight is 0, or whose loss or gradient holds a
non-finite value, is not applied at all: no weight, optimizer slot, counter or
BatchNorm statistic moves. `UpdateRule.decide` decides, and tower mode, which
has no replica context, acts on its decision in a `tf.cond` on the parameter
device.
"""
from __future__ import annotations

from typing import Callable, Iterator, Mapping, Sequence

import tensorflow as tf

from tower_train.data import Preprocess
from tower_train.devices import OneDevice, SpreadPlacement, canonical_device
from tower_train.inner_step import Batch, BatchSpec, Decision, UpdateResult
from tower_train.spread import SpreadState, joined
from tower_train.towers import (TowerResult, combine_gradients, compiled_tower_function, labels_per_shard,
                                pass_seeds, read_in_compute_dtype, regularization_gradients, run_on_towers,
                                seed_generator_states, split_batch, tower_function)
from tower_train.update_rule import TrainingStatistics, UpdateRule, tensors_finite
from tower_train.update_sums import UpdateSums


class TowerStep:
    """The inner step of tower mode for one model, optimizer and device layout."""

    def __init__(self, rule: UpdateRule, tower_devices: Sequence[str], placement: OneDevice | SpreadPlacement,
                 accum: int, shard_sizes: Sequence[int], jit_compile: bool = False, tower_weights: str = "per_update",
                 transfer_dtype: str = "float32", prepare: Preprocess | None = None):
        """`placement`: where the rule's variables live (the parameter device), which also holds
        the update's counters and decides it; or `SpreadPlacement`, whose slices the towers'
        devices hold and update (`spread.SpreadState`), its host holding the rest. `tower_weights`:
        "per_update" or "per_micro_step" (`TrainConfig.tower_weights`; spread: per_update).
        `transfer_dtype`: the dtype the towers' gradient sums cross devices in (float32, bfloat16
        or float16). `prepare`: the source's `model_input`, which each tower applies to its shard
        of a `data.RawInput` batch (`towers.prepared`)."""
        model = rule.model
        self._jit_compile = jit_compile
        self._tower = (compiled_tower_function(model, rule.loss_scale, prepare) if jit_compile
                       else tower_function(model, rule.loss_scale, prepare=prepare))
        self._rule = rule
        self._devices = tuple(tower_devices)
        self._shard_sizes = tuple(shard_sizes)  # examples of each tower per micro-step
        self._placement = placement
        spread = isinstance(placement, SpreadPlacement)
        param_device = self._param_device = placement.host if spread else placement.device
        self._accum = accum
        self._examples_per_update = sum(shard_sizes) * accum  # G
        # Per tower: whether it is on another device than the variables, so that what it reads
        # and returns crosses devices.
        self._remote = [canonical_device(d) != canonical_device(param_device) for d in self._devices]
        self._transfer_dtype = tf.as_dtype(transfer_dtype)
        # Per trainable variable: whether its value travels to the towers in the compute dtype.
        self._narrow_weights = read_in_compute_dtype(model)
        self._generator_states = seed_generator_states(model)  # None: a model without randomness
        with tf.device(param_device):
            self._statistics = TrainingStatistics(model)
            if self._generator_states is not None:
                self._micro_step = tf.Variable(0, dtype=tf.int64, trainable=False, name="micro_step")
        # Per tower, on its device, at K > 1: its sums of the update so far.
        self._sums: list[UpdateSums] = []
        if accum > 1:
            for i, device in enumerate(self._devices):
                with tf.device(device):
                    self._sums.append(UpdateSums(model, prefix=f"tower_{i}_"))
        # The slices of the weights, slots and averages, on the towers' devices; created after any
        # restore (`Run.inner`), so they start from the restored state.
        self._spread = (SpreadState(model.trainable_variables, rule.optimizer, rule.moving_average, placement)
                        if spread else None)
        self._synced = True  # whether the TrainState's variables hold the slices' values
        self._written = False  # whether they were written since, so that the slices must take them
        # Per tower, on its device: a copy of the trainable weights, or None to read them from the
        # parameter device. Not state: a TowerStep is not checkpointed, and each update refreshes them.
        # Spread: every tower, since the TrainState's weights are not current.
        copied = tower_weights == "per_update" and accum > 1
        self._weight_copies: list[list[tf.Variable] | None] = []
        for i, (device, remote) in enumerate(zip(self._devices, self._remote, strict=True)):
            if spread or (copied and remote):
                with tf.device(device):
                    self._weight_copies.append([
                        tf.Variable(tf.zeros(v.shape, model.compute_dtype if narrow else v.dtype),
                                    trainable=False, name=f"tower_{i}_weights_{j}")
                        for j, (v, narrow) in enumerate(zip(model.trainable_variables, self._narrow_weights,
                                                            strict=True))])
            else:
                self._weight_copies.append(None)
        self.refresh_weights = tf.function(self._refresh_weights)
        self.accumulate = tf.function(self._accumulate)
        self.update = tf.function(self._update)

    @property
    def copies_weights(self) -> bool:
        """Whether some tower reads its own copy of the weights (refreshed once per update)."""
        return any(copies is not None for copies in self._weight_copies)

    def run_update(self, batches: Iterator[Batch]) -> UpdateResult:
        """Takes K global micro-batches from `batches` and applies one update."""
        if self._written:
            self._spread.scatter()
            self._written = False
        if self.copies_weights:
            self.refresh_weights()
        for _ in range(self._accum - 1):
            self.accumulate(*next(batches))
        result = UpdateResult.of(*self.update(*next(batches)))
        self._synced = self._synced and not (self._spread is not None and result.applied)
        return result

    def sync_state(self) -> None:
        if not self._synced:
            self._spread.gather()
            self._synced = True

    def state_written(self) -> None:
        self._written = self._spread is not None

    def held_finite(self) -> bool:
        return self._spread is None or self._spread.finite()

    def traced_update(self, spec: BatchSpec) -> list[tuple[object, int]]:
        runs = [(self.refresh_weights.get_concrete_function(), 1)] if self.copies_weights else []
        if self._accum > 1:
            runs.append((self.accumulate.get_concrete_function(*spec), self._accum - 1))
        return runs + [(self.update.get_concrete_function(*spec), 1)]

    def variable_roles(self) -> Mapping[str, Sequence]:
        model = self._rule.model
        copies = [c for tower in self._weight_copies if tower is not None for c in tower]
        # Every tower's gradient sums, then its loss sums, then its weight sums (and batch losses').
        sums = ([v for tower in self._sums for v in tower.gradient_variables]
                + [v for scalars in zip(*(tower.scalar_variables for tower in self._sums)) for v in scalars])
        slices = [] if self._spread is None else self._spread.weights
        return {"weights": model.trainable_variables + copies + slices, "gradients": sums,
                "statistics": model.non_trainable_weights,
                "held": [] if self._spread is None else self._spread.held_variables()}

    def _refresh_weights(self) -> None:
        """Copies the current trainable weights to every tower that keeps a copy: the only
        weight traffic of the update. Spread: each tower joins its copy of a weight from the
        weight's slices, which their owners send (cast to the compute dtype where it is read in
        it); a tower receives only the slices it does not own."""
        sent = self._sent_weights() if self._spread is None else self._sent_slices()
        for device, copies in zip(self._devices, self._weight_copies, strict=True):
            if copies is not None:
                with tf.device(device):
                    for j, copy in enumerate(copies):
                        copy.assign(sent[j] if self._spread is None
                                    else joined([sent[k] for k in self._spread.slices_of[j]]))

    def _sent_slices(self) -> list[tf.Tensor]:
        """Spread: each slice as it travels to the towers, read (and cast to the compute dtype
        where its weight is read in it) on its owner."""
        model, spread = self._rule.model, self._spread
        sent = []
        for k, piece in enumerate(spread.slices):
            with tf.device(spread.devices[piece.owner]):
                value = spread.weights[k].value.read_value()
                sent.append(tf.cast(value, model.compute_dtype) if self._narrow_weights[piece.variable] else value)
        return sent

    def _sent_weights(self) -> list:
        """The trainable weights as they travel to the towers: the variables themselves, or, where
        a tower reads one in the compute dtype, its value cast to that on the device holding it."""
        model = self._rule.model
        sent = []
        for v, narrow in zip(model.trainable_variables, self._narrow_weights, strict=True):
            with tf.device(self._placement.device_of(v)):
                sent.append(tf.cast(v, model.compute_dtype) if narrow else v)
        return sent

    def _towers(self, batch: Batch) -> list:
        weights = list(self._weight_copies)
        # The towers without a copy that read what the parameter device sends: those off it when
        # weights travel narrowed, and every one under XLA, whose compiled pass reads no variable.
        reads = [copies is None and (remote or self._jit_compile)
                 for copies, remote in zip(weights, self._remote, strict=True)]
        if (any(self._narrow_weights) or self._jit_compile) and any(reads):
            sent = self._sent_weights()  # read once per micro-step, then sent to each tower
            weights = [sent if read else copies for copies, read in zip(weights, reads, strict=True)]
        shards = [(*shard, copies) for shard, copies in
                  zip(split_batch(batch, self._shard_sizes), weights, strict=True)]
        if self._generator_states is not None:
            with tf.device(self._param_device):
                update, micro_step = self._rule.step.read_value(), self._micro_step.read_value()
                shards = [(*shard, pass_seeds(self._generator_states, update, micro_step, i))
                          for i, shard in enumerate(shards)]
                self._micro_step.assign_add(1)
        return run_on_towers(self._tower, self._devices, shards)

    def _accumulate(self, features: tf.Tensor, labels: tf.Tensor, weights: tf.Tensor) -> None:
        """A micro-step that does not update: a global micro-batch [N*b, ...] -> nothing."""
        for device, sums, result in zip(self._devices, self._sums, self._towers((features, labels, weights)),
                                        strict=True):
            with tf.device(device):
                sums.add(result)

    def _update(self, features: tf.Tensor, labels: tf.Tensor,
                weights: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
        """The last micro-step of an update; returns (the update's weighted mean loss, its total
        weight, its `Decision`)."""
        results = []
        for i, (device, result) in enumerate(zip(self._devices, self._towers((features, labels, weights)),
                                                 strict=True)):
            with tf.device(device):  # the update's earlier micro-steps too (none at K = 1)
                results.append(self._sums[i].plus(result) if self._sums else result)
        counts = labels_per_shard(weights.shape, self._shard_sizes)
        with tf.device(self._param_device):
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
        reduce = self._reduce_on_parameter_device if self._spread is None else self._reduce_on_owners
        mean_loss, decision = reduce(tower_grads, results, counts, total_weight, safe_weight)
        for device, sums in zip(self._devices, self._sums):  # none at K = 1
            with tf.device(device):
                sums.clear()
        if self._generator_states is not None:
            with tf.device(self._param_device):
                self._micro_step.assign(0)
        return mean_loss, total_weight, decision

    def _mean_loss(self, results: Sequence[TowerResult], total_weight: tf.Tensor,
                   regularization: tf.Tensor) -> tf.Tensor:
        """The update's weighted mean loss plus the regularization, on the current device."""
        mean_loss = (tf.math.divide_no_nan(tf.add_n([result.loss_sum for result in results]), total_weight)
                     + regularization)
        if self._rule.model.adds_batch_losses:  # their mean over the update's G examples
            mean_loss += tf.add_n([result.batch_loss * (size / self._examples_per_update)
                                   for result, size in zip(results, self._shard_sizes, strict=True)])
        return mean_loss

    def _reduce_on_parameter_device(self, tower_grads: list[list[tf.Tensor]], results: Sequence[TowerResult],
                                    counts: Sequence[float], total_weight: tf.Tensor,
                                    safe_weight: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        """Every tower's gradient sums to the parameter device, which combines, decides and
        applies; returns (the mean loss, the `Decision`)."""
        if self._transfer_dtype != tf.float32:
            for i, (device, remote) in enumerate(zip(self._devices, self._remote, strict=True)):
                if remote:
                    with tf.device(device):
                        tower_grads[i] = [tf.cast(g, self._transfer_dtype) for g in tower_grads[i]]
        rule = self._rule
        with tf.device(self._param_device):
            variables = rule.model.trainable_variables
            tower_grads = [[tf.cast(g, v.dtype) for g, v in zip(grads, variables, strict=True)]
                           for grads in tower_grads]  # back from transfer_dtype; else nothing
            regularization, regularization_grads = regularization_gradients(rule.model)
            mean_loss = self._mean_loss(results, total_weight, regularization)
            mean_grads = combine_gradients(tower_grads, counts, safe_weight)
            if rule.loss_scale is not None:
                mean_grads = rule.loss_scale.unscale(mean_grads)
            mean_grads = [g + r for g, r in zip(mean_grads, regularization_grads, strict=True)]
            decision = rule.decide(total_weight, tensors_finite([mean_loss, *mean_grads]), mean_loss)
            self._settle(decision, lambda: rule.apply(rule.clip(mean_grads)))
        return mean_loss, decision

    def _reduce_on_owners(self, tower_grads: list[list[tf.Tensor]], results: Sequence[TowerResult],
                          counts: Sequence[float], total_weight: tf.Tensor,
                          safe_weight: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        """Spread: each tower sends each slice's owner its rows of the gradient sums; each owner
        combines its slices' gradients, adds the regularization's and sends the host one finite
        flag and one squared norm; the host decides, and each owner applies its slices (clipped
        by the global norm). Returns (the mean loss, the `Decision`)."""
        rule, spread = self._rule, self._spread
        variables = rule.model.trainable_variables
        pieces = []  # per tower, per slice: its rows of the tower's gradient sums
        for device, grads in zip(self._devices, tower_grads, strict=True):
            with tf.device(device):
                row = [spread.rows(grads[piece.variable], k) for k, piece in enumerate(spread.slices)]
                if self._transfer_dtype != tf.float32:
                    row = [part if canonical_device(spread.devices[piece.owner]) == canonical_device(device)
                           else tf.cast(part, self._transfer_dtype) for part, piece in zip(row, spread.slices)]
            pieces.append(row)
        with tf.device(self._param_device):
            rate = rule.optimizer.learning_rate  # at this update, before the count moves
            update_number = rule.step.read_value() + 1
        owner_grads, halves, finite = {}, [], []
        regularization = None
        for d, device in enumerate(self._devices):
            if not spread.owned[d] and d > 0:
                continue
            with tf.device(device):
                # Tower d's copy of the weights, exact: its own rows from its slices.
                regularization_d, regularization_grads = regularization_gradients(rule.model, self._exact_weights(d))
                regularization = regularization_d if regularization is None else regularization
                grads = []
                for k in spread.owned[d]:
                    j = spread.slices[k].variable
                    grad = combine_gradients([[tf.cast(row[k], variables[j].dtype)] for row in pieces], counts,
                                             safe_weight)[0]
                    if rule.loss_scale is not None:
                        grad = rule.loss_scale.unscale([grad])[0]
                    grads.append(grad + spread.rows(regularization_grads[j], k))
                if grads:
                    owner_grads[d] = grads
                    if rule.clip_norm is not None:
                        halves.append(rule.half_squared_norm(grads))
                    finite.append(tensors_finite(grads))
        with tf.device(self._param_device):
            mean_loss = self._mean_loss(results, total_weight, regularization)
            decision = rule.decide(total_weight, tf.reduce_all(tf.stack([tf.math.is_finite(mean_loss), *finite])),
                                   mean_loss)
            applied = tf.equal(decision, int(Decision.APPLIED))
            norm = None if rule.clip_norm is None else rule.global_norm(halves)
        for d, grads in owner_grads.items():
            with tf.device(self._devices[d]):
                tf.cond(applied, lambda d=d, grads=grads: spread.apply(d, rule.clip(grads, norm), rate, update_number),
                        lambda: None)
        with tf.device(self._param_device):
            self._settle(decision, lambda: (rule.count_update(), spread.count_update()))
        return mean_loss, decision

    def _settle(self, decision: tf.Tensor, apply: Callable[[], object]) -> None:
        """On the current device (the parameter device, or spread's host): `apply()` and keep
        the BN statistics if the update is applied, else put them back and refuse it."""
        def applied() -> None:
            apply()
            self._statistics.keep()

        def refused() -> None:
            self._statistics.restore()
            self._rule.refuse(decision)

        tf.cond(tf.equal(decision, int(Decision.APPLIED)), applied, refused)

    def _exact_weights(self, device: int) -> list[tf.Tensor]:
        """Spread: the trainable weights at tower `device`, from its copy, except where the copy
        is in the compute dtype: there its own slices' rows are taken exact, the others are the
        copy's (so the regularization's gradient is exact on its rows for a per-weight penalty)."""
        spread, copies = self._spread, self._weight_copies[device]
        weights = []
        for j, (copy, variable) in enumerate(zip(copies, self._rule.model.trainable_variables, strict=True)):
            value = tf.cast(copy, variable.dtype)
            if self._narrow_weights[j]:
                value = joined([spread.weights[k].value if spread.slices[k].owner == device else spread.rows(value, k)
                                for k in spread.slices_of[j]])
            weights.append(value)
        return weights

