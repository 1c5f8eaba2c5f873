"""Which network a run trains, and the one place where it is built.

A run names its network as a registered name (``--model``: a `TowerModel`
subclass, or a function returning a `keras.Model`, registered with its loss), a
`TowerModel` subclass, or a zero-argument callable that returns one; or, with a
loss, any other `keras.Model` instance or a callable that returns one (`user_keras_model.py`
wraps it in a TowerModel). `resolve_model` turns any of them into a `ModelSpec`,
and `build_model` makes the network from it for training, evaluation and export
alike, with the run's dtype policy and options (``--sync_bn``, ``--recompute``),
checking it against the data source.
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
from typing import Callable, Iterator

import keras
import tensorflow as tf
from absl import logging

from tower_train.config import OPTIMIZERS, TrainConfig

from tower_train.rules import MODE_RULES, ONE_PROCESS_MODES
from tower_train.data.source import Source, describe_nest
from tower_train.errors import UsageError
from tower_train.user_keras_model import (KerasModel, PerLabelLoss, check_labels, check_network,
                                     clone_instance, hand_back_instance, per_label_loss)
from tower_train.models import TowerModel, model_class, registered_loss
from tower_train.user_code import UserCodeError, call_user_code

# Keras's mixed-precision policies: the towers compute in the first dtype, variables stay float32.
DTYPE_POLICIES = {"fp32": "float32", "bf16": "mixed_bfloat16", "fp16": "mixed_float16"}
# The TowerModel constructor arguments that options turn on, and the option that turns each on.
_OPTION_KWARGS = (("sync_bn", "sync_batch_norm"), ("recompute", "recompute"))


def users_network(trained: TowerModel) -> keras.Model:
    """The network a run hands back for a model the run made: a TowerModel as it is, a plain
    keras.Model (from a callable) without the wrapper."""
    return trained.network if isinstance(trained, KerasModel) else trained


def model_label(name: str) -> str:
    """How messages name a model: --model=NAME for a registered one, model=module.Class else."""
    return f"model={name}" if "." in name else f"--model={name}"


def use_moving_average(model: keras.Model, moving_average) -> None:
    """Copies the moving averages into `model`'s trainable weights, in place.

    For evaluating or exporting the averaged weights. The averages were created
    from `model.trainable_variables`, in that order (`schedules.MovingAverage`).
    """
    weights = model.trainable_variables
    averages = moving_average.averages
    if len(weights) != len(averages):
        raise ValueError(f"{len(averages)} moving averages for {len(weights)} trainable weights")
    for weight, average in zip(weights, averages):
        weight.assign(tf.convert_to_tensor(average))


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """How to make the network: `make()` returns a fresh, unbuilt TowerModel.

    name: what the run record calls it (a registered name, or module.Class); label: what
    messages call it (--model=NAME, or model=module.Class); hand_back: the trained TowerModel
    -> the network `TrainResult.model` holds, the user's own object; optimizer: a Keras
    optimizer object given to fit (a model's compile()'s), which the run trains with a fresh
    copy of (`make_optimizer`); None: the --optimizer and learning-rate options.
    """

    name: str
    make: Callable[[], TowerModel]
    hand_back: Callable[[TowerModel], keras.Model] = users_network
    optimizer: keras.optimizers.Optimizer | None = None

    @property
    def label(self) -> str:
        return model_label(self.name)


def resolve_model(model: object, config: TrainConfig, num_classes: int | None,
                  source_classes: int | None, loss: object = None,
                  optimizer: object = None) -> ModelSpec:
    """`_resolve_model`'s ModelSpec, with the optimizer object `optimizer` (None: the options').

    Raises:
      UsageError: as `_resolve_model`, or an optimizer that is no keras.optimizers.Optimizer, or
        one that accumulates gradients itself.
    """
    spec = _resolve_model(model, config, num_classes, source_classes, loss)
    if optimizer is None:
        return spec
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise UsageError(f"optimizer={optimizer!r}: expected one of {', '.join(OPTIMIZERS)} or a "
                         "keras.optimizers.Optimizer object")
    if optimizer.gradient_accumulation_steps:
        raise UsageError(f"optimizer={type(optimizer).__name__}(gradient_accumulation_steps="
                         f"{optimizer.gradient_accumulation_steps}): the run accumulates micro-steps "
                         "itself; make it without, and set accum=")
    _check_optimizer_features(optimizer, config)
    return dataclasses.replace(spec, optimizer=optimizer)


def optimizer_features(optimizer: keras.optimizers.Optimizer) -> dict[str, object]:
    """What the optimizer's `apply` does besides its step, by argument name: the features the
    update applies as Keras applies them (`step/update_rule.UpdateRule.apply`)."""
    features = {name: getattr(optimizer, name, None)
                for name in ("clipnorm", "global_clipnorm", "clipvalue", "weight_decay")}
    features["use_ema"] = bool(getattr(optimizer, "use_ema", False))
    return {name: value for name, value in features.items() if value}


def _check_optimizer_features(optimizer: keras.optimizers.Optimizer, config: TrainConfig) -> None:
    """Refuses the features a placement cannot apply yet; says which applies where the run's own
    --clip_norm or --ema_decay stands beside the optimizer's."""
    features = optimizer_features(optimizer)
    named = ", ".join(f"{name}={value}" for name, value in features.items())
    placement = config.placement_rules  # None: "auto", which picks a placement that applies them
    if features and placement is not None and not placement.optimizer_features:
        raise UsageError(f"optimizer={type(optimizer).__name__}({named}): --ps_device={config.ps_device} steps "
                         "each device's slices with a copy of the optimizer that applies none of "
                         "these; use --ps_device=cpu or gpu (or --clip_norm, --ema_decay)")
    clipping = [name for name in ("clipnorm", "global_clipnorm", "clipvalue") if name in features]
    if config.clip_norm is not None and clipping:
        logging.warning("--clip_norm=%s and the optimizer's %s=%s both apply: the update's "
                        "gradient is clipped to --clip_norm first, then as the optimizer clips",
                        config.clip_norm, clipping[0], features[clipping[0]])
    if config.ema_decay and features.get("use_ema"):
        logging.warning("--ema_decay=%s and the optimizer's use_ema both apply: the run's average "
                        "is what evaluation and export read; the optimizer's (ema_momentum=%s) "
                        "becomes the weights at the end, as Keras's fit does",
                        config.ema_decay, optimizer.ema_momentum)


def _resolve_model(model: object, config: TrainConfig, num_classes: int | None,
                   source_classes: int | None, loss: object = None) -> ModelSpec:
    """`model` (None: --model; a registered name; a TowerModel subclass; a keras.Model instance;
    a zero-argument callable, such as a keras.Model subclass) as a ModelSpec. A registered name
    is made with `num_classes`, else the source's number of classes; a class with `num_classes`
    only when given. The options --sync_bn and --recompute reach a class as constructor
    arguments. `loss` (see `user_keras_model.per_label_loss`) is required for a keras.Model that is
    no TowerModel, and refused for a TowerModel, which owns its loss.

    Raises:
      UsageError: an unknown name or module, something that is no model, a loss missing or
        given where it does not belong, or an unknown loss.
    """
    if model is None or isinstance(model, str):
        name = config.model if model is None else model
        registered = model_class(name, config.model_module)
        if inspect.isclass(registered):  # a TowerModel subclass (register checks)
            _refuse_loss(loss, model_label(name))
            classes = source_classes if num_classes is None else num_classes
            return ModelSpec(name, _constructor(registered, name, config, {"num_classes": classes}))
        if loss is not None:
            raise UsageError(f"loss=: {model_label(name)} was registered with its loss; leave "
                             "loss= out, or pass the function itself as model= with loss=")
        if num_classes is not None:
            raise UsageError(f"num_classes={num_classes}: {model_label(name)} is a registered "
                             "function of no arguments; it cannot be passed num_classes")
        function = f"{getattr(registered, '__module__', '?')}.{getattr(registered, '__qualname__', '?')}"
        return ModelSpec(name, _checked_factory(registered, function, config,
                                                per_label_loss(registered_loss(name))))
    qualified = f"{getattr(model, '__module__', '?')}.{getattr(model, '__qualname__', type(model).__qualname__)}"
    if inspect.isclass(model) and issubclass(model, TowerModel):
        _refuse_loss(loss, f"model={qualified}")
        given = {} if num_classes is None else {"num_classes": num_classes}
        return ModelSpec(qualified, _constructor(model, qualified, config, given))
    if inspect.isclass(model) and not issubclass(model, keras.Model):
        raise UsageError(f"model={qualified}: is not a subclass of tower_train.TowerModel or "
                         "keras.Model")
    if isinstance(model, TowerModel):
        raise UsageError(f"model={qualified} instance: pass the class (model={qualified}) or a "
                         "zero-argument callable that returns a new one (model=lambda: ...), so "
                         "that the run builds it under its devices and options")
    if isinstance(model, keras.Model):
        return _instance_spec(model, qualified, config, num_classes, source_classes, loss)
    if not callable(model):
        raise UsageError(f"model={model!r}: expected a registered name, a tower_train.TowerModel "
                         "subclass, a keras.Model, or a zero-argument callable that returns one")
    if num_classes is not None:
        raise UsageError(f"num_classes={num_classes}: is passed to a model class or a registered "
                         f"name; the callable {qualified} takes no arguments")
    return ModelSpec(qualified, _checked_factory(
        model, qualified, config, None if loss is None else per_label_loss(loss)))


def _refuse_loss(loss: object, label: str) -> None:
    if loss is not None:
        raise UsageError(f"loss= is for a keras.Model; {label} is a tower_train.TowerModel, which "
                         "owns its loss (per_example_loss): leave loss out")


def _refuse_missing_loss(loss: object, label: str) -> None:
    if loss is None:
        raise UsageError(f"{label}: is a keras.Model, not a tower_train.TowerModel, so it needs "
                         "loss=: a Keras loss name ('sparse_categorical_crossentropy'), a "
                         "keras.losses.Loss, or a callable (labels, outputs) -> one loss per label")


def _instance_spec(instance: keras.Model, qualified: str, config: TrainConfig,
                   num_classes: int | None, source_classes: int, loss: object) -> ModelSpec:
    """A keras.Model instance (no TowerModel): cloned where the run makes its variables, its
    current weights copied in; the user's instance gets the trained weights back."""
    what = f"model={qualified}"
    _refuse_missing_loss(loss, f"{what} instance")
    resolved = per_label_loss(loss)
    if num_classes is not None and num_classes != source_classes:
        raise UsageError(f"num_classes={num_classes}: a keras.Model instance is not made with it, "
                         f"and the data has {source_classes} classes")
    if config.precision != "fp32" and instance.dtype_policy.name != DTYPE_POLICIES[config.precision]:
        # A clone keeps each layer's dtype policy, so --precision would not reach it.
        raise UsageError(f"--precision={config.precision}: {what} instance keeps its layers' "
                         "dtype policies when cloned; pass a zero-argument callable that makes it "
                         "(model=lambda: ...), which runs under the run's policy")
    check_network(instance, what, config)

    def make() -> TowerModel:
        return KerasModel(clone_instance(instance, what), *resolved)

    return ModelSpec(qualified, make, lambda trained: hand_back_instance(instance, trained))


def _constructor(cls: type, name: str, config: TrainConfig, given: dict) -> Callable[[], TowerModel]:
    # An option's constructor argument is passed only when the option is on, so that a model
    # whose __init__ takes num_classes alone still trains without it.
    asked = {f"--{option}": kwarg for option, kwarg in _OPTION_KWARGS if getattr(config, option)}

    def make() -> TowerModel:
        try:
            return cls(**given, **{kwarg: True for kwarg in asked.values()})
        except TypeError as e:
            if asked and any(kwarg in str(e) for kwarg in asked.values()):
                raise UsageError(f"{' '.join(asked)}: {ModelSpec(name, cls).label} does not accept "
                                 f"{', '.join(asked.values())}: its __init__ must take **kwargs and "
                                 f"pass them to TowerModel ({str(e).splitlines()[0]})") from None
            raise

    return make


def _checked_factory(factory: Callable[[], keras.Model], name: str, config: TrainConfig,
                     loss: tuple[PerLabelLoss, str] | None) -> Callable[[], TowerModel]:
    """A zero-argument factory cannot be handed the options: check that the model it made has
    them. A plain keras.Model it makes is wrapped with `loss`, which only a plain one takes."""
    def make() -> TowerModel:
        model = factory()
        if isinstance(model, TowerModel):
            _refuse_loss(loss, f"the model that {name}() returns")
            for option, attribute in _OPTION_KWARGS:
                if getattr(config, option) and not getattr(model, attribute):
                    raise UsageError(f"--{option}: the model that {name}() returns was made with "
                                     f"{attribute}=False; make it with {attribute}=True")
        elif isinstance(model, keras.Model):
            what = f"the model that {name}() returns"
            _refuse_missing_loss(loss, what)
            check_network(model, what, config)
            model = KerasModel(model, *loss)
        return model  # anything else is refused by build_model

    return make


@contextlib.contextmanager
def dtype_policy(precision: str) -> Iterator[None]:
    """Keras reads the policy when a layer is made, so it is set only while the model is built."""
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(DTYPE_POLICIES[precision])
    try:
        yield
    finally:
        keras.config.set_dtype_policy(previous)


def build_model(spec: ModelSpec, source: Source, config: TrainConfig,
                training: bool = False) -> TowerModel:
    """The network, made in the current scope and built on one example of `source`; with
    `training`, its training pass is traced too (`check_training_pass`).

    Raises:
      UsageError: its code fails (named by file:line), it is no TowerModel, its logits do not
        fit the labels, its loss is not one per label, or it cannot honour an option the run
        asked for.
    """
    what = spec.label
    with dtype_policy(config.precision):
        model = call_user_code(spec.make, what)
    if not isinstance(model, TowerModel):
        raise UsageError(f"{what}: made a {type(model).__name__}, not a tower_train.TowerModel or "
                         "a keras.Model")
    example = call_user_code(source.example_input, f"{source.name}: preprocess")
    called = f"{what}, called on {describe_nest(example)}"
    logits = call_user_code(lambda: model(example, training=False), called)
    if not tf.is_tensor(logits):
        raise UsageError(f"{called}: returned a {type(logits).__name__}; call() must return one "
                         "tensor, the logits")
    check_logits(spec.label, logits, source)
    if not model.trainable_variables:
        raise UsageError(f"{what}: has no trainable variables, so there is nothing to train")
    labels = source.example_labels()
    keras_loss = model.loss_label if isinstance(model, KerasModel) else None
    loss_name = keras_loss or "per_example_loss"
    losses = call_user_code(lambda: model.per_example_loss(labels, logits),
                            f"{what}, {keras_loss}" if keras_loss else f"{what}.per_example_loss")
    loss_shape = tf.convert_to_tensor(losses).shape.as_list()
    if source.num_classes is None and loss_shape != [1, *source.weight_shape.as_list()]:
        raise UsageError(f"{what}: {loss_name} returned shape {loss_shape} for targets "
                         f"{describe_nest(labels)}; it must return one loss per weight of "
                         f"{source.name}, [1, *{source.weight_shape.as_list()}] (the weights' shape)")
    if source.num_classes is not None and loss_shape != labels.shape.as_list():
        raise UsageError(f"{what}: {loss_name} returned shape {loss_shape} for labels "
                         f"{labels.shape.as_list()}; it must return one loss per label, the labels' "
                         "shape exactly (a [B, 1] loss for [B] labels would broadcast)")
    regularization = call_user_code(model.regularization, f"{what}.regularization()")
    if tf.convert_to_tensor(regularization).shape.rank != 0:
        raise UsageError(f"{what}: regularization() returned shape "
                         f"{tf.convert_to_tensor(regularization).shape.as_list()}; it must be a scalar")
    model.adds_batch_losses = bool(model.batch_losses())
    if config.recompute and not model.runs_blocks:
        raise UsageError(f"--recompute: {what} runs no block through self.run_block, "
                         "so there is nothing to recompute (see docs/models.md)")
    if config.sync_bn and not any(isinstance(layer, keras.layers.BatchNormalization)
                                  for layer in model._flatten_layers()):  # every nested layer
        raise UsageError(f"--sync_bn: {what} has no BatchNormalization layer")
    fault = replica_state_fault(config.mode, what, model)
    if fault:
        keeping = " or ".join(m for m in ONE_PROCESS_MODES if MODE_RULES[m].keeps_replica_state)
        raise UsageError(f"{fault}; use --mode={keeping}")
    if training:
        warn_of_unused_overrides(what, model, loss_name)
        check_training_pass(what, model, example, labels)
        check_labels(model, logits, source)
    if config.recompute and model.adds_batch_losses:
        raise UsageError(f"--recompute: {what} adds losses of the batch through Keras (add_loss, "
                         "activity_regularizer), which a recomputed block would drop; train it "
                         "without --recompute")
    return model


def replica_state_fault(mode: str, what: str, model: keras.Model) -> str | None:
    """Why `mode` cannot train the built `model`: it has state that its replicas move (BN's moving
    statistics, Dropout's random generators), which the mode cannot keep; None when it can."""
    if MODE_RULES[mode].keeps_replica_state or not model.non_trainable_variables:
        return None
    return (f"--mode={mode}: {what} has moving statistics (BatchNormalization) or random state "
            "(Dropout), which CentralStorageStrategy cannot update from its replicas")


def check_logits(label: str, logits: tf.Tensor, source: Source) -> None:
    """Logits must be [b, *label shape, C] with C >= the source's number of classes; for targets
    (no classes) the loss alone says what outputs it takes."""
    if source.num_classes is None:
        return
    shape = tf.convert_to_tensor(logits).shape.as_list()
    labels = [1, *source.label_spec.shape.as_list()]
    wanted = f"[{', '.join(map(str, labels))}, C >= {source.num_classes}]"
    if shape[:-1] != labels or len(shape) != len(labels) + 1 or shape[-1] < source.num_classes:
        raise UsageError(f"{label}: its logits are {shape} for labels {labels} in "
                         f"0..{source.num_classes - 1} of {source.name}; they must be {wanted}")


# What keras.Model.fit and evaluate would call, and tower-train never does.
_FIT_STEPS = ("train_step", "compute_loss", "test_step")


def warn_of_unused_overrides(what: str, model: TowerModel, loss_name: str) -> None:
    """Names, in one warning, the methods of Keras's fit and evaluate that the user's network
    overrides: tower-train runs its own update and evaluation, so they would be ignored silently."""
    network = model.network if isinstance(model, KerasModel) else model
    honoured = model.honoured_overrides if isinstance(model, KerasModel) else ()
    overridden = [name for name in _FIT_STEPS if name not in honoured
                  and getattr(type(network), name) is not getattr(keras.Model, name)]
    if overridden:
        logging.warning("%s: overrides keras.Model's %s, which tower-train never calls: its updates and "
                        "held-out evaluations run the model's call() and %s per label, the update rule "
                        "of docs/gradient-math.md", what, ", ".join(overridden), loss_name)


def check_training_pass(what: str, model: TowerModel, example: tf.Tensor, labels: tf.Tensor) -> None:
    """Traces (never runs) the model's training pass on one example, as the towers will, in the
    current strategy's replica context: an error that only tracing or `training=True` raises is
    one line naming the user's file:line, a variable made only in training is refused, and the
    trainable variables that get no gradient are named (refused when none gets one). Sets
    `model.adds_batch_losses` when the pass adds losses of the batch through Keras (some models
    add them only with training=True), and `model.sparse_gradients`.
    """
    untrained: list[str] = []
    batch_losses: list[int] = []
    sparse: list[bool] = []

    def training_pass(features: tf.Tensor, labels: tf.Tensor) -> None:
        # Under a name scope, as the towers are, the gradient included (--recompute calls the
        # blocks again inside it): a root scope refuses names such as "__basic_block" that Keras
        # opens for a class named _BasicBlock.
        with tf.name_scope("training_pass"):
            with tf.GradientTape(persistent=True) as tape:
                logits = model(features, training=True)
                batch_loss = model.batch_loss()
                loss = (tf.reduce_sum(tf.cast(model.per_example_loss(labels, logits), tf.float32))
                        + model.update_regularization() + batch_loss)
            batch_losses.append(len(model.batch_losses()))
            gradients = tape.gradient(loss, model.trainable_variables)
            batch_gradients = tape.gradient(batch_loss, model.trainable_variables)
        untrained[:] = [v.path for v, g in zip(model.trainable_variables, gradients) if g is None]
        sparse[:] = [isinstance(g, tf.IndexedSlices) and b is None for g, b in zip(gradients, batch_gradients)]

    created: list[str] = []

    def refuse_creation(next_creator, **kwargs):
        created.append(str(kwargs.get("name")))
        raise RuntimeError("a variable made in training")  # ends the trace; named below

    strategy = tf.distribute.get_strategy()
    traced = tf.function(lambda features, labels: strategy.run(training_pass, args=(features, labels)),
                         autograph=False)
    try:
        with tf.variable_creator_scope(refuse_creation):
            call_user_code(lambda: traced.get_concrete_function(example, labels),
                           f"{what}, traced for training on {describe_nest(example)}")
    except UserCodeError:
        if not created:
            raise
        # The optimizer, the accumulators and the checkpoint are made from the variables the
        # first call made: one made later would be saved but never trained.
        raise UsageError(f"{what}: makes variables in training that its first call "
                         f"(training=False) did not make ({', '.join(created)}); make every layer's "
                         "variables in __init__ or in that call") from None
    model.adds_batch_losses = model.adds_batch_losses or max(batch_losses) > 0
    model.sparse_gradients = tuple(sparse)
    variables = model.trainable_variables
    if len(untrained) == len(variables):
        raise UsageError(f"{what}: none of its {len(variables)} trainable variables gets a gradient "
                         "from the loss (are the logits computed from them, in a float dtype?)")
    if untrained:
        logging.warning("%s: %d of %d trainable variables get no gradient from the loss and will "
                        "not change: %s", what, len(untrained), len(variables), ", ".join(untrained))
