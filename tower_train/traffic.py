"""Bytes that cross devices in one update, counted from the traced graphs.

`count_traffic` takes the concrete functions an update runs, each with the
number of times it runs per update, and counts what crosses devices in them:

- Every edge whose producer and consumer run on different devices moves the
  tensor's bytes once per (tensor, consumer device), as the runtime's one
  _Send/_Recv pair per such pair does.
- An op that takes a resource (ReadVariableOp, AssignVariableOp,
  ResourceApplyAdam, ...) runs on the resource's device, whatever device its
  graph node names, because that is where TensorFlow's placer puts it; a
  variable's device comes from the function's captures. The function's
  arguments are counted from `argument_device` (the host, where the stream
  is made: the shards a step's feed copies ahead to accelerators cross from
  there, only ahead of the update; on CPU devices the graph copies them),
  and its results are fetched there. An op that names no
  device runs there too, as the placer's default device does when the caller
  names none. Constants are not counted: they are built where they are used.
- A collective (CollectiveReduceV2, NcclAllReduce, ...) moves its data in the
  runtime, not along the graph's edges: the bytes entering it, per replica,
  are counted apart (`Traffic.collective`). A ring all-reduce of B bytes over
  R replicas sends 2 (R - 1) / R x B bytes per replica over the wire.
- A function call inside the function (a `tf.cond`'s branches, a nested
  `tf.function`) counts as one op on its own device: its inputs are counted,
  not what moves inside it (tower-train's branches run on the parameter
  device, where their inputs already are).

Each counted tensor is put in one category, from the variables it was
computed from (`roles` names them):

- "weights": read from a weights variable (the trainable variables, or a
  tower's copy of them) and nothing else, e.g. the weights sent to a tower;
- "statistics": read from a statistics variable (BN's moving statistics) and
  nothing else, or written into one (a tower's new moving mean);
- "gradients": computed from an accumulator (gradient, loss or weight sums),
  or from weights and input together, or from input on another device than
  the arguments' (a tower's gradient, loss sum and weight sum at K = 1); in a
  strategy mode that reduces by copies, also the reduced gradient sent back to
  every replica;
- "input": computed from the function's arguments alone on the device they
  arrive on (a tower's shard);
- "other": anything else (the loss scale), and the function's results, fetched
  to `argument_device` (a loss, a weight sum).
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Iterable, Mapping, Sequence

import tensorflow as tf

CATEGORIES = ("weights", "gradients", "statistics", "input", "other")
# Roles a variable can have in `count_traffic`'s `roles`; the other variables count as "other".
# "held": variables that never leave their device, listed for the bytes each device holds.
ROLES = ("weights", "gradients", "statistics", "held")
# Ops that call another function: placed by their own device, never by a resource input.
_CALLS = {"If", "StatelessIf", "While", "StatelessWhile", "Case", "StatelessCase", "PartitionedCall",
          "StatefulPartitionedCall"}
_WRITES_PREFIXES = ("Assign", "ResourceApply", "ResourceSparseApply", "ResourceScatter")
# The ops that do an update's arithmetic, their gradients included: where they run, it computes.
_COMPUTE_PREFIXES = ("Conv", "DepthwiseConv", "MatMul", "BatchMatMul", "_FusedConv", "_FusedMatMul", "Einsum")
_NOT_DATA = (tf.resource, tf.variant)


@dataclasses.dataclass(frozen=True)
class Traffic:
    """Bytes per update.

    copied: by category (`CATEGORIES`), moved between devices along the graphs' edges.
    collective: by category, entering collective ops, summed over replicas.
    sent, received: by device (full device names), what `copied` counts leaving and reaching it.
    collective_in: by device, what `collective` counts entering that device's collectives.
    """

    copied: Mapping[str, int]
    collective: Mapping[str, int]
    sent: Mapping[str, int]
    received: Mapping[str, int]
    collective_in: Mapping[str, int]

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {field.name: dict(getattr(self, field.name)) for field in dataclasses.fields(self)}

    @property
    def busiest_device_bytes(self) -> float:
        """The largest of any device's bytes sent or received per update (the larger direction
        of its full-duplex link). A collective is taken as a ring all-reduce: of B bytes entering
        on each of R replicas, 2 (R - 1) / R x B leave and reach each replica."""
        ring = len(self.collective_in)
        wire = {d: 2 * (ring - 1) / ring * b for d, b in self.collective_in.items()}
        devices = set(self.sent) | set(self.received) | set(wire)
        return max((max(self.sent.get(d, 0), self.received.get(d, 0)) + wire.get(d, 0.0)
                    for d in devices), default=0)

    def link_seconds(self, gigabits_per_second: float) -> float:
        """Predicted communication time per update if every device had one full-duplex link of
        this speed and nothing else limited it: the busiest device's bytes at that speed."""
        return self.busiest_device_bytes * 8 / (gigabits_per_second * 1e9)


def device_name(device: str) -> str:
    """A device string in full: '/cpu:1', '/device:CPU:1' and
    '/job:localhost/replica:0/task:0/device:CPU:1' all become the last; another task's
    device stays another device. '' (no device named) stays ''."""
    if not device:
        return ""
    spec = tf.DeviceSpec.from_string(device)
    return (f"/job:{spec.job or 'localhost'}/replica:{spec.replica or 0}/task:{spec.task or 0}"
            f"/device:{spec.device_type}:{spec.device_index or 0}")


def _components(variable) -> tuple[tf.Variable, ...]:
    """The tf.Variables behind a tf.Variable, a Keras variable or a distributed variable (one
    per replica)."""
    import keras

    if isinstance(variable, keras.Variable):
        variable = variable.value
    components = getattr(variable, "values", None)  # a DistributedVariable's per-replica variables
    return components if isinstance(components, tuple) else (variable,)


def compute_devices(functions: Iterable[object], default_device: str) -> list[str]:
    """Where an update computes: the devices of the convolutions and matmuls (and their
    gradients) in the graphs of `functions` (concrete functions), sorted, as '/gpu:0'. An op inside
    a called function (a tf.cond's branch, an XLA-compiled tower) runs on the call's device
    unless it names its own; an op that names none runs on `default_device`, where TensorFlow's
    placer puts it when the caller names none."""
    library, found, walked = {}, set(), set()

    def walk(nodes, device: str) -> None:
        for node in nodes:
            here = node.device or device
            if node.op.startswith(_COMPUTE_PREFIXES):
                spec = tf.DeviceSpec.from_string(here)
                found.add((spec.device_type.lower(), spec.device_index or 0))
            for attr in node.attr.values():
                for called in [attr.func] if attr.HasField("func") else attr.list.func:
                    if called.name in library and (called.name, here) not in walked:
                        walked.add((called.name, here))
                        walk(library[called.name].node_def, here)

    for function in functions:
        graph_def = function.graph.as_graph_def()
        library.update({f.signature.name: f for f in graph_def.library.function})
        walk(graph_def.node, default_device)
    return [f"/{kind}:{index}" for kind, index in sorted(found)]


def variable_handles(variable) -> list[tf.Tensor]:
    """The resource handles behind a tf.Variable, a Keras variable or a distributed variable
    (one per replica)."""
    return [c.handle for c in _components(variable)]


def state_bytes_per_device(variables: Iterable) -> dict[str, int]:
    """The bytes of `variables` that each device holds (full device names): a distributed
    variable's copy counts on each replica's device, and a variable listed twice counts once."""
    held: collections.Counter = collections.Counter()
    seen = set()
    for variable in variables:
        for component in _components(variable):
            if id(component) not in seen:
                seen.add(id(component))
                held[device_name(component.device)] += component.shape.num_elements() * component.dtype.size
    return dict(held)


def count_traffic(runs: Iterable[tuple[object, int]], roles: Mapping[str, Sequence],
                  argument_device: str) -> Traffic:
    """The bytes per update that cross devices in `runs`, by category (see the module docstring).

    Args:
      runs: (concrete function, how many times an update runs it).
      roles: for each of `ROLES`, the variables that have it (tf, Keras or distributed
        variables); every other variable's reads count as "other".
      argument_device: where the functions' arguments arrive and their results go.
    """
    unknown = set(roles) - set(ROLES)
    if unknown:
        raise ValueError(f"roles {sorted(unknown)}: not among {ROLES}")
    role_of = {id(handle): role for role, variables in roles.items() for v in variables
               for handle in variable_handles(v)}
    totals = [collections.Counter() for _ in dataclasses.fields(Traffic)]
    for function, times in runs:
        for total, counts in zip(totals, _count_function(function, role_of, device_name(argument_device)),
                                 strict=True):
            total.update({key: times * value for key, value in counts.items()})
    copied, collective, sent, received, collective_in = totals
    return Traffic({c: copied[c] for c in CATEGORIES}, {c: collective[c] for c in CATEGORIES},
                   dict(sent), dict(received), dict(collective_in))


def _count_function(function, role_of: Mapping[int, str],
                    argument_device: str) -> tuple[collections.Counter, ...]:
    """(copied, collective, sent, received, collective_in) of one run of `function`."""
    graph = function.graph
    capture_of = {internal.ref(): external for external, internal in graph.captures}
    arguments = {t.ref() for t in graph.inputs} - set(capture_of)

    def resource_origin(tensor: tf.Tensor) -> tuple[str, str]:
        """(device, role) of the variable behind a resource tensor, through identities."""
        while tensor.ref() not in capture_of and tensor.op.type in ("Identity", "IdentityN") and tensor.op.inputs:
            tensor = tensor.op.inputs[tensor.value_index if tensor.op.type == "IdentityN" else 0]
        external = capture_of.get(tensor.ref())
        if external is None:
            return device_name(tensor.op.device) or argument_device, "other"
        return device_name(external.device), role_of.get(id(external), "other")

    device: dict[str, str] = {}
    origins: dict[object, frozenset[str]] = {}  # per tensor: what it was computed from
    for op in graph.get_operations():  # creation order: producers before consumers
        resources = [t for t in op.inputs if t.dtype == tf.resource]
        if op.type == "Placeholder":
            external = capture_of.get(op.outputs[0].ref())
            device[op.name] = argument_device if external is None else device_name(external.device)
        elif resources and op.type not in _CALLS:
            device[op.name] = resource_origin(resources[0])[0]
        else:
            device[op.name] = device_name(op.device) or argument_device
        if op.type == "Placeholder":
            own = frozenset({"input"}) if op.outputs[0].ref() in arguments else frozenset()
        elif op.type in ("ReadVariableOp", "ResourceGather"):
            own = frozenset({resource_origin(resources[0])[1]})
        else:
            own = frozenset().union(*(origins.get(t.ref(), frozenset()) for t in op.inputs
                                      if t.dtype not in _NOT_DATA))
        for output in op.outputs:
            origins[output.ref()] = own

    copied, collective, sent, received, collective_in = (collections.Counter() for _ in range(5))
    moved: set[tuple[object, str]] = set()
    results = {t.op.name for t in graph.outputs if t.op.type == "Identity"}

    def count(tensor: tf.Tensor, to_device: str, written_role: str | None, result: bool = False) -> None:
        from_device = device[tensor.op.name]
        if (tensor.dtype in _NOT_DATA or tensor.op.type == "Const"
                or from_device == to_device or (tensor.ref(), to_device) in moved):
            return
        moved.add((tensor.ref(), to_device))
        size = _bytes(tensor)
        category = "other" if result else _category(origins[tensor.ref()], written_role,
                                                    from_device == argument_device)
        copied[category] += size
        sent[from_device] += size
        received[to_device] += size

    for op in graph.get_operations():
        # The tensor a collective reduces or sends is its first data input (after V3's
        # communicator); broadcast receivers and initializers have none.
        data = (next((t for t in op.inputs if t.dtype not in _NOT_DATA), None)
                if op.type.startswith(("Collective", "Nccl")) else None)
        if data is not None:
            collective[_category(origins[data.ref()], None, False)] += _bytes(data)
            collective_in[device[op.name]] += _bytes(data)
        resources = [t for t in op.inputs if t.dtype == tf.resource]
        written_role = (resource_origin(resources[0])[1] if resources and op.type not in _CALLS
                        and op.type.startswith(_WRITES_PREFIXES) else None)
        for tensor in op.inputs:  # tf.function returns its results through Identity ops
            count(tensor, device[op.name], written_role, result=op.name in results)
    for output in graph.outputs:
        count(output, argument_device, None, result=True)
    return copied, collective, sent, received, collective_in


def _category(origins: frozenset[str], written_role: str | None, from_arguments: bool) -> str:
    """The category of a tensor computed from `origins`, moving into a variable of
    `written_role` (or None), from the arguments' device or not."""
    if written_role in ("weights", "statistics"):
        return written_role
    # A tower's sums: from an accumulator, from its pass (weights and input), or, for its weight
    # sum at K = 1, from its input alone but computed on the tower.
    if "gradients" in origins or {"weights", "input"} <= origins or (
            origins == {"input"} and not from_arguments):
        return "gradients"
    for category in ("weights", "statistics", "input"):
        if origins == {category}:
            return category
    return "other"


def _bytes(tensor: tf.Tensor) -> int:
    if not tensor.shape.is_fully_defined():
        raise ValueError(f"{tensor.name} has no static shape ({tensor.shape}): trace the function "
                         "with fully defined shapes to count its bytes")
    return tensor.shape.num_elements() * tensor.dtype.size
