"""The records of TFRecord files, file after file and each file in its order, read in parallel.

An uncompressed file's records come in chunks of about `tfrecord_check.CHUNK_BYTES`, found when
the file was checked: a chunk is read from its byte offset as one batch, by a `Dataset.map` that
reads as many chunks at once as there are cores, deterministically, so the chunks come out in
their order and their records in the files' order. A compressed file
cannot be entered in the middle: compressed files are read one after the other, as
`tf.data.TFRecordDataset` reads a list of files.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import tensorflow as tf

from tower_train.data.tfrecord_check import Chunk

READ_BUFFER = 1 << 20  # bytes of read-ahead per TFRecord file (or chunk)
_RECORD = tf.TensorSpec([], tf.string)


def read_records(files: Sequence[str], chunks: Mapping[str, list[Chunk] | None],
                 compression: str | None) -> tf.data.Dataset:
    """The records of `files`, file after file, each file in its order; `chunks` holds each
    file's chunks (`tfrecord_check.checked_chunks`), None for a compressed file.

    A chunk whose parallel read fails (a file deleted or damaged since it was checked) is read
    again alone, in its place in the stream, record by record: the stream then fails where a
    sequential read would, at the record the reader fails on, after the records before it. A file
    that holds fewer records than when it was checked fails the stream at its chunk's end
    (FailedPreconditionError), where a sequential read would have read on without a word,
    shifting every later position."""
    if compression or not files:
        return tf.data.TFRecordDataset(list(files), compression_type=compression or "",
                                       buffer_size=READ_BUFFER)
    table = [(path, offset, count) for path in files for offset, count in chunks[path]]
    if not table:
        return empty_records()
    paths = tf.constant([path for path, _, _ in table])
    offsets = tf.constant([offset for _, offset, _ in table], tf.int64)
    counts = tf.constant([count for _, _, count in table], tf.int64)
    last = len(table)  # a chunk index past the end: its element shows whether the last chunks failed

    def read_chunk(index):
        """(index, the records of chunk `index`): one read, failing if any record does."""
        if_real = tf.minimum(index, last - 1)
        count = tf.where(index < last, counts[if_real], 0)
        records = tf.data.Dataset.get_single_element(
            _from(paths[if_real], offsets[if_real]).take(count).batch(count + 1).concatenate(
                tf.data.Dataset.from_tensors(tf.zeros([0], tf.string))).take(1))
        tf.debugging.assert_equal(tf.size(records, out_type=tf.int64), count,
                                  "a file holds fewer records than when it was checked")
        return index, records

    def read_again(index):
        """Chunk `index` read alone, record by record: the records up to one the reader fails on."""
        return _from(paths[index], offsets[index]).take(counts[index]).apply(
            tf.data.experimental.assert_cardinality(counts[index]))

    def with_missed(expected, element):
        index, records = element
        return index + 1, (expected, index, records)

    def records_of(expected, index, records):
        missed = tf.data.Dataset.range(expected, index).flat_map(read_again)
        return missed.concatenate(tf.data.Dataset.from_tensor_slices(records))

    read = tf.data.Dataset.range(last + 1).map(read_chunk, num_parallel_calls=tf.data.AUTOTUNE,
                                               deterministic=True)
    read = read.ignore_errors().scan(tf.constant(0, tf.int64), with_missed)
    return read.flat_map(records_of)


def _from(path: tf.Tensor, offset: tf.Tensor) -> tf.data.Dataset:
    """The records of the file `path` from the byte `offset` on (where a record starts). Built
    inside the pipeline's functions only: TensorFlow cannot serialize this dataset (it drops
    byte_offsets), which an eager iterator over it would."""
    variant = tf.raw_ops.TFRecordDatasetV2(
        filenames=tf.reshape(path, [1]), compression_type="", buffer_size=tf.constant(READ_BUFFER, tf.int64),
        byte_offsets=tf.reshape(offset, [1]))
    return tf.data.experimental.from_variant(variant, _RECORD)


def empty_records() -> tf.data.Dataset:
    return tf.data.Dataset.from_tensor_slices(tf.constant([], tf.string))


def numbered(records: tf.data.Dataset, start_position: int, batch: int, drop_remainder: bool) -> tf.data.Dataset:
    """`records` in batches of `batch`, with their stream positions from `start_position`:
    (positions int64 [b], records string [b]). The positions are counted per batch, not per
    record: a zip with a counter of positions cost each record as much as reading it."""
    starts = tf.data.Dataset.counter(start=start_position, step=batch)
    batches = tf.data.Dataset.zip(starts, records.batch(batch, drop_remainder=drop_remainder))
    return batches.map(lambda first, chunk: (first + tf.range(tf.size(chunk, out_type=tf.int64)), chunk))
