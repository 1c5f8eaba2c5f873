"""tower_train.data.array_source: an ArraySource hands any shape over as it is, takes several inputs and
targets, and counts the classes. Its stream contract and its refusals beside the image sets' are
test_source.py's."""
import numpy as np
import pytest

from tower_train.data.array_source import ArraySource
from tower_train.data.source import DataError


def test_array_source_hands_any_shape_over_as_it_is_and_counts_classes():
    tokens = np.arange(6 * 5, dtype=np.int64).reshape(6, 5) % 7  # 6 sequences of 5 token ids
    targets = tokens * 2  # 0..12
    weights = np.ones((6, 5), np.float32)
    weights[:, 3:] = 0  # padding
    source = ArraySource(tokens, targets, weights, shuffle=False)
    assert source.num_classes == 13 and source.feature_spec.shape == (5,)
    assert source.feature_spec.dtype == np.int64 and source.label_spec.shape == (5,)
    x, y, w = next(iter(source.train_stream(seed=0, start_position=4, micro_batch=4)))
    # shuffle=False: position p is example p mod n, untouched.
    np.testing.assert_array_equal(x.numpy(), tokens[[4, 5, 0, 1]])
    np.testing.assert_array_equal(y.numpy(), targets[[4, 5, 0, 1]])
    np.testing.assert_array_equal(w.numpy(), weights[[4, 5, 0, 1]])
    assert ArraySource(tokens, targets, num_classes=100).num_classes == 100
    assert list(source.eval_batches(4)) == []  # no held-out set: nothing to count


def test_array_source_takes_several_inputs_and_targets():
    """A dict or list of arrays is several inputs (a list kept as a tuple: tf.data would stack
    it), a list of numbers one array; float labels are targets: no classes, one weight per
    example."""
    features = {"a": np.arange(12, dtype=np.float32).reshape(6, 2), "b": np.arange(6)}
    targets = np.eye(3, dtype=np.float32)[[0, 1, 2, 0, 1, 2]]
    source = ArraySource(features, targets, shuffle=False)
    assert source.num_classes is None and source.weight_shape == [] and source.train_size == 6
    x, y, w = next(iter(source.train_stream(seed=0, start_position=4, micro_batch=4)))
    np.testing.assert_array_equal(x["a"].numpy(), features["a"][[4, 5, 0, 1]])
    np.testing.assert_array_equal(x["b"].numpy(), features["b"][[4, 5, 0, 1]])
    np.testing.assert_array_equal(y.numpy(), targets[[4, 5, 0, 1]])
    np.testing.assert_array_equal(w.numpy(), np.ones(4))
    listed = ArraySource([features["a"], features["b"]], np.arange(6) % 2)
    assert isinstance(listed.train_features, tuple) and listed.num_classes == 2
    assert ArraySource([[1.0, 2.0]] * 4, [0, 1, 0, 1]).feature_spec.shape == [2]
    with pytest.raises(DataError, match=r"train_features\['a'\] \[6\] and "
                                             r"train_features\['b'\] \[5\] and train_labels \[6\]"):
        ArraySource({"a": np.zeros(6), "b": np.zeros(5)}, np.zeros(6, np.int64))


def test_targets_that_are_not_finite_are_refused_with_the_first_examples_position():
    """A NaN target reached the loss (a class-index loss cast it to -2**63 and failed at the update
    that read it, naming neither NaN nor the example); an inf as well."""
    features = np.zeros((6, 2), np.float32)
    one_hot = np.eye(3, dtype=np.float32)[[0, 1, 2, 0, 1, 2]]
    one_hot[4, 2] = np.nan
    one_hot[5, 0] = np.nan
    with pytest.raises(DataError) as error:
        ArraySource(features, one_hot)
    assert str(error.value) == "train_labels: example 4 holds nan; targets must be finite numbers"
    several = {"class": np.zeros(6, np.float32), "box": np.ones((6, 4), np.float64)}
    held_out = {"class": several["class"], "box": several["box"].copy()}
    held_out["box"][3, 1] = -np.inf
    with pytest.raises(DataError) as error:
        ArraySource(features, several, eval_features=features, eval_labels=held_out)
    assert str(error.value) == ("eval_labels['box']: example 3 holds -inf; targets must be finite "
                                "numbers")
