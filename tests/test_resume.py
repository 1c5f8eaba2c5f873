"""Stops, resumes and bad checkpoints: a real signal to a real process, bit-exact resume, fallback."""
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from helpers import read_until
from test_cli_errors import ROOT, run_cli
from test_modes import kill_running, start_workers
from test_train import checkpoint_values

EXACT = ["--num_gpus=2", "--accum=3", "--batch_size=8", "--optimizer=momentum", "--augment",
         "--deterministic", "--log_every=1", "--checkpoint_every=100"]


def start(*args):
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    return subprocess.Popen([sys.executable, "-m", "tower_train", *args], cwd=ROOT, env=env,
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)


def signal_after(process, line, number):
    """Sends signal `number` once `line` is on the process's stderr; returns all of its stderr."""
    try:
        seen = read_until(process, line, timeout=300)
        process.send_signal(number)
        return seen + process.communicate(timeout=120)[1]
    finally:
        kill_running([process])


def saved_files(train_dir) -> dict[str, bytes]:
    """Every file of a train_dir but the lock, which names whichever run holds it now."""
    return {p.name: p.read_bytes() for p in train_dir.iterdir() if p.name != "lock"}


def assert_same_weights(dir_a, dir_b):
    a, b = checkpoint_values(str(dir_a)), checkpoint_values(str(dir_b))
    assert a.keys() == b.keys()
    for name in a:
        if name.startswith(("model/", "optimizer/", "step/", "examples_seen/", "moving_average/")):
            np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def test_sigterm_stops_at_an_update_boundary_and_resumes_bit_exactly(tmp_path):
    stopped = start(*EXACT, "--max_steps=8", f"--train_dir={tmp_path / 'stopped'}")
    log = signal_after(stopped, "step 3, loss", signal.SIGTERM)
    assert stopped.returncode == 128 + signal.SIGTERM
    last = log.strip().splitlines()[-1]
    assert last.startswith("tower_train: stopped by SIGTERM after update ") and "Traceback" not in log
    step = int(last.split("after update ")[1].split(";")[0])
    assert 3 <= step < 8 and f"saved {tmp_path / 'stopped'}/ckpt-{step}" in last

    resumed = run_cli(*EXACT, "--max_steps=8", f"--train_dir={tmp_path / 'stopped'}")
    assert resumed.returncode == 0 and f"at step {step}" in resumed.stderr
    straight = run_cli(*EXACT, "--max_steps=8", f"--train_dir={tmp_path / 'straight'}")
    assert straight.returncode == 0
    assert_same_weights(tmp_path / "stopped", tmp_path / "straight")


SMALL = ["--num_gpus=2", "--batch_size=8", "--checkpoint_every=1", "--log_every=1"]


def test_a_corrupt_latest_checkpoint_falls_back_to_the_previous_with_a_warning(tmp_path):
    assert run_cli(*SMALL, "--max_steps=3", f"--train_dir={tmp_path}").returncode == 0
    data = tmp_path / "ckpt-3.data-00000-of-00001"
    data.write_bytes(data.read_bytes()[:100])
    result = run_cli(*SMALL, "--max_steps=4", f"--train_dir={tmp_path}")
    assert result.returncode == 0, result.stderr
    assert f"checkpoint {tmp_path}/ckpt-3 is unreadable" in result.stderr
    assert f"resuming from the older {tmp_path}/ckpt-2" in result.stderr
    assert f"resumed from {tmp_path}/ckpt-2 at step 2" in result.stderr and "done: step 4" in result.stderr


def test_no_readable_checkpoint_is_one_line_and_touches_nothing(tmp_path):
    assert run_cli(*SMALL, "--max_steps=1", f"--train_dir={tmp_path}").returncode == 0
    data = tmp_path / "ckpt-1.data-00000-of-00001"
    data.write_bytes(b"garbage")
    before = saved_files(tmp_path)
    result = run_cli(*SMALL, "--max_steps=2", f"--train_dir={tmp_path}")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith(f"tower_train: error: --train_dir={tmp_path}: no readable checkpoint: "
                                f"checkpoint {tmp_path}/ckpt-1 is unreadable")
    assert saved_files(tmp_path) == before


def test_a_train_dir_of_another_run_is_refused_saying_what_differs(tmp_path):
    assert run_cli(*SMALL, "--max_steps=1", f"--train_dir={tmp_path}").returncode == 0
    before = saved_files(tmp_path)
    result = run_cli("--num_gpus=2", "--batch_size=16", "--seed=3", "--max_steps=2",
                     f"--train_dir={tmp_path}")
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert "holds another run: seed 0 there, 3 here; global_batch 16 there, 32 here" in last
    assert saved_files(tmp_path) == before
    # The same G factored differently is the same run.
    same_g = run_cli("--num_gpus=1", "--batch_size=16", "--max_steps=2", f"--train_dir={tmp_path}")
    assert same_g.returncode == 0 and "at step 1" in same_g.stderr


@pytest.mark.cpu_only
def test_sigterm_to_one_worker_stops_every_worker_at_the_same_step(tmp_path):
    workers = start_workers(tmp_path / "mw", 2, ["--batch_size=16", "--max_steps=100000",
                                                 "--log_every=1", "--collective_timeout=60"])
    try:
        seen = read_until(workers[1], "step 3,", timeout=240)
        workers[1].send_signal(signal.SIGTERM)
        outputs = [w.communicate(timeout=120)[1] for w in workers]
    finally:
        kill_running(workers)
    outputs[1] = seen + outputs[1]
    lasts = [out.strip().splitlines()[-1] for out in outputs]
    assert [w.returncode for w in workers] == [128 + signal.SIGTERM] * 2, lasts
    assert lasts[1].startswith("tower_train: stopped by SIGTERM after update ")
    assert lasts[0].startswith("tower_train: stopped by a peer's signal after update ")
    steps = {last.split("after update ")[1].split(";")[0] for last in lasts}
    assert len(steps) == 1
    assert os.path.exists(tmp_path / "mw" / f"ckpt-{steps.pop()}.index")
