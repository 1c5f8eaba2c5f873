"""A plain Keras model and loss through `tower_train.fit` (tower_train/user_keras_model.py): the trained
weights equal Keras's own `fit` on one batch of G per update, in every layout; data=(x, y); what
`TrainResult` hands back; and bad input, one UsageError line with nothing written."""
import keras
import numpy as np
import pytest
import tensorflow as tf

import tower_train
import tower_train.keras
from tower_train import user_keras_model
from keras_reference import (CLASSES, EXAMPLES, FEATURES, G, LR, SGD_OPTIONS, UPDATES, arrays, assert_same_weights, functional,
                             keras_fit, sequential, with_weights)

# (num_gpus, batch_size, accum): N x B x K = G.
LAYOUTS = [("tower", (1, 24, 1)), ("tower", (2, 12, 1)), ("tower", (2, 6, 2)), ("tower", (3, 2, 4)),
           ("mirrored", (2, 6, 2))]


def tower_fit(model, loss, tmp_path, mode="tower", layout=(2, 6, 2), **options):
    towers, batch, accum = layout
    x, y = arrays()
    return tower_train.fit(model=model, loss=loss, data=(x, y), shuffle=False, mode=mode,
                           num_gpus=towers, batch_size=batch, accum=accum,
                           train_dir=tmp_path / "run", **{**SGD_OPTIONS, **options})


@pytest.fixture(scope="module")
def sequential_reference():
    keras.utils.set_random_seed(1)
    initial = sequential().get_weights()
    expected = keras_fit(sequential, initial, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    # Without the penalty the weights would end elsewhere: the comparison sees how it counts.
    unregularized = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(8, activation="tanh"),
                                      keras.layers.Dense(CLASSES)])
    without = keras_fit(lambda: keras.models.clone_model(unregularized), initial,
                        keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    assert np.abs(expected[0] - without[0]).max() > 1e-2
    return initial, expected


@pytest.mark.parametrize("mode,layout", LAYOUTS, ids=[f"{m}-{n}x{b}x{k}" for m, (n, b, k) in LAYOUTS])
def test_a_keras_sequential_trains_to_the_weights_of_kerass_own_fit(sequential_reference, tmp_path,
                                                                     mode, layout):
    initial, expected = sequential_reference
    model = with_weights(sequential, initial)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    result = tower_fit(model, loss, tmp_path, mode, layout)
    assert result.step == UPDATES and result.model is model
    assert loss.reduction == "sum_over_batch_size"  # the user's loss object is left as it was
    assert_same_weights(model.get_weights(), expected)
    assert np.abs(model.get_weights()[0] - initial[0]).max() > 1e-2  # it trained


def test_a_functional_model_and_a_loss_name_train_to_the_weights_of_kerass_own_fit(tmp_path):
    keras.utils.set_random_seed(2)
    initial = functional().get_weights()
    expected = keras_fit(functional, initial, "sparse_categorical_crossentropy")
    model = with_weights(functional, initial)
    result = tower_fit(model, "sparse_categorical_crossentropy", tmp_path, layout=(3, 4, 2))
    assert result.model is model
    assert_same_weights(model.get_weights(), expected)


def test_a_one_unit_sigmoid_with_integer_labels_trains_to_the_weights_of_kerass_own_fit(tmp_path):
    # Integer 0/1 labels of shape [n] against [n, 1] outputs: Keras casts them to the outputs'
    # dtype and brings them to the outputs' rank; broadcast instead, each loss would be a mean over
    # the whole batch's labels.
    x, classes = arrays()
    labels = classes % 2

    def make():
        return keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(8, activation="tanh"),
                                 keras.layers.Dense(1, activation="sigmoid")])

    keras.utils.set_random_seed(3)
    initial = make().get_weights()
    reference = with_weights(make, initial)
    reference.compile(keras.optimizers.SGD(LR), "binary_crossentropy")
    reference.fit(x, labels, batch_size=G, shuffle=False, epochs=UPDATES * G // EXAMPLES, verbose=0)
    model = with_weights(make, initial)
    result = tower_train.fit(model=model, loss="binary_crossentropy", data=(x, labels), shuffle=False,
                             num_gpus=2, batch_size=6, accum=2, train_dir=tmp_path / "run", **SGD_OPTIONS)
    assert result.step == UPDATES and labels.dtype.kind == "i"
    assert_same_weights(model.get_weights(), reference.get_weights())
    assert np.abs(model.get_weights()[0] - initial[0]).max() > 1e-2  # it trained


class Subclassed(keras.Model):
    """Keras writes its get_config itself (its __init__ takes plain values), so it can be cloned."""

    def __init__(self, units: int = 8, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(units, activation="tanh",
                                         kernel_regularizer=keras.regularizers.L2(0.05))
        self.logits = keras.layers.Dense(CLASSES)

    def call(self, features, training=False):
        return self.logits(self.hidden(features))


class OwnSteps(Subclassed):
    """Overrides what Keras's fit and evaluate call: a train_step that updates nothing, its own
    compute_loss and test_step."""

    def train_step(self, data):
        return {}

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        return 0.0

    def test_step(self, data):
        return {}


def test_a_model_overriding_fits_steps_trains_with_one_warning_naming_them_and_what_runs_instead(
        tmp_path, caplog):
    keras.utils.set_random_seed(6)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    for model in (Subclassed, OwnSteps):
        caplog.clear()
        result = tower_fit(model, loss, tmp_path / model.__name__, max_steps=1)
        named = [r.getMessage() for r in caplog.records if "never calls" in r.getMessage()]
        if model is Subclassed:
            assert named == []
    assert named == ["model=test_keras_models.OwnSteps: overrides keras.Model's train_step, compute_loss, "
                     "test_step, which tower-train never calls: its updates and held-out evaluations run "
                     "the model's call() and loss=SparseCategoricalCrossentropy per label, the update "
                     "rule of docs/gradient-math.md"]
    assert result.loss > 0.5  # the loss= cross-entropy of 3 classes, not compute_loss's 0


def built_subclassed():
    model = Subclassed()
    model(np.zeros((1, FEATURES), np.float32))
    return model


def activity_regularized(factor=0.5):
    return keras.Sequential([keras.Input((FEATURES,)),
                             keras.layers.Dense(8, activation="tanh",
                                                activity_regularizer=keras.regularizers.L2(factor)),
                             keras.layers.Dense(CLASSES)])


@pytest.mark.parametrize("mode,layout", [("tower", (3, 2, 4)), ("mirrored", (2, 6, 2))])
def test_an_activity_regularizer_counts_as_in_kerass_own_fit(tmp_path, mode, layout):
    """Keras divides the regularizer by the batch size: on one batch of G, its mean over the G
    examples, which tower-train adds whatever the shards."""
    keras.utils.set_random_seed(3)
    initial = activity_regularized().get_weights()
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    expected = keras_fit(activity_regularized, initial, loss)
    model = with_weights(activity_regularized, initial)
    tower_fit(model, loss, tmp_path, mode, layout)
    assert_same_weights(model.get_weights(), expected)
    without = keras_fit(lambda: activity_regularized(0.0), initial, loss)
    assert np.abs(expected[0] - without[0]).max() > 1e-2  # the regularizer shows


def dropout_between_regularized_layers():
    return keras.Sequential([keras.Input((FEATURES,)),
                             keras.layers.Dense(8, activation="tanh", kernel_regularizer=keras.regularizers.L2(0.05),
                                                activity_regularizer=keras.regularizers.L2(0.5)),
                             keras.layers.Dropout(0.3), keras.layers.Dense(CLASSES)])


def test_dropout_beside_weight_and_activity_regularizers_trains_alike_in_tower_and_mirrored_mode(tmp_path):
    """The towers' passes with Dropout's seeds (and, in tower mode, no copy of the weights at K = 1)
    read the weight penalties and collect the activity losses: each mode's update is the same."""
    keras.utils.set_random_seed(4)
    initial = dropout_between_regularized_layers().get_weights()
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    trained = {}
    for mode, layout in (("tower", (2, 6, 2)), ("mirrored", (2, 6, 2)), ("tower", (2, 12, 1))):
        model = with_weights(dropout_between_regularized_layers, initial)
        result = tower_fit(model, loss, tmp_path / f"{mode}{layout[2]}", mode, layout)
        assert result.step == UPDATES and np.isfinite(result.loss)
        trained[mode, layout[2]] = model.get_weights()
    assert_same_weights(trained["mirrored", 2], trained["tower", 2])
    assert np.abs(trained["tower", 1][0] - initial[0]).max() > 1e-2  # it trained at K = 1 too


def test_a_subclassed_instance_is_cloned_and_trains_to_the_weights_of_kerass_own_fit(tmp_path):
    keras.utils.set_random_seed(3)
    initial = built_subclassed().get_weights()
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    expected = keras_fit(built_subclassed, initial, loss)
    model = with_weights(built_subclassed, initial)
    assert tower_fit(model, loss, tmp_path).model is model
    assert_same_weights(model.get_weights(), expected)


class ScaledCrossEntropy(keras.losses.Loss):
    """A user's Loss subclass: its own call and a constructor argument, no get_config, so that
    Keras cannot remake it from a config."""

    def __init__(self, scale: float):
        super().__init__()
        self.scale = scale

    def call(self, y_true, y_pred):
        return self.scale * keras.losses.sparse_categorical_crossentropy(y_true, y_pred, from_logits=True)


@keras.saving.register_keras_serializable(package="test_keras_models")
class RegisteredScaledCrossEntropy(ScaledCrossEntropy):
    pass


@pytest.mark.parametrize("loss_class", [ScaledCrossEntropy, RegisteredScaledCrossEntropy])
def test_a_custom_loss_subclass_is_called_as_written_and_trains_to_the_weights_of_kerass_own_fit(
        tmp_path, loss_class):
    keras.utils.set_random_seed(5)
    initial = sequential().get_weights()
    expected = keras_fit(sequential, initial, loss_class(2.0))
    model, loss = with_weights(sequential, initial), loss_class(2.0)
    result = tower_fit(model, loss, tmp_path, layout=(1, 24, 1))
    assert result.model is model and loss.reduction == "sum_over_batch_size"
    assert_same_weights(model.get_weights(), expected)
    # At scale 1 the weights would end elsewhere: the user's call, with its scale, was used.
    assert np.abs(expected[0] - keras_fit(sequential, initial, loss_class(1.0))[0]).max() > 1e-2


def test_a_keras_instance_resumes_from_the_train_dirs_checkpoint_bit_for_bit(tmp_path):
    keras.utils.set_random_seed(4)
    initial = sequential().get_weights()
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    options = dict(layout=(2, 6, 2), deterministic=True)
    straight = tower_fit(with_weights(sequential, initial), loss, tmp_path / "straight", **options)
    tower_fit(with_weights(sequential, initial), loss, tmp_path / "resumed", max_steps=UPDATES // 2,
              **options)
    # Other weights copied in: the checkpoint's replace them.
    resumed = tower_fit(sequential(), loss, tmp_path / "resumed", **options)
    assert resumed.step == UPDATES and resumed.history["step"] == [UPDATES]
    for got, want in zip(resumed.model.get_weights(), straight.model.get_weights(), strict=True):
        np.testing.assert_array_equal(got, want)


def per_label_cross_entropy(labels, outputs):
    return keras.losses.sparse_categorical_crossentropy(labels, outputs, from_logits=True)


def test_each_kind_of_loss_becomes_one_loss_per_label_and_the_users_loss_object_keeps_its_reduction():
    logits = np.array([[2.0, -1.0, 0.5], [0.1, 0.2, -3.0], [-1.0, 0.0, 1.0]], np.float32)
    labels = np.array([2, 0, 1])
    log_softmax = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    cross_entropy = -log_softmax[np.arange(3), labels]

    users = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    loss, label = user_keras_model.per_label_loss(users)
    assert label == "loss=SparseCategoricalCrossentropy"
    np.testing.assert_allclose(loss(labels, logits), cross_entropy, rtol=1e-6)
    assert users.reduction == "sum_over_batch_size"
    assert float(users(labels, logits)) == pytest.approx(cross_entropy.mean(), rel=1e-6)
    # A name is Keras's function of that name: here of probabilities.
    loss, label = user_keras_model.per_label_loss("sparse_categorical_crossentropy")
    assert label == "loss=sparse_categorical_crossentropy"
    np.testing.assert_allclose(loss(labels, np.exp(log_softmax)), cross_entropy, rtol=1e-5)
    assert user_keras_model.per_label_loss(per_label_cross_entropy) == (
        per_label_cross_entropy, "loss=test_keras_models.per_label_cross_entropy")
    with pytest.raises(tower_train.UsageError) as error:
        user_keras_model.per_label_loss(3)
    assert str(error.value) == ("loss=3: expected a Keras loss name, a keras.losses.Loss, or a "
                                "callable (labels, outputs) -> one loss per label")

    # The wrapper computes the network's outputs and takes float16 ones to the loss in float32.
    network = with_weights(sequential, [np.full(w.shape, 0.1, np.float32) for w in sequential().get_weights()])
    wrapped = user_keras_model.KerasModel(network, *user_keras_model.per_label_loss(users))
    x, _ = arrays()
    np.testing.assert_array_equal(wrapped(x[:4]), network(x[:4]))
    losses = wrapped.per_example_loss(labels, tf.constant(logits, tf.float16))
    assert losses.dtype == tf.float32
    np.testing.assert_allclose(losses, cross_entropy, rtol=1e-3)


def test_train_result_holds_the_trained_network_and_the_history(tmp_path):
    x, y = arrays()
    held_x, held_y = arrays(n=30, seed=1)
    model = sequential()
    result = tower_train.fit(model=model, loss=per_label_cross_entropy, data=(x, y),
                             eval_data=(held_x, held_y), optimizer="sgd", learning_rate=LR,
                             num_gpus=2, batch_size=6, accum=2, max_steps=UPDATES, log_every=2,
                             eval_every=3, ema_decay=0.0, train_dir=tmp_path / "run")
    assert result.model is model
    # It predicts with the trained weights: a numpy forward pass over them.
    kernel, bias, out_kernel, out_bias = model.get_weights()
    logits = np.tanh(held_x @ kernel + bias) @ out_kernel + out_bias
    np.testing.assert_allclose(model.predict(held_x, verbose=0), logits, rtol=1e-5, atol=1e-5)
    history = result.history
    assert history["step"] == [2, 4, 6] and len(history["loss"]) == 3
    assert history["loss"][-1] == result.loss
    assert history["learning_rate"] == [pytest.approx(LR)] * 3
    assert history["val_step"] == [3, 6]
    assert history["val_precision"][-1] == pytest.approx(np.mean(logits.argmax(1) == held_y))
    assert history["val_precision"][-1] == result.eval_precision

    made = tower_train.fit(model=sequential, loss=per_label_cross_entropy, data=(x, y),
                           num_gpus=2, batch_size=6, max_steps=1, train_dir=tmp_path / "made")
    assert type(made.model) is keras.Sequential  # the callable's model, not the trainer's wrapper
    assert made.history["val_step"] == [] and made.history["step"] == [1]

    # An instance never called has no weights to copy in: it is built to hand the trained ones back.
    unbuilt = keras.Sequential([keras.layers.Dense(8), keras.layers.Dense(CLASSES)])
    trained = tower_train.fit(model=unbuilt, loss=per_label_cross_entropy, data=(x, y), num_gpus=2,
                              batch_size=6, max_steps=1, ema_decay=0.0, train_dir=tmp_path / "unbuilt")
    assert trained.model is unbuilt and [w.shape for w in unbuilt.get_weights()] == [
        (FEATURES, 8), (8,), (8, CLASSES), (CLASSES,)]


def token_tagger() -> keras.Sequential:
    """Token ids [B, 48] -> logits [B, 48, 32]: the built-in markov_text's shapes."""
    from tower_train.data.text_sets import LENGTH, VOCABULARY

    return keras.Sequential([keras.Input((LENGTH,), dtype="int32"), keras.layers.Embedding(VOCABULARY, 8),
                             keras.layers.Dense(VOCABULARY)])


def test_a_per_token_loss_callable_on_padded_sequences_gives_the_update_of_the_whole_updates_tokens(
        tmp_path):
    """Σw·ℓ/Σw over the real tokens of the whole update, against a plain GradientTape step on it;
    and Keras's own fit on the same batch, which divides by the number of labels (padding
    included), is off from it by exactly Σw / (G·48) (docs/models.md states it for markov_text)."""
    from tower_train.data.text_sets import markov_text

    source = markov_text()
    g, updates = 32, 2
    x, y, w = (np.asarray(a[:g * updates]) for a in (source.train_features, source.train_labels,
                                                       source.train_weights))
    keras.utils.set_random_seed(5)
    initial = token_tagger().get_weights()

    def per_token(labels, logits):
        return tf.nn.sparse_softmax_cross_entropy_with_logits(tf.cast(labels, tf.int32), logits)

    reference = with_weights(token_tagger, initial)
    for u in range(updates):
        part = slice(u * g, (u + 1) * g)
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(w[part] * per_token(y[part], reference(x[part]))) / w[part].sum()
        for variable, gradient in zip(reference.trainable_variables,
                                      tape.gradient(loss, reference.trainable_variables)):
            variable.assign_sub(LR * tf.convert_to_tensor(gradient))
    model = with_weights(token_tagger, initial)
    tower_train.fit(model=model, loss=per_token, data=(x, y, w), shuffle=False, num_gpus=2,
                    batch_size=8, accum=2, max_steps=updates, optimizer="sgd", learning_rate=LR,
                    lr_schedule="constant", warmup_steps=0, scale_lr=False, ema_decay=0.0,
                    train_dir=tmp_path / "run")
    assert_same_weights(model.get_weights(), reference.get_weights())

    # One update of Keras's fit with these weights as sample_weight, against ours from `initial`.
    keras_model = with_weights(token_tagger, initial)
    keras_model.compile(keras.optimizers.SGD(LR),
                        keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    keras_model.fit(x[:g], y[:g], sample_weight=w[:g], batch_size=g, shuffle=False, verbose=0)
    ours = with_weights(token_tagger, initial)
    tower_train.fit(model=ours, loss=per_token, data=(x, y, w), shuffle=False, num_gpus=2,
                    batch_size=16, max_steps=1, optimizer="sgd", learning_rate=LR,
                    lr_schedule="constant", warmup_steps=0, scale_lr=False, ema_decay=0.0,
                    train_dir=tmp_path / "one")
    factor = w[:g].sum() / w[:g].size
    assert 0.3 < factor < 0.8  # the padding is a large share: the difference is no rounding
    for got, want, start in zip(keras_model.get_weights(), ours.get_weights(), initial, strict=True):
        np.testing.assert_allclose(got - start, factor * (want - start), rtol=1e-4, atol=1e-7)


class Net(tower_train.TowerModel):
    def __init__(self, num_classes: int = CLASSES, **kwargs):
        super().__init__(num_classes, **kwargs)
        self.logits = keras.layers.Dense(num_classes)

    def call(self, features, training=False):
        return self.logits(features)


class Uncloneable(keras.Model):
    """Its __init__ takes an argument Keras cannot serialize, and it has no get_config."""

    def __init__(self, scale: np.ndarray, **kwargs):
        super().__init__(**kwargs)
        self.scale = scale
        self.logits = keras.layers.Dense(CLASSES)

    def call(self, features, training=False):
        return self.logits(features * self.scale)


def uncloneable():
    model = Uncloneable(np.ones(FEATURES, np.float32))
    model(np.zeros((1, FEATURES), np.float32))
    return model


def batch_normalized():
    return keras.Sequential([keras.Input((FEATURES,)), keras.layers.BatchNormalization(name="bn"),
                             keras.layers.Dense(CLASSES)])


def mean_loss(labels, outputs):
    return tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(labels, outputs, from_logits=True))


SEQUENTIAL = "model=keras.src.models.sequential.Sequential"
BAD = [
    (dict(model=sequential), f"{SEQUENTIAL} instance: is a keras.Model, not a tower_train.TowerModel, "
                             "so it needs loss=: a Keras loss name"),
    (dict(model=Net, loss="sparse_categorical_crossentropy"),
     "loss= is for a keras.Model; model=test_keras_models.Net is a tower_train.TowerModel, which "
     "owns its loss (per_example_loss): leave loss out"),
    (dict(model=sequential, loss=mean_loss),
     f"{SEQUENTIAL}: loss=test_keras_models.mean_loss returned shape [] for labels [1]; it must "
     "return one loss per label"),
    (dict(model=sequential, loss="no_such_loss"),
     "loss='no_such_loss': not a Keras loss name (keras.losses)"),
    (dict(model=sequential, loss="sparse_categorical_crossentropy",
          data=lambda: tower_train.ArraySource(*arrays()), shuffle=False),
     "shuffle=: is for data=(x, y) or (x, y, w) numpy arrays; data=ArraySource is not"),
    (dict(model=uncloneable, loss="sparse_categorical_crossentropy"),
     "model=test_keras_models.Uncloneable instance: Keras cannot clone it (NotImplementedError: "
     "Object Uncloneable was created by passing non-serializable argument values in `__init__()`"),
    (dict(model=sequential, loss="sparse_categorical_crossentropy", precision="bf16"),
     f"--precision=bf16: {SEQUENTIAL} instance keeps its layers' dtype policies when cloned"),
    (dict(model=sequential, loss="sparse_categorical_crossentropy", recompute=True),
     f"--recompute: {SEQUENTIAL} is a keras.Model, whose blocks tower-train does not know"),
    (dict(model=batch_normalized, loss="sparse_categorical_crossentropy", sync_bn=True,
          mode="mirrored"),
     f"--sync_bn: {SEQUENTIAL} has BatchNormalization layers made without synchronized=True (bn)"),
    (dict(model=sequential, loss="sparse_categorical_crossentropy", num_classes=5,
          data=lambda: tower_train.ArraySource(*arrays())),
     "num_classes=5: a keras.Model instance is not made with it, and the data has 3 classes"),
]


@pytest.mark.parametrize("arguments,message", BAD, ids=[m[:40] for _, m in BAD])
def test_bad_keras_input_is_one_usage_error_line_and_writes_nothing(tmp_path, arguments, message):
    """`model` and `data` are made in the test (a Keras model's variables after the device plan)."""
    arguments = {"data": arrays, **arguments}
    model, data = arguments.pop("model"), arguments.pop("data")()
    train_dir = tmp_path / "run"
    with pytest.raises(tower_train.UsageError) as error:
        tower_train.fit(model=model if isinstance(model, type) else model(), data=data,
                        train_dir=train_dir, num_gpus=2, batch_size=4, max_steps=1, **arguments)
    assert message in str(error.value) and "\n" not in str(error.value), error.value
    assert not train_dir.exists()


def test_an_optimizer_object_trains_a_copy_of_itself(sequential_reference, tmp_path):
    """fit(optimizer=<a Keras optimizer object>): the reference's SGD at LR, as an object, gives
    its weights; the object itself is left unbuilt."""
    initial, expected = sequential_reference
    model = with_weights(sequential, initial)
    optimizer = keras.optimizers.SGD(LR)
    x, y = arrays()
    tower_train.fit(model=model, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                    data=(x, y), shuffle=False, num_gpus=2, batch_size=6, accum=2,
                    train_dir=tmp_path / "run", optimizer=optimizer, max_steps=UPDATES, ema_decay=0.0)
    assert_same_weights(model.get_weights(), expected)
    assert not optimizer.built


def test_float16_layers_in_a_run_that_scales_no_loss_are_named_in_one_warning(tmp_path, caplog):
    """A mixed_float16 layer in an fp32 run computes in float16 without loss scaling: one line
    names it and what to do; a float32 model gets no such line."""
    keras.utils.set_random_seed(16)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    half = keras.Sequential([keras.Input((FEATURES,)),
                             keras.layers.Dense(8, activation="tanh", dtype="mixed_float16",
                                                name="half"),
                             keras.layers.Dense(CLASSES, dtype="float32")])
    for model, said in ((sequential(), False), (half, True)):
        caplog.clear()
        tower_fit(model, loss, tmp_path / str(said), max_steps=1)
        warnings = [r.getMessage() for r in caplog.records if "float16" in r.getMessage()]
        assert len(warnings) == said, warnings
        assert not said or warnings[0].endswith(
            ": half compute in float16 (their dtype policy), but the loss is scaled only "
            "with --precision=fp16 (this run: fp32), so small gradients may underflow to 0; make "
            "the model under float32, or train with precision='fp16' and model=lambda: ...")


def sigmoid() -> keras.Sequential:
    return keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(1, activation="sigmoid")])


def float_labels(**changed):
    """arrays() with float32 labels, `changed` as {"at_<example>": label}."""
    x, y = arrays()
    y = y.astype(np.float32)
    for at, label in changed.items():
        y[int(at.removeprefix("at_"))] = label
    return x, y


SPARSE_TAKES = ("sparse_categorical_crossentropy cannot read: it takes class indices, whole numbers "
                "in 0..2 (the outputs' last dimension is 3)")
UNREADABLE_LABELS = [
    (sequential, "sparse_categorical_crossentropy", dict(data=float_labels(at_5=np.nan)),
     "train_labels: example 5 holds nan; targets must be finite numbers"),
    (sequential, "sparse_categorical_crossentropy", dict(data=float_labels(at_9=3.0)),
     f"train_labels: example 9 holds 3.0, which {SPARSE_TAKES}"),
    (sequential, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
     dict(data=float_labels(at_7=1.5)), f"train_labels: example 7 holds 1.5, which {SPARSE_TAKES}"),
    (sequential, "sparse_categorical_crossentropy",
     dict(data=float_labels(), eval_data=float_labels(at_3=-1.0)),
     f"eval_labels: example 3 holds -1.0, which {SPARSE_TAKES}"),
    (sequential, keras.losses.SparseCategoricalCrossentropy(ignore_class=-1),
     dict(data=float_labels(at_2=-1.0, at_4=-2.0)),
     f"train_labels: example 4 holds -2.0, which {SPARSE_TAKES} or ignore_class=-1"),
    # Integer labels of a 1-unit sigmoid are targets, as floats (docs/data.md).
    (sigmoid, "binary_crossentropy", dict(data=(arrays()[0], np.minimum(np.arange(EXAMPLES) - 4, 1))),
     "train_labels: example 0 holds -4.0, which binary_crossentropy cannot read: it takes "
     "probabilities of class 1, in [0, 1]"),
]


@pytest.mark.parametrize("make,loss,data,message", UNREADABLE_LABELS,
                         ids=[m[:40] for *_, m in UNREADABLE_LABELS])
def test_labels_a_keras_loss_cannot_read_are_refused_with_the_example_before_the_first_update(
        tmp_path, make, loss, data, message):
    """A NaN, a class the outputs do not have, a fraction or a negative label were cast by the
    loss: a NaN ended at the update that read it in "Received a label value of
    -9223372036854775808 which is outside the valid range of [0, 3)", the others trained."""
    train_dir = tmp_path / "run"
    with pytest.raises(tower_train.UsageError) as error:
        tower_train.fit(model=make(), loss=loss, train_dir=train_dir, num_gpus=2, batch_size=4,
                        max_steps=1, **data)
    assert str(error.value) == message
    assert not train_dir.exists()  # before anything is written


def test_keras_fit_refuses_a_class_the_model_has_not_with_the_example():
    x, y = arrays()
    y[9] = CLASSES + 2
    model = sequential()
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with pytest.raises(tower_train.UsageError) as error:
        tower_train.keras.fit(model, x, y, batch_size=8, num_gpus=2, verbose=0)
    assert str(error.value) == (f"train_labels[0]: example 9 holds 5, which {SPARSE_TAKES}")
