"""step/device_feed.py: the stream's micro-batches cut into shards, each prefetched to its device
when asked (on accelerators), else left on the host."""
import numpy as np
import pytest
import tensorflow as tf

from tower_train.data.source import RawInput
from tower_train.step.device_feed import copies_ahead, feed_devices, shard_specs
from tower_train.traffic import device_name
from helpers import dataset_of

DEVICES = ("/cpu:1", "/cpu:2", "/cpu:3")


def micro_batches(count: int, size: int) -> list:
    """`count` global micro-batches of `size` examples, raw (`RawInput`) as training reads them,
    every value telling its micro-batch and row apart."""
    rng = np.random.default_rng(0)
    batches = []
    for m in range(count):
        images = rng.integers(0, 256, size=(size, 4, 4, 3)).astype(np.uint8)
        seeds = np.stack([np.full(size, 7), m * size + np.arange(size)], -1).astype(np.int64)
        labels = rng.integers(0, 10, size=size).astype(np.int32)
        weights = rng.random(size).astype(np.float32)
        batches.append((RawInput(images, seeds), labels, weights))
    return batches


@pytest.mark.parametrize("copy_ahead", [True, None], ids=["copied_ahead", "on_cpus_left_on_the_host"])
@pytest.mark.parametrize("shard_sizes", [(2, 2, 2), (3, 1, 2)], ids=["even", "uneven"])
def test_each_shard_is_the_next_rows_of_its_micro_batch_on_its_device_or_the_host(shard_sizes, copy_ahead):
    batches = micro_batches(4, sum(shard_sizes))
    fed = list(feed_devices(dataset_of(batches), DEVICES, shard_sizes, "/cpu:0", copy_ahead))
    assert len(fed) == len(batches)  # and the stream ends where the dataset does
    bounds = np.cumsum((0,) + shard_sizes)
    for shards, batch in zip(fed, batches, strict=True):
        assert len(shards) == len(DEVICES)
        for i, (shard, device) in enumerate(zip(shards, DEVICES, strict=True)):
            rows = slice(bounds[i], bounds[i + 1])
            want = tf.nest.flatten(tf.nest.map_structure(lambda leaf: leaf[rows], batch))
            got = tf.nest.flatten(shard)
            assert isinstance(shard[0], RawInput)
            for g, w in zip(got, want, strict=True):
                assert g.dtype == w.dtype
                np.testing.assert_array_equal(g.numpy(), w)
            # Logical CPU devices share the host's cores and memory: unless asked, no copy ahead.
            assert {device_name(leaf.device) for leaf in got} == {device_name(device if copy_ahead else "/cpu:0")}


@pytest.mark.parametrize("copy_ahead", [True, False])
def test_an_error_in_the_pipeline_reaches_the_caller_as_the_ops_own_error(copy_ahead):
    def check(images, labels, weights):
        tf.debugging.assert_less(labels, 5, message="label out of range")
        return images, labels, weights

    labels = np.array([[1, 2], [3, 9]], np.int32)  # the second micro-batch holds a 9
    dataset = tf.data.Dataset.from_tensor_slices((np.zeros((2, 2, 3), np.float32), labels,
                                                  np.ones((2, 2), np.float32))).map(check)
    fed = feed_devices(dataset, DEVICES[:2], (1, 1), "/cpu:0", copy_ahead)
    first = next(fed)
    np.testing.assert_array_equal([shard[1].numpy() for shard in first], [[1], [2]])
    with pytest.raises(tf.errors.InvalidArgumentError, match="label out of range"):
        next(fed)


def test_only_accelerators_get_a_copy_ahead():
    assert not copies_ahead(["/cpu:1", "/cpu:2"])
    assert not copies_ahead(["/job:worker/replica:0/task:1/device:CPU:0"])
    assert copies_ahead(["/gpu:0", "/gpu:1"])
    assert copies_ahead(["/job:localhost/replica:0/task:0/device:GPU:0"])
    assert copies_ahead(["/cpu:1", "/gpu:0"])  # any accelerator among them


def test_shard_specs_cut_the_batch_axis_and_keep_the_rest():
    spec = (RawInput(tf.TensorSpec([6, 4, 4, 3], tf.uint8), tf.TensorSpec([6, 2], tf.int64)),
            tf.TensorSpec([6, 5], tf.int32), tf.TensorSpec([6, 5], tf.float32))
    specs = shard_specs(spec, (4, 2))
    assert [s[0].features.shape.as_list() for s in specs] == [[4, 4, 4, 3], [2, 4, 4, 3]]
    assert [s[0].seeds.shape.as_list() for s in specs] == [[4, 2], [2, 2]]
    assert [(s[1].shape.as_list(), s[1].dtype, s[2].dtype) for s in specs] == [
        ([4, 5], tf.int32, tf.float32), ([2, 5], tf.int32, tf.float32)]


def test_as_many_devices_as_shard_sizes():
    with pytest.raises(ValueError, match="2 devices for 3 shard sizes"):
        feed_devices(dataset_of(micro_batches(1, 3)), DEVICES[:2], (1, 1, 1), "/cpu:0")
