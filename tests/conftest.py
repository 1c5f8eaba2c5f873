"""Splits the CPU into logical devices once, before TensorFlow initialises, as the product does.

The test process gets a host /cpu:0 and 8 tower devices /cpu:1..8, enough for
every layout the tests use.
"""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from tower_train.devices import apply_device_plan, plan_devices  # noqa: E402

MAX_TEST_TOWERS = 8

apply_device_plan(plan_devices(MAX_TEST_TOWERS, "cpu", num_physical_gpus=0))
