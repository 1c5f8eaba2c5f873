"""Tests of tower_train.data.batch_parse: a per-example parse over a batch gives what the same
parse gives each example alone, whether it vectorizes, runs per example (a JPEG decoded at its own
size), or decodes raw bytes (vectorized for strings of one length, per example otherwise); and
through a TFRecordSource's stream."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from tower_train.data.batch_parse import parse_batch
from tower_train.data.tfrecord import TFRecordSource
from tower_train.data.tfrecord_writer import write_examples

SIDE = 8  # images are resized to SIDE x SIDE
LENGTH = 6  # byte sequences are padded to LENGTH int32s


def resized_jpeg(example):
    image = tf.image.resize(tf.io.decode_jpeg(example["image"], channels=3), [SIDE, SIDE])
    return image, example["label"]


def padded_int32s(example):
    values = tf.io.decode_raw(example["values"], tf.int32)
    return tf.pad(values, [[0, LENGTH - tf.shape(values)[0]]]), example["label"]


WORDS = tf.constant([b"a", b"bcd", b"efghij", b"kl"])


def word_of(example):
    """Bytes made inside parse from no string feature: word x, each of its own length."""
    letters = tf.io.decode_raw(tf.gather(WORDS, example["x"]), tf.uint8)
    return tf.pad(letters, [[0, LENGTH - tf.shape(letters)[0]]]), example["label"]


def jpegs(sizes: list[tuple[int, int]]) -> list[bytes]:
    rng = np.random.default_rng(0)
    return [tf.io.encode_jpeg(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).numpy() for h, w in sizes]


def int32_bytes(lengths: list[int]) -> list[bytes]:
    return [np.arange(10 * i, 10 * i + n, dtype=np.int32).tobytes() for i, n in enumerate(lengths)]


def each_alone(parse, columns: dict) -> list[np.ndarray]:
    """`parse` called eagerly on each example, its outputs stacked: the reference."""
    count = len(next(iter(columns.values())))
    outs = [parse({name: tf.constant(column[i]) for name, column in columns.items()}) for i in range(count)]
    return [np.stack([out[k].numpy() for out in outs]) for k in range(len(outs[0]))]


JPEG_SIGNATURE = (tf.TensorSpec([SIDE, SIDE, 3], tf.float32), tf.TensorSpec([], tf.int64))
INT32_SIGNATURE = (tf.TensorSpec([LENGTH], tf.int32), tf.TensorSpec([], tf.int64))
LETTERS_SIGNATURE = (tf.TensorSpec([LENGTH], tf.uint8), tf.TensorSpec([], tf.int64))


@pytest.mark.parametrize("parse, signature, column", [
    (resized_jpeg, JPEG_SIGNATURE, ("image", jpegs([(20, 30), (40, 10), (32, 32), (17, 50)]))),
    (resized_jpeg, JPEG_SIGNATURE, ("image", jpegs([(12, 12)] * 4))),
    (padded_int32s, INT32_SIGNATURE, ("values", int32_bytes([3, 5, 1, 6]))),
    (padded_int32s, INT32_SIGNATURE, ("values", int32_bytes([4] * 4))),
    (word_of, LETTERS_SIGNATURE, ("x", [0, 1, 2, 3])),
], ids=["jpegs-of-four-sizes", "jpegs-of-one-size", "raw-bytes-of-four-lengths", "raw-bytes-of-one-length",
        "raw-bytes-made-by-parse"])
def test_a_batch_parses_as_its_examples_do_alone(parse, signature, column):
    values = column[1]
    columns = {column[0]: np.array(values, dtype=object if isinstance(values[0], bytes) else np.int64),
               "label": np.arange(4, dtype=np.int64)}
    batched = tf.function(lambda batch: parse_batch(parse, batch, signature))(
        {name: tf.constant(values) for name, values in columns.items()})
    for got, want, spec in zip(batched, each_alone(parse, columns), signature):
        assert got.dtype == spec.dtype and got.shape == [4, *spec.shape]
        np.testing.assert_array_equal(got.numpy(), want)


def op_types(parse, columns: dict, signature) -> set[str]:
    graph = tf.function(lambda batch: parse_batch(parse, batch, signature)).get_concrete_function(
        {name: tf.TensorSpec([None], dtype) for name, dtype in columns.items()}).graph
    return {op.type for op in graph.get_operations()}


def test_a_parse_runs_vectorized_per_example_or_chosen_by_the_strings_lengths():
    def casts(example):
        return tf.cast(example["x"], tf.float32) * 2.0, example["label"]

    vectorized = op_types(casts, {"x": tf.int64, "label": tf.int64},
                          (tf.TensorSpec([], tf.float32), tf.TensorSpec([], tf.int64)))
    assert not vectorized & {"While", "StatelessWhile", "If", "StatelessIf"}, vectorized
    # decode_jpeg has no vectorizing converter: tf.map_fn's loop, and nothing else.
    per_example = op_types(resized_jpeg, {"image": tf.string, "label": tf.int64}, JPEG_SIGNATURE)
    assert per_example & {"While", "StatelessWhile"} and not per_example & {"If", "StatelessIf"}, per_example
    # decode_raw: one of the two, as the batch's strings' lengths say.
    raw = op_types(padded_int32s, {"values": tf.string, "label": tf.int64}, INT32_SIGNATURE)
    assert raw & {"If", "StatelessIf"}, raw


def test_a_tfrecord_source_streams_jpegs_of_several_sizes(tmp_path):
    sizes = [(20, 30), (40, 10), (32, 32), (17, 50), (9, 9), (64, 20)]
    images = jpegs(sizes)
    path = str(tmp_path / "train.tfrecord")
    write_examples(path, {"image": images, "label": np.arange(len(sizes)) % 3})
    source = TFRecordSource(path, features={"image": tf.io.FixedLenFeature([], tf.string),
                                            "label": tf.io.FixedLenFeature([], tf.int64)},
                            parse=resized_jpeg, feature_spec=JPEG_SIGNATURE[0], label_spec=JPEG_SIGNATURE[1],
                            num_classes=3, shuffle_buffer=0)
    source.check()
    features, labels, _ = next(iter(source.train_stream(seed=0, start_position=0, micro_batch=6)))
    want_features, want_labels = each_alone(resized_jpeg, {
        "image": np.array(images, dtype=object), "label": np.arange(len(sizes), dtype=np.int64) % 3})
    np.testing.assert_array_equal(features.numpy(), want_features)
    np.testing.assert_array_equal(labels.numpy(), want_labels)
