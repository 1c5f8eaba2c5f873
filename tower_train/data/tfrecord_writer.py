"""`write_examples`: numpy arrays written as TFRecord files of `tf.train.Example` records, one a row,
such as `TFRecordSource` reads."""

from __future__ import annotations

import os
from typing import Mapping, Sequence

import numpy as np
import tensorflow as tf

from tower_train.data.tfrecord_check import COMPRESSIONS


def write_examples(path: str, features: Mapping[str, np.ndarray | Sequence[np.ndarray]],
                   compression: str | None = None) -> int:
    """Writes one `tf.train.Example` per row to the TFRecord file `path`; returns the rows written.

    `features` maps a feature name to its rows: an array whose axis 0 counts the rows, or a
    sequence of per-row arrays (rows may then differ in length, for a VarLenFeature). Each row is
    flattened into an int64 list (bool and integer dtypes), a float list (floating dtypes; stored
    as float32) or a bytes list (bytes or str, str as UTF-8; binary data as a sequence of bytes
    objects, since a numpy bytes array drops trailing zero bytes). Every feature must have the same
    number of rows. Read a feature back with ``tf.io.FixedLenFeature(row_shape, tf.int64 /
    tf.float32 / tf.string)`` or ``tf.io.VarLenFeature(...)``. The file's directory is made
    if it does not exist.
    """
    if compression not in COMPRESSIONS:
        raise ValueError(f"compression={compression!r}: must be None, 'ZLIB' or 'GZIP'")
    if not features:
        raise ValueError("features is empty: give at least one feature")
    columns = {}
    for key, value in features.items():
        if not isinstance(key, str):
            raise ValueError(f"feature name {key!r} is not a string")
        if isinstance(value, np.ndarray) and value.dtype != object:
            if value.ndim < 1:
                raise ValueError(f"feature {key!r} is a scalar: axis 0 must count the rows")
            columns[key] = value
        else:
            columns[key] = [_row(row) for row in value]
    counts = {key: len(rows) for key, rows in columns.items()}
    if len(set(counts.values())) != 1:
        raise ValueError(f"features have different numbers of rows: {counts}")
    count = next(iter(counts.values()))
    kinds = {key: _list_kind(key, rows) for key, rows in columns.items()}
    options = tf.io.TFRecordOptions(compression_type=compression or "")
    tf.io.gfile.makedirs(os.path.dirname(path) or ".")
    with tf.io.TFRecordWriter(path, options) as writer:
        for i in range(count):
            example = tf.train.Example()
            feature_map = example.features.feature
            for key, rows in columns.items():
                row = _row(rows[i]).reshape(-1)
                kind = kinds[key]
                if kind == "int64":
                    feature_map[key].int64_list.value.extend(row.astype(np.int64).tolist())
                elif kind == "float":
                    feature_map[key].float_list.value.extend(row.astype(np.float32).tolist())
                else:
                    feature_map[key].bytes_list.value.extend(
                        v.encode("utf-8") if isinstance(v, str) else bytes(v) for v in row.tolist())
            writer.write(example.SerializeToString())
    return count


def _row(value) -> np.ndarray:
    """One row as an array; bytes and str stay whole Python objects (numpy's fixed-width bytes
    would drop a trailing zero byte)."""
    if isinstance(value, (bytes, str)):
        return np.array([value], dtype=object).reshape(())
    return np.asarray(value)


def _list_kind(key: str, rows) -> str:
    """"int64", "float" or "bytes" for one feature's rows: by the array's dtype, or for a sequence
    of rows by the first non-empty row's (every row must be of the same kind)."""
    if isinstance(rows, np.ndarray):
        dtypes = [rows.dtype]
    else:
        dtypes = [row.dtype for row in rows if row.size]
    kinds = {_dtype_kind(key, dtype) for dtype in dtypes}
    if len(kinds) > 1:
        raise ValueError(f"feature {key!r} mixes rows of {' and '.join(sorted(kinds))}: one kind per feature")
    return kinds.pop() if kinds else "int64"


def _dtype_kind(key: str, dtype: np.dtype) -> str:
    if dtype == bool or np.issubdtype(dtype, np.integer):
        return "int64"
    if np.issubdtype(dtype, np.floating):
        return "float"
    if dtype.kind in "SUO":
        return "bytes"
    raise ValueError(f"feature {key!r} has dtype {dtype}: expected integers, floats, bytes or str")
