"""Faults: a run killed with SIGKILL resumes to the weights of an uninterrupted run; bad data files and
refused runs write nothing.

The kill tests drive the real CLI in a subprocess and read its progress lines as they come, so the
kill lands between (or during) real updates and checkpoint saves.
"""
import hashlib
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import tensorflow as tf

import tower_train
from test_cli_errors import ROOT, run_cli
from test_train import checkpoint_values

TIMEOUT = 300  # seconds, for every subprocess
STEP_LINE = re.compile(r"\bstep (\d+), loss = \S+ \(")  # a progress line, not the "done: " line
RESUMED = re.compile(r"resumed from (\S+) at step (\d+)")
STEP_VAR = "step/.ATTRIBUTES/VARIABLE_VALUE"
EXAMPLES_VAR = "examples_seen/.ATTRIBUTES/VARIABLE_VALUE"

# 2 towers x K = 2, momentum, augmentation, deterministic ops: every piece of state a resume must restore.
LAYOUT = ["--num_gpus=2", "--accum=2", "--batch_size=8", "--optimizer=momentum", "--augment",
          "--deterministic", "--log_every=1"]


def _env():
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    env["PYTHONPATH"] = ROOT
    return env


class Run:
    """What one `python -m tower_train` process did: its exit status, stderr lines and logged steps."""

    def __init__(self, returncode, lines):
        self.returncode = returncode
        self.lines = lines
        self.stderr = "".join(lines)
        self.steps = [int(m.group(1)) for m in map(STEP_LINE.search, lines) if m]
        resumed = [RESUMED.search(line) for line in lines]
        resumed = [m for m in resumed if m]
        self.resumed_step = int(resumed[0].group(2)) if resumed else None
        self.resumed_from = resumed[0].group(1) if resumed else None


def start_cli(*args):
    """Starts `python -m tower_train ARGS`; `finish_cli` reads it to the end. Bounded by TIMEOUT."""
    process = subprocess.Popen([sys.executable, "-m", "tower_train", *args], cwd=ROOT, env=_env(),
                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True, bufsize=1)
    process.started = time.monotonic()
    process.watchdog = threading.Timer(TIMEOUT, process.kill)  # a hung child ends the reading loop
    process.watchdog.daemon = True
    process.watchdog.start()
    return process


def finish_cli(process, kill_at_step=None, kill_delay=0.0):
    """Reads the process's stderr line by line until it exits; with kill_at_step, sends SIGKILL (after
    kill_delay seconds) as soon as a progress line of that step or a later one is read."""
    lines = []
    try:
        for line in process.stderr:
            lines.append(line)
            match = STEP_LINE.search(line)
            if kill_at_step is not None and match and int(match.group(1)) >= kill_at_step:
                if kill_delay:
                    time.sleep(kill_delay)
                process.send_signal(signal.SIGKILL)
                break
        process.stderr.close()
        returncode = process.wait(timeout=TIMEOUT)
    finally:
        process.watchdog.cancel()
        if process.poll() is None:
            process.kill()
            process.wait(timeout=TIMEOUT)
    elapsed = time.monotonic() - process.started
    assert elapsed < TIMEOUT, f"timed out after {TIMEOUT} s:\n{''.join(lines)}"
    return Run(returncode, lines)


def train_cli(*args, kill_at_step=None, kill_delay=0.0):
    return finish_cli(start_cli(*args), kill_at_step, kill_delay)


def checkpoint_step(train_dir):
    """The step of the latest checkpoint in train_dir, 0 if there is none."""
    latest = tf.train.latest_checkpoint(str(train_dir))
    return int(latest.rsplit("-", 1)[1]) if latest else 0


def assert_same_final_state(interrupted_dir, straight_dir, max_steps):
    interrupted = checkpoint_values(str(interrupted_dir))
    straight = checkpoint_values(str(straight_dir))
    state = sorted(n for n in straight if n.split("/")[0] in ("model", "optimizer"))
    assert any(n.startswith("model/") for n in state) and any(n.startswith("optimizer/") for n in state)
    assert sorted(n for n in interrupted if n.split("/")[0] in ("model", "optimizer")) == state
    for name in state:
        np.testing.assert_array_equal(interrupted[name], straight[name], err_msg=name)
    assert interrupted[STEP_VAR] == max_steps and straight[STEP_VAR] == max_steps
    assert interrupted[EXAMPLES_VAR] == straight[EXAMPLES_VAR]


def test_kill_9_between_checkpoints_loses_only_the_updates_since_the_last_one(tmp_path):
    train_dir = tmp_path / "interrupted"
    straight_dir = tmp_path / "straight"
    args = [*LAYOUT, "--checkpoint_every=3", "--max_steps=9"]
    straight_process = start_cli(*args, f"--train_dir={straight_dir}")  # alongside, to save time
    try:
        killed = train_cli(*args, f"--train_dir={train_dir}", kill_at_step=5)
        assert killed.returncode == -signal.SIGKILL, killed.stderr
        assert killed.steps == [1, 2, 3, 4, 5], killed.stderr
        assert "done: " not in killed.stderr
        assert tf.train.latest_checkpoint(str(train_dir)) == str(train_dir / "ckpt-3")

        resumed = train_cli(*args, f"--train_dir={train_dir}")
        assert resumed.returncode == 0, resumed.stderr
        assert "resumed from" in resumed.stderr and "at step 3" in resumed.stderr, resumed.stderr
        assert resumed.resumed_step == 3
        assert resumed.steps == [4, 5, 6, 7, 8, 9], resumed.stderr  # 4 and 5 are redone, 1..3 are not
        assert "done: step 9" in resumed.stderr
    except BaseException:
        straight_process.kill()
        straight_process.wait(timeout=TIMEOUT)
        raise

    straight = finish_cli(straight_process)
    assert straight.returncode == 0, straight.stderr
    assert straight.steps == list(range(1, 10)) and straight.resumed_step is None

    assert_same_final_state(train_dir, straight_dir, max_steps=9)


@pytest.mark.soak
def test_soak_repeated_kills_resume_to_the_uninterrupted_weights(tmp_path):
    max_steps, every, cycles = 30, 2, 6
    train_dir = tmp_path / "interrupted"
    args = [*LAYOUT, f"--checkpoint_every={every}", f"--max_steps={max_steps}"]
    rng = random.Random(0)
    resume_point = 0  # the step the next process starts from
    history = []
    for cycle in range(cycles):
        if resume_point >= max_steps - 2:
            break  # (not with seed 0) leave the last updates to the final run
        # Progress past the resume point, then a kill at a random moment: right after the progress line, or
        # up to ~1.5 updates later, so some kills land inside an update and some inside a checkpoint save.
        target = rng.randint(resume_point + 1, min(resume_point + 5, max_steps - 1))
        delay = rng.choice([0.0, rng.uniform(0.0, 0.2)])
        run = train_cli(*args, f"--train_dir={train_dir}", kill_at_step=target, kill_delay=delay)
        context = f"cycle {cycle}, kill at step {target} + {delay:.3f} s, history {history}:\n{run.stderr}"
        assert run.returncode == -signal.SIGKILL, context
        assert "done: " not in run.stderr, context
        # This process started where the last one's latest checkpoint was, and logged every update after it.
        if resume_point:
            assert run.resumed_step == resume_point, context
            assert run.resumed_from == str(train_dir / f"ckpt-{resume_point}"), context
        else:
            assert run.resumed_step is None, context
        assert run.steps[0] == resume_point + 1 and run.steps[-1] >= target, context
        assert run.steps == list(range(resume_point + 1, run.steps[-1] + 1)), context
        # Nothing before the last checkpoint that had finished when the progress line was printed is lost.
        saved = checkpoint_step(train_dir)
        assert saved >= max(resume_point, (target - 1) // every * every), context
        assert saved % every == 0, context
        history.append((target, round(delay, 3), saved))
        resume_point = saved

    print(f"(kill at step, delay s, latest checkpoint after the kill): {history}")
    final = train_cli(*args, f"--train_dir={train_dir}")
    context = f"history {history}:\n{final.stderr}"
    assert final.returncode == 0, context
    assert final.resumed_step == resume_point, context
    assert final.steps == list(range(resume_point + 1, max_steps + 1)), context
    assert f"done: step {max_steps}" in final.stderr, context

    straight_dir = tmp_path / "straight"
    straight = train_cli(*args, f"--train_dir={straight_dir}")
    assert straight.returncode == 0, straight.stderr
    assert straight.steps == list(range(1, max_steps + 1))

    assert_same_final_state(train_dir, straight_dir, max_steps=max_steps)


# --------------------------------------------------------------------------------------------------
# Bad data files

RECORD = 3073  # 1 label byte + 3072 image bytes
CIFAR10_FILES = [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]


def write_cifar10(directory, records=4, seed=0):
    """A valid little CIFAR-10 binary data set: `records` random records per file, labels 0..9."""
    rng = np.random.default_rng(seed)
    directory.mkdir()
    for name in CIFAR10_FILES:
        data = rng.integers(0, 256, (records, RECORD), dtype=np.uint8)
        data[:, 0] = rng.integers(0, 10, records)
        (directory / name).write_bytes(data.tobytes())
    return directory


def _missing_test_batch(d):
    (d / "test_batch.bin").unlink()
    return d, "test_batch.bin", "missing"


def _truncated_data_batch_3(d):
    with open(d / "data_batch_3.bin", "r+b") as f:
        f.truncate(RECORD * 2 + 100)
    return d, "data_batch_3.bin", str(RECORD * 2 + 100)


def _empty_data_batch_1(d):
    (d / "data_batch_1.bin").write_bytes(b"")
    return d, "data_batch_1.bin", "empty"


def _data_dir_is_a_file(d):
    a_file = d.parent / "cifar-10-batches.bin"
    a_file.write_bytes((d / "data_batch_1.bin").read_bytes())
    return a_file, a_file.name, "not a directory"


BAD_DATA = [_missing_test_batch, _truncated_data_batch_3, _empty_data_batch_1, _data_dir_is_a_file]


def snapshot(directory):
    """{relative path: (sha256, size, mtime_ns)} of every file under directory, and every directory."""
    found = {}
    for parent, dirs, files in os.walk(directory):
        for name in dirs:
            found[os.path.relpath(os.path.join(parent, name), directory) + "/"] = None
        for name in files:
            path = os.path.join(parent, name)
            with open(path, "rb") as f:
                digest = hashlib.sha256(f.read()).hexdigest()
            stat = os.stat(path)
            found[os.path.relpath(path, directory)] = (digest, stat.st_size, stat.st_mtime_ns)
    return found


def assert_one_line_error(result, culprit):
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("tower_train: error: "), lines[0]
    assert culprit in lines[0], lines[0]
    assert "Traceback" not in result.stderr + result.stdout
    return lines[0]


@pytest.mark.parametrize("spoil", BAD_DATA, ids=[f.__name__.lstrip("_") for f in BAD_DATA])
def test_a_bad_cifar10_file_is_one_line_naming_it_and_writes_nothing(tmp_path, spoil):
    data_dir, culprit, reason = spoil(write_cifar10(tmp_path / "cifar10"))
    before = snapshot(tmp_path)
    train_dir = tmp_path / "train"

    result = run_cli("--dataset=cifar10", f"--data_dir={data_dir}", "--num_gpus=2", "--batch_size=8",
                     "--max_steps=2", f"--train_dir={train_dir}")

    line = assert_one_line_error(result, culprit)
    assert reason in line, line
    assert not train_dir.exists()
    assert snapshot(tmp_path) == before


def test_checkpoint_files_are_not_touched_by_a_refused_run(tmp_path):
    train_dir = tmp_path / "run"
    data_dir = write_cifar10(tmp_path / "cifar10")  # a tiny data set: the held-out evaluation is quick
    options = dict(dataset="cifar10", data_dir=str(data_dir), num_gpus=2, batch_size=8, max_steps=2,
                   checkpoint_every=1, log_every=1, train_dir=str(train_dir))
    args = [f"--{name}={value}" for name, value in options.items()]
    # The checkpoints the refused commands must leave alone, written in this process: the
    # commands take its train_dir as one of their own.
    assert tower_train.fit(**options).step == 2
    assert checkpoint_step(train_dir) == 2
    before = snapshot(train_dir)
    assert any(name.startswith("ckpt-2.") for name in before), before

    for bad, culprit in [("--accum=0", "--accum=0"), ("--model=no_such_model", "no_such_model")]:
        refused = run_cli(*args, bad)
        assert_one_line_error(refused, culprit)
        assert "resumed from" not in refused.stderr
        assert snapshot(train_dir) == before, bad
