"""checkpoints.py in this process, on tiny tf.train.Checkpoints: checkpoints found from their files
whatever the index says, nothing written over, another configuration refused, partial saves
removed, and the run record's copy inside every checkpoint (compared by `RunRecord.check`)."""
import dataclasses
import hashlib
import json
import os

import numpy as np
import pytest
import tensorflow as tf

from tower_train.training import checkpoints
from tower_train.training import run_record
from tower_train.errors import TrainingError, UsageError
from tower_train.training.run_record import RUN_FILE

RECORD = run_record.RunRecord("mlp", None, "synthetic", 0, "momentum", 16, True)


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
                                             "run_record/.ATTRIBUTES/VARIABLE_VALUE")) == RECORD.as_dict()
    (tmp_path / RUN_FILE).unlink()

    checkpoints.check_same_run(str(tmp_path), RECORD)  # the same run: resumes
    assert f"comparing this run with the copy in {tmp_path}/ckpt-2" in caplog.text
    with pytest.raises(UsageError) as refused:
        checkpoints.check_same_run(str(tmp_path), dataclasses.replace(RECORD, seed=3, dataset="cifar10"))
    assert str(refused.value).startswith(
        f"--train_dir={tmp_path} holds another run (says the copy of {RUN_FILE} in {tmp_path}/ckpt-2, "
        "as the file itself is missing): dataset 'synthetic' there, 'cifar10' here; seed 0 there, 3 here")

    train(tmp_path, 3)  # resumed: the record is written again
    assert json.loads((tmp_path / RUN_FILE).read_text()) == RECORD.as_dict()


def test_checkpoints_without_any_record_or_a_record_without_checkpoints_are_refused(tmp_path):
    with tf.device("/cpu:0"):
        state().write(str(tmp_path / "ckpt-1"))  # as earlier versions wrote it: no copy
    with pytest.raises(UsageError, match=f"holds checkpoints \\(the newest ckpt-1\\) but no {RUN_FILE}, "
                                         "and none holds a copy of it"):
        checkpoints.check_same_run(str(tmp_path), RECORD)
    for name in os.listdir(tmp_path):
        os.remove(tmp_path / name)
    (tmp_path / RUN_FILE).write_text(json.dumps(RECORD.as_dict()))
    with pytest.raises(UsageError, match=f"holds {RUN_FILE} but no checkpoint"):
        checkpoints.check_same_run(str(tmp_path), RECORD)


def test_checkpoints_of_earlier_versions_without_a_copy_still_resume(tmp_path):
    earlier = state()
    earlier.model.w.assign([7, 7])
    tf.train.CheckpointManager(earlier, str(tmp_path), 5).save(checkpoint_number=1)  # as they saved
    (tmp_path / RUN_FILE).write_text(json.dumps(RECORD.as_dict()))
    checkpoints.check_same_run(str(tmp_path), RECORD)

    resumed = state()
    writer = checkpoints.CheckpointWriter(resumed, str(tmp_path), RECORD)
    assert writer.restore() == str(tmp_path / "ckpt-1")
    np.testing.assert_array_equal(resumed.model.w.numpy(), [7, 7])
    writer.save(2)
    assert json.loads(tf.train.load_variable(str(tmp_path / "ckpt-2"),
                                             "run_record/.ATTRIBUTES/VARIABLE_VALUE")) == RECORD.as_dict()


NO_SPACE = "No space left on device"
# TensorFlow's wrapping of a failed write, as SaveV2 raises it.
WRAPPED = ("{{function_node __wrapped__SaveV2_dtypes_2_device_/job:localhost/replica:0/task:0/device:CPU:0}} "
           "%s/ckpt-%d_temp/part-00000-of-00001.data-00000-of-00001.tempstate1; %s [Op:SaveV2] name: ")


def failing_save(writer, monkeypatch, point, step, reason=NO_SPACE, error=tf.errors.ResourceExhaustedError):
    """Makes writer's next save fail at `point`, leaving what a write failing there leaves: the
    staging directory; the merged data file alone; data and index without the index file's entry."""
    manager = writer._manager
    real_save = manager.save
    directory = manager.directory

    def save(checkpoint_number):
        index = os.path.join(directory, "checkpoint")
        listed_before = open(index).read() if os.path.exists(index) else None
        if point == "staging":
            os.makedirs(os.path.join(directory, f"ckpt-{step}_temp"))
            with open(os.path.join(directory, f"ckpt-{step}_temp", "part-00000-of-00001.index"), "wb") as f:
                f.write(b"half")
        else:
            real_save(checkpoint_number=checkpoint_number)
            if point == "merge":
                os.remove(os.path.join(directory, f"ckpt-{step}.index"))
            if listed_before is None:
                os.remove(index)
            else:
                with open(index, "w") as f:
                    f.write(listed_before)
        raise error(None, None, WRAPPED % (directory, step, reason))

    monkeypatch.setattr(manager, "save", save)


@pytest.mark.parametrize("step", [1, 2])
@pytest.mark.parametrize("point", ["staging", "merge", "index file"])
def test_a_save_that_fails_at_any_point_leaves_no_file_of_it_and_the_same_run_goes_on(tmp_path, monkeypatch,
                                                                                        point, step):
    writer = train(tmp_path, step - 1)
    before = digests(tmp_path)
    failing_save(writer, monkeypatch, point, step)
    writer._checkpoint.step.assign(step)
    with pytest.raises(TrainingError) as error:
        writer.save(step)
    kept = f"the last checkpoint, {tmp_path}/ckpt-1, is intact" if step == 2 else "no checkpoint was written"
    assert str(error.value) == (f"cannot write checkpoint ckpt-{step} in --train_dir={tmp_path} ({NO_SPACE}); its "
                                f"partial files are removed and {kept}; make room and run the same command to "
                                "resume")
    assert digests(tmp_path) == before and not list(tmp_path.glob(f"ckpt-{step}*"))
    # The same run again: not refused (no stray checkpoint without a record), it goes on from
    # the last checkpoint and writes the one that failed.
    checkpoints.check_same_run(str(tmp_path), RECORD)
    train(tmp_path, 3)
    assert checkpoints.checkpoint_numbers(str(tmp_path)) == [3, 2, 1]
    assert tf.train.load_variable(str(tmp_path / f"ckpt-{step}"), "model/w/.ATTRIBUTES/VARIABLE_VALUE").tolist() == [
        step, step]


def test_a_run_record_that_cannot_be_written_after_a_whole_checkpoint_keeps_the_checkpoint(tmp_path, monkeypatch):
    writer = train(tmp_path, 0)

    def no_room(record, train_dir):
        raise OSError(28, NO_SPACE)

    monkeypatch.setattr(run_record.RunRecord, "write", no_room)
    with pytest.raises(TrainingError) as error:
        writer.save(1)
    assert str(error.value) == (f"cannot write {RUN_FILE} in --train_dir={tmp_path} ({NO_SPACE}); {tmp_path}/ckpt-1 "
                                "is written whole and holds a copy of it; make room and run the same command to "
                                "resume")
    monkeypatch.undo()
    checkpoints.check_same_run(str(tmp_path), RECORD)  # the copy stands in for the file
    assert checkpoints.CheckpointWriter(state(), str(tmp_path), RECORD).restore() == str(tmp_path / "ckpt-1")


STAGED = "{}/ckpt-2_temp/part-00000-of-00001.data-00000-of-00001.tempstate1; "


@pytest.mark.parametrize("reason, error, said, remedy", [
    ("Operation not permitted", tf.errors.PermissionDeniedError, "Operation not permitted",
     "give the run permission to write there (an immutable file or directory?)"),
    ("Permission denied", tf.errors.PermissionDeniedError, "Permission denied", "give the run permission to write there"),
    ("Read-only file system", tf.errors.FailedPreconditionError, "Read-only file system", "make the file system writable"),
    # An unknown reason: TensorFlow's line, its wrapping left out.
    ("Failed to rename", tf.errors.UnknownError, STAGED + "Failed to rename", "fix the cause"),
])
def test_a_save_refused_for_another_reason_says_that_reason_without_tensorflows_wrapping(
        tmp_path, monkeypatch, reason, error, said, remedy):
    writer = train(tmp_path, 1)
    failing_save(writer, monkeypatch, "staging", 2, reason, error)
    with pytest.raises(TrainingError) as raised:
        writer.save(2)
    assert str(raised.value) == (f"cannot write checkpoint ckpt-2 in --train_dir={tmp_path} ({said.format(tmp_path)}); "
                                 f"its partial files are removed and the last checkpoint, {tmp_path}/ckpt-1, is "
                                 f"intact; {remedy} and run the same command to resume")


def test_a_workers_failed_save_does_not_say_that_no_checkpoint_was_written(tmp_path, monkeypatch):
    writer = checkpoints.CheckpointWriter(state(), str(tmp_path), RECORD, is_chief=False, worker_index=1)
    writer.restore()
    failing_save(writer, monkeypatch, "staging", 1)
    with pytest.raises(TrainingError) as raised:
        writer.save(1)
    assert "no checkpoint was written" not in str(raised.value)
    assert str(raised.value) == (f"cannot write checkpoint ckpt-1 in this worker's directory {tmp_path}/.worker_1.tmp "
                                 f"({NO_SPACE}); its partial files are removed and the checkpoints in --train_dir "
                                 "are the chief's to write; make room and run the same command to resume")


def test_a_link_as_a_workers_own_directory_is_refused_and_nothing_is_written_where_it_points(tmp_path):
    # Before: rmtree left the link, and the worker's checkpoints were written into its target.
    elsewhere, train_dir = tmp_path / "elsewhere", tmp_path / "run"
    elsewhere.mkdir(), train_dir.mkdir()
    (elsewhere / "precious").write_text("precious")
    (train_dir / ".worker_1.tmp").symlink_to(elsewhere)
    writer = checkpoints.CheckpointWriter(state(), str(train_dir), RECORD, is_chief=False, worker_index=1)
    with pytest.raises(UsageError) as refused:
        writer.restore()
        writer.save(1)
    assert str(refused.value) == (
        f"--train_dir={train_dir}: {train_dir}/.worker_1.tmp is a symbolic link (to {elsewhere}); a run "
        "follows no link where it writes, so nothing it points at is written: remove it, or add "
        f"--train_dir={train_dir}_2")
    assert os.listdir(elsewhere) == ["precious"]
    assert (elsewhere / "precious").read_text() == "precious"

@pytest.mark.parametrize("earlier", [0, 1])
def test_a_train_dir_whose_only_stray_is_the_data_of_an_interrupted_save_resumes(tmp_path, earlier):
    """TF's merge renames a save's data file into place, then writes its index: a save cut
    between the two (no inode left, a kill) leaves ckpt-N.data-* alone, with no run record if
    it was the first."""
    other, run = tmp_path / "other", tmp_path / "run"
    other.mkdir(), run.mkdir()
    train(other, 1)
    train(run, earlier)
    before = digests(run)
    stray = f"ckpt-{earlier + 1}.data-00000-of-00001"
    (run / stray).write_bytes((other / "ckpt-1.data-00000-of-00001").read_bytes())
    checkpoints.check_same_run(str(run), RECORD)
    restored = checkpoints.CheckpointWriter(state(), str(run), RECORD).restore()
    assert restored == (str(run / "ckpt-1") if earlier else None)
    assert digests(run) == before
    assert (run / checkpoints.PASSED_OVER / f"ckpt-{earlier + 1}" / stray).exists()
    train(run, 3)
    assert checkpoints.checkpoint_numbers(str(run)) == [3, 2, 1]
