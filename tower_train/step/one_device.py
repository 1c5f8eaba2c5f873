"""--ps_device=cpu|gpu: every variable of tower mode on one parameter device (`OneDevice`), and
its layout (`ParameterDeviceLayout`): the weights leave that device once per update, and every
tower's gradient sums come to it, which combines, decides and applies."""
from __future__ import annotations

import dataclasses
from typing import Callable, ContextManager, Mapping, Sequence

import tensorflow as tf

from tower_train.devices import canonical_device
from tower_train.step.inner_step import UpdateResult
from tower_train.step.towers import combine_gradients, combine_slices, read_in_compute_dtype, regularization_gradients
from tower_train.step.tower_layout import TowerLayout, TowerSetup, TowerSums, weight_copies
from tower_train.step.update_rule import tensors_finite


@dataclasses.dataclass(frozen=True)
class OneDevice:
    """Every variable on one device: tower mode's parameter device (`ParameterDeviceLayout`)."""

    device: str

    @classmethod
    def of(cls, param_device: str, tower_devices: Sequence[str]) -> OneDevice:
        return cls(param_device)

    def scope(self) -> ContextManager:
        return tf.device(self.device)

    def device_of(self, variable) -> str:
        return self.device

    def describe(self, trainable_variables: Sequence) -> str:
        return self.device

    def tower_layout(self, setup: TowerSetup) -> TowerLayout:
        return ParameterDeviceLayout(setup=setup, device=self.device)


class ParameterDeviceLayout:
    """Every variable on one device (`--ps_device=cpu|gpu`): the weights leave it once per update
    for the towers that keep a copy (or each pass for the others), and every tower's gradient
    sums come to it, which combines, decides and applies."""

    holds_state = False

    def __init__(self, *, setup: TowerSetup, device: str):
        model = setup.rule.model
        self.host = device
        self._setup = setup
        # Per trainable variable: whether its value travels to the towers in the compute dtype.
        self._narrow_weights = read_in_compute_dtype(model)
        # Per tower: whether it is on another device than the variables, so that what it reads
        # and returns crosses devices.
        self._remote = [canonical_device(d) != canonical_device(device) for d in setup.tower_devices]
        copied = setup.tower_weights == "per_update" and setup.accum > 1
        self.copies = [weight_copies(model, tower_device, i, self._narrow_weights) if copied and remote else None
                       for i, (tower_device, remote) in enumerate(zip(setup.tower_devices, self._remote, strict=True))]

    def tower_weights(self) -> list:
        weights = list(self.copies)
        # The towers without a copy that read what the parameter device sends: those off it when
        # weights travel narrowed, and every one under XLA, whose compiled pass reads no variable.
        reads = [copies is None and (remote or self._setup.jit_compile)
                 for copies, remote in zip(weights, self._remote, strict=True)]
        if (any(self._narrow_weights) or self._setup.jit_compile) and any(reads):
            sent = self._sent_weights()  # read once per micro-step, then sent to each tower
            weights = [sent if read else copies for copies, read in zip(weights, reads, strict=True)]
        return weights

    def refresh_weights(self) -> None:
        """Copies the current trainable weights to every tower that keeps a copy: the only
        weight traffic of the update."""
        sent = self._sent_weights()
        for device, copies in zip(self._setup.tower_devices, self.copies, strict=True):
            if copies is not None:
                with tf.device(device):
                    for copy, value in zip(copies, sent, strict=True):
                        copy.assign(value)

    def _sent_weights(self) -> list:
        """The trainable weights as they travel to the towers: the variables themselves, or, where
        a tower reads one in the compute dtype, its value cast to that on the device holding it."""
        model = self._setup.rule.model
        sent = []
        with tf.device(self.host):
            for v, narrow in zip(model.trainable_variables, self._narrow_weights, strict=True):
                sent.append(tf.cast(v, model.compute_dtype) if narrow else v)
        return sent

    def reduce(self, sums: TowerSums) -> tuple[tf.Tensor, tf.Tensor, Callable[[], object]]:
        """Every tower's gradient sums to the parameter device, which combines and decides."""
        setup, rule = self._setup, self._setup.rule
        tower_grads = list(sums.gradients)
        if setup.transfer_dtype != tf.float32:
            for i, (device, remote) in enumerate(zip(setup.tower_devices, self._remote, strict=True)):
                if remote:
                    with tf.device(device):
                        tower_grads[i] = [tf.cast(g, setup.transfer_dtype) for g in tower_grads[i]]
        with tf.device(self.host):
            variables = rule.model.trainable_variables
            tower_grads = [[tf.cast(g, v.dtype) for g, v in zip(grads, variables, strict=True)]
                           for grads in tower_grads]  # back from transfer_dtype; else nothing
            regularization, regularization_grads = regularization_gradients(rule.model)
            mean_loss = sums.mean_loss(regularization)
            mean_grads = combine_gradients(tower_grads, sums.counts, sums.safe_weight)
            if rule.loss_scale is not None:
                mean_grads = rule.loss_scale.unscale(mean_grads)
            mean_grads = [g + r for g, r in zip(mean_grads, regularization_grads, strict=True)]
            decision = rule.decide(sums.total_weight, tensors_finite([mean_loss, *mean_grads]), mean_loss)
            # Their dense gradients above decide and clip; the occurrences step. They travel in
            # float32, whatever transfer_dtype; no regularization reaches them (`sparse_gradients`).
            sparse = {}
            if sums.sparse:
                scale = sums.safe_weight * (1.0 if rule.loss_scale is None else rule.loss_scale.value)
                sparse = dict(zip(sums.sparse, combine_slices(sums.slices, sums.counts, scale), strict=True))
        return mean_loss, decision, lambda: rule.apply(rule.clip(mean_grads, sparse=sparse))

    def before_update(self) -> None:
        pass  # the towers read the TrainState's variables themselves

    def after_update(self, result: UpdateResult) -> None:
        pass  # nothing to read: the next update may be queued before this one is read

    def sync_state(self) -> None:
        pass  # the TrainState's variables are the weights

    def state_written(self) -> None:
        pass

    def held_finite(self) -> bool:
        return True

    def variable_roles(self) -> Mapping[str, list]:
        return {"weights": [c for tower in self.copies if tower is not None for c in tower], "held": []}
