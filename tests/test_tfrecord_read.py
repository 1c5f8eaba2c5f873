"""Tests of tower_train.data.tfrecord_read: files read in parallel, chunk by chunk, give a
TFRecordSource the stream a sequential read of the same files gives, record for record, resumed
too; and a read that fails, fails where the sequential read would."""

from __future__ import annotations

import os

import numpy as np
import pytest
import tensorflow as tf

from tower_train.data import tfrecord, tfrecord_check
from tower_train.data.tfrecord import TFRecordSource
from tower_train.data.tfrecord_read import read_records
from tower_train.data.tfrecord_writer import write_examples

SIZES = (37, 50, 3, 41)  # records per file; at 60 bytes a chunk, each file is many chunks
N = sum(SIZES)


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(tfrecord_check, "CHUNK_BYTES", 60)


@pytest.fixture
def files(tmp_path, small_chunks):
    paths, start = [], 0
    for i, size in enumerate(SIZES):
        path = str(tmp_path / f"part-{i}.tfrecord")
        ids = np.arange(start, start + size)
        write_examples(path, {"id": ids, "label": ids % 3})
        paths.append(path)
        start += size
    return paths


def make_source(files, shuffle_buffer: int) -> TFRecordSource:
    return TFRecordSource(
        files, files[1:3], features={"id": tf.io.FixedLenFeature([], tf.int64),
                                     "label": tf.io.FixedLenFeature([], tf.int64)},
        parse=lambda e: (e["id"], tf.cast(e["label"], tf.int32)), feature_spec=tf.TensorSpec([], tf.int64),
        label_spec=tf.TensorSpec([], tf.int32), num_classes=3, shuffle_buffer=shuffle_buffer)


def ids(source, *, start: int = 0, count: int = 2 * N + 11, micro_batch: int = 8) -> np.ndarray:
    batches = source.train_stream(seed=5, start_position=start, micro_batch=micro_batch)
    out = np.concatenate([features.numpy() for features, _, _ in batches.take(-(-count // micro_batch))])
    return out[:count]


def sequential(files, chunks, compression):
    """The reader the parallel one replaced: every file in one TFRecordDataset, one after the other."""
    return tf.data.TFRecordDataset(list(files))


def test_the_files_come_in_many_chunks(files):
    chunks = tfrecord_check.checked_chunks("set", "train_files", files, None)
    assert [sum(count for _, count in chunks[path]) for path in files] == list(SIZES)
    assert all(len(chunks[path]) > 1 for path in files if os.path.getsize(path) > 60)


def test_records_come_in_the_files_order(files):
    chunks = tfrecord_check.checked_chunks("set", "train_files", files, None)
    records = list(read_records(files, chunks, None).as_numpy_iterator())
    single = files[0] + ".all"  # the files' bytes one after the other: one file of every record
    with open(single, "wb") as out:
        for path in files:
            with open(path, "rb") as part:
                out.write(part.read())
    assert records == list(tf.data.TFRecordDataset(single).as_numpy_iterator())
    parsed = [tf.io.parse_single_example(r, {"id": tf.io.FixedLenFeature([], tf.int64)})["id"] for r in records]
    np.testing.assert_array_equal(parsed, np.arange(N))


@pytest.mark.parametrize("shuffle_buffer", [0, 8, 1000])
def test_the_stream_and_its_resumes_are_the_sequential_reads(files, monkeypatch, shuffle_buffer):
    source = make_source(files, shuffle_buffer)
    parallel = {start: ids(source, start=start) for start in (0, 29, N + 7)}
    held_out = [b[1].numpy() for b in source.eval_batches(4)]
    monkeypatch.setattr(tfrecord, "read_records", sequential)
    reference = make_source(files, shuffle_buffer)
    for start, stream in parallel.items():
        np.testing.assert_array_equal(stream, ids(reference, start=start), err_msg=f"start {start}")
    np.testing.assert_array_equal(parallel[29][:50], parallel[0][29:79])  # resume mid-epoch: the tail
    np.testing.assert_array_equal(parallel[N + 7][:50], parallel[0][N + 7:N + 57])
    for got, want in zip(held_out, [b[1].numpy() for b in reference.eval_batches(4)], strict=True):
        np.testing.assert_array_equal(got, want)
    if shuffle_buffer == 0:
        np.testing.assert_array_equal(parallel[0], np.arange(2 * N + 11) % N)


def test_a_record_damaged_mid_chunk_fails_the_read_after_the_records_before_it(files):
    chunks = tfrecord_check.checked_chunks("set", "train_files", files, None)
    path = files[1]
    offsets = np.cumsum([0] + [len(r) + 16 for r in tf.data.TFRecordDataset(path).as_numpy_iterator()])
    bad = 23  # not a chunk's first record
    assert all(offset != offsets[bad] for offset, _ in chunks[path])
    with open(path, "r+b") as f:
        f.seek(int(offsets[bad]) + 12 + 2)
        byte = f.read(1)[0]
        f.seek(int(offsets[bad]) + 12 + 2)
        f.write(bytes([byte ^ 0xFF]))
    failures = []
    for reader in (read_records(files, chunks, None), tf.data.TFRecordDataset(files)):
        iterator = iter(reader)
        for _ in range(SIZES[0] + bad):
            next(iterator)
        with pytest.raises(tf.errors.DataLossError, match="corrupted record at ") as caught:
            next(iterator)
        failures.append(caught.value.message.split("}} ")[-1])
    assert failures[0] == failures[1]  # the same offset as the sequential read's


def test_a_file_cut_at_a_record_since_it_was_checked_fails_the_read(files):
    chunks = tfrecord_check.checked_chunks("set", "train_files", files, None)
    path = files[0]
    with open(path, "rb") as f:
        content = f.read()
    with open(path, "wb") as f:
        f.write(content[:len(content) - (len(content) // SIZES[0])])  # one record fewer
    with pytest.raises(tf.errors.FailedPreconditionError, match="expected to contain"):
        list(read_records(files, chunks, None))
