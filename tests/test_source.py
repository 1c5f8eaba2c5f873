"""Tests of tower_train.data.source and tower_train.data.image_sets: the stream contract, preprocessing,
the ArraySource checks beside the image sets', the CIFAR-10 reader and the synthetic set."""

from __future__ import annotations

import hashlib
import os

import numpy as np
import pytest
import tensorflow as tf

from tower_train.data import source as data
from tower_train.data import catalog
from tower_train.data import image_sets
from tower_train.data.array_source import ArraySource
from tower_train.errors import UsageError

RECORD = 3073


def fake_source(n_train: int = 10, n_eval: int = 10, rng_seed: int = 0, augment: bool = False):
    """Random-noise images; labels i % 10, so with n <= 10 a label names its example."""
    rng = np.random.default_rng(rng_seed)
    return image_sets.image_source(
        "fake",
        rng.integers(0, 256, (n_train, 32, 32, 3), dtype=np.uint8),
        (np.arange(n_train) % 10).astype(np.int32),
        rng.integers(0, 256, (n_eval, 32, 32, 3), dtype=np.uint8),
        (np.arange(n_eval) % 10).astype(np.int32),
        augment=augment,
    )


def take_examples(dataset, count: int) -> tuple[np.ndarray, np.ndarray]:
    """The first `count` examples' (features, labels) of a batched dataset, batches concatenated."""
    images, labels = [], []
    for x, y, _ in dataset:
        images.append(x.numpy())
        labels.append(y.numpy())
        if sum(len(b) for b in labels) >= count:
            break
    return np.concatenate(images)[:count], np.concatenate(labels)[:count]


def stream(source, *, seed=7, start=0, micro_batch=8, augment=False):
    if augment:
        source = image_sets.image_source("fake", source.train_features, source.train_labels,
                                         source.eval_features, source.eval_labels, augment=True)
    return source.train_stream(seed=seed, start_position=start, micro_batch=micro_batch)


def expected_center(image: np.ndarray) -> np.ndarray:
    """numpy reference: central 24x24 crop, then (x - mean) / max(std, 1/sqrt(N))."""
    x = image[4:28, 4:28].astype(np.float64)
    return (x - x.mean()) / max(x.std(), 1 / np.sqrt(x.size))


# --------------------------------------------------------------------------------------------------
# The stream


@pytest.mark.parametrize("augment", [False, True])
def test_stream_does_not_depend_on_micro_batch(augment):
    source = fake_source(n_train=50)  # 64 examples cross an epoch boundary
    big = take_examples(stream(source, micro_batch=64, augment=augment), 64)
    small = take_examples(stream(source, micro_batch=8, augment=augment), 64)
    np.testing.assert_array_equal(big[0], small[0])
    np.testing.assert_array_equal(big[1], small[1])
    assert len(np.unique(big[1])) == 10


@pytest.mark.parametrize("augment", [False, True])
def test_resume_continues_the_same_stream(augment):
    source = fake_source(n_train=30)
    whole = take_examples(stream(source, micro_batch=64, augment=augment), 64)
    x, y, _ = next(iter(stream(source, start=40, micro_batch=8, augment=augment)))
    np.testing.assert_array_equal(x.numpy(), whole[0][40:48])
    np.testing.assert_array_equal(y.numpy(), whole[1][40:48])


def test_each_epoch_is_a_fresh_permutation_fixed_by_the_seed():
    source = fake_source(n_train=10)  # label == example index
    order = take_examples(stream(source, seed=3, micro_batch=4), 30)[1]
    epochs = order.reshape(3, 10)
    for epoch in epochs:
        assert sorted(epoch) == list(range(10))
    assert not (epochs[0] == epochs[1]).all() and not (epochs[1] == epochs[2]).all()
    assert any((epoch != np.arange(10)).any() for epoch in epochs)

    np.testing.assert_array_equal(take_examples(stream(source, seed=3, micro_batch=7), 30)[1], order)
    assert (take_examples(stream(source, seed=4, micro_batch=4), 30)[1] != order).any()


def test_plain_batches_pair_each_label_with_its_centred_standardized_image():
    source = fake_source(n_train=10)
    x, y = take_examples(stream(source, micro_batch=5), 20)
    assert x.dtype == np.float32 and x.shape == (20, 24, 24, 3) and y.dtype == np.int32
    for image, label in zip(x, y):
        np.testing.assert_allclose(image, expected_center(source.train_features[label]), atol=1e-4)


def test_static_batch_shape():
    spec = stream(fake_source(), micro_batch=6, augment=True).element_spec
    assert spec[0].shape.as_list() == [6, 24, 24, 3] and spec[0].dtype.name == "float32"
    assert spec[1].shape.as_list() == [6] and spec[1].dtype.name == "int32"
    assert spec[2].shape.as_list() == [6] and spec[2].dtype.name == "float32"


def _best_window(out: np.ndarray, raw: np.ndarray) -> tuple[int, int, bool] | None:
    """The (dy, dx, flipped) 24x24 window of `raw` that `out` is, per channel, a positive affine image of."""
    for flipped in (False, True):
        for dy in range(9):
            for dx in range(9):
                window = raw[dy : dy + 24, dx : dx + 24].astype(np.float64)
                if flipped:
                    window = window[:, ::-1]
                corr = [np.corrcoef(window[..., c].ravel(), out[..., c].ravel())[0, 1] for c in range(3)]
                if min(corr) > 0.9999:
                    # one contrast factor for all channels: equal slopes
                    slopes = [out[..., c].std() / window[..., c].std() for c in range(3)]
                    assert max(slopes) / min(slopes) < 1.001
                    return dy, dx, flipped
    return None


def test_augmentation_is_a_crop_flip_and_contrast_fixed_by_the_position():
    source = fake_source(n_train=1)  # every position is the same example
    x, _ = take_examples(stream(source, micro_batch=16, augment=True), 16)
    assert x.dtype == np.float32 and x.shape == (16, 24, 24, 3)
    plain = expected_center(source.train_features[0])
    windows = set()
    for image in x:
        assert np.abs(image - plain).max() > 0.1  # never left alone
        window = _best_window(image, source.train_features[0])
        assert window is not None
        windows.add(window)
    assert len(windows) >= 8  # positions get different distortions
    assert {flipped for _, _, flipped in windows} == {False, True}

    again, _ = take_examples(stream(source, start=5, micro_batch=3, augment=True), 3)
    np.testing.assert_array_equal(again, x[5:8])
    other_seed, _ = take_examples(stream(source, seed=8, micro_batch=16, augment=True), 16)
    assert np.abs(other_seed - x).max() > 0.1


def test_distortions_follow_the_originals_distributions_and_are_each_images_own():
    n = 60_000
    seeds = tf.stack([tf.fill([n], tf.constant(7, tf.int64)), tf.range(n, dtype=tf.int64)], -1)
    dy, dx, flip, brightness, contrast = (t.numpy() for t in image_sets.distortions(seeds))
    for offsets in (dy, dx):  # uniform in 0..8
        np.testing.assert_allclose(np.bincount(offsets, minlength=9) / n, 1 / 9, atol=0.01)
    assert abs(np.corrcoef(dy, dx)[0, 1]) < 0.02
    assert abs(flip.mean() - 0.5) < 0.01
    assert -63 <= brightness.min() and brightness.max() < 63 and abs(brightness.mean()) < 1.0
    assert 0.2 <= contrast.min() and contrast.max() < 1.8 and abs(contrast.mean() - 1.0) < 0.015
    # A pure function of each image's own seed: the same in a batch of 3 as in the batch of n.
    alone = image_sets.distortions(seeds[5:8])
    for got, want in zip(alone, (dy, dx, flip, brightness, contrast)):
        np.testing.assert_array_equal(got.numpy(), want[5:8])
    other_run = image_sets.distortions(tf.constant([[8, 5]], tf.int64))
    assert not all(np.array_equal(got.numpy(), want[5:6]) for got, want in
                   zip(other_run, (dy, dx, flip, brightness, contrast)))


def test_distort_is_tf_images_own_ops_applied_image_by_image():
    images = np.random.default_rng(3).integers(0, 256, (4, 32, 32, 3), dtype=np.uint8)
    dy, dx, flip = [0, 8, 3, 5], [8, 0, 4, 5], [False, True, True, False]
    brightness, contrast = [-63.0, 0.0, 12.5, 62.9], [0.2, 1.79, 1.0, 0.7]
    got = image_sets.distort(tf.constant(images), tf.constant(dy), tf.constant(dx), tf.constant(flip),
                             tf.constant(brightness), tf.constant(contrast))
    for i, image in enumerate(images):
        x = tf.image.crop_to_bounding_box(image, dy[i], dx[i], 24, 24)
        x = tf.image.flip_left_right(x) if flip[i] else x
        x = tf.image.adjust_brightness(tf.cast(x, tf.float32), brightness[i])
        x = tf.image.per_image_standardization(tf.image.adjust_contrast(x, contrast[i]))
        np.testing.assert_allclose(got[i], x, atol=2e-5)


@pytest.mark.parametrize("augment", [False, True])
def test_images_are_standardized(augment):
    x, _ = take_examples(stream(fake_source(n_train=20), micro_batch=20, augment=augment), 20)
    np.testing.assert_allclose(x.mean(axis=(1, 2, 3)), 0, atol=1e-4)
    np.testing.assert_allclose(x.std(axis=(1, 2, 3)), 1, atol=1e-3)


def test_bad_stream_arguments():
    with pytest.raises(ValueError, match="micro_batch"):
        stream(fake_source(), micro_batch=0)
    with pytest.raises(ValueError, match="start_position"):
        stream(fake_source(), start=-1)


def test_image_sources_and_array_sources_reject_malformed_arrays():
    good = fake_source()
    images, labels = good.train_features, good.train_labels
    with pytest.raises(data.DataError, match="train images must be uint8"):
        image_sets.image_source("x", images.astype(np.int32), labels, images, labels)
    with pytest.raises(data.DataError, match="num_classes=10 but the largest label is 10"):
        image_sets.image_source("x", images, np.full(10, 10, np.int32), images, labels)
    cases = [
        (dict(train_features=images[:3]), "train_features [3, 32, 32, 3] and train_labels [10]"),
        # Float labels are targets (of a Keras loss), which the held-out class labels are not.
        (dict(train_labels=labels.astype(np.float32)), "eval_labels are int32 [10], train_labels float32 [10]"),
        (dict(train_labels=labels - 1), "train_labels hold -1"),
        # Not wrapped to another class by the cast to int32.
        (dict(train_labels=labels.astype(np.int64) + 2**31), "train_labels hold 2147483657: labels must fit in int32"),
        (dict(train_weights=np.ones((10, 2))), "train_weights [10, 2]: must have the labels' shape [10]"),
        (dict(train_weights=np.full(10, np.nan)), "train_weights: must be finite numbers >= 0"),
        (dict(eval_features=images[:, :8]), "eval_features are uint8 [10, 8, 32, 3]"),
        (dict(eval_labels=None), "give eval_features and eval_labels together"),
        (dict(num_classes=5), "num_classes=5 but the largest label is 9"),
        (dict(train_features=images[:0], train_labels=labels[:0]), "holds no example"),
    ]
    for change, message in cases:
        arguments = dict(train_features=images, train_labels=labels, eval_features=images,
                         eval_labels=labels, **{})
        arguments.update(change)
        with pytest.raises(data.DataError) as excinfo:
            ArraySource(**arguments)
        assert message in str(excinfo.value) and "\n" not in str(excinfo.value), (change, excinfo.value)


def test_preprocess_gets_each_examples_seed_and_whether_it_trains():
    calls = []

    def preprocess(features, seeds, training):
        calls.append(training)
        return tf.cast(features, tf.float32) + tf.cast(seeds[:, 1:2], tf.float32) * 1000

    features = np.arange(8, dtype=np.int32).reshape(8, 1)
    source = ArraySource(features, np.zeros(8, np.int32), shuffle=False, preprocess=preprocess,
                              eval_features=features, eval_labels=np.zeros(8, np.int32))
    x, _, _ = next(iter(source.train_stream(seed=5, start_position=10, micro_batch=3)))
    # stream positions 10, 11, 12 are examples 2, 3, 4; the seed's second word is the position.
    np.testing.assert_array_equal(x.numpy()[:, 0], [10_002, 11_003, 12_004])
    x, _, _ = next(iter(source.eval_batches(3)))
    np.testing.assert_array_equal(x.numpy()[:, 0], [0, 1_001, 2_002])  # eval: the index
    assert set(calls) == {True, False}


# --------------------------------------------------------------------------------------------------
# Evaluation batches


def test_eval_batches_cover_every_example_once_in_order():
    source = fake_source(n_eval=10)
    batches = [(x.numpy(), y.numpy()) for x, y, _ in source.eval_batches(4)]
    assert [len(y) for _, y in batches] == [4, 4, 2]
    labels = np.concatenate([y for _, y in batches])
    np.testing.assert_array_equal(labels, np.arange(10))
    images = np.concatenate([x for x, _ in batches])
    for image, raw in zip(images, source.eval_features):
        np.testing.assert_allclose(image, expected_center(raw), atol=1e-4)


# --------------------------------------------------------------------------------------------------
# The CIFAR-10 reader and the start-up check

NAMES = [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]


def write_cifar(directory, records_per_file: int = 3) -> dict[str, np.ndarray]:
    """Write small CIFAR-10 binary files; returns each file's records as uint8 [n, 3073]."""
    rng = np.random.default_rng(1)
    written = {}
    for f, name in enumerate(NAMES):
        records = rng.integers(0, 256, (records_per_file, RECORD), dtype=np.uint8)
        records[:, 0] = (np.arange(records_per_file) + f) % 10
        records.tofile(directory / name)
        written[name] = records
    return written


def test_cifar10_reader_transposes_depth_major_records(tmp_path):
    written = write_cifar(tmp_path)
    # Pixel (row 1, column 2) of the second record of data_batch_2: bytes 1 + channel * 1024 + 1 * 32 + 2.
    records = written["data_batch_2.bin"]
    records[1, [1 + 0 * 1024 + 34, 1 + 1 * 1024 + 34, 1 + 2 * 1024 + 34]] = [11, 22, 33]
    records.tofile(tmp_path / "data_batch_2.bin")

    source = catalog.load_source("cifar10", str(tmp_path))
    assert source.name == "cifar10" and source.num_classes == 10
    assert source.train_features.shape == (15, 32, 32, 3) and source.train_features.dtype == np.uint8
    assert source.eval_features.shape == (3, 32, 32, 3)
    assert source.train_labels.dtype == np.int32 and source.eval_labels.dtype == np.int32
    np.testing.assert_array_equal(source.train_labels, [0, 1, 2, 1, 2, 3, 2, 3, 4, 3, 4, 5, 4, 5, 6])
    np.testing.assert_array_equal(source.eval_labels, [5, 6, 7])
    assert source.train_features[4, 1, 2].tolist() == [11, 22, 33]
    # Every pixel of one record, against the byte formula.
    raw = written["test_batch.bin"][2]
    for y, x, c in [(0, 0, 0), (31, 31, 2), (5, 17, 1), (17, 5, 0)]:
        assert source.eval_features[2, y, x, c] == raw[1 + c * 1024 + y * 32 + x]


def assert_one_line_error(excinfo, *needles: str) -> None:
    message = str(excinfo.value)
    assert isinstance(excinfo.value, UsageError)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, (needle, message)


def test_missing_data_dir(tmp_path):
    with pytest.raises(data.DataError) as excinfo:
        image_sets.check_data_dir("cifar10", str(tmp_path / "nowhere"))
    assert_one_line_error(excinfo, "nowhere", "does not exist")
    with pytest.raises(data.DataError) as excinfo:
        image_sets.check_data_dir("cifar10", None)
    assert_one_line_error(excinfo, "--data_dir", "data_batch_1.bin")


def test_data_dir_that_is_a_file(tmp_path):
    (tmp_path / "plain").write_bytes(b"x")
    with pytest.raises(data.DataError) as excinfo:
        image_sets.check_data_dir("cifar10", str(tmp_path / "plain"))
    assert_one_line_error(excinfo, "plain", "not a directory")


def test_missing_file(tmp_path):
    write_cifar(tmp_path)
    os.remove(tmp_path / "data_batch_3.bin")
    with pytest.raises(data.DataError) as excinfo:
        catalog.load_source("cifar10", str(tmp_path))
    assert_one_line_error(excinfo, "data_batch_3.bin", "missing")


def test_file_that_is_a_directory(tmp_path):
    write_cifar(tmp_path)
    os.remove(tmp_path / "test_batch.bin")
    (tmp_path / "test_batch.bin").mkdir()
    with pytest.raises(data.DataError) as excinfo:
        image_sets.check_data_dir("cifar10", str(tmp_path))
    assert_one_line_error(excinfo, "test_batch.bin", "not a regular file")


def test_file_of_partial_records(tmp_path):
    write_cifar(tmp_path)
    (tmp_path / "data_batch_2.bin").write_bytes(bytes(3 * RECORD + 5))
    with pytest.raises(data.DataError) as excinfo:
        image_sets.check_data_dir("cifar10", str(tmp_path))
    assert_one_line_error(excinfo, "data_batch_2.bin", str(3 * RECORD + 5), "3073")


def test_empty_file(tmp_path):
    write_cifar(tmp_path)
    (tmp_path / "test_batch.bin").write_bytes(b"")
    with pytest.raises(data.DataError) as excinfo:
        image_sets.check_data_dir("cifar10", str(tmp_path))
    assert_one_line_error(excinfo, "test_batch.bin", "empty")


def test_label_byte_above_nine(tmp_path):
    written = write_cifar(tmp_path)
    records = written["data_batch_4.bin"]
    records[2, 0] = 10
    records.tofile(tmp_path / "data_batch_4.bin")
    image_sets.check_data_dir("cifar10", str(tmp_path))  # sizes are fine: contents are not its business
    with pytest.raises(data.DataError) as excinfo:
        catalog.load_source("cifar10", str(tmp_path))
    assert_one_line_error(excinfo, "data_batch_4.bin", "record 2", "label byte 10")


def test_data_dir_with_synthetic(tmp_path):
    with pytest.raises(data.DataError) as excinfo:
        catalog.load_source("synthetic", str(tmp_path))
    assert_one_line_error(excinfo, "--data_dir", "--dataset=cifar10", str(tmp_path))


def test_error_messages_stay_on_one_line_for_odd_paths(tmp_path):
    odd = tmp_path / "two\nlines"
    with pytest.raises(data.DataError) as excinfo:
        image_sets.check_data_dir("cifar10", str(odd))
    assert_one_line_error(excinfo, "two\\nlines")


# --------------------------------------------------------------------------------------------------
# The synthetic data set


def nearest_class_mean_accuracy(source: ArraySource) -> float:
    def features(images):
        x = images.reshape(len(images), -1).astype(np.float32)
        x -= x.mean(axis=1, keepdims=True)
        x /= x.std(axis=1, keepdims=True)
        return x

    train, held_out = features(source.train_features), features(source.eval_features)
    means = np.stack([train[source.train_labels == c].mean(axis=0) for c in range(10)])
    distance = (means**2).sum(axis=1)[None, :] - 2 * held_out @ means.T  # + |x|^2, the same for every class
    return float((distance.argmin(axis=1) == source.eval_labels).mean())


def digest(arrays) -> str:
    h = hashlib.sha256()
    for array in arrays:
        h.update(np.ascontiguousarray(array).tobytes())
    return h.hexdigest()


def test_synthetic_data_set():
    source = catalog.load_source("synthetic", None)
    assert source.name == "synthetic"
    assert source.train_features.shape == (20_000, 32, 32, 3) and source.train_features.dtype == np.uint8
    assert source.eval_features.shape == (2_000, 32, 32, 3) and source.eval_features.dtype == np.uint8
    assert source.train_labels.dtype == np.int32 and source.eval_labels.dtype == np.int32
    assert np.bincount(source.train_labels, minlength=10).tolist() == [2_000] * 10
    assert np.bincount(source.eval_labels, minlength=10).tolist() == [200] * 10
    assert 20 < source.train_features.std() < 100  # neither flat nor saturated

    arrays = image_sets._synthetic_arrays()
    assert arrays[0] is source.train_features  # generated once per process
    assert digest(image_sets._synthetic_arrays.__wrapped__()) == digest(arrays)  # a fresh generation is identical
    assert not source.train_features.flags.writeable

    train_rows = {row.tobytes() for row in source.train_features.reshape(20_000, -1)}
    assert not any(row.tobytes() in train_rows for row in source.eval_features.reshape(2_000, -1))

    accuracy = nearest_class_mean_accuracy(source)
    assert 0.3 < accuracy < 0.95, accuracy
