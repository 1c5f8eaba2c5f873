"""Checkpoints and the run record of a train_dir, shared by training and evaluation.

A train_dir holds the checkpoints of ONE run: `RUN_FILE` records what must not
change for them to be resumed (the model, the data, the seed, the optimizer,
whether a moving average is kept, and G, the examples per update). Training
refuses a train_dir whose record differs; evaluation refuses a checkpoint of
another model. Restoring takes the newest checkpoint that reads back whole.
"""
from __future__ import annotations

import dataclasses
import errno
import fcntl
import glob
import json
import os
import re
import shutil
import socket
from typing import Callable

import tensorflow as tf
from absl import logging

from tower_train.config import RUN_FILE
from tower_train.errors import TrainingError, UsageError, first_line

CHECKPOINTS_KEPT = 5  # enough to fall back past a bad one, small enough to ignore
LOCK_FILE = "lock"  # held by the run that trains in a train_dir
_STATE_FILE = "checkpoint"  # where tf.train.CheckpointManager lists a directory's checkpoints
_MODEL_PREFIX = "model/"
_AVERAGE_PREFIX = "moving_average/"
# TF's reader fails on a damaged file in all of these ways, depending on where it is cut.
_READ_ERRORS = (tf.errors.OpError, AssertionError, ValueError, IndexError, KeyError)


_FOR_MESSAGES_ONLY = ("model_module",)  # recorded for the eval command's hints, not compared


def run_record(model: str, model_module: str | None, dataset: str, seed: int, optimizer: str,
               global_batch: int, moving_average: bool) -> dict:
    """What must not change for a checkpoint to be resumed (any factoring of G is fine:
    that is the promise), and the module that registers the model."""
    return {"model": model, "model_module": model_module, "dataset": dataset, "seed": seed,
            "optimizer": optimizer, "global_batch": global_batch, "moving_average": moving_average}


def read_run_record(directory: str) -> dict | None:
    """The run record in `directory`, None if there is none; UsageError if it is unreadable."""
    path = os.path.join(directory, RUN_FILE)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            record = json.load(f)
    except (OSError, ValueError) as e:
        raise UsageError(f"--train_dir={directory}: {RUN_FILE} is unreadable ({e})") from None
    if not isinstance(record, dict):
        raise UsageError(f"--train_dir={directory}: {RUN_FILE} holds no JSON object")
    return record


def check_same_run(train_dir: str, record: dict) -> None:
    """Refuses a train_dir written by a different model or layout, naming a fresh one to use."""
    saved = read_run_record(train_dir)
    if saved is None:
        return
    differ = [f"{key} {saved.get(key)!r} there, {value!r} here" for key, value in record.items()
              if saved.get(key) != value and key not in _FOR_MESSAGES_ONLY]
    if differ:
        raise UsageError(f"--train_dir={train_dir} holds another run: " + "; ".join(differ)
                         + " (global_batch = batch_size x towers x workers x accum); use the same "
                         f"values to resume, or add --train_dir={fresh_directory(train_dir)}")


def fresh_directory(train_dir: str) -> str:
    """The first of <train_dir>_2, _3, ... that does not exist: a train_dir to suggest."""
    base = train_dir.rstrip(os.sep) or train_dir
    number = 2
    while os.path.exists(f"{base}_{number}"):
        number += 1
    return f"{base}_{number}"


def write_run_record(train_dir: str, record: dict) -> None:
    """Writes the record unless there is one, whole or not at all (a full disk leaves no half)."""
    path = os.path.join(train_dir, RUN_FILE)
    if os.path.exists(path):
        return
    staging = f"{path}.tmp"
    try:
        with open(staging, "w") as f:
            json.dump(record, f, indent=1)
        os.replace(staging, path)
    finally:
        if os.path.exists(staging):
            os.remove(staging)


class TrainDirLock:
    """An exclusive lock on a train_dir for the life of one run: a second run there is refused.

    It is a `flock` on train_dir/lock, so the kernel releases it whenever the holder
    ends, SIGKILL included: a lock left by a dead run never blocks the next one. The
    file says who holds it (PID and host), for the refusal's message. Evaluation
    takes no lock: it only reads.
    """

    def __init__(self, train_dir: str):
        self._created = not os.path.isdir(train_dir)
        os.makedirs(train_dir, exist_ok=True)
        self._path = path = os.path.join(train_dir, LOCK_FILE)
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = os.pread(self._fd, 200, 0).decode(errors="replace").strip() or "unknown"
            os.close(self._fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EACCES):
                raise UsageError(f"--train_dir={train_dir}: cannot lock {path} ({e.strerror})") from None
            raise UsageError(f"--train_dir={train_dir}: another run is training there ({holder}); "
                             f"wait for it to end, or add --train_dir={fresh_directory(train_dir)}") from None
        try:
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, f"PID {os.getpid()} on host {socket.gethostname()}\n".encode(), 0)
        except OSError:
            pass  # a full disk: the lock holds all the same, only its message names no one

    def release(self) -> None:
        """Releases the lock; a train_dir this run made and never wrote to goes again, so a run
        refused after taking it leaves nothing behind."""
        directory = os.path.dirname(self._path)
        if self._created and os.listdir(directory) == [LOCK_FILE]:
            os.remove(self._path)
            os.rmdir(directory)
        os.close(self._fd)  # releases the flock

    def __enter__(self) -> "TrainDirLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def restore_latest_readable(checkpoint: tf.train.Checkpoint, train_dir: str,
                            is_finite: Callable[[], bool] = lambda: True) -> str | None:
    """Restores the newest checkpoint that reads back whole and, by `is_finite`, holds only
    finite values; says so when it skips a bad one.

    Returns its path, or None when train_dir holds no checkpoint.
    Raises UsageError when it holds some and none is readable.
    """
    state = tf.train.get_checkpoint_state(train_dir)
    paths = list(reversed(state.all_model_checkpoint_paths)) if state else []
    failures = []
    for path in paths:
        try:
            checkpoint.restore(path).assert_existing_objects_matched()
            if not is_finite():
                failures.append(f"checkpoint {path} holds non-finite values")
                continue
            if failures:
                logging.warning("%s; resuming from the older %s", "; ".join(failures), path)
            return path
        except _READ_ERRORS as e:
            failures.append(f"checkpoint {path} is unreadable ({first_line(e, 160)})")
    if failures:
        raise UsageError(f"--train_dir={train_dir}: no readable checkpoint: {failures[0]}")
    return None


class CheckpointWriter:
    """Saves numbered checkpoints of a run, and its run record beside the first one.

    Only the chief writes into train_dir; another worker of a multi_worker run writes
    into a temporary directory inside it, which `close` removes.
    """

    def __init__(self, checkpoint: tf.train.Checkpoint, train_dir: str, record: dict,
                 is_chief: bool = True, worker_index: int = 0):
        self.train_dir = train_dir
        self._record = record
        self._is_chief = is_chief
        self._directory = train_dir if is_chief else os.path.join(train_dir, f".worker_{worker_index}.tmp")
        self._manager = tf.train.CheckpointManager(checkpoint, self._directory,
                                                   max_to_keep=CHECKPOINTS_KEPT)

    def save(self, step: int) -> str:
        """Writes ckpt-<step>; returns its path in train_dir.

        Raises TrainingError when it cannot be written (a full disk, a lost mount), after
        removing what the failed write left: the earlier checkpoints stay as they were.
        """
        try:
            if self._is_chief:  # first: a checkpoint is never without its record
                write_run_record(self.train_dir, self._record)
            self._manager.save(checkpoint_number=step)
        except (tf.errors.OpError, OSError) as e:
            for leftover in glob.glob(os.path.join(glob.escape(self._directory), f"ckpt-{step}_temp*")):
                shutil.rmtree(leftover, ignore_errors=True)
            latest = self.latest()
            kept = f"the last checkpoint, {latest}, is intact" if latest else "no checkpoint was written"
            raise TrainingError(f"cannot write checkpoint ckpt-{step} in --train_dir={self.train_dir} "
                                f"({write_failure(e)}); its partial files are removed and {kept}; "
                                "make room and run the same command to resume") from None
        return os.path.join(self.train_dir, f"ckpt-{step}")

    def latest(self) -> str | None:
        return tf.train.latest_checkpoint(self.train_dir)

    def close(self) -> None:
        if not self._is_chief:
            shutil.rmtree(self._directory, ignore_errors=True)


# --------------------------------------------------------------------------------------------------
# Finding and restoring a checkpoint for evaluation


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    path: str  # the checkpoint's prefix, e.g. /tmp/tower_train/ckpt-30
    flag: str  # how the user named it, for messages: "--checkpoint=..." or "--train_dir=..."
    has_moving_average: bool


_NO_CHECKPOINT_HINT = {True: "; train there first, or name one with --checkpoint",
                       False: " (name a checkpoint prefix such as <train_dir>/ckpt-30, or a run's "
                              "train_dir)"}


def _prefix(checkpoint: str) -> str:
    return checkpoint[:-len(".index")] if checkpoint.endswith(".index") else checkpoint


def check_named_checkpoint(checkpoint: str | None, train_dir: str, model: str) -> None:
    """The checks that need no reading of tensors, so that these errors come at once: the path
    named exists, a directory lists checkpoints at all, and the run record beside them (if
    any) names this model."""
    listed = checkpoint is None or os.path.isdir(checkpoint)  # a directory: its latest checkpoint
    if checkpoint is not None:
        flag, directory = f"--checkpoint={checkpoint}", checkpoint
        if not listed:
            prefix = _prefix(checkpoint)
            if not os.path.isfile(prefix + ".index"):
                raise UsageError(f"{flag}: no such checkpoint ({prefix}.index does not exist); name "
                                 "a checkpoint prefix such as <train_dir>/ckpt-30, or a directory")
            directory = os.path.dirname(prefix) or "."
    else:
        flag, directory = f"--train_dir={train_dir}", train_dir
        if not os.path.isdir(train_dir):
            raise UsageError(f"{flag}: "
                             f"{'is not a directory' if os.path.exists(train_dir) else 'does not exist'}"
                             "; no checkpoint to evaluate (name a run's --train_dir, or --checkpoint)")
    if listed and not os.path.isfile(os.path.join(directory, _STATE_FILE)):
        raise UsageError(f"{flag}: holds no checkpoint{_NO_CHECKPOINT_HINT[checkpoint is None]}")
    try:
        record = read_run_record(directory) or {}
    except UsageError:
        return  # an unreadable record: the restore itself checks the structure
    trained, module = record.get("model"), record.get("model_module")
    if trained is not None and trained != model:
        hint = model_label(trained) + (f" --model_module={module}" if module else "")
        raise UsageError(f"{flag}: its checkpoints are of {model_label(trained)} (says "
                         f"{os.path.join(directory, RUN_FILE)}), not {model_label(model)}; pass {hint}")


def model_label(name: str) -> str:
    """How messages name a model: --model=NAME for a registered one, model=module.Class else."""
    return f"model={name}" if "." in name else f"--model={name}"


def find_checkpoint(checkpoint: str | None, train_dir: str) -> CheckpointInfo:
    """The checkpoint to evaluate, checked readable: --checkpoint (a prefix, or a directory's
    latest), else the latest in train_dir."""
    directory = train_dir if checkpoint is None else checkpoint
    flag = f"--train_dir={train_dir}" if checkpoint is None else f"--checkpoint={checkpoint}"
    if os.path.isdir(directory):
        path = tf.train.latest_checkpoint(directory)
        if path is None:
            raise UsageError(f"{flag}: holds no checkpoint{_NO_CHECKPOINT_HINT[checkpoint is None]}")
    else:
        path = _prefix(checkpoint)
    try:
        reader = tf.train.load_checkpoint(path)
        names = sorted(reader.get_variable_to_shape_map())
        for name in names:  # read what will be restored now, so a damaged file is named here
            if name.startswith((_MODEL_PREFIX, _AVERAGE_PREFIX)):
                reader.get_tensor(name)
    except _READ_ERRORS as e:
        raise UsageError(f"{flag}: checkpoint {path} is unreadable ({first_line(e)})") from None
    if not any(name.startswith(_MODEL_PREFIX) for name in names):
        raise UsageError(f"{flag}: checkpoint {path} holds no 'model' (not written by tower_train?)")
    return CheckpointInfo(path, flag, any(name.startswith(_AVERAGE_PREFIX) for name in names))


def restore_for_evaluation(info: CheckpointInfo, objects: dict, model_name: str) -> None:
    """Restores `objects` ({"model": ..., maybe "moving_average": ...}) from the checkpoint;
    the optimizer is not read. UsageError for a checkpoint of another network."""
    mismatch = _shape_mismatch(objects, info.path)
    if mismatch:
        raise UsageError(f"{info.flag}: checkpoint {info.path} does not fit {model_label(model_name)} "
                         f"(a checkpoint of another network?): {mismatch}")
    try:
        tf.train.Checkpoint(**objects).restore(info.path).expect_partial() \
            .assert_existing_objects_matched()
    # A checkpoint of another network fails the match (AssertionError) or a shape (ValueError).
    except _READ_ERRORS as e:
        what = ("does not hold the weights of" if isinstance(e, AssertionError)
                else "cannot be restored into")
        raise UsageError(f"{info.flag}: checkpoint {info.path} {what} {model_label(model_name)} "
                         f"({first_line(e)})") from None


def _shape_mismatch(objects: dict, path: str) -> str | None:
    """The first checkpoint variable whose shape differs from the Python variable it would be
    restored into, found by following its key's attribute names; None if there is none.

    TensorFlow itself raises in the middle of a restore on such a variable, and then warns
    about every other value at exit; this check names the culprit before any restore. Keys
    that do not resolve by attribute name are left to the restore's own matching.
    """
    suffix = "/.ATTRIBUTES/VARIABLE_VALUE"
    for key, shape in sorted(tf.train.load_checkpoint(path).get_variable_to_shape_map().items()):
        head, *names = key[:-len(suffix)].split("/") if key.endswith(suffix) else ("", )
        target = objects.get(head)
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
                             r"Permission denied|Input/output error")


def write_failure(error: BaseException) -> str:
    """Why a write failed, in the system's words when it gives them (TF's own message wraps them
    in op names and temporary paths)."""
    known = _WRITE_FAILURES.search(str(error))
    return known.group(0) if known else first_line(error)
