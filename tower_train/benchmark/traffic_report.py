"""--measure=traffic: the bytes one update moves across devices, counted from the traced graphs
(`tower_train.traffic`); nothing is run."""
from __future__ import annotations

from typing import TYPE_CHECKING

from tower_train.benchmark.names import BenchConfig
from tower_train.benchmark.workloads import build_workload
from tower_train.config import TrainConfig

if TYPE_CHECKING:
    from tower_train.devices import DevicePlan


def measure_traffic(config: TrainConfig, benches: list[BenchConfig], plan: DevicePlan,
                    keras_jit_compile: bool | str | None = None) -> list[dict]:
    """For each configuration: its global batch and `Traffic.as_dict()` (None on one device).
    `keras_jit_compile`: keras_fit's (`build_workload`)."""
    results = []
    for bench in benches:
        workload = build_workload(bench, config, plan, keras_jit_compile=keras_jit_compile)
        traffic = workload.traffic and workload.traffic()
        results.append({"config": bench.name, "global_batch": workload.global_batch,
                        "bytes_per_update": traffic and traffic.as_dict(),
                        "busiest_device_bytes": traffic and traffic.busiest_device_bytes,
                        "state_bytes_per_device": workload.state_bytes and workload.state_bytes(),
                        "compute_devices": workload.compute_devices()})
    return results


def format_traffic_report(results: list[dict], link_gbps: list[float]) -> str:
    """A row per configuration: MB per update by category, what enters collectives, the busiest
    device's MB, the MB of state the fullest device holds, and the predicted communication time
    per update on each link speed (`Traffic.link_seconds`)."""
    from tower_train.traffic import CATEGORIES, Traffic

    lines = [f"{'config':<24} {'G':>6} " + " ".join(f"{c:>10}" for c in CATEGORIES)
             + f" {'collective':>10} {'busiest':>10} {'state max':>10}"
             + "".join(f" {f'ms @{g:g}Gb/s':>13}" for g in link_gbps) + "   (MB per update)"]
    for r in results:
        moved = r["bytes_per_update"]
        if moved is None:
            lines.append(f"{r['config']:<24} {r['global_batch']:>6} one device: nothing crosses")
            continue
        traffic = Traffic(**moved)
        lines.append(f"{r['config']:<24} {r['global_batch']:>6} "
                     + " ".join(f"{moved['copied'][c] / 1e6:>10.2f}" for c in CATEGORIES)
                     + f" {sum(moved['collective'].values()) / 1e6:>10.2f}"
                     + f" {r['busiest_device_bytes'] / 1e6:>10.2f}"
                     + f" {max(r['state_bytes_per_device'].values()) / 1e6:>10.2f}"
                     + "".join(f" {traffic.link_seconds(g) * 1e3:>13.2f}" for g in link_gbps))
    lines.append("weights: read from the weights and sent to a tower; gradients: a tower's gradient, loss "
                 "and weight sums (and, reduced by copies, the sum sent back); statistics: BN's; input: "
                 "the shards; collective: bytes entering all-reduces; busiest: the largest of any "
                 "device's bytes sent or received; state max: the variables, optimizer slots, moving "
                 "averages and accumulators of the device that holds the most (MB, not per update). "
                 "ms: the busiest device's link, full duplex, at that speed (tower_train/traffic.py)")
    return "\n".join(lines)
