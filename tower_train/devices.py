"""Which devices the towers and the parameters use, decided before TensorFlow initialises.

The decision is a pure function of the flags and of the physical devices found
(`plan_devices`), so every branch, including the GPU ones this project's CI
cannot run, is unit-tested through device strings. `apply_device_plan` then
creates the logical devices the plan needs.
"""
from __future__ import annotations

import dataclasses
import shutil
import subprocess

from tower_train.rules import PLACEMENTS
from tower_train.errors import UsageError

HOST_DEVICE = "/cpu:0"  # where input pipelines run and, with --ps_device=cpu, the variables live
MIN_LOGICAL_GPU_MB = 256  # below this a tower's cuDNN workspace and activations cannot fit
# No host has more than 16 GPUs; 4 x that emulates any real layout. A tower costs a copy of the
# model's graph, so 100,000 CPU towers take minutes and gigabytes before the first update.
MAX_CPU_TOWERS = 64
# Where a plan's variables live, as `DevicePlan.message` says it: on its parameter device, in
# slices over the towers (`--ps_device=spread`, whose counters are on the parameter device), or
# mirrored on every tower (the mirrored modes).
VARIABLE_LAYOUTS = ("parameter_device", "spread", "mirrored")


@dataclasses.dataclass(frozen=True)
class DevicePlan:
    """Where everything runs.

    Attributes:
      tower_devices: one device string per tower, e.g. ("/gpu:0", "/gpu:1").
      param_device: the device that holds every model and optimizer variable.
      split: which physical device is divided into logical ones: "none", "gpu" (GPU 0) or "cpu".
      num_logical: how many logical devices the split creates (0 when split is "none").
      gpu_memory_limit_mb: the memory limit of each logical GPU when split is "gpu", else None.
      setup: what was found and where the towers are, as the log line says it.
      variables: where the variables live, one of `VARIABLE_LAYOUTS`, or None where the line
        does not say (a multi_worker worker's one CPU replica).
      ps_device: the --ps_device that placed them, "auto" resolved (`resolve_ps_device`).
      choices: what each "auto" option chose and why, as the line ends.
    """

    tower_devices: tuple[str, ...]
    param_device: str
    split: str
    num_logical: int
    gpu_memory_limit_mb: int | None
    setup: str
    variables: str | None
    ps_device: str = "cpu"
    choices: tuple[str, ...] = ()

    @property
    def message(self) -> str:
        """The one log line that says what was done: the setup, where the variables live, and
        what the "auto" options chose."""
        where = {"parameter_device": f"parameters on {self.param_device}",
                 "spread": f"parameters spread over {device_span(self.tower_devices)}, counters on {self.param_device}",
                 "mirrored": "variables mirrored on every tower", None: None}[self.variables]
        return "; ".join([self.setup, *([where] if where else []), *self.choices])


def plan_devices(
    num_gpus: int,
    ps_device: str,
    num_physical_gpus: int,
    gpu0_memory_mb: int | None = None,
    gpu_memory_mb: int | None = None,
) -> DevicePlan:
    """Decides the tower and parameter devices for `--num_gpus` towers.

    Args:
      num_gpus: the number of towers; 0 means one tower on the CPU.
      ps_device: "cpu" (the host CPU, as in the original), "gpu" (GPU 0, or
        the first tower device when there is no GPU), "spread" (`spread.SpreadPlacement`) or
        "auto" (`resolve_ps_device`).
      num_physical_gpus: how many physical GPUs the machine has.
      gpu0_memory_mb: GPU 0's total memory, when known; used to split it.
      gpu_memory_mb: the `--gpu_memory_mb` override for each logical GPU.

    Returns:
      The plan. With at least `num_gpus` GPUs the towers use /gpu:0..N-1 as they
      are. With fewer but at least one, GPU 0 is split into N logical GPUs. With
      none, the CPU is split into N + 1 logical devices: /cpu:0 stays the host
      (input pipeline and, by default, the parameters), as on a GPU machine, and
      the towers get /cpu:1..N, so the parameter device is never a tower's.

    Raises:
      UsageError: GPU 0 must be split but its memory is unknown and no
        `--gpu_memory_mb` was given, or the split does not fit in its memory.
    """
    if num_gpus == 0:
        return DevicePlan((HOST_DEVICE,), HOST_DEVICE, "none", 0, None, "--num_gpus=0: one tower on /cpu:0",
                          "parameter_device", "cpu" if ps_device == "auto" else ps_device)
    if num_physical_gpus >= num_gpus:
        towers = tuple(f"/gpu:{i}" for i in range(num_gpus))
        split, num_logical, limit = "none", 0, None
        setup = f"{num_physical_gpus} GPU(s) found: {num_gpus} tower(s) on {device_span(towers)}"
    elif num_physical_gpus >= 1:
        limit = gpu_memory_mb or (gpu0_memory_mb // num_gpus if gpu0_memory_mb else None)
        if limit is None:
            raise UsageError(
                f"--num_gpus={num_gpus} needs {num_gpus} GPUs but {num_physical_gpus} found, and "
                "GPU 0's memory is unknown (no nvidia-smi): pass --gpu_memory_mb=MB for each of its "
                f"{num_gpus} logical GPUs")
        _check_gpu_split(num_gpus, limit, gpu0_memory_mb, gpu_memory_mb is not None)
        towers = tuple(f"/gpu:{i}" for i in range(num_gpus))
        split, num_logical = "gpu", num_gpus
        setup = (f"{num_physical_gpus} GPU(s) found for --num_gpus={num_gpus}: split GPU 0 into "
                   f"{num_gpus} logical GPUs of {limit} MB each, towers on {device_span(towers)}")
    else:
        if num_gpus > MAX_CPU_TOWERS:
            raise UsageError(f"--num_gpus={num_gpus}: no GPU found, and the CPU is split into at most "
                             f"{MAX_CPU_TOWERS} towers (each adds a copy of the model's graph); "
                             f"use 1..{MAX_CPU_TOWERS}")
        towers = tuple(f"/cpu:{i + 1}" for i in range(num_gpus))
        split, num_logical, limit = "cpu", num_gpus + 1, None
        setup = (f"no GPU found for --num_gpus={num_gpus}: split the CPU into {num_gpus + 1} "
                   f"logical devices, host /cpu:0, towers on {device_span(towers)}")
    chosen, why = resolve_ps_device(ps_device, num_gpus, num_physical_gpus)
    return DevicePlan(towers, parameter_device(chosen, towers), split, num_logical, limit, setup,
                      "spread" if PLACEMENTS[chosen].spread else "parameter_device", chosen,
                      (f"--ps_device=auto chose {chosen}: {why}",) if why else ())


def resolve_ps_device(ps_device: str, num_gpus: int, num_physical_gpus: int) -> tuple[str, str]:
    """What --ps_device=auto places the variables on, and why; any other value as it is, with
    no reason. The fastest placement that was measured for the machine (docs/gpu.md): with one
    tower on a GPU, that GPU, which then computes with the weights it holds instead of copying
    them in and the gradients out once per update; with several towers, the host, fastest of
    cpu, gpu and spread for 4 towers on one GPU; with no GPU, the host, as in the original."""
    if ps_device != "auto":
        return ps_device, ""
    if num_physical_gpus == 0:
        return "cpu", "no GPU, the host"
    if num_gpus == 1:
        return "gpu", "one tower, on the GPU it computes on"
    return "cpu", f"{num_gpus} towers, the host (fastest for 4 towers on one GPU, docs/gpu.md)"


def parameter_device(ps_device: str, tower_devices: tuple[str, ...]) -> str:
    """Where `--ps_device` puts the variables: "cpu" the host; "gpu" the first tower's device,
    which is GPU 0 whenever the machine has a GPU (towers are /gpu:0.. then, split or not);
    "spread" the host too, for what is not spread (the counters, BN statistics and the
    checkpoint's copy of the state: `spread.SpreadPlacement`)."""
    return tower_devices[0] if PLACEMENTS[ps_device].on_first_tower else HOST_DEVICE


def _check_gpu_split(num_gpus: int, limit_mb: int, gpu0_memory_mb: int | None, from_flag: bool) -> None:
    """Refuses a split of GPU 0 that cannot fit: the one memory shortage knowable before training."""
    culprit = f"--gpu_memory_mb={limit_mb}" if from_flag else f"--num_gpus={num_gpus}"
    if limit_mb < MIN_LOGICAL_GPU_MB:
        raise UsageError(f"{culprit}: {num_gpus} logical GPUs of {limit_mb} MB each; each needs at "
                         f"least {MIN_LOGICAL_GPU_MB} MB (GPU 0 has {gpu0_memory_mb or 'unknown'} MB)")
    if gpu0_memory_mb is not None and limit_mb * num_gpus > gpu0_memory_mb:
        raise UsageError(f"{culprit}: {num_gpus} logical GPUs of {limit_mb} MB need "
                         f"{limit_mb * num_gpus} MB but GPU 0 has {gpu0_memory_mb} MB")


def device_span(devices: tuple[str, ...]) -> str:
    """('/cpu:1', '/cpu:2', '/cpu:3') -> '/cpu:1../cpu:3', as the log lines write them."""
    return devices[0] if len(devices) == 1 else f"{devices[0]}..{devices[-1]}"


def gpu0_total_memory_mb() -> int | None:
    """GPU 0's total memory from nvidia-smi, which, unlike TF, can tell it before initialisation."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits", "-i", "0"],
            capture_output=True, text=True, timeout=20, check=True).stdout
        return int(out.strip().splitlines()[0])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def plan_for_this_machine(num_gpus: int, ps_device: str, gpu_memory_mb: int | None) -> DevicePlan:
    """`plan_devices` fed with this machine's physical devices (this does not initialise TF)."""
    import tensorflow as tf

    num_physical_gpus = len(tf.config.list_physical_devices("GPU"))
    gpu0_memory = (gpu0_total_memory_mb()
                   if 1 <= num_physical_gpus < num_gpus and not gpu_memory_mb else None)
    return plan_devices(num_gpus, ps_device, num_physical_gpus, gpu0_memory, gpu_memory_mb)


def apply_device_plan(plan: DevicePlan) -> None:
    """Creates the logical devices the plan needs; call before TF initialises its runtime.

    If the runtime is already up (a test process, or a second run in one
    process), or the process has split the device already (an earlier call),
    the plan is accepted only when the devices it names exist: a split is never
    replaced, so what another part of the process relies on stays.

    Raises:
      UsageError: the runtime is up and lacks a device the plan names.
    """
    import tensorflow as tf

    if plan.split == "none":
        return  # nothing to create; and listing devices would initialise the runtime too early
    kind = plan.split.upper()
    physical = tf.config.list_physical_devices(kind)[0]
    configs = [tf.config.LogicalDeviceConfiguration(memory_limit=plan.gpu_memory_limit_mb)
               for _ in range(plan.num_logical)]
    if not tf.config.get_logical_device_configuration(physical):
        try:
            tf.config.set_logical_device_configuration(physical, configs)
            return
        except RuntimeError:
            pass  # already initialised: accepted if the devices exist
    existing = {canonical_device(d.name) for d in tf.config.list_logical_devices()}
    missing = [d for d in (*plan.tower_devices, plan.param_device)
               if canonical_device(d) not in existing]
    if missing:
        raise UsageError(
            f"devices {', '.join(missing)} do not exist and TensorFlow is already initialised; "
            f"the logical devices are: {', '.join(sorted(existing))} (call tower_train.fit, or "
            "tower_train.create_devices with fit's options, before any other TensorFlow work in "
            "the process, such as making a Keras model)")


def canonical_device(device: str) -> str:
    """'/gpu:1', '/device:GPU:1' and '/job:localhost/.../device:GPU:1' all become 'GPU:1'."""
    import tensorflow as tf

    spec = tf.DeviceSpec.from_string(device)
    return f"{spec.device_type}:{spec.device_index}"
