"""Tests of tower_train.data.tfrecord_check on files TensorFlow writes: its CRC-32C is the one in their
records, a record whose data fails its checksum is found where TensorFlow's error points, and
patterns become files in order, each once. The refusals as a TFRecordSource's user meets them are
test_tfrecord.py's."""
import os
import struct

import pytest
import tensorflow as tf

from tower_train.data.source import DataError
from tower_train.data.tfrecord_check import checked_files, file_fault, masked_crc32c


def write_records(path: str, records: list[bytes]) -> None:
    with tf.io.TFRecordWriter(path) as writer:
        for record in records:
            writer.write(record)


def test_the_checksum_is_the_one_tensorflow_writes_into_each_record(tmp_path):
    path = str(tmp_path / "one.tfrecord")
    data = bytes(range(256)) * 3
    write_records(path, [data])
    with open(path, "rb") as f:
        content = f.read()
    length_checksum, data_checksum = struct.unpack("<I", content[8:12])[0], struct.unpack("<I", content[-4:])[0]
    assert masked_crc32c(content[:8]) == length_checksum
    assert masked_crc32c(data) == data_checksum
    assert masked_crc32c(data[:-1]) != data_checksum


def test_a_record_whose_data_fails_its_checksum_is_named_only_where_an_error_points(tmp_path):
    path = str(tmp_path / "damaged.tfrecord")
    write_records(path, [b"first record", b"second record"])
    second = 12 + len(b"first record") + 4  # header, data, footer
    with open(path, "r+b") as f:
        f.seek(second + 12)
        f.write(b"S")  # the second record's data, its length untouched
    assert file_fault(path, None) is None  # the walk reads lengths only
    assert file_fault(path, None, suspect=0) is None  # the first record is whole
    assert file_fault(path, None, suspect=second + 3) == (
        f"has a corrupted record at offset {second}: its data fails its checksum")


def test_patterns_become_files_in_their_order_each_matched_file_once(tmp_path):
    for name in ("b.tfrecord", "a.tfrecord", "c.tfrecord"):
        write_records(str(tmp_path / name), [b"x"])
    os.mkdir(tmp_path / "d.tfrecord")  # a directory is no file
    files = checked_files("set", "train_files", [str(tmp_path / "c.tfrecord"), str(tmp_path / "*.tfrecord")], None)
    assert files == [str(tmp_path / name) for name in ("c.tfrecord", "a.tfrecord", "b.tfrecord")]
    with pytest.raises(DataError, match=r"^set: train_files is empty: give at least one file or glob pattern$"):
        checked_files("set", "train_files", [], None)
