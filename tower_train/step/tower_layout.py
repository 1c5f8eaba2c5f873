"""Tower mode's contract between its step and its placements: what a `TowerLayout` is built
from (`TowerSetup`), what it reduces (`TowerSums`), and what it does once per update.

`tower_step.TowerStep` runs the towers and the decision, the same for every placement; a
placement (`one_device.OneDevice`, `spread.SpreadPlacement`) builds the layout that says where
the weights come from and where the sums go.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Mapping, Protocol, Sequence

import tensorflow as tf

from tower_train.step.inner_step import UpdateResult
from tower_train.step.placement import Placement
from tower_train.step.update_rule import UpdateRule


@dataclasses.dataclass(frozen=True)
class TowerSetup:
    """What a `TowerLayout` is built for: the rule, the towers and the options of the step."""

    rule: UpdateRule
    tower_devices: tuple[str, ...]
    accum: int
    tower_weights: str  # `TrainConfig.tower_weights`
    jit_compile: bool
    transfer_dtype: tf.DType  # the dtype the towers' gradient sums cross devices in


@dataclasses.dataclass(frozen=True)
class TowerSums:
    """An update's sums as the towers leave them: what a layout reduces."""

    gradients: list[list[tf.Tensor]]  # per tower, on its device: its gradient sums, one per weight
    counts: Sequence[float]  # per tower: its labels, c_i
    total_weight: tf.Tensor  # W, on the layout's host
    safe_weight: tf.Tensor  # W, or 1 where W = 0 (then the update is refused)
    mean_loss: Callable[[tf.Tensor], tf.Tensor]  # the update's mean loss with this regularization, here
    sparse: tuple[int, ...] = ()  # the variables stepped sparsely, by index
    slices: Sequence[Sequence[tf.IndexedSlices]] = ()  # per tower, on its device: their occurrences


class TowerLayout(Protocol):
    """Where tower mode's weights come from and where its sums go, built by the placement.

    Attributes:
      host: the device of the counters and BN statistics, which decides the update.
      copies: per tower, its copy of the trainable weights, or None to be sent them each pass.
      holds_state: whether it keeps part of the training state away from the TrainState
        (`sync_state` writes it back), so that its finiteness is read from where it is kept.
    """

    host: str
    copies: list[list[tf.Variable] | None]
    holds_state: bool

    def tower_weights(self) -> list:
        """Per tower, what its pass reads: its copy, the weights sent it, or None (the variables)."""

    def refresh_weights(self) -> None:
        """Fills the towers' copies with the current weights (once per update)."""

    def reduce(self, sums: TowerSums) -> tuple[tf.Tensor, tf.Tensor, Callable[[], object]]:
        """(the mean loss, the `Decision`, what applies the update on the host if it is applied)."""

    def before_update(self) -> None:
        """Takes in what was written into the TrainState since the last update."""

    def after_update(self, result: UpdateResult) -> None:
        """Notes an update done, applied or not (reading `result` waits for it)."""

    def sync_state(self) -> None:
        """`InnerStep.sync_state`."""

    def state_written(self) -> None:
        """`InnerStep.state_written`."""

    def held_finite(self) -> bool:
        """`InnerStep.held_finite`."""

    def variable_roles(self) -> Mapping[str, list]:
        """"weights": the layout's own copies of weights; "held": state that never leaves its device."""


class TowerPlacement(Placement, Protocol):
    """A placement tower mode runs: it builds its layout."""

    @classmethod
    def of(cls, param_device: str, tower_devices: Sequence[str]) -> TowerPlacement:
        """The placement of a plan's parameter device and towers (step/modes.py builds it so,
        by the name `rules.PLACEMENTS` gives)."""

    def tower_layout(self, setup: TowerSetup) -> TowerLayout:
        """The layout of a `TowerStep` over `setup`, its variables placed by this placement."""


def weight_copies(model, device: str, tower: int, narrow_weights: Sequence[bool]) -> list[tf.Variable]:
    """Tower `tower`'s copy of the trainable weights on `device`, in the compute dtype where it
    reads them in it. Not state: a TowerStep is not checkpointed, and each update refreshes them."""
    with tf.device(device):
        return [tf.Variable(tf.zeros(v.shape, model.compute_dtype if narrow else v.dtype),
                            trainable=False, name=f"tower_{tower}_weights_{j}")
                for j, (v, narrow) in enumerate(zip(model.trainable_variables, narrow_weights, strict=True))]
