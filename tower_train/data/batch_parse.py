"""A `parse` written for one example, run over a batch of them: vectorized where TensorFlow can
vectorize all of it, one example at a time where it cannot, with the same results either way.

TensorFlow's own `tf.vectorized_map` falls back to a loop per op that it cannot vectorize and
stacks that op's outputs, which fails when an example's intermediate shape is its own: a JPEG
decoded at its own size before a resize, bytes of any length decoded then padded. So a parse
either vectorizes whole, or runs whole per example (`tf.map_fn`), where only its results need
one shape.

`tf.io.decode_raw`, how raw image bytes are read (CIFAR-10's records), has no vectorizing
converter in TensorFlow: one is registered here (`_decode_raw_batched`). A batch decodes at once
only when its strings are all of one length, so a parse that uses it is vectorized for a batch
whose string features each hold strings of one length, and runs per example otherwise (and
always when it decodes bytes it made from no string feature).
"""

from __future__ import annotations

from typing import Callable

import tensorflow as tf
from tensorflow.python.ops import gen_parsing_ops
from tensorflow.python.ops.parallel_for import pfor

Columns = dict  # feature name -> tf.Tensor [b, ...], as tf.io.parse_example gives them

_decode_raw_conversions = 0  # counts the converter's calls: a trace that made one needs the length test


def _decode_raw_batched(pfor_input) -> pfor.WrappedTensor:
    """DecodeRaw of stacked strings [n, *S] -> [n, *S, L]: one op, exact when all n are L bytes long
    (it raises otherwise, as one example's decode_raw does on strings of several lengths)."""
    decoded = gen_parsing_ops.decode_raw(pfor_input.stacked_input(0), pfor_input.get_attr("out_type"),
                                         little_endian=pfor_input.get_attr("little_endian"))
    return pfor.wrap(decoded, True)


def _counted(converter: Callable) -> Callable:
    def convert(pfor_input):
        global _decode_raw_conversions
        _decode_raw_conversions += 1
        return converter(pfor_input)

    return convert


# TensorFlow's registry of converters, where tf.vectorized_map looks (private: RegisterPFor refuses
# a second one). A TensorFlow with a converter of its own keeps it, counted too.
pfor._pfor_converter_registry["DecodeRaw"] = _counted(
    pfor._pfor_converter_registry.get("DecodeRaw", _decode_raw_batched))


def parse_batch(parse: Callable[[Columns], tuple], columns: Columns,
                signature: tuple[tf.TensorSpec, ...]) -> tuple[tf.Tensor, ...]:
    """`parse` of each example of `columns`, stacked: one tensor [b, *spec.shape] of spec.dtype
    per spec of `signature`, which says what `parse` returns for one example.

    Traced once per pipeline: vectorized when every op of `parse` vectorizes (with decode_raw,
    only for a batch whose string columns each hold strings of one length, tested as it runs);
    otherwise `tf.map_fn` over the examples.
    """
    def one_example(example: Columns) -> tuple[tf.Tensor, ...]:
        return tuple(tf.ensure_shape(out, spec.shape) for out, spec in zip(parse(example), signature))

    def vectorized(batch: Columns) -> tuple[tf.Tensor, ...]:
        return tuple(tf.vectorized_map(one_example, batch, fallback_to_while_loop=False))

    def per_example() -> tuple[tf.Tensor, ...]:
        return tuple(tf.map_fn(one_example, columns, fn_output_signature=signature))

    # A trial trace, in a graph of its own, says which to build: the vectorized ops must be built
    # inside the cond's branch, or they would run whichever branch the cond takes. (`check` has
    # traced parse before, so an error here is pfor's, not the user's.)
    conversions = _decode_raw_conversions
    try:
        tf.function(vectorized).get_concrete_function(
            {name: tf.TensorSpec.from_tensor(column) for name, column in columns.items()})
    except ValueError:  # an op without a converter (decode_jpeg, ...)
        return per_example()
    if _decode_raw_conversions == conversions:
        return vectorized(columns)
    strings = [tf.reshape(tf.strings.length(c), [-1]) for c in columns.values() if c.dtype == tf.string]
    if not strings:  # decode_raw of bytes made inside parse: their lengths are not known here
        return per_example()
    one_length = tf.reduce_all([tf.reduce_all(tf.equal(lengths, lengths[:1])) for lengths in strings])
    return tuple(tf.cond(one_length, lambda: vectorized(columns), per_example))
