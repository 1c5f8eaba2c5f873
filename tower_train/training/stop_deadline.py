"""The stop deadline: a separate process that ends a run which cannot reach an update boundary.

Started by `StopSignals.listen` as `python stop_deadline.py PID GRACE TRAIN_DIR PROG STOPS`, with
its stdin the read end of a pipe; STOPS are the numbers of the run's stop signals, by commas
(SIGHUP is not among them under nohup). The run's C-level signal handler writes the number of every
signal it gets into that pipe (`signal.set_wakeup_fd`), even while a long native op holds the
GIL and no Python handler can run. The first of STOPS starts a clock of GRACE seconds;
the run writes BOUNDARY when it reaches an update boundary (it then saves, however long that
takes). If the clock runs out first, this process prints one line and SIGKILLs the run, whose
checkpoints are left as they were. End of file (the run exited) ends it.

It imports only the standard library: starting it must not load TensorFlow.
"""
import os
import re
import select
import signal
import sys
import time

BOUNDARY = 0  # no signal has number 0


def what_is_kept(train_dir: str) -> str:
    try:
        with open(os.path.join(train_dir, "checkpoint")) as f:
            match = re.search(r'^model_checkpoint_path: "(.*)"', f.read(), re.M)
    except OSError:
        match = None
    if match is None:
        return "no checkpoint had been written yet"
    return f"the last checkpoint, {os.path.join(train_dir, match.group(1))}, is intact"


def watch(run_pid: int, grace: float, train_dir: str, prog: str, stops: set[int]) -> int:
    deadline, received = None, None
    while True:
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready, _, _ = select.select([0], [], [], timeout)
        if not ready:
            break
        data = os.read(0, 64)
        if not data:
            return 0  # the run exited
        for number in data:
            if number == BOUNDARY:
                return 0
            if number in stops and deadline is None:
                deadline, received = time.monotonic() + grace, signal.Signals(number).name
    print(f"{prog}: no update boundary within {grace:g} s of {received} (--stop_grace_period): "
          f"exited without saving; {what_is_kept(train_dir)}",
          file=sys.stderr, flush=True)
    os.kill(run_pid, signal.SIGKILL)
    return 1


if __name__ == "__main__":
    # A Ctrl-C or a closed terminal reaches the whole process group; the run decides what a stop
    # means.
    stops = {int(number) for number in sys.argv[5].split(",")}
    for number in stops:
        signal.signal(number, signal.SIG_IGN)
    sys.exit(watch(int(sys.argv[1]), float(sys.argv[2]), sys.argv[3], sys.argv[4], stops))
