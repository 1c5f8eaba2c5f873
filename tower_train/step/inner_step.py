"""What every mode's inner step is: the `InnerStep` protocol, which tower mode's `TowerStep`
and the strategy modes' `StrategyStep` implement, and what one update reports."""
from __future__ import annotations

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


class UpdateResult:
    """What one call of `run_update` did, read from the devices only when first asked.

    loss: the update's weighted mean loss (over all towers, micro-steps and workers) plus the
      regularization; total_weight: W, the sum of the update's weights; decision: applied, or
      why it was refused (nothing moved then); state_finite: whether every float value a
      checkpoint would hold was finite after it (`UpdateRule.state_finite`).

    Made from the step's tensors (or plain values), it holds them until one of its fields is
    asked for; that read, of all four at once, waits for the update to finish. So the
    Controller can queue the next update before it reads this one (controller.py).
    """

    __slots__ = ("_given", "_read")

    def __init__(self, loss: tf.Tensor | float, total_weight: tf.Tensor | float,
                 decision: tf.Tensor | Decision, state_finite: tf.Tensor | bool = True):
        self._given = (loss, total_weight, decision, state_finite)
        self._read: tuple[float, float, Decision, bool] | None = None

    def _values(self) -> tuple[float, float, Decision, bool]:
        if self._read is None:
            loss, total_weight, decision, state_finite = self._given
            self._read = (float(loss), float(total_weight), Decision(int(decision)), bool(state_finite))
        return self._read

    @property
    def loss(self) -> float:
        return self._values()[0]

    @property
    def total_weight(self) -> float:
        return self._values()[1]

    @property
    def decision(self) -> Decision:
        return self._values()[2]

    @property
    def state_finite(self) -> bool:
        return self._values()[3]

    @property
    def applied(self) -> bool:
        return self.decision == Decision.APPLIED

    def with_state_finite(self, state_finite: tf.Tensor | bool) -> UpdateResult:
        """The same update, with the finiteness of the state it left read from `state_finite`."""
        return UpdateResult(*self._given[:3], state_finite)


class InnerStep(Protocol):
    """Applies one update of K micro-steps: what a mode computes, apart from the outer loop."""

    def feed(self, dataset: tf.data.Dataset, copy_ahead: bool | None = None) -> Iterator[Shards]:
        """The global micro-batches of `dataset` (on the host) as `run_update` takes them: cut
        into this process's towers' or replicas' shards, each copied ahead to its device if
        `copy_ahead`; None: if that is an accelerator (`device_feed.feed_devices`)."""

    def run_update(self, batches: Iterator[Shards], at_once: object | None = None) -> UpdateResult:
        """Takes K global micro-batches (`feed`'s) from `batches` and applies one update, or
        refuses it. `at_once`: the iterator `feed` gave, under `batches`, which the step may
        read the K micro-batches from inside one call instead (not advancing `batches`)."""

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

    @property
    def overlaps_updates(self) -> bool:
        """Whether the Controller may queue the next update before it reads this one's result:
        the step reads nothing of it on the host itself, and the state a late read finds is the
        TrainState's (no state held elsewhere, whose finiteness would be read after the next
        update)."""
