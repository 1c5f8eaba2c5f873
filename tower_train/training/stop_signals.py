"""SIGTERM, SIGINT and SIGHUP (left ignored under nohup) as a request to stop at the next update
boundary, within a grace period."""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys

from absl import logging

from tower_train.training import stop_deadline

_PR_GET_PDEATHSIG = 2  # linux/prctl.h


def stop_signals() -> tuple[int, ...]:
    """The signals that stop a run, and that the launcher passes on to its workers: SIGTERM, SIGINT
    and SIGHUP (a closed terminal or ssh session, which should no more lose the updates than
    SIGTERM), but not SIGHUP where it is ignored: a process started under nohup keeps it so."""
    if signal.getsignal(signal.SIGHUP) == signal.SIG_IGN:
        return signal.SIGTERM, signal.SIGINT
    return signal.SIGTERM, signal.SIGINT, signal.SIGHUP


def parent_death_signal() -> int:
    """The signal this process gets when its parent dies (Linux's PR_SET_PDEATHSIG; the launcher
    sets one for its workers), or 0: none is set, or it cannot be handled (SIGKILL)."""
    if not sys.platform.startswith("linux"):
        return 0
    number = ctypes.c_int(0)
    ctypes.CDLL(None, use_errno=True).prctl(_PR_GET_PDEATHSIG, ctypes.byref(number))
    return 0 if number.value in (signal.SIGKILL, signal.SIGSTOP) else number.value


class StopSignals:
    """Turns the first stop signal (`stop_signals`, and the parent-death signal where one is set:
    the launcher's death) into a request to stop at the next update boundary.

    The run saves there if it gets there within the grace period; if not (a long update, a
    native op that holds the GIL), the `stop_deadline` process ends it unsaved, its
    checkpoints intact. A second signal ends the process at once, as if no handler were there.
    """

    def __init__(self, prog: str = "tower_train"):
        self._prog = prog
        self._signal: int | None = None
        self._deadline: subprocess.Popen | None = None
        self._write_end = -1
        self._previous: dict = {}

    def listen(self, grace_seconds: float, train_dir: str) -> None:
        """Installs the handlers and starts the deadline process; call it after the distribution
        strategy is built, and `close` when training ends.

        A multi-worker strategy starts TF's coordination service, which puts its own
        SIGTERM handler in place of any installed before it: one installed later wins.
        """
        numbers, death = stop_signals(), parent_death_signal()
        if death not in (0, *numbers):
            numbers += (death,)
        read_end, self._write_end = os.pipe()
        self._deadline = subprocess.Popen(
            [sys.executable, "-I", stop_deadline.__file__, str(os.getpid()), str(grace_seconds),
             train_dir, self._prog, ",".join(str(int(n)) for n in numbers)], stdin=read_end)
        os.close(read_end)
        os.set_blocking(self._write_end, False)  # set_wakeup_fd needs it so
        signal.set_wakeup_fd(self._write_end, warn_on_full_buffer=False)
        self._previous = {number: signal.signal(number, self._record) for number in numbers}

    def received(self) -> int | None:
        """The number of the signal that asked the run to stop, or None."""
        return self._signal

    def at_boundary(self) -> None:
        """The run stopped at an update boundary and saves now: the deadline no longer applies.

        The deadline process exits on BOUNDARY, so the signal wake-up goes too: a second signal
        during the save would otherwise be written into a pipe nobody reads (a BrokenPipeError
        report) before its handler ends the process."""
        if self._deadline is not None:
            os.write(self._write_end, bytes([stop_deadline.BOUNDARY]))
            signal.set_wakeup_fd(-1)

    def close(self) -> None:
        """Puts the previous handlers back and ends the deadline process."""
        if self._deadline is None:
            return
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        signal.set_wakeup_fd(-1)
        os.close(self._write_end)  # end of file: the deadline process exits
        self._deadline.wait()
        self._deadline = None

    def _record(self, number: int, frame) -> None:
        if self._signal is not None:
            signal.signal(number, signal.SIG_DFL)
            os.kill(os.getpid(), number)
        self._signal = number
        logging.info("%s received: stopping after the current update (again to stop at once)",
                     signal.Signals(number).name)
