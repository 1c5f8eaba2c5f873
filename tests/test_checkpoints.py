"""checkpoints.py in this process, on tiny tf.train.Checkpoints: checkpoints found from their files
whatever the index says, nothing written over, another configuration refused, partial saves
removed, and the run record's copy inside every checkpoint."""
import hashlib
import json
import os

import numpy as np
import pytest
import tensorflow as tf

from tower_train import checkpoints, run_dir
from tower_train.config import RUN_FILE
from tower_train.errors import UsageError

RECORD = run_dir.run_record("mlp", None, "synthetic", 0, "momentum", 16, True)


def state(shape=(2,), loss_scale=False) -> tf.train.Checkpoint:
    """A stand-in for a run's state: one weight (and fp16's loss scale, as a LossScale holds it)."""
    with tf.device("/cpu:0"):
        objects = {"model": tf.Module(), "step": tf.Variable(0, dtype=tf.int64)}
        objects["model"].w = tf.Variable(tf.zeros(shape))
        if loss_scale:
            objects["loss_scale"] = tf.Module()
            objects["loss_scale"].value = tf.Variable(2.0 ** 15)
    return tf.train.Checkpoint(**objects)


def train(train_dir, steps, record=RECORD) -> checkpoints.CheckpointWriter:
    """Saves ckpt-1..steps as a run does, the weight [step, step] in each; returns the writer."""
    checkpoint = state()
    writer = checkpoints.CheckpointWriter(checkpoint, str(train_dir), record)
    writer.restore()
    for step in range(int(checkpoint.step.numpy()) + 1, steps + 1):
        checkpoint.model.w.assign([step, step])
        checkpoint.step.assign(step)
        writer.save(step)
    return writer


def digests(directory) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.iterdir()) if p.name.startswith("ckpt-") and p.is_file()}


def listed(train_dir) -> list[str]:
    state_ = tf.train.get_checkpoint_state(str(train_dir))
    return [os.path.basename(p) for p in state_.all_model_checkpoint_paths]


@pytest.mark.parametrize("index", ["deleted", "emptied", "garbled"])
def test_a_lost_index_resumes_from_the_newest_checkpoint_and_rotates_only_as_usual(tmp_path, index):
    train(tmp_path, 4)
    path = tmp_path / "checkpoint"
    if index == "deleted":
        path.unlink()
    else:
        path.write_text("" if index == "emptied" else "model_checkpoint_path: \x00garbage {")
    before = digests(tmp_path)

    resumed = state()
    writer = checkpoints.CheckpointWriter(resumed, str(tmp_path), RECORD)
    assert writer.restore() == str(tmp_path / "ckpt-4")
    np.testing.assert_array_equal(resumed.model.w.numpy(), [4, 4])
    assert listed(tmp_path) == ["ckpt-1", "ckpt-2", "ckpt-3", "ckpt-4"]  # the index is whole again
    for step in (5, 6):
        writer.save(step)

    after = digests(tmp_path)
    assert sorted({name.split(".")[0] for name in after}) == [f"ckpt-{n}" for n in (2, 3, 4, 5, 6)]
    assert {k: v for k, v in before.items() if not k.startswith("ckpt-1.")} == \
        {k: v for k, v in after.items() if k in before}  # ckpt-1 rotated away, the others unchanged
    assert listed(tmp_path) == [f"ckpt-{n}" for n in (2, 3, 4, 5, 6)]


def test_a_passed_over_checkpoint_is_moved_aside_never_written_over(tmp_path, caplog):
    train(tmp_path, 3)
    data = tmp_path / "ckpt-3.data-00000-of-00001"
    data.write_bytes(data.read_bytes()[:20])
    damaged = digests(tmp_path)

    resumed = state()
    writer = checkpoints.CheckpointWriter(resumed, str(tmp_path), RECORD)
    assert writer.restore() == str(tmp_path / "ckpt-2")
    assert f"checkpoint {tmp_path}/ckpt-3 is unreadable" in caplog.text
    assert listed(tmp_path) == ["ckpt-1", "ckpt-2"]
    writer.save(3)

    aside = tmp_path / checkpoints.PASSED_OVER / "ckpt-3"
    assert digests(aside) == {k: v for k, v in damaged.items() if k.startswith("ckpt-3.")}
    assert tf.train.load_variable(str(tmp_path / "ckpt-3"), "model/w/.ATTRIBUTES/VARIABLE_VALUE").tolist() == [2, 2]
    assert listed(tmp_path) == ["ckpt-1", "ckpt-2", "ckpt-3"]


@pytest.mark.parametrize("other,said", [
    (dict(shape=(3,)), "model/w is [2] there, [3] here (another architecture?)"),
    (dict(loss_scale=True), "it holds no loss scale, so it was written without --precision=fp16, and "
                            "this run has --precision=fp16"),
])
def test_a_checkpoint_of_another_configuration_is_refused_not_passed_over(tmp_path, other, said):
    train(tmp_path, 2)
    before = sorted(os.listdir(tmp_path))
    writer = checkpoints.CheckpointWriter(state(**other), str(tmp_path), RECORD)
    with pytest.raises(UsageError) as refused:
        writer.restore()
    assert str(refused.value) == (
        f"--train_dir={tmp_path}: checkpoint {tmp_path}/ckpt-2 reads back whole but was written by "
        f"another model, precision or configuration: {said}; it is left as it is: resume with the "
        f"flags and model code that wrote it, or add --train_dir={tmp_path}_2")
    assert sorted(os.listdir(tmp_path)) == before


def test_a_checkpoint_lacking_a_variable_of_the_run_is_refused_naming_it(tmp_path):
    train(tmp_path, 1)
    with tf.device("/cpu:0"):
        extra = state()
        extra.model.bias = tf.Variable(tf.zeros(4), name="bias")
    with pytest.raises(UsageError, match=r"ckpt-1 reads back whole but was written by another model, "
                                         r"precision or configuration: it lacks variables of this run: \[<tf.Variable 'bias:0' "):
        checkpoints.CheckpointWriter(extra, str(tmp_path), RECORD).restore()


def test_a_partial_save_is_removed_at_the_next_start(tmp_path):
    train(tmp_path, 1)
    (tmp_path / "ckpt-2_temp").mkdir()
    (tmp_path / "ckpt-2_temp" / "part-00000-of-00001.index").write_bytes(b"half")
    before = digests(tmp_path)
    checkpoints.CheckpointWriter(state(), str(tmp_path), RECORD).restore()
    assert digests(tmp_path) == before and not (tmp_path / "ckpt-2_temp").exists()


def test_every_checkpoint_holds_a_copy_of_the_run_record_that_stands_in_for_a_lost_one(tmp_path, caplog):
    train(tmp_path, 2)
    assert json.loads(tf.train.load_variable(str(tmp_path / "ckpt-2"),
                                             "run_record/.ATTRIBUTES/VARIABLE_VALUE")) == RECORD
    (tmp_path / RUN_FILE).unlink()

    checkpoints.check_same_run(str(tmp_path), RECORD)  # the same run: resumes
    assert f"comparing this run with the copy in {tmp_path}/ckpt-2" in caplog.text
    with pytest.raises(UsageError) as refused:
        checkpoints.check_same_run(str(tmp_path), {**RECORD, "seed": 3, "dataset": "cifar10"})
    assert str(refused.value).startswith(
        f"--train_dir={tmp_path} holds another run (says the copy of {RUN_FILE} in {tmp_path}/ckpt-2, "
        "as the file itself is missing): dataset 'synthetic' there, 'cifar10' here; seed 0 there, 3 here")

    train(tmp_path, 3)  # resumed: the record is written again
    assert json.loads((tmp_path / RUN_FILE).read_text()) == RECORD


def test_checkpoints_without_any_record_or_a_record_without_checkpoints_are_refused(tmp_path):
    with tf.device("/cpu:0"):
        state().write(str(tmp_path / "ckpt-1"))  # as earlier versions wrote it: no copy
    with pytest.raises(UsageError, match=f"holds checkpoints \\(the newest ckpt-1\\) but no {RUN_FILE}, "
                                         "and none holds a copy of it"):
        checkpoints.check_same_run(str(tmp_path), RECORD)
    for name in os.listdir(tmp_path):
        os.remove(tmp_path / name)
    (tmp_path / RUN_FILE).write_text(json.dumps(RECORD))
    with pytest.raises(UsageError, match=f"holds {RUN_FILE} but no checkpoint"):
        checkpoints.check_same_run(str(tmp_path), RECORD)


@pytest.mark.parametrize("index", ["deleted", "emptied"])
def test_evaluation_finds_the_newest_checkpoint_from_the_files(tmp_path, index):
    train(tmp_path, 3)
    if index == "deleted":
        (tmp_path / "checkpoint").unlink()
    else:
        (tmp_path / "checkpoint").write_text("")
    checkpoints.check_named_checkpoint(None, str(tmp_path), "mlp")
    assert checkpoints.find_checkpoint(None, str(tmp_path)).path == str(tmp_path / "ckpt-3")


def test_checkpoints_of_earlier_versions_without_a_copy_still_resume(tmp_path):
    earlier = state()
    earlier.model.w.assign([7, 7])
    tf.train.CheckpointManager(earlier, str(tmp_path), 5).save(checkpoint_number=1)  # as they saved
    (tmp_path / RUN_FILE).write_text(json.dumps(RECORD))
    checkpoints.check_same_run(str(tmp_path), RECORD)

    resumed = state()
    writer = checkpoints.CheckpointWriter(resumed, str(tmp_path), RECORD)
    assert writer.restore() == str(tmp_path / "ckpt-1")
    np.testing.assert_array_equal(resumed.model.w.numpy(), [7, 7])
    writer.save(2)
    assert json.loads(tf.train.load_variable(str(tmp_path / "ckpt-2"),
                                             "run_record/.ATTRIBUTES/VARIABLE_VALUE")) == RECORD
