"""Input: what a data source is, and the registry of named sources. The in-memory source is
`tower_train.data.array_source.ArraySource`.

A source hands the trainer three things, each a `tf.data.Dataset` of
``(features, labels, weights)`` batches:

* the training stream: ONE infinite stream of examples whose order and
  preprocessing are a pure function of ``(seed, stream position)``. The batch
  size only decides how the stream is cut, so resuming at ``start_position =
  examples consumed`` continues the very same stream, and any factoring of the
  global batch G reads the same examples;
* the held-out batches: every held-out example once, in order;
* the model's input for raw features (`preprocess`), which an export serves.

Features reach the model as the source holds them, unless the source has a
`preprocess` function: ``preprocess(features, seeds, training)`` runs on a
batch, and ``seeds`` (int64 [b, 2]) holds each example's stateless seed
``[seed, stream position]``, so random augmentation is resumable.

Labels are [n] or [n, ...] (for example one label per token) integers in
``0 .. num_classes - 1``; weights, float32 with the labels' shape, say how much
each label counts (0 for padding); without weights every label counts 1. A source
may instead hold **targets**, as a Keras loss takes them (float labels such as one-hot
rows or 0/1 for a sigmoid, or several arrays): its `num_classes` is None, nothing
counts classes or precision @ 1, and its weights have the shape of the loss's output
(`weight_shape`; [n], one per example, unless given). Features, and targets, may be
a dict, list or tuple of arrays (a model of several inputs); each is a tf.nest
structure whose leaves share axis 0.

Sources are registered by name for ``--dataset`` with `register`;
`tower_train.data.catalog` looks a name up among them and the built-in sets, which
import this module and are never imported by it.
"""

from __future__ import annotations

import abc
from typing import Callable, NamedTuple

import tensorflow as tf

from tower_train.errors import UsageError, op_error_text

_HOST = "/cpu:0"  # input pipelines run on the host, as in the original
# Global micro-batches the training stream prepares ahead of the towers: enough to hide the input
# behind the compute, as the original's queue of 2 x towers examples did; an autotuned buffer of
# an endless stream kept filling (with RAM and both cores) after training had stopped.
TRAIN_PREFETCH = 2
# In host memory: prefetched; being cut into the towers' shards; and the shards being trained on
# (logical CPU devices) or waiting in step.device_feed's host buffer (accelerators).
TRAIN_BATCHES_HELD = TRAIN_PREFETCH + 2

Preprocess = Callable[[tf.Tensor, tf.Tensor, bool], tf.Tensor]
# The op errors that bad data (a malformed, corrupted or deleted file, a label out of range) or a
# model's own checks raise while an update or an evaluation runs: each ends the run in one line,
# `Source.describe_error`'s.
RUN_OP_ERRORS = (tf.errors.InvalidArgumentError, tf.errors.DataLossError, tf.errors.NotFoundError)


class RawInput(NamedTuple):
    """A training batch's features as its source holds them, with each example's stateless seed
    [seed, stream position] (int64 [b, 2]): what the training stream hands the towers, which
    preprocess their own shard on their own device (`Source.model_input`, `towers.prepared`).
    Raw images cross devices as uint8, a quarter of the bytes of float32, and the host only
    slices, shuffles and batches."""

    features: object  # a tensor, or a nest of them
    seeds: tf.Tensor


class DataError(UsageError):
    """A data set that cannot be used: a bad --dataset/--data_dir pair, a missing or malformed file,
    arrays of the wrong shape."""


class Source(abc.ABC):
    """What the trainer needs of any data source.

    Attributes set by subclasses:
      name: for messages and the run record.
      num_classes: labels lie in 0 .. num_classes - 1; None for targets (module docstring).
      feature_spec: one raw example's features (shape without the batch axis, dtype); a
        nest of them for several inputs.
      label_spec: one example's labels (a nest of them for targets of several arrays).
      train_size: examples in one epoch, or None when unknown (a stream of unknown length).
      preprocess: see the module docstring; None hands the features over as they are.
    """

    name: str
    num_classes: int | None
    feature_spec: tf.TensorSpec
    label_spec: tf.TensorSpec
    train_size: int | None
    preprocess: Preprocess | None

    @abc.abstractmethod
    def _raw_train_batches(self, seed: int, start_position: int, batch: int) -> tf.data.Dataset:
        """Infinite batches of `batch` consecutive stream positions from `start_position`:
        (positions int64 [batch], features, labels, weights float32), not preprocessed."""

    @abc.abstractmethod
    def _raw_eval_batches(self, batch_size: int) -> tf.data.Dataset:
        """Every held-out example once, in order: (indices int64 [<=b], features, labels, weights)."""

    def train_stream(self, *, seed: int, start_position: int, micro_batch: int,
                     shard_index: int = 0, num_shards: int = 1, preprocessed: bool = True) -> tf.data.Dataset:
        """Infinite dataset of (features, labels, weights), `micro_batch` examples each; the
        features preprocessed for training, or, with `preprocessed=False`, as a `RawInput` for
        the towers to preprocess (what training reads).

        Batch b holds stream positions start_position + b * micro_batch ... + micro_batch - 1,
        in order. With num_shards > 1 (one shard per worker), the stream is cut into batches
        of micro_batch x num_shards and this shard gets slice shard_index of each: together
        the shards read exactly the examples one process would read with the whole batch.
        """
        check_stream_arguments(seed, start_position, micro_batch, shard_index, num_shards)
        mine = slice(shard_index * micro_batch, (shard_index + 1) * micro_batch)

        def shard(positions, features, labels, weights):
            return (self.train_input(rows(features, mine), seed, positions[mine], preprocessed),
                    rows(labels, mine), weights[mine])

        with tf.device(_HOST):
            dataset = self._raw_train_batches(seed, start_position, micro_batch * num_shards)
            dataset = dataset.map(shard, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
            return without_autotuning(dataset.prefetch(TRAIN_PREFETCH))

    def eval_batches(self, batch_size: int) -> tf.data.Dataset:
        """Every held-out example once, in order, preprocessed for evaluation:
        (features, labels, weights) of at most batch_size examples (the last may be partial)."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")

        def prepare(indices, features, labels, weights):
            seeds = tf.stack([tf.zeros_like(indices), indices], -1)
            return self.model_input(features, seeds, training=False), labels, weights

        with tf.device(_HOST):
            dataset = self._raw_eval_batches(batch_size)
            dataset = dataset.map(prepare, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
            return without_autotuning(dataset.prefetch(tf.data.AUTOTUNE))

    def check(self) -> None:
        """Checks what needs TensorFlow running (a streaming source's parse function); `fit` calls
        it once the devices exist, since starting TensorFlow's runtime earlier would keep it from
        creating them. Raises DataError in one line."""

    def describe_error(self, error: tf.errors.OpError) -> str:
        """One line for an op error raised while this source's batches were read or trained on:
        the op's own message (`errors.op_error_text`); a source of files names the file."""
        return op_error_text(error)

    def model_input(self, features: tf.Tensor, seeds: tf.Tensor, training: bool) -> tf.Tensor:
        """A batch of raw features as the model takes it."""
        if self.preprocess is None:
            return features
        return self.preprocess(features, seeds, training)

    def train_input(self, features, seed: int, positions: tf.Tensor, preprocessed: bool):
        """The training stream's features of the examples at int64 stream `positions`:
        preprocessed for training, or raw as a `RawInput` with their seeds [seed, position]."""
        seeds = tf.stack([tf.fill(tf.shape(positions), tf.constant(seed, tf.int64)), positions], -1)
        return self.model_input(features, seeds, training=True) if preprocessed else RawInput(features, seeds)

    @property
    def weight_shape(self) -> tf.TensorShape:
        """One example's weights: the labels' shape, one weight per label (a source of targets
        says its own)."""
        return self.label_spec.shape

    def example_input(self) -> tf.Tensor:
        """One all-zero example as the model takes it, [1, ...]: builds a model's variables."""
        zeros = tf.nest.map_structure(lambda spec: tf.zeros([1, *spec.shape], spec.dtype),
                                      self.feature_spec)
        return self.model_input(zeros, tf.zeros([1, 2], tf.int64), training=False)

    def example_labels(self):
        """All-zero labels (or targets) of one example, [1, ...]: what the checks of a model's
        loss and metrics call them on."""
        return tf.nest.map_structure(lambda spec: tf.zeros([1, *spec.shape], spec.dtype),
                                     self.label_spec)


def rows(nest, index):
    """`nest` (a tensor, or a structure of them) indexed along axis 0 by `index` (a slice)."""
    return tf.nest.map_structure(lambda tensor: tensor[index], nest)


def describe_nest(nest) -> str:
    """A tensor, spec or array, or a dict, list or tuple of them, as messages give it:
    "float32 [1, 4]", or "{'a': float32 [1, 4], 'b': int32 [1]}"."""
    if isinstance(nest, dict):
        return "{" + ", ".join(f"{key!r}: {describe_nest(nest[key])}" for key in sorted(nest)) + "}"
    if isinstance(nest, (list, tuple)):
        return "[" + ", ".join(describe_nest(item) for item in nest) + "]"
    return f"{tf.as_dtype(nest.dtype).name} {tf.TensorShape(nest.shape).as_list()}"


def without_autotuning(dataset: tf.data.Dataset) -> tf.data.Dataset:
    """`dataset` with tf.data's autotuning model off, so that AUTOTUNE means the core count.

    The model's optimizing thread sleeps up to 60 s between rounds, and deleting an iterator
    could wait for that sleep to end: the main job froze for 35 s at no CPU after its last
    update, in 2 of 4 runs (docs/performance.md). Its tuning buys nothing here: a map runs
    ahead by the core count, and the training stream's prefetch is fixed.
    """
    options = tf.data.Options()
    options.autotune.enabled = False
    return dataset.with_options(options)


def weight_check(weights: tf.Tensor, what: str) -> tf.Operation:
    """An op that fails, with "<what> a weight that is negative or not finite:" and the weights,
    when one is: the in-graph form of the rule ArraySource checks on its arrays."""
    return tf.debugging.Assert(tf.reduce_all(tf.math.is_finite(weights) & (weights >= 0)),
                               [f"{what} a weight that is negative or not finite:", weights], summarize=16)


def available_memory_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (Linux): what can be allocated without swapping."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def input_bytes_per_example(source: Source) -> int:
    """The bytes of one example's features as the model takes them (after preprocessing)."""
    return sum(leaf.shape[1:].num_elements() * leaf.dtype.size
               for leaf in tf.nest.flatten(source.example_input()))


def check_batch_memory(per_example: int, examples: int, copies: int, what: str,
                       available: int) -> None:
    """Refuses a batch whose inputs alone, `examples` of `per_example` bytes and `copies` of the
    batch held at once, exceed `available` bytes of memory: better one line now than minutes of
    swapping before an out-of-memory kill. `what` names the flags that set `examples`."""
    needed = examples * per_example * copies
    if needed > available:
        raise UsageError(f"{what}: {examples:,} examples of {per_example:,} bytes as the model takes "
                         f"them, {copies} batches held at once, need {needed / 2**30:,.1f} GiB but "
                         f"{available / 2**30:,.1f} GiB of memory is available; lower it")


def check_stream_arguments(seed: int, start_position: int, micro_batch: int, shard_index: int,
                           num_shards: int) -> None:
    """The arguments of `Source.train_stream` (a subclass that overrides it checks them too)."""
    if num_shards < 1 or not 0 <= shard_index < num_shards:
        raise ValueError(f"shard_index must be in 0..num_shards - 1 with num_shards >= 1, got "
                         f"{shard_index} of {num_shards}")
    if micro_batch < 1:
        raise ValueError(f"micro_batch must be >= 1, got {micro_batch}")
    if start_position < 0:
        raise ValueError(f"start_position must be >= 0, got {start_position}")
    if not -(2**63) <= seed < 2**63:
        raise ValueError(f"seed must fit in int64, got {seed}")


# --------------------------------------------------------------------------------------------------
# The registry of named sources (--dataset)

_SOURCES: dict[str, Callable[[], Source]] = {}


def register(name: str) -> Callable[[Callable[[], Source]], Callable[[], Source]]:
    """Decorator: makes a zero-argument function that returns a Source usable as `--dataset=name`.

    The function runs when a run asks for the data set, not at import.
    """
    def add(factory: Callable[[], Source]) -> Callable[[], Source]:
        if name in _SOURCES and _SOURCES[name] is not factory:
            raise ValueError(f"data set name {name!r} is already registered to {_SOURCES[name]!r}")
        _SOURCES[name] = factory
        return factory
    return add


def registered() -> dict[str, Callable[[], Source]]:
    """The functions registered so far, by name (a copy)."""
    return dict(_SOURCES)
