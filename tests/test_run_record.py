"""`run_record.py` in the test process: the lock of a train_dir, its run record, and the fresh
train_dir a refusal suggests. A lock held by another, live process is test_reliability.py's."""
import dataclasses
import json
import os
import socket

import pytest

from tower_train.training import run_record
from tower_train.errors import UsageError
from tower_train.training.run_record import RUN_FILE

RECORD = run_record.RunRecord("mlp", "my_models", "synthetic", 0, "momentum", 16, True)


def test_a_second_lock_is_refused_naming_the_holder_until_the_first_is_released(tmp_path):
    train_dir = str(tmp_path / "run")
    first = run_record.TrainDirLock(train_dir)
    with pytest.raises(UsageError) as refused:
        run_record.TrainDirLock(train_dir)  # another open file: flock refuses it, even in one process
    assert str(refused.value) == (
        f"--train_dir={train_dir}: another run is training there (PID {os.getpid()} on host "
        f"{socket.gethostname()}); wait for it to end, or add --train_dir={train_dir}_2")
    first.release()
    with run_record.TrainDirLock(train_dir):
        pass


def test_a_lock_removes_the_train_dir_it_made_only_if_nothing_else_was_written(tmp_path):
    made, written, existing = (str(tmp_path / name) for name in ("made", "written", "existing"))
    run_record.TrainDirLock(made).release()
    assert not os.path.exists(made)
    with run_record.TrainDirLock(written):
        RECORD.write(written)
    assert sorted(os.listdir(written)) == sorted([RUN_FILE, run_record.LOCK_FILE])
    os.mkdir(existing)
    run_record.TrainDirLock(existing).release()
    assert os.listdir(existing) == [run_record.LOCK_FILE]


def test_the_run_record_is_written_once_and_read_back(tmp_path):
    assert run_record.RunRecord.read(str(tmp_path)) is None
    RECORD.write(str(tmp_path))
    dataclasses.replace(RECORD, seed=5).write(str(tmp_path))  # never written over
    assert run_record.RunRecord.read(str(tmp_path)) == RECORD.as_dict()
    assert os.listdir(tmp_path) == [RUN_FILE]  # no staging file left


@pytest.mark.parametrize("content,said", [("{not json", "is unreadable"), ("[1, 2]", "holds no JSON object")])
def test_an_unreadable_run_record_is_one_usage_error_line(tmp_path, content, said):
    (tmp_path / RUN_FILE).write_text(content)
    with pytest.raises(UsageError) as error:
        run_record.RunRecord.read(str(tmp_path))
    assert str(error.value).startswith(f"--train_dir={tmp_path}: {RUN_FILE} {said}")
    assert "\n" not in str(error.value)


def test_record_differences_name_each_changed_value_but_not_the_models_module():
    saved = json.loads(json.dumps(RECORD.as_dict()))
    changed = dataclasses.replace(RECORD, seed=3, global_batch=32, model_module="elsewhere")
    assert changed.differences(saved) == ["seed 0 there, 3 here", "global_batch 16 there, 32 here"]
    assert RECORD.differences(saved) == []


def test_the_fresh_directory_is_the_first_numbered_one_that_does_not_exist(tmp_path):
    base = str(tmp_path / "run")
    assert run_record.fresh_directory(base + os.sep) == base + "_2"
    os.mkdir(base + "_2")
    os.mkdir(base + "_3")
    assert run_record.fresh_directory(base) == base + "_4"


def test_the_check_compares_the_record_or_its_copy_and_refuses_a_run_with_files_lost(tmp_path):
    directory = str(tmp_path)

    def not_asked():
        raise AssertionError("the copy is read only when the file is missing")

    RECORD.check(directory, [], not_asked)  # a fresh train_dir
    with pytest.raises(UsageError, match=r"holds checkpoints \(the newest ckpt-3\) but no "
                                         f"{RUN_FILE}, and none holds a copy of it"):
        RECORD.check(directory, [3, 1], lambda: (None, None))
    copy = f"{directory}/ckpt-3"
    RECORD.check(directory, [3], lambda: (RECORD.as_dict(), copy))
    with pytest.raises(UsageError) as refused:
        RECORD.check(directory, [3], lambda: ({**RECORD.as_dict(), "seed": 4}, copy))
    assert str(refused.value) == (
        f"--train_dir={directory} holds another run (says the copy of {RUN_FILE} in {copy}, as the "
        "file itself is missing): seed 4 there, 0 here (global_batch = batch_size x towers x workers "
        f"x accum); use the same values to resume, or add --train_dir={directory}_2")
    RECORD.write(directory)
    RECORD.check(directory, [3], not_asked)
    with pytest.raises(UsageError, match=f"holds {RUN_FILE} but no checkpoint"):
        RECORD.check(directory, [], not_asked)


@pytest.mark.parametrize("target", ["precious", "missing/precious", "precious_not_yet_made"])
def test_a_link_at_the_lock_is_refused_and_what_it_names_is_untouched(tmp_path, target):
    # Before: the lock was opened through the link, and the file it named truncated (or made).
    precious = tmp_path / "precious"
    precious.write_text("precious")
    train_dir = tmp_path / "run"
    train_dir.mkdir()
    (train_dir / "lock").symlink_to(tmp_path / target)
    with pytest.raises(UsageError) as refused:
        run_record.TrainDirLock(str(train_dir))
    assert str(refused.value) == (
        f"--train_dir={train_dir}: cannot lock {train_dir}/lock (it is a symbolic link, to "
        f"{tmp_path / target}, which the run does not follow; remove it, or add "
        f"--train_dir={train_dir}_2)")
    assert precious.read_text() == "precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["precious", "run"]


@pytest.mark.parametrize("kind,make", [("a directory", os.mkdir), ("a FIFO", os.mkfifo)])
def test_a_directory_or_a_fifo_where_the_lock_belongs_is_one_usage_error_line(tmp_path, kind, make):
    # Before: IsADirectoryError for a directory; a FIFO was taken as the lock.
    train_dir = tmp_path / "run"
    train_dir.mkdir()
    make(train_dir / "lock")
    with pytest.raises(UsageError) as refused:
        run_record.TrainDirLock(str(train_dir))
    assert str(refused.value) == (f"--train_dir={train_dir}: cannot lock {train_dir}/lock (it is {kind}, "
                                  f"not a file; remove it, or add --train_dir={train_dir}_2)")


def test_a_train_dir_that_is_a_file_or_under_a_link_loop_is_one_usage_error_line(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("precious")
    with pytest.raises(UsageError) as refused:  # before: FileExistsError
        run_record.TrainDirLock(str(a_file))
    assert str(refused.value) == (f"--train_dir={a_file}: cannot make the directory (it is a file, "
                                  "not a directory)")
    assert a_file.read_text() == "precious"
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    with pytest.raises(UsageError) as refused:  # before: OSError ELOOP from os.makedirs
        run_record.TrainDirLock(str(tmp_path / "loop" / "run"))
    assert str(refused.value) == (f"--train_dir={tmp_path}/loop/run: cannot make the directory "
                                  "(Too many levels of symbolic links)")


@pytest.mark.parametrize("name", ["checkpoint.tmp", f"{RUN_FILE}.tmp", "ckpt-3.index", "ckpt-3_temp",
                                  "events.out.tfevents.1.host.42.0", "passed_over"])
def test_a_link_in_the_train_dir_is_refused_by_the_lock_and_what_it_names_is_untouched(tmp_path, name):
    # Before: the lock was taken, and the run's writes (its own, TensorFlow's) went through the link.
    precious = tmp_path / "precious"
    precious.write_text("precious")
    train_dir = tmp_path / "run"
    train_dir.mkdir()
    (train_dir / name).symlink_to(precious)
    with pytest.raises(UsageError) as refused:
        run_record.TrainDirLock(str(train_dir))
    assert str(refused.value) == (
        f"--train_dir={train_dir}: {train_dir}/{name} is a symbolic link (to {precious}); a run follows "
        f"no link where it writes, so nothing it points at is written: remove it, or add "
        f"--train_dir={train_dir}_2")
    assert precious.read_text() == "precious"
    (train_dir / name).unlink()
    with run_record.TrainDirLock(str(train_dir)):  # the refusal released the lock
        pass


def test_a_link_at_a_staging_file_is_refused_and_what_it_names_is_untouched(tmp_path):
    # Before: the run record (and the checkpoints' index) were written through the link.
    precious = tmp_path / "precious"
    precious.write_text("precious")
    train_dir = tmp_path / "run"
    train_dir.mkdir()
    (train_dir / f"{RUN_FILE}.tmp").symlink_to(precious)
    with pytest.raises(UsageError) as refused:
        RECORD.write(str(train_dir))
    assert str(refused.value) == (
        f"{train_dir}/{RUN_FILE}.tmp is a symbolic link (to {precious}); a run follows no link where it "
        "writes, so nothing it points at is written: remove it")
    assert precious.read_text() == "precious"
    assert os.listdir(train_dir) == [f"{RUN_FILE}.tmp"]


def test_a_staging_file_left_by_a_killed_run_is_replaced_and_one_planted_in_its_place_is_not_followed(
        tmp_path, monkeypatch):
    path = tmp_path / "checkpoint"
    (tmp_path / "checkpoint.tmp").write_text("half an index")
    run_record.write_whole(str(path), "whole")
    assert path.read_text() == "whole"
    assert sorted(os.listdir(tmp_path)) == ["checkpoint"]

    # A link made between the removal of the stale file and the staging file's creation.
    precious = tmp_path / "precious"
    precious.write_text("precious")
    (tmp_path / "checkpoint.tmp").write_text("half an index")
    remove = os.remove

    def remove_then_plant(name):
        remove(name)
        os.symlink(precious, name)

    monkeypatch.setattr(os, "remove", remove_then_plant)
    with pytest.raises(FileExistsError):  # before: written through the link
        run_record.write_whole(str(path), "again")
    assert precious.read_text() == "precious"
    assert path.read_text() == "whole"


def test_a_train_dir_another_user_may_write_in_is_refused(tmp_path):
    """Another local user could plant a link there after the start-up's checks, where
    TensorFlow's own writers would write through it: a train_dir of another user's, or one
    anyone may write in, is refused in one line and left as it was."""
    if os.geteuid() != 0:
        pytest.skip("making a directory another user's needs root (chown)")
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, 4321, -1)
    with pytest.raises(UsageError) as refused:
        run_record.TrainDirLock(str(theirs))
    assert str(refused.value) == (
        f"--train_dir={theirs}: belongs to another user (uid 4321), who could plant links where "
        f"the run writes; use a directory of your own, such as --train_dir={theirs}_2")
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(UsageError) as refused:
        run_record.TrainDirLock(str(shared))
    assert str(refused.value) == (
        f"--train_dir={shared}: any user may write in it (mode 777), and so plant links where the "
        "run writes; chmod o-w it, or use a directory of your own")
    assert not list(theirs.iterdir()) and not list(shared.iterdir())
