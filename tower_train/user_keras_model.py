"""A plain `keras.Model` and a Keras loss as the network the trainer drives.

`tower_train.fit(model=..., loss=...)` takes any `keras.Model` that is not a
`TowerModel` (Sequential, functional or subclassed), or a zero-argument callable
that returns one, with a loss: a Keras loss name, a `keras.losses.Loss`, or a
callable ``(labels, outputs) -> per-label loss``. `KerasModel` wraps the model
in a `TowerModel` whose `per_example_loss` is that loss with reduction none, so
the update stays the weighted mean over all its labels (step/towers.py), and whose
regularization is the model's Keras weight regularizers, once per update.

An instance is cloned (`keras.models.clone_model`) where the run makes its
variables, its current weights copied in; the user's own object gets the
trained weights back at the end (`hand_back_instance`).
"""
from __future__ import annotations

from typing import Any, Callable

import keras
import numpy as np
import tensorflow as tf
from absl import logging
from keras.src.losses.losses import LossFunctionWrapper  # what compile() wraps a loss name in

from tower_train.data.array_source import ArraySource
from tower_train.data.source import Source
from tower_train.errors import UsageError
from tower_train.models import TowerModel

PerLabelLoss = Callable[[tf.Tensor, tf.Tensor], tf.Tensor]


class KerasModel(TowerModel):
    """`network` (a keras.Model that is no TowerModel) with `loss` as its per-label loss.

    Its variables, Keras losses and random generators are the network's, so the trainer
    treats it as any TowerModel. `loss_label` names the loss in messages (loss=...).
    """

    def __init__(self, network: keras.Model, loss: PerLabelLoss, loss_label: str):
        # The network's outputs say how many classes; nothing here is made with the number.
        super().__init__(num_classes=None)
        self.network = network
        self.loss_label = loss_label
        self._per_label_loss = loss

    def call(self, features: tf.Tensor, training: bool = False) -> tf.Tensor:
        outputs = self.network(features, training=training)
        if getattr(self._per_label_loss, "packs_outputs", False):
            return pack_outputs(outputs)  # which the loss unpacks (compiled_loss.py)
        return outputs

    def per_example_loss(self, labels: tf.Tensor, logits: tf.Tensor) -> tf.Tensor:
        return self._per_label_loss(labels, tf.cast(logits, tf.float32))

    @property
    def tracks_training_metrics(self) -> bool:
        return getattr(self._per_label_loss, "tracks_metrics", False)

    @property
    def honoured_overrides(self) -> tuple[str, ...]:
        """The methods of Keras's fit that the run calls where the network overrides them (a
        compiled loss's, under tower_train.keras.fit: compiled_loss.py); none for a plain loss."""
        return getattr(self._per_label_loss, "honoured_overrides", ())

    def update_training_metrics(self, labels: Any, logits: tf.Tensor) -> None:
        self._per_label_loss.update_metrics(labels, logits)

    def labels_read(self, labels: Any, logits: tf.Tensor) -> list[tuple[str, np.ndarray, Any, int]]:
        """(path, labels, loss, classes) for each array of a source's `labels` that a loss reads,
        with that loss and the last dimension of the outputs it reads them against (a loss per
        output says its own: `CompiledLoss.labels_read`)."""
        if hasattr(self._per_label_loss, "labels_read"):
            return self._per_label_loss.labels_read(labels)
        if tf.nest.is_nested(labels) or logits.shape.rank < 2:
            return []
        return [("", labels, self._per_label_loss, logits.shape[-1])]


def pack_outputs(outputs: Any) -> tf.Tensor:
    """Several outputs (a list, tuple or dict, in `tf.nest`'s order) as one float32 tensor [b, the
    sum of their sizes]; one output as it is."""
    if not tf.nest.is_nested(outputs):
        return outputs
    return tf.concat([tf.reshape(tf.cast(output, tf.float32), [tf.shape(output)[0], -1])
                      for output in tf.nest.flatten(outputs)], axis=-1)


def per_label_loss(loss: object) -> tuple[PerLabelLoss, str]:
    """`loss` (a Keras loss name, a `keras.losses.Loss`, or a callable (labels, outputs) -> one
    loss per label) as a function of one loss per label, and its label for messages.

    A `keras.losses.Loss` is used with reduction none: it would otherwise reduce a tower's shard
    to its mean, and the update rule weighs each label itself. A name is wrapped as compile()
    wraps it (`LossFunctionWrapper`), which brings labels and outputs to the same rank: Keras's
    functions alone would broadcast [b] labels against a 1-unit sigmoid's [b, 1] outputs to [b, b].

    Raises:
      UsageError: an unknown name, or something that is no loss.
    """
    if isinstance(loss, str):
        try:
            resolved = keras.losses.get(loss)
        except ValueError:
            raise UsageError(f"loss={loss!r}: not a Keras loss name (keras.losses), such as "
                             "'sparse_categorical_crossentropy'") from None
        label = f"loss={loss}"
        if not isinstance(resolved, keras.losses.Loss):
            resolved = LossFunctionWrapper(resolved, name=loss)
    elif isinstance(loss, keras.losses.Loss):
        resolved, label = loss, f"loss={type(loss).__name__}"
    elif callable(loss):
        resolved = loss
        # A loss may name itself (tower_train.keras.fit's: the user's compiled loss or compute_loss).
        label = getattr(loss, "label", None) or (
            f"loss={getattr(loss, '__module__', '?')}.{getattr(loss, '__qualname__', type(loss).__qualname__)}")
    else:
        raise UsageError(f"loss={loss!r}: expected a Keras loss name, a keras.losses.Loss, or a "
                         "callable (labels, outputs) -> one loss per label")
    if isinstance(resolved, keras.losses.Loss):
        resolved = unreduced_copy(resolved)
    return resolved, label


def unreduced_copy(loss: keras.losses.Loss) -> keras.losses.Loss:
    """A shallow copy of `loss` with reduction none, its call and attributes the user's own; the
    user's object keeps its reduction. Not `copy.copy`: Keras pickles a Loss through its config,
    which remakes the user's class only if it is registered and its get_config is complete."""
    unreduced = object.__new__(type(loss))
    unreduced.__dict__.update(vars(loss))
    unreduced.reduction = None
    return unreduced


def label_rule(loss: Any, classes: int) -> tuple[Callable[[np.ndarray], np.ndarray], str] | None:
    """How Keras's `loss` reads labels against outputs whose last dimension is `classes`: a
    function of float64 labels that is True where they are valid, and what the loss takes, in
    words; None for any other loss, whose labels only it knows. Sparse categorical crossentropy
    casts labels to class indices (a NaN to -2**63, which fails only at the update that reads
    it, naming neither NaN nor the example; 2.5 to 2); binary crossentropy takes the
    probability of class 1 (a label of 3 would train, wrongly, without a word)."""
    function = getattr(loss, "fn", loss)  # compile()'s and a Loss class's LossFunctionWrapper
    if function is keras.losses.sparse_categorical_crossentropy:
        ignored = getattr(loss, "_fn_kwargs", {}).get("ignore_class")
        return (lambda labels: ((labels >= 0) & (labels < classes) & (labels == np.floor(labels)))
                | (labels == ignored),
                f"class indices, whole numbers in 0..{classes - 1} (the outputs' last dimension "
                f"is {classes}){'' if ignored is None else f' or ignore_class={ignored}'}")
    if function in (keras.losses.binary_crossentropy, keras.losses.binary_focal_crossentropy):
        return lambda labels: (labels >= 0) & (labels <= 1), "probabilities of class 1, in [0, 1]"
    return None


def check_labels(model: TowerModel, logits: tf.Tensor, source: Source) -> None:
    """Refuses, in one line naming the first such example, labels held in memory (an
    ArraySource's, train and eval) that the Keras loss of `model` cannot read (`label_rule`):
    before the first update, not at the update that reads them. A stream's labels are
    integers, checked against its classes as they are read (data/source.py)."""
    if not isinstance(model, KerasModel) or not isinstance(source, ArraySource):
        return
    for split, labels in (("train", source.train_labels), ("eval", source.eval_labels)):
        for path, array, loss, classes in model.labels_read(labels, logits):
            rule = label_rule(loss, classes)
            if rule is None:
                continue
            valid, takes = rule
            with np.errstate(invalid="ignore"):  # NaN compares False: invalid, as it should
                bad = np.argwhere(~valid(np.asarray(array, np.float64)))
            if len(bad):
                name = getattr(getattr(loss, "fn", loss), "__name__", type(loss).__name__)
                raise UsageError(f"{split}_labels{path}: example {bad[0][0]} holds "
                                 f"{array[tuple(bad[0])]}, which {name} cannot read: it takes "
                                 f"{takes}")


def check_network(network: keras.Model, what: str, config) -> None:
    """Refuses options a plain Keras model cannot honour, in one line: --recompute (tower-train
    does not know its blocks) and --sync_bn with a BatchNormalization layer made without
    synchronized=True (only a TowerModel's constructor is handed the option). Warns in one line
    of float16 layers in a run that does not scale the loss (--precision=fp16 does)."""
    if config.precision != "fp16":
        half = [layer.name for layer in network._flatten_layers()
                if layer.compute_dtype == "float16"]
        if half:
            logging.warning("%s: %s compute in float16 (their dtype policy), but the loss is scaled "
                            "only with --precision=fp16 (this run: %s), so small gradients may "
                            "underflow to 0; make the model under float32, or train with "
                            "precision='fp16' and model=lambda: ...", what,
                            ", ".join(half[:5]) + (", ..." if len(half) > 5 else ""),
                            config.precision)
    if config.recompute:
        raise UsageError(f"--recompute: {what} is a keras.Model, whose blocks tower-train does not "
                         "know; make it a tower_train.TowerModel that runs them through run_block "
                         "(see docs/models.md)")
    if config.sync_bn:
        plain = [layer.name for layer in network._flatten_layers()  # every nested layer
                 if isinstance(layer, keras.layers.BatchNormalization) and not layer.synchronized]
        if plain:
            raise UsageError(f"--sync_bn: {what} has BatchNormalization layers made without "
                             f"synchronized=True ({', '.join(plain)}); make them with it")


def clone_instance(instance: keras.Model, what: str) -> keras.Model:
    """A clone of `instance` made in the current scope, with its current weights (if it is built).

    Raises:
      UsageError: a subclassed model that Keras cannot clone (its `get_config` is missing or
        does not remake it), asking for a zero-argument callable instead.
    """
    try:
        clone = keras.models.clone_model(instance)
        if instance.weights:
            if not clone.built:
                clone.build_from_config(instance.get_build_config())
            clone.set_weights(instance.get_weights())
    except Exception as e:  # Keras raises several kinds for a model it cannot remake
        # Keras's reason is prose over several lines, whose first says little alone.
        reason = " ".join(str(e).split())[:300] or type(e).__name__
        raise UsageError(f"{what} instance: Keras cannot clone it ({type(e).__name__}: "
                         f"{reason}); pass a zero-argument callable that makes a new one "
                         f"(model=lambda: {type(instance).__name__}(...))") from None
    return clone


def hand_back_instance(instance: keras.Model, trained: KerasModel) -> keras.Model:
    """`instance`, the user's own object, with the trained network's weights copied in (built
    first like the trained one if it was never called)."""
    if not instance.built:
        instance.build_from_config(trained.network.get_build_config())
    instance.set_weights(trained.network.get_weights())
    return instance
