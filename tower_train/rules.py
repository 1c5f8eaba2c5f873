"""What each --mode and each --ps_device is and allows: the two registries, free of TensorFlow,
that the options' checks (config.py) read before TensorFlow loads, and that step/modes.py builds
each mode and placement from by name."""
from __future__ import annotations

import dataclasses

AUTO = "auto"  # an option's value that this machine decides, once the devices are known


@dataclasses.dataclass(frozen=True)
class ModeRules:
    """What a --mode is and allows: every rule that depends on the mode, written once here
    (step/modes.py builds each mode's strategy and inner step)."""

    name: str
    all_reduce: tuple[str, ...]  # the --all_reduce choices
    # What --all_reduce=auto picks: with one whole GPU per tower, and on split GPUs or CPUs.
    auto_all_reduce: tuple[str, str]
    # Towers placed by hand and the variables on the parameter device: the tower-only options
    # (--tower_split, --tower_weights, --transfer_precision) are for it alone.
    places_towers: bool = False
    workers: bool = False  # one process per worker, which learns the cluster (--cluster)
    mirrors_variables: bool = False  # a copy of the variables on every replica: no parameter device
    replica_context: bool = False  # where --sync_bn can synchronize
    # Whether the replicas' moves of non-trainable state (BN statistics, random generators) can
    # be kept: CentralStorageStrategy cannot update it from its replicas.
    keeps_replica_state: bool = True


# The one registry of the modes: step/modes.py's Mode classes take their rules from it by name.
MODE_RULES = {rules.name: rules for rules in (
    # Reduces on the parameter device, by hand.
    ModeRules("tower", ("auto",), ("parameter_device", "parameter_device"), places_towers=True),
    ModeRules("mirrored", ("auto", "nccl", "hierarchical_copy", "one_device"), ("nccl", "one_device"),
              mirrors_variables=True, replica_context=True),
    ModeRules("multi_worker", ("auto", "nccl", "ring"), ("nccl", "ring"), workers=True,
              mirrors_variables=True, replica_context=True),
    # The strategy reduces to its parameter device.
    ModeRules("central_storage", ("auto",), ("parameter_device", "parameter_device"),
              keeps_replica_state=False),
)}
MODES = tuple(MODE_RULES)
HAND_PLACED_MODE = next(rules.name for rules in MODE_RULES.values() if rules.places_towers)
WORKERS_MODE = next(rules.name for rules in MODE_RULES.values() if rules.workers)
ONE_PROCESS_MODES = tuple(rules.name for rules in MODE_RULES.values() if not rules.workers)
SYNC_BN_MODES = tuple(rules.name for rules in MODE_RULES.values() if rules.replica_context)


@dataclasses.dataclass(frozen=True)
class PlacementRules:
    """What a --ps_device is and allows: every rule that depends on where tower mode keeps its
    variables, written once here. Its module in step/ holds the placement class (`placement`,
    "module:Class" under tower_train.step), which step/modes.py builds by this name; the
    devices and the benchmark read the rest. Adding a placement is its module, its row here,
    and its tests."""

    name: str
    placement: str  # "module:Class" in tower_train.step: built with .of(param_device, tower_devices)
    what: str  # where the variables live, in words (the benchmark's kind says it)
    on_first_tower: bool = False  # the parameter device is the first tower's, else the host
    spread: bool = False  # the trainable weights in slices over the tower devices
    # Its towers read the weights from their own copy once per update only (no per_micro_step).
    copies_per_update_only: bool = False
    # Applies the compiled optimizer's own clipping, weight decay and average (UpdateRule).
    optimizer_features: bool = True
    sparse_steps: bool = True  # steps a table with its rows' occurrences (--sparse_steps)


# The one registry of the placements, in --ps_device's order.
PLACEMENTS = {rules.name: rules for rules in (
    PlacementRules("cpu", "one_device:OneDevice", "variables on the host CPU /cpu:0 (the original's placement)"),
    PlacementRules("gpu", "one_device:OneDevice",
                   "variables on GPU 0 (without a GPU, on the first tower's device)", on_first_tower=True),
    PlacementRules("spread", "spread:SpreadPlacement",
                   "the weights, slots and averages in slices on the tower devices", spread=True,
                   copies_per_update_only=True, optimizer_features=False, sparse_steps=False),
)}
PS_DEVICES = (AUTO, *PLACEMENTS)
