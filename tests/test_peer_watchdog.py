"""tower_train.workers.peer_watchdog: which peers are blamed when a worker waits on them too long, and the
watchdog's child carrying a worker's stderr."""
import os
import socket
import subprocess
import sys
import threading

from tower_train.workers import peer_watchdog
from tower_train.workers.cluster import WorkerInfo
from test_cli_errors import ROOT


def test_a_peer_whose_port_closes_just_after_its_connections_broke_is_still_blamed():
    listening = socket.create_server(("127.0.0.1", 0))
    address = f"127.0.0.1:{listening.getsockname()[1]}"
    threading.Timer(0.5, listening.close).start()  # a killed peer's port outlives its connections
    assert peer_watchdog.peer_trouble(WorkerInfo(index=0, count=2, is_chief=True, peers=(address,))) == (
        f"peer(s) {address} not reachable (never started, or died)")


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
