"""--measure=memory: each configuration, and its floor at one example per tower, in a subprocess
of its own, which reports its peak resident memory during its updates."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import TYPE_CHECKING

from tower_train import flags as tt_flags
from tower_train import startup
from tower_train.benchmark.names import BenchConfig, floor_config, parse_config_name
from tower_train.benchmark.options import bench_flags
from tower_train.benchmark.workloads import build_workload
from tower_train.cli import command, parse_config
from tower_train.errors import UsageError

if TYPE_CHECKING:
    from tower_train.config import TrainConfig
    from tower_train.devices import DevicePlan


def peak_memory_main(argv: list[str]) -> int:
    """The subprocess of --measure=memory: builds one configuration, runs its updates, and
    prints one JSON line of memory figures in MB."""
    return command(lambda: _peak_memory(argv))


def _peak_memory(argv: list[str]) -> int:
    options = bench_flags()
    config = parse_config(argv, __doc__ or "", options, tt_flags.BENCHMARK_OPTIONS)
    bench = parse_config_name(_one(options["configs"].value), config.batch_size)
    with startup.start(startup.BENCHMARK, startup.options_of(config)) as run:
        # keras_fit's jit_compile as given: "auto" lets Keras decide (`build_workload`).
        return _measure_peak(bench, run.config, run.plan, options, config.jit_compile)


def _measure_peak(bench: BenchConfig, config: TrainConfig, plan: DevicePlan, options: dict,
                  keras_jit_compile: bool | str) -> int:
    import tensorflow as tf

    workload = build_workload(bench, config, plan, keras_jit_compile=keras_jit_compile)
    gpus = _gpu_names(plan)
    rss_before = _status_mb("VmRSS")
    gpu_before = {d: tf.config.experimental.get_memory_info(d)["current"] / 2**20 for d in gpus}
    _reset_peak_rss()
    for device in gpus:
        tf.config.experimental.reset_memory_stats(device)
    workload.run(options["warmup_updates"].value + options["updates"].value)
    print(json.dumps({
        "config": bench.name, "global_batch": workload.global_batch, "accum": bench.accum,
        "batch_per_tower": bench.batch_size, "rss_before_mb": rss_before, "peak_rss_mb": _status_mb("VmHWM"),
        "gpu_before_mb": gpu_before,
        "gpu_peak_mb": {d: tf.config.experimental.get_memory_info(d)["peak"] / 2**20 for d in gpus},
        "compute_devices": workload.compute_devices()}))
    return 0


# glibc raises its mmap threshold to the size of every large block freed, after which freed
# tensors stay in the heap and peak RSS counts malloc's cache; a fixed threshold returns them.
_LIVE_RSS = {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}


def measure_memory(benches: list[BenchConfig], argv: list[str]) -> list[dict]:
    """Runs `peak_memory_main` in a fresh process for each configuration and for its floor
    configuration (the training flags of `argv` passed on), one after another, so no
    configuration inherits another's heap. Each result gets `floor_added_mb`: its floor's
    peak minus its floor's RSS before the updates."""
    measured: dict[str, dict] = {}
    for name in dict.fromkeys(n for b in benches for n in (floor_config(b), b.name)):
        child = subprocess.run(
            [sys.executable, "-c", "import sys; from tower_train.benchmark.memory import peak_memory_main; "
             "sys.exit(peak_memory_main(sys.argv))", *argv[1:], f"--configs={name}"],
            capture_output=True, text=True, env={**os.environ, **_LIVE_RSS})
        if child.returncode != 0:
            lines = child.stderr.strip().splitlines() or ["no output"]
            raise UsageError(f"--measure=memory: {name} failed: {lines[-1]}")
        measured[name] = json.loads(child.stdout.strip().splitlines()[-1])
    results = []
    for bench in benches:
        floor = measured[floor_config(bench)]
        result = {**measured[bench.name], "floor_added_mb": floor["peak_rss_mb"] - floor["rss_before_mb"]}
        if result["gpu_peak_mb"]:  # the devices' own peaks hold the activations; the host's RSS does not
            result["activations_mb"] = max(
                (result["gpu_peak_mb"][d] - result["gpu_before_mb"][d])
                - (floor["gpu_peak_mb"][d] - floor["gpu_before_mb"][d]) for d in result["gpu_peak_mb"])
        else:
            result["activations_mb"] = result["peak_rss_mb"] - result["rss_before_mb"] - result["floor_added_mb"]
        results.append(result)
    return results


def format_memory_report(results: list[dict]) -> str:
    """A row per configuration: the host's memory, then 'activations', what its updates add
    above its floor's (`floor_config`): on GPUs, from the busiest GPU's peak, else from the
    host's RSS; the last column compares it with the first row's."""
    lines = [f"{'config':<24} {'G':>6} {'K':>3} {'B':>5} {'host RSS before':>15} {'host peak':>9} "
             f"{'added':>6} {'activations':>12} {'vs row 1':>9}   (MB)"]
    first = results[0]["activations_mb"]
    for r in results:
        act = r["activations_mb"]
        gpu = "".join(f"  {d} peak {mb:.0f} MB" for d, mb in r["gpu_peak_mb"].items())
        ratio = f"{act / first:>9.2f}" if first > 0 else f"{'-':>9}"
        lines.append(f"{r['config']:<24} {r['global_batch']:>6} {r['accum']:>3} {r['batch_per_tower']:>5} "
                     f"{r['rss_before_mb']:>15.0f} {r['peak_rss_mb']:>9.0f} "
                     f"{r['peak_rss_mb'] - r['rss_before_mb']:>6.0f} {act:>12.0f} {ratio}{gpu}")
    on_gpus = any(r["gpu_peak_mb"] for r in results)
    lines.append("activations: the busiest GPU's peak above its memory before the updates, less its floor's"
                 if on_gpus else "activations: the host's peak RSS above its RSS before the updates, less its floor's")
    return "\n".join(lines)


def _one(names: list[str]) -> str:
    if len(names) != 1:
        raise UsageError(f"--configs: the memory subprocess takes one configuration, got {len(names)}")
    return names[0]


def _gpu_names(plan: DevicePlan) -> list[str]:
    """The GPUs the plan uses, as get_memory_info names them ('GPU:0')."""
    from tower_train.devices import canonical_device

    devices = {canonical_device(d) for d in (*plan.tower_devices, plan.param_device)}
    return sorted(d for d in devices if d.startswith("GPU"))


def _status_mb(field: str) -> float:
    """A line of /proc/self/status, such as VmHWM (peak resident memory), in MB."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise UsageError(f"--measure=memory: /proc/self/status has no {field}")


def _reset_peak_rss() -> None:
    """Sets VmHWM back to the current RSS, so the peak is that of the updates alone
    (loading the data set and building the model can peak higher)."""
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")
