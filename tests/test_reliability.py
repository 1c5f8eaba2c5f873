"""Faults on real processes: one run per train_dir, a full disk, non-finite weights from finite
gradients. Each drives the real CLI and checks that nothing already saved is lost."""
import hashlib
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from helpers import read_until
from test_cli_errors import ROOT, run_cli
from test_modes import kill_running
from test_resume import start

SMALL = ["--num_gpus=2", "--batch_size=8", "--log_every=1", "--checkpoint_every=1"]


def digests(directory) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.iterdir()) if p.name.startswith("ckpt-")}


def one_line(result, status: int) -> str:
    assert result.returncode == status, result.stderr[-2000:]
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("tower_train:")]
    assert len(errors) == 1, result.stderr[-2000:]
    return errors[0]


def test_a_second_run_in_a_train_dir_is_refused_naming_the_holder_until_it_dies(tmp_path):
    train_dir = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import time
            from tower_train.checkpoints import TrainDirLock
            TrainDirLock({str(train_dir)!r})
            print("held", flush=True)
            time.sleep(600)
        """)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        refused = run_cli(f"--train_dir={train_dir}", "--max_steps=1", *SMALL)
        line = one_line(refused, 2)
        assert f"another run is training there (PID {holder.pid} on host {socket.gethostname()})" in line
        assert sorted(p.name for p in train_dir.iterdir()) == ["lock"]
    finally:
        holder.send_signal(signal.SIGKILL)  # no clean-up runs: only the kernel can release the lock
        holder.wait(timeout=60)

    from tower_train.checkpoints import TrainDirLock
    TrainDirLock(str(train_dir)).release()  # free again


def test_eval_reads_a_train_dir_while_a_run_holds_it(tmp_path):
    train_dir = tmp_path / "run"
    trained = run_cli(f"--train_dir={train_dir}", "--max_steps=1", *SMALL)
    assert trained.returncode == 0, trained.stderr[-2000:]
    from tower_train.checkpoints import TrainDirLock
    with TrainDirLock(str(train_dir)):
        evaluated = subprocess.run([sys.executable, "-m", "tower_train.eval", f"--train_dir={train_dir}",
                                    "--num_gpus=2"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert evaluated.returncode == 0, evaluated.stderr[-2000:]
    assert "precision @ 1" in evaluated.stderr + evaluated.stdout


@pytest.fixture
def small_disk(tmp_path):
    """A real tmpfs of 32 MB (a checkpoint of the default model is 17 MB)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount = tmp_path / "disk"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", str(mount)], check=True)
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def fill(disk, leave_kb: int) -> None:
    stat = os.statvfs(disk)
    free_kb = stat.f_bavail * stat.f_frsize // 1024
    with open(disk / "filler", "wb") as f:
        f.write(b"\0" * ((free_kb - leave_kb) * 1024))


def test_a_full_disk_is_one_line_removes_the_partial_checkpoint_and_keeps_the_others(small_disk):
    """Not a byte left: the summaries warn once and training goes on; the checkpoint cannot."""
    train_dir = small_disk / "run"
    first = run_cli(f"--train_dir={train_dir}", "--max_steps=1", *SMALL)
    assert first.returncode == 0, first.stderr[-2000:]
    saved = digests(train_dir)
    assert "ckpt-1.index" in saved
    fill(small_disk, leave_kb=0)

    resumed = run_cli(f"--train_dir={train_dir}", "--max_steps=3", *SMALL)

    line = one_line(resumed, 1)
    assert resumed.stderr.count("TensorBoard summaries are off from here") == 1
    assert "step 2, loss" in resumed.stderr
    assert "cannot write checkpoint ckpt-2" in line and "No space left on device" in line
    assert f"the last checkpoint, {train_dir}/ckpt-1, is intact" in line
    assert digests(train_dir) == saved
    assert not list(train_dir.glob("*_temp*"))


LOUD_MODEL = '''
import keras
from tower_train.models import TowerModel, register


@register("loud")
class Loud(TowerModel):
    """Inputs amplified 10^4 times: a finite loss and gradient, but large ones."""

    def __init__(self, num_classes, **kwargs):
        super().__init__(num_classes, **kwargs)
        self.flatten = keras.layers.Flatten()
        self.logits = keras.layers.Dense(num_classes)

    def call(self, images, training=False):
        return self.logits(self.flatten(images) * 1e4)
'''


def test_weights_made_non_finite_by_a_finite_gradient_are_never_saved(tmp_path):
    (tmp_path / "loud.py").write_text(LOUD_MODEL)
    train_dir = tmp_path / "run"
    common = [f"--train_dir={train_dir}", "--model_module=loud", "--model=loud", "--optimizer=sgd", *SMALL]
    good = run_cli(*common, "--max_steps=1", "--learning_rate=1e-6", cwd=tmp_path)
    assert good.returncode == 0, good.stderr[-2000:]
    saved = digests(train_dir)

    result = run_cli(*common, "--max_steps=3", "--learning_rate=1e36", "--nonfinite=skip", cwd=tmp_path)

    line = one_line(result, 1)
    assert "update 2 had a finite loss" in line and "left non-finite values" in line
    assert f"the last good checkpoint is {train_dir}/ckpt-1" in line
    assert digests(train_dir) == saved


def test_a_stop_that_reaches_no_update_boundary_ends_the_run_unsaved_after_the_grace_period(tmp_path):
    """An update of 100,000 micro-steps: the boundary is minutes away."""
    train_dir = tmp_path / "run"
    process = start(f"--train_dir={train_dir}", "--accum=100000", "--max_steps=1",
                    "--stop_grace_period=3", *SMALL)
    try:
        seen = read_until(process, "micro-step", timeout=300)  # the long update's progress line
        process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        rest = process.communicate(timeout=120)[1]
        waited = time.monotonic() - signalled
    finally:
        kill_running([process])
    assert process.returncode == -signal.SIGKILL, seen + rest
    assert 3 <= waited < 20, waited
    errors = [line for line in rest.splitlines() if line.startswith("tower_train:")]
    assert errors == ["tower_train: no update boundary within 3 s of SIGTERM (--stop_grace_period): "
                      "exited without saving; no checkpoint had been written yet"], rest
    assert "Traceback" not in rest
    assert not list(train_dir.glob("ckpt-*"))


def test_sigint_during_start_up_is_one_line_and_writes_nothing(tmp_path):
    process = start(f"--train_dir={tmp_path / 'run'}", "--max_steps=1", *SMALL)
    try:
        time.sleep(1.5)  # Python is up and loading TensorFlow: seconds before training listens
        process.send_signal(signal.SIGINT)
        stderr = process.communicate(timeout=120)[1]
    finally:
        kill_running([process])
    assert process.returncode == 130, stderr
    assert stderr.strip().splitlines() == ["tower_train: interrupted by SIGINT outside training; the "
                                           "checkpoints already written are intact"]
    assert list(tmp_path.iterdir()) == []
