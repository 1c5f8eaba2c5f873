"""Multi-worker plumbing: this worker's place from TF_CONFIG or Slurm, the strategy's cluster, and its
server's port. The watchdog for lost peers is `peer_watchdog`'s."""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import re
import socket
from typing import Iterator, Mapping

from tower_train.errors import TrainingError, UsageError

# The first port of each node's Slurm tasks; TensorFlow's SlurmClusterResolver's own default.
SLURM_PORT_VARIABLE, DEFAULT_SLURM_PORT = "TOWER_TRAIN_SLURM_PORT", 8888


@dataclasses.dataclass(frozen=True)
class WorkerInfo:
    """This process's place in the cluster; one worker of one outside multi_worker mode."""

    index: int = 0
    count: int = 1
    is_chief: bool = True
    peers: tuple[str, ...] = ()  # "host:port" of every other task, in cluster order
    slurm_port: int | None = None  # the cluster is an srun step's, its ports from this; None: TF_CONFIG's
    address: str = ""  # "host:port" this worker's server listens on; "" outside a cluster

    @property
    def name(self) -> str:
        return f"worker {self.index}/{self.count}"

    def peer_name(self, address: str) -> str:
        """One of `peers` as "host:port (worker i/N)"."""
        position = self.peers.index(address)
        return f"{address} (worker {position + (position >= self.index)}/{self.count})"


SINGLE_PROCESS = WorkerInfo()


def this_worker(cluster: str, environ: Mapping[str, str] = os.environ) -> WorkerInfo:
    """This process's place in a multi-worker cluster, as `--cluster` says to find it (see
    config.CLUSTERS); read without TensorFlow, so that the watchdog can start before it loads.
    Raises UsageError naming what is missing or wrong."""
    if cluster == "auto":
        cluster = "slurm" if "SLURM_PROCID" in environ else "tf_config"
    if cluster == "slurm":
        return parse_slurm(environ)
    return parse_tf_config(environ.get("TF_CONFIG"))


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
    return WorkerInfo(global_index, len(addresses), is_chief, peers, address=addresses[global_index])


def parse_slurm(environ: Mapping[str, str]) -> WorkerInfo:
    """This task's place in its srun step, laid out as TensorFlow's SlurmClusterResolver lays it
    out: one worker per task, the nodes in sorted name order, the tasks of a node on consecutive
    ports from $TOWER_TRAIN_SLURM_PORT; SLURM_PROCID is the worker's index and task 0 the chief.

    The strategy is built from the resolver itself (`strategy_resolver`), which is checked
    against this reading. Raises UsageError for a variable that is missing, malformed or at odds
    with the others.
    """
    rank = _slurm_count(environ, "SLURM_PROCID", 0)
    tasks = _slurm_count(environ, "SLURM_STEP_NUM_TASKS", 1)
    nodes = expand_hostlist(_slurm_variable(environ, "SLURM_STEP_NODELIST"))
    per_node = expand_tasks_per_node(_slurm_variable(environ, "SLURM_STEP_TASKS_PER_NODE"))
    port_text = environ.get(SLURM_PORT_VARIABLE, str(DEFAULT_SLURM_PORT))
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535 - max(per_node) + 1:
        raise UsageError(f"{SLURM_PORT_VARIABLE}={port_text}: must be a port in 1.."
                         f"{65536 - max(per_node)} (a node's {max(per_node)} task(s) listen on it "
                         "and the ports after it)")
    port = int(port_text)
    if len(set(nodes)) != len(nodes):
        raise UsageError(f"SLURM_STEP_NODELIST={environ['SLURM_STEP_NODELIST']}: names a node twice")
    if len(per_node) != len(nodes) or sum(per_node) != tasks:
        raise UsageError(
            f"Slurm's variables disagree: SLURM_STEP_NODELIST has {len(nodes)} node(s) and "
            f"SLURM_STEP_TASKS_PER_NODE={environ['SLURM_STEP_TASKS_PER_NODE']} gives "
            f"{len(per_node)} node(s) {sum(per_node)} task(s), but SLURM_STEP_NUM_TASKS={tasks}")
    if rank >= tasks:
        raise UsageError(f"SLURM_PROCID={rank}: out of range for SLURM_STEP_NUM_TASKS={tasks} "
                         f"(0..{tasks - 1})")
    addresses = [f"{node}:{port + k}" for node, count in sorted(zip(nodes, per_node))
                 for k in range(count)]
    return WorkerInfo(rank, tasks, rank == 0, tuple(a for i, a in enumerate(addresses) if i != rank),
                      slurm_port=port, address=addresses[rank])


def _slurm_variable(environ: Mapping[str, str], name: str) -> str:
    if not environ.get(name):
        raise UsageError(f"--cluster=slurm: {name} is not set; run each worker as a task of a Slurm "
                         "step: srun python -m tower_train --mode=multi_worker --cluster=slurm ...")
    return environ[name]


def _slurm_count(environ: Mapping[str, str], name: str, minimum: int) -> int:
    text = _slurm_variable(environ, name)
    if not text.isdigit() or int(text) < minimum:
        raise UsageError(f"{name}={text}: must be a whole number >= {minimum}")
    return int(text)


def expand_hostlist(text: str) -> list[str]:
    """Slurm's node list as the resolver reads it: 'n[01-02,5],m' -> n01, n02, n05, m (prefix and
    one bracket of numbers and ranges per name, digits padded as the range's first number)."""
    hosts = []
    for part in re.split(r",(?![^\[]*\])", text):  # commas outside brackets
        match = re.fullmatch(r"([^,\[\]]+)(?:\[([0-9,-]+)\])?", part)
        if match is None:
            raise UsageError(f"SLURM_STEP_NODELIST={text}: cannot read {part!r}; expected names "
                             "such as node1 or node[01-04,7]")
        prefix, ranges = match.groups()
        if ranges is None:
            hosts.append(prefix)
            continue
        for span in ranges.split(","):
            first, _, last = span.partition("-")
            last = last or first
            if not (first.isdigit() and last.isdigit()) or int(first) > int(last):
                raise UsageError(f"SLURM_STEP_NODELIST={text}: cannot read the range {span!r}")
            hosts.extend(prefix + str(i).zfill(len(first)) for i in range(int(first), int(last) + 1))
    return hosts


def expand_tasks_per_node(text: str) -> list[int]:
    """Slurm's tasks per node: '2(x3),1' -> 2, 2, 2, 1."""
    counts = []
    for part in text.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part)
        if match is None or int(match[1]) < 1:
            raise UsageError(f"SLURM_STEP_TASKS_PER_NODE={text}: cannot read {part!r}; expected "
                             "counts such as 2(x3),1")
        counts.extend([int(match[1])] * int(match[2] or 1))
    return counts


def strategy_resolver(worker: WorkerInfo, gpus: int):
    """The cluster resolver MultiWorkerMirroredStrategy is built with: None (TF_CONFIG, TF's
    default), or, for Slurm, the cluster of TensorFlow's SlurmClusterResolver with `gpus` local
    GPUs (0: one replica on the CPU). Raises TrainingError if the resolver places this worker
    otherwise than `worker` says: its index shards the data."""
    if worker.slurm_port is None:
        return None
    import tensorflow as tf

    resolver_module = tf.distribute.cluster_resolver
    # The devices are the device plan's (--num_gpus, and the GPUs Slurm makes visible), so the
    # resolver sets none. It lists only the tasks it can give GPUs to, so it is told of one per task.
    slurm = resolver_module.SlurmClusterResolver(port_base=worker.slurm_port, gpus_per_node=worker.count,
                                                 gpus_per_task=1, auto_set_gpu=False)
    spec = slurm.cluster_spec()
    task_type, task_id = slurm.get_task_info()
    theirs = spec.as_dict().get("worker", [])
    if ((task_type, task_id) != ("worker", worker.index)
            or [a for i, a in enumerate(theirs) if i != worker.index] != list(worker.peers)):
        raise TrainingError(f"TensorFlow's SlurmClusterResolver makes this task {task_type} "
                            f"{task_id} of {theirs}, tower-train worker {worker.index} with peers "
                            f"{list(worker.peers)}: refusing to train with the two at odds")
    return resolver_module.SimpleClusterResolver(spec, task_type="worker", task_id=task_id,
                                                 num_accelerators={"GPU": gpus}, rpc_layer="grpc")


def why_not_listening(port: int) -> str | None:
    """Why no server could listen on `port` of this machine ("in use by another process"), or None
    if one could. Tried as TensorFlow's gRPC server binds: every address, IPv6 and IPv4 together
    where the machine has IPv6; a port that an earlier run's connections left in TIME_WAIT is free
    to it (SO_REUSEADDR)."""
    try:
        probe = socket.socket(socket.AF_INET6)
    except OSError:  # no IPv6 here: the server binds IPv4 alone
        probe = socket.socket(socket.AF_INET)
    with probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if probe.family == socket.AF_INET6:
            probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        try:
            probe.bind(("::" if probe.family == socket.AF_INET6 else "0.0.0.0", port))
        except OSError as e:
            return "in use by another process" if e.errno == errno.EADDRINUSE else e.strerror.lower()
    return None


@contextlib.contextmanager
def server_start(worker: WorkerInfo) -> Iterator[None]:
    """Around the multi-worker strategy's start: TensorFlow's bare `Could not start gRPC server`
    (a traceback that names no port) becomes one UsageError line naming this worker's port."""
    import tensorflow as tf

    try:
        yield
    except tf.errors.UnknownError as e:
        if "Could not start gRPC server" not in str(e):
            raise
        port = int(worker.address.rpartition(":")[2])
        where = ("TF_CONFIG" if worker.slurm_port is None
                 else f"from {SLURM_PORT_VARIABLE}={worker.slurm_port}")
        reason = why_not_listening(port) or "free now, yet TensorFlow's gRPC server could not listen on it"
        raise UsageError(f"[{worker.name}] cannot listen on port {port}, of its address "
                         f"{worker.address} ({where}): the port is {reason}; give the workers free "
                         "ports") from None
