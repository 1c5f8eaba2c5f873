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

import tower_train
from helpers import read_until, seconds_between
from test_cli_errors import ROOT, run_cli
from test_modes import kill_running, start_workers
from test_resume import SMALL, SMALL_OPTIONS, start


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
            from tower_train.training.run_record import TrainDirLock
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

    from tower_train.training.run_record import TrainDirLock
    TrainDirLock(str(train_dir)).release()  # free again


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
    assert tower_train.fit(train_dir=str(train_dir), max_steps=1, **SMALL_OPTIONS).step == 1
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


MLP_MODEL = '''
import keras
from tower_train.models import TowerModel, register


@register("mlp")
class Mlp(TowerModel):
    def __init__(self, num_classes, **kwargs):
        super().__init__(num_classes, **kwargs)
        self.hidden = keras.layers.Dense(8, activation="relu")
        self.logits = keras.layers.Dense(num_classes)

    def call(self, features, training=False):
        return self.logits(self.hidden(features))
'''

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
    # The signal comes at a known point of start-up, while the --data_module is imported (after
    # TensorFlow loaded, before the train_dir is touched). The child gets SIGINT's default action
    # whatever this test inherited: under a test runner started as a background job of a
    # non-interactive shell SIGINT is ignored, and Python keeps an ignored SIGINT ignored.
    code = tmp_path / "code"
    code.mkdir()
    (code / "slow_start.py").write_text(
        # One write, newline included: print's separate write of the newline could be cut off by the
        # signal, leaving the CLI's line glued to this one.
        "import os, time\nos.write(2, b'slow_start: imported\\n')\ntime.sleep(120)\n")
    args = [f"--train_dir={tmp_path / 'run'}", "--max_steps=1", f"--data_module={code / 'slow_start.py'}",
            *SMALL]
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    process = subprocess.Popen([sys.executable, "-m", "tower_train", *args], cwd=ROOT, env=env,
                               stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        seen = read_until(process, "slow_start: imported\n", timeout=300)
        process.send_signal(signal.SIGINT)
        stderr = seen + process.communicate(timeout=60)[1]
    finally:
        kill_running([process])
    assert process.returncode == 130, stderr
    assert stderr.strip().splitlines()[-1] == ("tower_train: interrupted by SIGINT outside training; the "
                                               "checkpoints already written are intact"), stderr
    assert "Traceback" not in stderr
    assert not (tmp_path / "run").exists()


SLOW_EVALUATION = '''
import time

import numpy as np
import tensorflow as tf

import tower_train


def _wait_when_evaluating(features, seeds, training):
    if training:
        return tf.cast(features, tf.float32)
    waited = tf.py_function(lambda: time.sleep(12) or 0, [], tf.int32)
    with tf.control_dependencies([waited]):
        return tf.cast(features, tf.float32)


@tower_train.data.source.register("slow_evaluation")
def slow_evaluation():
    rng = np.random.default_rng(0)
    return tower_train.ArraySource(
        rng.normal(size=(64, 4)).astype(np.float32), rng.integers(0, 3, 64),
        eval_features=rng.normal(size=(8, 4)).astype(np.float32), eval_labels=rng.integers(0, 3, 8),
        preprocess=_wait_when_evaluating, num_classes=3, name="slow_evaluation")
'''


@pytest.mark.cpu_only  # multi_worker without a GPU: one CPU replica per worker
def test_the_watchdog_does_not_time_a_local_evaluation_longer_than_its_timeout(tmp_path):
    """12 s of held-out evaluation at the end, --collective_timeout=10: both workers finish."""
    (tmp_path / "slow_data.py").write_text(SLOW_EVALUATION)
    (tmp_path / "mlp.py").write_text(MLP_MODEL)
    workers = start_workers(tmp_path / "mw", 2, [
        "--data_module=slow_data", "--dataset=slow_evaluation", "--model_module=mlp", "--model=mlp",
        "--batch_size=8", "--max_steps=2", "--collective_timeout=10"], cwd=tmp_path)
    try:
        logs = [w.communicate(timeout=240)[1] for w in workers]
    finally:
        kill_running(workers)
    for worker, log in zip(workers, logs):
        assert worker.returncode == 0, log[-2000:]
        assert "done: step 2" in log and "no progress" not in log
        assert seconds_between(log, "step 2, loss", "done: step 2") >= 12  # the evaluation did wait


def test_a_checkpoint_with_non_finite_values_is_passed_over_on_resume(tmp_path):
    import numpy as np
    import tensorflow as tf

    train_dir = tmp_path / "run"
    assert tower_train.fit(train_dir=str(train_dir), max_steps=2, **SMALL_OPTIONS).step == 2
    # Rewrite ckpt-2 whole, as a writer that kept a NaN weight would have.
    prefix = str(train_dir / "ckpt-2")
    reader = tf.train.load_checkpoint(prefix)
    names = sorted(reader.get_variable_to_shape_map())
    values = [reader.get_tensor(name) for name in names]
    poisoned = next(i for i, n in enumerate(names) if n.startswith("model/") and values[i].dtype == np.float32)
    values[poisoned] = np.full_like(values[poisoned], np.nan)
    tf.raw_ops.SaveV2(prefix=prefix, tensor_names=names, shape_and_slices=[""] * len(names),
                      tensors=[tf.constant(v) for v in values])

    resumed = run_cli(f"--train_dir={train_dir}", "--max_steps=3", *SMALL)

    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert (f"checkpoint {prefix} holds non-finite values; resuming from the older "
            f"{train_dir}/ckpt-1") in resumed.stderr
    assert f"resumed from {train_dir}/ckpt-1 at step 1" in resumed.stderr
