"""tower_train.training.run in this process: a run's state is seeded alike in every mode, its inner step is
built after a restore (and so keeps the restored statistics), its stream starts at the state's
position, and its layout line."""
import keras
import numpy as np
import pytest
import tensorflow as tf

from tower_train.data import catalog
from tower_train.models import TowerModel, register
from tower_train.training.run import Run
from helpers import fed, make_run, weights


@register("test_run_normalized_probe")
class NormalizedProbe(TowerModel):
    """BatchNorm on the input images (moving statistics to keep), pooling, logits."""

    def __init__(self, num_classes: int, **kwargs):
        super().__init__(num_classes, **kwargs)
        self.norm = self.batch_norm(momentum=0.5)
        self.pool = keras.layers.GlobalAveragePooling2D()
        self.logits = keras.layers.Dense(num_classes)

    def call(self, images: tf.Tensor, training: bool = False) -> tf.Tensor:
        return self.logits(self.pool(self.norm(images, training=training)))


@pytest.mark.parametrize("mode", ["tower", "mirrored"])
def test_the_inner_step_is_built_after_a_restore_and_a_refused_update_goes_back_to_the_restored_statistics(mode):
    run = make_run(model="test_run_normalized_probe", mode=mode, num_gpus=2, accum=2, batch_size=4)
    mean = run.state.model.norm.moving_mean
    restored = np.full(mean.shape, 0.25, np.float32)
    mean.assign(restored)  # as a checkpoint's restore would, before the run's first update
    # Preprocessed on the host, as a float image that can hold a NaN (the run's stream is uint8).
    batches = iter(run.source.train_stream(seed=run.config.seed, start_position=0, micro_batch=2 * 4))
    images, labels, label_weights = next(batches)
    poisoned = np.asarray(images).copy()
    poisoned[0, 0, 0, 0] = np.nan

    result = run.inner.run_update(fed(run.inner, [(tf.constant(poisoned), labels, label_weights), next(batches)]))

    assert not result.applied
    # An inner step built with the state would have kept the statistics of a fresh model (0).
    np.testing.assert_array_equal(np.asarray(tf.convert_to_tensor(mean)), restored)


def test_runs_of_one_config_start_from_the_same_weights_in_every_mode():
    runs = [make_run(mode=mode, num_gpus=2, seed=7) for mode in ("tower", "mirrored", "central_storage")]
    other_seed = make_run(mode="tower", num_gpus=2, seed=8)

    first = weights(runs[0].state.model)
    for run in runs[1:]:
        for got, want in zip(weights(run.state.model), first, strict=True):
            np.testing.assert_array_equal(got, want)
    assert any(np.any(got != want) for got, want in zip(weights(other_seed.state.model), first, strict=True))


def test_batches_start_at_the_position_the_state_holds():
    run = make_run(num_gpus=2, batch_size=3)
    micro = 2 * 3
    source = catalog.load_source("synthetic", None, run.config.augment)
    fresh = iter(source.train_stream(seed=run.config.seed, start_position=0, micro_batch=micro,
                                     preprocessed=False))
    third = [next(fresh) for _ in range(3)][2]

    run.state.examples_seen.assign(2 * micro)
    resumed = tf.nest.map_structure(lambda *shards: tf.concat(shards, 0), *next(run.batches()))

    for got, want in zip(tf.nest.flatten(resumed), tf.nest.flatten(third), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_the_layout_line_names_the_mode_devices_shards_and_global_batch():
    run = make_run(num_gpus=2, batch_size=4, accum=3, tower_split="3,1")

    assert isinstance(run, Run)
    assert run.describe_layout() == (
        "mode=tower (parameter_device reduction), 2 tower(s) on /cpu:1, /cpu:2, variables on /cpu:0, "
        "batch per tower 6/2 (--tower_split=3,1), accum 3, global batch G = 24")
