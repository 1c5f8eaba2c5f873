"""The whole run: the CLI's files and lines, resume, TensorBoard, and that the default data learns."""
import glob
import os

import numpy as np
import pytest
import tensorflow as tf

import tower_train
from helpers import END_PAUSE_LIMIT, end_pause_seconds
from test_cli_errors import run_cli


def checkpoint_values(train_dir):
    path = tf.train.latest_checkpoint(train_dir)
    return {name: tf.train.load_variable(path, name) for name, _ in tf.train.list_variables(path)}


def scalar_tags(train_dir):
    tags = {}
    for events in glob.glob(os.path.join(train_dir, "events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(events):
            for value in event.summary.value:
                tags.setdefault(value.tag, []).append(event.step)
    return tags


@pytest.mark.cpu_only  # the log names the CPU split and towers /cpu:1, /cpu:2
def test_cli_run_writes_checkpoints_and_logs_then_resumes(tmp_path):
    train_dir = tmp_path / "run"
    args = ["--num_gpus=2", "--accum=2", "--batch_size=16", "--checkpoint_every=2",
            "--log_every=2", f"--train_dir={train_dir}"]
    first = run_cli(*args, "--max_steps=4", "--eval_every=2")
    assert first.returncode == 0, first.stderr
    log = first.stderr
    assert "no GPU found for --num_gpus=2: split the CPU into 3 logical devices" in log
    assert "mode=tower (parameter_device reduction), 2 tower(s) on /cpu:1, /cpu:2, variables on " \
           "/cpu:0, batch per tower 16, accum 2, global batch G = 64" in log
    assert "step 1, loss = " in log and "(warm-up: tracing, not timed)" in log  # at once, untimed
    assert "step 2, loss = " in log and "step 3, loss = " not in log and "step 4, loss = " in log
    assert "examples/sec; " in log and " sec/update)" in log
    assert "done: step 4" in log and "(2000 examples)" in log
    assert "held-out evaluation: 2000 examples in " in log
    assert end_pause_seconds(log, 4) <= END_PAUSE_LIMIT, log  # no silent pause before the end
    assert "step 2, held-out precision @ 1 = " in log  # --eval_every; step 4 is the final evaluation
    assert sorted(os.path.basename(p) for p in glob.glob(str(train_dir / "ckpt-*.index"))) == \
        ["ckpt-2.index", "ckpt-4.index"]
    values = checkpoint_values(str(train_dir))
    assert values["step/.ATTRIBUTES/VARIABLE_VALUE"] == 4
    assert values["examples_seen/.ATTRIBUTES/VARIABLE_VALUE"] == 4 * 64
    assert {name.split("/")[0] for name in values} >= {"model", "optimizer", "step", "moving_average"}
    tags = scalar_tags(str(train_dir))
    assert tags["loss"] == [2, 4] and tags["learning_rate"] == [2, 4]
    assert tags["val_precision"] == tags["val_loss"] == [2, 4]  # --eval_every and the end
    assert tags["examples_per_sec"] == [2, 4]

    resumed = run_cli(*args, "--max_steps=6")
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stderr and "at step 4" in resumed.stderr
    assert "step 2, loss" not in resumed.stderr and "done: step 6" in resumed.stderr
    assert checkpoint_values(str(train_dir))["step/.ATTRIBUTES/VARIABLE_VALUE"] == 6


def _train(train_dir, **overrides):
    return tower_train.fit(train_dir=str(train_dir), **overrides)


def test_stopping_and_resuming_gives_the_weights_of_an_uninterrupted_run(tmp_path):
    layout = dict(num_gpus=2, accum=3, batch_size=8, optimizer="momentum", augment=True,
                  deterministic=True, log_every=100)
    _train(tmp_path / "interrupted", max_steps=2, **layout)
    _train(tmp_path / "interrupted", max_steps=5, **layout)
    _train(tmp_path / "straight", max_steps=5, **layout)
    interrupted = checkpoint_values(str(tmp_path / "interrupted"))
    straight = checkpoint_values(str(tmp_path / "straight"))
    weights = [n for n in straight if n.startswith(("model/", "moving_average/"))]
    assert weights and interrupted.keys() == straight.keys()
    for name in weights + ["optimizer/_iterations/.ATTRIBUTES/VARIABLE_VALUE"]:
        np.testing.assert_array_equal(interrupted[name], straight[name], err_msg=name)


def test_the_default_data_is_learned(tmp_path):
    result = _train(tmp_path, num_gpus=2, batch_size=32, max_steps=60, log_every=100)
    assert result.step == 60
    assert result.eval_examples == 2000
    assert result.eval_precision > 0.25  # chance is 0.10
