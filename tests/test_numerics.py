"""tower_train.numerics: TF32 and op determinism set for a run and put back, and the device line's
TF32 note. On this machine's CPU TF32 changes nothing (the GPU side is in test_gpu.py)."""
import numpy as np
import tensorflow as tf
from tensorflow.python.framework import config as tf_config

from helpers import make_run, weights
from tower_train.numerics import run_numerics, tf32_note


def test_run_numerics_sets_tf32_and_determinism_for_the_run_and_puts_them_back():
    assert tf.config.experimental.tensor_float_32_execution_enabled()  # TensorFlow's default
    assert not tf_config.is_op_determinism_enabled()
    with run_numerics(deterministic=True, tf32=False):
        assert not tf.config.experimental.tensor_float_32_execution_enabled()
        assert tf_config.is_op_determinism_enabled()
    assert tf.config.experimental.tensor_float_32_execution_enabled()
    assert not tf_config.is_op_determinism_enabled()
    try:  # a script that turned TF32 off itself keeps it off after a run that wanted it on
        tf.config.experimental.enable_tensor_float_32_execution(False)
        with run_numerics(deterministic=False, tf32=True):
            assert tf.config.experimental.tensor_float_32_execution_enabled()
        assert not tf.config.experimental.tensor_float_32_execution_enabled()
    finally:
        tf.config.experimental.enable_tensor_float_32_execution(True)


def test_the_device_line_names_tf32_on_gpus_only():
    assert tf32_note(("/cpu:1", "/cpu:2"), tf32=True) == ""
    assert tf32_note(("/gpu:0", "/gpu:1"), tf32=True) == (
        "; TF32 on: float32 matmuls and convolutions round their inputs to 10 bits of mantissa "
        "(--notf32 for full float32)")
    assert tf32_note(("/gpu:0",), tf32=False) == "; TF32 off: float32 matmuls and convolutions in full float32"


def test_on_a_cpu_tf32_changes_nothing():
    """TF32 is a GPU mode (Ampere and later): on CPUs the first update is bit-identical with it on
    or off. test_gpu.py checks what --notf32 changes on a GPU."""
    updates = []
    for tf32 in (True, False):
        run = make_run(num_gpus=2, accum=2, batch_size=4, optimizer="sgd", learning_rate=0.1)
        with run_numerics(deterministic=False, tf32=tf32):
            assert run.inner.run_update(run.batches()).applied
        updates.append(weights(run.state.model))
    for on, off in zip(*updates, strict=True):
        np.testing.assert_array_equal(on, off)
