"""TensorFlow's C++ log lines kept out of a command's stderr.

Under --jit_compile on a GPU, XLA's autotuner writes lines such as

    E0000 00:00:1795703141.430089    5122 cuda_timer.cc:87] Delay kernel timed out: ...

through absl's C++ logging, which TF_CPP_MIN_LOG_LEVEL does not silence: 118-143 of them a run
(docs/gpu.md, "XLA's log lines"), burying the progress and the one-line errors. A command's process
(`cli.run`) therefore sends its fd 2, where TensorFlow's C++ side writes, through this file run as
a process of its own, which drops the lines in absl's C++ format (a `.cc`, `.h`, `.cpp` or `.cu`
file; FATAL's `F` lines stay) and passes every other byte on in order: absl-py's lines (the same
format, a `.py` file), tracebacks, the one-line errors, a last line without its newline.

A process, not a thread: it drains the pipe after the command has ended, a crash too, until every
writer (the command's children included) has closed it; it ignores the stop signals, which are
the command's. Only the commands call it: the library, imported by a user's script, leaves fd 2
alone, and a user who sets TF_CPP_MIN_LOG_LEVEL gets TensorFlow's lines untouched.

This file imports only the standard library: the filter runs it as a script (`python -I -S`).
"""
from __future__ import annotations

import atexit
import io
import os
import re
import signal
import subprocess
import sys

# absl's C++ prefix: severity, date and time (before absl is set up, a zero date and the seconds
# since the epoch), thread, the C++ source file and line.
CPP_LINE = re.compile(rb"[IWE]\d{4} \d\d:\d\d:\d+\.\d{6} +\d+ [\w./+-]+\.(?:cc|h|cpp|cu):\d+\]")
# The start of a line that may still become one of CPP_LINE (loosely: each part's characters).
_MAY_BECOME = re.compile(rb"[IWE]\d{0,4}(?: [\d:.]*(?: +\d*(?: [\w./+-]*(?::\d*)?)?)?)?")
# At exit, the wait for the filter's last lines, which should come before the shell's prompt.
EXIT_WAIT_S = 2.0


class LineFilter:
    """CPP_LINE's lines dropped from bytes that come in pieces; the rest passed on in order. The
    start of a line is held back only while it may still become a C++ line."""

    def __init__(self) -> None:
        self._head = b""  # the current line's start, held while undecided
        self._keep: bool | None = None  # the current line's fate, once decided

    def feed(self, data: bytes) -> bytes:
        """What of `data` (and of the start held back) to pass on now."""
        out = []
        *lines, last = data.split(b"\n")
        for piece, ends in [*((line + b"\n", True) for line in lines), (last, False)]:
            if not piece:
                continue
            if self._keep is None:
                self._head += piece
                if not ends and _MAY_BECOME.fullmatch(self._head):
                    continue
                self._keep = not CPP_LINE.match(self._head)
                piece, self._head = self._head, b""
            if self._keep:
                out.append(piece)
            if ends:
                self._keep = None
        return b"".join(out)

    def end(self) -> bytes:
        """The start of a last line held back, which never became a C++ line."""
        head, self._head = self._head, b""
        return head


def filter_stderr() -> None:
    """Sends this process's fd 2, which its children inherit, through the filter process until
    it exits; called once, by `cli.run`, before TensorFlow loads."""
    sys.stderr.flush()
    terminal = os.dup(2)  # the stderr behind the filter
    read_end, write_end = os.pipe()
    # Its own session: a Ctrl-C at the terminal reaches the command, not the filter.
    filter_process = subprocess.Popen([sys.executable, "-I", "-S", os.path.abspath(__file__)],
                                      stdin=read_end, stdout=terminal, start_new_session=True)
    os.close(read_end)
    os.dup2(write_end, 2)
    os.close(write_end)
    if os.isatty(terminal):
        sys.stderr = _TerminalBehind(open(2, "wb", closefd=False), encoding=sys.stderr.encoding,
                                     errors=sys.stderr.errors, line_buffering=True)
    atexit.register(_finish, filter_process, terminal)


class _TerminalBehind(io.TextIOWrapper):
    """sys.stderr on the filter's pipe, a terminal to those who ask: the live progress line is
    drawn only when stderr is a terminal (api.py)."""

    def isatty(self) -> bool:
        return True


def _finish(filter_process: subprocess.Popen, terminal: int) -> None:
    """At exit: fd 2 back on the terminal, which ends the filter's input unless a child still
    holds it, and a bounded wait for the filter; the exit status stays the command's."""
    for stream in {sys.stderr, sys.__stderr__}:
        stream.flush()
    os.dup2(terminal, 2)
    try:
        filter_process.wait(EXIT_WAIT_S)
    except subprocess.TimeoutExpired:
        pass


def _relay() -> None:
    """The filter process: its stdin, filtered, to its stdout, until every writer has closed it."""
    for number in (signal.SIGINT, signal.SIGTERM):
        signal.signal(number, signal.SIG_IGN)
    lines, out = LineFilter(), sys.stdout.buffer
    while data := os.read(0, 1 << 16):
        out.write(lines.feed(data))
        out.flush()
    out.write(lines.end())
    out.flush()


if __name__ == "__main__":
    _relay()
