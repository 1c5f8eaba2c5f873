"""Tests of tower_train.errors: an op error's own message (an assertion's text, a bad label's value)
reaches the one line of a failed update, without TensorFlow's wrapping around it."""

from __future__ import annotations

import re

import numpy as np
import pytest
import tensorflow as tf

import tower_train
from tower_train.errors import TrainingError, UsageError, first_line, op_error_text, traced_message

NUM_CLASSES = 5
FEATURES = np.arange(40 * 3, dtype=np.float32).reshape(40, 3)
LABELS = np.arange(40) % NUM_CLASSES
MICRO_BATCH = 8  # batch_size 4 x 2 towers


class Linear(tower_train.TowerModel):
    def __init__(self, num_classes=NUM_CLASSES, **kwargs):
        super().__init__(num_classes, **kwargs)
        self.dense = tf.keras.layers.Dense(num_classes)

    def call(self, features, training=False):
        return self.dense(features)


class Asserting(Linear):
    def call(self, features, training=False):
        tf.debugging.assert_less(tf.reduce_max(features), 5.0, message="features must stay below 5")
        return self.dense(features)


class ShiftedLabels(Linear):
    """A user's bug: the loss gets labels beyond the logits' classes, except label 0 (the label
    the build's check of the loss uses), so the bug shows only in an update."""

    def per_example_loss(self, labels, logits):
        return super().per_example_loss(tf.where(labels > 0, labels + NUM_CLASSES, labels), logits)


def failed_update_line(model, tmp_path) -> str:
    source = tower_train.ArraySource(FEATURES, LABELS, shuffle=False)
    with pytest.raises(TrainingError) as caught:
        tower_train.fit(model=model, data=source, train_dir=str(tmp_path / "run"), num_gpus=2,
                        batch_size=MICRO_BATCH // 2, max_steps=2, log_every=100)
    line = str(caught.value)
    assert "\n" not in line and line.startswith("update 1 failed: "), line
    for noise in ("Graph execution error", "Detected at node", "<stack traces unavailable>", "{{", "[[", "root error"):
        assert noise not in line, line
    return line


def test_an_assertions_message_and_values_reach_the_line(tmp_path):
    line = failed_update_line(Asserting, tmp_path)
    # The first micro-batch is examples 0..7 (shuffle=False); the assertion sees a tower's shard.
    largest = {FEATURES[:MICRO_BATCH // 2].max(), FEATURES[MICRO_BATCH // 2:MICRO_BATCH].max()}
    match = re.search(r"assertion failed: \[features must stay below 5\] \[Condition x < y did not hold "
                      r"element-wise:\] \[x \(\S+\) = \] \[(\d+)\]", line)
    assert match and float(match[1]) in largest, line
    assert line.count("features must stay below 5") == 1, line  # one per distinct root error


def test_a_label_value_out_of_the_losss_range_reaches_the_line(tmp_path):
    line = failed_update_line(ShiftedLabels, tmp_path)
    match = re.search(r"Received a label value of (\d+) which is outside the valid range of \[0, (\d+)\)", line)
    assert match and int(match[2]) == NUM_CLASSES, line
    assert int(match[1]) in {label + NUM_CLASSES for label in LABELS[:MICRO_BATCH] if label > 0}, line


def test_only_noise_is_cut_and_a_long_line_at_a_space():
    error = tf.errors.InvalidArgumentError(None, None, (
        "{{function_node __wrapped__IteratorGetNext_output_types_1_device_/job:localhost/replica:0/task:0"
        "/device:CPU:0}} Error in user-defined function passed to MapDataset:39 transformation with "
        "iterator: Iterator::Root::ParallelMapV2: Name: <unknown>, Feature: a_feature_name (data type: "
        "int64) is required but could not be found.\n\t [[{{node ParseExample/ParseExampleV2}}]] "
        "[Op:IteratorGetNext] name: "))
    assert op_error_text(error) == ("Name: <unknown>, Feature: a_feature_name (data type: int64) is "
                                    "required but could not be found.")
    words = " ".join(f"word{i}" for i in range(300))
    cut = op_error_text(ValueError(words), limit=100)
    assert cut.endswith(" ...") and len(cut) <= 104
    assert all(re.fullmatch(r"word\d+", word) for word in cut[:-4].split()), cut  # no word cut
    assert op_error_text(ValueError("")) == "ValueError"


def test_traced_message_is_the_errors_own_line_without_the_stack_tf_function_adds():
    traced = UsageError('in user code:\n\n    File "towers.py", line 105, in tower  *\n'
                        '        raise UsageError(...)\n\n    UsageError: Net: the message\n')
    assert traced_message(traced) == "Net: the message"
    assert traced_message(UsageError("a line of its own")) == "a line of its own"


def test_every_one_line_error_and_quoted_first_line_leaves_tensorflows_wrapping_out():
    wrapped = ("{{function_node __wrapped__SaveV2_dtypes_2_device_/job:localhost/replica:0/task:0/device:CPU:0}} "
               "/run/ckpt-3_temp/part-00000-of-00001.data-00000-of-00001.tempstate9; Operation not permitted "
               "[Op:SaveV2] name: ")
    for error_type in (UsageError, TrainingError):
        assert str(error_type(f"cannot write checkpoint ckpt-3 ({wrapped}); stop")) == (
            "cannot write checkpoint ckpt-3 (/run/ckpt-3_temp/part-00000-of-00001.data-00000-of-00001.tempstate9; "
            "Operation not permitted); stop")
    assert first_line(tf.errors.PermissionDeniedError(None, None, f"{wrapped}\nmore")) == (
        "/run/ckpt-3_temp/part-00000-of-00001.data-00000-of-00001.tempstate9; Operation not permitted")
    assert str(TrainingError("a message of ours,  spaced   as written")) == "a message of ours,  spaced   as written"
