"""The temporary train_dir of `tower_train.keras.fit` (tower_train/keras/temp_dir.py): a SIGKILLed
owner's directory is removed at the next start; a live owner's, another user's or host's, a link
and anything not provably made by it are left alone."""
import os
import signal
import socket
import subprocess
import sys
import tempfile

import keras
import numpy as np

import tower_train.keras
from tower_train.keras import temp_dir

PREFIX = "tower_train_keras_"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Makes a directory in argv[1], says its path, then waits for its stdin to close.
OWNER = """
import sys
from tower_train.keras import temp_dir
print(temp_dir.make("tower_train_keras_", sys.argv[1]), flush=True)
sys.stdin.read()
"""


def planted(parent, name: str, owner: str | None) -> str:
    """A directory `name` in `parent` with an `owner` file of `owner`'s text, unlocked: what a
    dead owner leaves."""
    path = os.path.join(parent, name)
    os.mkdir(path)
    if owner is not None:
        with open(os.path.join(path, temp_dir.OWNER), "w") as f:
            f.write(owner)
    return path


def test_a_sigkilled_owners_directory_is_removed_at_the_next_start_and_a_live_ones_kept(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", OWNER, str(tmp_path)], cwd=ROOT,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": ROOT})
    try:
        line = child.stdout.readline()  # "" if the child died first
        assert line, f"the child ended first (exit {child.wait(timeout=60)})"
        theirs = line.strip()
        assert os.path.isdir(theirs) and os.path.basename(theirs).startswith(PREFIX)
        with open(os.path.join(theirs, temp_dir.OWNER)) as f:
            assert f.read() == f"PID {child.pid} on host {socket.gethostname()}\n"

        mine = temp_dir.make(PREFIX, str(tmp_path))
        assert os.path.isdir(theirs)  # its owner is alive
        temp_dir.make(PREFIX, str(tmp_path))
        assert os.path.isdir(mine)  # so is this process, the owner of the first

        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=60) == -signal.SIGKILL
        assert os.path.isdir(theirs)  # nothing removes it until the next start
        temp_dir.remove(mine)
        last = temp_dir.make(PREFIX, str(tmp_path))
        assert not os.path.exists(theirs)
        assert len(os.listdir(tmp_path)) == 2 and os.path.isdir(last)
    finally:
        child.kill()
        child.wait(timeout=60)


def test_what_is_not_provably_a_dead_owners_directory_is_left_alone(tmp_path):
    here = f"PID 1 on host {socket.gethostname()}\n"
    dead = planted(tmp_path, PREFIX + "dead", here)
    kept = [planted(tmp_path, PREFIX + "from_before_owner_files", None),
            planted(tmp_path, PREFIX + "being_made", None),
            planted(tmp_path, PREFIX + "other_host", "PID 1 on host not-" + socket.gethostname()),
            planted(tmp_path, "another_prefix_dead", here)]
    # A link to a dead owner's directory is not followed: neither the link nor its target goes.
    target = planted(tmp_path, "target_of_a_link", here)
    os.symlink(target, tmp_path / (PREFIX + "link"))
    # An owner file that is a link is not read through.
    linked_owner = planted(tmp_path, PREFIX + "linked_owner", None)
    os.symlink(os.path.join(target, temp_dir.OWNER), os.path.join(linked_owner, "owner"))
    kept += [target, linked_owner]
    if os.geteuid() == 0:
        others = planted(tmp_path, PREFIX + "another_users", here)
        os.chown(others, 12345, 12345)
        kept.append(others)

    made = temp_dir.make(PREFIX, str(tmp_path))
    assert not os.path.exists(dead)
    assert all(os.path.isdir(path) for path in kept)
    assert os.path.islink(tmp_path / (PREFIX + "link"))
    temp_dir.remove(made)
    assert not os.path.exists(made)


def test_keras_fit_without_train_dir_removes_a_dead_runs_directory_and_its_own(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # as TMPDIR would
    dead = planted(tmp_path, PREFIX + "killed", f"PID 1 on host {socket.gethostname()}\n")
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, activation="softmax")])
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    rng = np.random.default_rng(0)
    tower_train.keras.fit(model, rng.normal(size=(8, 3)).astype(np.float32), rng.integers(0, 2, 8),
                          batch_size=4, verbose=0)
    assert not os.path.exists(dead)
    assert [name for name in os.listdir(tmp_path) if name.startswith(PREFIX)] == []
