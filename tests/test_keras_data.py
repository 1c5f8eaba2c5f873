"""tower_train/keras/data.py directly: `split_data` holds out the last fraction Keras's fit holds
out (Keras's own `train_validation_split`), `class_weights` gives each example its class's weight
as Keras's own conversion does, and `read_dataset` reads a batched `tf.data.Dataset` into the
arrays it was made of; bad arguments, one UsageError line each."""
import keras
import numpy as np
import pytest
import tensorflow as tf
from keras.src.trainers.data_adapters.array_slicing import train_validation_split
from keras.src.trainers.data_adapters.data_adapter_utils import class_weight_to_sample_weights

from tower_train.errors import UsageError
from tower_train.keras.data import class_weights, read_dataset, split_data

EXAMPLES = 10  # 0.25 of it is 2.5: the cut's rounding shows


def features(kind: str, rng):
    if kind == "array":
        return rng.normal(size=(EXAMPLES, 3)).astype(np.float32)
    return {"a": rng.normal(size=(EXAMPLES, 3)).astype(np.float32),
            "b": rng.normal(size=(EXAMPLES, 2, 2)).astype(np.float32)}


def assert_same_nest(got, want):
    tf.nest.assert_same_structure(got, want)
    for got_one, want_one in zip(tf.nest.flatten(got), tf.nest.flatten(want), strict=True):
        np.testing.assert_array_equal(got_one, want_one)


@pytest.mark.parametrize("kind", ["array", "dict"])
def test_validation_split_holds_out_the_last_fraction_kerass_fit_holds_out(kind):
    rng = np.random.default_rng(0)
    x, y = features(kind, rng), rng.integers(0, 3, EXAMPLES)
    sample_weight = rng.uniform(0.5, 2.0, EXAMPLES).astype(np.float32)
    (train_x, train_y, train_w), (held_x, held_y, held_w) = split_data(
        x, y, sample_weight, None, 0.25, None)
    want_train, want_held = train_validation_split((x, y, sample_weight), validation_split=0.25)
    assert len(train_y) == 7  # floor(10 x 0.75), not 8
    assert_same_nest((train_x, train_y, train_w), want_train)
    assert_same_nest((held_x, held_y, held_w), want_held)
    # Without sample weights every training example weighs 1, and the held-out part has none.
    (_, _, ones), (_, _, none) = split_data(x, y, None, None, 0.25, None)
    np.testing.assert_array_equal(ones, np.ones(7, np.float32))
    assert ones.dtype == np.float32 and none is None


def test_validation_data_is_held_out_as_given_and_nothing_is_split_off():
    rng = np.random.default_rng(1)
    x, y = features("array", rng), rng.integers(0, 3, EXAMPLES)
    held = (x[:3] + 1.0, y[:3])
    (train_x, train_y, train_w), held_out = split_data(x, y, None, None, 0.5, held)
    assert_same_nest((train_x, train_y), (x, y))  # validation_data wins over validation_split
    assert len(train_w) == EXAMPLES and held_out[0] is held[0] and held_out[2] is None


# Labels as Keras takes them with class_weight: int classes [n] or [n, 1], one-hot rows, and a
# 1-unit sigmoid's float 0/1 targets [n] or [n, 1] (rounded: 0.9 is class 1).
CLASSES = np.array([0, 2, 1, 1, 0, 2, 2, 0])
LABELS = {"int": CLASSES,
          "int_column": CLASSES[:, None],
          "one_hot": np.eye(3, dtype=np.float32)[CLASSES],
          "sigmoid": np.array([0.0, 1.0, 0.9, 0.1, 1.0, 0.0, 1.0, 0.0], np.float32),
          "sigmoid_column": np.array([0.0, 1.0, 0.9, 0.1, 1.0, 0.0, 1.0, 0.0], np.float32)[:, None]}
WANT = {"int": [0.5, 1.0, 4.0, 4.0, 0.5, 1.0, 1.0, 0.5],  # class 2 left out of the dict: 1
        "sigmoid": [0.5, 4.0, 4.0, 0.5, 4.0, 0.5, 4.0, 0.5]}


@pytest.mark.parametrize("labels", sorted(LABELS))
def test_class_weights_give_each_example_its_classs_weight_as_keras_does(labels):
    class_weight = {0: 0.5, 1: 4.0}
    y = LABELS[labels]
    got = class_weights(y, class_weight)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, WANT["sigmoid" if labels.startswith("sigmoid") else "int"])
    np.testing.assert_array_equal(got, class_weight_to_sample_weights(y, class_weight))
    # split_data weighs the examples it trains on by class; Keras's validation has no weights.
    x = np.zeros((len(y), 2), np.float32)
    (_, _, train_w), (_, _, held_w) = split_data(x, y, None, class_weight, 0.25, None)
    np.testing.assert_array_equal(train_w, got[:6])
    assert held_w is None


def batches(x, y, sample_weight, size):
    parts = (x, y) if sample_weight is None else (x, y, sample_weight)
    return tf.data.Dataset.from_tensor_slices(parts).batch(size)


@pytest.mark.parametrize("kind", ["array", "dict"])
def test_read_dataset_gives_the_arrays_its_batches_were_cut_from_and_their_size(kind):
    rng = np.random.default_rng(2)
    x, y = features(kind, rng), rng.integers(0, 3, EXAMPLES)
    sample_weight = rng.uniform(0.5, 2.0, EXAMPLES).astype(np.float32)
    # The same order every epoch: read twice to find that out, kept once.
    got_x, got_y, got_w, size, examples = read_dataset(batches(x, y, sample_weight, 4), None, None,
                                                       None, 0.0, epochs=3)
    assert (size, examples) == (4, EXAMPLES)  # batches of 4, 4 and the last 2
    assert_same_nest((got_x, got_y, got_w), (x, y, sample_weight))
    *_, no_weights, size, _ = read_dataset(batches(x, y, None, 3), None, None, None, None, epochs=1)
    assert no_weights is None and size == 3


def test_a_dataset_that_reshuffles_is_read_once_per_epoch_in_each_epochs_order():
    """As Keras's own fit reads it, epoch by epoch: the arrays hold, in turn, the orders of the
    examples that Keras's fit trains each epoch on (recorded from its model's calls)."""
    rng = np.random.default_rng(4)
    x = rng.normal(size=(EXAMPLES, 1)).astype(np.float32)
    y = np.arange(EXAMPLES)

    def reshuffled():
        return tf.data.Dataset.from_tensor_slices((x, y)).shuffle(
            EXAMPLES, seed=5, reshuffle_each_iteration=True).batch(EXAMPLES)

    seen = []

    class Recorder(keras.layers.Layer):
        def call(self, inputs):
            tf.py_function(lambda batch: seen.append(batch.numpy().ravel().copy()), [inputs], [])
            return inputs

    model = keras.Sequential([keras.Input((1,)), Recorder(), keras.layers.Dense(1)])
    model.compile("sgd", "mse", run_eagerly=True)
    model.fit(reshuffled(), epochs=3, verbose=0)
    keras_orders = [np.searchsorted(np.sort(x.ravel()), batch) for batch in seen]
    by_value = np.argsort(x.ravel())
    keras_orders = [by_value[order] for order in keras_orders]  # example indices, epoch by epoch
    assert len(keras_orders) == 3 and not np.array_equal(keras_orders[0], keras_orders[1])
    got_x, got_y, _, size, examples = read_dataset(reshuffled(), None, None, None, 0.0, epochs=3)
    assert (size, examples) == (EXAMPLES, EXAMPLES)
    np.testing.assert_array_equal(got_y, np.concatenate(keras_orders))
    np.testing.assert_array_equal(got_x, x[got_y])


def test_bad_arguments_are_one_usage_error_line():
    rng = np.random.default_rng(3)
    x, y = features("array", rng), rng.integers(0, 3, EXAMPLES)
    dataset = batches(x, y, None, 4)
    features_only = tf.data.Dataset.from_tensor_slices(x).batch(4)
    cases = [
        (lambda: read_dataset(dataset, y, None, None, 0.0, 1),
         "y=: not with x=Dataset, whose elements give the batches (x, y[, sample_weight])"),
        (lambda: read_dataset(dataset, None, None, None, 0.2, 1),
         "validation_split=: not with x=Dataset"),
        (lambda: read_dataset(features_only, None, None, None, 0.0, 1),
         "x=Dataset: expected batches (x, y) or (x, y, sample_weight), one per step; it yields "
         "ndarray"),
        (lambda: split_data(x, y, None, None, 0.95, None),
         f"validation_split=0.95: leaves no example to train on of {EXAMPLES}"),
        (lambda: split_data(x, [y, y], None, {0: 2.0}, 0.0, None),
         "class_weight=: Keras takes it only for a model of one output"),
        (lambda: split_data(x, y, None, [1.0, 2.0], 0.0, None),
         "class_weight=list: expected a dict of class index -> weight"),
        (lambda: split_data(x, y, None, None, 0.0, (x, y, None, None)),
         "validation_data=tuple: expected a tuple (x, y) or (x, y, sample_weight)"),
    ]
    for call, message in cases:
        with pytest.raises(UsageError) as excinfo:
            call()
        assert message in str(excinfo.value) and "\n" not in str(excinfo.value), excinfo.value
    # Keras's fit refuses the same split.
    with pytest.raises(ValueError, match="not sufficient to split"):
        train_validation_split((x, y), validation_split=0.95)
