"""The loss `model.compile()` gave, as the per-example loss of `tower_train.fit`, for
`tower_train.keras.fit` (keras/model_fit.py): one loss for one output, or a loss per output (a dict by
output name, or a list in the outputs' order) with `loss_weights`; or the model's own
`compute_loss`, where its class overrides Keras's.

The run's network returns one tensor (step/towers.py weighs one loss per example), so the outputs of
a model of several are packed into one, [b, sum of their sizes], by `KerasModel.call` when its
loss says `packs_outputs` (user_keras_model.py), and unpacked here into the model's structure.
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Iterator

import keras
import tensorflow as tf

from tower_train.errors import UsageError
from tower_train.user_keras_model import per_label_loss


class CompiledLoss:
    """The compiled loss for targets `(y, sample_weight)`: each output's Keras loss with reduction
    none and the sample weights, as Keras weighs them, then each example's mean over its other
    axes, times the output's loss weight, summed over the outputs. With every example weighing
    1 in the run, an update's weighted mean of these is Keras's total loss over the update: the
    sum over outputs of loss weight times "sum_over_batch_size" of that output's losses.

    A model whose class overrides Keras's `compute_loss` has that called instead, once for each
    tower's share of a micro-step, and its value, the mean over the share's examples, stands for
    each of them, so that the update's mean over its G examples is the mean of these means
    weighed by the shares' sizes: what `compute_loss` gives on the batch of G when it is a mean of
    one term per example (docs/keras.md)."""

    packs_outputs = True  # KerasModel packs several outputs into one tensor for it
    # What Keras's fit calls of an override and this calls too: the model's compute_loss, and
    # its test_step through evaluate (model_spec.warn_of_unused_overrides).
    honoured_overrides = ("compute_loss", "test_step")

    def __init__(self, model: keras.Model, features: Any, targets: Any, weighted: bool = True):
        """`features` and `targets`: the first examples, which tell the "crossentropy" alias
        which crossentropy it is, as compile() tells it from the first batch. `weighted`: whether
        the user gave sample or class weights, else an own compute_loss is given none, as by
        Keras."""
        from keras.src.trainers.compile_utils import get_loss  # compile()'s own resolution

        outputs = model(features, training=False)
        self._model, self._weighted = model, weighted
        own = type(model)
        self.own_compute_loss = own.compute_loss is not keras.Model.compute_loss
        self.label = (f"{own.__module__}.{own.__qualname__}.compute_loss" if self.own_compute_loss
                      else f"model {model.name}'s compiled loss")
        # The structure of the model's outputs, in which the metrics take them.
        self._structure = tf.nest.map_structure(lambda _: 0, outputs)
        self._names = _output_names(model, outputs)
        self._shapes = [tuple(output.shape[1:]) for output in _in_order(outputs, self._names)]
        self._sizes = [math.prod(shape) for shape in self._shapes]
        self.several_outputs = len(self._names) > 1
        self._packed = tf.nest.is_nested(outputs)  # by KerasModel.call, a list of one too
        first = _in_order(targets, self._names, "y")
        # An own compute_loss decides what of compile()'s loss it uses (super().compute_loss).
        losses = _per_output(None if self.own_compute_loss else model.loss, self._names, "loss")
        weights = _per_output(model.get_compile_config().get("loss_weights"), self._names,
                              "loss_weights")
        self._losses = []  # (output's index, unreduced loss, loss weight)
        for index, (loss, weight) in enumerate(zip(losses, weights, strict=True)):
            if loss is None:  # Keras trains an output without a loss on nothing
                continue
            # A name or a function becomes the Loss object compile() makes of it
            # (LossFunctionWrapper, which brings labels and outputs to the same rank: [n] labels
            # for [n, 1] sigmoids).
            loss = get_loss(loss, first[index], _in_order(outputs, self._names)[index])
            if loss.reduction != "sum_over_batch_size":
                raise UsageError(f"loss={type(loss).__name__}(reduction={loss.reduction!r}): "
                                 "tower_train.keras.fit takes Keras's default reduction, "
                                 "'sum_over_batch_size'")
            self._losses.append((index, per_label_loss(loss)[0],
                                 1.0 if weight is None else float(weight)))
        config = model.get_compile_config()
        # The metrics Keras's train step keeps: the compiled ones, and each output's loss when
        # there are several.
        # An own compute_loss may update metrics, as the customizing-fit guide's does.
        self.tracks_metrics = bool(config.get("metrics") or config.get("weighted_metrics")
                                   or self.several_outputs or self.own_compute_loss)

    def __call__(self, targets: tuple[Any, tf.Tensor], outputs: tf.Tensor) -> tf.Tensor:
        if self.own_compute_loss:
            loss = tf.cast(self._own_loss(targets, outputs), tf.float32)
            if loss.shape.rank != 0:
                raise UsageError(f"{self.label}: returned shape {loss.shape.as_list()}; it must "
                                 "return a scalar, the mean over the batch it is given, as Keras's "
                                 "does")
            return tf.broadcast_to(loss, tf.shape(outputs)[:1])
        y, sample_weight = targets
        y = _in_order(y, self._names, "y")
        outputs = self._unpacked(outputs)
        total = 0.0
        for index, unreduced, weight in self._losses:
            losses = tf.convert_to_tensor(unreduced(y[index], outputs[index],
                                                    sample_weight=sample_weight))
            if losses.shape.rank > 1:
                losses = tf.reduce_mean(losses, axis=list(range(1, losses.shape.rank)))
            total += losses * weight
        return total


    def update_metrics(self, targets: tuple[Any, tf.Tensor], outputs: tf.Tensor) -> None:
        """The compiled metrics of the user's model (and each output's loss metric, with several
        outputs) updated from one tower pass's targets and its training outputs, as Keras's train
        step updates them from its forward pass: inside the compiled update, so a metric's state
        adds up over the towers and micro-steps of an update as over one batch of G."""
        if self.own_compute_loss:  # for the metrics it updates, once a pass as Keras's train step
            self._own_loss(targets, outputs)
        y, sample_weight = targets
        outputs = tf.nest.pack_sequence_as(self._structure, self._unpacked(outputs))
        if self.several_outputs and not self.own_compute_loss:  # each output's loss metric
            self._model.compute_loss(None, y, outputs, sample_weight=sample_weight, training=False)
        self._model.compute_metrics(None, y, outputs, sample_weight=sample_weight)

    def _own_loss(self, targets: tuple[Any, tf.Tensor], outputs: tf.Tensor) -> tf.Tensor:
        """The model's own compute_loss on one pass's targets and outputs, in its outputs'
        structure (x is not at hand: None), with `model.losses` reading 0 inside: the run adds
        the model's regularization once per update and its add_loss losses as means over the
        update (models/base.py), as Keras's compute_loss adds `self.losses`."""
        y, sample_weight = targets
        outputs = tf.nest.pack_sequence_as(self._structure, self._unpacked(outputs))
        with _losses_read_as_zero(self._model):
            return self._model._compute_loss(  # Keras's, which passes training= where taken
                None, y, outputs, sample_weight if self._weighted else None, training=True)

    def _unpacked(self, outputs: tf.Tensor) -> list[tf.Tensor]:
        """The outputs `KerasModel.call` packed, as a list in the outputs' order."""
        if not self._packed:
            return [outputs]
        parts = tf.split(outputs, self._sizes, axis=-1)
        return [tf.reshape(part, [-1, *shape]) for part, shape in zip(parts, self._shapes, strict=True)]

    def labels_read(self, labels: tuple[Any, Any]) -> list[tuple[str, Any, Any, int]]:
        """(path, labels, loss, classes) for each output's labels in a source's `(y,
        sample_weight)` arrays, with its loss and the last dimension of its outputs: what
        `user_keras_model.check_labels` checks."""
        if self.own_compute_loss:  # the user's function alone knows how it reads them
            return []
        y = labels[0]
        arrays = _in_order(y, self._names, "y")
        if isinstance(y, dict):
            keys = self._names if all(name in y for name in self._names) else list(y)  # as _in_order
            paths = [f"[0][{key!r}]" for key in keys]
        else:
            paths = [f"[0][{i}]" for i in range(len(arrays))] if isinstance(y, (list, tuple)) else ["[0]"]
        return [(paths[index], arrays[index], loss, self._shapes[index][-1])
                for index, loss, _ in self._losses if self._shapes[index]]


@contextlib.contextmanager
def _losses_read_as_zero(model: keras.Model) -> Iterator[None]:
    """`model.losses` reads [0.0] inside: Keras's `losses` returns its override list when that
    is not empty."""
    override = model._losses_override
    kept = list(override)
    override[:] = [tf.zeros(())]
    try:
        yield
    finally:
        override[:] = kept


def _output_names(model: keras.Model, outputs: Any) -> list[str]:
    """The names of the model's outputs, in `tf.nest`'s order of `outputs`."""
    if isinstance(outputs, dict):
        return sorted(outputs)  # tf.nest's order
    if tf.nest.is_nested(outputs):
        names = list(getattr(model, "output_names", None) or [])
        if len(names) != len(outputs):
            raise UsageError(f"model {model.name}: has {len(outputs)} outputs but names "
                             f"{len(names)}; tower_train.keras.fit takes several outputs of a "
                             "functional model")
        return names
    return list(getattr(model, "output_names", None) or ["output"])[:1]


def _in_order(values: Any, names: list[str], what: str = "outputs") -> list:
    """`values` of the outputs (a dict by name, a list in order, or one) as a list in the
    outputs' order."""
    if isinstance(values, dict):
        missing = [name for name in names if name not in values]
        if missing and len(names) > 1:
            raise UsageError(f"{what}: has no {', '.join(missing)} for the model's outputs "
                             f"{names}")
        return [values[name] for name in names] if not missing else list(values.values())
    if isinstance(values, (list, tuple)) and (len(names) > 1 or len(values) == 1):
        if len(values) != len(names):
            raise UsageError(f"{what}: {len(values)} values for the model's {len(names)} "
                             f"outputs {names}")
        return list(values)
    if len(names) > 1:
        raise UsageError(f"{what}: one array for the model's {len(names)} outputs {names}; give a "
                         "dict by output name or a list, as for model.fit")
    return [values]


def _per_output(value: Any, names: list[str], what: str) -> list:
    """compile()'s `loss` or `loss_weights`: one for every output, a dict by output name (an
    output left out has none), or a list in the outputs' order."""
    if isinstance(value, dict):
        unknown = sorted(set(value) - set(names))
        if unknown:
            raise UsageError(f"{what}: names {', '.join(map(str, unknown))}, not an output of the "
                             f"model ({', '.join(names)}), as compile() would refuse")
        return [value.get(name) for name in names]
    if isinstance(value, (list, tuple)):
        if len(value) != len(names):
            raise UsageError(f"{what}: {len(value)} for the model's {len(names)} outputs "
                             f"({', '.join(names)})")
        return list(value)
    return [value] * len(names)
