"""Tests of tower_train.data.tfrecord: the stream contract of a TFRecordSource (purity, resuming,
shuffling, sharding), its held-out batches, and its checks (of its files too: truncated, of another
kind, damaged while training runs, as the user meets them)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from tower_train.data.source import DataError
from tower_train.errors import TrainingError
from tower_train.data.tfrecord import TFRecordSource
from tower_train.data.tfrecord_writer import write_examples
from tower_train.user_code import UserCodeError

# Train files of 10, 13 and 7 records: 30 records, ids 0..29 in file order.
TRAIN_SIZES = (10, 13, 7)
N_TRAIN = sum(TRAIN_SIZES)
EVAL_SIZES = (6, 5)
EVAL_ID = 100  # held-out ids are 100, 101, ...
NUM_CLASSES = 5
FEATURES = {"x": tf.io.FixedLenFeature([3], tf.int64), "label": tf.io.FixedLenFeature([], tf.int64)}


def rows(ids: np.ndarray) -> dict[str, np.ndarray]:
    """The written arrays of records `ids`: x = [id, id + 1000, -id], label = id % 5."""
    return {"x": np.stack([ids, ids + 1000, -ids], 1), "label": ids % NUM_CLASSES}


def parse(example):
    return tf.cast(example["x"], tf.float32), tf.cast(example["label"], tf.int32)


def write_split(directory, prefix: str, sizes, first_id: int = 0) -> list[str]:
    paths, start = [], first_id
    for i, size in enumerate(sizes):
        path = os.path.join(directory, f"{prefix}-{i:02d}.tfrecord")
        assert write_examples(path, rows(np.arange(start, start + size))) == size
        paths.append(path)
        start += size
    return paths


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    directory = tmp_path_factory.mktemp("records")
    train = write_split(directory, "train", TRAIN_SIZES)
    evaluation = write_split(directory, "eval", EVAL_SIZES, EVAL_ID)
    return str(directory), train, evaluation


def make_source(files, **overrides) -> TFRecordSource:
    directory, _, _ = files
    arguments = dict(train_files=[os.path.join(directory, "train-*.tfrecord")],
                     eval_files=[os.path.join(directory, "eval-*.tfrecord")], features=FEATURES,
                     parse=parse, feature_spec=tf.TensorSpec([3], tf.float32),
                     label_spec=tf.TensorSpec([], tf.int32), num_classes=NUM_CLASSES, shuffle_buffer=8)
    arguments.update(overrides)
    return TFRecordSource(arguments.pop("train_files"), arguments.pop("eval_files"), **arguments)


def take(dataset, count: int) -> tuple[np.ndarray, ...]:
    """The first `count` examples of a dataset of batches, as (features, labels, weights)."""
    parts = []
    for batch in dataset:
        parts.append([t.numpy() for t in batch])
        if sum(len(p[0]) for p in parts) >= count:
            break
    return tuple(np.concatenate([p[i] for p in parts])[:count] for i in range(len(parts[0])))


def stream(source, *, seed=7, start=0, micro_batch=8, shard_index=0, num_shards=1):
    return source.train_stream(seed=seed, start_position=start, micro_batch=micro_batch,
                               shard_index=shard_index, num_shards=num_shards)


def ids_of(features: np.ndarray) -> np.ndarray:
    return features[:, 0].astype(np.int64)


def check_examples(features, labels, weights) -> None:
    """Every example is the written record of its id."""
    expected = rows(ids_of(features))
    np.testing.assert_array_equal(features[:, :3], expected["x"].astype(np.float32))
    np.testing.assert_array_equal(labels, expected["label"])
    np.testing.assert_array_equal(weights, np.ones(len(labels), np.float32))


# --------------------------------------------------------------------------------------------------
# The stream


def test_stream_does_not_depend_on_micro_batch(files):
    source = make_source(files)
    big = take(stream(source, micro_batch=64), 64)  # 64 examples: across two epoch boundaries
    for micro_batch in (8, 5):
        small = take(stream(source, micro_batch=micro_batch), 64)
        for a, b in zip(big, small):
            np.testing.assert_array_equal(a, b)
    check_examples(*big)


def test_stream_is_pure_function_of_seed(files):
    """Two fresh pipelines, whatever TensorFlow's global seed, and the same dataset iterated twice
    read the same stream; another seed reads another."""
    first = take(stream(make_source(files)), 64)[0]
    tf.random.set_seed(12345)
    try:
        dataset = stream(make_source(files))
        for _ in range(2):
            np.testing.assert_array_equal(take(dataset, 64)[0], first)
    finally:
        tf.random.set_seed(None)  # no global seed again, as before
    other = take(stream(make_source(files), seed=8), 64)[0]
    assert not np.array_equal(ids_of(other), ids_of(first))


@pytest.mark.parametrize("start", [7, 40, 95])  # within the first epoch, the second, the fourth
def test_resume_continues_the_stream(files, start):
    source = make_source(files)
    fresh = take(stream(source, micro_batch=16), start + 48)
    resumed = take(stream(source, start=start, micro_batch=16), 48)
    for a, b in zip(fresh, resumed):
        np.testing.assert_array_equal(a[start:], b)
    positions = next(iter(source._raw_train_batches(7, start, 16)))[0].numpy()
    np.testing.assert_array_equal(positions, np.arange(start, start + 16))


@pytest.mark.parametrize("shuffle_buffer", [0, 1])
def test_without_shuffling_the_stream_is_file_order(files, shuffle_buffer):
    directory, train, _ = files
    # Listed out of order on purpose: each pattern's matches come sorted, patterns in their order.
    source = make_source(files, shuffle_buffer=shuffle_buffer,
                         train_files=[train[1], os.path.join(directory, "train-0[02].tfrecord")])
    features, labels, weights = take(stream(source, micro_batch=16, start=5), 3 * N_TRAIN)
    order = np.concatenate([np.arange(10, 23), np.arange(0, 10), np.arange(23, 30)])
    expected = rows(order[(5 + np.arange(3 * N_TRAIN)) % N_TRAIN])
    np.testing.assert_array_equal(features, expected["x"].astype(np.float32))
    np.testing.assert_array_equal(labels, expected["label"])
    np.testing.assert_array_equal(weights, 1.0)


def test_each_epoch_is_a_fresh_permutation(files):
    source = make_source(files, shuffle_buffer=8)
    features, labels, weights = take(stream(source, micro_batch=10), 4 * N_TRAIN)
    check_examples(features, labels, weights)
    epochs = ids_of(features).reshape(4, N_TRAIN)
    for epoch in epochs:
        np.testing.assert_array_equal(np.sort(epoch), np.arange(N_TRAIN))
    assert not np.array_equal(epochs[0], np.arange(N_TRAIN))  # shuffled
    assert len({tuple(e) for e in epochs}) == 4  # and differently each epoch


# --------------------------------------------------------------------------------------------------
# Workers


def preprocess(features, seeds, training):
    """Appends each example's seed [seed, position]: shows which position a worker gave it."""
    return tf.concat([features, tf.cast(seeds, tf.float32)], -1)


def test_stream_sharding_reads_the_one_process_stream(files):
    source = make_source(files, preprocess=preprocess)
    micro, workers, updates = 6, 2, 7  # 84 examples: across two epoch boundaries
    start = 10  # not a multiple of the global batch
    one = take(stream(source, start=start, micro_batch=micro * workers), updates * micro * workers)
    np.testing.assert_array_equal(one[0][:, 4], start + np.arange(updates * micro * workers))
    for k in range(workers):
        mine = take(stream(source, start=start, micro_batch=micro, shard_index=k, num_shards=workers),
                    updates * micro)
        for a, b in zip(one, mine):
            expected = a.reshape(updates, workers, micro, *a.shape[1:])[:, k]
            np.testing.assert_array_equal(b, expected.reshape(b.shape))


@pytest.mark.parametrize("sharding", ["stream", "files"])
def test_a_workers_raw_stream_preprocessed_as_the_towers_do_is_its_preprocessed_stream(files, sharding):
    """Training reads a worker's stream raw (features and seeds) and its towers preprocess it:
    the same batches as the stream preprocessed on the host, each example's position included."""
    source = make_source(files, sharding=sharding, preprocess=preprocess)
    arguments = dict(seed=7, start_position=8, micro_batch=4, shard_index=1, num_shards=2)
    raw = source.train_stream(**arguments, preprocessed=False)
    host = source.train_stream(**arguments)
    for (features, labels, weights), want in zip(raw.take(5), host.take(5)):
        assert features.features.shape == [4, 3]  # as parsed
        got = (source.model_input(features.features, features.seeds, training=True), labels, weights)
        for a, b in zip(got, want, strict=True):
            np.testing.assert_array_equal(a, b)


def test_files_sharding_reads_disjoint_files(files):
    source = make_source(files, sharding="files", preprocess=preprocess)
    file_of = np.repeat(np.arange(len(TRAIN_SIZES)), TRAIN_SIZES)  # id -> its file
    micro, workers = 4, 2
    seen = []
    for k in range(workers):
        features, labels, weights = take(stream(source, micro_batch=micro, shard_index=k,
                                                num_shards=workers), 60)
        check_examples(features, labels, weights)
        ids = ids_of(features)
        assert set(file_of[ids]) == {i for i in range(len(TRAIN_SIZES)) if i % workers == k}
        # every record of its files, each epoch a permutation of them
        epoch = int(np.sum(np.array(TRAIN_SIZES)[k::workers]))
        np.testing.assert_array_equal(np.sort(ids[:epoch]), np.flatnonzero(file_of % workers == k))
        # seeds' positions: local position * workers + k, distinct over the workers
        np.testing.assert_array_equal(features[:, 4], np.arange(60) * workers + k)
        # resuming after 5 updates of both workers continues this worker's own stream
        resumed = take(stream(source, start=5 * micro * workers, micro_batch=micro, shard_index=k,
                              num_shards=workers), 20)
        np.testing.assert_array_equal(resumed[0], features[5 * micro:5 * micro + 20])
        seen.append(set(ids))
    assert not seen[0] & seen[1]
    assert seen[0] | seen[1] == set(range(N_TRAIN))


def test_files_sharding_refusals_and_one_worker(files):
    source = make_source(files, sharding="files")
    with pytest.raises(ValueError, match="multiple of num_shards"):
        stream(source, start=3, shard_index=0, num_shards=2)
    with pytest.raises(DataError, match="at least 4 train files"):
        stream(source, shard_index=3, num_shards=4)
    # one worker: the same stream as sharding="stream"
    np.testing.assert_array_equal(take(stream(source), 40)[0], take(stream(make_source(files)), 40)[0])


# --------------------------------------------------------------------------------------------------
# Held-out batches


def test_eval_batches_cover_every_record_once_in_order(files):
    source = make_source(files, preprocess=preprocess)
    batches = [[t.numpy() for t in batch] for batch in source.eval_batches(4)]
    assert [len(b[1]) for b in batches] == [4, 4, 3]
    features, labels, weights = (np.concatenate([b[i] for b in batches]) for i in range(3))
    n_eval = sum(EVAL_SIZES)
    np.testing.assert_array_equal(ids_of(features), EVAL_ID + np.arange(n_eval))
    check_examples(features, labels, weights)
    np.testing.assert_array_equal(features[:, 3:], np.stack([np.zeros(n_eval), np.arange(n_eval)], 1))


def test_no_eval_files_is_zero_batches_of_the_same_structure(files):
    source = make_source(files, eval_files=None)
    dataset = source.eval_batches(4)
    assert list(dataset) == []
    spec = stream(source).element_spec
    for got, want in zip(dataset.element_spec, spec):
        assert got.dtype == want.dtype and got.shape[1:] == want.shape[1:]


# --------------------------------------------------------------------------------------------------
# Checks


def one_line_error(error_type, function, *fragments):
    with pytest.raises(error_type) as caught:
        function()
    message = str(caught.value)
    assert "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, message
    return message


def test_pattern_that_matches_nothing(files):
    directory, train, _ = files
    missing = os.path.join(directory, "nope-*.tfrecord")
    one_line_error(DataError, lambda: make_source(files, train_files=[train[0], missing]), repr(missing),
                   "matches no file", "train_files")
    one_line_error(DataError, lambda: make_source(files, eval_files=directory), repr(directory),
                   "eval_files")  # a directory is not a file
    one_line_error(DataError, lambda: make_source(files, train_files=[]), "train_files")


def test_bad_arguments(files):
    one_line_error(DataError, lambda: make_source(files, sharding="workers"), "sharding='workers'",
                   "'stream', 'files'")
    one_line_error(DataError, lambda: make_source(files, compression="LZ4"), "compression")
    one_line_error(DataError, lambda: make_source(files, shuffle_buffer=-1), "shuffle_buffer")
    one_line_error(DataError, lambda: make_source(files, label_spec=tf.TensorSpec([], tf.float32)),
                   "integers")
    # What parse returns is checked by check(), which fit calls once the devices exist.
    one_line_error(DataError, lambda: make_source(files, feature_spec=tf.TensorSpec([4], tf.float32)).check(),
                   "features", "[4]")
    one_line_error(DataError, lambda: make_source(files, parse=lambda e: e["x"]).check(), "parse returns")

    def broken(example):
        return example["no_such_feature"], example["label"]

    one_line_error(UserCodeError, lambda: make_source(files, parse=broken).check(), "parse", "no_such_feature")


def test_label_outside_the_classes_fails_when_read(files):
    source = make_source(files, num_classes=3)  # labels go up to 4
    with pytest.raises(tf.errors.InvalidArgumentError, match="outside 0..2"):
        take(stream(source, micro_batch=16), 32)


def test_train_files_without_records(tmp_path, files):
    empty = str(tmp_path / "empty.tfrecord")
    with tf.io.TFRecordWriter(empty):
        pass
    source = make_source(files, train_files=[empty])
    one_line_error(DataError, lambda: stream(source), "hold no record", repr(empty))


# --------------------------------------------------------------------------------------------------
# Specs, sequences, writing


def test_outputs_have_the_declared_specs(files):
    source = make_source(files, feature_spec=tf.TensorSpec([3], tf.float32))
    features, labels, weights = next(iter(stream(source, micro_batch=8)))
    assert (features.dtype, features.shape) == (tf.float32, (8, 3))
    assert (labels.dtype, labels.shape) == (tf.int32, (8,))
    assert (weights.dtype, weights.shape) == (tf.float32, (8,))


def test_padded_sequences_get_zero_weight_on_padding(tmp_path):
    length = 6
    rng = np.random.default_rng(0)
    tokens = [rng.integers(1, 9, size) for size in (3, 6, 1, 4, 2)]
    path = str(tmp_path / "seq.tfrecord")
    write_examples(path, {"tokens": tokens, "score": np.arange(5, dtype=np.float32)})

    def pad(example):
        sequence = tf.sparse.to_dense(example["tokens"])[:length]
        real = tf.size(sequence)
        padded = tf.pad(sequence, [[0, length - real]])
        weights = tf.sequence_mask(real, length, tf.float32) * (1 + example["score"])
        return tf.cast(padded, tf.int32), tf.cast(padded, tf.int32), weights

    source = TFRecordSource(path, path, features={"tokens": tf.io.VarLenFeature(tf.int64),
                                                  "score": tf.io.FixedLenFeature([], tf.float32)},
                            parse=pad, feature_spec=tf.TensorSpec([length], tf.int32),
                            label_spec=tf.TensorSpec([length], tf.int32), num_classes=10)
    features, labels, weights = next(iter(source.eval_batches(8)))
    assert (features.shape, labels.shape, weights.shape) == ((5, length),) * 3
    assert weights.dtype == tf.float32
    expected = np.zeros((5, length), np.int64)
    expected_weights = np.zeros((5, length), np.float32)
    for i, row in enumerate(tokens):
        expected[i, :len(row)] = row
        expected_weights[i, :len(row)] = 1 + i
    np.testing.assert_array_equal(features.numpy(), expected)
    np.testing.assert_array_equal(labels.numpy(), expected)
    np.testing.assert_array_equal(weights.numpy(), expected_weights)
    train_features, _, train_weights = next(iter(stream(source, micro_batch=5)))
    assert train_features.shape == (5, length) and train_weights.shape == (5, length)


def test_compressed_files_stream(tmp_path):
    path = str(tmp_path / "z.tfrecord")
    write_examples(path, rows(np.arange(12)), compression="ZLIB")
    source = TFRecordSource([path], features=FEATURES, parse=parse,
                            feature_spec=tf.TensorSpec([3], tf.float32),
                            label_spec=tf.TensorSpec([], tf.int32), num_classes=NUM_CLASSES,
                            shuffle_buffer=0, compression="ZLIB")
    features, labels, weights = take(stream(source, micro_batch=4), 24)
    np.testing.assert_array_equal(ids_of(features), np.arange(24) % 12)
    check_examples(features, labels, weights)


def test_works_under_a_host_device_scope(files):
    with tf.device("/cpu:0"):
        source = make_source(files)
        features, _, _ = take(stream(source, micro_batch=8), 16)
    np.testing.assert_array_equal(features, take(stream(make_source(files), micro_batch=8), 16)[0])


def test_training_on_streamed_files_resumes_bit_exactly(files, tmp_path):
    """Stop after 2 updates, resume to 5: the same weights, bit for bit, as 5 straight updates
    (--deterministic), with a shuffle buffer, a random preprocess and 4 epochs of 30 records."""
    import tower_train
    from test_train import checkpoint_values

    def jitter(features, seeds, training):
        noise = tf.random.stateless_normal(tf.shape(features), seed=seeds[0]) if training else 0.0
        return features / 1000.0 + noise

    class Linear(tower_train.TowerModel):
        def __init__(self, num_classes=NUM_CLASSES, **kwargs):
            super().__init__(num_classes, **kwargs)
            self.dense = tf.keras.layers.Dense(num_classes)

        def call(self, features, training=False):
            return self.dense(features)

    options = dict(model=Linear, data=make_source(files, preprocess=jitter), num_gpus=2, accum=3,
                   batch_size=4, optimizer="momentum", learning_rate=0.05, deterministic=True,
                   log_every=100)
    tower_train.fit(train_dir=str(tmp_path / "resumed"), max_steps=2, **options)
    tower_train.fit(train_dir=str(tmp_path / "resumed"), max_steps=5, **options)
    tower_train.fit(train_dir=str(tmp_path / "straight"), max_steps=5, **options)
    resumed = checkpoint_values(str(tmp_path / "resumed"))
    straight = checkpoint_values(str(tmp_path / "straight"))
    names = [n for n in straight if n.startswith(("model/", "moving_average/", "examples_seen/"))]
    assert names and resumed.keys() == straight.keys()
    assert straight["examples_seen/.ATTRIBUTES/VARIABLE_VALUE"] == 5 * 24 > N_TRAIN * 3  # epochs 1-4
    for name in names:
        np.testing.assert_array_equal(resumed[name], straight[name], err_msg=name)


# --------------------------------------------------------------------------------------------------
# Damaged files


def record_offsets(path: str) -> list[int]:
    """The offset of each record of an uncompressed TFRecord file, and the file's end: computed
    from the records TensorFlow reads, each taking 16 bytes more than its data."""
    lengths = [len(record.numpy()) for record in tf.data.TFRecordDataset(path)]
    return [int(offset) for offset in np.cumsum([0] + [length + 16 for length in lengths])]


def test_a_truncated_file_is_refused_naming_it_and_the_offset(tmp_path, files):
    whole = str(tmp_path / "whole.tfrecord")
    write_examples(whole, rows(np.arange(64)))
    offsets = record_offsets(whole)
    with open(whole, "rb") as f:
        content = f.read()
    assert len(content) == offsets[64]
    cut_in_header = str(tmp_path / "cut-in-header.tfrecord")
    with open(cut_in_header, "wb") as f:
        f.write(content[:offsets[32] + 5])
    # What the check is for: TensorFlow reads this file as one of 32 records, without a word.
    assert sum(1 for _ in tf.data.TFRecordDataset(cut_in_header)) == 32
    one_line_error(DataError, lambda: make_source(files, train_files=cut_in_header), "train_files",
                   repr(cut_in_header), f"ends inside the header of the record at offset {offsets[32]} "
                   "(5 of its 12 bytes): the file is truncated")
    cut_in_data = str(tmp_path / "cut-in-data.tfrecord")
    with open(cut_in_data, "wb") as f:
        f.write(content[:offsets[40] + 20])
    one_line_error(DataError, lambda: make_source(files, eval_files=[whole, cut_in_data]), "eval_files",
                   repr(cut_in_data), f"ends inside the record at offset {offsets[40]} (the record would "
                   f"end at byte {offsets[41]}, the file ends at byte {offsets[40] + 20})")
    assert make_source(files, train_files=whole).train_files == [whole]  # the whole file passes


def test_a_file_of_another_kind_is_refused_naming_it_and_compression_type(tmp_path, files):
    text = str(tmp_path / "notes.tfrecord")
    with open(text, "w") as f:
        f.write("not a TFRecord file\n" * 10)
    gzipped, plain = str(tmp_path / "gzipped.tfrecord"), str(tmp_path / "plain.tfrecord")
    write_examples(gzipped, rows(np.arange(4)), compression="GZIP")
    write_examples(plain, rows(np.arange(4)))
    one_line_error(DataError, lambda: make_source(files, train_files=text), repr(text),
                   "is not a TFRecord file", "compression_type is ''")
    one_line_error(DataError, lambda: make_source(files, train_files=gzipped), repr(gzipped),
                   "is GZIP-compressed", "compression_type is ''", "give compression='GZIP'")
    one_line_error(DataError, lambda: make_source(files, train_files=plain, eval_files=None,
                                                  compression="GZIP"), repr(plain),
                   "is not GZIP-compressed", "compression_type is 'GZIP'",
                   "it reads as an uncompressed TFRecord file: give compression=None")
    one_line_error(DataError, lambda: make_source(files, train_files=gzipped, eval_files=None,
                                                  compression="ZLIB"), repr(gzipped),
                   "is not ZLIB-compressed", "compression_type is 'ZLIB'")


def copy_split(directory, files) -> tuple[list[str], list[str]]:
    """The module's train and eval files, copied into `directory` (to be damaged there)."""
    copies = []
    for paths in files[1:]:
        copies.append([])
        for path in paths:
            copy = os.path.join(directory, os.path.basename(path))
            with open(path, "rb") as source, open(copy, "wb") as target:
                target.write(source.read())
            copies[-1].append(copy)
    return copies[0], copies[1]


def corrupt_data(path: str, record: int) -> None:
    """Flips a byte of the data of the record `record` of the file."""
    start = record_offsets(path)[record] + 12
    with open(path, "r+b") as f:
        f.seek(start + 3)
        byte = f.read(1)[0]
        f.seek(start + 3)
        f.write(bytes([byte ^ 0xFF]))


@pytest.mark.parametrize("damage", ["corrupted", "deleted"])
def test_a_file_damaged_after_the_check_fails_the_update_reading_it_in_one_line(tmp_path, files, damage):
    import tower_train
    from test_errors import Linear

    train, evaluation = copy_split(tmp_path, files)
    source = make_source(files, train_files=train, eval_files=evaluation, shuffle_buffer=0)
    # In file order, micro-batches of 8 and accum 1, update u reads stream positions 8u-8 .. 8u-1.
    if damage == "corrupted":
        corrupt_data(train[2], 2)  # position 25, in update 4
        update, fault = 4, (f"has a corrupted record at offset {record_offsets(files[1][2])[2]}: its data "
                            "fails its checksum")
    else:
        os.remove(train[2])  # opened at position 23, in update 3
        update, fault = 3, "cannot be read: "
    with pytest.raises(tower_train.TrainingError) as caught:
        tower_train.fit(model=Linear, data=source, train_dir=str(tmp_path / "run"), num_gpus=2,
                        batch_size=4, max_steps=6, checkpoint_every=1, log_every=100)
    line = str(caught.value)
    assert "\n" not in line, line
    assert line.startswith(f"update {update} failed in the input pipeline: tfrecord: train_files: {train[2]!r} {fault}"), line
    assert line.endswith(f"the last good checkpoint is {tmp_path / 'run' / f'ckpt-{update - 1}'}"), line
    if damage == "deleted":
        assert "No such file or directory" in line, line


def test_a_held_out_file_corrupted_after_the_check_fails_the_evaluation_in_one_line(tmp_path, files):
    from tower_train.training.evaluation.held_out import evaluate

    train, evaluation = copy_split(tmp_path, files)
    source = make_source(files, train_files=train, eval_files=evaluation)
    corrupt_data(evaluation[1], 0)  # held-out example 6: the second batch of 4
    from test_errors import Linear

    with pytest.raises(TrainingError) as caught:
        evaluate(Linear(NUM_CLASSES), source, 4, ["/cpu:1"])
    assert str(caught.value) == (f"held-out evaluation failed after 4 examples: tfrecord: eval_files: "
                                 f"{evaluation[1]!r} has a corrupted record at offset 0: its data fails "
                                 "its checksum")


def test_a_record_that_does_not_parse_fails_the_update_naming_the_file_and_the_feature(tmp_path, files):
    """The line keeps the feature's name whole, loses TensorFlow's wrapping and names the file."""
    import tower_train
    from test_errors import Linear

    long_name = "pixels_of_the_image_in_row_major_order_as_the_camera_wrote_them"
    good, bad = str(tmp_path / "good.tfrecord"), str(tmp_path / "bad.tfrecord")
    write_examples(good, {long_name: np.ones((16, 3)), "label": np.arange(16) % NUM_CLASSES})
    write_examples(bad, {"label": np.arange(16) % NUM_CLASSES})  # lacks the feature

    def take_pixels(example):
        return tf.cast(example[long_name], tf.float32), tf.cast(example["label"], tf.int32)

    source = make_source(files, train_files=[good, bad], eval_files=None, parse=take_pixels,
                         features={long_name: tf.io.FixedLenFeature([3], tf.float32),
                                   "label": tf.io.FixedLenFeature([], tf.int64)}, shuffle_buffer=0)
    with pytest.raises(TrainingError) as caught:
        tower_train.fit(model=Linear, data=source, train_dir=str(tmp_path / "run"), num_gpus=2,
                        batch_size=4, max_steps=4, log_every=100)
    line = str(caught.value)
    assert "\n" not in line and "{{" not in line and "[[" not in line, line
    # Micro-batches of 8 in file order: update 3 reads the first records of bad.tfrecord.
    assert line.startswith(f"update 3 failed in the input pipeline: tfrecord: train_files: {bad!r} has a record that does not "
                           f"parse: Name: <unknown>, Feature: {long_name} (data type: float) is required "
                           "but could not be found."), line


RECORDS_MODULE = '''
import os

import keras
import tensorflow as tf

import tower_train
from tower_train.models import TowerModel, register
from tower_train.data.tfrecord import TFRecordSource


@register("records_linear")
class Linear(TowerModel):
    def __init__(self, num_classes, **kwargs):
        super().__init__(num_classes, **kwargs)
        self.dense = keras.layers.Dense(num_classes)

    def call(self, features, training=False):
        return self.dense(features)


@tower_train.data.source.register("records")
def records():
    return TFRecordSource(
        os.path.join(os.path.dirname(os.path.abspath(__file__)), "train-*.tfrecord"),
        features={"x": tf.io.FixedLenFeature([3], tf.int64), "label": tf.io.FixedLenFeature([], tf.int64)},
        parse=lambda e: (tf.cast(e["x"], tf.float32) / 1000.0, tf.cast(e["label"], tf.int32)),
        feature_spec=tf.TensorSpec([3], tf.float32), label_spec=tf.TensorSpec([], tf.int32),
        num_classes=5, shuffle_buffer=0, name="records")
'''


def test_a_file_deleted_while_the_command_trains_is_one_line_and_exit_1(tmp_path):
    """The real process: the file goes while training runs, and the reader meets its absence when
    the stream comes round to it again (an open file stays readable until it is closed)."""
    from helpers import read_until

    train = write_split(tmp_path, "train", TRAIN_SIZES)
    (tmp_path / "records_data.py").write_text(RECORDS_MODULE)
    process = subprocess.Popen(
        [sys.executable, "-m", "tower_train", "--model_module=records_data", "--model=records_linear",
         "--data_module=records_data", "--dataset=records", "--num_gpus=2", "--batch_size=4",
         "--max_steps=1000000", "--log_every=1", "--checkpoint_every=1000000",
         f"--train_dir={tmp_path / 'run'}"],
        cwd=tmp_path, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        env={k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TF_CONFIG")})
    try:
        read_until(process, "step 2, loss = ", timeout=240)
        os.remove(train[1])
        _, rest = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=60)
    rest = rest.decode(errors="replace")
    last = rest.strip().splitlines()[-1]
    assert process.returncode == 1, rest[-3000:]
    assert "Traceback" not in rest, rest[-3000:]
    assert re.fullmatch(rf"tower_train: update \d+ failed in the input pipeline: records: train_files: {re.escape(repr(train[1]))} "
                        rf"cannot be read: .*No such file or directory; the last good checkpoint is none",
                        last), last
