"""Shared set-up for tests that build a trainer in this process."""
from __future__ import annotations

import dataclasses

import numpy as np
import tensorflow as tf

from tower_train import data
from tower_train.config import TrainConfig
from tower_train.devices import canonical_device, plan_devices
from tower_train.modes import build_mode
from tower_train.trainer import TrainState, build_state


@dataclasses.dataclass
class Run:
    config: TrainConfig
    state: TrainState
    inner: object  # TowerStep or StrategyStep
    tower_devices: tuple[str, ...]
    param_device: str


def make_run(**overrides) -> Run:
    """A state and inner step for a config (any single-process mode) on this process's logical CPUs."""
    config = TrainConfig(**{"train_dir": "/unused", **overrides})
    plan = plan_devices(config.num_gpus, config.ps_device, num_physical_gpus=0)
    mode = build_mode(config, plan)
    state = build_state(config, mode.variable_scope(), len(data.load_source("synthetic", None).train_labels))
    return Run(config, state, mode.inner_step(state, config.accum, config.clip_norm), plan.tower_devices,
               plan.param_device)


def synthetic_batches(run: Run):
    """The training stream of the embedded data set for this run's layout."""
    source = data.load_source("synthetic", None)
    return iter(data.train_stream(
        source, seed=run.config.seed, start_position=0,
        micro_batch=run.config.batch_size * len(run.tower_devices), augment=run.config.augment))


def weights(model) -> list[np.ndarray]:
    return [np.asarray(tf.convert_to_tensor(v)) for v in model.trainable_variables]


def cross_tower_ops(graph, tower_devices):
    """The ops where values computed on two or more towers first meet: the reductions.

    Each op's tower origins are the towers whose computation its value depends
    on, followed through every data input whatever device the ops in between
    carry; variable reads have none.
    """
    towers = {canonical_device(d) for d in tower_devices}
    origins, merges = {}, []
    for op in graph.get_operations():  # creation order is a topological order
        inherited = [origins.get(t.op.name, frozenset()) for t in op.inputs]
        own = {canonical_device(op.device)} & towers if op.device else set()
        origins[op.name] = frozenset(own).union(*inherited)
        if len(origins[op.name]) >= 2 and all(len(o) < 2 for o in inherited):
            merges.append(op)
    return merges
