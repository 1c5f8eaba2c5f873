"""Tests of tower_train.data.tfrecord_writer: write_examples's rows read back as TensorFlow parses them."""

import gzip

import numpy as np
import pytest
import tensorflow as tf

from tower_train.data.tfrecord_writer import write_examples


def test_write_examples_round_trip(tmp_path):
    path = str(tmp_path / "kinds.tfrecord.gz")
    images = np.arange(2 * 4 * 4 * 3, dtype=np.uint8).reshape(2, 4, 4, 3)
    count = write_examples(path, {"image": images, "value": np.array([0.5, -2.0]),
                                  "flag": np.array([True, False]), "name": np.array([b"a", b"bc"])},
                           compression="GZIP")
    assert count == 2
    with open(path, "rb") as f:
        assert gzip.decompress(f.read())  # really compressed
    spec = {"image": tf.io.FixedLenFeature([4, 4, 3], tf.int64),
            "value": tf.io.FixedLenFeature([], tf.float32), "flag": tf.io.FixedLenFeature([], tf.int64),
            "name": tf.io.FixedLenFeature([], tf.string)}
    records = list(tf.data.TFRecordDataset(path, compression_type="GZIP"))
    parsed = [tf.io.parse_single_example(r, spec) for r in records]
    np.testing.assert_array_equal(np.stack([p["image"].numpy() for p in parsed]), images)
    assert [float(p["value"]) for p in parsed] == [0.5, -2.0]
    assert [int(p["flag"]) for p in parsed] == [1, 0]
    assert [p["name"].numpy() for p in parsed] == [b"a", b"bc"]
    with pytest.raises(ValueError, match="different numbers of rows"):
        write_examples(str(tmp_path / "bad.tfrecord"), {"a": np.zeros(2), "b": np.zeros(3)})


def test_binary_rows_keep_their_trailing_zero_bytes(tmp_path):
    path = str(tmp_path / "nested" / "binary.tfrecord")  # the directory is made
    rows = [b"ab\x00\x00", b"\x00", bytes(range(5)) + b"\x00"]
    assert write_examples(path, {"raw": rows, "label": np.arange(3)}) == 3
    spec = {"raw": tf.io.FixedLenFeature([], tf.string), "label": tf.io.FixedLenFeature([], tf.int64)}
    read = [tf.io.parse_single_example(r, spec)["raw"].numpy() for r in tf.data.TFRecordDataset(path)]
    assert read == rows
