"""Where a run's variables live, as the modes ask it: `Placement`, the protocol every placement
keeps (tower mode's, in their own modules: `one_device.OneDevice`, `spread.SpreadPlacement`), and
`StrategyPlacement`, a tf.distribute strategy's. rules.PLACEMENTS lists tower mode's placements."""
from __future__ import annotations

import dataclasses
from typing import ContextManager, Protocol, Sequence


class Placement(Protocol):
    """Where a run's variables live: the scope they are created in, and the device that holds
    each one (and runs its reduction and update). Tower mode's placements (`one_device.OneDevice`,
    `spread.SpreadPlacement`) also build the layout its step runs (`tower_layout.TowerPlacement`)."""

    def scope(self) -> ContextManager:
        """Variables created inside are placed by this placement."""

    def device_of(self, variable) -> str:
        """The device that holds `variable` (the first copy, for a mirrored one)."""

    def describe(self, trainable_variables: Sequence) -> str:
        """Where the variables are, as the layout line says it."""


@dataclasses.dataclass(frozen=True)
class StrategyPlacement:
    """A tf.distribute strategy's placement: its scope puts each variable where the strategy
    keeps it, on `parameter_device`, or on every replica when that is None (mirrored)."""

    strategy: object  # tf.distribute.Strategy
    parameter_device: str | None

    def scope(self) -> ContextManager:
        return self.strategy.scope()

    def device_of(self, variable) -> str:
        return self.parameter_device or variable.device

    def describe(self, trainable_variables: Sequence) -> str:
        return self.parameter_device or "every replica (mirrored)"
