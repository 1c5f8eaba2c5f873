"""How a worker process ended, in words, for the launcher (launch.py): its exit status as a shell
gives it, the stop rule's exit (128 + a stop signal's number), and a suspended child told apart."""
from __future__ import annotations

import os
import signal

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)  # the stop rule's (stop_signals.py)


def shell_status(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def describe_status(status: int) -> str:
    if status > 128 and status - 128 in signal.valid_signals():
        return f"{status} ({signal.Signals(status - 128).name})"
    return str(status)


def how_it_ended(returncode: int, finished: bool, suspended_by: int | None = None) -> str:
    """A worker's end in words, from its `Popen.returncode` (negative: killed by that signal),
    whether it logged its `done:` line, and the signal that had suspended it, if any."""
    status = shell_status(returncode)
    if returncode < 0:
        how = f"killed by {signal.Signals(-returncode).name} (exit status {status})"
    elif returncode == 0:
        how = ("finished (exit status 0)" if finished
               else "exited with status 0 before finishing (no `done:` line)")
    elif returncode == 2:
        how = "refused its input (exit status 2, its line above)"
    elif stopped_by_the_stop_rule(returncode):  # its own signal's number, or SIGTERM's for a peer's
        how = f"stopped on a stop signal (exit status {status})"
    else:
        how = f"failed (exit status {status})"
    if suspended_by is not None:
        how = f"suspended by {signal.Signals(suspended_by).name}, then {how}"
    return how


def stopped_by_the_stop_rule(returncode: int) -> bool:
    """Whether a worker exited as the stop rule ends a run: 128 + the stop signal's number."""
    return returncode - 128 in STOP_SIGNALS


def suspending_signal(pid: int) -> int | None:
    """The signal that holds child `pid` suspended now (SIGSTOP, SIGTSTP, ...), or None; Popen
    still collects its exit (WNOWAIT)."""
    if not hasattr(os, "waitid"):  # macOS: suspended workers are not told apart
        return None
    try:
        info = os.waitid(os.P_PID, pid, os.WSTOPPED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # collected already
        return None
    return info.si_status if info is not None and info.si_code == os.CLD_STOPPED else None
