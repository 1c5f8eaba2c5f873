"""BatchNormalization across towers, replicas and micro-steps, checked against numpy and plain steps.

What one update does to BN (see docs/batchnorm.md):

- tower mode: every tower's call normalizes its own shard and moves the moving
  statistics (on the parameter device) one EMA step, tower after tower, so an
  update makes N x K steps: effective momentum momentum^(N x K).
- mirrored: every replica normalizes its own shard and moves only its own copy
  of the moving statistics (Keras 3 creates them with aggregation "none"), K
  steps per update; the update's one all-reduce then averages the copies.
- mirrored with --sync_bn: every replica normalizes over the global micro-batch
  and all copies take the same K steps per update.

The probe model puts BN directly on the images, so every expected statistic is
a numpy mean or variance of the recorded input shards.
"""
import itertools

import keras
import numpy as np
import pytest
import tensorflow as tf

import tower_train.models as models
from tower_train.models.resnet20 import ResNet20
from tower_train.data import catalog
from tower_train.config import TrainConfig
from tower_train.errors import UsageError
from helpers import fed, host_batches, make_run, weights

MOMENTUM = 0.5  # the probe's: large steps, so the order and the number of steps show clearly


@models.register("test_bn_probe")
class BNProbe(models.TowerModel):
    """BN on the input images, global average pooling, logits."""

    def __init__(self, num_classes: int, **kwargs):
        super().__init__(num_classes, **kwargs)
        self.bn = self.batch_norm(momentum=MOMENTUM, epsilon=1e-5)
        self.pool = keras.layers.GlobalAveragePooling2D()
        self.logits = keras.layers.Dense(num_classes)

    def call(self, images: tf.Tensor, training: bool = False) -> tf.Tensor:
        return self.logits(self.pool(self.bn(images, training=training)))


@models.register("test_old_signature")
class OldSignature(models.TowerModel):
    """A model written before sync_batch_norm existed: its __init__ takes num_classes only."""

    def __init__(self, num_classes: int):
        super().__init__(num_classes)
        self.logits = keras.layers.Dense(num_classes)

    def call(self, images: tf.Tensor, training: bool = False) -> tf.Tensor:
        return self.logits(keras.layers.Flatten()(images))


def recorded(run, count, record):
    """The next `count` global micro-batches of `run`'s stream (`host_batches`), fed to its step,
    with a numpy copy of the images and labels of each appended to `record`."""
    batches = list(itertools.islice(host_batches(run), count))
    record.extend((np.asarray(images), np.asarray(labels)) for images, labels, _ in batches)
    return fed(run.inner, batches)


def ema(start, values, momentum=MOMENTUM):
    """Keras BN's update, one step per value in order: m <- m * momentum + x * (1 - momentum)."""
    for x in values:
        start = start * momentum + x * (1 - momentum)
    return start


def shards(record, num_shards):
    """The shards of every recorded micro-batch, in stream order and tower order within each."""
    return [s for images, _ in record for s in np.split(images, num_shards)]


def stat(variable):
    return np.asarray(tf.convert_to_tensor(variable))


def test_tower_mode_moves_the_statistics_once_per_tower_and_micro_step_in_tower_order():
    num_towers, accum, updates = 2, 2, 2
    run = make_run(model="test_bn_probe", num_gpus=num_towers, accum=accum, batch_size=4,
                   optimizer="sgd", learning_rate=0.1)
    record = []
    batches = recorded(run, accum * updates, record)
    for _ in range(updates):
        run.inner.run_update(batches)
    means = [s.mean(axis=(0, 1, 2)) for s in shards(record, num_towers)]
    variances = [s.var(axis=(0, 1, 2)) for s in shards(record, num_towers)]  # biased, as tf.nn.moments
    assert len(means) == num_towers * accum * updates
    bn = run.state.model.bn
    np.testing.assert_allclose(stat(bn.moving_mean), ema(np.zeros(3), means), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(stat(bn.moving_variance), ema(np.ones(3), variances), rtol=1e-5)
    # Closed form of the same thing, per update: m' = momentum^(N*K) m + (1 - momentum) sum_j momentum^(N*K-1-j) x_j.
    steps = num_towers * accum
    after_first = ema(np.zeros(3), means[:steps])
    step_weights = MOMENTUM ** np.arange(steps - 1, -1, -1)
    np.testing.assert_allclose(
        stat(bn.moving_mean),
        MOMENTUM ** steps * after_first + (1 - MOMENTUM) * (step_weights[:, None] * means[steps:]).sum(0),
        rtol=1e-5, atol=1e-7)
    # The test can tell: another order, or one step per micro-batch, gives other numbers.
    reversed_order = [m for i in range(0, len(means), num_towers) for m in means[i:i + num_towers][::-1]]
    per_micro_batch = [np.mean(means[i:i + num_towers], axis=0) for i in range(0, len(means), num_towers)]
    for wrong in (ema(np.zeros(3), reversed_order), ema(np.zeros(3), per_micro_batch)):
        assert np.abs(stat(bn.moving_mean) - wrong).max() > 1e-3


@pytest.mark.parametrize("sync_bn", [False, True])
def test_mirrored_moving_statistics(sync_bn):
    num_replicas, accum = 2, 2
    run = make_run(mode="mirrored", model="test_bn_probe", num_gpus=num_replicas, accum=accum,
                   batch_size=4, optimizer="sgd", learning_rate=0.1, sync_bn=sync_bn)
    record = []
    run.inner.run_update(recorded(run, accum, record))
    bn = run.state.model.bn
    copies = [np.asarray(c) for c in bn.moving_mean.value.values]
    variance_copies = [np.asarray(c) for c in bn.moving_variance.value.values]
    assert len(copies) == num_replicas
    if sync_bn:
        # Every replica normalizes over the global micro-batch: K identical steps on every copy.
        means = [images.mean(axis=(0, 1, 2)) for images, _ in record]
        variances = [images.var(axis=(0, 1, 2)) for images, _ in record]
        for mean, variance in zip(copies, variance_copies):
            np.testing.assert_allclose(mean, ema(np.zeros(3), means), rtol=1e-5, atol=1e-7)
            np.testing.assert_allclose(variance, ema(np.ones(3), variances), rtol=1e-5)
    else:
        # Each replica moves only its own copy, K steps over its own shards; then the update's one
        # all-reduce averages the copies, so they agree again after every update.
        all_shards = shards(record, num_replicas)
        own = [all_shards[r::num_replicas] for r in range(num_replicas)]
        want_mean = np.mean([ema(np.zeros(3), [s.mean(axis=(0, 1, 2)) for s in o]) for o in own], axis=0)
        want_variance = np.mean([ema(np.ones(3), [s.var(axis=(0, 1, 2)) for s in o]) for o in own], axis=0)
        for mean, variance in zip(copies, variance_copies):
            np.testing.assert_allclose(mean, want_mean, rtol=1e-5, atol=1e-7)
            np.testing.assert_allclose(variance, want_variance, rtol=1e-5)
        unsynchronized = ema(np.zeros(3), [s.mean(axis=(0, 1, 2)) for s in own[1]])
        assert np.abs(copies[1] - unsynchronized).max() > 1e-3  # the averaging did something
    # What a checkpoint saves (and a read outside the replicas sees) is replica 0's copy.
    np.testing.assert_array_equal(stat(bn.moving_mean), copies[0])


@pytest.mark.parametrize("sync_bn", [False, True])
def test_mirrored_applies_tower_modes_updates_unless_sync_bn(sync_bn):
    layout = dict(model="test_bn_probe", num_gpus=2, accum=2, batch_size=4, optimizer="sgd",
                  learning_rate=0.5)
    tower, mirrored = make_run(**layout), make_run(mode="mirrored", sync_bn=sync_bn, **layout)
    tower.inner.run_update(tower.batches())
    mirrored.inner.run_update(mirrored.batches())
    difference = max(np.abs(m - t).max() / np.abs(t).max()
                     for m, t in zip(weights(mirrored.state.model), weights(tower.state.model)))
    if sync_bn:
        assert difference > 1e-3  # normalized over the global micro-batch, not per shard
    else:
        assert difference < 1e-5  # both normalize each shard alone


def resnet20_like(model, sync_batch_norm=False):
    """A fresh single-device ResNet20 holding `model`'s current values."""
    plain = ResNet20(num_classes=10, sync_batch_norm=sync_batch_norm)
    plain(tf.zeros([1, 24, 24, 3]))
    for mine, theirs in zip(plain.weights, model.weights, strict=True):
        mine.assign(stat(theirs))
    return plain


def plain_step(model, images, labels):
    """(loss, gradients) of one plain GradientTape step on one device: mean loss + regularization."""
    with tf.GradientTape() as tape:
        logits = model(images, training=True)
        loss = tf.reduce_mean(model.per_example_loss(labels, logits)) + model.regularization()
    return float(loss), [g.numpy() for g in tape.gradient(loss, model.trainable_variables)]


def applied_gradient(run, batches, learning_rate):
    """The gradient the next update applies, read back from plain SGD: (w_before - w_after) / rate."""
    before = weights(run.state.model)
    loss = run.inner.run_update(batches).loss
    return loss, [(b - a) / learning_rate for b, a in zip(before, weights(run.state.model))]


def largest_difference(got, want):
    """max over variables of max|got - want| / max|want|: float rounding is ~5e-6 here."""
    return max(np.abs(g - w).max() / (np.abs(w).max() + 1e-12) for g, w in zip(got, want, strict=True))


def test_resnet20_in_tower_mode_applies_the_mean_of_per_shard_plain_steps():
    """BN normalizes each tower's shard, so the update is the mean of N plain steps, one per shard,
    and NOT a plain step on the concatenated batch."""
    rate = 1.0
    run = make_run(model="resnet20", num_gpus=2, accum=1, batch_size=8, optimizer="sgd",
                   learning_rate=rate, ema_decay=0.0)
    plain = resnet20_like(run.state.model)
    record = []
    loss, got = applied_gradient(run, recorded(run, 1, record), rate)
    images, labels = record[0]
    per_shard = [plain_step(plain, x, y) for x, y in zip(np.split(images, 2), np.split(labels, 2))]
    want = [np.mean(g, axis=0) for g in zip(*(grads for _, grads in per_shard))]
    assert loss == pytest.approx(np.mean([shard_loss for shard_loss, _ in per_shard]), rel=1e-5)
    assert largest_difference(got, want) < 2e-5
    _, concatenated = plain_step(plain, images, labels)
    assert largest_difference(got, concatenated) > 0.1  # per-shard BN is another update (0.8 here)


def test_resnet20_mirrored_with_sync_bn_applies_a_plain_step_on_the_concatenated_batch():
    """With --sync_bn each BN layer normalizes over the global micro-batch of all replicas."""
    rate = 1.0
    run = make_run(mode="mirrored", model="resnet20", num_gpus=2, accum=1, batch_size=8,
                   optimizer="sgd", learning_rate=rate, ema_decay=0.0, sync_bn=True)
    plain = resnet20_like(run.state.model)
    record = []
    loss, got = applied_gradient(run, recorded(run, 1, record), rate)
    images, labels = record[0]
    want_loss, want = plain_step(plain, images, labels)
    assert loss == pytest.approx(want_loss, rel=1e-5)
    assert largest_difference(got, want) < 2e-5
    per_shard = [plain_step(plain, x, y)[1] for x, y in zip(np.split(images, 2), np.split(labels, 2))]
    assert largest_difference(got, [np.mean(g, axis=0) for g in zip(*per_shard)]) > 0.1


def test_resnet20_learns_in_tower_mode():
    """A few updates lower the loss on held-out examples (batch statistics, as in training)."""
    run = make_run(model="resnet20", num_gpus=1, batch_size=32, optimizer="momentum",
                   learning_rate=0.05)
    images, labels, _ = next(iter(catalog.load_source("synthetic").eval_batches(128)))

    def held_out_loss():
        logits = run.state.model(images, training=True)
        return float(tf.reduce_mean(run.state.model.per_example_loss(labels, logits)))

    before, batches = held_out_loss(), run.batches()
    for _ in range(8):
        assert run.inner.run_update(batches).applied
    assert held_out_loss() < 0.9 * before


def one_line_usage_error(match, build):
    with pytest.raises(UsageError, match=match) as error:
        build()
    assert "\n" not in str(error.value)


def test_sync_bn_refuses_tower_mode_and_models_without_batch_norm():
    one_line_usage_error(r"^--sync_bn: only with --mode=mirrored or multi_worker, not --mode=tower",
                         lambda: TrainConfig(sync_bn=True))
    one_line_usage_error(r"^--sync_bn: only with .* not --mode=central_storage",
                         lambda: TrainConfig(mode="central_storage", sync_bn=True))
    one_line_usage_error(r"^--sync_bn: --model=cifar10_cnn has no BatchNormalization layer$",
                         lambda: make_run(mode="mirrored", model="cifar10_cnn", sync_bn=True))
    one_line_usage_error(r"^--sync_bn: --model=test_old_signature does not accept sync_batch_norm",
                         lambda: make_run(mode="mirrored", model="test_old_signature", sync_bn=True))


def test_batch_norm_layers_follow_sync_batch_norm_and_resnet20_is_the_paper_s():
    for sync in (False, True):
        model = ResNet20(num_classes=10, sync_batch_norm=sync)
        assert model(tf.zeros([2, 24, 24, 3])).shape == (2, 10)
        norms = [layer for layer in model._flatten_layers() if isinstance(layer, keras.layers.BatchNormalization)]
        assert len(norms) == 19 and {layer.synchronized for layer in norms} == {sync}
    assert sum(int(np.prod(v.shape)) for v in model.trainable_variables) == 269_722  # "0.27 M"
    kernels = [v for v in model.trainable_variables if v.name == "kernel"]
    assert len(kernels) == 20  # 19 convolutions and the dense layer; no BN gamma/beta, no bias
    expected = 1e-4 * sum(float(tf.reduce_sum(tf.square(k))) / 2 for k in kernels)
    assert float(model.regularization()) == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("mode", ["tower", "mirrored"])
def test_a_refused_update_leaves_the_moving_statistics_as_they_were(mode):
    run = make_run(mode=mode, model="test_bn_probe", num_gpus=2, accum=2, batch_size=4,
                   optimizer="sgd", learning_rate=0.1)
    batches = host_batches(run)  # float images, which can hold a NaN
    run.inner.run_update(fed(run.inner, itertools.islice(batches, 2)))
    bn = run.state.model.bn
    before = stat(bn.moving_mean), stat(bn.moving_variance)
    images, labels, label_weights = next(batches)
    poisoned = np.asarray(images).copy()
    poisoned[0, 0, 0, 0] = np.nan
    good = next(batches)
    assert not run.inner.run_update(fed(run.inner, [(tf.constant(poisoned), labels, label_weights), good])).applied
    np.testing.assert_array_equal(stat(bn.moving_mean), before[0])
    np.testing.assert_array_equal(stat(bn.moving_variance), before[1])
    assert run.inner.run_update(fed(run.inner, itertools.islice(batches, 2))).applied  # and training goes on
    assert np.isfinite(stat(bn.moving_mean)).all()
