"""The training modes: which strategy (if any) holds the variables and runs the inner step.

- `tower`: the classic pattern, no strategy: variables on the parameter
  device, towers placed by hand (`tower_mode.TowerStep`).
- `mirrored`: `tf.distribute.MirroredStrategy` over the same tower devices.
- `multi_worker`: `tf.distribute.MultiWorkerMirroredStrategy`, from TF_CONFIG or Slurm (`--cluster`).
- `central_storage`: `tf.distribute.experimental.CentralStorageStrategy`, TF's
  own variables-on-one-device strategy, over the same towers and parameter device.

All four apply the same update: the gradient of the weighted mean loss over the G examples
(`strategy_mode` for the three strategies).
"""
from __future__ import annotations

import dataclasses
from typing import ContextManager

from tower_train.cluster import SINGLE_PROCESS, WorkerInfo, strategy_resolver
from tower_train.config import DTYPES, MODE_RULES, TrainConfig
from tower_train.devices import HOST_DEVICE, DevicePlan, device_span, plan_devices
from tower_train.errors import UsageError


def fit_plan_to_mode(mode: str, plan: DevicePlan) -> DevicePlan:
    """The device plan a mode can run: MultiWorkerMirroredStrategy runs one replica on a
    worker's /cpu:0 when the worker has no GPU, so a CPU split is of no use to it; and the
    mirrored modes have no parameter device, so the plan's line does not name one."""
    if MODE_RULES[mode].mirrors_variables:
        plan = dataclasses.replace(plan, message=plan.message.replace(
            f"; parameters on {plan.param_device}", "; variables mirrored on every tower"))
    if not MODE_RULES[mode].workers or plan.split != "cpu":
        return plan
    if len(plan.tower_devices) > 1:
        raise UsageError(f"--num_gpus={len(plan.tower_devices)}: with --mode=multi_worker and no GPU "
                         "each worker runs one replica on its CPU; pass --num_gpus=1")
    return dataclasses.replace(
        plan_devices(0, "cpu", num_physical_gpus=0),
        message="no GPU found for --mode=multi_worker: one replica on this worker's /cpu:0")


def resolve_all_reduce(mode: str, choice: str, plan: DevicePlan) -> str:
    """The concrete cross-device reduction for `--all_reduce=choice` (already valid for `mode`).

    NCCL needs real, whole GPUs; on logical GPUs split from one, or on CPUs,
    MirroredStrategy reduces to one device and MultiWorkerMirroredStrategy
    uses ring collectives.
    """
    whole_gpus = plan.split == "none" and plan.tower_devices[0].startswith("/gpu")
    if choice == "nccl" and not whole_gpus:
        raise UsageError("--all_reduce=nccl: needs one physical GPU per tower; "
                         f"this run's towers are {plan.tower_devices[0]}.. ({plan.split} split)")
    if choice != "auto":
        return choice
    if mode == "mirrored":
        return "nccl" if whole_gpus else "one_device"
    if mode == "multi_worker":
        return "nccl" if whole_gpus else "ring"
    return "parameter_device"


@dataclasses.dataclass
class Mode:
    """How a run places its variables and runs its updates."""

    name: str
    plan: DevicePlan
    all_reduce: str
    strategy: object | None  # tf.distribute.Strategy; None in tower mode
    worker: WorkerInfo
    _vote: object | None = dataclasses.field(default=None, repr=False)  # the compiled any_worker

    def variable_scope(self) -> ContextManager:
        """Where the model, optimizer and counters are created."""
        import tensorflow as tf

        return self.strategy.scope() if self.strategy else tf.device(self.plan.param_device)

    def inner_step(self, state, config: TrainConfig, tower=None):
        """The `InnerStep` whose `run_update(batches)` applies one update of config.accum
        micro-steps: clipped to --clip_norm, each tower's share as --tower_split says, compiled
        with XLA under --jit_compile, tower mode's weights fetched as --tower_weights says and its
        gradient sums sent in --transfer_precision. `tower` replaces tower mode's tower function
        (the benchmark's simulated slow device)."""
        rule = state.update_rule(config.clip_norm)
        accum, jit_compile = config.accum, config.jit_compile
        if self.strategy is None:
            from tower_train.tower_mode import TowerStep

            return TowerStep(rule, self.plan.tower_devices, self.plan.param_device, accum,
                             config.tower_shard_sizes, jit_compile, tower, config.tower_weights,
                             DTYPES[config.transfer_precision])
        from tower_train.strategy_mode import StrategyStep

        return StrategyStep(self.strategy, rule, accum,
                            first_replica=self.worker.index * len(self.plan.tower_devices),
                            jit_compile=jit_compile)

    def any_worker(self, flag: bool) -> bool:
        """True on every worker if `flag` is True on any: a scalar all-reduce, only in multi_worker."""
        if self.worker.count == 1:
            return flag
        import tensorflow as tf

        if self._vote is None:
            def vote(flag_tensor):
                votes = self.strategy.run(lambda f: f, args=(flag_tensor,))
                return self.strategy.reduce(tf.distribute.ReduceOp.SUM, votes, axis=None)

            self._vote = tf.function(vote)
        return int(self._vote(tf.constant(int(flag)))) > 0

    @property
    def variables_on(self) -> str:
        if MODE_RULES[self.name].mirrors_variables:
            return "every replica (mirrored)"
        return self.plan.param_device


def check_jit_compile(mode: str, plan: DevicePlan) -> None:
    """XLA compiles a tower for its own device and cannot read variables held on another one
    (tensorflow.org/xla/known_issues), so it needs each tower to hold the variables it reads."""
    if not MODE_RULES[mode].mirrors_variables and set(plan.tower_devices) != {plan.param_device}:
        raise UsageError(f"--jit_compile: XLA cannot read the variables on {plan.param_device} from "
                         f"towers on {device_span(plan.tower_devices)} (--mode={mode}); use --mode=mirrored, "
                         "or one tower on the parameter device (--num_gpus=1 --ps_device=gpu)")


def build_mode(config: TrainConfig, plan: DevicePlan, worker: WorkerInfo = SINGLE_PROCESS) -> Mode:
    """Creates the strategy for `config.mode`; call it before any other TF op runs."""
    import tensorflow as tf

    if config.jit_compile:
        check_jit_compile(config.mode, plan)
    all_reduce = resolve_all_reduce(config.mode, config.all_reduce, plan)
    if config.mode == "tower":
        strategy = None
    elif config.mode == "mirrored":
        cross_device_ops = {
            "nccl": lambda: tf.distribute.NcclAllReduce(),
            "hierarchical_copy": lambda: tf.distribute.HierarchicalCopyAllReduce(),
            "one_device": lambda: tf.distribute.ReductionToOneDevice(reduce_to_device=HOST_DEVICE),
        }[all_reduce]()
        strategy = tf.distribute.MirroredStrategy(list(plan.tower_devices),
                                                  cross_device_ops=cross_device_ops)
    elif config.mode == "central_storage":
        strategy = tf.distribute.experimental.CentralStorageStrategy(
            list(plan.tower_devices), parameter_device=plan.param_device)
    else:
        implementation = (tf.distribute.experimental.CommunicationImplementation.NCCL
                          if all_reduce == "nccl"
                          else tf.distribute.experimental.CommunicationImplementation.RING)
        gpus = len(plan.tower_devices) if plan.tower_devices[0].startswith("/gpu") else 0
        strategy = tf.distribute.MultiWorkerMirroredStrategy(
            cluster_resolver=strategy_resolver(worker, gpus),
            communication_options=tf.distribute.experimental.CommunicationOptions(
                implementation=implementation, timeout_seconds=config.collective_timeout))
    return Mode(config.mode, plan, all_reduce, strategy, worker)
