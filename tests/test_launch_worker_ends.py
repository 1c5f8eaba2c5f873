"""How `python -m tower_train.launch` says the end of a worker that ended first (killed,
suspended, stopped by a signal of its own, exited 0 early, still starting while the other waited),
each with two real workers. Apart from test_launch.py so that pytest-xdist's loadfile can give
these runs and test_launch.py's to two workers."""
import contextlib
import os
import re
import signal
import subprocess
import time

import pytest

from tower_train.workers.worker_exit import how_it_ended
from helpers import read_until
from test_launch import finish, start_launcher, worker_pid


def two_workers_training(tmp_path, collective_timeout: int) -> tuple[subprocess.Popen, str]:
    """A launcher of two workers training without end into `tmp_path`, once its output has
    reached step 3: (the launcher, its output so far)."""
    launcher = start_launcher("--workers=2", "--", "--num_gpus=1", "--batch_size=16",
                              "--max_steps=100000", "--log_every=1", f"--collective_timeout={collective_timeout}",
                              f"--train_dir={tmp_path}")
    return launcher, read_until(launcher, "step 3,", timeout=240)


@pytest.mark.cpu_only
def test_a_killed_worker_ends_the_launcher_within_the_collective_timeout(tmp_path):
    launcher, seen = two_workers_training(tmp_path, collective_timeout=10)
    os.kill(worker_pid(seen, 1), signal.SIGKILL)
    killed = time.monotonic()
    output = seen + finish(launcher, timeout=120)
    assert time.monotonic() - killed < 10 + 30  # the bound: --collective_timeout + 30 s
    assert launcher.returncode == 128 + signal.SIGKILL, output
    assert "[worker 0/2] tower_train: " in output and "not reachable" in output, output  # its own lost-peer line
    assert output.strip().splitlines()[-1].startswith(
        "tower_train.launch: worker 1/2 ended first: killed by SIGKILL (exit status 137)"), output


def test_a_workers_end_is_said_as_it_came():
    assert how_it_ended(0, finished=True) == "finished (exit status 0)"
    assert how_it_ended(0, finished=False) == "exited with status 0 before finishing (no `done:` line)"
    assert how_it_ended(1, False) == "failed (exit status 1)"
    assert how_it_ended(2, False) == "refused its input (exit status 2, its line above)"
    assert how_it_ended(143, False) == "stopped on a stop signal (exit status 143)"  # saved, its line says
    assert how_it_ended(129, False) == "stopped on a stop signal (exit status 129)"
    assert how_it_ended(-signal.SIGTERM, False) == "killed by SIGTERM (exit status 143)"
    assert how_it_ended(-signal.SIGKILL, False, signal.SIGSTOP) == (
        "suspended by SIGSTOP, then killed by SIGKILL (exit status 137)")


@pytest.mark.cpu_only
def test_a_worker_leaving_early_with_status_0_is_named_not_the_peer_it_left(tmp_path):
    code = tmp_path / "leaves_early.py"
    code.write_text("import json, os\n"
                    "if json.loads(os.environ['TF_CONFIG'])['task']['index'] == 1:\n"
                    "    os._exit(0)  # as if its work were done, before its peer's strategy is up\n")
    launcher = start_launcher("--workers=2", "--", "--num_gpus=1", "--collective_timeout=10",
                              f"--model_module={code}", f"--train_dir={tmp_path / 'run'}")
    output = finish(launcher, timeout=120)
    assert launcher.returncode != 0, output
    assert output.strip().splitlines()[-1].startswith(
        "tower_train.launch: worker 1/2 ended first: exited with status 0 before finishing (no `done:` "
        "line); exit statuses: "), output


@pytest.mark.cpu_only
def test_a_worker_still_starting_is_named_as_late_not_the_peer_that_waited_on_it(tmp_path):
    """Worker 1 imports its --model_module for longer than worker 0 waits on it: worker 0's
    watchdog ends it, naming worker 1 as not started yet; the launcher names worker 1, alive,
    as still starting, and suggests a longer --collective_timeout."""
    code = tmp_path / "slow_to_import.py"
    code.write_text("import json, os, time\n"
                    "if json.loads(os.environ['TF_CONFIG'])['task']['index'] == 1:\n"
                    "    time.sleep(600)  # the launcher kills it first\n")
    launcher = start_launcher("--workers=2", "--", "--num_gpus=1", "--collective_timeout=10",
                              f"--model_module={code}", f"--train_dir={tmp_path / 'run'}")
    output = finish(launcher, timeout=240)
    late = re.search(r"worker 1/2 \(pid \d+\) on (\S+)", output)[1]
    assert launcher.returncode == 128 + signal.SIGKILL, output
    assert (f"[worker 0/2] tower_train: no progress for 10 s while waiting on the peers "
            f"(--collective_timeout): peer(s) {late} (worker 1/2) not reachable: not started yet "
            "(still starting, or never started); a longer --collective_timeout") in output, output
    assert output.strip().splitlines()[-1].startswith(
        "tower_train.launch: worker 1/2 was still starting (alive, not yet listening on its port) while "
        "the others waited on it; worker 0/2 ended first: killed by SIGKILL (exit status 137); a longer "
        "--collective_timeout (now 10 s) gives a slow start"), output


@pytest.mark.cpu_only
def test_a_suspended_worker_is_named_as_the_cause_and_its_watchdog_blames_no_peer(tmp_path):
    launcher, seen = two_workers_training(tmp_path, collective_timeout=10)
    suspended = worker_pid(seen, 1)
    os.kill(suspended, signal.SIGSTOP)
    try:
        output = seen + finish(launcher, timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):  # if the launcher was killed, its SIGHUP ends it
            os.kill(suspended, signal.SIGCONT)
    assert "tower_train.launch: worker 1/2 is suspended by SIGSTOP: the others wait on it" in output, output
    assert re.match(r"tower_train.launch: worker 1/2 (was suspended by SIGSTOP while the others waited on "
                    r"it; worker 0/2 ended first: |ended first: suspended by SIGSTOP, then )",
                    output.strip().splitlines()[-1]), output
    assert not [line for line in output.splitlines() if line.startswith("[worker 1/2]")
                and "not reachable" in line], output  # the peer it stalled is not blamed


@pytest.mark.cpu_only
def test_a_stop_signal_to_one_worker_is_a_stop_of_all_not_a_failure(tmp_path):
    launcher, seen = two_workers_training(tmp_path, collective_timeout=60)
    os.kill(worker_pid(seen, 1), signal.SIGTERM)
    output = seen + finish(launcher, timeout=120)
    assert launcher.returncode == 128 + signal.SIGTERM, output
    assert output.strip().splitlines()[-1] == (
        "tower_train.launch: all 2 workers stopped on a stop signal (their lines say which, and after "
        "which update); exit statuses: 143 (SIGTERM), 143 (SIGTERM)"), output
