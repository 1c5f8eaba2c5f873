"""A train_dir's own files, apart from its checkpoints: the run record and the lock.

`RUN_FILE` records what must not change for a train_dir's checkpoints to be
resumed (the model, the data, the seed, the optimizer, whether a moving average
is kept, and G, the examples per update); `checkpoints.check_same_run` compares
a new run with it. `TrainDirLock` keeps a second run out of a train_dir while
one trains there. Nothing here reads a checkpoint.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import socket

from tower_train.config import RUN_FILE
from tower_train.errors import UsageError

LOCK_FILE = "lock"  # held by the run that trains in a train_dir

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


def record_differences(saved: dict, record: dict) -> list[str]:
    """"<key> <saved> there, <new> here" for each key of `record` whose value differs from the
    saved record's (the module that registers the model is not compared)."""
    return [f"{key} {saved.get(key)!r} there, {value!r} here" for key, value in record.items()
            if saved.get(key) != value and key not in _FOR_MESSAGES_ONLY]


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
    if not os.path.exists(path):
        write_whole(path, json.dumps(record, indent=1))


def write_whole(path: str, text: str) -> None:
    """Writes `text` to `path` whole or not at all: staged beside it, then renamed over it; the
    staging file is removed if the write fails (a full disk). OSError as the write raises it."""
    staging = f"{path}.tmp"
    try:
        with open(staging, "w") as f:
            f.write(text)
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
