"""python -m tower_train.benchmark: tower-train's updates against the alternatives, and memory against K.

Run commands:
    python -m tower_train.benchmark --num_gpus=4 --batch_size=32                    # docs/performance.md: speed
    python -m tower_train.benchmark --num_gpus=4 --batch_size=32 --measure=memory   # docs/performance.md: memory
    python -m tower_train.benchmark --configs=plain_k1,tower_pscpu_k1 --rounds=3 --output_json=b.json
    python -m tower_train.benchmark --num_gpus=4 --batch_size=32 --measure=traffic --link_gbps=256,100  # docs/which-mode.md

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
- _permicro: tower kinds only, --tower_weights=per_micro_step: the towers read the
  weights from the parameter device at every micro-step instead of once per update.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import statistics
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Callable

from absl import flags

from tower_train import flags as tt_flags
from tower_train.api import check_data, prepare_devices
from tower_train.cli import command, load_tensorflow, parse_config
from tower_train.config import TrainConfig
from tower_train.errors import UsageError
from tower_train.stats import jitter

if TYPE_CHECKING:
    from tower_train.devices import DevicePlan
    from tower_train.traffic import Traffic



@functools.cache
def bench_flags() -> dict[str, flags.FlagHolder]:
    """The benchmark's own flags, defined when a command first needs them: importing this
    module for its pure functions (as the tests do) must not claim flag names that
    `tower_train.compare` defines too."""
    return tt_flags.define_benchmark_flags()

KINDS = {
    "plain": "one GradientTape step over all G examples on the parameter device: the reference",
    "tower_pscpu": "tower mode, variables on the host CPU /cpu:0 (the original's placement)",
    "tower_psgpu": "tower mode, variables on GPU 0 (without a GPU, on the first tower's device)",
    "mirrored": "MirroredStrategy over the same towers",
    "central_storage": "CentralStorageStrategy over the same towers and parameter device",
    "keras_fit": "Keras 3 model.fit on one device, optimizer.gradient_accumulation_steps = K",
}
MEASURES = ("time", "memory", "traffic", "ops")
_NAME = re.compile(r"^(?P<kind>[a-z_]+?)_k(?P<accum>\d+)(?:_b(?P<batch>\d+))?(?:_s(?P<split>\d+(?:-\d+)+))?"
                   r"(?P<permicro>_permicro)?(?:_(?P<input>data|tfrecord|dataset))?$")
NAME_FORM = "KIND_kK[_bB][_sA-B...][_permicro][_data|_tfrecord|_dataset]"
MODE_KINDS = ("tower_pscpu", "tower_psgpu", "mirrored", "central_storage")  # run by a mode's inner step
# One fixed batch; the source's pipeline; streamed files; a tf.data pipeline of the same arrays.
INPUTS = ("memory", "data", "tfrecord", "dataset")


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """One parsed configuration name."""

    name: str
    kind: str
    accum: int  # K
    batch_size: int  # B, per tower per micro-step
    input: str  # one of INPUTS
    tower_split: str | None = None  # --tower_split, e.g. "1,3" (tower kinds only)
    weights_per_micro_step: bool = False  # _permicro: --tower_weights=per_micro_step (tower kinds only)


def parse_config_name(name: str, default_batch_size: int) -> BenchConfig:
    """'tower_pscpu_k8_b32_data' -> BenchConfig(kind='tower_pscpu', accum=8, batch_size=32, input='data')."""
    match = _NAME.match(name)
    if not match or match["kind"] not in KINDS or int(match["accum"]) < 1 or (
            match["batch"] is not None and int(match["batch"]) < 1):
        raise UsageError(f"--configs: {name!r} is not {NAME_FORM} with KIND in "
                         f"{', '.join(KINDS)}, K >= 1 and B >= 1")
    batch = default_batch_size if match["batch"] is None else int(match["batch"])
    split = match["split"] and match["split"].replace("-", ",")
    if split and not match["kind"].startswith("tower_ps"):
        raise UsageError(f"--configs: {name!r}: _sSHARES (--tower_split) is for the tower kinds only")
    if match["permicro"] and not match["kind"].startswith("tower_ps"):
        raise UsageError(f"--configs: {name!r}: _permicro (--tower_weights=per_micro_step) is for the "
                         "tower kinds only")
    return BenchConfig(name, match["kind"], int(match["accum"]), batch, match["input"] or "memory", split,
                       bool(match["permicro"]))


def default_configs(measure: str, batch_size: int) -> list[str]:
    """The suite for `--measure` when --configs is not given.

    time: every kind at K = 1 and K = 8 with the same micro-batch; tower mode at K = 1
    with the G of K = 8 (a micro-batch 8 times larger); tower mode at K = 8 with the weights
    read at every micro-step; tower mode at K = 8 fed by the input pipeline. memory: tower mode
    at one G = 8 x batch_size x towers, as K = 1, 2, 4, 8. traffic: every kind that crosses
    devices at K = 1 and K = 8, and tower mode at K = 8 with the weights read at every
    micro-step.
    """
    if measure == "memory":
        return [f"tower_pscpu_k{k}_b{batch_size * 8 // k}" for k in (1, 2, 4, 8)]
    if measure == "traffic":
        return [f"{kind}_k{k}" for kind in MODE_KINDS for k in (1, 8)] + ["tower_pscpu_k8_permicro"]
    return ([f"{kind}_k{k}" for kind in KINDS for k in (1, 8)]
            + [f"tower_pscpu_k1_b{batch_size * 8}", "tower_pscpu_k8_permicro", "tower_pscpu_k8_data",
               "tower_pscpu_k8_tfrecord"])


@dataclasses.dataclass(frozen=True)
class Workload:
    """`run(n)` applies n updates and returns the seconds they took; each consumes `global_batch`
    examples of `labels_per_example` labels (tokens, for a sequence model). `traffic()` counts
    the bytes one update moves across devices (tracing its functions if they were not); None
    for the kinds that run on one device; `state_bytes()` the bytes of variables, optimizer slots,
    moving averages and accumulators each device holds, None for them too. `read_input(n)` reads n updates' batches from the same
    training stream and nothing else, returning the seconds; None for a batch held in memory."""

    run: Callable[[int], float]
    global_batch: int
    labels_per_example: int
    traffic: Callable[[], Traffic] | None
    state_bytes: Callable[[], dict[str, int]] | None
    read_input: Callable[[int], float] | None


def build_workload(bench: BenchConfig, config: TrainConfig, plan: DevicePlan,
                   slow_tower_ms: float = 0.0) -> Workload:
    """A fresh model and optimizer (seeded by --seed) training as `bench` says; in tower mode,
    tower 0 waits `slow_tower_ms` per example of its shard (`slowed_first_tower`)."""
    import numpy as np
    import tensorflow as tf

    from tower_train import datasets
    from tower_train.devices import parameter_device
    from tower_train.model_spec import resolve_model
    from tower_train.trainer import TrainState, build_state

    config = dataclasses.replace(config, batch_size=bench.batch_size, accum=bench.accum,
                                 tower_split=bench.tower_split)
    if bench.kind.startswith("tower_ps"):  # the kind, not --ps_device, says where the variables live
        ps_device = bench.kind.removeprefix("tower_ps")
        tower_weights = "per_micro_step" if bench.weights_per_micro_step else config.tower_weights
        config = dataclasses.replace(config, mode="tower", all_reduce="auto", ps_device=ps_device,
                                     tower_weights=tower_weights)
        plan = dataclasses.replace(plan, param_device=parameter_device(ps_device, plan.tower_devices))
    elif bench.kind in ("mirrored", "central_storage"):
        # Tower-only options the run's flags may set apply to the tower kinds alone.
        config = dataclasses.replace(config, mode=bench.kind, all_reduce="auto", tower_weights="per_update",
                                     transfer_precision="fp32")
    micro = bench.batch_size * len(plan.tower_devices)
    source = datasets.load_source(config.dataset, config.data_dir, config.augment)
    spec = resolve_model(None, config, None, source.num_classes)
    if bench.input == "tfrecord":
        source = _records_of(source)
    elif bench.input == "dataset":
        source = _pipeline_of(source, config.seed)
    if bench.input != "memory":
        dataset = source.train_stream(seed=config.seed, start_position=0, micro_batch=micro)
    else:
        example = source.example_input()
        rng = np.random.default_rng(config.seed)
        shape = (micro, *example.shape[1:])
        with tf.device("/cpu:0"):  # token ids for a model of integer inputs, else normal values
            features = tf.constant(rng.integers(0, source.num_classes, shape) if example.dtype.is_integer
                                   else rng.normal(size=shape), example.dtype)
            labels = tf.constant(rng.integers(0, source.num_classes, (micro, *source.label_spec.shape)),
                                 source.label_spec.dtype)
            weights = tf.ones(labels.shape, tf.float32)
        dataset = tf.data.Dataset.from_tensors((features, labels, weights)).repeat()
    builder = {"plain": _plain, "keras_fit": _keras_fit}.get(
        bench.kind, functools.partial(_mode, slow_tower_ms=slow_tower_ms))
    built = []  # the state the builder makes: what each device holds is read from it

    def new_state(scope) -> TrainState:
        built.append(build_state(config, spec, source, scope))
        return built[-1]

    run, inner = builder(config, plan, dataset, new_state, source.train_size)
    batch_spec = tuple(tf.TensorSpec([micro, *s.shape[1:]], s.dtype) for s in dataset.element_spec)

    def traffic() -> Traffic:
        from tower_train.devices import HOST_DEVICE
        from tower_train.traffic import count_traffic

        # The batches come from the host (a tf.data pipeline, or a batch held there).
        return count_traffic(inner.traced_update(batch_spec), inner.variable_roles(), HOST_DEVICE)

    def state_bytes() -> dict[str, int]:
        from tower_train.traffic import state_bytes_per_device

        state = built[0]
        loss_scale = state.loss_scale
        return state_bytes_per_device([
            *state.model.variables, *state.optimizer.variables, state.step, state.examples_seen,
            *(state.moving_average.averages if state.moving_average else ()),
            *((loss_scale.value, loss_scale.good_updates) if loss_scale else ()),
            *(v for variables in inner.variable_roles().values() for v in variables)])

    return Workload(run, micro * bench.accum, source.label_spec.shape.num_elements(),
                    None if inner is None else traffic, None if inner is None else state_bytes,
                    None if bench.input == "memory" else _input_reader(dataset, bench.accum))


def _input_reader(dataset, accum: int) -> Callable[[int], float]:
    """`read(n)`: the seconds that reading n updates' micro-batches from a second iterator of
    `dataset` takes, with no training beside it."""
    batches = None

    def read(updates: int) -> float:
        nonlocal batches
        start = time.perf_counter()
        batches = batches or iter(dataset)  # made on first use: its prefetching would compete
        for _ in range(updates * accum):
            next(batches)
        return time.perf_counter() - start

    return read


@functools.cache
def _records_of(source):
    """The training examples of an ArraySource written to TFRecord files (once per process, in a
    temporary directory removed at exit), streamed back by a TFRecordSource with the same
    preprocessing: images as raw bytes, so parsing is a decode_raw."""
    import atexit
    import shutil
    import tempfile

    import numpy as np
    import tensorflow as tf

    from tower_train.tfrecord_source import TFRecordSource, write_examples

    directory = tempfile.mkdtemp(prefix="tower_train_benchmark_records.")
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    files = 8  # several files, as a real data set has
    for i, rows in enumerate(np.array_split(np.arange(source.train_size), files)):
        write_examples(f"{directory}/train-{i}.tfrecord",
                       {"features": [source.train_features[r].tobytes() for r in rows],
                        "labels": source.train_labels[rows]})
    shape, dtype = source.feature_spec.shape, source.feature_spec.dtype

    def parse(example):
        features = tf.reshape(tf.io.decode_raw(example["features"], dtype), shape)
        return features, tf.cast(example["labels"], tf.int32)

    return TFRecordSource(
        f"{directory}/train-*.tfrecord", features={
            "features": tf.io.FixedLenFeature([], tf.string),
            "labels": tf.io.FixedLenFeature(source.label_spec.shape, tf.int64)},
        parse=parse, feature_spec=source.feature_spec, label_spec=source.label_spec,
        num_classes=source.num_classes, train_size=source.train_size, preprocess=source.preprocess,
        name=f"{source.name} as TFRecord files")


def _pipeline_of(source, seed: int):
    """The training examples of an ArraySource as a DatasetSource: from_tensor_slices of its arrays
    through a shuffle buffer of 10,000 (a TFRecordSource's default) seeded by `seed`, with the same
    preprocessing."""
    import tensorflow as tf

    from tower_train.dataset_source import DatasetSource

    def train() -> tf.data.Dataset:
        examples = tf.data.Dataset.from_tensor_slices((source.train_features, source.train_labels))
        return examples.shuffle(10_000, seed=seed)

    return DatasetSource(train=train, num_classes=source.num_classes, preprocess=source.preprocess,
                         name=f"{source.name} as a tf.data pipeline")


def slowed_first_tower(state, config: TrainConfig, ms_per_example: float):
    """Tower mode's tower function, but tower 0 (the one under run_on_towers' name scope
    "tower_0") also waits `ms_per_example` milliseconds per example of its shard, in a sleep
    that holds no core: a device slower than the others, as an older GPU beside newer ones."""
    import tensorflow as tf

    from tower_train.towers import tower_function

    tower = tower_function(state.model, state.loss_scale, config.jit_compile)

    def wait(seconds: tf.Tensor) -> tf.Tensor:
        time.sleep(float(seconds))
        return seconds

    def slowed(features, labels, weights, *copies_and_seeds):
        result = tower(features, labels, weights, *copies_and_seeds)
        if "tower_0" not in tf.get_current_name_scope().split("/"):
            return result
        delay = tf.cast(tf.shape(labels)[0], tf.float32) * (ms_per_example / 1000.0)
        with tf.control_dependencies([tf.py_function(wait, [delay], tf.float32)]):
            return tf.nest.map_structure(lambda t: t if t is None else tf.identity(t), result)

    return slowed


def _mode(config: TrainConfig, plan: DevicePlan, dataset, new_state: Callable,
          train_examples: int | None, slow_tower_ms: float = 0.0) -> tuple[Callable[[int], float], object]:
    """tower_pscpu, tower_psgpu, mirrored, central_storage: the trainer's own inner step, which
    is returned too."""
    from tower_train.modes import build_mode

    mode = build_mode(config, plan)
    state = new_state(mode.variable_scope())
    slow = slow_tower_ms > 0 and config.mode == "tower"
    inner = mode.inner_step(state, config, slowed_first_tower(state, config, slow_tower_ms) if slow else None)
    batches = iter(dataset)

    def run(updates: int) -> float:
        start = time.perf_counter()
        for _ in range(updates):
            inner.run_update(batches)  # its result is read: waits for the update
        return time.perf_counter() - start

    return run, inner


def _plain(config: TrainConfig, plan: DevicePlan, dataset, new_state: Callable,
           train_examples: int | None) -> tuple[Callable[[int], float], None]:
    """One GradientTape step on the parameter device over all G examples, with the same
    update-boundary work (regularization, clip, apply, count, average) as the towers'."""
    import tensorflow as tf

    from tower_train.towers import regularization_gradients, tower_loss_and_gradients

    state = new_state(tf.device(plan.param_device))
    rule = state.update_rule(config.clip_norm)
    whole_batches = iter(dataset.batch(config.accum).map(
        lambda *parts: tuple(tf.reshape(p, [-1, *p.shape[2:]]) for p in parts)))

    @tf.function(jit_compile=config.jit_compile)
    def plain_step(features: tf.Tensor, labels: tf.Tensor, weights: tf.Tensor) -> tf.Tensor:
        with tf.device(plan.param_device):
            result = tower_loss_and_gradients(state.model, features, labels, weights)
            regularization, regularization_grads = regularization_gradients(state.model)
            # The tower's gradient is of sum(w * loss) / (labels): rescaled to / sum(w). One shard
            # of all G examples: the batch losses count as they are.
            scale = tf.cast(tf.size(weights), tf.float32) / result.weight_sum
            grads = [g * scale + r for g, r in zip(result.gradients, regularization_grads)]
            if result.batch_gradients is not None:
                grads = [g + b for g, b in zip(grads, result.batch_gradients)]
            rule.apply(rule.clip(grads))
            return result.loss_sum / result.weight_sum + regularization + result.batch_loss

    def run(updates: int) -> float:
        start = time.perf_counter()
        for _ in range(updates):
            float(plain_step(*next(whole_batches)))
        return time.perf_counter() - start

    return run, None


def _keras_fit(config: TrainConfig, plan: DevicePlan, dataset, new_state: Callable,
               train_examples: int | None) -> tuple[Callable[[int], float], None]:
    """What a user would pick instead: Keras's own train step and gradient accumulation, on
    the same network, loss, optimizer and schedule, fed the micro-batch of all towers."""
    import keras
    import tensorflow as tf

    from tower_train.trainer import make_optimizer

    state = new_state(tf.device(plan.param_device))
    net = state.model

    class FitModel(keras.Model):
        """The network behind Keras's train step, with tower-train's loss: the weighted mean of the
        per-label losses (the data's weights arrive as Keras's sample_weight) + regularization."""

        def __init__(self):
            super().__init__()
            self.net = net

        def call(self, images, training=False):
            return self.net(images, training=training)

        def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
            losses = tf.cast(self.net.per_example_loss(y, y_pred), tf.float32)
            weighted = tf.reduce_sum(losses * sample_weight) / tf.reduce_sum(sample_weight)
            return weighted + self.net.regularization()

    optimizer = make_optimizer(config, config.global_batch, train_examples)
    if config.accum > 1:  # Keras takes None, not 1, for no accumulation
        optimizer.gradient_accumulation_steps = config.accum
    class BatchClock(keras.callbacks.Callback):
        """Seconds from the start of fit's first batch to the end of its last, so fit's own
        set-up (iterator, callbacks) is not charged to the updates."""

        seconds = 0.0

        def on_train_begin(self, logs=None):
            self.start = None

        def on_train_batch_begin(self, batch, logs=None):
            if self.start is None:
                self.start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            self.seconds = time.perf_counter() - self.start

    model = FitModel()
    model.compile(optimizer=optimizer, jit_compile=config.jit_compile)
    clock = BatchClock()

    def run(updates: int) -> float:
        with tf.device(plan.param_device):
            model.fit(dataset, epochs=1, steps_per_epoch=updates * config.accum, verbose=0, shuffle=False,
                      callbacks=[clock])
        return clock.seconds

    return run, None


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

    @property
    def sec_per_example(self) -> float:
        return self.sec_per_update / self.global_batch

    @property
    def labels_per_sec(self) -> float:
        return self.examples_per_sec * self.labels_per_example


def run_benchmark(config: TrainConfig, benches: list[BenchConfig], plan: DevicePlan, updates: int,
                  warmup_updates: int, rounds: int, slow_tower_ms: float = 0.0) -> list[Measurement]:
    """Times every configuration, alternating, and returns one Measurement each; then the input
    pipeline of each configuration that has one, alone, for as many updates as were trained."""
    workloads = {bench.name: build_workload(bench, config, plan, slow_tower_ms) for bench in benches}
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
                                   workload.state_bytes and workload.state_bytes()))
    return results


def comparisons(names: list[str], batch_size: int) -> list[tuple[str, str, str]]:
    """(A, B, what it shows) for every pair of the suite whose two configurations were run;
    the report prints time per example of A / B."""
    pairs = []
    for k in (1, 8):
        pairs += [(f"tower_pscpu_k{k}", f"plain_k{k}", "towers vs one device, same G; goal <= 1.05"),
                  (f"tower_psgpu_k{k}", f"plain_k{k}", "towers vs one device, same G"),
                  (f"tower_pscpu_k{k}", f"mirrored_k{k}", "goal <= 1.0"),
                  (f"tower_pscpu_k{k}", f"central_storage_k{k}", ""),
                  (f"tower_pscpu_k{k}", f"keras_fit_k{k}", "goal <= 1.0")]
    pairs += [("tower_pscpu_k8", "tower_pscpu_k1", "same micro-batch; goal <= 1.0"),
              ("tower_pscpu_k8", "tower_pscpu_k8_permicro", "weights once per update vs every micro-step"),
              ("tower_pscpu_k8", f"tower_pscpu_k1_b{batch_size * 8}", "same G, micro-batch 8x smaller"),
              ("tower_pscpu_k8_data", "tower_pscpu_k8", "input pipeline vs in memory; goal <= 1.05"),
              ("tower_pscpu_k8_tfrecord", "tower_pscpu_k8", "streamed TFRecord files vs in memory; goal <= 1.05"),
              ("tower_pscpu_k8_dataset", "tower_pscpu_k8", "a tf.data pipeline vs in memory; goal <= 1.05")]
    present = set(names)
    return [pair for pair in pairs if pair[0] in present and pair[1] in present]


def moved_mb(bytes_per_update: dict | None, category: str) -> str:
    """MB per update of a category, along edges and into collectives; '-' on one device."""
    if bytes_per_update is None:
        return "-"
    return f"{(bytes_per_update['copied'][category] + bytes_per_update['collective'][category]) / 1e6:.2f}"


def format_report(results: list[Measurement], towers: int, batch_size: int) -> str:
    per_token = any(m.labels_per_example > 1 for m in results)
    lines = [f"{'config':<24} {'G':>6} {'examples/sec':>22} {'sec/update':>11} "
             f"{'weights MB':>10} {'grads MB':>9} {'stats MB':>9}"
             + (f" {'tokens/sec':>11}" if per_token else "")]
    for m in results:
        moved = m.bytes_per_update
        lines.append(f"{m.config:<24} {m.global_batch:>6} "
                     f"{m.examples_per_sec:>12.1f} +/- {m.jitter:<7.1f} {m.sec_per_update:>11.4f} "
                     f"{moved_mb(moved, 'weights'):>10} {moved_mb(moved, 'gradients'):>9} "
                     f"{moved_mb(moved, 'statistics'):>9}"
                     + (f" {m.labels_per_sec:>11.0f}" if per_token else ""))
    by_name = {m.config: m for m in results}
    for a, b, note in comparisons(list(by_name), batch_size):
        ratio = by_name[a].sec_per_example / by_name[b].sec_per_example
        lines.append(f"time per example, {a} / {b}: {ratio:.3f}" + (f"  ({note})" if note else ""))
    for m in results:
        if m.input_examples_per_sec:
            lines.append(f"input alone, {m.config}: {m.input_examples_per_sec:.0f} examples/sec, "
                         f"{m.input_examples_per_sec / m.examples_per_sec:.1f}x what its training "
                         "consumes (goal >= 10)")
    lines.append(f"{towers} tower(s), {batch_size} examples per tower per micro-step unless _bB says"
                 + ("; tokens/sec counts every label position, padding included" if per_token else ""))
    lines.append("MB: bytes per update across devices (10^6), counted from the traced graphs; "
                 "'-': one device")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# Traffic: bytes per update, from the traced graphs; nothing is run.


def measure_traffic(config: TrainConfig, benches: list[BenchConfig], plan: DevicePlan) -> list[dict]:
    """For each configuration: its global batch and `Traffic.as_dict()` (None on one device)."""
    results = []
    for bench in benches:
        workload = build_workload(bench, config, plan)
        traffic = workload.traffic and workload.traffic()
        results.append({"config": bench.name, "global_batch": workload.global_batch,
                        "bytes_per_update": traffic and traffic.as_dict(),
                        "busiest_device_bytes": traffic and traffic.busiest_device_bytes,
                        "state_bytes_per_device": workload.state_bytes and workload.state_bytes()})
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


# --------------------------------------------------------------------------------------------------
# Ops: where an update's time goes, from TensorFlow's profiler.


def measure_ops(config: TrainConfig, benches: list[BenchConfig], plan: DevicePlan, updates: int,
                warmup_updates: int) -> list[dict]:
    """For each configuration: its wall time per example over `updates` updates, then the op
    time per example by op type over `updates` profiled updates (TensorFlow's
    framework_op_stats: every op's self time on every device, the input pipeline's "Dataset"
    included, "IDLE" the devices' waits)."""
    import glob
    import tempfile

    import tensorflow as tf
    # The profiler's own converter: TensorBoard's profile plugin reads the same tables.
    from tensorflow.python.profiler.internal import _pywrap_profiler_plugin

    results = []
    for bench in benches:
        workload = build_workload(bench, config, plan)
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
                        "op_us_per_example": {k: v / examples for k, v in micros.items()}})
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


# --------------------------------------------------------------------------------------------------
# Memory: one subprocess per configuration.


def peak_memory_main(argv: list[str]) -> int:
    """The subprocess of --measure=memory: builds one configuration, runs its updates, and
    prints one JSON line of memory figures in MB."""
    return command(lambda: _peak_memory(argv))


def _peak_memory(argv: list[str]) -> int:
    import tensorflow as tf

    options = bench_flags()
    config = parse_config(argv, __doc__ or "", options)
    bench = parse_config_name(_one(options["configs"].value), config.batch_size)
    check_data(config, None)
    plan = prepare_devices(config)
    workload = build_workload(bench, config, plan)
    gpus = _gpu_names(plan)
    rss_before = _status_mb("VmRSS")
    _reset_peak_rss()
    for device in gpus:
        tf.config.experimental.reset_memory_stats(device)
    workload.run(options["warmup_updates"].value + options["updates"].value)
    print(json.dumps({
        "config": bench.name, "global_batch": workload.global_batch, "accum": bench.accum,
        "batch_per_tower": bench.batch_size, "rss_before_mb": rss_before, "peak_rss_mb": _status_mb("VmHWM"),
        "gpu_peak_mb": {d: tf.config.experimental.get_memory_info(d)["peak"] / 2**20 for d in gpus}}))
    return 0


# glibc raises its mmap threshold to the size of every large block freed, after which freed
# tensors stay in the heap and peak RSS counts malloc's cache; a fixed threshold returns them.
_LIVE_RSS = {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}


def floor_config(bench: BenchConfig) -> str:
    """The same configuration at one example per tower: what its updates add to the process
    besides activations (thread pools, weight copies, gradients and their sums, the update)."""
    return (f"{bench.kind}_k{bench.accum}_b1" + ("_permicro" if bench.weights_per_micro_step else "")
            + ("" if bench.input == "memory" else f"_{bench.input}"))


def measure_memory(benches: list[BenchConfig], argv: list[str]) -> list[dict]:
    """Runs `peak_memory_main` in a fresh process for each configuration and for its floor
    configuration (the training flags of `argv` passed on), one after another, so no
    configuration inherits another's heap. Each result gets `floor_added_mb`: its floor's
    peak minus its floor's RSS before the updates."""
    measured: dict[str, dict] = {}
    for name in dict.fromkeys(n for b in benches for n in (floor_config(b), b.name)):
        child = subprocess.run(
            [sys.executable, "-c", "import sys; from tower_train.benchmark import peak_memory_main; "
             "sys.exit(peak_memory_main(sys.argv))", *argv[1:], f"--configs={name}"],
            capture_output=True, text=True, env={**os.environ, **_LIVE_RSS})
        if child.returncode != 0:
            lines = child.stderr.strip().splitlines() or ["no output"]
            raise UsageError(f"--measure=memory: {name} failed: {lines[-1]}")
        measured[name] = json.loads(child.stdout.strip().splitlines()[-1])
    results = []
    for bench in benches:
        floor = measured[floor_config(bench)]
        results.append({**measured[bench.name],
                        "floor_added_mb": floor["peak_rss_mb"] - floor["rss_before_mb"]})
    return results


def format_memory_report(results: list[dict]) -> str:
    """A row per configuration. 'activations' is what its updates add above its floor's
    (`floor_config`); the last column compares it with the first row's."""
    lines = [f"{'config':<24} {'G':>6} {'K':>3} {'B':>5} {'RSS before':>11} {'peak RSS':>9} "
             f"{'added':>6} {'activations':>12} {'vs row 1':>9}   (MB)"]
    activations = [r["peak_rss_mb"] - r["rss_before_mb"] - r["floor_added_mb"] for r in results]
    for r, act in zip(results, activations):
        gpu = "".join(f"  {d} peak {mb:.0f} MB" for d, mb in r["gpu_peak_mb"].items())
        ratio = f"{act / activations[0]:>9.2f}" if activations[0] > 0 else f"{'-':>9}"
        lines.append(f"{r['config']:<24} {r['global_batch']:>6} {r['accum']:>3} {r['batch_per_tower']:>5} "
                     f"{r['rss_before_mb']:>11.0f} {r['peak_rss_mb']:>9.0f} "
                     f"{r['peak_rss_mb'] - r['rss_before_mb']:>6.0f} {act:>12.0f} {ratio}{gpu}")
    return "\n".join(lines)


def _link_speeds(values: list[str]) -> list[float]:
    try:
        speeds = [float(v) for v in values]
    except ValueError:
        speeds = []
    if len(speeds) != len(values) or not all(s > 0 for s in speeds):
        raise UsageError(f"--link_gbps={','.join(values)}: must be numbers > 0 (gigabits per second), "
                         "comma-separated")
    return speeds


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


# --------------------------------------------------------------------------------------------------


def _benchmark(argv: list[str]) -> int:
    options = bench_flags()
    config = parse_config(argv, __doc__ or "", options)
    measure = options["measure"].value
    if measure not in MEASURES:
        raise UsageError(f"--measure={measure}: unknown; allowed: {', '.join(MEASURES)}")
    if measure == "memory" and not os.path.exists("/proc/self/clear_refs"):
        raise UsageError("--measure=memory: needs Linux's /proc/self/status and clear_refs")
    names = options["configs"].value or default_configs(measure, config.batch_size)
    benches = [parse_config_name(name, config.batch_size) for name in names]
    for key in ("updates", "rounds"):
        if options[key].value < 1:
            raise UsageError(f"--{key}={options[key].value}: must be a whole number >= 1")
    if options["warmup_updates"].value < 1:
        raise UsageError("--warmup_updates must be >= 1: the first update traces")
    if not options["slow_tower_ms"].value >= 0:
        raise UsageError(f"--slow_tower_ms={options['slow_tower_ms'].value}: must be a number >= 0")
    if options["slow_tower_ms"].value and measure != "time":
        raise UsageError("--slow_tower_ms: only with --measure=time")
    link_gbps = _link_speeds(options["link_gbps"].value)
    if link_gbps and measure != "traffic":
        raise UsageError("--link_gbps: only with --measure=traffic")
    load_tensorflow()
    check_data(config, None)
    plan = prepare_devices(config, announce=True)
    if measure == "memory":
        results = measure_memory(benches, argv)
        report = format_memory_report(results)
    elif measure == "traffic":
        results = measure_traffic(config, benches, plan)
        report = format_traffic_report(results, link_gbps)
    elif measure == "ops":
        results = measure_ops(config, benches, plan, options["updates"].value,
                              options["warmup_updates"].value)
        report = format_ops_report(results)
    else:
        measurements = run_benchmark(config, benches, plan, options["updates"].value,
                                     options["warmup_updates"].value, options["rounds"].value,
                                     options["slow_tower_ms"].value)
        results = [dataclasses.asdict(m) for m in measurements]
        report = format_report(measurements, len(plan.tower_devices), config.batch_size)
    print(report)
    if options["output_json"].value:
        import tensorflow as tf

        with open(options["output_json"].value, "w") as f:
            json.dump({"measure": measure, "towers": len(plan.tower_devices),
                       "batch_per_tower": config.batch_size, "cores": os.cpu_count(),
                       "tensorflow": tf.__version__, "results": results}, f, indent=2)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Runs `python -m tower_train.benchmark`; returns the exit status."""
    return command(lambda: _benchmark(sys.argv if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
