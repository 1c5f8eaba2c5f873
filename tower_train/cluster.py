"""Multi-worker plumbing: this worker's place from TF_CONFIG, and a watchdog for lost peers."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import select
import signal
import socket
import sys
import time
from typing import Iterator

from tower_train.errors import UsageError


@dataclasses.dataclass(frozen=True)
class WorkerInfo:
    """This process's place in the cluster; one worker of one outside multi_worker mode."""

    index: int = 0
    count: int = 1
    is_chief: bool = True
    peers: tuple[str, ...] = ()  # "host:port" of every other task, in cluster order

    @property
    def name(self) -> str:
        return f"worker {self.index}/{self.count}"


SINGLE_PROCESS = WorkerInfo()


def parse_tf_config(text: str | None) -> WorkerInfo:
    """This worker's index, the number of workers and whether it is the chief, from TF_CONFIG.

    The cluster may list `worker` tasks and at most one `chief`; TF's
    convention makes the chief (or, with none, worker 0) the one whose
    checkpoints and summaries count. Raises UsageError naming what is wrong.
    """
    if not text:
        raise UsageError("--mode=multi_worker needs TF_CONFIG, e.g. "
                         '{"cluster": {"worker": ["host1:port", "host2:port"]}, '
                         '"task": {"type": "worker", "index": 0}}')
    try:
        tf_config = json.loads(text)
    except json.JSONDecodeError as e:
        raise UsageError(f"TF_CONFIG is not valid JSON ({e.msg} at character {e.pos})") from None
    if not isinstance(tf_config, dict):
        raise UsageError("TF_CONFIG must be a JSON object with 'cluster' and 'task'")
    cluster, task = tf_config.get("cluster"), tf_config.get("task")
    if not isinstance(cluster, dict) or not isinstance(task, dict):
        raise UsageError("TF_CONFIG needs a 'cluster' object and a 'task' object")
    unknown = sorted(set(cluster) - {"chief", "worker"})
    if unknown:
        raise UsageError(f"TF_CONFIG cluster has job {unknown[0]!r}; allowed: chief, worker")
    for job, addresses in cluster.items():
        if (not isinstance(addresses, list) or not addresses
                or not all(isinstance(a, str) and ":" in a for a in addresses)):
            raise UsageError(f"TF_CONFIG cluster.{job} must be a non-empty list of 'host:port'")
    if len(cluster.get("chief", [])) > 1:
        raise UsageError("TF_CONFIG cluster.chief may hold one address only")
    task_type, index = task.get("type"), task.get("index")
    if task_type not in cluster:
        raise UsageError(f"TF_CONFIG task.type={task_type!r}: allowed: {', '.join(sorted(cluster))}")
    if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < len(cluster[task_type]):
        raise UsageError(f"TF_CONFIG task.index={index!r}: out of range; cluster.{task_type} has "
                         f"{len(cluster[task_type])} address(es), so 0..{len(cluster[task_type]) - 1}")
    addresses = cluster.get("chief", []) + cluster.get("worker", [])  # TF's task order
    global_index = index if task_type == "chief" else index + len(cluster.get("chief", []))
    is_chief = task_type == "chief" or ("chief" not in cluster and index == 0)
    peers = tuple(a for i, a in enumerate(addresses) if i != global_index)
    return WorkerInfo(global_index, len(addresses), is_chief, peers)


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


def peer_trouble(worker: WorkerInfo) -> str:
    """Which peers look lost, in words, for an error line: a peer is blamed only when it no
    longer accepts connections."""
    down = unreachable(worker.peers)
    if down:
        return f"peer(s) {', '.join(down)} not reachable (never started, or died)"
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
        read_end, self._write_end = os.pipe()
        stderr_read, stderr_write = os.pipe()
        self._local_depth = 0
        self._pid = os.fork()
        if self._pid == 0:  # the child: never returns
            os.close(self._write_end)
            os.close(stderr_write)
            # A stop signal to the whole process group is the worker's to handle; the child
            # ends when the worker closes the pipe.
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            code = _watch(read_end, stderr_read, os.getppid(), worker, timeout, prog)
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
    deadline = None
    filtered = _NativeLineFilter()
    open_fds = [clock, stderr]
    while open_fds:
        wait = None if not timing or clock not in open_fds else max(0.0, deadline - time.monotonic())
        ready, _, _ = select.select(open_fds, [], [], wait)
        if not ready:
            filtered.flush()
            print(f"{prog}: [{worker.name}] no progress for {timeout:g} s while waiting on the peers "
                  f"(--collective_timeout): {peer_trouble(worker)}", file=sys.stderr, flush=True)
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
                deadline = time.monotonic() + timeout
    filtered.flush()
    return 0


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
            os.write(2, b"".join(kept))

    def flush(self) -> None:
        if self._pending:
            self.write(b"\n")
