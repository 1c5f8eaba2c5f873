"""A model's randomness (Dropout, `keras.random` with a layer's SeedGenerator) is a pure function of
the generators' seeds, the update, the micro-step and the tower: exact resume, and the same draws
in tower and mirrored mode."""
import itertools

import keras
import numpy as np
import pytest
import tensorflow as tf

import tower_train
from tower_train.models import TowerModel
from tower_train.step.towers import pass_seeds, seed_generator_states
from helpers import make_run, weights
from test_train import checkpoint_values


class Jitter(keras.layers.Layer):
    """Adds uniform noise in [-scale, scale), drawn twice per call from its own SeedGenerator."""

    def __init__(self, scale: float, **kwargs):
        super().__init__(**kwargs)
        self.scale = scale
        self.seed_generator = keras.random.SeedGenerator()

    def call(self, x, training=False):
        if not training or not self.scale:
            return x
        for _ in range(2):  # the second draw reads the state the first one advanced
            x = x + keras.random.uniform(keras.ops.shape(x), -self.scale, self.scale, seed=self.seed_generator)
        return x


class NoisyNet(TowerModel):
    """Flatten, dense 16 (ReLU), Dropout, Jitter, dense logits."""

    def __init__(self, num_classes: int = 10, rate: float = 0.5, jitter: float = 0.1, **kwargs):
        super().__init__(num_classes, **kwargs)
        self.flatten = keras.layers.Flatten()
        self.hidden = keras.layers.Dense(16, activation="relu")
        self.dropout = keras.layers.Dropout(rate)
        self.jitter = Jitter(jitter)
        self.logits = keras.layers.Dense(num_classes)

    def call(self, images, training=False):
        x = self.dropout(self.hidden(self.flatten(images)), training=training)
        return self.logits(self.jitter(x, training=training))


def quiet_net():
    return NoisyNet(rate=0.0, jitter=0.0)


LAYOUT = dict(num_gpus=2, accum=2, batch_size=4, optimizer="momentum", learning_rate=0.5)


@pytest.mark.parametrize("mode,tower_weights", [
    ("tower", "per_update"),  # each tower reads its copy of the weights
    ("tower", "per_micro_step"),  # each tower reads the parameter device
    ("mirrored", "per_update"),
])
def test_four_straight_updates_equal_two_then_a_resume_then_two(tmp_path, mode, tower_weights):
    options = dict(LAYOUT, mode=mode, tower_weights=tower_weights, deterministic=True,
                   log_every=100, model=NoisyNet)
    tower_train.fit(train_dir=str(tmp_path / "resumed"), max_steps=2, **options)
    tower_train.fit(train_dir=str(tmp_path / "resumed"), max_steps=4, **options)
    tower_train.fit(train_dir=str(tmp_path / "straight"), max_steps=4, **options)
    resumed = checkpoint_values(str(tmp_path / "resumed"))
    straight = checkpoint_values(str(tmp_path / "straight"))
    compared = [name for name in straight if name.startswith(("model/", "optimizer/", "moving_average/"))]
    assert resumed.keys() == straight.keys() and len(compared) == 13
    assert straight["step/.ATTRIBUTES/VARIABLE_VALUE"] == 4
    for name in compared:
        np.testing.assert_array_equal(resumed[name], straight[name], err_msg=name)


def test_the_randomness_is_active_and_no_generator_moves():
    noisy = make_run(model=NoisyNet, **LAYOUT)
    quiet = make_run(model=quiet_net, **LAYOUT)
    states = [np.asarray(tf.convert_to_tensor(v)) for v in noisy.state.model.seed_states]
    assert len(states) == 2  # Dropout's and Jitter's
    for run in (noisy, quiet):
        batches = run.batches()
        for _ in range(2):
            run.inner.run_update(batches)
    difference = max(np.abs(n - q).max() for n, q in zip(weights(noisy.state.model), weights(quiet.state.model)))
    assert difference > 1e-3
    for variable, state in zip(noisy.state.model.seed_states, states, strict=True):
        np.testing.assert_array_equal(np.asarray(tf.convert_to_tensor(variable)), state)


def test_mirrored_draws_what_tower_mode_draws_for_the_same_shard():
    """Replica i gets tower i's shard and seeds, so the updates agree up to float rounding; any
    other draw would change the weights by far more."""
    tower, mirrored = make_run(model=NoisyNet, **LAYOUT), make_run(model=NoisyNet, mode="mirrored", **LAYOUT)
    quiet = make_run(model=quiet_net, **LAYOUT)
    for run in (tower, mirrored, quiet):
        batches = run.batches()
        for _ in range(2):
            run.inner.run_update(batches)

    def largest_difference(a, b):
        return max(np.abs(x - y).max() / np.abs(y).max()
                   for x, y in zip(weights(a.state.model), weights(b.state.model)))

    assert largest_difference(mirrored, tower) < 1e-5
    assert largest_difference(quiet, tower) > 1e-2


def test_a_pass_gives_the_seeds_it_is_handed_and_moves_no_generator():
    model = NoisyNet()
    model(tf.zeros([1, 24, 24, 3]))
    images = tf.random.stateless_uniform([8, 24, 24, 3], seed=[1, 2])
    before = [np.asarray(tf.convert_to_tensor(v)) for v in model.seed_states]

    def forward(seeds):
        with model.using(seeds=tf.unstack(seeds)):
            return model(images, training=True).numpy()

    first = tf.constant([[1, 2], [3, 4]], tf.int64)
    np.testing.assert_array_equal(forward(first), forward(first))
    for other in ([[1, 2], [3, 5]], [[1, 3], [3, 4]]):  # each generator's seed counts
        assert np.abs(forward(tf.constant(other, tf.int64)) - forward(first)).max() > 1e-3
    for variable, state in zip(model.seed_states, before, strict=True):
        np.testing.assert_array_equal(np.asarray(tf.convert_to_tensor(variable)), state)
    plain = TowerModel(10)
    assert plain.seed_states == [] and seed_generator_states(plain) is None


def test_pass_seeds_are_a_pure_function_and_distinct_per_update_micro_step_and_tower():
    generators = tf.constant([[7, 0], [8, 0]], tf.int64)
    grid = list(itertools.product(range(3), range(3), range(3)))
    seeds = {key: pass_seeds(generators, *key).numpy() for key in grid}
    assert all(s.shape == (2, 2) and s.dtype == np.int64 for s in seeds.values())
    np.testing.assert_array_equal(pass_seeds(generators, 2, 1, 0).numpy(), seeds[(2, 1, 0)])
    # Keras casts a state to int32 (mod 2**31 - 2) and a pass's draws take [a, b], [a, b + 1], ...:
    # no two passes or generators share an a.
    firsts = [int(a) % (2 ** 31 - 2) for s in seeds.values() for a in s[:, 0]]
    assert len(set(firsts)) == len(firsts) == 2 * len(grid)
