"""tower_train.workers.peer_watchdog: which peers are blamed when a worker waits on them too long, and how
(not started yet, in the strategy's start-up), and the watchdog's child carrying a worker's stderr."""
import os
import signal
import socket
import subprocess
import sys
import threading

import pytest

from tower_train.workers import peer_watchdog
from tower_train.workers.cluster import WorkerInfo
from test_cli_errors import ROOT


def test_a_peer_whose_port_closes_just_after_its_connections_broke_is_still_blamed():
    listening = socket.create_server(("127.0.0.1", 0))
    address = f"127.0.0.1:{listening.getsockname()[1]}"
    threading.Timer(0.5, listening.close).start()  # a killed peer's port outlives its connections
    assert peer_watchdog.peer_trouble(WorkerInfo(index=0, count=2, is_chief=True, peers=(address,))) == (
        f"peer(s) {address} (worker 1/2) not reachable (ended, or died)")


def closed_port_address():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.parametrize("phase", ["start-up", "training"])
def test_a_peer_that_has_not_started_yet_is_named_as_late_and_a_lost_one_as_gone(phase):
    """Worker 1 of 3: worker 0 listens, worker 2 does not. The watchdog's clock runs out in the
    strategy's start-up (its first progress, nothing after it) or in training (progress after
    local work): worker 2 is named, as not started yet with a longer --collective_timeout
    suggested, or as gone."""
    script = """if True:
        import sys, time
        from tower_train.workers import cluster
        from tower_train.workers import peer_watchdog
        watchdog = peer_watchdog.PeerWatchdog(cluster.WorkerInfo(1, 3, False, tuple(sys.argv[2:])), 0.5, "t")
        watchdog.progress()  # the strategy's start-up
        if sys.argv[1] == "training":
            with watchdog.local_work():
                pass
        time.sleep(60)  # the watchdog kills it first
    """
    with socket.create_server(("127.0.0.1", 0)) as listening:
        first, third = f"127.0.0.1:{listening.getsockname()[1]}", closed_port_address()
        result = subprocess.run([sys.executable, "-c", script, phase, first, third], cwd=ROOT,
                                capture_output=True, text=True, timeout=60)
    assert result.returncode == -signal.SIGKILL, result.stderr
    trouble = ("not reachable: not started yet (still starting, or never started); a longer "
               "--collective_timeout gives a slow start (a long --data_module import, say) time to "
               "finish" if phase == "start-up" else "not reachable (ended, or died)")
    assert result.stderr == (f"t: [worker 1/3] no progress for 0.5 s while waiting on the peers "
                             f"(--collective_timeout): peer(s) {third} (worker 2/3) {trouble}\n")


def test_the_watchdog_carries_a_workers_stderr_on_when_no_one_reads_it():
    """A launcher that dies leaves its workers' output with no reader: the watchdog's child drops
    the lines it carries, rather than failing and returning, a second copy of the worker, into
    the worker's code (and leaving the worker's own writes to fail)."""
    script = """if True:
        import os, sys, time
        from tower_train.workers import cluster
        from tower_train.workers import peer_watchdog
        try:
            watchdog = peer_watchdog.PeerWatchdog(cluster.WorkerInfo(0, 2, True, ("127.0.0.1:1",)), 60, "t")
        except BaseException as e:
            print(f"{os.getpid()} returned from the watchdog's start: {e!r}", flush=True)
            raise
        for _ in range(3):
            print("a line no one reads", file=sys.stderr, flush=True)
            time.sleep(0.1)
        watchdog.stop()
        print("done", flush=True)
    """
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the worker starts
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, stderr=write_end,
                            stdout=subprocess.PIPE, text=True, timeout=60)
    os.close(write_end)
    assert (result.returncode, result.stdout) == (0, "done\n")
