"""The training stream's micro-batches, cut into one shard per device and, on accelerators,
prefetched to it.

The stream yields global micro-batches on the host. `feed_devices` cuts each into consecutive
shards, shard i of `shard_sizes[i]` examples for device i (the cut `towers.split_batch` makes).
When the devices are accelerators it also copies each shard to its device ahead of the step
that takes it: while one micro-step computes, the next one's shards cross to the devices, and
one shard per device waits there. This is how tf.distribute feeds its replicas (a
MultiDeviceIterator); tf.data's public `prefetch_to_device` reaches one device only. Logical CPU
devices share the host's memory and cores, so a copy ahead saves nothing there, and the
iterator's threads cost training 12-15% of its examples/sec on 2 cores (docs/performance.md):
their shards stay on the host, and the update's graph copies them, as it always did.

The cut and the order are the stream's, so a fed step trains on exactly what it would from the
host: the same examples, the same shards, the same seeds. The traffic counted from an update's
graph (`tower_train.traffic`) is unchanged too: its arguments are counted from the host, and a
copy ahead moves those very bytes, only earlier.
"""
from __future__ import annotations

import functools
from typing import Iterator, Sequence

import tensorflow as tf
# tf.distribute's own input prefetches with it; tf.data exports no multi-device prefetch.
from tensorflow.python.data.ops.multi_device_iterator_ops import OwnedMultiDeviceIterator

from tower_train.step.inner_step import BatchSpec
from tower_train.step.towers import split_batch

# Shards each device holds ready beyond the one being taken, and the host holds for it: one hides
# the copy behind a micro-step's compute; more would only hold memory.
DEVICE_PREFETCH = 1


def copies_ahead(devices: Sequence[str]) -> bool:
    """Whether a copy ahead helps `devices`: some of them are not CPUs (logical CPU devices share
    the host's memory and cores)."""
    return any(tf.DeviceSpec.from_string(device).device_type != "CPU" for device in devices)


def feed_devices(dataset: tf.data.Dataset, devices: Sequence[str], shard_sizes: Sequence[int], host: str,
                 copy_ahead: bool | None = None) -> Iterator:
    """An iterator of the global micro-batches of `dataset` (on `host`), each as `Shards`: shard
    i, the next `shard_sizes[i]` examples of the micro-batch, already on `devices[i]` when
    `copy_ahead`, else on the host. `copy_ahead` None: where it helps (`copies_ahead`). Its
    `get_next()` may also be called inside a tf.function that takes it as an argument. After an
    error from `dataset` it is done with: a copy ahead would hand later shards to the wrong
    devices.

    `dataset` yields (features, labels, weights) of sum(shard_sizes) examples (features and
    labels may be nests); the shards are cut in that order.
    """
    if len(devices) != len(shard_sizes):
        raise ValueError(f"{len(devices)} devices for {len(shard_sizes)} shard sizes")
    if copy_ahead is None:
        copy_ahead = copies_ahead(devices)
    with tf.device(host):
        if not copy_ahead:
            # Cut ahead too: a cut made at `next()` would hold up each micro-step.
            return iter(dataset.map(lambda *batch: tuple(split_batch(batch, shard_sizes)))
                        .prefetch(DEVICE_PREFETCH))

        def cut(*batch) -> tf.data.Dataset:
            pieces = [tf.data.Dataset.from_tensors(shard) for shard in split_batch(batch, shard_sizes)]
            return functools.reduce(tf.data.Dataset.concatenate, pieces)

        # Shard j of micro-batch m is element m * N + j, which the iterator hands to device j.
        return OwnedMultiDeviceIterator(dataset.flat_map(cut), list(devices), source_device=host,
                                        max_buffer_size=DEVICE_PREFETCH, prefetch_buffer_size=DEVICE_PREFETCH)


def shard_specs(spec: BatchSpec, shard_sizes: Sequence[int]) -> tuple[BatchSpec, ...]:
    """The specs of the shards `feed_devices` cuts from global micro-batches of `spec`."""
    return tuple(tf.nest.map_structure(lambda s, size=size: tf.TensorSpec([size, *s.shape[1:]], s.dtype), spec)
                 for size in shard_sizes)
