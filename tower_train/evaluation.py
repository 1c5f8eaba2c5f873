"""Held-out evaluation, shared by training's last line and `python -m tower_train.eval`.

Precision @ 1 counts every held-out example exactly once, whatever the eval batch
size and the number of towers N:

* `data.eval_batches` reads the examples once, in order; the last batch may be
  partial.
* Each batch of b examples is cut into N contiguous shards: shard i holds
  positions floor(i * b / N) .. floor((i + 1) * b / N) - 1. The shards cover the
  batch without overlap, and their sizes differ by at most one (a shard is empty
  when b < N).
* Shard i's correct-count is computed on tower device i; the N counts are summed.
"""
from __future__ import annotations

from typing import Callable, Sequence

import tensorflow as tf

from tower_train import data


def shard_bounds(batch: int, num_shards: int) -> list[tuple[int, int]]:
    """[start, end) of each of `num_shards` contiguous shards of a batch of `batch` examples.

    The same arithmetic `correct_counter` runs in the graph; sizes differ by at most one.
    """
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    cuts = [i * batch // num_shards for i in range(num_shards + 1)]
    return list(zip(cuts[:-1], cuts[1:]))


def correct_counter(model, devices: Sequence[str]) -> Callable[[tf.Tensor, tf.Tensor], tf.Tensor]:
    """A compiled (images, labels) -> int64 number of correct top-1 predictions.

    images float32 [b, 24, 24, 3], labels int32 [b], any b >= 0. The batch is split
    into len(devices) shards (`shard_bounds`); shard i's predictions and count are
    computed on devices[i].
    """
    devices = tuple(devices)
    if not devices:
        raise ValueError("evaluation needs at least one device")

    # autograph=False: the loop over devices is unrolled at trace time, there is no
    # tensor-dependent Python control flow to convert.
    @tf.function(reduce_retracing=True, autograph=False)
    def count_correct(images: tf.Tensor, labels: tf.Tensor) -> tf.Tensor:
        batch = tf.shape(labels, out_type=tf.int64)[0]
        counts = []
        for i, device in enumerate(devices):
            start = i * batch // len(devices)
            end = (i + 1) * batch // len(devices)
            # Sliced where the batch is (the host), so each tower receives only its shard.
            shard_images, shard_labels = images[start:end], labels[start:end]
            with tf.device(device):
                # An empty shard is not run: some kernels (oneDNN convolutions) refuse a 0-example batch.
                counts.append(tf.cond(
                    end > start,
                    lambda x=shard_images, y=shard_labels, d=device: _count_on(model, x, y, d),
                    lambda: tf.constant(0, tf.int64)))
        return tf.add_n(counts)

    return count_correct


def _count_on(model, images: tf.Tensor, labels: tf.Tensor, device: str) -> tf.Tensor:
    with tf.device(device):  # again inside the branch: its ops live in their own function graph
        predictions = tf.argmax(model(images, training=False), axis=-1, output_type=tf.int32)
        return tf.reduce_sum(tf.cast(tf.equal(predictions, labels), tf.int64))


def evaluate(model, source: data.ExampleSource, batch_size: int,
             devices: Sequence[str]) -> tuple[float, int]:
    """Precision @ 1 over every held-out example of `source` exactly once, and how many there were.

    Each batch of `batch_size` (the last one may be smaller) is spread over the
    tower `devices`, one shard each; see the module docstring.
    """
    count_correct = correct_counter(model, devices)
    correct = total = 0
    for images, labels in data.eval_batches(source, batch_size):
        correct += int(count_correct(images, labels))
        total += int(labels.shape[0])
    if total == 0:
        raise ValueError(f"the {source.name} data set has no held-out examples")
    return correct / total, total


def use_moving_average(model, moving_average) -> None:
    """Copies the moving averages into `model`'s trainable weights, in place.

    For evaluating or exporting the averaged weights. The averages were created
    from `model.trainable_variables`, in that order (`schedules.MovingAverage`).
    """
    weights = model.trainable_variables
    averages = moving_average.averages
    if len(weights) != len(averages):
        raise ValueError(f"{len(averages)} moving averages for {len(weights)} trainable weights")
    for weight, average in zip(weights, averages):
        weight.assign(tf.convert_to_tensor(average))
