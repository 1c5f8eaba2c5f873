"""What every mode's inner step is: the `InnerStep` protocol, which tower mode's `TowerStep`
and the strategy modes' `StrategyStep` implement, and what one update reports."""
from __future__ import annotations

import dataclasses
from typing import Iterator, Mapping, Protocol, Sequence

import tensorflow as tf

# One global micro-batch: (features [M, ...], labels int [M, ...], weights float32, the labels' shape).
Batch = tuple[tf.Tensor, tf.Tensor, tf.Tensor]
BatchSpec = tuple[tf.TensorSpec, tf.TensorSpec, tf.TensorSpec]


@dataclasses.dataclass(frozen=True)
class UpdateResult:
    """What one call of `run_update` did.

    loss: the update's weighted mean loss (over all towers, micro-steps and workers) plus the
      regularization; total_weight: W, the sum of the update's weights; applied: False when the
      update was refused (W = 0, or a non-finite loss or gradient) and nothing moved.
    """

    loss: float
    total_weight: float
    applied: bool

    @classmethod
    def of(cls, loss: tf.Tensor, total_weight: tf.Tensor, applied: tf.Tensor | bool) -> UpdateResult:
        """From the step's tensors; reading them waits for the update to finish."""
        return cls(float(loss), float(total_weight), bool(applied))

    @property
    def empty(self) -> bool:
        """The update counted no label at all (every weight 0): refused, and no fault."""
        return self.total_weight == 0


class InnerStep(Protocol):
    """Applies one update of K micro-steps: what a mode computes, apart from the outer loop."""

    def run_update(self, batches: Iterator[Batch]) -> UpdateResult:
        """Takes K global micro-batches from `batches` and applies one update, or refuses it."""

    def traced_update(self, spec: BatchSpec) -> list[tuple[object, int]]:
        """The concrete functions one update runs on global micro-batches of `spec` (traced now
        if they were not), each with how many times per update: what `tower_train.traffic`
        counts. A refused update's functions are not among them."""

    def variable_roles(self) -> Mapping[str, Sequence]:
        """The variables behind the traffic, by role: "weights" (the trainable variables and
        any copy of them), "gradients" (the accumulators of gradient, loss and weight sums),
        "statistics" (BN's moving statistics)."""
