"""--ps_device=spread: the training state tower mode keeps in slices on the tower devices.

`slice_rows` cuts the trainable variables along their first axis into byte-balanced
shares, one per tower device. `SpreadState` holds, on each slice's device, the slice of the
weights, the optimizer's slots for it and its moving average, and updates them there
(`apply`): the optimizer's update is elementwise, so a slice updated alone changes as its rows
of the whole variable would, to float rounding. The slots belong to a second optimizer of the same class
and settings, built over the slices (Keras creates each slot beside its variable).
`SpreadLayout`, the `tower_layout.TowerLayout` of `SpreadPlacement`, sends each tower the slices
it needs and each owner its rows of the gradient sums.

The TrainState on the host stays what a checkpoint holds, so checkpoints are the same whatever
--ps_device wrote them, and a run may resume under another placement: `scatter` fills the slices
from it when the step is built (after any restore), and `gather` writes them back into it when
something reads it (a save, an evaluation, a Keras callback, the end of training).
"""
from __future__ import annotations

import collections
import dataclasses
import math
from typing import Callable, ContextManager, Mapping, Sequence

import keras
import tensorflow as tf

from tower_train.devices import canonical_device
from tower_train.errors import UsageError
from tower_train.step.inner_step import Decision, UpdateResult
from tower_train.step.schedules import MovingAverage
from tower_train.step.tower_layout import TowerLayout, TowerSetup, TowerSums, weight_copies
from tower_train.step.towers import combine_gradients, read_in_compute_dtype, regularization_gradients
from tower_train.step.update_rule import tensors_finite

_SLICE_NAME = "spread_slice_{}"


@dataclasses.dataclass(frozen=True)
class Slice:
    """Rows [start, stop) of trainable variable `variable`'s first axis (a scalar is one row),
    held and updated by tower device `owner`."""

    variable: int
    start: int
    stop: int
    owner: int


def slice_rows(variable_rows: Sequence[tuple[int, int]], owners: int) -> list[Slice]:
    """Cuts variables into `owners` byte-balanced shares, along their first axis.

    Args:
      variable_rows: per variable, (its rows, the bytes of one row).
      owners: the number of devices, N >= 1.

    Returns:
      The slices, ordered by variable and then by row. The variables, largest first (ties in
      their order), are laid end to end, and device d takes the rows that start in bytes
      [d T / N, (d + 1) T / N) of that line, T being the total: TF1's greedy placement, largest
      first, with a variable too large for one device cut into partitions, as its partitioned
      variables were. A device holds at most T / N plus one row.
    """
    sizes = [rows * row_bytes for rows, row_bytes in variable_rows]
    total = sum(sizes)
    slices, offset = [], 0
    for j in sorted(range(len(sizes)), key=lambda j: -sizes[j]):
        rows, row_bytes = variable_rows[j]
        if sizes[j] == 0:  # no bytes to balance: one slice, on the first device
            slices.append(Slice(j, 0, rows, 0))
            continue
        # The first row of device d's share: the first whose start byte reaches d T / N.
        cuts = [0, *(min(rows, max(0, -(-(d * total - offset * owners) // (row_bytes * owners))))
                     for d in range(1, owners)), rows]
        slices += [Slice(j, cuts[d], cuts[d + 1], d) for d in range(owners) if cuts[d] < cuts[d + 1]]
        offset += sizes[j]
    return sorted(slices, key=lambda s: (s.variable, s.start))


def variable_rows(variables: Sequence) -> list[tuple[int, int]]:
    """(rows, bytes per row) of each variable, as `slice_rows` takes them."""
    return [(v.shape[0] if len(v.shape) else 1,
             math.prod(v.shape[1:]) * _dtype_size(v.dtype)) for v in variables]


def _dtype_size(dtype) -> int:
    return tf.as_dtype(dtype).size


@dataclasses.dataclass(frozen=True)
class SpreadPlacement:
    """--ps_device=spread: the trainable weights, with their optimizer slots and averages, in
    byte-balanced slices on the tower devices (`slice_rows`; `SpreadLayout` keeps them). What a
    checkpoint holds is created on `host`, which also keeps the counters and BN statistics."""

    host: str
    tower_devices: tuple[str, ...]

    @classmethod
    def of(cls, param_device: str, tower_devices: Sequence[str]) -> SpreadPlacement:
        return cls(param_device, tuple(tower_devices))

    def scope(self) -> ContextManager:
        return tf.device(self.host)

    def device_of(self, variable) -> str:
        return self.host

    def slices(self, trainable_variables: Sequence) -> list[Slice]:
        return slice_rows(variable_rows(trainable_variables), len(self.tower_devices))

    def describe(self, trainable_variables: Sequence) -> str:
        held = [0] * len(self.tower_devices)
        rows = variable_rows(trainable_variables)
        for s in self.slices(trainable_variables):
            held[s.owner] += (s.stop - s.start) * rows[s.variable][1]
        shares = ", ".join(f"{device} {size / 1e6:.2f} MB" for device, size in zip(self.tower_devices, held,
                                                                                    strict=True))
        return f"{shares} of weights in slices (their slots and averages beside them), counters on {self.host}"

    def tower_layout(self, setup: TowerSetup) -> TowerLayout:
        return SpreadLayout(setup=setup, placement=self)


def rows_of(value: tf.Tensor, piece: Slice, rows: int) -> tf.Tensor:
    """`piece`'s rows of `value`, a tensor of the whole variable (of `rows` rows; a scalar is
    one), on the current device; the tensor itself when the slice is all of it."""
    if piece.start == 0 and piece.stop == rows:
        return tf.convert_to_tensor(value)
    return value[piece.start:piece.stop]


def joined(parts: Sequence[tf.Tensor]) -> tf.Tensor:
    """A whole variable's value from its slices' values, in row order, on the current device."""
    return tf.convert_to_tensor(parts[0]) if len(parts) == 1 else tf.concat(list(parts), axis=0)


class SpreadState:
    """The slices of the trainable weights, their optimizer slots and their moving averages, each
    on its owner among the tower devices; filled from the TrainState's variables at creation."""

    def __init__(self, variables: Sequence[keras.Variable], optimizer: keras.optimizers.Optimizer,
                 moving_average: MovingAverage | None, placement: SpreadPlacement):
        """`variables`, `optimizer` and `moving_average`: the TrainState's, on the host; their
        current values are scattered to the slices."""
        self.slices = placement.slices(variables)
        self.devices = placement.tower_devices
        self._host = placement.host
        self._variables, self._optimizer, self._moving_average = list(variables), optimizer, moving_average
        self._rows = [v.shape[0] if len(v.shape) else 1 for v in self._variables]
        # Per variable: its slices' indices, in row order.
        self.slices_of = [[k for k, s in enumerate(self.slices) if s.variable == j] for j in range(len(variables))]
        # Per device: the slices it owns.
        self.owned = [[k for k, s in enumerate(self.slices) if s.owner == d] for d in range(len(self.devices))]
        self.weights: list[keras.Variable] = []
        for k, piece in enumerate(self.slices):
            variable = self._variables[piece.variable]
            shape = [piece.stop - piece.start, *variable.shape[1:]] if len(variable.shape) else []
            with tf.device(self.devices[piece.owner]):
                self.weights.append(keras.Variable(tf.zeros(shape, variable.dtype), name=_SLICE_NAME.format(k)))
        settings = optimizer.get_config()
        settings["learning_rate"] = 0.0  # never read: the update passes the TrainState optimizer's rate
        with tf.device(self._host):
            self.optimizer = type(optimizer).from_config(settings)
            self.optimizer.build(self.weights)
        self._slot_pairs = self._pair_slots()
        # Per device: the moving average of its slices (None without --ema_decay).
        self._averages: list[MovingAverage | None] = []
        for d, device in enumerate(self.devices):
            with tf.device(device):
                self._averages.append(None if moving_average is None or not self.owned[d] else
                                      MovingAverage([self.weights[k] for k in self.owned[d]], moving_average.decay))
        self.scatter = tf.function(self._scatter_values, autograph=False)
        self.gather = tf.function(self._gather_values, autograph=False)
        self._finite = tf.function(self._all_finite, autograph=False)
        self.scatter()

    def rows(self, value: tf.Tensor, k: int) -> tf.Tensor:
        """Slice k's rows of `value`, a tensor of its whole variable, on the current device."""
        piece = self.slices[k]
        return rows_of(value, piece, self._rows[piece.variable])

    def apply(self, device: int, clipped: Sequence[tf.Tensor], rate: tf.Tensor, update_number: tf.Tensor) -> None:
        """Applies the update to device `device`'s slices, on it: `clipped[i]` is the gradient of
        its i-th owned slice; `rate` the learning rate; `update_number` the update, from 1, that
        the moving average counts."""
        for k, gradient in zip(self.owned[device], clipped, strict=True):
            self.optimizer.update_step(gradient, self.weights[k], rate)
        if self._averages[device] is not None:
            self._averages[device].update([self.weights[k] for k in self.owned[device]], update_number)

    def count_update(self) -> None:
        """The slices' optimizer counts the update with the TrainState's (Adam's bias correction
        reads it)."""
        self.optimizer.iterations.assign_add(1)

    def held_variables(self) -> list:
        """The slots and averages: state that never leaves its device."""
        return [part for _, _, parts in self._held_pairs() for part in parts]

    def finite(self) -> bool:
        """Whether every value of the slices, their slots and averages is finite: one reduction on
        each device, one boolean from each to the host."""
        return bool(self._finite())

    def _pair_slots(self) -> list[tuple[keras.Variable, int, list[keras.Variable]]]:
        """(a slot of the TrainState's optimizer, its weight's index, the slices' slots that make
        it up, in row order), matched by the names Keras gives slots: "<its weight's path>_<slot>",
        "/" made "_". Every slot of either optimizer is matched exactly once."""
        def prefix(variable) -> str:
            return variable.path.replace("/", "_") + "_"

        prefixes = [prefix(v) for v in self._variables]
        for j, name in enumerate(prefixes):
            if prefixes.index(name) != j:
                raise UsageError(f"--ps_device=spread: weights {self._variables[prefixes.index(name)].path} and "
                                 f"{self._variables[j].path} give their optimizer slots the same names; rename a "
                                 "layer so that their paths differ other than by '/' and '_'")
        whole_slots = {v.name: v for v in self._optimizer.variables}
        part_slots = {v.name: v for v in self.optimizer.variables}
        first = prefix(self.weights[0]) if self.weights else ""
        slot_names = sorted(name[len(first):] for name in part_slots if name.startswith(first))
        pairs = []
        for j, variable in enumerate(self._variables):
            for slot in slot_names:
                parts = [part_slots.get(prefix(self.weights[k]) + slot) for k in self.slices_of[j]]
                whole = whole_slots.get(prefixes[j] + slot)
                if whole is None or any(part is None for part in parts):
                    raise UsageError(f"--ps_device=spread: the optimizer {type(self._optimizer).__name__} has no "
                                     f"slot {slot!r} named after weight {variable.path}: it cannot be split")
                pairs.append((whole, j, parts))
        counters = {id(self._optimizer.iterations), id(getattr(self._optimizer, "_learning_rate", None))}
        slots = [v for v in self._optimizer.variables if id(v) not in counters]
        if len(slots) != len(pairs) or len({id(whole) for whole, _, _ in pairs}) != len(pairs):
            raise UsageError(f"--ps_device=spread: the optimizer {type(self._optimizer).__name__}'s variables "
                             f"{[v.name for v in slots]} are not one slot of each weight per slot name")
        return pairs

    def _held_pairs(self) -> list[tuple[object, int, list]]:
        """(a slot or average of the TrainState, its weight's index, the slices' that make it up)."""
        pairs = list(self._slot_pairs)
        if self._moving_average is not None:
            average_of = {}
            for d, average in enumerate(self._averages):
                if average is not None:
                    average_of.update(zip(self.owned[d], average.averages, strict=True))
            pairs += [(whole, j, [average_of[k] for k in self.slices_of[j]])
                      for j, whole in enumerate(self._moving_average.averages)]
        return pairs

    def _all_pairs(self) -> list[tuple[object, int, list]]:
        """(a TrainState variable the slices make up, its weight's index, those slices' variables)."""
        weights = [(v, j, [self.weights[k] for k in self.slices_of[j]]) for j, v in enumerate(self._variables)]
        return weights + self._held_pairs()

    def _scatter_values(self) -> None:
        """Each slice takes its rows of the TrainState's variables, cut on the host."""
        for whole, j, parts in self._all_pairs():
            for k, part in zip(self.slices_of[j], parts, strict=True):
                with tf.device(self._host):
                    part.assign(self.rows(tf.convert_to_tensor(whole), k))
        self.optimizer.iterations.assign(self._optimizer.iterations)

    def _gather_values(self) -> None:
        """The TrainState's variables take the slices' values, joined on the host."""
        for whole, _, parts in self._all_pairs():
            with tf.device(self._host):
                whole.assign(joined([tf.convert_to_tensor(p) for p in parts]))

    def _all_finite(self) -> tf.Tensor:
        held = collections.defaultdict(list)
        for _, j, parts in self._all_pairs():
            for k, part in zip(self.slices_of[j], parts, strict=True):
                held[self.slices[k].owner].append(part)
        verdicts = []
        for d, parts in sorted(held.items()):
            with tf.device(self.devices[d]):
                verdicts.append(tensors_finite(parts))
        with tf.device(self._host):
            return tf.reduce_all(tf.stack(verdicts)) if verdicts else tf.constant(True)


class SpreadLayout:
    """`SpreadPlacement`'s tower layout: every tower keeps a copy of the weights, joined once per
    update (at every K) from the slices; each slice's owner gets its rows of every tower's
    gradient sums, combines and applies them, and the host decides from one flag (and one partial
    squared norm, for clipping) per owner. A tower receives and sends only the rows it does not
    own, each in the dtype `tower_step` gives (`--precision`, `--transfer_precision`)."""

    holds_state = True  # the slices of the weights, slots and averages

    def __init__(self, *, setup: TowerSetup, placement: SpreadPlacement):
        rule = setup.rule
        self.host = placement.host
        self._setup = setup
        self._narrow_weights = read_in_compute_dtype(rule.model)
        # The slices of the weights, slots and averages, on the towers' devices, from the TrainState.
        self.state = SpreadState(rule.model.trainable_variables, rule.optimizer, rule.moving_average, placement)
        # Every tower: the TrainState's weights are not current.
        self.copies = [weight_copies(rule.model, device, i, self._narrow_weights)
                       for i, device in enumerate(setup.tower_devices)]
        self._synced = True  # whether the TrainState's variables hold the slices' values
        self._written = False  # whether they were written since, so that the slices must take them

    def tower_weights(self) -> list:
        return list(self.copies)

    def refresh_weights(self) -> None:
        """Each tower joins its copy of a weight from the weight's slices, which their owners send
        (cast to the compute dtype where it is read in it); a tower receives only the slices it
        does not own."""
        sent = self._sent_slices()
        for device, copies in zip(self._setup.tower_devices, self.copies, strict=True):
            with tf.device(device):
                for j, copy in enumerate(copies):
                    copy.assign(joined([sent[k] for k in self.state.slices_of[j]]))

    def _sent_slices(self) -> list[tf.Tensor]:
        """Each slice as it travels to the towers, read (and cast to the compute dtype where its
        weight is read in it) on its owner."""
        model, spread = self._setup.rule.model, self.state
        sent = []
        for k, piece in enumerate(spread.slices):
            with tf.device(spread.devices[piece.owner]):
                value = spread.weights[k].value.read_value()
                sent.append(tf.cast(value, model.compute_dtype) if self._narrow_weights[piece.variable] else value)
        return sent

    def reduce(self, sums: TowerSums) -> tuple[tf.Tensor, tf.Tensor, Callable[[], object]]:
        """Each tower sends each slice's owner its rows of the gradient sums; each owner combines
        its slices' gradients, adds the regularization's and sends the host one finite flag and
        one squared norm; the host decides, and each owner applies its slices (clipped by the
        global norm); the host then counts the update."""
        setup, rule, spread = self._setup, self._setup.rule, self.state
        counts, safe_weight = sums.counts, sums.safe_weight
        variables = rule.model.trainable_variables
        pieces = []  # per tower, per slice: its rows of the tower's gradient sums
        for device, grads in zip(setup.tower_devices, sums.gradients, strict=True):
            with tf.device(device):
                row = [spread.rows(grads[piece.variable], k) for k, piece in enumerate(spread.slices)]
                if setup.transfer_dtype != tf.float32:
                    row = [part if canonical_device(spread.devices[piece.owner]) == canonical_device(device)
                           else tf.cast(part, setup.transfer_dtype) for part, piece in zip(row, spread.slices)]
            pieces.append(row)
        with tf.device(self.host):
            rate = rule.optimizer.learning_rate  # at this update, before the count moves
            update_number = rule.step.read_value() + 1
        owner_grads, halves, finite = {}, [], []
        regularization = None
        for d, device in enumerate(setup.tower_devices):
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
        with tf.device(self.host):
            mean_loss = sums.mean_loss(regularization)
            decision = rule.decide(sums.total_weight, tf.reduce_all(tf.stack([tf.math.is_finite(mean_loss), *finite])),
                                   mean_loss)
            applied = tf.equal(decision, int(Decision.APPLIED))
            norm = None if rule.clip_norm is None else rule.global_norm(halves)
        for d, grads in owner_grads.items():
            with tf.device(setup.tower_devices[d]):
                tf.cond(applied, lambda d=d, grads=grads: spread.apply(d, rule.clip(grads, norm), rate, update_number),
                        lambda: None)
        return mean_loss, decision, lambda: (rule.count_update(), spread.count_update())

    def _exact_weights(self, device: int) -> list[tf.Tensor]:
        """The trainable weights at tower `device`, from its copy, except where the copy
        is in the compute dtype: there its own slices' rows are taken exact, the others are the
        copy's (so the regularization's gradient is exact on its rows for a per-weight penalty)."""
        spread, copies = self.state, self.copies[device]
        weights = []
        for j, (copy, variable) in enumerate(zip(copies, self._setup.rule.model.trainable_variables, strict=True)):
            value = tf.cast(copy, variable.dtype)
            if self._narrow_weights[j]:
                value = joined([spread.weights[k].value if spread.slices[k].owner == device else spread.rows(value, k)
                                for k in spread.slices_of[j]])
            weights.append(value)
        return weights

    def before_update(self) -> None:
        if self._written:
            self.state.scatter()
            self._written = False

    def after_update(self, result: UpdateResult) -> None:
        self._synced = self._synced and not result.applied

    def sync_state(self) -> None:
        if not self._synced:
            self.state.gather()
            self._synced = True

    def state_written(self) -> None:
        self._written = True

    def held_finite(self) -> bool:
        return self.state.finite()

    def variable_roles(self) -> Mapping[str, list]:
        return {"weights": [c for tower in self.copies for c in tower] + self.state.weights,
                "held": self.state.held_variables()}
