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
