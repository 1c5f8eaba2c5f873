"""--measure=time: examples/sec of every configuration, alternating in this process, and its report."""
from __future__ import annotations

import dataclasses
import statistics
from typing import TYPE_CHECKING

from tower_train.benchmark.names import BenchConfig, comparisons, parse_config_name
from tower_train.benchmark.workloads import build_workload
from tower_train.config import TrainConfig
from tower_train.stats import jitter

if TYPE_CHECKING:
    from tower_train.devices import DevicePlan


@dataclasses.dataclass(frozen=True)
class Measurement:
    config: str
    global_batch: int
    examples_per_sec: float  # median over rounds
    jitter: float  # 1.4826 x median absolute deviation of examples/sec over rounds
    sec_per_update: float  # median
    labels_per_example: int  # > 1 for per-token labels: the report adds labels (tokens) per second
    bytes_per_update: dict | None  # Traffic.as_dict(); None for the kinds that run on one device
    input_examples_per_sec: float | None  # the input pipeline alone; None for a batch in memory
    busiest_device_bytes: float | None  # Traffic.busiest_device_bytes; None on one device
    state_bytes_per_device: dict | None  # Workload.state_bytes(); None on one device
    compute_devices: list[str]  # Workload.compute_devices(): where its update computes
    sec_per_update_by_round: list[float]  # in round order, so a reader can pair two configurations' rounds
    jit_compile: bool | None = None  # Workload.jit_compile: its update compiles with XLA

    @property
    def sec_per_example(self) -> float:
        return self.sec_per_update / self.global_batch

    @property
    def labels_per_sec(self) -> float:
        return self.examples_per_sec * self.labels_per_example


def run_benchmark(config: TrainConfig, benches: list[BenchConfig], plan: DevicePlan, updates: int,
                  warmup_updates: int, rounds: int, slow_tower_ms: float = 0.0,
                  keras_jit_compile: bool | str | None = None) -> list[Measurement]:
    """Times every configuration, alternating, and returns one Measurement each; then the input
    pipeline of each configuration that has one, alone, for as many updates as were trained.
    `keras_jit_compile`: keras_fit's jit_compile (`build_workload`)."""
    workloads = {bench.name: build_workload(bench, config, plan, slow_tower_ms, keras_jit_compile)
                 for bench in benches}
    for workload in workloads.values():
        workload.run(warmup_updates)
    seconds: dict[str, list[float]] = {name: [] for name in workloads}
    for _ in range(rounds):
        for name, workload in workloads.items():
            seconds[name].append(workload.run(updates) / updates)
    results = []
    for name, workload in workloads.items():
        rates = [workload.global_batch / s for s in seconds[name]]
        traffic = workload.traffic and workload.traffic()
        input_rate = None
        if workload.read_input:
            workload.read_input(warmup_updates)
            input_rate = workload.global_batch * updates * rounds / workload.read_input(updates * rounds)
        results.append(Measurement(name, workload.global_batch, statistics.median(rates), jitter(rates),
                                   statistics.median(seconds[name]), workload.labels_per_example,
                                   traffic and traffic.as_dict(), input_rate,
                                   traffic and traffic.busiest_device_bytes,
                                   workload.state_bytes and workload.state_bytes(),
                                   workload.compute_devices(), seconds[name], workload.jit_compile))
    return results


def moved_mb(bytes_per_update: dict | None, category: str) -> str:
    """MB per update of a category, along edges and into collectives; '-' on one device."""
    if bytes_per_update is None:
        return "-"
    return f"{(bytes_per_update['copied'][category] + bytes_per_update['collective'][category]) / 1e6:.2f}"


def devices_text(devices: list[str]) -> str:
    """['/gpu:0', '/gpu:1', '/gpu:2'] -> '/gpu:0..2'; devices of two kinds, or with a gap, in full."""
    kinds = {d.rsplit(":", 1)[0] for d in devices}
    numbers = [int(d.rsplit(":", 1)[1]) for d in devices]
    if len(devices) > 1 and len(kinds) == 1 and numbers == list(range(numbers[0], numbers[0] + len(numbers))):
        return f"{devices[0]}..{numbers[-1]}"
    return ",".join(devices) or "-"


def format_report(results: list[Measurement], towers: int, batch_size: int) -> str:
    per_token = any(m.labels_per_example > 1 for m in results)
    lines = [f"{'config':<24} {'G':>6} {'examples/sec':>22} {'sec/update':>11} "
             f"{'weights MB':>10} {'grads MB':>9} {'stats MB':>9}"
             + (f" {'tokens/sec':>11}" if per_token else "") + "  computes on"]
    for m in results:
        moved = m.bytes_per_update
        lines.append(f"{m.config:<24} {m.global_batch:>6} "
                     f"{m.examples_per_sec:>12.1f} +/- {m.jitter:<7.1f} {m.sec_per_update:>11.4f} "
                     f"{moved_mb(moved, 'weights'):>10} {moved_mb(moved, 'gradients'):>9} "
                     f"{moved_mb(moved, 'statistics'):>9}"
                     + (f" {m.labels_per_sec:>11.0f}" if per_token else "")
                     + f"  {devices_text(m.compute_devices)}")
    by_name = {m.config: m for m in results}
    for a, b, note in comparisons(list(by_name), batch_size):
        ratio = by_name[a].sec_per_example / by_name[b].sec_per_example
        lines.append(f"time per example, {a} / {b}: {ratio:.3f}" + (f"  ({note})" if note else ""))
    lines += _against_keras_fit(results, batch_size)
    for m in results:
        if m.input_examples_per_sec:
            lines.append(f"input alone, {m.config}: {m.input_examples_per_sec:.0f} examples/sec, "
                         f"{m.input_examples_per_sec / m.examples_per_sec:.1f}x what its training "
                         "consumes (goal >= 10)")
    if any(m.jit_compile is not None for m in results):
        lines.append("compiled with XLA: " + (", ".join(m.config for m in results if m.jit_compile) or "none"))
    lines.append(f"{towers} tower(s), {batch_size} examples per tower per micro-step unless _bB says"
                 + ("; tokens/sec counts every label position, padding included" if per_token else ""))
    lines.append("MB: bytes per update across devices (10^6), counted from the traced graphs; "
                 "'-': one device. computes on: the devices of its convolutions and matmuls, from the same graphs")
    return "\n".join(lines)


def _against_keras_fit(results: list[Measurement], batch_size: int) -> list[str]:
    """For each keras_fit_kK that ran: every other configuration with the same K, as its
    examples/sec over keras_fit_kK's (images/sec on an image set), what a user of Keras's fit
    compares; above 1 is faster than Keras."""
    accum = {m.config: parse_config_name(m.config, batch_size).accum for m in results}
    lines = []
    for keras_fit in (m for m in results if m.config.startswith("keras_fit_")):
        others = [m for m in results if m is not keras_fit and accum[m.config] == accum[keras_fit.config]]
        if others:
            lines.append(f"examples/sec / {keras_fit.config}'s: " + ", ".join(
                f"{m.config} {m.examples_per_sec / keras_fit.examples_per_sec:.3f}" for m in others)
                + "  (above 1: faster than Keras's fit)")
    return lines
