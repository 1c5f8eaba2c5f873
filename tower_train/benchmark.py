"""python -m tower_train.benchmark: time tower updates against a plain single-device step.

Run commands:
    python -m tower_train.benchmark --num_gpus=4 --batch_size=32     # the README's table
    python -m tower_train.benchmark --configs=plain_k1,tower_k1 --rounds=3 --output_json=b.json

In the style of tf_cnn_benchmarks: warm-up updates (tracing included) are not
timed; each round times every configuration once, alternating, so that drift
of the machine cancels; a configuration's figure is the median over rounds of
examples/sec, +/- jitter = 1.4826 x the median absolute deviation.

Every configuration uses the same micro-batch per tower (--batch_size) and the
same towers (--num_gpus); `_kK` accumulates K micro-steps per update. `plain_kK`
is one GradientTape step on the parameter device over the whole global batch
G = batch_size x towers x K: the reference the towers are measured against.
"""
from __future__ import annotations

import dataclasses
import json
import statistics
import sys
import time
from typing import TYPE_CHECKING, Callable

from absl import flags

from tower_train import flags as tt_flags
from tower_train.cli import fail, parse_config, prepare_devices
from tower_train.config import TrainConfig
from tower_train.errors import UsageError
from tower_train.stats import jitter

if TYPE_CHECKING:
    from tower_train.devices import DevicePlan

BENCH_FLAGS = tt_flags.define_benchmark_flags()
KINDS = ("plain", "tower", "mirrored", "central_storage")


@dataclasses.dataclass(frozen=True)
class Measurement:
    config: str
    global_batch: int
    examples_per_sec: float  # median over rounds
    jitter: float  # 1.4826 x median absolute deviation of examples/sec over rounds
    sec_per_update: float  # median

    @property
    def sec_per_example(self) -> float:
        return self.sec_per_update / self.global_batch


def parse_config_name(name: str) -> tuple[str, int]:
    """'tower_k8' -> ('tower', 8)."""
    kind, _, k = name.partition("_k")
    if kind not in KINDS or not k.isdigit() or int(k) < 1:
        raise UsageError(f"--configs: {name!r} is not MODE_kK with MODE in {', '.join(KINDS)} "
                         "and K >= 1")
    return kind, int(k)


def build_update(name: str, config: TrainConfig, plan: DevicePlan) -> tuple[Callable[[], object], int]:
    """One update of configuration `name` on fixed in-memory data, and its global batch."""
    import numpy as np
    import tensorflow as tf

    from tower_train import data
    from tower_train.modes import build_mode
    from tower_train.trainer import build_state
    from tower_train.towers import tower_loss_and_gradients

    kind, accum = parse_config_name(name)
    micro = config.batch_size * len(plan.tower_devices)
    train_examples = len(data.load_source(config.dataset, config.data_dir).train_labels)  # for the schedule
    rng = np.random.default_rng(config.seed)
    with tf.device("/cpu:0"):
        images = tf.constant(rng.normal(size=(micro, data.IMAGE_SIZE, data.IMAGE_SIZE, 3)),
                             tf.float32)
        labels = tf.constant(rng.integers(0, data.NUM_CLASSES, micro), tf.int32)
    if kind != "plain":
        mode = build_mode(dataclasses.replace(config, mode=kind, all_reduce="auto"), plan)
        state = build_state(config, mode.variable_scope(), train_examples)
        inner = mode.inner_step(state, accum, config.clip_norm)
        batches = iter(lambda: (images, labels), None)
        return lambda: inner.run_update(batches)[0].numpy(), micro * accum

    state = build_state(config, tf.device(plan.param_device), train_examples)
    rule = state.update_rule(config.clip_norm)  # the same update-boundary work as the towers'

    whole_images, whole_labels = tf.tile(images, [accum, 1, 1, 1]), tf.tile(labels, [accum])

    @tf.function
    def plain_step() -> tf.Tensor:
        with tf.device(plan.param_device):
            loss, grads = tower_loss_and_gradients(state.model, whole_images, whole_labels)
            rule.apply(rule.clip(grads))
            return loss

    return lambda: plain_step().numpy(), micro * accum


def run_benchmark(config: TrainConfig, names: list[str], plan: DevicePlan, updates: int,
                  warmup_updates: int, rounds: int) -> list[Measurement]:
    """Times every configuration, alternating, and returns one Measurement each."""
    steps = {name: build_update(name, config, plan) for name in names}
    for run_update, _ in steps.values():
        for _ in range(warmup_updates):
            run_update()
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(rounds):
        for name, (run_update, _) in steps.items():
            start = time.perf_counter()
            for _ in range(updates):
                run_update()
            seconds[name].append((time.perf_counter() - start) / updates)
    results = []
    for name, (_, global_batch) in steps.items():
        rates = [global_batch / s for s in seconds[name]]
        results.append(Measurement(name, global_batch, statistics.median(rates), jitter(rates),
                                   statistics.median(seconds[name])))
    return results


def format_report(results: list[Measurement], towers: int) -> str:
    lines = [f"{'config':<12} {'G':>6} {'examples/sec':>22} {'sec/update':>11}"]
    for m in results:
        lines.append(f"{m.config:<12} {m.global_batch:>6} "
                     f"{m.examples_per_sec:>12.1f} +/- {m.jitter:<7.1f} {m.sec_per_update:>11.4f}")
    by_name = {m.config: m for m in results}
    for kind, k in (("tower", 1), ("tower", 8)):
        plain, tower = by_name.get(f"plain_k{k}"), by_name.get(f"{kind}_k{k}")
        if plain and tower:
            lines.append(f"time per example, {tower.config} / {plain.config} (same G, {towers} "
                         f"towers): {tower.sec_per_example / plain.sec_per_example:.3f}")
    if "tower_k1" in by_name and "tower_k8" in by_name:
        ratio = by_name["tower_k8"].sec_per_example / by_name["tower_k1"].sec_per_example
        lines.append(f"time per example, tower_k8 / tower_k1 (same micro-batch): {ratio:.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv if argv is None else argv
    try:
        config = parse_config(argv)
        names = BENCH_FLAGS["configs"].value
        for name in names:
            parse_config_name(name)
        for key in ("updates", "rounds"):
            if BENCH_FLAGS[key].value < 1:
                raise UsageError(f"--{key}={BENCH_FLAGS[key].value}: must be a whole number >= 1")
        if BENCH_FLAGS["warmup_updates"].value < 1:
            raise UsageError("--warmup_updates must be >= 1: the first update traces")
        plan = prepare_devices(config)
        results = run_benchmark(config, names, plan, BENCH_FLAGS["updates"].value, BENCH_FLAGS["warmup_updates"].value,
                                BENCH_FLAGS["rounds"].value)
    except (UsageError, flags.Error) as e:
        return fail(e)
    print(format_report(results, len(plan.tower_devices)))
    if BENCH_FLAGS["output_json"].value:
        with open(BENCH_FLAGS["output_json"].value, "w") as f:
            json.dump({"towers": len(plan.tower_devices), "batch_per_tower": config.batch_size,
                       "results": [dataclasses.asdict(m) for m in results]}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
