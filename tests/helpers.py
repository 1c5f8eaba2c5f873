"""Shared set-up for tests that build a trainer in this process."""
from __future__ import annotations

import dataclasses

import numpy as np

from tower_train import data
from tower_train.config import TrainConfig
from tower_train.devices import plan_devices
from tower_train.tower_mode import TowerStep
from tower_train.trainer import TrainState, build_state


@dataclasses.dataclass
class TowerRun:
    config: TrainConfig
    state: TrainState
    inner: TowerStep
    tower_devices: tuple[str, ...]
    param_device: str


def tower_run(**overrides) -> TowerRun:
    """A tower-mode state and inner step for a config on this process's logical CPUs."""
    config = TrainConfig(**{"train_dir": "/unused", **overrides})
    plan = plan_devices(config.num_gpus, config.ps_device, num_physical_gpus=0)
    state = build_state(config, plan.param_device)
    inner = TowerStep(state.model, state.optimizer, state.step, plan.tower_devices,
                      plan.param_device, config.accum)
    return TowerRun(config, state, inner, plan.tower_devices, plan.param_device)


def synthetic_batches(run: TowerRun):
    """The training stream of the embedded data set for this run's layout."""
    source = data.load_source("synthetic", None)
    return iter(data.train_stream(
        source, seed=run.config.seed, start_position=0,
        micro_batch=run.config.batch_size * len(run.tower_devices), augment=run.config.augment))


def weights(model) -> list[np.ndarray]:
    return [v.numpy() for v in model.trainable_variables]
