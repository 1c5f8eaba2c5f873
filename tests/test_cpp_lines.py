"""A command's stderr without TensorFlow's C++ log lines (cpp_lines.py): the rest passes on
unchanged and in order, the user's TF_CPP_MIN_LOG_LEVEL brings them back, and the command's exit
status and one-line error stay its own. The filter acts on a process's fd 2 and outlives it:
hence real processes. No GPU here: XLA's autotuner lines are written by the scripts themselves."""
import os
import signal
import subprocess
import sys

from test_cli_errors import ROOT
from tower_train.cpp_lines import LineFilter

AUTOTUNER = (b"E0000 00:00:1795703141.430089    5122 cuda_timer.cc:87] Delay kernel timed out: measured "
             b"time has sub-optimal accuracy. There may be a missing warmup execution, please "
             b"investigate in Nsight Systems.\n")
# C++ lines after absl is set up (a date), of a header and of a .cpp file.
CPP_WARNING = b"W1128 20:54:48.918747    5122 gpu_timer.h:12] timer\n"
CPP_INFO = b"I1128 20:54:48.918750    5122 autotuner_util.cpp:301] cache miss\n"
PY_ABSL = b"I1128 20:54:48.918747 139683906759552 train.py:188] done: 3 updates\n"
FATAL = b"F1128 20:54:48.918760    5122 crash.cc:1] Check failed\n"
PLAIN = b"tower_train: error: --accum=0: must be >= 1\n"
PARTIAL = b"I12 no newline at the end"
WRITTEN = [AUTOTUNER, PY_ABSL, CPP_WARNING, PLAIN, CPP_INFO, FATAL, PARTIAL]
KEPT = b"".join([PY_ABSL, PLAIN, FATAL, PARTIAL])

# Writes WRITTEN to fd 2 as a command's process, after `before` (a statement), and exits 3.
SCRIPT = """
import os, signal, sys
from tower_train import cli

def main():
    {before}
    for line in {written!r}:
        os.write(2, line)
    {after}
    return 3

cli.run(main)
"""


def run_script(env_level: str | None, before: str = "pass",
               after: str = "pass") -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}  # conftest sets it
    env["PYTHONPATH"] = ROOT
    if env_level is not None:
        env["TF_CPP_MIN_LOG_LEVEL"] = env_level
    script = SCRIPT.format(before=before, written=WRITTEN, after=after)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, cwd=ROOT, env=env, timeout=60)


def test_the_filter_drops_cpp_lines_in_any_pieces_and_passes_the_rest_in_order():
    text = b"".join(WRITTEN)
    for size in (1, 7, len(text)):
        lines = LineFilter()
        out = b"".join(lines.feed(text[i:i + size]) for i in range(0, len(text), size)) + lines.end()
        assert out == KEPT, size


def test_a_held_start_that_cannot_become_a_cpp_line_passes_at_once():
    lines = LineFilter()
    assert lines.feed(b"E0000 00:00:17") == b""  # may still be one
    assert lines.feed(b"95 x") == b"E0000 00:00:1795 x"  # no header goes on so: not one
    assert lines.feed(b" 5%|#") == b" 5%|#"  # the rest of a kept line, as it comes (tqdm's \r lines)
    assert lines.feed(b"\nE0000 00:00:1.000001 1 a.cc:1] gone\n") == b"\n"


def test_a_commands_process_drops_cpp_lines_from_its_fd_2_and_keeps_its_exit_status():
    filtered = run_script(None)
    assert filtered.returncode == 3, filtered.stderr.decode()
    assert filtered.stderr == KEPT


def test_the_users_tf_cpp_min_log_level_keeps_every_line():
    untouched = run_script("2")
    assert untouched.returncode == 3
    assert untouched.stderr == b"".join(WRITTEN)


def test_the_filter_drains_what_a_process_killed_by_sigkill_had_written():
    killed = run_script(None, after="os.kill(os.getpid(), signal.SIGKILL)")
    assert killed.returncode == -signal.SIGKILL
    assert killed.stderr == KEPT


# The filter process, a child of the script, once it ignores SIGINT and SIGTERM (from its start-up
# on), is sent both; the lines written after them still come out.
SIGNALS_FIRST = """import time
    (filter_pid,) = map(int, open(f"/proc/self/task/{os.getpid()}/children").read().split())
    ignoring = 1 << (signal.SIGINT - 1) | 1 << (signal.SIGTERM - 1)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not int(next(
            line.split()[1] for line in open(f"/proc/{filter_pid}/status")
            if line.startswith("SigIgn:")), 16) & ignoring == ignoring:
        time.sleep(0.01)
    os.kill(filter_pid, signal.SIGINT)
    os.kill(filter_pid, signal.SIGTERM)"""


def test_the_filter_ignores_sigint_and_sigterm():
    signalled = run_script(None, before=SIGNALS_FIRST)
    assert signalled.returncode == 3, signalled.stderr.decode()
    assert signalled.stderr == KEPT


BROKEN_MODELS = """import os

os.write(2, {line!r})
raise ValueError("broken on purpose")
"""


def test_a_commands_one_line_error_and_status_reach_stderr_without_the_cpp_line(tmp_path):
    (tmp_path / "broken_models.py").write_text(BROKEN_MODELS.format(line=AUTOTUNER))
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CPP_MIN_LOG_LEVEL", "TF_CONFIG")}
    command = [sys.executable, "-m", "tower_train", "--model_module=broken_models",
               f"--train_dir={tmp_path / 'run'}"]
    failed = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path,
                            env={**env, "PYTHONPATH": ROOT}, timeout=300)
    assert failed.returncode == 2
    assert failed.stderr == (f"tower_train: error: --model_module=broken_models: "
                             f"{tmp_path / 'broken_models.py'}:4: ValueError: broken on purpose\n")
    untouched = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path,
                               env={**env, "PYTHONPATH": ROOT, "TF_CPP_MIN_LOG_LEVEL": "2"}, timeout=300)
    assert untouched.returncode == 2
    assert untouched.stderr == AUTOTUNER.decode() + failed.stderr


# What the launcher hands its workers, each a command of its own that decides as the launcher did.
WORKER_ENVIRONMENT = """import os, tower_train
from tower_train.quiet_start import level_set_by_user, users_environment
print(os.environ.get("TF_CPP_MIN_LOG_LEVEL"), level_set_by_user(), users_environment().get("TF_CPP_MIN_LOG_LEVEL"))
"""


def test_a_worker_gets_the_users_tf_cpp_min_log_level_and_not_the_one_set_by_import():
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    for level, printed in ((None, "2 False None"), ("1", "1 True 1")):
        child_env = {**env, "PYTHONPATH": ROOT, **({"TF_CPP_MIN_LOG_LEVEL": level} if level else {})}
        shown = subprocess.run([sys.executable, "-c", WORKER_ENVIRONMENT], capture_output=True, text=True,
                               cwd=ROOT, env=child_env, timeout=60)
        assert shown.stdout.strip() == printed, shown.stderr
