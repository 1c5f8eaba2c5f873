"""The training modes, one `Mode` subclass per --mode: which strategy (if any) holds the
variables, where they live (a `placement.Placement`) and which inner step runs the updates.

- `TowerMode` (`tower`): the classic pattern, no strategy: variables on the parameter
  device, towers placed by hand (`tower_step.TowerStep`).
- `MirroredMode` (`mirrored`): `tf.distribute.MirroredStrategy` over the same tower devices.
- `MultiWorkerMode` (`multi_worker`): `tf.distribute.MultiWorkerMirroredStrategy`, from
  TF_CONFIG or Slurm (`--cluster`).
- `CentralStorageMode` (`central_storage`): `tf.distribute.experimental.CentralStorageStrategy`,
  TF's own variables-on-one-device strategy, over the same towers and parameter device.

All four apply the same update: the gradient of the weighted mean loss over the G examples
(`strategy_step` for the three strategies). What each is and allows, its default reduction
included, is `rules.MODE_RULES`, from which each class takes its `rules` by name.
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import TYPE_CHECKING, ClassVar, ContextManager

from absl import logging

from tower_train.workers.cluster import SINGLE_PROCESS, WorkerInfo, server_start, strategy_resolver
from tower_train.config import DTYPES, TrainConfig
from tower_train.rules import AUTO, MODE_RULES, PLACEMENTS, ModeRules
from tower_train.devices import HOST_DEVICE, DevicePlan, device_span, plan_devices
from tower_train.step.placement import Placement, StrategyPlacement
from tower_train.errors import UsageError

if TYPE_CHECKING:
    from tower_train.step.inner_step import InnerStep


def fit_plan_to_mode(mode: str, plan: DevicePlan) -> DevicePlan:
    """The device plan a mode can run: MultiWorkerMirroredStrategy runs one replica on a
    worker's /cpu:0 when the worker has no GPU, so a CPU split is of no use to it; and the
    mirrored modes have no parameter device, so the plan's line does not name one."""
    if MODE_RULES[mode].mirrors_variables:  # no parameter device: --ps_device placed nothing
        plan = dataclasses.replace(plan, variables="mirrored",
                                   choices=tuple(c for c in plan.choices if not c.startswith("--ps_device")))
    if not MODE_RULES[mode].workers or plan.split != "cpu":
        return plan
    if len(plan.tower_devices) > 1:
        raise UsageError(f"--num_gpus={len(plan.tower_devices)}: with --mode=multi_worker and no GPU "
                         "each worker runs one replica on its CPU; pass --num_gpus=1")
    return dataclasses.replace(
        plan_devices(0, "cpu", num_physical_gpus=0),
        setup="no GPU found for --mode=multi_worker: one replica on this worker's /cpu:0", variables=None)


def resolve_all_reduce(mode: str, choice: str, plan: DevicePlan) -> str:
    """The concrete cross-device reduction for `--all_reduce=choice` (already valid for `mode`).

    NCCL needs real, whole GPUs; on logical GPUs split from one, or on CPUs, each mode's
    `ModeRules.auto_all_reduce` picks its reduction without it.
    """
    whole_gpus = plan.split == "none" and plan.tower_devices[0].startswith("/gpu")
    if choice == "nccl" and not whole_gpus:
        raise UsageError("--all_reduce=nccl: needs one physical GPU per tower; "
                         f"this run's towers are {plan.tower_devices[0]}.. ({plan.split} split)")
    with_whole_gpus, otherwise = MODE_RULES[mode].auto_all_reduce
    return (with_whole_gpus if whole_gpus else otherwise) if choice == "auto" else choice


def check_jit_compile(mode: str, plan: DevicePlan) -> None:
    """XLA compiles a tower for its own device and cannot read variables held on another one
    (tensorflow.org/xla/known_issues). Tower mode hands its compiled towers the values instead
    (`towers.compiled_towers`); CentralStorageStrategy's replicas read its variables."""
    rules = MODE_RULES[mode]
    if not (rules.mirrors_variables or rules.places_towers) and set(plan.tower_devices) != {plan.param_device}:
        raise UsageError(f"--jit_compile: XLA cannot read the variables on {plan.param_device} from "
                         f"towers on {device_span(plan.tower_devices)} (--mode={mode}); use --mode=tower "
                         "or --mode=mirrored")


def resolve_jit_compile(config: TrainConfig, plan: DevicePlan, model: object = None) -> tuple[bool, str]:
    """Whether the towers compile with XLA, and why when --jit_compile=auto decided it (else "").

    auto decides as Keras's fit decides its own `jit_compile="auto"`: on where GPUs compute,
    off on a CPU (where XLA is rarely faster), under --deterministic, and for a Keras `model`
    with a layer whose `supports_jit` is False; also off where the mode cannot compile its
    towers (`check_jit_compile`). A model that is not yet built is taken to compile.
    """
    if config.jit_compile != AUTO:
        return config.jit_compile, ""
    if not plan.tower_devices[0].startswith("/gpu"):
        return False, "no GPU computes the towers"
    try:
        check_jit_compile(config.mode, plan)
    except UsageError:
        return False, f"--mode={config.mode} reads the variables on {plan.param_device}"
    if config.deterministic:
        return False, "--deterministic"
    layers = None if isinstance(model, type) else getattr(model, "_flatten_layers", None)
    unsupported = [layer for layer in layers() if not getattr(layer, "supports_jit", True)] if layers else []
    if unsupported:
        return False, f"layer {unsupported[0].name} ({type(unsupported[0]).__name__}) does not support XLA"
    return True, "GPUs compute the towers"


class Mode:
    """How a run places its variables and runs its updates: one subclass per --mode, which owns
    its strategy (none in tower mode) and its inner step. What each mode is and allows is its
    `rules`, `rules.MODE_RULES[name]`, which the options' checks read before TensorFlow loads."""

    rules: ClassVar[ModeRules]

    def __init__(self, *, config: TrainConfig, plan: DevicePlan, worker: WorkerInfo, all_reduce: str):
        """Creates the mode's strategy; call it before any other TF op runs. `all_reduce`: the
        reduction `resolve_all_reduce` gave for the config on `plan`. The config's "auto" options
        are resolved as `startup.prepare_devices` resolves them, where the caller has not."""
        jit_compile, _ = resolve_jit_compile(config, plan)
        if jit_compile:
            check_jit_compile(self.rules.name, plan)
        config = dataclasses.replace(config, jit_compile=jit_compile,
                                     ps_device=plan.ps_device if config.ps_device == AUTO else config.ps_device)
        self.config, self.plan, self.worker = config, plan, worker
        self.all_reduce = all_reduce
        self.placement = self._placement()
        self._vote = None  # the compiled any_worker

    def _placement(self) -> Placement:
        raise NotImplementedError

    def inner_step(self, state, prepare=None) -> InnerStep:
        """The `InnerStep` of `state` whose `run_update(batches)` applies one update of config.accum
        micro-steps: clipped to --clip_norm, each tower's share as --tower_split says, compiled
        with XLA under --jit_compile; a `data/source.RawInput` batch preprocessed by `prepare` (the
        source's `model_input`) on each tower's device."""
        raise NotImplementedError

    @property
    def strategy(self):  # tf.distribute.Strategy | None
        return None

    def variable_scope(self) -> ContextManager:
        """Where the model, optimizer and counters are created."""
        return self.placement.scope()

    def any_worker(self, flag: bool) -> bool:
        """True on every worker if `flag` is True on any: a scalar all-reduce, only in multi_worker."""
        if self.worker.count == 1:
            return flag
        import tensorflow as tf

        if self._vote is None:
            def vote(flag_tensor):
                votes = self.strategy.run(lambda f: f, args=(flag_tensor,))
                return self.strategy.reduce(tf.distribute.ReduceOp.SUM, votes, axis=None)

            self._vote = tf.function(vote, autograph=False)
        return int(self._vote(tf.constant(int(flag)))) > 0

    def sparse_steps(self, model) -> bool:
        """Whether the update steps `model`'s tables read by gather (`sparse_gradients`) with
        their occurrences, as --sparse_steps asks: in tower mode with one parameter device;
        elsewhere they take the dense step, which one warning line says."""
        if not (self.config.sparse_steps and any(model.sparse_gradients)):
            return False
        if self.rules.places_towers and self.config.placement_rules.sparse_steps:
            return True
        where = f"--ps_device={self.config.ps_device}" if self.rules.places_towers else f"--mode={self.rules.name}"
        tables = [v.path for v, sparse in zip(model.trainable_variables, model.sparse_gradients) if sparse]
        stepping = " or ".join(name for name, rules in PLACEMENTS.items() if rules.sparse_steps)
        logging.warning("--sparse_steps: %s steps %s with its dense gradient, not with its rows' "
                        "occurrences as Keras's fit does (sparse steps are --mode=tower's, with "
                        "--ps_device=%s)", where, ", ".join(tables), stepping)
        return False

    def pooled_moments(self, model) -> bool:
        """Whether BN's moving statistics move once per update, from its pooled moments, as
        --bn_statistics=per_update asks: in tower mode; elsewhere at every replica's pass, which
        one warning line says."""
        from tower_train.step.pooled_moments import moving_layers

        if self.config.bn_statistics != "per_update" or not moving_layers(model):
            return False
        if self.rules.places_towers:
            return True
        logging.warning("--bn_statistics=per_update: --mode=%s moves BatchNormalization's moving "
                        "statistics at every replica's pass, not once per update (per_update is "
                        "--mode=tower's)", self.rules.name)
        return False


class TowerMode(Mode):
    """The classic pattern: no strategy, the variables on the parameter device, the towers
    placed by hand (`tower_step.TowerStep`), reduced on the parameter device."""

    rules = MODE_RULES["tower"]

    def _placement(self) -> Placement:
        """The class --ps_device's rules name (`rules.PLACEMENTS`), in its step/ module."""
        module, name = self.config.placement_rules.placement.split(":")
        placement = getattr(importlib.import_module(f"tower_train.step.{module}"), name)
        return placement.of(self.plan.param_device, self.plan.tower_devices)

    def inner_step(self, state, prepare=None) -> InnerStep:
        """Also: tower mode's weights fetched as --tower_weights says and its gradient sums sent
        in --transfer_precision."""
        from tower_train.step.tower_step import TowerStep

        config = self.config
        rule = state.update_rule(config.clip_norm)
        return TowerStep(rule=rule, tower_devices=self.plan.tower_devices,
                         placement=self.placement, accum=config.accum, shard_sizes=config.tower_shard_sizes,
                         jit_compile=config.jit_compile, tower_weights=config.tower_weights,
                         transfer_dtype=DTYPES[config.transfer_precision], prepare=prepare,
                         sparse_steps=self.sparse_steps(rule.model), pooled_moments=self.pooled_moments(rule.model))


class _StrategyMode(Mode):
    """A tf.distribute strategy holds the variables and runs `strategy_step.StrategyStep`."""

    def _placement(self) -> Placement:
        return StrategyPlacement(self._make_strategy(),
                                 None if self.rules.mirrors_variables else self.plan.param_device)

    def _make_strategy(self):
        raise NotImplementedError

    @property
    def strategy(self):
        return self.placement.strategy

    def inner_step(self, state, prepare=None) -> InnerStep:
        from tower_train.step.strategy_step import StrategyStep

        config = self.config
        rule = state.update_rule(config.clip_norm)
        self.sparse_steps(rule.model)  # False: says so once, where the model has tables to step
        self.pooled_moments(rule.model)  # likewise, where it has BatchNormalization
        return StrategyStep(strategy=self.strategy, rule=rule,
                            accum=config.accum, shard_size=config.batch_size,
                            first_replica=self.worker.index * len(self.plan.tower_devices),
                            jit_compile=config.jit_compile, prepare=prepare)


class MirroredMode(_StrategyMode):
    """`tf.distribute.MirroredStrategy` over the same tower devices."""

    rules = MODE_RULES["mirrored"]

    def _make_strategy(self):
        import tensorflow as tf

        cross_device_ops = {
            "nccl": lambda: tf.distribute.NcclAllReduce(),
            "hierarchical_copy": lambda: tf.distribute.HierarchicalCopyAllReduce(),
            "one_device": lambda: tf.distribute.ReductionToOneDevice(reduce_to_device=HOST_DEVICE),
        }[self.all_reduce]()
        return tf.distribute.MirroredStrategy(list(self.plan.tower_devices), cross_device_ops=cross_device_ops)


class CentralStorageMode(_StrategyMode):
    """`tf.distribute.experimental.CentralStorageStrategy`, TF's own variables-on-one-device
    strategy, over the same towers and parameter device."""

    rules = MODE_RULES["central_storage"]

    def _make_strategy(self):
        import tensorflow as tf

        return tf.distribute.experimental.CentralStorageStrategy(
            list(self.plan.tower_devices), parameter_device=self.plan.param_device)


class MultiWorkerMode(_StrategyMode):
    """`tf.distribute.MultiWorkerMirroredStrategy`, one process per worker, from TF_CONFIG or
    Slurm (`--cluster`)."""

    rules = MODE_RULES["multi_worker"]

    def _make_strategy(self):
        import tensorflow as tf

        implementation = (tf.distribute.experimental.CommunicationImplementation.NCCL
                          if self.all_reduce == "nccl"
                          else tf.distribute.experimental.CommunicationImplementation.RING)
        gpus = len(self.plan.tower_devices) if self.plan.tower_devices[0].startswith("/gpu") else 0
        with server_start(self.worker):
            return tf.distribute.MultiWorkerMirroredStrategy(
                cluster_resolver=strategy_resolver(self.worker, gpus),
                communication_options=tf.distribute.experimental.CommunicationOptions(
                    implementation=implementation, timeout_seconds=self.config.collective_timeout))


# Each --mode's class, by the name its rules give.
MODE_CLASSES: dict[str, type[Mode]] = {mode.rules.name: mode for mode in (
    TowerMode, MirroredMode, CentralStorageMode, MultiWorkerMode)}


def build_mode(config: TrainConfig, plan: DevicePlan, worker: WorkerInfo = SINGLE_PROCESS,
               all_reduce: str | None = None) -> Mode:
    """The mode `config.mode` names, its strategy created; call it before any other TF op runs.

    `all_reduce`: what `resolve_all_reduce` gave for `config` on `plan` (`startup.prepare_devices`
    resolves it while it checks the devices); None resolves it here, for a caller that builds
    a mode other than the one it checked (compare.py, the benchmark).
    """
    if all_reduce is None:
        all_reduce = resolve_all_reduce(config.mode, config.all_reduce, plan)
    return MODE_CLASSES[config.mode](config=config, plan=plan, worker=worker, all_reduce=all_reduce)
