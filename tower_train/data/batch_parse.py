"""A `parse` written for one example, run over a batch of them: vectorized where TensorFlow can
vectorize all of it, one example at a time where it cannot, with the same results either way.

TensorFlow's own `tf.vectorized_map` falls back to a loop per op that it cannot vectorize and
stacks that op's outputs, which fails when an example's intermediate shape is its own: a JPEG
decoded at its own size before a resize, bytes of any length decoded then padded. So a parse
either vectorizes whole, or runs whole per example (`tf.map_fn`), where only its results need
one shape.

`tf.io.decode_raw`, how raw image bytes are read (CIFAR-10's records), has no vectorizing
converter in TensorFlow: one is registered here (`_decode_raw_batched`). A batch decodes at once
only when its strings are all of one length. So a parse vectorizes through decode_raw only
where decode_raw reads a string feature as it is, and then only for a batch whose strings of
that feature have one length, tested as it runs; a parse that decodes bytes it took apart,
picked or made runs per example.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

import tensorflow as tf

try:  # TensorFlow's internals: a TensorFlow that moved them runs decode_raw per example
    from tensorflow.python.ops import gen_parsing_ops
    from tensorflow.python.ops.parallel_for import pfor
    _converters = pfor._pfor_converter_registry  # where tf.vectorized_map looks; RegisterPFor refuses a second
except (ImportError, AttributeError):
    _converters = None

Columns = dict  # feature name -> tf.Tensor [b, ...], as tf.io.parse_example gives them

# A trial trace's record of the strings decode_raw was converted for (thread-local: tf.data may
# trace pipelines on several threads).
_trial = threading.local()


def _decode_raw_batched(pfor_input):
    """DecodeRaw of stacked strings [n, *S] -> [n, *S, L]: one op, exact when all n are L bytes long
    (it raises otherwise, as one example's decode_raw does on strings of several lengths)."""
    return pfor.wrap(gen_parsing_ops.decode_raw(pfor_input.stacked_input(0), pfor_input.get_attr("out_type"),
                                                little_endian=pfor_input.get_attr("little_endian")), True)


def _recorded(converter: Callable) -> Callable:
    def convert(pfor_input):
        if getattr(_trial, "decoded", None) is not None:
            _trial.decoded.append(pfor_input.stacked_input(0))
        return converter(pfor_input)

    return convert


if _converters is not None:  # a TensorFlow with a converter of its own keeps it, recorded too
    _converters["DecodeRaw"] = _recorded(_converters.get("DecodeRaw", _decode_raw_batched))


class _WithoutPforErrors(logging.Filter):
    """Drops pfor's ERROR records from a trial trace: an op it cannot vectorize is logged there
    with its whole stack before the ValueError that sends the parse per example."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.pathname.endswith("pfor.py")


def _decoded_columns(parse_vectorized: Callable, columns: Columns) -> list[str] | None:
    """Traces `parse_vectorized` on placeholders of `columns` in a graph of its own: None if
    pfor cannot vectorize an op of it; else the columns decode_raw reads as they are (gathered
    whole by the vectorized map); None too if decode_raw reads anything else."""
    placeholders: dict[str, str] = {}

    def trial(batch: Columns):
        placeholders.update({name: tensor.name for name, tensor in batch.items()})
        return parse_vectorized(batch)

    logger, quiet = tf.get_logger(), _WithoutPforErrors()
    logger.addFilter(quiet)
    _trial.decoded = []
    try:
        tf.function(trial).get_concrete_function(
            {name: tf.TensorSpec.from_tensor(column) for name, column in columns.items()})
        decoded = _trial.decoded
    except ValueError:  # an op without a converter (decode_jpeg, ...)
        return None
    finally:
        _trial.decoded = None
        logger.removeFilter(quiet)
    column_of = {placeholder: name for name, placeholder in placeholders.items()}
    # Only the vectorized map gathers from the placeholders: parse sees one example's slices.
    read = [column_of.get((t.op.inputs[0] if t.op.type == "GatherV2" else t).name) for t in decoded]
    return None if None in read else sorted(set(read))


def parse_batch(parse: Callable[[Columns], tuple], columns: Columns,
                signature: tuple[tf.TensorSpec, ...]) -> tuple[tf.Tensor, ...]:
    """`parse` of each example of `columns`, stacked: one tensor [b, *spec.shape] of spec.dtype
    per spec of `signature`, which says what `parse` returns for one example.

    Traced once per pipeline: vectorized when every op of `parse` vectorizes (with decode_raw of a
    string feature, only for a batch whose strings of that feature have one length, tested as it
    runs); otherwise `tf.map_fn` over the examples. `check` has traced `parse` before, so an
    error of the trial trace is pfor's, not the user's.
    """
    def one_example(example: Columns) -> tuple[tf.Tensor, ...]:
        return tuple(tf.ensure_shape(out, spec.shape) for out, spec in zip(parse(example), signature))

    def vectorized(batch: Columns) -> tuple[tf.Tensor, ...]:
        return tuple(tf.vectorized_map(one_example, batch, fallback_to_while_loop=False))

    def per_example() -> tuple[tf.Tensor, ...]:
        return tuple(tf.map_fn(one_example, columns, fn_output_signature=signature))

    # The trial says which to build: the vectorized ops must be built inside the cond's branch,
    # or they would run whichever branch the cond takes.
    decoded = _decoded_columns(vectorized, columns)
    if decoded is None:
        return per_example()
    if not decoded:
        return vectorized(columns)
    lengths = [tf.reshape(tf.strings.length(columns[name]), [-1]) for name in decoded]
    one_length = tf.reduce_all([tf.reduce_all(tf.equal(each, each[:1])) for each in lengths])
    return tuple(tf.cond(one_length, lambda: vectorized(columns), per_example))
