"""`python -m tower_train.launch --workers=N [--port=P] -- <training flags>`: a multi-worker run on
this machine, in one command.

It starts N processes of `python -m tower_train --mode=multi_worker <training flags>`, each with
its own TF_CONFIG on loopback ports and --num_gpus GPUs of its own (CUDA_VISIBLE_DEVICES), shows
their output with every line led by its worker's tag (`[worker 1/2] ...`; progress lines from
the chief only), and waits for all of them:

- SIGTERM, SIGINT or SIGHUP to the launcher is passed to every worker, which stop after the same
  update and save (the signal rule of docs/faults-and-resume.md); a second one kills them. Under
  nohup (SIGHUP ignored) SIGHUP stays ignored, by the launcher and by the workers.
- A worker that ends early (fails, is killed, stops, or exits 0 before its `done:` line) leaves
  the others to their own lost-peer handling (TF's collective timeout and the watchdog, both
  --collective_timeout); whichever still run --collective_timeout + 10 s later are killed. A
  worker refusing its input (status 2) ends the others at once. A worker suspended (SIGSTOP) is
  said at once, and named as the cause when the others then end; so is one still starting (alive,
  not yet listening on its port) when a worker that waited on it ends, with a longer
  --collective_timeout suggested.
- If the launcher itself dies, by any signal and at any time, every worker gets SIGUSR1 (on
  Linux), a stop signal to it: one that trains stops after the current update and saves, one that
  starts ends at once.
- The exit status is the highest of the workers' (128 + n for a worker ended by signal n),
  leaving out those the launcher killed after another failed, and 1 if that is 0 but a worker
  ended early; one last line names the worker that ended first and how.

It is for one machine (tests, or one worker per GPU); several machines run one worker each under
Slurm (`--cluster=slurm`) or Kubernetes: docs/multi-machine.md.
"""
from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import re
import select
import selectors
import signal
import socket
import subprocess
import sys
import time
from typing import BinaryIO, Callable, Sequence

from absl import flags

from tower_train import cli
from tower_train.training.stop_signals import stop_signals
from tower_train.workers import cluster, peer_watchdog
from tower_train.workers.worker_exit import (describe_status, how_it_ended, shell_status, stopped_by_the_stop_rule,
                                             suspending_signal)
from tower_train import flags as tt_flags
from tower_train.config import TrainConfig
from tower_train.rules import WORKERS_MODE
from tower_train.errors import UsageError
from tower_train.quiet_start import users_environment

PROG = "tower_train.launch"
USAGE = """python -m tower_train.launch --workers=N [--port=P] -- <training flags>

Runs N --mode=multi_worker workers of `python -m tower_train <training flags>` on this machine,
each with its own TF_CONFIG, e.g.

    python -m tower_train.launch --workers=2 -- --num_gpus=1 --accum=8 --train_dir=/tmp/run

For several machines see docs/multi-machine.md (Slurm, Kubernetes).
"""
# Beyond --collective_timeout, what the surviving workers' own lost-peer handling is given to end
# them: the watchdog's connection test of each peer and its line, or a failed collective's line.
LOST_PEER_MARGIN = 10.0
# progress.Progress's log line, as a worker tags it: shown from the chief alone.
_PROGRESS_LINE = re.compile(rb"\[worker \d+/\d+\] step \d+, loss = ")
# The trainer's last line of a run that finished; a worker's exit 0 without it came early.
_DONE_LINE = re.compile(rb"\[worker \d+/\d+\] done: step \d+")
# Every signal a worker may have stopped on: SIGHUP too, sent to a worker itself.
_PR_SET_PDEATHSIG = 1  # linux/prctl.h
_PARENT_DEATH_SIGNAL = signal.SIGUSR1


@dataclasses.dataclass(frozen=True)
class LaunchResult:
    """How the workers ended: the launcher's exit status and one line that says why."""

    status: int
    summary: str


def check_training_flags(args: Sequence[str]) -> TrainConfig:
    """The training flags as every worker will read them, checked once, without TensorFlow.

    Raises UsageError for a bad flag or value, an argument that is not a flag, or a --mode or
    --cluster the launcher does not run (it gives each worker --mode=multi_worker and a TF_CONFIG).
    """
    rest = flags.FLAGS(["tower_train", f"--mode={WORKERS_MODE}", *args])
    if len(rest) > 1:
        raise UsageError(f"unexpected argument {rest[1]!r} among the training flags: only --flags "
                         "are accepted after '--'")
    if flags.FLAGS["help"].value or flags.FLAGS["helpfull"].value:  # cli's, which every worker reads
        raise UsageError("--help after '--' would show each worker's help: put it before '--' for the "
                         "launcher's, or run python -m tower_train --help for the training flags")
    for name, wanted in (("mode", WORKERS_MODE), ("cluster", "tf_config")):
        value = tt_flags.TRAINING_FLAGS[name].value
        if value != wanted:
            raise UsageError(f"--{name}={value}: the launcher runs --{name}={wanted} workers, each "
                             f"with its own TF_CONFIG; leave --{name} out")
    return tt_flags.config_from_flags()


def loopback_addresses(workers: int, port: int | None) -> list[str]:
    """127.0.0.1:port+i for worker i; without a port, ports the system reports free.

    Raises UsageError for a bad count or port, or a port no worker could listen on (another
    process holds it): found here, before any worker starts, rather than by a worker's failure.
    """
    if workers < 1:
        raise UsageError(f"--workers={workers}: must be a whole number >= 1")
    if port is None:
        sockets = [socket.socket() for _ in range(workers)]  # held together: the ports differ
        try:
            for s in sockets:
                s.bind(("127.0.0.1", 0))
            return [f"127.0.0.1:{s.getsockname()[1]}" for s in sockets]
        finally:
            for s in sockets:
                s.close()
    if not 1 <= port <= 65536 - workers:
        raise UsageError(f"--port={port}: must be in 1..{65536 - workers}, so that the {workers} "
                         "worker(s) listen on it and the ports after it")
    for index in range(workers):
        refusal = cluster.why_not_listening(port + index)
        if refusal is not None:
            raise UsageError(f"--port={port}: port {port + index}, worker {index}'s, is {refusal}; "
                             "choose another --port, or leave it out for ports the system reports free")
    return [f"127.0.0.1:{port + i}" for i in range(workers)]


def launch(workers: int, training_args: Sequence[str], port: int | None = None,
           output: BinaryIO | None = None) -> LaunchResult:
    """Runs `workers` multi_worker processes of `python -m tower_train <training_args>` on this
    machine and waits for all of them (see the module doc); call it from the main thread.

    Their output, and the launcher's own lines, go to `output` (default: this process's stderr).
    Raises UsageError for bad arguments, before any worker starts.
    """
    addresses = loopback_addresses(workers, port)
    config = check_training_flags(training_args)
    output = output or sys.stderr.buffer
    received: list[int] = []
    previous = {number: signal.signal(number, lambda number, frame: received.append(number))
                for number in stop_signals()}
    try:
        group = _WorkerGroup(addresses, training_args, config.num_gpus, output)
        return group.wait(received, config.collective_timeout)
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def gpus_of_worker(index: int, per_worker: int, visible: str | None) -> str:
    """CUDA_VISIBLE_DEVICES for worker `index`: GPUs index x per_worker onwards, counted in the
    launcher's own CUDA_VISIBLE_DEVICES when it has one, so that no two workers share a GPU."""
    gpus = visible.split(",") if visible else [str(i) for i in range((index + 1) * per_worker)]
    return ",".join(gpus[index * per_worker:(index + 1) * per_worker])


def _stop_when_the_launcher_dies(launcher: int) -> Callable[[], None] | None:
    """What a worker runs before it starts, on Linux: the launcher's death, however it comes
    (SIGKILL included), sends the worker SIGUSR1 rather than leaving it to train with no one to
    watch it. The run takes its parent-death signal as a stop signal
    (`stop_signals.parent_death_signal`), and until it listens, SIGUSR1's default action ends it
    at once. Not SIGTERM: from the moment TensorFlow loads until the run's stop handlers are in
    place (the strategy's start-up, building, restoring), TensorFlow's coordination service holds
    SIGTERM and drops it. Not SIGHUP: under nohup the worker keeps it ignored."""
    if not sys.platform.startswith("linux"):
        return None

    def stop_with_the_parent() -> None:
        signal.signal(_PARENT_DEATH_SIGNAL, signal.SIG_DFL)  # an ignored one would leave it deaf
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, _PARENT_DEATH_SIGNAL)
        if os.getppid() != launcher:  # it died before the line above
            os.kill(os.getpid(), _PARENT_DEATH_SIGNAL)

    return stop_with_the_parent


class _WorkerGroup:
    """The running workers, their output and their exits."""

    def __init__(self, addresses: list[str], training_args: Sequence[str], gpus_per_worker: int,
                 output: BinaryIO):
        self._count, self._output, self._addresses = len(addresses), output, addresses
        self._pending = [b""] * self._count  # each worker's unfinished last line
        # Its server was seen accepting connections: it reached the strategy's start-up, which
        # waits for every worker's.
        self._listening = [False] * self._count
        self._finished = [False] * self._count  # its `done:` line was seen
        # The signal that last held each suspended, and when it was last seen so; whether it is now.
        self._suspension: list[tuple[int, float] | None] = [None] * self._count
        self._suspended_now = [False] * self._count
        self._processes: list[subprocess.Popen] = []
        for index in range(self._count):
            tf_config = json.dumps({"cluster": {"worker": addresses},
                                    "task": {"type": "worker", "index": index}})
            # A session of its own: a terminal's Ctrl-C reaches the launcher alone, which passes
            # it on once; the same signal twice would kill a worker unsaved.
            self._processes.append(subprocess.Popen(
                [sys.executable, "-m", "tower_train", f"--mode={WORKERS_MODE}", *training_args],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                env={**users_environment(), "TF_CONFIG": tf_config, "CUDA_VISIBLE_DEVICES": gpus_of_worker(
                    index, gpus_per_worker, os.environ.get("CUDA_VISIBLE_DEVICES"))}, start_new_session=True,
                preexec_fn=_stop_when_the_launcher_dies(os.getpid())))
        self._say("started " + ", ".join(
            f"{self._name(i)} (pid {p.pid}) on {addresses[i]}" for i, p in enumerate(self._processes)))

    def _name(self, index: int) -> str:
        return f"worker {index}/{self._count}"

    def _say(self, line: str) -> None:
        self._output.write(f"{PROG}: {line}\n".encode())
        self._output.flush()

    def _show(self, index: int, data: bytes) -> None:
        lines = (self._pending[index] + data).split(b"\n")
        self._pending[index] = lines.pop()
        tag = f"[{self._name(index)}]".encode()
        self._finished[index] |= any(_DONE_LINE.search(line) for line in lines)
        shown = [tag + b" " + line.replace(tag + b" ", b"", 1) + b"\n" for line in lines
                 if index == 0 or not _PROGRESS_LINE.search(line)]
        if shown:
            self._output.write(b"".join(shown))
            self._output.flush()

    def _kill(self, indices: list[int]) -> None:
        for index in indices:
            self._processes[index].kill()

    def wait(self, received: list[int], collective_timeout: float) -> LaunchResult:
        returncodes: list[int | None] = [None] * self._count  # Popen's: -n for a kill by signal n
        killed_after_failure: list[int] = []
        killed_at_once = False  # those for a worker that refused its input
        first_end: str | None = None  # the first early end in words: who ended first, and how
        forwarded: list[int] = []  # the stop signals passed on to the workers
        deadline = None
        with selectors.DefaultSelector() as selector:
            for index, process in enumerate(self._processes):
                selector.register(process.stdout, selectors.EVENT_READ, index)
            while any(r is None for r in returncodes):
                self._read(selector, 0.2)
                running = [i for i, r in enumerate(returncodes) if r is None]
                for number in received[len(forwarded):]:
                    forwarded.append(number)
                    name = signal.Signals(number).name
                    if len(forwarded) == 1:
                        self._say(f"{name} received: passed to every worker, which stop after the "
                                  "same update and save (again to kill them)")
                        for index in running:
                            self._processes[index].send_signal(number)
                    else:
                        self._say(f"{name} received again: killing the workers")
                        self._kill(running)
                for index in running:
                    returncode = self._processes[index].poll()
                    if returncode is None:
                        self._watch_suspension(index)
                        self._watch_start(index)
                        continue
                    self._drain(selector, index)  # its last lines, `done:` among them, came first
                    returncodes[index] = returncode
                    if (returncode == 0 and self._finished[index]) or forwarded or first_end is not None:
                        continue
                    how = how_it_ended(returncode, self._finished[index],
                                       self._suspended_within(index, collective_timeout))
                    first_end = self._first_end(index, how, running, collective_timeout)
                    others = [i for i in running if self._processes[i].poll() is None]
                    if returncode == 2:  # bad input: no peer will get further
                        killed_after_failure, killed_at_once = others, True
                        self._kill(others)
                    elif others:
                        deadline = time.monotonic() + collective_timeout + LOST_PEER_MARGIN
                        self._say(f"{self._name(index)} {how}; the others get --collective_timeout "
                                  f"+ {LOST_PEER_MARGIN:g} s = {deadline - time.monotonic():.0f} s "
                                  "to notice and end")
                if deadline is not None and time.monotonic() > deadline:
                    deadline = None
                    killed_after_failure = [i for i, r in enumerate(returncodes) if r is None]
                    self._kill(killed_after_failure)
            # What the workers wrote last; a child of theirs still holding the pipe is not waited for.
            end = time.monotonic() + 5
            while selector.get_map() and time.monotonic() < end:
                self._read(selector, end - time.monotonic())
        for index, rest in enumerate(self._pending):
            if rest:
                self._show(index, b"\n")
        return self._result(returncodes, first_end, killed_after_failure, killed_at_once, forwarded)

    def _first_end(self, index: int, how: str, running: list[int], collective_timeout: float) -> str:
        """Who ended first and how, in words; led by a peer that was suspended, or still starting,
        while the others waited on it, whose doing their end then is."""
        first_end = f"{self._name(index)} ended first: {how}"
        others = [i for i in running if i != index]
        for other in others:
            suspended_by = self._suspended_within(other, collective_timeout)
            if suspended_by is not None:
                return (f"{self._name(other)} was suspended by {signal.Signals(suspended_by).name} "
                        f"while the others waited on it; {first_end}")
        # A worker that listened was in the strategy's start-up, waiting for the servers of those
        # that never did; one still alive is late, not lost.
        late = [i for i in others if self._listening[index] and not self._listening[i]
                and self._processes[i].poll() is None]
        if late:
            return (f"{', '.join(map(self._name, late))} {'was' if len(late) == 1 else 'were'} still "
                    "starting (alive, not yet listening on its port) while the others waited on it; "
                    f"{first_end}; a longer --collective_timeout (now {collective_timeout:g} s) gives "
                    "a slow start (a long --data_module import, say) time to finish")
        return first_end

    def _watch_start(self, index: int) -> None:
        """Notes that a running worker's server accepts connections, once it does."""
        if not self._listening[index]:
            self._listening[index] = not peer_watchdog.unreachable((self._addresses[index],))

    def _watch_suspension(self, index: int) -> None:
        """Notes, and says once, that a running worker is suspended (SIGSTOP, SIGTSTP): its peers
        wait on it, and their failure is then its doing. The suspension is kept with the time it was
        last seen, not forgotten when the worker is seen running: a suspended worker that is killed
        is, for an instant, neither suspended nor ended."""
        suspended_by = suspending_signal(self._processes[index].pid)
        if suspended_by is not None:
            if not self._suspended_now[index]:
                self._say(f"{self._name(index)} is suspended by {signal.Signals(suspended_by).name}: "
                          "the others wait on it (SIGCONT resumes it), and end after "
                          "--collective_timeout")
            self._suspension[index] = (suspended_by, time.monotonic())
        self._suspended_now[index] = suspended_by is not None

    def _suspended_within(self, index: int, collective_timeout: float) -> int | None:
        """The signal that held worker `index` suspended lately enough to be why its peers, which
        wait --collective_timeout (+ the margin) on it, ended; or None."""
        suspension = self._suspension[index]
        lately = suspension and time.monotonic() - suspension[1] <= collective_timeout + LOST_PEER_MARGIN
        return suspension[0] if lately else None

    def _read(self, selector: selectors.BaseSelector, timeout: float) -> None:
        for key, _ in selector.select(timeout):
            self._read_key(selector, key)

    def _drain(self, selector: selectors.BaseSelector, index: int) -> None:
        """Reads what worker `index`, which has ended, left in its pipe."""
        key = next((k for k in selector.get_map().values() if k.data == index), None)
        for _ in range(64):  # at most 4 MiB: a child of its own could hold the pipe and write on
            if key is None or not select.select([key.fd], [], [], 0)[0]:
                return
            if not self._read_key(selector, key):
                return

    def _read_key(self, selector: selectors.BaseSelector, key: selectors.SelectorKey) -> bool:
        """Shows what the pipe holds; False at its end, which closes it."""
        data = os.read(key.fd, 1 << 16)
        if data:
            self._show(key.data, data)
            return True
        selector.unregister(key.fileobj)
        key.fileobj.close()
        return False

    def _result(self, returncodes: list[int], first_end: str | None, killed_after_failure: list[int],
                killed_at_once: bool, forwarded: list[int]) -> LaunchResult:
        statuses = [shell_status(r) for r in returncodes]
        counted = [s for i, s in enumerate(statuses) if i not in killed_after_failure]
        listing = ", ".join(describe_status(s) for s in statuses)
        if forwarded:
            summary = (f"{signal.Signals(forwarded[0]).name} passed to the workers; their exit "
                       f"statuses: {listing}")
        elif first_end is None:
            summary = f"all {self._count} workers finished; exit statuses: {listing}"
        elif all(stopped_by_the_stop_rule(r) for r in returncodes):
            summary = (f"all {self._count} workers stopped on a stop signal (their lines say which, "
                       f"and after which update); exit statuses: {listing}")
        else:
            summary = first_end
            if killed_at_once:
                summary += "; the others were killed at once"
            elif killed_after_failure:
                summary += (f"; killed {', '.join(self._name(i) for i in killed_after_failure)}, "
                            "still running after --collective_timeout + "
                            f"{LOST_PEER_MARGIN:g} s")
            summary += f"; exit statuses: {listing}"
        # A worker that ended early fails the run, even when its own status and the others' were 0.
        return LaunchResult(max(counted) or int(first_end is not None), summary)


def main(argv: list[str] | None = None) -> int:
    """Runs `python -m tower_train.launch`; returns the exit status."""
    return cli.command(lambda: _launch_command(sys.argv if argv is None else argv))


def _launch_command(argv: list[str]) -> int:
    launch_flags, holders = tt_flags.define_launch_flags()
    if "--" not in argv and not {"-h", "--help"} & set(argv):
        raise UsageError("missing '--' before the training flags: python -m tower_train.launch "
                         "--workers=N [--port=P] -- <training flags>")
    split = argv.index("--") if "--" in argv else len(argv)
    rest = launch_flags([argv[0], *argv[1:split]])
    if holders["help"].value:
        raise cli.HelpShown(f"{USAGE.strip()}\n\nThe launcher's flags, before '--':\n" + "\n".join(
            f"  --{name}: {launch_flags[name].help}" for name in ("workers", "port")))
    if len(rest) > 1:
        raise UsageError(f"unexpected argument {rest[1]!r} before '--': the launcher takes --workers "
                         "and --port; the training flags follow '--'")
    if holders["workers"].value is None:
        raise UsageError("--workers is required: the number of worker processes to start")
    result = launch(holders["workers"].value, argv[split + 1:], holders["port"].value)
    print(f"{PROG}: {result.summary}", file=sys.stderr)
    return result.status


if __name__ == "__main__":
    cli.run(main)
