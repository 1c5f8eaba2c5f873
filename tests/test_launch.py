"""`python -m tower_train.launch`: N multi_worker workers on this machine in one command; and an srun
step's two tasks, simulated on this machine, against it."""
import codecs
import os
import re
import selectors
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

import tower_train
from tower_train.launch import gpus_of_worker
from tower_train.training.run_record import TrainDirLock
from helpers import read_until
from test_cli_errors import ROOT
from test_modes import TOWER_LAYOUT
from test_train import checkpoint_values

# The layout, with SGD at a rate that moves the weights far enough to tell layouts apart
# (test_modes.py's: two workers there too, against tower mode).
LAYOUT = ["--num_gpus=1", *(f"--{name}={value}" for name, value in TOWER_LAYOUT.items())]


def start_launcher(*args):
    return subprocess.Popen([sys.executable, "-m", "tower_train.launch", *args], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={k: v for k, v in os.environ.items() if k != "TF_CONFIG"})


def finish(process, timeout):
    """The rest of the launcher's stderr, once it has ended; it is killed (and with it, by the
    launcher's own rule, its workers) if it outlives `timeout`."""
    try:
        return process.communicate(timeout=timeout)[1]
    except subprocess.TimeoutExpired:
        process.kill()
        pytest.fail(f"the launcher still ran after {timeout} s: {process.communicate(timeout=60)[1][-5000:]}")


def finish_together(processes, timeout):
    """Each process's stderr, read from all at once (one whose pipe filled would stall the others
    waiting on it), until all have ended, or one has failed: the others would wait out their
    collective timeout on it, so they are killed. All are killed if `timeout` passes first."""
    outputs = {process: "" for process in processes}
    decoders = {process: codecs.getincrementaldecoder("utf-8")(errors="replace") for process in processes}
    deadline = time.monotonic() + timeout
    try:
        with selectors.DefaultSelector() as selector:
            for process in processes:
                selector.register(process.stderr.fileno(), selectors.EVENT_READ, process)
            while selector.get_map() and not any(p.poll() not in (None, 0) for p in processes):
                if time.monotonic() > deadline:
                    pytest.fail(f"still running after {timeout} s: {[o[-5000:] for o in outputs.values()]}")
                for key, _ in selector.select(0.5):
                    data = os.read(key.fd, 1 << 16)
                    outputs[key.data] += decoders[key.data].decode(data, final=not data)
                    if not data:
                        selector.unregister(key.fd)
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
            process.wait(timeout=60)
    return list(outputs.values())


def worker_pid(output, index):
    return int(re.search(rf"worker {index}/2 \(pid (\d+)\)", output)[1])


@pytest.mark.parametrize("args, expected", [
    (["--workers=0", "--"], "--workers=0: must be a whole number >= 1"),
    (["--workers=2", "--num_gpus=1"], "missing '--' before the training flags"),
    (["--", "--num_gpus=1"], "--workers is required"),
    (["--workers=2", "--port=65535", "--"], "--port=65535: must be in 1..65534"),
    (["--workers=2", "--", "--mode=tower"], "--mode=tower: the launcher runs --mode=multi_worker workers"),
    (["--workers=2", "--", "--cluster=slurm"], "--cluster=slurm: the launcher runs --cluster=tf_config"),
    (["--workers=2", "--", "--accum=0"], "--accum=0: must be a whole number >= 1"),
    (["--workers=2", "--", "--help"], "--help after '--' would show each worker's help"),
])
def test_bad_launcher_input_is_one_line_and_starts_no_worker(args, expected):
    result = subprocess.run([sys.executable, "-m", "tower_train.launch", *args], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith("tower_train: error: ") and expected in result.stderr
    assert result.stderr.count("\n") == 1, result.stderr


def test_a_worker_refusing_its_input_ends_the_launcher_at_once(tmp_path):
    # Only the chief takes the train_dir's lock: worker 1 would wait on it for --collective_timeout.
    with TrainDirLock(str(tmp_path)):
        start = time.monotonic()
        launcher = start_launcher("--workers=2", "--", "--num_gpus=1", f"--train_dir={tmp_path}")
        output = finish(launcher, timeout=110)
    assert launcher.returncode == 2, output
    assert time.monotonic() - start < 100  # --collective_timeout is 120
    assert f"[worker 0/2] tower_train: error: --train_dir={tmp_path}: another run is training there" in output
    assert output.strip().splitlines()[-1].startswith(
        "tower_train.launch: worker 0/2 ended first: refused its input (exit status 2, its line above); "
        "the others were killed at once"), output
    assert "Traceback" not in output


@pytest.mark.cpu_only
def test_a_busy_port_is_one_line_naming_it_before_the_workers_start_or_from_one(tmp_path):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        early = subprocess.run([sys.executable, "-m", "tower_train.launch", "--workers=2",
                                f"--port={port - 1}", "--", "--num_gpus=1", f"--train_dir={tmp_path}"],
                               cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert (early.returncode, early.stderr) == (2, (
            f"tower_train: error: --port={port - 1}: port {port}, worker 1's, is in use by another "
            "process; choose another --port, or leave it out for ports the system reports free\n"))

        # Taken after the launcher's look (another process was quicker): the worker says so in
        # one line, and the launcher ends the other at once, within the 60 s, not after
        # the default --collective_timeout (120 s) + 10 s.
        launcher = subprocess.Popen(
            [sys.executable, "-c", "import sys; from tower_train import launch; from tower_train.workers import cluster; "
             "cluster.why_not_listening = lambda port: None; sys.exit(launch.main())",
             "--workers=2", f"--port={port}", "--", "--num_gpus=1", f"--train_dir={tmp_path}"],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            env={k: v for k, v in os.environ.items() if k != "TF_CONFIG"})
        output = finish(launcher, timeout=60)
    assert launcher.returncode == 2 and "Traceback" not in output, output
    assert f"[worker 0/2] tower_train: error: cannot listen on port {port}, of its address " \
           f"127.0.0.1:{port} (TF_CONFIG): the port is in use by another process; give the workers " \
           "free ports\n" in output, output
    assert output.strip().splitlines()[-1].startswith(
        "tower_train.launch: worker 0/2 ended first: refused its input (exit status 2, its line above); "
        "the others were killed at once"), output


def free_consecutive_ports(count):
    while True:
        with socket.socket() as first:
            first.bind(("127.0.0.1", 0))
            base = first.getsockname()[1]
            if base + count > 65536:
                continue
            try:
                others = [socket.socket() for _ in range(count - 1)]
                for offset, s in enumerate(others, 1):
                    s.bind(("127.0.0.1", base + offset))
                return base
            except OSError:
                continue
            finally:
                for s in others:
                    s.close()


@pytest.mark.cpu_only
def test_launcher_matches_tower_mode_and_an_srun_step_matches_the_launcher(tmp_path):
    """The srun step is simulated: two processes with the SLURM_* variables srun gives two tasks
    on one node. TensorFlow 2.21's SlurmClusterResolver expands the node list itself and runs no
    `scontrol`, so no stand-in for that command is needed."""
    launcher = start_launcher("--workers=2", "--", *LAYOUT, f"--train_dir={tmp_path / 'launch'}")
    output = finish(launcher, timeout=240)
    assert launcher.returncode == 0, output
    lines = output.strip().splitlines()
    assert all(line.startswith(("[worker 0/2] ", "[worker 1/2] ", "tower_train.launch: ")) for line in lines)
    assert not [line for line in lines if line.count("[worker ") > 1]  # the tag is said once
    assert [int(m) for m in re.findall(r"\[worker 0/2\] .*\] step (\d), loss = ", output)] == [1, 2, 3, 4]
    assert re.search(r"\[worker 1/2\] .* done: step 4", output) and not re.search(
        r"\[worker 1/2\] .*\] step \d, loss = ", output)  # progress from the chief alone
    assert lines[-1] == "tower_train.launch: all 2 workers finished; exit statuses: 0, 0"

    # Tower mode's reference in this process (a command's start-up would add nothing to the comparison).
    tower = tower_train.fit(mode="tower", num_gpus=2, train_dir=str(tmp_path / "tower"), **TOWER_LAYOUT)
    assert tower.step == 4

    port = free_consecutive_ports(2)
    slurm = [subprocess.Popen(
        [sys.executable, "-m", "tower_train", "--mode=multi_worker", "--cluster=slurm", *LAYOUT,
         f"--train_dir={tmp_path / 'slurm'}"], cwd=ROOT, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True,
        env={**{k: v for k, v in os.environ.items() if k != "TF_CONFIG"}, "SLURM_PROCID": str(task),
             "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NODELIST": "localhost",
             "SLURM_STEP_TASKS_PER_NODE": "2", "TOWER_TRAIN_SLURM_PORT": str(port)})
        for task in (0, 1)]
    errors = finish_together(slurm, timeout=240)
    assert [task.returncode for task in slurm] == [0, 0], errors
    assert "[worker 1/2] done: step 4" in errors[1]

    launched = checkpoint_values(str(tmp_path / "launch"))
    for other in ("tower", "slurm"):
        values = checkpoint_values(str(tmp_path / other))
        assert values.keys() == launched.keys()
        for name in (n for n in launched if n.startswith("model/")):
            np.testing.assert_allclose(values[name], launched[name], rtol=1e-5, atol=1e-6,
                                       err_msg=f"{other}: {name}")


@pytest.mark.cpu_only
def test_sigterm_to_the_launcher_stops_both_workers_saved_and_the_same_command_resumes(tmp_path):
    command = ["--workers=2", "--", "--num_gpus=1", "--batch_size=16", "--max_steps=30",
               "--log_every=1", "--collective_timeout=60", f"--train_dir={tmp_path}"]
    launcher = start_launcher(*command)
    seen = read_until(launcher, "[worker 0/2] ", timeout=240)
    seen += read_until(launcher, "step 3,", timeout=240)
    launcher.send_signal(signal.SIGTERM)
    output = seen + finish(launcher, timeout=120)
    assert launcher.returncode == 128 + signal.SIGTERM, output
    stops = re.findall(r"\[worker (\d)/2\] tower_train: stopped by SIGTERM after update (\d+); saved", output)
    assert sorted(worker for worker, _ in stops) == ["0", "1"], output
    (step,) = {int(update) for _, update in stops}  # the same update boundary
    assert 3 <= step < 30 and os.path.exists(tmp_path / f"ckpt-{step}.index")
    assert output.strip().splitlines()[-1] == ("tower_train.launch: SIGTERM passed to the workers; their "
                                               "exit statuses: 143 (SIGTERM), 143 (SIGTERM)")

    again = start_launcher(*command)
    output = finish(again, timeout=240)
    assert again.returncode == 0, output
    assert re.search(rf"\[worker 0/2\] .* resumed from .*ckpt-{step} at step {step}\n", output), output
    assert re.search(r"\[worker 0/2\] .* done: step 30,", output)


def launched_processes(pid):
    """`pid`'s descendants, each as (pid, start time): a pid the system reuses is another process."""
    children = {}
    for entry in os.listdir("/proc"):
        stat = process_stat(int(entry)) if entry.isdigit() else None
        if stat is not None:
            children.setdefault(int(stat[1]), []).append((int(entry), stat[19]))
    found, queue = [], [pid]
    while queue:
        for child in children.get(queue.pop(), []):
            found.append(child)
            queue.append(child[0])
    return found


def process_stat(pid):
    """/proc/pid/stat's fields from the state on (state, ppid, ...), or None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()
    except (FileNotFoundError, ProcessLookupError):
        return None


def still_running(processes):
    """Those of `processes` that have neither ended nor become a zombie."""
    return [(pid, started) for pid, started in processes
            if (stat := process_stat(pid)) is not None and stat[19] == started and stat[0] != "Z"]


def caught_signals(pid, mask="SigCgt"):
    """The signals `pid` has a handler for (/proc's SigCgt), or another of its masks (SigIgn: those
    it ignores); None once it has exited."""
    try:
        with open(f"/proc/{pid}/status") as f:
            bits = int(re.search(rf"^{mask}:\s*([0-9a-f]+)$", f.read(), re.M)[1], 16)
    except (FileNotFoundError, ProcessLookupError):
        return None
    return {number for number in range(1, 65) if bits >> (number - 1) & 1}


@pytest.mark.cpu_only
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's parent-death signal")
@pytest.mark.parametrize("phase", ["start-up", "set-up", "training"])
def test_no_worker_outlives_a_launcher_killed_in_any_phase(tmp_path, phase):
    """SIGKILL of the launcher while the workers start (Python loading, before TensorFlow), while
    TensorFlow holds SIGTERM and the run's stop handlers are not yet in place (the strategy's
    start-up, building, restoring: workers that got SIGTERM there trained on unattended), and
    mid-training, where they stop after the same update, saved."""
    launcher = start_launcher("--workers=2", "--", "--num_gpus=1", "--batch_size=16",
                              "--max_steps=100000", "--log_every=1", "--collective_timeout=60",
                              f"--train_dir={tmp_path}")
    seen = read_until(launcher, "started worker", timeout=60)  # the line is one write
    workers = [worker_pid(seen, i) for i in (0, 1)]
    if phase == "start-up":
        assert all(signal.SIGTERM not in (caught_signals(pid) or set()) for pid in workers), "TF loaded"
    elif phase == "set-up":
        deadline = time.monotonic() + 240
        while True:
            caught = [caught_signals(pid) for pid in workers]
            assert None not in caught, seen + finish(launcher, timeout=60)
            if all(signal.SIGTERM in c for c in caught):
                break
            assert time.monotonic() < deadline, "no worker loaded TensorFlow within 240 s"
            time.sleep(0.02)
        assert not any(signal.SIGHUP in c for c in caught), "the run's stop handlers were in place"
    else:
        seen += read_until(launcher, "step 3,", timeout=240)
    processes = launched_processes(launcher.pid)
    launcher.kill()
    launcher.communicate(timeout=60)
    deadline = time.monotonic() + 30
    while still_running(processes) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = still_running(processes)
    for pid, _ in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"{phase}: still running 30 s after the launcher was killed: {left}"
    if phase == "training":  # both stopped after the same update, and the chief saved it
        saved = [int(m[1]) for m in map(re.compile(r"ckpt-(\d+)\.index$").match, os.listdir(tmp_path)) if m]
        assert saved and max(saved) >= 3, os.listdir(tmp_path)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc's signal masks")
def test_a_launcher_under_nohup_keeps_sighup_ignored_and_its_workers_inherit_that(tmp_path):
    launcher = subprocess.Popen(
        [sys.executable, "-m", "tower_train.launch", "--workers=2", "--", "--num_gpus=1",
         "--collective_timeout=60", f"--train_dir={tmp_path}"], cwd=ROOT, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True, env={k: v for k, v in os.environ.items() if k != "TF_CONFIG"},
        preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    seen = read_until(launcher, "started worker", timeout=60)  # the line is one write
    ignored = [caught_signals(worker_pid(seen, i), "SigIgn") for i in (0, 1)]
    # The two are pending together: a launcher that handled SIGHUP would pass it on first.
    launcher.send_signal(signal.SIGHUP)
    launcher.send_signal(signal.SIGTERM)
    output = seen + finish(launcher, timeout=120)
    assert all(signal.SIGHUP in worker for worker in ignored), (ignored, output)
    assert "SIGHUP" not in output and "tower_train.launch: SIGTERM received: passed to every worker" \
        in output, output


@pytest.mark.cpu_only
def test_a_second_signal_kills_workers_that_have_not_reached_an_update_boundary(tmp_path):
    # Updates of 4000 micro-steps: the first signal waits for a boundary far away.
    launcher = start_launcher("--workers=2", "--", "--num_gpus=1", "--batch_size=2", "--accum=4000",
                              "--max_steps=10", "--stop_grace_period=600", "--collective_timeout=60",
                              f"--train_dir={tmp_path}")
    seen = read_until(launcher, "[worker 1/2] ", timeout=240)
    seen += read_until(launcher, "global batch G =", timeout=240)  # the device line: training starts
    launcher.send_signal(signal.SIGTERM)
    seen += read_until(launcher, "SIGTERM received: passed to every worker", timeout=60)
    launcher.send_signal(signal.SIGINT)
    output = seen + finish(launcher, timeout=120)

    assert "tower_train.launch: SIGINT received again: killing the workers" in output, output
    assert launcher.returncode == 128 + signal.SIGKILL, output
    assert output.strip().splitlines()[-1] == ("tower_train.launch: SIGTERM passed to the workers; their "
                                               "exit statuses: 137 (SIGKILL), 137 (SIGKILL)")
    assert not any(name.startswith("ckpt-") for name in os.listdir(tmp_path))  # no update was finished


def test_each_worker_gets_gpus_of_its_own():
    assert [gpus_of_worker(i, 2, None) for i in range(3)] == ["0,1", "2,3", "4,5"]
    assert [gpus_of_worker(i, 1, "4,6,7") for i in range(3)] == ["4", "6", "7"]
    assert gpus_of_worker(1, 2, "4,6,7") == "7"  # too few: the worker plans with what it sees
    assert gpus_of_worker(0, 0, None) == ""  # --num_gpus=0: one tower on the CPU
