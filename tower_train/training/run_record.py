"""A train_dir's own files, apart from its checkpoints: the run record and the lock.

`RUN_FILE` records what must not change for a train_dir's checkpoints to be
resumed (the model, the data, the seed, the optimizer, whether a moving average
is kept, and G, the examples per update): a `RunRecord`, whose `check` compares
a new run with it (`checkpoints.check_same_run` tells it what the checkpoints
say). `TrainDirLock` keeps a second run out of a train_dir while one trains
there, and refuses a symbolic link in it (`refuse_links`). Nothing here reads a checkpoint.

A run follows no link inside its train_dir: the default train_dir is a fixed name under /tmp,
and a link planted inside it (which /tmp's sticky bit does not cover) would point the run's
writes at any file its owner may write. The run's own files are opened so that they follow no
link (the lock, `write_whole`'s staging file); TensorFlow's checkpoint and summary writers follow
links, so a link anywhere among the train_dir's entries is refused before they run.
"""
from __future__ import annotations

import dataclasses
import errno
import fcntl
import json
import os
import socket
import stat
from typing import Callable

from absl import logging

from tower_train.errors import UsageError

RUN_FILE = "tower_train_run.json"  # in a train_dir: what its checkpoints were trained with
LOCK_FILE = "lock"  # held by the run that trains in a train_dir

_FOR_MESSAGES_ONLY = ("model_module",)  # recorded for the eval command's hints, not compared


@dataclasses.dataclass(frozen=True)
class RunRecord:
    """What must not change for a checkpoint to be resumed (any factoring of G is fine:
    that is the promise), and the module that registers the model."""

    model: str
    model_module: str | None
    dataset: str
    seed: int
    optimizer: str
    global_batch: int
    moving_average: bool

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    @staticmethod
    def read(directory: str) -> dict | None:
        """The record in `directory` as written (by any version), None if there is none;
        UsageError if it is unreadable."""
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

    def write(self, train_dir: str) -> None:
        """Writes the record unless there is one, whole or not at all (a full disk leaves no half)."""
        path = os.path.join(train_dir, RUN_FILE)
        if not os.path.exists(path):
            write_whole(path, json.dumps(self.as_dict(), indent=1))

    def differences(self, saved: dict) -> list[str]:
        """"<key> <saved> there, <new> here" for each value of this record that differs from the
        saved record's (the module that registers the model is not compared)."""
        return [f"{key} {saved.get(key)!r} there, {value!r} here" for key, value in self.as_dict().items()
                if saved.get(key) != value and key not in _FOR_MESSAGES_ONLY]

    def check(self, train_dir: str, checkpoints: list[int],
              copy: Callable[[], tuple[dict | None, str | None]]) -> None:
        """Refuses a train_dir written by a different model or layout, naming a fresh one to use.

        `checkpoints` are the numbers of the checkpoints in it, newest first; `copy` reads the
        record's copy in the newest that holds one, and that checkpoint's path ((None, None) if
        none does). Without RUN_FILE the copy is compared; a record without any checkpoint, or
        checkpoints without any record, are refused: either means files of the run were lost,
        and starting afresh would write over what is left.
        """
        saved = self.read(train_dir)
        says = ""
        if saved is not None and not checkpoints:
            raise UsageError(f"--train_dir={train_dir}: holds {RUN_FILE} but no checkpoint (no ckpt-N "
                             "file): were they moved or deleted? Put them back to resume, remove "
                             f"{RUN_FILE} to start afresh there, or add --train_dir={fresh_directory(train_dir)}")
        if saved is None and checkpoints:
            saved, where = copy()
            if saved is None:
                raise UsageError(f"--train_dir={train_dir}: holds checkpoints (the newest ckpt-{checkpoints[0]}) "
                                 f"but no {RUN_FILE}, and none holds a copy of it (written by an older "
                                 "tower_train?), so nothing says which run they are of; put the file back "
                                 f"to resume, or add --train_dir={fresh_directory(train_dir)}")
            says = f" (says the copy of {RUN_FILE} in {where}, as the file itself is missing)"
            logging.warning("%s is missing: comparing this run with the copy in %s",
                            os.path.join(train_dir, RUN_FILE), where)
        if saved is None:
            return
        differ = self.differences(saved)
        if differ:
            raise UsageError(f"--train_dir={train_dir} holds another run{says}: " + "; ".join(differ)
                             + " (global_batch = batch_size x towers x workers x accum); use the same "
                             f"values to resume, or add --train_dir={fresh_directory(train_dir)}")


def fresh_directory(train_dir: str) -> str:
    """The first of <train_dir>_2, _3, ... that does not exist: a train_dir to suggest."""
    base = train_dir.rstrip(os.sep) or train_dir
    number = 2
    while os.path.exists(f"{base}_{number}"):
        number += 1
    return f"{base}_{number}"


def write_whole(path: str, text: str) -> None:
    """Writes `text` to `path` whole or not at all: staged beside it in a file made afresh, then
    renamed over it (a link at `path` is replaced, never written through); the staging file is
    removed if the write fails (a full disk). UsageError if the staging file's name is a
    symbolic link; OSError as the write raises it."""
    staging = f"{path}.tmp"
    try:
        if stat.S_ISLNK(os.lstat(staging).st_mode):
            raise link_refusal(staging)
        os.remove(staging)  # left by a run killed while it wrote
    except FileNotFoundError:
        pass
    # O_EXCL follows no link and makes the file afresh: one planted since the removal fails it.
    fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(staging, path)
    finally:
        if os.path.lexists(staging):
            os.remove(staging)


def link_refusal(path: str, train_dir: str | None = None) -> UsageError:
    """The refusal of a symbolic link at `path`, where the run would write."""
    where = f"--train_dir={train_dir}: " if train_dir is not None else ""
    fresh = f", or add --train_dir={fresh_directory(train_dir)}" if train_dir is not None else ""
    return UsageError(f"{where}{path} is a symbolic link (to {os.readlink(path)}); a run follows "
                      f"no link where it writes, so nothing it points at is written: remove it{fresh}")


def refuse_links(train_dir: str) -> None:
    """Refuses a symbolic link among train_dir's entries, naming the first: the run writes files
    there by name, TensorFlow's among them, and those writers follow links."""
    try:
        names = sorted(os.listdir(train_dir))
    except OSError as e:
        raise UsageError(f"--train_dir={train_dir}: cannot list it ({e.strerror})") from None
    for name in names:
        path = os.path.join(train_dir, name)
        if os.path.islink(path):
            raise link_refusal(path, train_dir)


def _refuse_others_directory(train_dir: str) -> None:
    """Refuses a train_dir that another local user may write in: one that user owns (a
    /tmp/tower_train someone else made first) or one anyone may write in. Such a user could plant
    a link there after the start-up's checks, where TensorFlow's own writers (checkpoints,
    TensorBoard), which follow links, would then write."""
    info = os.stat(train_dir)
    if info.st_uid != os.geteuid():
        raise UsageError(f"--train_dir={train_dir}: belongs to another user (uid {info.st_uid}), "
                         "who could plant links where the run writes; use a directory of your "
                         f"own, such as --train_dir={fresh_directory(train_dir)}")
    if info.st_mode & stat.S_IWOTH:
        raise UsageError(f"--train_dir={train_dir}: any user may write in it (mode "
                         f"{stat.S_IMODE(info.st_mode):o}), and so plant links where the run "
                         "writes; chmod o-w it, or use a directory of your own")


def _not_a_file(path: str) -> str | None:
    """Why no lock can be at `path` when something other than a regular file stands there; None
    when a regular file does, or nothing."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return None
    if stat.S_ISLNK(mode):
        return f"it is a symbolic link, to {os.readlink(path)}, which the run does not follow"
    kinds = {stat.S_ISREG: None, stat.S_ISDIR: "a directory", stat.S_ISFIFO: "a FIFO",
             stat.S_ISSOCK: "a socket", stat.S_ISCHR: "a device", stat.S_ISBLK: "a device"}
    kind = next(name for test, name in kinds.items() if test(mode))  # every kind Linux has
    return None if kind is None else f"it is {kind}, not a file"


def _lock_refusal(train_dir: str, path: str, odd: str | None, error: str = "") -> UsageError:
    """"cannot lock <path> (<reason>)": what stands there instead of a file (`odd`) and what to
    do about it, or the system's error."""
    reason = f"{odd}; remove it, or add --train_dir={fresh_directory(train_dir)}" if odd else error
    return UsageError(f"--train_dir={train_dir}: cannot lock {path} ({reason})")


class TrainDirLock:
    """An exclusive lock on a train_dir for the life of one run: a second run there is refused.

    It is a `flock` on train_dir/lock, so the kernel releases it whenever the holder
    ends, SIGKILL included: a lock left by a dead run never blocks the next one. The
    file says who holds it (PID and host), for the refusal's message. Evaluation
    takes no lock: it only reads.
    """

    def __init__(self, train_dir: str):
        self._created = not os.path.isdir(train_dir)
        try:
            os.makedirs(train_dir, exist_ok=True)
        except OSError as e:  # a file of that name, a link loop on the way (ELOOP)
            reason = "it is a file, not a directory" if e.errno == errno.EEXIST else e.strerror
            raise UsageError(f"--train_dir={train_dir}: cannot make the directory ({reason})") from None
        if self._created:  # a umask of 0 would leave it open to everyone's links
            os.chmod(train_dir, stat.S_IMODE(os.stat(train_dir).st_mode) & ~stat.S_IWOTH)
        _refuse_others_directory(train_dir)
        self._path = path = os.path.join(train_dir, LOCK_FILE)
        try:
            # No link followed (the run would truncate the file it names); no wait on a FIFO.
            self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
        except OSError as e:
            raise _lock_refusal(train_dir, path, _not_a_file(path), e.strerror) from None
        if not stat.S_ISREG(os.fstat(self._fd).st_mode):
            os.close(self._fd)
            raise _lock_refusal(train_dir, path, _not_a_file(path) or "it is no regular file")
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = os.pread(self._fd, 200, 0).decode(errors="replace").strip() or "unknown"
            os.close(self._fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EACCES):
                raise _lock_refusal(train_dir, path, None, e.strerror) from None
            raise UsageError(f"--train_dir={train_dir}: another run is training there ({holder}); "
                             f"wait for it to end, or add --train_dir={fresh_directory(train_dir)}") from None
        try:
            refuse_links(train_dir)  # held: no other run changes it from here
        except UsageError:
            self.release()
            raise
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
