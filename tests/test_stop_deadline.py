"""tower_train.training.stop_deadline: the message naming what a killed run keeps (in this process), and
the deadline process itself, run as StopSignals.listen runs it (its own process is the point),
against a stand-in run (`sleep`): a boundary or a signal that is no stop kills nothing, a stop
past the grace period SIGKILLs the run, and a Ctrl-C to the deadline process is not its own.
test_reliability.py runs the whole thing under a real training run."""
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tower_train.training import stop_deadline

WAIT = 60  # seconds any child is given before the test fails
STOPS = ",".join(str(int(n)) for n in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP))  # a run's, as listen passes them


@pytest.fixture
def stand_in_run():
    run = subprocess.Popen(["sleep", "300"])
    yield run
    if run.poll() is None:
        run.kill()
    run.wait(timeout=WAIT)


def start_deadline(run: subprocess.Popen, grace: float, train_dir) -> tuple[subprocess.Popen, int]:
    """The deadline process for `run`, and the write end of its stdin (the run's wake-up fd)."""
    read_end, write_end = os.pipe()
    process = subprocess.Popen(
        [sys.executable, "-I", stop_deadline.__file__, str(run.pid), str(grace), str(train_dir),
         "tower_train", STOPS], stdin=read_end, stderr=subprocess.PIPE, text=True)
    os.close(read_end)
    return process, write_end


def finish(process: subprocess.Popen, write_end: int) -> tuple[int, str]:
    """Closes the run's end (as a run that exits does) and waits; returns (status, stderr)."""
    os.close(write_end)
    try:
        _, stderr = process.communicate(timeout=WAIT)
    except subprocess.TimeoutExpired:
        process.kill()
        pytest.fail(f"the deadline process did not exit within {WAIT} s; killed it")
    return process.returncode, stderr


def test_what_is_kept_names_the_checkpoint_the_index_points_at(tmp_path):
    assert stop_deadline.what_is_kept(str(tmp_path)) == "no checkpoint had been written yet"
    (tmp_path / "checkpoint").write_text('model_checkpoint_path: "ckpt-7"\n'
                                         'all_model_checkpoint_paths: "ckpt-5"\n'
                                         'all_model_checkpoint_paths: "ckpt-7"\n')
    assert stop_deadline.what_is_kept(str(tmp_path)) == \
        f"the last checkpoint, {tmp_path}/ckpt-7, is intact"
    (tmp_path / "checkpoint").write_text("damaged")
    assert stop_deadline.what_is_kept(str(tmp_path)) == "no checkpoint had been written yet"


def test_a_boundary_after_the_stop_ends_the_deadline_and_the_run_goes_on(tmp_path, stand_in_run):
    process, write_end = start_deadline(stand_in_run, 0.5, tmp_path)
    os.write(write_end, bytes([signal.SIGTERM, stop_deadline.BOUNDARY]))
    # It exits on the boundary itself, its stdin still open (the run saves on after it).
    process.wait(timeout=WAIT)
    status, stderr = finish(process, write_end)
    assert (status, stderr) == (0, "")
    assert stand_in_run.poll() is None


def test_signals_that_are_no_stop_start_no_clock(tmp_path, stand_in_run):
    process, write_end = start_deadline(stand_in_run, 0.2, tmp_path)
    os.write(write_end, bytes([signal.SIGUSR1, signal.SIGCHLD, signal.SIGALRM]))
    status, stderr = finish(process, write_end)  # end of file: the run exited, nothing to do
    assert (status, stderr) == (0, "")
    assert stand_in_run.poll() is None


def test_a_stop_with_no_boundary_within_the_grace_period_kills_the_run_naming_its_checkpoint(
        tmp_path, stand_in_run):
    (tmp_path / "checkpoint").write_text('model_checkpoint_path: "ckpt-3"\n')
    process, write_end = start_deadline(stand_in_run, 0.2, tmp_path)
    os.write(write_end, bytes([signal.SIGHUP]))
    assert stand_in_run.wait(timeout=WAIT) == -signal.SIGKILL
    status, stderr = finish(process, write_end)
    assert status == 1
    assert stderr == ("tower_train: no update boundary within 0.2 s of SIGHUP (--stop_grace_period): "
                      f"exited without saving; the last checkpoint, {tmp_path}/ckpt-3, is intact\n")


def test_the_deadline_process_ignores_a_ctrl_c_to_the_process_group(tmp_path, stand_in_run):
    process, write_end = start_deadline(stand_in_run, 30, tmp_path)
    os.write(write_end, bytes([signal.SIGINT]))  # the run got it, and writes it down
    # A signal that came before it set its handlers would end it: wait until the kernel lists
    # the three stops among the signals it ignores.
    stops = sum(1 << (number - 1) for number in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP))
    for _ in range(WAIT * 10):
        with open(f"/proc/{process.pid}/status") as f:
            ignored = int(re.search(r"^SigIgn:\s*([0-9a-f]+)$", f.read(), re.M).group(1), 16)
        if ignored & stops == stops:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the deadline process ignored no stop signal within {WAIT} s")
    process.send_signal(signal.SIGINT)
    process.send_signal(signal.SIGTERM)
    os.write(write_end, bytes([stop_deadline.BOUNDARY]))
    status, stderr = finish(process, write_end)
    assert (status, stderr) == (0, "")
    assert stand_in_run.poll() is None
