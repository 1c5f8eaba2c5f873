"""A multi-worker worker's lost peers: which ones no longer answer, and the watchdog, a forked process
that ends a worker waiting on its peers for too long."""
from __future__ import annotations

import contextlib
import os
import re
import select
import signal
import socket
import sys
import time
from typing import Iterator

from tower_train.workers.cluster import WorkerInfo


def unreachable(addresses: tuple[str, ...], timeout: float = 1.0) -> list[str]:
    """The "host:port" addresses that refuse or do not answer a TCP connection."""
    down = []
    for address in addresses:
        host, _, port = address.rpartition(":")
        try:
            with socket.create_connection((host, int(port)), timeout=timeout):
                pass
        except (OSError, ValueError):
            down.append(address)
    return down


# A killed peer's connections can break a few milliseconds before the kernel closes its listening
# port; a loaded machine stretches that, so "none is lost" is said only after this long.
PEER_EXIT_GRACE = 3.0


def peer_trouble(worker: WorkerInfo, starting: bool = False) -> str:
    """Which peers look lost, in words, for an error line: a peer is blamed only when it no
    longer accepts connections. `starting`: the worker waits in the strategy's start-up, for
    peers that have not all started their servers yet, and those may still be on their way."""
    deadline = time.monotonic() + PEER_EXIT_GRACE
    down = unreachable(worker.peers)
    while not down and time.monotonic() < deadline:
        time.sleep(0.25)
        down = unreachable(worker.peers)
    named = ", ".join(map(worker.peer_name, down))
    if down and starting:
        return (f"peer(s) {named} not reachable: not started yet (still starting, or never started); "
                "a longer --collective_timeout gives a slow start (a long --data_module import, "
                "say) time to finish")
    if down:
        return f"peer(s) {named} not reachable (ended, or died)"
    return (f"peers {', '.join(worker.peers)} still accept connections, so none is known lost: one is "
            "stuck, or its work between two waits takes longer than --collective_timeout allows")


class PeerClock:
    """What training tells a multi-worker watchdog: it made progress, or it does local work
    (tracing, evaluation, export) that must not be timed as a wait on the peers. This one does
    nothing: outside multi_worker, or in a script, no one watches."""

    def progress(self) -> None:
        pass

    @contextlib.contextmanager
    def local_work(self) -> Iterator[None]:
        yield


_PROGRESS, _LOCAL = b".", b"L"
# A line of TensorFlow's C++ logging (absl format, a .cc or .h source), and absl's notice that
# precedes the first of them.
_NATIVE_LINE = re.compile(rb"^[IWEF]\d{4} \d\d:\d\d:\d+\.\d+\s+\d+ \S+\.(?:cc|h):\d+\] ")
_NATIVE_NOTICE = b"WARNING: All log messages before absl::InitializeLog() is called"
_RECORD_START = re.compile(rb"^(?:[IWEF]\d{4} \d\d:\d\d:\d+\.\d+\s+\d+ \S+:\d+\] |\S+: |Traceback )")


class PeerWatchdog(PeerClock):
    """Ends this worker when it waits on its peers for `timeout` seconds without progress.

    A peer that never starts, or dies, leaves the collectives of the others waiting, and TF's
    collective timeout does not cover the strategy's start-up, which blocks in C++ without
    releasing the GIL. So the watchdog is a forked child process, started before TensorFlow is
    loaded. Its clock runs only while the worker waits on the peers: it starts when training
    first needs them (the strategy's start-up), and training stops it for local work, so a slow
    trace or evaluation is never taken for a lost peer. When the clock runs out, the child blames
    the peers that no longer accept connections, or, if all still do, says so; then it prints
    one line and kills the worker. When the worker ends, the pipe closes and the child exits.

    The child also carries the worker's stderr, without the multi-line C++ errors TensorFlow
    prints when a peer is lost: the one-line message says what happened.
    """

    def __init__(self, worker: WorkerInfo, timeout: float, prog: str):
        self.worker = worker  # fit reads this worker's place here, not from the environment again
        read_end, self._write_end = os.pipe()
        stderr_read, stderr_write = os.pipe()
        self._local_depth = 0
        self._pid = os.fork()
        if self._pid == 0:  # the child: never returns, not even by an error, into the worker's code
            code = 1
            try:
                os.close(self._write_end)
                os.close(stderr_write)
                # A stop signal to the whole process group is the worker's to handle; the child
                # ends when the worker closes the pipe.
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
                signal.signal(signal.SIGINT, signal.SIG_IGN)
                code = _watch(read_end, stderr_read, os.getppid(), worker, timeout, prog)
            finally:
                os._exit(code)
        os.close(read_end)
        os.close(stderr_read)
        sys.stderr.flush()
        self._real_stderr = os.dup(2)
        os.dup2(stderr_write, 2)
        os.close(stderr_write)

    def progress(self) -> None:
        if not self._local_depth:
            self._send(_PROGRESS)

    @contextlib.contextmanager
    def local_work(self) -> Iterator[None]:
        self._local_depth += 1
        self._send(_LOCAL)
        try:
            yield
        finally:
            self._local_depth -= 1
            self.progress()

    def stop(self) -> None:
        """Ends the watch; the worker's stderr is its own again, everything before it written."""
        sys.stderr.flush()
        os.dup2(self._real_stderr, 2)  # the child reads the rest of the stderr pipe, then ends
        os.close(self._real_stderr)
        os.close(self._write_end)
        os.waitpid(self._pid, 0)

    def _send(self, message: bytes) -> None:
        try:
            os.write(self._write_end, message)
        except BrokenPipeError:
            pass  # the watchdog was killed from outside: train on unwatched


def _watch(clock: int, stderr: int, worker_pid: int, worker: WorkerInfo, timeout: float,
           prog: str) -> int:
    timing = False  # TensorFlow's loading is local work; the first progress starts the clock
    messages = 0  # the first is the strategy's start-up, which waits until every peer has started
    deadline = None
    filtered = _NativeLineFilter()
    open_fds = [clock, stderr]
    while open_fds:
        wait = None if not timing or clock not in open_fds else max(0.0, deadline - time.monotonic())
        ready, _, _ = select.select(open_fds, [], [], wait)
        if not ready:
            filtered.flush()
            if _suspended(worker_pid):  # its own stall, not a wait on the peers: they are not blamed
                line = (f"[{worker.name}] no progress for {timeout:g} s (--collective_timeout) "
                        "while suspended (SIGSTOP, or the like): its own stall, not its peers'")
            else:
                line = (f"[{worker.name}] no progress for {timeout:g} s while waiting on the peers "
                        f"(--collective_timeout): {peer_trouble(worker, starting=messages == 1)}")
            _write_stderr(f"{prog}: {line}\n".encode())
            os.kill(worker_pid, signal.SIGKILL)
            return 1
        for fd in ready:
            data = os.read(fd, 65536)
            if not data:
                open_fds.remove(fd)
            elif fd == stderr:
                filtered.write(data)
            else:
                timing = data[-1:] != _LOCAL
                messages += len(data)
                deadline = time.monotonic() + timeout
    filtered.flush()
    return 0


def _suspended(pid: int) -> bool:
    """Whether process `pid` is suspended (state T: SIGSTOP, SIGTSTP); False where /proc is not."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] == "T"
    except OSError:
        return False


def _write_stderr(data: bytes) -> None:
    try:
        os.write(2, data)
    except BrokenPipeError:
        pass  # no one reads the worker's output any more (its launcher died): the worker goes on


class _NativeLineFilter:
    """Copies the worker's stderr to this process's, less TensorFlow's C++ log records (a record
    runs on over its continuation lines until the next record starts)."""

    def __init__(self):
        self._pending = b""
        self._dropping = False

    def write(self, data: bytes) -> None:
        lines = (self._pending + data).split(b"\n")
        self._pending = lines.pop()
        kept = []
        for line in lines:
            if _NATIVE_LINE.match(line) or line.startswith(_NATIVE_NOTICE):
                self._dropping = True
            elif not self._dropping or _RECORD_START.match(line):
                self._dropping = False
                kept.append(line + b"\n")
        if kept:
            _write_stderr(b"".join(kept))

    def flush(self) -> None:
        if self._pending:
            self.write(b"\n")
