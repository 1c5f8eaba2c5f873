"""What one benchmark configuration runs: a fresh model and optimizer training as its name says,
fed from memory or from an input pipeline, by the trainer's own inner step, a plain
GradientTape step, or Keras's own fit."""
from __future__ import annotations

import dataclasses
import functools
import time
from typing import TYPE_CHECKING, Callable

from tower_train.benchmark.names import MODE_KINDS, TOWER_KIND, TOWER_KINDS, BenchConfig
from tower_train.config import TrainConfig
from tower_train.rules import HAND_PLACED_MODE

if TYPE_CHECKING:
    from tower_train.data.source import Source
    from tower_train.devices import DevicePlan
    from tower_train.training.run import TrainState
    from tower_train.traffic import Traffic


@dataclasses.dataclass(frozen=True)
class Workload:
    """`run(n)` applies n updates and returns the seconds they took; each consumes `global_batch`
    examples of `labels_per_example` labels (tokens, for a sequence model). `traffic()` counts
    the bytes one update moves across devices (tracing its functions if they were not); None
    for the kinds that run on one device; `state_bytes()` the bytes of variables, optimizer slots,
    moving averages and accumulators each device holds, None for them too. `read_input(n)` reads
    n updates' batches from the same training stream and nothing else, returning the seconds;
    None for a batch held in memory. `compute_devices()`: the devices its update computes on, read
    from the traced graphs (`traffic.compute_devices`). `jit_compile`: whether its update compiles
with XLA (for keras_fit, what Keras decided)."""

    run: Callable[[int], float]
    global_batch: int
    labels_per_example: int
    traffic: Callable[[], Traffic] | None
    state_bytes: Callable[[], dict[str, int]] | None
    read_input: Callable[[int], float] | None
    compute_devices: Callable[[], list[str]]
    jit_compile: bool


def build_workload(bench: BenchConfig, config: TrainConfig, plan: DevicePlan,
                   slow_tower_ms: float = 0.0, keras_jit_compile: bool | str | None = None) -> Workload:
    """A fresh model and optimizer (seeded by --seed) training as `bench` says; in tower mode,
    tower 0 waits `slow_tower_ms` per example of its shard (`slow_first_tower`).

    `keras_jit_compile` is what keras_fit passes to Keras's compile() (None: `config`'s
    jit_compile as handed): the benchmark's --jit_compile as the user gave it, so that with
    neither --jit_compile nor --nojit_compile ("auto") Keras decides as it does for its users
    (XLA where a GPU computes), whatever tower-train's own auto chose for the other kinds."""
    import tensorflow as tf

    from tower_train.data import catalog
    from tower_train.devices import HOST_DEVICE, parameter_device
    from tower_train.model_spec import resolve_model
    from tower_train.step.modes import build_mode, resolve_jit_compile
    from tower_train.training.run import Run, TrainState
    from tower_train.traffic import compute_devices

    keras_jit_compile = config.jit_compile if keras_jit_compile is None else keras_jit_compile
    config = dataclasses.replace(config, batch_size=bench.batch_size, accum=bench.accum,
                                 tower_split=bench.tower_split,
                                 jit_compile=resolve_jit_compile(config, plan)[0])  # the baselines' too
    if bench.kind in TOWER_KINDS:  # the kind, not --ps_device, says where the variables live
        ps_device = bench.kind.removeprefix(TOWER_KIND)
        tower_weights = "per_micro_step" if bench.weights_per_micro_step else config.tower_weights
        config = dataclasses.replace(config, mode=HAND_PLACED_MODE, all_reduce="auto", ps_device=ps_device,
                                     tower_weights=tower_weights)
        plan = dataclasses.replace(plan, param_device=parameter_device(ps_device, plan.tower_devices))
    elif bench.kind in MODE_KINDS:  # a strategy mode's name
        # Tower-only options the run's flags may set apply to the tower kinds alone.
        config = dataclasses.replace(config, mode=bench.kind, all_reduce="auto", tower_weights="per_update",
                                     transfer_precision="fp32")
    micro = bench.batch_size * len(plan.tower_devices)
    source = catalog.load_source(config.dataset, config.data_dir, config.augment)
    spec = resolve_model(None, config, None, source.num_classes)
    if bench.input == "tfrecord":
        source = _records_of(source)
    elif bench.input == "dataset":
        source = _pipeline_of(source, config.seed)
    # Raw, as training reads it: the towers preprocess their shards (`towers.prepared`).
    dataset = source.train_stream(seed=config.seed, start_position=0, micro_batch=micro, preprocessed=False)
    if bench.input == "memory":  # the stream's first micro-batch, held on the host: no pipeline
        with tf.device(HOST_DEVICE):
            dataset = tf.data.Dataset.from_tensors(next(iter(dataset))).repeat()
    batch_spec = tf.nest.map_structure(lambda s: tf.TensorSpec([micro, *s.shape[1:]], s.dtype),
                                       dataset.element_spec)
    if bench.kind in MODE_KINDS:
        training = Run.create(spec, source, build_mode(config, plan))
        state, inner = training.state, training.inner
        if slow_tower_ms > 0 and config.mode_rules.places_towers:
            slow_first_tower(state.model, slow_tower_ms)
        run = _updates(inner, dataset)
        # What no op places runs where TensorFlow's placer puts it: GPU 0 when there is one.
        default_device = "/gpu:0" if tf.config.list_logical_devices("GPU") else HOST_DEVICE

        def traced() -> list:
            return [function for function, _ in inner.traced_update(batch_spec)]
    else:
        # On the towers' first device, so that a baseline runs on the same kind of device as
        # the towers: a GPU on a GPU machine, one logical CPU device (not the host) on a CPU one.
        default_device = plan.tower_devices[0]
        state = TrainState.create(config, spec, source, tf.device(default_device))
        if bench.kind == "keras_fit":
            run, traced, jit_compile = _keras_fit(config, default_device, dataset, batch_spec, state,
                                                  source, keras_jit_compile)
        else:
            run, traced = _plain(config, default_device, dataset, batch_spec, state, source)
        inner = None

    def traffic() -> Traffic:
        from tower_train.traffic import count_traffic

        # The batches come from the host (a tf.data pipeline, or a batch held there).
        return count_traffic(inner.traced_update(batch_spec), inner.variable_roles(), HOST_DEVICE)

    def state_bytes() -> dict[str, int]:
        from tower_train.traffic import state_bytes_per_device

        loss_scale = state.loss_scale
        return state_bytes_per_device([
            *state.model.variables, *state.optimizer.variables, state.step, state.examples_seen,
            *(state.moving_average.averages if state.moving_average else ()),
            *((loss_scale.value, loss_scale.good_updates) if loss_scale else ()),
            *(v for variables in inner.variable_roles().values() for v in variables)])

    return Workload(run, micro * bench.accum, source.label_spec.shape.num_elements(),
                    None if inner is None else traffic, None if inner is None else state_bytes,
                    None if bench.input == "memory" else _input_reader(
                        (lambda: iter(dataset)) if inner is None else (lambda: inner.feed(dataset)), bench.accum),
                    lambda: compute_devices(traced(), default_device),
                    jit_compile if bench.kind == "keras_fit" else config.jit_compile)


def _input_reader(make_iterator: Callable[[], object], accum: int) -> Callable[[int], float]:
    """`read(n)`: the seconds that reading n updates' micro-batches from a second iterator of the
    stream takes, with no training beside it: the iterator `make_iterator()` gives (a mode's
    `feed`, which cuts the towers' shards and copies them ahead to accelerators, as training
    takes them), inside TensorFlow, one compiled loop of `get_next`, not one Python call per
    micro-batch."""
    import tensorflow as tf

    from tower_train.devices import HOST_DEVICE

    batches = None

    @tf.function
    def consume(iterator, micro_batches: tf.Tensor) -> None:
        # A feed places each shard itself; a dataset's iterator would otherwise copy every batch
        # to GPU 0 on a GPU machine.
        with tf.device(HOST_DEVICE):
            for _ in tf.range(micro_batches):
                iterator.get_next()

    def read(updates: int) -> float:
        nonlocal batches
        start = time.perf_counter()
        batches = batches or make_iterator()  # made on first use: its prefetching would compete
        consume(batches, tf.constant(updates * accum))
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

    from tower_train.data.tfrecord import TFRecordSource
    from tower_train.data.tfrecord_writer import write_examples

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

    from tower_train.data.tf_dataset import DatasetSource

    def train() -> tf.data.Dataset:
        examples = tf.data.Dataset.from_tensor_slices((source.train_features, source.train_labels))
        return examples.shuffle(10_000, seed=seed)

    return DatasetSource(train=train, num_classes=source.num_classes, preprocess=source.preprocess,
                         name=f"{source.name} as a tf.data pipeline")


def slow_first_tower(model, ms_per_example: float) -> None:
    """Makes tower 0 of `model`'s passes (the one under run_on_towers' name scope "tower_0") also
    wait `ms_per_example` milliseconds per example of its shard, in a sleep that holds no core:
    a device slower than the others, as an older GPU beside newer ones. The wait is in the
    model's loss, so the tower's gradient waits too."""
    import tensorflow as tf

    per_example_loss = model.per_example_loss

    def wait(seconds: tf.Tensor) -> tf.Tensor:
        time.sleep(float(seconds))
        return seconds

    def slowed(labels: tf.Tensor, logits: tf.Tensor) -> tf.Tensor:
        losses = per_example_loss(labels, logits)
        if "tower_0" not in tf.get_current_name_scope().split("/"):
            return losses
        delay = tf.cast(tf.shape(labels)[0], tf.float32) * (ms_per_example / 1000.0)
        with tf.control_dependencies([tf.py_function(wait, [delay], tf.float32)]):
            return tf.identity(losses)

    model.per_example_loss = slowed


def _updates(inner, dataset) -> Callable[[int], float]:
    """`run(n)`: the seconds n updates of a mode's inner step take on `dataset`."""
    batches = inner.feed(dataset)

    def run(updates: int) -> float:
        start = time.perf_counter()
        for _ in range(updates):
            inner.run_update(batches, at_once=batches)  # its result is read: waits for the update
        return time.perf_counter() - start

    return run


def _plain(config: TrainConfig, device: str, dataset, batch_spec: tuple, state: TrainState,
           source: Source) -> tuple[Callable[[int], float], Callable[[], list]]:
    """One GradientTape step on `device` over all G examples, preprocessing them there as the
    towers do, with the same update-boundary work (regularization, clip, apply, count, average)
    as the towers'; and its traced function."""
    import tensorflow as tf

    from tower_train.step.towers import prepared, regularization_gradients, tower_loss_and_gradients

    rule = state.update_rule(config.clip_norm)
    whole_batches = iter(dataset.batch(config.accum).map(
        lambda *parts: tf.nest.map_structure(lambda p: tf.reshape(p, [-1, *p.shape[2:]]), parts)))

    @tf.function(jit_compile=config.jit_compile, autograph=False)
    def plain_step(features, labels: tf.Tensor, weights: tf.Tensor) -> tf.Tensor:
        with tf.device(device):
            result = tower_loss_and_gradients(state.model, prepared(features, source.model_input), labels,
                                              weights)
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
            # Called on `device` too: XLA compiles the whole step for the caller's device, whatever
            # device its ops name, and cannot read variables held elsewhere.
            with tf.device(device):
                loss = plain_step(*next(whole_batches))
            float(loss)
        return time.perf_counter() - start

    def traced() -> list:
        return [plain_step.get_concrete_function(*tf.nest.map_structure(
            lambda s: tf.TensorSpec([s.shape[0] * config.accum, *s.shape[1:]], s.dtype), batch_spec))]

    return run, traced


def _keras_fit(config: TrainConfig, device: str, dataset, batch_spec: tuple, state: TrainState,
               source: Source, jit_compile: bool | str
               ) -> tuple[Callable[[int], float], Callable[[], list], bool]:
    """What a user would pick instead: Keras's own train step and gradient accumulation, on
    the same network, loss, optimizer and schedule, fed the micro-batch of all towers, on
    `device`, preprocessed there as the towers do, compiled with `jit_compile` (True, False or
    "auto") under the global dtype policy of --precision (mixed_bfloat16 for bf16, as a Keras
    user sets it; the network was built under it too); its train step traced as fit traces it;
    and whether Keras compiles it with XLA."""
    import keras
    import tensorflow as tf

    from tower_train.model_spec import dtype_policy
    from tower_train.training.run import make_optimizer
    from tower_train.step.towers import prepared

    net = state.model

    class FitModel(keras.Model):
        """The network behind Keras's train step, with tower-train's loss: the weighted mean of the
        per-label losses (the data's weights arrive as Keras's sample_weight) + regularization."""

        def __init__(self):
            super().__init__()
            self.net = net

        def call(self, images, training=False):
            return self.net(images, training=training)

        def train_step(self, data):
            features, labels, weights = data
            return super().train_step((prepared(features, source.model_input), labels, weights))

        def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
            losses = tf.cast(self.net.per_example_loss(y, y_pred), tf.float32)
            weighted = tf.reduce_sum(losses * sample_weight) / tf.reduce_sum(sample_weight)
            return weighted + self.net.regularization()

    with tf.device(device):  # its counters too: a compiled step reads only its own device's variables
        optimizer = make_optimizer(config, config.global_batch, source.train_size)
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

    # On `device` for Keras's loss tracker; under the policy, so that compile() sees it as it sees
    # a user's model (mixed_float16: Keras's LossScaleOptimizer).
    with tf.device(device), dtype_policy(config.precision):
        model = FitModel()
        model.compile(optimizer=optimizer, jit_compile=jit_compile)
    clock = BatchClock()

    def run(updates: int) -> float:
        with tf.device(device):
            model.fit(dataset, epochs=1, steps_per_epoch=updates * config.accum, verbose=0, shuffle=False,
                      callbacks=[clock])
        return clock.seconds

    def traced() -> list:
        # fit's own function is out of reach; its step, traced the same way (called under `device`,
        # which no op of it names: compute_devices puts them there).
        features, labels, weights = batch_spec
        return [tf.function(model.train_step).get_concrete_function((features, labels, weights))]

    return run, traced, bool(model.jit_compile)
