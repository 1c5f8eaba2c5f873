"""--measure=ops: where an update's time goes, from TensorFlow's profiler."""
from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

from tower_train.benchmark.names import BenchConfig
from tower_train.benchmark.workloads import build_workload
from tower_train.config import TrainConfig

if TYPE_CHECKING:
    from tower_train.devices import DevicePlan


def measure_ops(config: TrainConfig, benches: list[BenchConfig], plan: DevicePlan, updates: int,
                warmup_updates: int, keras_jit_compile: bool | str | None = None) -> list[dict]:
    """For each configuration: its wall time per example over `updates` updates, then the op
    time per example by op type over `updates` profiled updates (TensorFlow's
    framework_op_stats: every op's self time on every device, the input pipeline's "Dataset"
    included, "IDLE" the devices' waits). `keras_jit_compile`: keras_fit's (`build_workload`)."""
    import glob
    import tempfile

    import tensorflow as tf
    # The profiler's own converter: TensorBoard's profile plugin reads the same tables.
    from tensorflow.python.profiler.internal import _pywrap_profiler_plugin

    results = []
    for bench in benches:
        workload = build_workload(bench, config, plan, keras_jit_compile=keras_jit_compile)
        workload.run(warmup_updates)
        seconds = workload.run(updates)
        with tempfile.TemporaryDirectory() as logdir:
            tf.profiler.experimental.start(logdir)
            workload.run(updates)
            tf.profiler.experimental.stop()
            planes = glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True)
            table, _ = _pywrap_profiler_plugin.xspace_to_tools_data(planes, "framework_op_stats", {})
        table = json.loads(table)
        table = table[0] if isinstance(table, list) else table
        columns = [column["id"] for column in table["cols"]]
        kind, self_time = columns.index("type"), columns.index("total_self_time")
        micros: dict[str, float] = {}
        for row in table["rows"]:
            op_type = row["c"][kind]["v"]
            micros[op_type] = micros.get(op_type, 0.0) + float(row["c"][self_time]["v"])
        examples = workload.global_batch * updates
        results.append({"config": bench.name, "wall_us_per_example": seconds * 1e6 / examples,
                        "op_us_per_example": {k: v / examples for k, v in micros.items()},
                        "compute_devices": workload.compute_devices()})
    return results


def format_ops_report(results: list[dict]) -> str:
    """A row per configuration: wall time and busy op time per example, the input pipeline's
    part of it, and the op types that take most."""
    lines = [f"{'config':<24} {'wall us/ex':>10} {'ops us/ex':>10} {'input':>6}  top op types (us/example)"]
    for r in results:
        ops = r["op_us_per_example"]
        busy = sum(v for k, v in ops.items() if k != "IDLE")
        top = sorted(((v, k) for k, v in ops.items() if k != "IDLE"), reverse=True)[:6]
        lines.append(f"{r['config']:<24} {r['wall_us_per_example']:>10.1f} {busy:>10.1f} "
                     f"{ops.get('Dataset', 0.0) / busy:>6.1%}  " + ", ".join(f"{k} {v:.0f}" for v, k in top))
    lines.append("ops us/ex: the self time of every op on every device (IDLE excluded), per example; "
                 "ops running at once on shared cores each count their whole duration. input: the "
                 "tf.data pipeline's share of it (op type Dataset)")
    return "\n".join(lines)
