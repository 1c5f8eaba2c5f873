"""The checkpoints of a train_dir, as training writes and restores them.

A train_dir holds the checkpoints of ONE run: its run record (`run_record.RunRecord`) says
which, and every checkpoint holds a copy of it. Training refuses a train_dir whose record differs.
Restoring takes the newest
checkpoint that reads back whole, found from the checkpoint files themselves: the
index file `checkpoint` may be lost or damaged without losing a checkpoint, and no
checkpoint file is ever overwritten. Evaluation finds and restores its checkpoint with
`evaluation.checkpoint`, from the same files.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import time
from typing import Callable

import tensorflow as tf
from absl import logging

from tower_train.errors import TrainingError, UsageError, first_line
from tower_train.training.run_record import (RUN_FILE, RunRecord, fresh_directory, link_refusal,
                                             write_whole)

CHECKPOINTS_KEPT = 5  # enough to fall back past a bad one, small enough to ignore
_STATE_FILE = "checkpoint"  # where tf.train.CheckpointManager lists a directory's checkpoints
PASSED_OVER = "passed_over"  # where a passed-over checkpoint goes before its number is written again
_CHECKPOINT_FILE = re.compile(r"ckpt-(\d+)\.(?:index|data-\d{5}-of-\d{5})")
_PARTIAL_SAVE = re.compile(r"ckpt-\d+_temp.*")  # what TF stages a checkpoint in
_RECORD_KEY = "run_record/.ATTRIBUTES/VARIABLE_VALUE"  # the run record's copy in a checkpoint
# TF's reader fails on a damaged file in all of these ways, depending on where it is cut.
READ_ERRORS = (tf.errors.OpError, AssertionError, ValueError, IndexError, KeyError)


def check_same_run(train_dir: str, record: RunRecord) -> None:
    """`RunRecord.check` against the checkpoints in train_dir, found from their files, and the
    record's copy in the newest that holds one."""
    # The data files of an interrupted save are no checkpoint: the writer moves them aside.
    numbers = [n for n in checkpoint_numbers(train_dir) if n not in interrupted_merges(train_dir)]
    record.check(train_dir, numbers, lambda: _record_copy(train_dir, numbers))


def checkpoint_numbers(directory: str) -> list[int]:
    """The numbers N of the checkpoints ckpt-N in `directory`, newest first, from the files
    themselves (any file of a checkpoint counts); the index file is not read."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    found = (_CHECKPOINT_FILE.fullmatch(name) for name in names)
    return sorted({int(match.group(1)) for match in found if match}, reverse=True)


def _record_copy(directory: str, numbers: list[int]) -> tuple[dict | None, str | None]:
    """The run record's copy in the newest of these checkpoints that holds a readable one, and
    that checkpoint's path; (None, None) if none does."""
    for number in numbers:
        path = os.path.join(directory, f"ckpt-{number}")
        try:
            record = json.loads(tf.train.load_checkpoint(path).get_tensor(_RECORD_KEY))
        except READ_ERRORS:
            continue
        if isinstance(record, dict):
            return record, path
    return None, None


def restore_latest_readable(checkpoint: tf.train.Checkpoint, train_dir: str,
                            is_finite: Callable[[], bool] = lambda: True) -> str | None:
    """Restores the newest checkpoint that reads back whole and, by `is_finite`, holds only
    finite values; says so when it passes over a bad one.

    The checkpoints are found from their files, so a lost or damaged index loses none.
    Returns the path restored, or None when train_dir holds no checkpoint file.
    Raises UsageError when it holds some and none is readable, or when the newest readable one
    was written by another model, precision or configuration: passing over a good checkpoint,
    or starting afresh, would write over the run's checkpoints.
    """
    failures = []
    for number in checkpoint_numbers(train_dir):
        path = os.path.join(train_dir, f"ckpt-{number}")
        differ = _configuration_mismatch(checkpoint, path)
        if differ is None:
            try:
                # Partial: the checkpoint's copy of the run record is added to the state after this.
                checkpoint.restore(path).expect_partial().assert_existing_objects_matched()
            except READ_ERRORS as e:
                if not _reads_whole(path):
                    failures.append(f"checkpoint {path} is unreadable ({first_line(e, 160)})")
                    continue
                differ = _unfit(e)
        if differ is not None:
            raise UsageError(f"--train_dir={train_dir}: checkpoint {path} reads back whole but was "
                             f"written by another model, precision or configuration: {differ}; it is "
                             "left as it is: resume with the flags and model code that wrote it, or "
                             f"add --train_dir={fresh_directory(train_dir)}")
        if not is_finite():
            failures.append(f"checkpoint {path} holds non-finite values")
            continue
        if failures:
            logging.warning("%s; resuming from the older %s", "; ".join(failures), path)
        return path
    if failures:
        raise UsageError(f"--train_dir={train_dir}: no readable checkpoint: {failures[0]}")
    return None


def _configuration_mismatch(checkpoint: tf.train.Checkpoint, path: str) -> str | None:
    """What makes a checkpoint unfit for this run's objects, as its index tells (no tensor is
    read): float16's loss scale missing, or a variable of another shape; None if nothing does,
    or if the index is unreadable (the restore then names the damage)."""
    try:
        shapes = tf.train.load_checkpoint(path).get_variable_to_shape_map()
    except READ_ERRORS:
        return None
    if (getattr(checkpoint, "loss_scale", None) is not None
            and not any(key.startswith("loss_scale/") for key in shapes)):
        return ("it holds no loss scale, so it was written without --precision=fp16, and this run "
                "has --precision=fp16")
    mismatch = shape_mismatch(checkpoint, shapes)
    return f"{mismatch} (another architecture?)" if mismatch else None


def _unfit(error: BaseException) -> str:
    """What a restore's error says about a checkpoint that reads back whole: TensorFlow lists the
    variables of this run that it lacks after a sentence of its own."""
    text = first_line(error, 2000)
    lacking = text.partition("unmatched objects: ")[2]
    if lacking:
        return f"it lacks variables of this run: {lacking[:200]}"
    return f"it does not fit this run's variables ({text[:200]})"


def _reads_whole(path: str) -> bool:
    """Whether every tensor of the checkpoint reads back (each is checksummed)."""
    try:
        reader = tf.train.load_checkpoint(path)
        for name in reader.get_variable_to_shape_map():
            reader.get_tensor(name)
    except READ_ERRORS:
        return False
    return True


def remove_partial_saves(directory: str) -> None:
    """Removes what an interrupted save left (TF stages each checkpoint in ckpt-N_temp*): a second
    signal or a kill during a save; and moves into PASSED_OVER the data files of a save cut
    between its merge's steps (`interrupted_merges`). Only the run that holds the train_dir's
    lock calls it."""
    for name in os.listdir(directory):
        if _PARTIAL_SAVE.fullmatch(name):
            path = os.path.join(directory, name)
            if os.path.isdir(path):
                shutil.rmtree(path)
            else:
                os.remove(path)
            logging.info("removed %s, left by a save that was interrupted", path)
    for number in interrupted_merges(directory):
        logging.warning("moved the data files of ckpt-%d, a save interrupted before its index was "
                        "written, to %s", number, _move_aside(directory, number))


def interrupted_merges(directory: str) -> list[int]:
    """The checkpoints newer than every whole one that have data files but no index: TF's merge
    renames a save's data files into place before it writes the index, so these are the last
    save, cut there (by a full disk, no inode left, a kill). No restore can read them."""
    try:
        names = set(os.listdir(directory))
    except OSError:
        return []
    indexed = [n for n in checkpoint_numbers(directory) if f"ckpt-{n}.index" in names]
    return [n for n in checkpoint_numbers(directory)
            if f"ckpt-{n}.index" not in names and n > max(indexed, default=-1)]


def _move_aside(train_dir: str, step: int) -> str | None:
    """Moves the files of ckpt-<step> into PASSED_OVER/ckpt-<step> (or a fresh name beside it);
    returns where, or None when it has none."""
    names = [name for name in os.listdir(train_dir)
             if (match := _CHECKPOINT_FILE.fullmatch(name)) and int(match.group(1)) == step]
    if not names:
        return None
    target = os.path.join(train_dir, PASSED_OVER, f"ckpt-{step}")
    if os.path.exists(target):
        target = fresh_directory(target)
    os.makedirs(target)
    for name in names:
        os.replace(os.path.join(train_dir, name), os.path.join(target, name))
    return target


def _write_index(directory: str, numbers: list[int]) -> None:
    """Makes the index file of `directory` list these checkpoints, as CheckpointManager writes
    it: the manager built on it then rotates exactly these, oldest first, and an index lost or
    damaged is whole again. Without checkpoints there is no index. An index that lists them
    already (a run that ended well) is left alone: rewriting it would need room on the disk."""
    path = os.path.join(directory, _STATE_FILE)
    names = [f"ckpt-{number}" for number in sorted(numbers)]
    try:
        if not names:
            if os.path.lexists(path):
                os.remove(path)
            return
        if _listed(path) == names:
            return
        now = time.time()  # the manager rotates only checkpoints stamped after last_preserved_timestamp
        lines = ([f'model_checkpoint_path: "{names[-1]}"']
                 + [f'all_model_checkpoint_paths: "{name}"' for name in names]
                 + [f"all_model_checkpoint_timestamps: {now!r}" for _ in names]
                 + [f"last_preserved_timestamp: {now - 1!r}"])
        write_whole(path, "\n".join(lines) + "\n")
    except OSError as e:
        failure = write_failure(e)
        raise TrainingError(f"cannot rewrite the index {path} of the checkpoints found "
                            f"({failure}); the checkpoints are intact; {write_remedy(failure)} and "
                            "run the same command to resume") from None
    logging.warning("%s did not list the checkpoints this run continues (it was missing, damaged, "
                    "or listed others): rewritten from the checkpoint files to list %s", path,
                    ", ".join(names))


def _listed(path: str) -> list[str] | None:
    """The checkpoints an index file lists, newest last, if it is whole: its latest is the last
    listed and every one has a time stamp (the manager rotates only those)."""
    try:
        with open(path) as f:
            text = f.read()
    except (OSError, UnicodeDecodeError):
        return None
    listed = re.findall(r'^all_model_checkpoint_paths: "([^"/]*)"$', text, re.M)
    latest = re.findall(r'^model_checkpoint_path: "([^"/]*)"$', text, re.M)
    stamps = re.findall(r"^all_model_checkpoint_timestamps: ", text, re.M)
    return listed if latest == listed[-1:] and len(stamps) == len(listed) else None


def checkpoint_number(path: str) -> int:
    """N, of a checkpoint's prefix .../ckpt-N."""
    return int(path.rsplit("-", 1)[1])


class CheckpointWriter:
    """Restores and saves the numbered checkpoints of a run, each with a copy of its run record,
    and writes the record beside them.

    `restore` comes first: only once it knows which checkpoint the run continues from is the
    index rewritten from the checkpoint files and the manager built on it, so that its usual
    rotation is all that ever deletes a checkpoint. A checkpoint is never written over: one of
    the same number, passed over by `restore`, is moved into PASSED_OVER first.
    Only the chief writes into train_dir; another worker of a multi_worker run writes
    into a temporary directory inside it, which `close` removes.
    """

    def __init__(self, checkpoint: tf.train.Checkpoint, train_dir: str, record: RunRecord,
                 is_chief: bool = True, worker_index: int = 0):
        self.train_dir = train_dir
        self._checkpoint = checkpoint
        self._record = record
        self._is_chief = is_chief
        self._directory = train_dir if is_chief else os.path.join(train_dir, f".worker_{worker_index}.tmp")
        self._manager: tf.train.CheckpointManager | None = None  # built by `restore`
        self._latest: str | None = None

    def restore(self, is_finite: Callable[[], bool] = lambda: True) -> str | None:
        """Restores the newest readable checkpoint (`restore_latest_readable`) and makes ready to
        save; returns the path restored, None for a fresh start."""
        if self._is_chief:
            remove_partial_saves(self.train_dir)
        elif os.path.islink(self._directory):  # not removed by rmtree: its target would be written
            raise link_refusal(self._directory, self.train_dir)
        else:
            shutil.rmtree(self._directory, ignore_errors=True)  # this worker's own, from a killed run
        self._latest = restore_latest_readable(self._checkpoint, self.train_dir, is_finite)
        if self._is_chief:
            restored = checkpoint_number(self._latest) if self._latest else -1
            _write_index(self.train_dir, [n for n in checkpoint_numbers(self.train_dir) if n <= restored])
        with tf.device("/cpu:0"):
            copy = tf.Variable("", trainable=False)
        # Added after the restore, as checkpoints of earlier versions hold no copy; assigned once
        # added, as adding it restores the copy the checkpoint holds.
        self._checkpoint.run_record = copy
        copy.assign(json.dumps(self._record.as_dict(), sort_keys=True))
        self._manager = tf.train.CheckpointManager(self._checkpoint, self._directory,
                                                   max_to_keep=CHECKPOINTS_KEPT)
        return self._latest

    def save(self, step: int) -> str:
        """Writes ckpt-<step>; returns its path in train_dir.

        Raises TrainingError when it cannot be written (a full disk, a lost mount), after
        removing what the failed write left: the earlier checkpoints stay as they were.
        """
        set_aside = written = False
        try:
            if self._is_chief:
                self._set_aside(step)
            set_aside = True  # from here, every file of ckpt-<step> is this save's
            self._manager.save(checkpoint_number=step)
            written = True
            self._latest = os.path.join(self.train_dir, f"ckpt-{step}")
            if self._is_chief:  # after the checkpoint: a record beside no checkpoint is refused
                self._record.write(self.train_dir)
        except (tf.errors.OpError, OSError) as e:
            failure = write_failure(e)
            if written:  # the checkpoint is whole, and its copy of the record stands in for the file
                raise TrainingError(f"cannot write {RUN_FILE} in --train_dir={self.train_dir} ({failure}); "
                                    f"{self._latest} is written whole and holds a copy of it; "
                                    f"{write_remedy(failure)} and run the same command to resume") from None
            if set_aside:
                self._remove_files_of(step)
            if self._latest:
                kept = f"the last checkpoint, {self._latest}, is intact"
            elif self._is_chief:
                kept = "no checkpoint was written"
            else:  # this worker's copy is set aside; the train_dir's checkpoints are the chief's
                kept = "the checkpoints in --train_dir are the chief's to write"
            where = (f"--train_dir={self.train_dir}" if self._is_chief
                     else f"this worker's directory {self._directory}")
            raise TrainingError(f"cannot write checkpoint ckpt-{step} in {where} ({failure}); its "
                                f"partial files are removed and {kept}; {write_remedy(failure)} and "
                                "run the same command to resume") from None
        return self._latest

    def _remove_files_of(self, step: int) -> None:
        """Removes every file that a failed save of ckpt-<step> left, wherever it failed: the
        staging ckpt-<step>_temp*, a data file or an index already merged before the index file
        could be written (_set_aside moved any earlier ckpt-<step> away first, so all are this
        save's)."""
        try:
            names = os.listdir(self._directory)
        except OSError:
            return  # no directory, nothing left in it
        for name in names:
            checkpoint_file = _CHECKPOINT_FILE.fullmatch(name)
            if not (checkpoint_file and int(checkpoint_file.group(1)) == step
                    or name.startswith(f"ckpt-{step}_temp")):
                continue
            path = os.path.join(self._directory, name)
            try:
                if os.path.isdir(path):
                    shutil.rmtree(path)
                else:
                    os.remove(path)
            except OSError as e:
                logging.warning("cannot remove %s, left by the failed save (%s)", path, write_failure(e))

    def _set_aside(self, step: int) -> None:
        """Moves the files of an existing ckpt-<step> (passed over by `restore` as unreadable or
        non-finite) into PASSED_OVER, so that this run's ckpt-<step> writes over none of them."""
        target = _move_aside(self.train_dir, step)
        if target:
            logging.warning("moved the files of the passed-over checkpoint ckpt-%d to %s: this run "
                            "writes its own ckpt-%d", step, target, step)

    def latest(self) -> str | None:
        """The checkpoint restored or last written."""
        return self._latest

    def close(self) -> None:
        if not self._is_chief:
            shutil.rmtree(self._directory, ignore_errors=True)


def shape_mismatch(root: object, shapes: dict) -> str | None:
    """The first checkpoint variable (`shapes`: key -> shape, as a checkpoint's reader gives them)
    whose shape differs from the Python variable it would be restored into, found by following
    its key's attribute names from `root`; None if there is none.

    TensorFlow itself raises in the middle of a restore on such a variable, and then warns
    about every other value at exit; this check names the culprit before any restore. Keys
    that do not resolve by attribute name are left to the restore's own matching.
    """
    suffix = "/.ATTRIBUTES/VARIABLE_VALUE"
    for key, shape in sorted(shapes.items()):
        head, *names = key[:-len(suffix)].split("/") if key.endswith(suffix) else ("", )
        # A tf.train.Checkpoint would make its save counter on being asked for it.
        target = getattr(root, head, None) if head not in ("", "save_counter") else None
        for name in names:
            if target is None:
                break
            if name.isdigit() and isinstance(target, (list, tuple)):
                target = target[int(name)] if int(name) < len(target) else None
            else:
                target = getattr(target, name, None)
        here = getattr(target, "shape", None)
        if target is not None and here is not None and list(here) != list(shape):
            return f"{key[:-len(suffix)]} is {list(shape)} there, {list(here)} here"
    return None


_WRITE_FAILURES = re.compile(r"No space left on device|Disk quota exceeded|Read-only file system|"
                             r"Permission denied|Operation not permitted|Input/output error")
# What to do about each, before running the same command again.
_REMEDIES = {"No space left on device": "make room", "Disk quota exceeded": "make room",
             "Read-only file system": "make the file system writable",
             "Permission denied": "give the run permission to write there",
             "Operation not permitted": "give the run permission to write there (an immutable "
                                        "file or directory?)"}


def write_failure(error: BaseException) -> str:
    """Why a write failed, in the system's words when it gives them (TF's own message wraps them
    in op names and temporary paths)."""
    known = _WRITE_FAILURES.search(str(error))
    return known.group(0) if known else first_line(error)


def write_remedy(failure: str) -> str:
    """What to do about a write that failed for `failure` (`write_failure`'s words)."""
    return _REMEDIES.get(failure, "fix the cause")
