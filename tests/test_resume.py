"""Stops, resumes and bad checkpoints: a real signal to a real process, bit-exact resume, fallback,
a lost index or run record."""
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import tower_train
from helpers import read_until
from test_cli_errors import ROOT, run_cli
from test_modes import kill_running, start_workers
from test_train import checkpoint_values

# As the command's flags, and as options of tower_train.fit for the uninterrupted reference.
EXACT_OPTIONS = dict(num_gpus=2, accum=3, batch_size=8, optimizer="momentum", augment=True,
                     deterministic=True, log_every=1, checkpoint_every=100)
EXACT = [f"--{name}" if value is True else f"--{name}={value}" for name, value in EXACT_OPTIONS.items()]


def hangup_stops():
    """SIGHUP as a terminal leaves it, whatever this test run inherited (CI may run under nohup,
    which a run honours)."""
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def start(*args, preexec_fn=hangup_stops):
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    return subprocess.Popen([sys.executable, "-m", "tower_train", *args], cwd=ROOT, env=env,
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            preexec_fn=preexec_fn)


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
    # The uninterrupted run in this process: a second command's start-up would add nothing to it.
    assert tower_train.fit(train_dir=str(tmp_path / "straight"), max_steps=8, **EXACT_OPTIONS).step == 8
    assert_same_weights(tmp_path / "stopped", tmp_path / "straight")


SMALL_OPTIONS = dict(num_gpus=2, batch_size=8, checkpoint_every=1, log_every=1)
SMALL = [f"--{name}={value}" for name, value in SMALL_OPTIONS.items()]


def test_no_readable_checkpoint_is_one_line_and_touches_nothing(tmp_path):
    assert tower_train.fit(train_dir=str(tmp_path), max_steps=1, **SMALL_OPTIONS).step == 1
    data = tmp_path / "ckpt-1.data-00000-of-00001"
    data.write_bytes(b"garbage")
    before = saved_files(tmp_path)
    result = run_cli(*SMALL, "--max_steps=2", f"--train_dir={tmp_path}")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith(f"tower_train: error: --train_dir={tmp_path}: no readable checkpoint: "
                                f"checkpoint {tmp_path}/ckpt-1 is unreadable")
    assert saved_files(tmp_path) == before


def test_sighup_stops_at_an_update_boundary_as_sigterm_does(tmp_path):
    """A closed terminal or ssh session: saved at the boundary, exit 128 + 1."""
    stopped = start(*SMALL, "--max_steps=100000", f"--train_dir={tmp_path}")
    log = signal_after(stopped, "step 2, loss", signal.SIGHUP)
    assert stopped.returncode == 128 + signal.SIGHUP, log[-2000:]
    last = log.strip().splitlines()[-1]
    assert last.startswith("tower_train: stopped by SIGHUP after update ") and "Traceback" not in log
    step = int(last.split("after update ")[1].split(";")[0])
    assert f"saved {tmp_path}/ckpt-{step}" in last and (tmp_path / f"ckpt-{step}.index").exists()


def test_a_run_started_under_nohup_trains_on_through_sighup_and_stops_on_sigterm(tmp_path):
    """SIGHUP ignored at the start (nohup) stays ignored; SIGTERM still stops the run, saved."""
    nohup = start(*SMALL, "--max_steps=100000", f"--train_dir={tmp_path}",
                  preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    try:
        seen = read_until(nohup, "step 2, loss", timeout=300)
        nohup.send_signal(signal.SIGHUP)
        seen += read_until(nohup, "step 5, loss", timeout=300)  # a stop would have come at 2 or 3
        nohup.send_signal(signal.SIGTERM)
        log = seen + nohup.communicate(timeout=120)[1]
    finally:
        kill_running([nohup])
    assert nohup.returncode == 128 + signal.SIGTERM, log[-2000:]
    last = log.strip().splitlines()[-1]
    assert last.startswith("tower_train: stopped by SIGTERM after update ") and "Traceback" not in log
    step = int(last.split("after update ")[1].split(";")[0])
    assert step >= 5 and (tmp_path / f"ckpt-{step}.index").exists()


def test_a_second_signal_during_the_save_ends_the_run_at_once_and_silently(tmp_path):
    """After the boundary the deadline process has exited: the second signal must not be written
    into its pipe (once a BrokenPipeError report). No TensorFlow: StopSignals alone."""
    script = textwrap.dedent(f"""
        import os, signal, time
        from tower_train.training.stop_signals import StopSignals
        stop = StopSignals()
        stop.listen(30, {str(tmp_path)!r})
        os.kill(os.getpid(), signal.SIGTERM)
        while stop.received() is None:
            time.sleep(0.01)
        stop.at_boundary()  # the run saves from here on
        stop._deadline.wait(timeout=60)  # the deadline process has ended
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(60)
    """)
    ended = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True,
                           timeout=120)
    assert ended.returncode == -signal.SIGTERM and ended.stderr == "", ended.stderr


def digests(directory) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.iterdir()) if p.name.startswith("ckpt-")}


@pytest.fixture(scope="module")
def four_checkpoints(tmp_path_factory):
    """A train_dir with ckpt-1..4 and its run record, for each case to copy, written by
    tower_train.fit in this process: the commands take it as one of their own."""
    train_dir = tmp_path_factory.mktemp("trained") / "run"
    assert tower_train.fit(train_dir=str(train_dir), max_steps=4, **SMALL_OPTIONS).step == 4
    return train_dir


def test_a_corrupt_latest_checkpoint_falls_back_to_the_previous_with_a_warning(four_checkpoints, tmp_path):
    train_dir = tmp_path / "run"
    shutil.copytree(four_checkpoints, train_dir)
    data = train_dir / "ckpt-4.data-00000-of-00001"
    data.write_bytes(data.read_bytes()[:100])
    damaged = {name: digest for name, digest in digests(train_dir).items() if name.startswith("ckpt-4.")}
    result = run_cli(*SMALL, "--max_steps=5", f"--train_dir={train_dir}")
    assert result.returncode == 0, result.stderr
    assert f"checkpoint {train_dir}/ckpt-4 is unreadable" in result.stderr
    assert f"resuming from the older {train_dir}/ckpt-3" in result.stderr
    assert f"resumed from {train_dir}/ckpt-3 at step 3" in result.stderr and "done: step 5" in result.stderr
    # The run wrote its own ckpt-4 after moving the damaged one aside, byte for byte.
    assert f"moved the files of the passed-over checkpoint ckpt-4 to {train_dir}/passed_over/ckpt-4" \
        in result.stderr
    assert digests(train_dir / "passed_over" / "ckpt-4") == damaged


@pytest.mark.parametrize("index", ["deleted", "emptied", "garbled"])
def test_a_lost_index_resumes_from_the_newest_checkpoint_and_writes_over_none(four_checkpoints,
                                                                             tmp_path, index):
    train_dir = tmp_path / "run"
    shutil.copytree(four_checkpoints, train_dir)
    if index == "deleted":
        (train_dir / "checkpoint").unlink()
    else:
        (train_dir / "checkpoint").write_bytes(b"" if index == "emptied" else b"\x89garbled {{ \x00")
    before = digests(train_dir)
    assert sorted({name.split(".")[0] for name in before}) == [f"ckpt-{n}" for n in range(1, 5)]

    resumed = run_cli(*SMALL, "--max_steps=5", f"--train_dir={train_dir}")

    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"resumed from {train_dir}/ckpt-4 at step 4" in resumed.stderr
    assert "done: step 5" in resumed.stderr
    assert "Traceback" not in resumed.stderr and "Checkpoint ignored" not in resumed.stderr
    after = digests(train_dir)
    assert {name: after.get(name) for name in before} == before
    assert "ckpt-5.index" in after


def test_a_lost_run_record_is_stood_in_for_by_the_checkpoints_copy(four_checkpoints, tmp_path):
    train_dir = tmp_path / "run"
    shutil.copytree(four_checkpoints, train_dir)
    (train_dir / "tower_train_run.json").unlink()
    before = saved_files(train_dir)

    other = run_cli(*SMALL, "--max_steps=5", "--seed=3", f"--train_dir={train_dir}")

    assert other.returncode == 2, other.stderr[-2000:]
    last = other.stderr.strip().splitlines()[-1]
    assert last.startswith(f"tower_train: error: --train_dir={train_dir} holds another run (says the "
                           f"copy of tower_train_run.json in {train_dir}/ckpt-4, as the file itself is "
                           "missing): seed 0 there, 3 here ("), last
    assert "Traceback" not in other.stderr and saved_files(train_dir) == before


def test_a_checkpoint_of_another_precision_is_refused_as_such_not_as_unreadable(four_checkpoints,
                                                                               tmp_path):
    """fp16 adds a loss scale that the checkpoint lacks: once reported as `ckpt-4 is unreadable`."""
    train_dir = tmp_path / "run"
    shutil.copytree(four_checkpoints, train_dir)
    before = saved_files(train_dir)

    fp16 = run_cli(*SMALL, "--max_steps=5", "--precision=fp16", f"--train_dir={train_dir}")

    assert fp16.returncode == 2, fp16.stderr[-2000:]
    assert fp16.stderr.strip().splitlines()[-1] == (
        f"tower_train: error: --train_dir={train_dir}: checkpoint {train_dir}/ckpt-4 reads back whole "
        "but was written by another model, precision or configuration: it holds no loss scale, so it "
        "was written without --precision=fp16, and this run has --precision=fp16; it is left as it "
        f"is: resume with the flags and model code that wrote it, or add --train_dir={train_dir}_2")
    assert "Traceback" not in fp16.stderr and saved_files(train_dir) == before


def test_a_train_dir_of_another_run_is_refused_saying_what_differs(four_checkpoints, tmp_path):
    train_dir = tmp_path / "run"
    shutil.copytree(four_checkpoints, train_dir)
    before = saved_files(train_dir)
    result = run_cli("--num_gpus=2", "--batch_size=16", "--seed=3", "--max_steps=5",
                     f"--train_dir={train_dir}")
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert "holds another run: seed 0 there, 3 here; global_batch 16 there, 32 here" in last
    assert saved_files(train_dir) == before
    # The same G factored differently is the same run.
    same_g = run_cli("--num_gpus=1", "--batch_size=16", "--max_steps=5", f"--train_dir={train_dir}")
    assert same_g.returncode == 0 and "at step 4" in same_g.stderr


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
