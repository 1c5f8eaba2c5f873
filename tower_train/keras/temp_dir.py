"""The temporary train_dir of `tower_train.keras.fit` without `train_dir=` (keras/model_fit.py), which a
SIGKILL cannot leave behind for good.

The process that makes one holds an exclusive `flock` on its `owner` file, which names the
process and its host, until it removes the directory; the kernel drops the lock when the process
dies, however it dies. Each new one first removes the stale ones in the same temporary
directory: a directory of this prefix that this user owns (not a link), whose `owner` is a
regular file (not a link) naming this host, and whose lock can be taken. Anything else is left
alone: another user's, a live process's (its lock is held, in whatever PID namespace), another
host's (a shared /tmp whose locks may not reach across hosts), one being made (its `owner`
appears only once locked), and one from before `owner` existed.
"""
from __future__ import annotations

import fcntl
import os
import shutil
import socket
import stat
import tempfile

OWNER = "owner"
# Each live directory's locked owner file, held open until `remove` (closed by the kernel if the
# process dies first).
_held: dict[str, int] = {}


def make(prefix: str, parent: str | None = None) -> str:
    """A new directory `<parent>/<prefix>XXXXXXXX` (default parent: tempfile.gettempdir()), made
    after removing the stale ones of `prefix` there; this process owns it until `remove`."""
    parent = tempfile.gettempdir() if parent is None else parent
    remove_stale(prefix, parent)
    path = tempfile.mkdtemp(prefix=prefix, dir=parent)
    pending = os.path.join(path, f".{OWNER}.pending")
    fd = os.open(pending, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # a filesystem without locks: no owner file, so never taken for stale
        os.close(fd)
        return path
    os.write(fd, f"PID {os.getpid()} on host {socket.gethostname()}\n".encode())
    os.rename(pending, os.path.join(path, OWNER))  # appears locked
    _held[path] = fd
    return path


def remove(path: str) -> None:
    """Removes a directory `make` made, and lets go of its lock."""
    shutil.rmtree(path, ignore_errors=True)
    fd = _held.pop(path, None)
    if fd is not None:
        os.close(fd)


def remove_stale(prefix: str, parent: str) -> None:
    """Removes the directories of `prefix` in `parent` whose owner is gone (module docstring)."""
    try:
        names = [name for name in os.listdir(parent) if name.startswith(prefix)]
    except OSError:
        return
    for name in names:
        path = os.path.join(parent, name)
        if _owner_gone(path):
            shutil.rmtree(path, ignore_errors=True)


def _owner_gone(path: str) -> bool:
    """Whether `path` is this user's directory of `make`'s whose owner on this host has died."""
    try:
        info = os.lstat(path)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
            return False
        directory = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        owner = os.open(OWNER, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=directory)
    except OSError:
        return False
    finally:
        os.close(directory)
    try:
        if not stat.S_ISREG(os.fstat(owner).st_mode):
            return False
        host = os.read(owner, 4096).decode(errors="replace").strip().rpartition(" on host ")[2]
        if host != socket.gethostname():
            return False
        fcntl.flock(owner, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:  # held by its owner (this process too), or a lock that cannot be tried
        return False
    finally:
        os.close(owner)
