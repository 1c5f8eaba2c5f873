"""Splits the CPU into logical devices once, before TensorFlow initialises, as the product does.

The test process gets a host /cpu:0 and 8 tower devices /cpu:1..8, enough for
every layout the tests use. The split is made whatever GPUs the machine has.

On a machine with a GPU:
- this process hides its GPUs from TensorFlow, so that it is the CPU-only process
  the tests are written for (ops not placed by hand run on /cpu:0, not GPU 0), and
  it holds no GPU memory that the commands the tests start would need;
- the tests marked `cpu_only` are skipped: they run a command (`python -m
  tower_train ...`) in a subprocess and check what it does with the devices that
  command picks for itself, which on a CPU-only machine are /cpu:1..N (or one CPU
  replica per multi_worker worker) and on this one would be GPUs.
"""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from tower_train.devices import apply_device_plan, plan_devices  # noqa: E402

MAX_TEST_TOWERS = 8
# The one check for GPUs; listing physical devices does not initialise the runtime.
PHYSICAL_GPUS = tf.config.list_physical_devices("GPU")

if PHYSICAL_GPUS:
    tf.config.set_visible_devices([], "GPU")
apply_device_plan(plan_devices(MAX_TEST_TOWERS, "cpu", num_physical_gpus=0))


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "cpu_only: runs a command that picks its own devices and checks what it does on "
                   "a machine without a GPU; skipped on a machine with one")


def pytest_report_header(config):
    if PHYSICAL_GPUS:
        return (f"{len(PHYSICAL_GPUS)} GPU(s) found: hidden from this process; "
                "tests marked cpu_only are skipped")
    return None


def bfloat16_kernels() -> bool:
    """Whether this CPU's oneDNN makes bfloat16 kernels. Not under ONEDNN_MAX_CPU_ISA=AVX2, for one:
    TensorFlow, which reads the real CPU, then asks for bfloat16 kernels oneDNN cannot make (a
    convolution fails, building a Dense and BN model crashed the process)."""
    try:
        with tf.device("/cpu:0"):
            tf.nn.conv2d(tf.ones([1, 4, 4, 1], tf.bfloat16), tf.ones([3, 3, 1, 1], tf.bfloat16), 1, "SAME")
        return True
    except tf.errors.OpError:
        return False


def pytest_collection_modifyitems(config, items):
    bf16 = [item for item in items if item.get_closest_marker("bf16") is not None]
    if bf16 and not bfloat16_kernels():
        no_bf16 = pytest.mark.skip(reason="this CPU's oneDNN makes no bfloat16 kernel (ONEDNN_MAX_CPU_ISA capped?)")
        for item in bf16:
            item.add_marker(no_bf16)
    if not PHYSICAL_GPUS:
        no_gpu = pytest.mark.skip(reason="needs a GPU (tests/test_gpu.py; docs/gpu.md#the-gpu-tests)")
        for item in items:
            if item.get_closest_marker("gpu") is not None:
                item.add_marker(no_gpu)
        return
    skip = pytest.mark.skip(reason=(
        f"this machine has {len(PHYSICAL_GPUS)} GPU(s): the command this test runs would put its "
        "towers on them, and the test checks what it does with the devices of a machine without "
        "one (towers /cpu:1..N; multi_worker: one CPU replica per worker, ring collectives)"))
    for item in items:
        if item.get_closest_marker("cpu_only") is not None:
            item.add_marker(skip)
