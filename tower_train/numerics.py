"""TensorFlow's process-wide numeric settings that a run asks for: op determinism and
TensorFloat-32. Each is set for the run and put back afterwards, since a script's next run may
want otherwise (XLA has no deterministic MaxPool gradient, for one)."""
from __future__ import annotations

import contextlib
from typing import Iterator, Sequence


@contextlib.contextmanager
def run_numerics(deterministic: bool, tf32: bool) -> Iterator[None]:
    """Inside: op determinism on when `deterministic` (else as it was), and TensorFloat-32 as
    `tf32` says. TF32 rounds the inputs of float32 matmuls and convolutions to 10 bits of mantissa
    on Ampere and later GPUs; TensorFlow has it on by default, and it changes nothing on a CPU."""
    import tensorflow as tf
    from tensorflow.python.framework import config as tf_config  # the public API cannot turn it off

    turned_on = deterministic and not tf_config.is_op_determinism_enabled()
    tf32_before = tf.config.experimental.tensor_float_32_execution_enabled()
    if turned_on:
        tf_config.enable_op_determinism()
    tf.config.experimental.enable_tensor_float_32_execution(tf32)
    try:
        yield
    finally:
        tf.config.experimental.enable_tensor_float_32_execution(tf32_before)
        if turned_on:
            tf_config.disable_op_determinism()


def tf32_note(tower_devices: Sequence[str], tf32: bool) -> str:
    """What the device line adds about TF32: nothing for CPU towers, which it does not reach."""
    if not tower_devices[0].startswith("/gpu"):
        return ""
    if tf32:
        return ("; TF32 on: float32 matmuls and convolutions round their inputs to 10 bits of "
                "mantissa (--notf32 for full float32)")
    return "; TF32 off: float32 matmuls and convolutions in full float32"
