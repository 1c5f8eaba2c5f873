"""tower_train.training.stop_signals without TensorFlow, each case in a process of its own (its signal
dispositions are the point): SIGHUP ignored at the start (nohup) stays ignored while SIGTERM still
stops, and a parent-death signal is a stop too. test_resume.py sends real signals to real runs."""
import ctypes
import signal
import subprocess
import sys
import textwrap

import pytest

from test_cli_errors import ROOT

# Reports the stop signals, sends itself the signals given, then says which one StopSignals
# received and whether SIGHUP is still ignored.
REPORT = textwrap.dedent("""
    import os, signal, sys, time
    from tower_train.training.stop_signals import StopSignals, stop_signals
    print(*(signal.Signals(n).name for n in stop_signals()), flush=True)
    stop = StopSignals()
    stop.listen(30, sys.argv[1])
    for number in map(int, sys.argv[2:]):
        os.kill(os.getpid(), number)
    for _ in range(6000):  # the handler runs at the next bytecode; nothing ends the wait for SIGHUP
        if stop.received() is not None:
            break
        time.sleep(0.01)
    print(signal.Signals(stop.received()).name, "SIGHUP ignored:",
          signal.getsignal(signal.SIGHUP) == signal.SIG_IGN, flush=True)
    stop.close()
""")


def report(tmp_path, preexec, *sent):
    result = subprocess.run([sys.executable, "-c", REPORT, str(tmp_path), *map(str, map(int, sent))],
                            cwd=ROOT, capture_output=True, text=True, timeout=120, preexec_fn=preexec)
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def ignore_sighup():
    signal.signal(signal.SIGHUP, signal.SIG_IGN)


def default_sighup():  # as a terminal leaves it, whatever this test run inherited (nohup, say)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def test_sighup_ignored_at_the_start_stays_ignored_and_sigterm_still_stops(tmp_path):
    assert report(tmp_path, ignore_sighup, signal.SIGHUP, signal.SIGTERM) == [
        "SIGTERM SIGINT", "SIGTERM SIGHUP ignored: True"]
    assert report(tmp_path, default_sighup, signal.SIGHUP) == [  # without nohup: a stop, as before
        "SIGTERM SIGINT SIGHUP", "SIGHUP SIGHUP ignored: False"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's parent-death signal")
def test_the_parent_death_signal_is_a_stop(tmp_path):
    """The launcher's workers get SIGUSR1 when it dies: training stops at the boundary, saved."""
    def die_with_the_parent():
        ignore_sighup()  # a launcher under nohup: its death still stops the worker
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGUSR1)  # PR_SET_PDEATHSIG

    assert report(tmp_path, die_with_the_parent, signal.SIGUSR1)[1] == "SIGUSR1 SIGHUP ignored: True"
