"""tower_train/keras/compiled_loss.py directly: `CompiledLoss`'s per-example loss, averaged over the batch,
is Keras's own `model.compute_loss` on the same batch (one loss, the "crossentropy" alias, a loss
per output with loss_weights, an output without a loss), and each example's value is the numpy
crossentropy times its sample weight; bad loss and loss_weights names, one UsageError line each."""
import keras
import numpy as np
import pytest
import tensorflow as tf

from test_keras_fit import binary, softmax, two_outputs
from tower_train.errors import UsageError
from tower_train.keras.compiled_loss import CompiledLoss
from tower_train.user_keras_model import pack_outputs

EXAMPLES = 12


def batch(seed=0):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(EXAMPLES, 5)).astype(np.float32), rng.integers(0, 3, EXAMPLES),
            rng.uniform(0.0, 2.0, EXAMPLES).astype(np.float32))


def compiled(make, **compile_arguments):
    keras.utils.set_random_seed(7)
    model = make()
    model.compile(optimizer="sgd", **compile_arguments)
    return model


def per_example(model, x, y, sample_weight) -> np.ndarray:
    """CompiledLoss built as tower_train.keras.fit builds it (from the first example), applied to
    the model's outputs packed as KerasModel.call packs them."""
    loss = CompiledLoss(model, *tf.nest.map_structure(lambda a: a[:1], (x, y)))
    got = np.asarray(loss((y, tf.constant(sample_weight)), pack_outputs(model(x))))
    assert got.shape == (EXAMPLES,)
    return got


def crossentropy(probabilities: np.ndarray, classes: np.ndarray) -> np.ndarray:
    return -np.log(probabilities[np.arange(len(classes)), classes].astype(np.float64))


def binary_crossentropy(probability: np.ndarray, target: np.ndarray) -> np.ndarray:
    p = probability.reshape(-1).astype(np.float64)
    return -(target * np.log(p) + (1.0 - target) * np.log(1.0 - p))


@pytest.mark.parametrize("loss", ["sparse_categorical_crossentropy", "crossentropy",
                                  keras.losses.SparseCategoricalCrossentropy()])
def test_one_loss_is_kerass_compute_loss(loss):
    x, y, sample_weight = batch()
    model = compiled(softmax, loss=loss)
    got = per_example(model, x, y, sample_weight)
    probabilities = np.asarray(model(x))
    np.testing.assert_allclose(got, crossentropy(probabilities, y) * sample_weight, rtol=1e-6)
    want = model.compute_loss(x, y, model(x), sample_weight=sample_weight)
    np.testing.assert_allclose(got.mean(), float(want), rtol=1e-6)


def test_crossentropy_alias_on_a_sigmoid_is_binary_crossentropy_on_rank_1_labels():
    """[n] 0/1 labels for a 1-unit sigmoid's [n, 1] outputs: one loss per example, not [n, n]."""
    x, classes, sample_weight = batch(1)
    y = (classes % 2).astype(np.float32)
    model = compiled(binary, loss="crossentropy")
    got = per_example(model, x, y, sample_weight)
    np.testing.assert_allclose(got, binary_crossentropy(np.asarray(model(x)), y) * sample_weight,
                               rtol=1e-5)
    want = model.compute_loss(x, y, model(x), sample_weight=sample_weight)
    np.testing.assert_allclose(got.mean(), float(want), rtol=1e-6)


LOSSES = {"kind": "sparse_categorical_crossentropy", "flag": "binary_crossentropy"}


@pytest.mark.parametrize("targets", ["dict", "list"])
def test_a_loss_per_output_with_loss_weights_is_kerass_compute_loss(targets):
    x, classes, sample_weight = batch(2)
    flags = (classes == 1).astype(np.float32)[:, None]
    y = {"kind": classes, "flag": flags} if targets == "dict" else [classes, flags]
    model = compiled(two_outputs, loss=LOSSES, loss_weights={"kind": 0.3, "flag": 2.0})
    got = per_example(model, x, y, sample_weight)
    kind, flag = (np.asarray(output) for output in model(x))
    by_hand = (0.3 * crossentropy(kind, classes) + 2.0 * binary_crossentropy(flag, flags[:, 0]))
    np.testing.assert_allclose(got, by_hand * sample_weight, rtol=1e-5)
    want = model.compute_loss(x, y, model(x), sample_weight=sample_weight)
    np.testing.assert_allclose(got.mean(), float(want), rtol=1e-6)


def test_an_output_without_a_loss_adds_nothing_as_in_keras():
    """loss=[loss, None]: Keras trains the second output on nothing."""
    x, classes, sample_weight = batch(3)
    flags = (classes == 1).astype(np.float32)[:, None]
    model = compiled(two_outputs, loss=[LOSSES["kind"], None], loss_weights=[0.3, 5.0])
    got = per_example(model, x, [classes, flags], sample_weight)
    np.testing.assert_allclose(got, 0.3 * crossentropy(np.asarray(model(x)[0]), classes)
                               * sample_weight, rtol=1e-5)
    want = model.compute_loss(x, [classes, flags], model(x), sample_weight=sample_weight)
    np.testing.assert_allclose(got.mean(), float(want), rtol=1e-6)


def test_bad_loss_and_loss_weights_are_one_usage_error_line():
    x, classes, _ = batch(4)
    y = [classes, (classes == 1).astype(np.float32)[:, None]]
    cases = [
        (dict(loss=LOSSES, loss_weights={"kind": 1.0, "flags": 2.0}),
         "loss_weights: names flags, not an output of the model (kind, flag)"),
        (dict(loss={**LOSSES, "other": "mse"}), "loss: names other, not an output of the model"),
        (dict(loss=LOSSES, loss_weights=[1.0]),
         "loss_weights: 1 for the model's 2 outputs (kind, flag)"),
        (dict(loss=keras.losses.MeanSquaredError(reduction="sum")),
         "tower_train.keras.fit takes Keras's default reduction"),
    ]
    for compile_arguments, message in cases:
        model = compiled(two_outputs, **compile_arguments)
        with pytest.raises(UsageError) as excinfo:
            CompiledLoss(model, x[:1], [part[:1] for part in y])
        assert message in str(excinfo.value) and "\n" not in str(excinfo.value), excinfo.value
