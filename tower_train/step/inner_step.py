"""What every mode's inner step is: the `InnerStep` protocol, which tower mode's `TowerStep`
and the strategy modes' `StrategyStep` implement, and what one update reports."""
from __future__ import annotations

import dataclasses
import enum
from typing import Iterator, Mapping, Protocol, Sequence

import tensorflow as tf

# One global micro-batch: (features [M, ...], labels int [M, ...], weights float32, the labels' shape);
# the features as the model takes them, or raw as the training stream gives them (`data/source.RawInput`).
Batch = tuple[tf.Tensor, tf.Tensor, tf.Tensor]
BatchSpec = tuple[tf.TensorSpec, tf.TensorSpec, tf.TensorSpec]
# One global micro-batch as consecutive shards, one per device of the step, each already on its
# device when that is an accelerator, else on the host (`device_feed.feed_devices`).
Shards = Sequence[Batch]


class Decision(enum.IntEnum):
    """What became of an update: decided once, in the graph, by `UpdateRule.decide`, for every
    mode. Only APPLIED moves anything but the loss scale."""

    APPLIED = 0
    EMPTY = 1  # total weight 0: no label counted; refused, and no fault
    OVERFLOW = 2  # float16: a finite loss whose gradient overflowed, which the loss scale handles
    NONFINITE = 3  # a non-finite loss or gradient would have reached the weights: --nonfinite's case


@dataclasses.dataclass(frozen=True)
class UpdateResult:
    """What one call of `run_update` did.

    loss: the update's weighted mean loss (over all towers, micro-steps and workers) plus the
      regularization; total_weight: W, the sum of the update's weights; decision: applied, or
      why it was refused (nothing moved then); state_finite: whether every float value a
      checkpoint would hold was finite after it (`UpdateRule.state_finite`).
    """

    loss: float
    total_weight: float
    decision: Decision
    state_finite: bool = True

    @classmethod
    def of(cls, loss: tf.Tensor, total_weight: tf.Tensor, decision: tf.Tensor,
           state_finite: tf.Tensor | bool = True) -> UpdateResult:
        """From the step's tensors; reading them waits for the update to finish."""
        return cls(float(loss), float(total_weight), Decision(int(decision)), bool(state_finite))

    @property
    def applied(self) -> bool:
        return self.decision == Decision.APPLIED


class InnerStep(Protocol):
    """Applies one update of K micro-steps: what a mode computes, apart from the outer loop."""

    def feed(self, dataset: tf.data.Dataset, copy_ahead: bool | None = None) -> Iterator[Shards]:
        """The global micro-batches of `dataset` (on the host) as `run_update` takes them: cut
        into this process's towers' or replicas' shards, each copied ahead to its device if
        `copy_ahead`; None: if that is an accelerator (`device_feed.feed_devices`)."""

    def run_update(self, batches: Iterator[Shards]) -> UpdateResult:
        """Takes K global micro-batches (`feed`'s) from `batches` and applies one update, or
        refuses it."""

    def traced_update(self, spec: BatchSpec) -> list[tuple[object, int]]:
        """The concrete functions one update runs on global micro-batches of `spec` (traced now
        if they were not), each with how many times per update: what `tower_train.traffic`
        counts. A refused update's functions are not among them."""

    def variable_roles(self) -> Mapping[str, Sequence]:
        """The variables behind the traffic, by role: "weights" (the trainable variables and
        any copy or slice of them), "gradients" (the accumulators of gradient, loss and weight
        sums), "statistics" (BN's moving statistics), and "held" (state that never leaves its
        device: --ps_device=spread's optimizer slots and averages)."""

    def sync_state(self) -> None:
        """Writes what the step keeps of the training state away from the TrainState's variables
        back into them, so that a save, an evaluation or a callback reads the current state:
        --ps_device=spread keeps the weights, slots and averages in slices on the towers. Does
        nothing when the TrainState is already current, and in the steps that update it in place."""

    def state_written(self) -> None:
        """Says that the TrainState's variables may have been written (a Keras callback may set
        weights): a step that keeps the state elsewhere takes them before its next update."""

    def held_finite(self) -> bool:
        """Whether every float value the step keeps of the state away from the TrainState (what
        `sync_state` would write) is finite; True when it keeps none."""
