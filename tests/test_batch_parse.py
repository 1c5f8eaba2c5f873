"""Tests of tower_train.data.batch_parse: a per-example parse over a batch gives what the same
parse gives each example alone, whether it vectorizes, runs per example (a JPEG decoded at its own
size), or decodes raw bytes (vectorized for a feature's strings of one length, per example
otherwise); on the path its ops allow, without pfor's error log; and through a TFRecordSource's
stream."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import tensorflow as tf

from tower_train.data.batch_parse import parse_batch
from tower_train.data.tfrecord import TFRecordSource
from tower_train.data.tfrecord_writer import write_examples

SIDE = 8  # images are resized to SIDE x SIDE
LENGTH = 6  # byte sequences are padded to LENGTH values
WORDS = tf.constant([b"a", b"bcd", b"efghij", b"kl"])
LOOPS = {"While", "StatelessWhile"}
CONDS = {"If", "StatelessIf"}


def resized_jpeg(example):
    image = tf.image.resize(tf.io.decode_jpeg(example["image"], channels=3), [SIDE, SIDE])
    return image, example["label"]


def padded_int32s(example):
    values = tf.io.decode_raw(example["values"], tf.int32)
    return tf.pad(values, [[0, LENGTH - tf.shape(values)[0]]]), example["label"]


def word_of(example):
    """Bytes made inside parse from no string feature: word x, each of its own length."""
    letters = tf.io.decode_raw(tf.gather(WORDS, example["x"]), tf.uint8)
    return tf.pad(letters, [[0, LENGTH - tf.shape(letters)[0]]]), example["label"]


def short_or_long(example):
    """Bytes picked per example from two features, each of one length in the batch."""
    letters = tf.io.decode_raw(tf.where(example["x"] % 2 == 0, example["short"], example["long"]), tf.uint8)
    return tf.pad(letters, [[0, LENGTH - tf.shape(letters)[0]]]), example["label"]


def tokens_weighted(example):
    """Labels per position and weights, from decoded bytes, and the rest of the batch's text."""
    values = tf.cast(tf.io.decode_raw(example["values"], tf.uint8)[:3], tf.int64)
    return tf.cast(values, tf.float32), values % 2, tf.cast(values % 3, tf.float16)


def ones_of_length_x(example):
    """A per-example length that pfor's converters cannot take (tf.fill's shape)."""
    ones = tf.fill([tf.cast(example["x"], tf.int32)], 1.0)
    return tf.pad(ones, [[0, LENGTH - tf.shape(ones)[0]]]), example["label"]


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


def spec(shape: list[int], dtype: tf.DType) -> tuple[tf.TensorSpec, tf.TensorSpec]:
    return tf.TensorSpec(shape, dtype), tf.TensorSpec([], tf.int64)


JPEG_SIGNATURE = spec([SIDE, SIDE, 3], tf.float32)
LABEL = np.arange(4, dtype=np.int64)
TEXT = np.array([b"id", b"id-1", b"", b"id-222"], dtype=object)  # a string feature parse does not decode


@pytest.mark.parametrize("parse, signature, columns", [
    (resized_jpeg, JPEG_SIGNATURE, {"image": jpegs([(20, 30), (40, 10), (32, 32), (17, 50)])}),
    (resized_jpeg, JPEG_SIGNATURE, {"image": jpegs([(12, 12)] * 4)}),
    (padded_int32s, spec([LENGTH], tf.int32), {"values": int32_bytes([3, 5, 1, 6])}),
    (padded_int32s, spec([LENGTH], tf.int32), {"values": int32_bytes([4] * 4), "text": TEXT}),
    (word_of, spec([LENGTH], tf.uint8), {"x": np.arange(4), "text": np.array([b"ab"] * 4, dtype=object)}),
    (short_or_long, spec([LENGTH], tf.uint8), {"x": np.arange(4), "short": [b"ab"] * 4, "long": [b"abcde"] * 4}),
    (tokens_weighted, (tf.TensorSpec([3], tf.float32), tf.TensorSpec([3], tf.int64), tf.TensorSpec([3], tf.float16)),
     {"values": [b"abcd", b"efg", b"hijkl", b"mnop"]}),
    (ones_of_length_x, spec([LENGTH], tf.float32), {"x": np.array([1, 4, 2, 6])}),
], ids=["jpegs-of-four-sizes", "jpegs-of-one-size", "raw-bytes-of-four-lengths",
        "raw-bytes-of-one-length-beside-text", "raw-bytes-made-by-parse", "raw-bytes-picked-by-parse",
        "labels-per-position-and-weights", "a-length-pfor-cannot-take"])
def test_a_batch_parses_as_its_examples_do_alone(parse, signature, columns):
    columns = {name: np.array(values, dtype=object if isinstance(values[0], bytes) else np.int64)
               for name, values in {**columns, "label": LABEL}.items()}
    batched = tf.function(lambda batch: parse_batch(parse, batch, signature))(
        {name: tf.constant(values) for name, values in columns.items()})
    for got, want, expected in zip(batched, each_alone(parse, columns), signature):
        assert got.dtype == expected.dtype and got.shape == [4, *expected.shape]
        np.testing.assert_array_equal(got.numpy(), want)


def traced(parse, dtypes: dict, signature) -> tuple[list[tf.Operation], dict[str, set[str]]]:
    """parse_batch's ops over `dtypes`' columns, and the op types of each function it calls."""
    graph = tf.function(lambda batch: parse_batch(parse, batch, signature)).get_concrete_function(
        {name: tf.TensorSpec([None], dtype) for name, dtype in dtypes.items()}).graph
    library = graph.as_graph_def().library.function
    return graph.get_operations(), {f.signature.name: {node.op for node in f.node_def} for f in library}


def op_types(parse, dtypes: dict, signature) -> set[str]:
    return {op.type for op in traced(parse, dtypes, signature)[0]}


def test_each_parse_takes_the_path_its_ops_allow():
    def casts(example):
        return tf.cast(example["x"], tf.float32) * 2.0, example["label"]

    ops = op_types(casts, {"x": tf.int64, "label": tf.int64}, spec([], tf.float32))
    assert not ops & (LOOPS | CONDS), ops  # vectorized: no loop
    # decode_jpeg has no vectorizing converter: tf.map_fn's loop, and nothing else.
    ops = op_types(resized_jpeg, {"image": tf.string, "label": tf.int64}, JPEG_SIGNATURE)
    assert ops & LOOPS and not ops & CONDS, ops
    # decode_raw of a feature as it is: a cond on its strings' lengths, whose first branch (one
    # length) is vectorized and whose second runs per example.
    graph_ops, functions = traced(padded_int32s, {"values": tf.string, "text": tf.string, "label": tf.int64},
                                  spec([LENGTH], tf.int32))
    cond = next(op for op in graph_ops if op.type in CONDS)
    one_length, several = (functions[cond.get_attr(branch).name] for branch in ("then_branch", "else_branch"))
    assert "DecodeRaw" in one_length and not one_length & LOOPS, one_length
    assert several & LOOPS, several
    # decode_raw of bytes parse picked: per example, with no cond.
    ops = op_types(short_or_long, {"x": tf.int64, "short": tf.string, "long": tf.string, "label": tf.int64},
                   spec([LENGTH], tf.uint8))
    assert ops & LOOPS and not ops & CONDS, ops


def test_a_parse_pfor_cannot_vectorize_runs_per_example_without_pfors_error_log():
    records = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append
    tf.get_logger().addHandler(handler)
    try:
        ops = op_types(ones_of_length_x, {"x": tf.int64, "label": tf.int64}, spec([LENGTH], tf.float32))
    finally:
        tf.get_logger().removeHandler(handler)
    assert ops & LOOPS, ops
    assert [r.getMessage()[:80] for r in records if r.levelno >= logging.WARNING] == []


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
