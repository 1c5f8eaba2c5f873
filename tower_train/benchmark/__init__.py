"""python -m tower_train.benchmark: tower-train's updates against the alternatives, and memory against K.

Run commands:
    python -m tower_train.benchmark --num_gpus=4 --batch_size=32                    # docs/performance.md: speed
    python -m tower_train.benchmark --num_gpus=4 --batch_size=32 --measure=memory   # docs/performance.md: memory
    python -m tower_train.benchmark --configs=plain_k1,tower_pscpu_k1 --rounds=3 --output_json=b.json
    python -m tower_train.benchmark --num_gpus=4 --batch_size=32 --measure=traffic --link_gbps=256,100  # docs/which-mode.md
    python -m tower_train.benchmark --measure=keras --rounds=2                       # docs/performance.md: against Keras's fit

Speed, in the style of tf_cnn_benchmarks: warm-up updates (tracing included) are
not timed; each round times every configuration once, alternating, so that drift
of the machine cancels; a configuration's figure is the median over rounds of
examples/sec, +/- jitter = 1.4826 x the median absolute deviation. A configuration
fed by a pipeline (_data, _tfrecord, _dataset) also times that pipeline alone, with
no training, for as many updates as its rounds trained: the report says how many
times faster it delivers than its training consumes.

Bytes: the time report sets, beside each mode's time, the bytes one update moves
across devices by category, counted from the traced graphs of its functions
(`tower_train.traffic`); --measure=traffic prints only those, in more detail, and
the communication time they predict on links of --link_gbps. Nothing is run.

Memory: each configuration runs in a subprocess of its own, which reports its
peak resident memory during its updates (and, on GPUs, TensorFlow's peak per
device), against its resident memory once the model was built. A second
subprocess runs the same configuration at one example per tower (its floor), so
that the report can tell activations from what every update costs anyway.

A configuration is named KIND_kK[_bB][_sA-B...][_permicro][_data|_tfrecord|_dataset]:
- KIND, what runs one update (see KINDS);
- K, micro-steps per update;
- B, examples per tower per micro-step (default --batch_size), so a configuration
  consumes G = B x towers x K examples per update;
- _data: batches come from the training input pipeline of --dataset (its arrays,
  shuffle, --augment distortions) instead of one fixed batch held in memory;
- _tfrecord: the same examples, written once to TFRecord files in a temporary
  directory and streamed from there by a `TFRecordSource` (parse, shuffle buffer,
  the same preprocessing);
- _dataset: the same examples through a `DatasetSource` whose train() is
  tf.data.Dataset.from_tensor_slices of the same arrays with a seeded shuffle buffer,
  batched by the trainer (the same preprocessing);
- _sA-B...: tower kinds only, --tower_split=A,B,...: tower i takes share i of every
  micro-batch. With --slow_tower_ms, tower 0 is made slower than the others, so the
  suite can show what a skewed split saves on unequal devices;
- _permicro: tower_pscpu and tower_psgpu only, --tower_weights=per_micro_step: the towers read the
  weights from the parameter device at every micro-step instead of once per update.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys

from tower_train import flags as tt_flags
from tower_train import startup
from tower_train.benchmark.keras_epochs import format_keras_report, measure_keras_epochs
from tower_train.benchmark.memory import format_memory_report, measure_memory
from tower_train.benchmark.names import MEASURES, BenchConfig, default_configs, parse_config_name
from tower_train.benchmark.ops import format_ops_report, measure_ops
from tower_train.benchmark.options import bench_flags
from tower_train.benchmark.timing import format_report, run_benchmark
from tower_train.benchmark.traffic_report import format_traffic_report, measure_traffic
from tower_train.cli import command, parse_config
from tower_train.errors import UsageError
from tower_train.quiet_start import load_tensorflow
from tower_train.rules import MODE_RULES


def _link_speeds(values: list[str]) -> list[float]:
    try:
        speeds = [float(v) for v in values]
    except ValueError:
        speeds = []
    if len(speeds) != len(values) or not all(s > 0 for s in speeds):
        raise UsageError(f"--link_gbps={','.join(values)}: must be numbers > 0 (gigabits per second), "
                         "comma-separated")
    return speeds


def _benchmark(argv: list[str]) -> int:
    options = bench_flags()
    config = parse_config(argv, __doc__ or "", options, tt_flags.BENCHMARK_OPTIONS)
    measure = options["measure"].value
    if measure not in MEASURES:
        raise UsageError(f"--measure={measure}: unknown; allowed: {', '.join(MEASURES)}")
    if measure == "memory" and not os.path.exists("/proc/self/clear_refs"):
        raise UsageError("--measure=memory: needs Linux's /proc/self/status and clear_refs")
    for key in ("updates", "rounds"):
        if options[key].value < 1:
            raise UsageError(f"--{key}={options[key].value}: must be a whole number >= 1")
    if measure == "keras":
        if options["configs"].value:
            raise UsageError("--configs: not with --measure=keras, which times its own two models")
        load_tensorflow()
        # Keras's own fit and tower_train.keras.fit(num_gpus=1) each place their one device.
        results = measure_keras_epochs(options["rounds"].value)
        return _report(format_keras_report(results), results, measure, 1, options)
    keras_jit_compile = config.jit_compile  # as given: "auto" lets keras_fit's Keras decide
    names = options["configs"].value or default_configs(measure, config.batch_size)
    benches = [parse_config_name(name, config.batch_size) for name in names]
    if options["warmup_updates"].value < 1:
        raise UsageError("--warmup_updates must be >= 1: the first update traces")
    if not options["slow_tower_ms"].value >= 0:
        raise UsageError(f"--slow_tower_ms={options['slow_tower_ms'].value}: must be a number >= 0")
    if options["slow_tower_ms"].value and measure != "time":
        raise UsageError("--slow_tower_ms: only with --measure=time")
    if options["slow_tower_ms"].value:
        if config.jit_compile is True:
            raise UsageError("--slow_tower_ms: not with --jit_compile (XLA cannot compile the slowed "
                             "tower's sleep)")
        config = dataclasses.replace(config, jit_compile=False)  # what --jit_compile=auto would not know
    link_gbps = _link_speeds(options["link_gbps"].value)
    if link_gbps and measure != "traffic":
        raise UsageError("--link_gbps: only with --measure=traffic")
    with startup.start(startup.BENCHMARK, startup.options_of(config), announce=True) as run:
        config, plan = run.config, run.plan
        benches = trainable_configs(benches, run, given=bool(options["configs"].value))
        if measure == "memory":
            results = measure_memory(benches, argv)
            report = format_memory_report(results)
        elif measure == "traffic":
            results = measure_traffic(config, benches, plan, keras_jit_compile)
            report = format_traffic_report(results, link_gbps)
        elif measure == "ops":
            results = measure_ops(config, benches, plan, options["updates"].value,
                                  options["warmup_updates"].value, keras_jit_compile)
            report = format_ops_report(results)
        else:
            measurements = run_benchmark(config, benches, plan, options["updates"].value,
                                         options["warmup_updates"].value, options["rounds"].value,
                                         options["slow_tower_ms"].value, keras_jit_compile)
            results = [dataclasses.asdict(m) for m in measurements]
            report = format_report(measurements, len(plan.tower_devices), config.batch_size)
    return _report(report, results, measure, len(plan.tower_devices), options, config.batch_size)


def trainable_configs(benches: list[BenchConfig], run: startup.Started, given: bool) -> list[BenchConfig]:
    """`benches` without the configurations whose mode cannot train the model (central_storage
    and a model with BN statistics or Dropout), found before any is measured: refused in one
    line when --configs named them, left out of a default suite with a line that says why."""
    from absl import logging

    from tower_train.model_spec import build_model, replica_state_fault

    modes = {bench.kind for bench in benches if bench.kind in MODE_RULES}
    if all(MODE_RULES[mode].keeps_replica_state for mode in modes):
        return benches
    model = build_model(run.spec, run.source, run.config)
    faults = {mode: replica_state_fault(mode, run.spec.label, model) for mode in modes}
    unfit = [bench.name for bench in benches if faults.get(bench.kind)]
    if not unfit:
        return benches
    fault = next(filter(None, faults.values()))
    if given:
        them = "it" if len(unfit) == 1 else "them"
        raise UsageError(f"--configs: {', '.join(unfit)}: {fault}; leave {them} out")
    logging.warning("the benchmark leaves out %s: %s", ", ".join(unfit), fault)
    return [bench for bench in benches if bench.name not in unfit]


def _report(report: str, results: list, measure: str, towers: int, options: dict,
            batch_per_tower: int | None = None) -> int:
    """Prints the report and writes --output_json; returns the exit status."""
    print(report)
    if options["output_json"].value:
        import tensorflow as tf

        with open(options["output_json"].value, "w") as f:
            json.dump({"measure": measure, "towers": towers, "batch_per_tower": batch_per_tower,
                       "cores": os.cpu_count(), "tensorflow": tf.__version__,
                       "results": [dataclasses.asdict(r) if dataclasses.is_dataclass(r) else r
                                   for r in results]}, f, indent=2)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Runs `python -m tower_train.benchmark`; returns the exit status."""
    return command(lambda: _benchmark(sys.argv if argv is None else argv))
