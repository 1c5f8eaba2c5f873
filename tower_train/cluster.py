"""Multi-worker plumbing: this worker's place from TF_CONFIG, and a watchdog for lost peers."""
from __future__ import annotations

import dataclasses
import json
import os
import select
import signal
import socket
import sys

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
    """Which peers look lost, in words, for an error line."""
    down = unreachable(worker.peers)
    if down:
        return f"peer(s) {', '.join(down)} not reachable (never started, or died)"
    return f"peers {', '.join(worker.peers)} reachable but not answering"


class PeerWatchdog:
    """Ends this worker if training makes no progress for `timeout` seconds.

    A peer that never starts, or dies, leaves the collectives of the others
    waiting, and TF's collective timeout does not cover the strategy's
    start-up, which blocks in C++ without releasing the GIL. So the watchdog
    is a forked child process, started before TensorFlow is loaded. The
    trainer calls `progress()` after every phase that needs the peers; if
    none comes in time, the child names the peers that no longer accept
    connections, prints one line and kills the worker. When the worker ends,
    the pipe closes and the child exits.
    """

    def __init__(self, worker: WorkerInfo, timeout: float, prog: str):
        read_end, self._write_end = os.pipe()
        self._pid = os.fork()
        if self._pid == 0:  # the child: never returns
            os.close(self._write_end)
            # A stop signal to the whole process group is the worker's to handle; the child
            # ends when the worker closes the pipe.
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            code = _watch(read_end, os.getppid(), worker, timeout, prog)
            os._exit(code)
        os.close(read_end)

    def progress(self) -> None:
        try:
            os.write(self._write_end, b".")
        except BrokenPipeError:
            pass  # the watchdog was killed from outside: train on unwatched

    def stop(self) -> None:
        os.close(self._write_end)
        os.waitpid(self._pid, 0)


def _watch(read_end: int, worker_pid: int, worker: WorkerInfo, timeout: float, prog: str) -> int:
    while True:
        ready, _, _ = select.select([read_end], [], [], timeout)
        if not ready:
            break
        if not os.read(read_end, 4096):
            return 0  # the worker closed the pipe: it is done
    print(f"{prog}: [{worker.name}] no progress for {timeout:g} s (--collective_timeout): "
          f"{peer_trouble(worker)}", file=sys.stderr, flush=True)
    os.kill(worker_pid, signal.SIGKILL)
    return 1
