"""--ps_device=spread: the training state tower mode keeps in slices on the tower devices.

`devices.slice_rows` cuts the trainable variables along their first axis into byte-balanced
shares, one per tower device. `SpreadState` holds, on each slice's device, the slice of the
weights, the optimizer's slots for it and its moving average, and updates them there
(`apply`): the optimizer's update is elementwise, so a slice updated alone changes as its rows
of the whole variable would, to float rounding. The slots belong to a second optimizer of the same class
and settings, built over the slices (Keras creates each slot beside its variable).
`tower_mode.TowerStep` sends each tower the slices it needs and each owner its rows of the
gradient sums.

The TrainState on the host stays what a checkpoint holds, so checkpoints are the same whatever
--ps_device wrote them, and a run may resume under another placement: `scatter` fills the slices
from it when the step is built (after any restore), and `gather` writes them back into it when
something reads it (a save, an evaluation, a Keras callback, the end of training).
"""
from __future__ import annotations

import collections
from typing import Sequence

import keras
import tensorflow as tf

from tower_train.devices import Slice, SpreadPlacement
from tower_train.errors import UsageError
from tower_train.schedules import MovingAverage
from tower_train.update_rule import tensors_finite

_SLICE_NAME = "spread_slice_{}"


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
        self.scatter = tf.function(self._scatter_values)
        self.gather = tf.function(self._gather_values)
        self._finite = tf.function(self._all_finite)
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
