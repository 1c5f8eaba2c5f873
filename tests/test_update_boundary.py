"""The schedule, clipping, the moving average and the step counter advance once per update, in
tower and mirrored modes, against a plain single-device computation on the concatenated batch."""
import math

import numpy as np
import pytest
import tensorflow as tf

from tower_train.step.schedules import UpdateSchedule, scaled_rate, updates_per_decay
from helpers import fed, make_run, weights, unit_weighted

BATCH, TOWERS, ACCUM = 4, 2, 3
G = BATCH * TOWERS * ACCUM


def test_exponential_is_the_originals_staircase_counted_in_examples():
    # The original: 0.1, x0.1 every 350 epochs of 50 000 examples, at batch 128 per update.
    per_decay = updates_per_decay(50_000, 128)
    assert per_decay == pytest.approx(350 * 50_000 / 128)
    schedule = UpdateSchedule(0.1, "exponential", updates_per_decay=per_decay)
    assert float(schedule(0)) == pytest.approx(0.1)
    assert float(schedule(math.floor(per_decay))) == pytest.approx(0.1)
    assert float(schedule(math.ceil(per_decay))) == pytest.approx(0.01)
    # With 4 towers G is 512 examples per update: the decay comes 4x sooner in updates, at the
    # same epoch. The original divided by the per-tower batch and decayed 4x too late.
    assert updates_per_decay(50_000, 512) == pytest.approx(per_decay / 4)


def test_warm_up_is_linear_then_cosine_reaches_zero_at_the_last_update():
    schedule = UpdateSchedule(1.0, "cosine", warmup_steps=4, total_steps=12)
    rates = [float(schedule(t)) for t in range(13)]
    np.testing.assert_allclose(rates[:4], [0.25, 0.5, 0.75, 1.0], rtol=1e-6)
    expected = [0.5 * (1 + math.cos(math.pi * (t - 4) / 8)) for t in range(4, 13)]
    np.testing.assert_allclose(rates[4:], expected, rtol=1e-5, atol=1e-7)
    assert float(UpdateSchedule(0.3, "constant")(10_000)) == pytest.approx(0.3)


def test_linear_scaling_rule_uses_g():
    assert scaled_rate(0.1, 1024, scale=True) == pytest.approx(0.4)
    assert scaled_rate(0.1, 1024, scale=False) == pytest.approx(0.1)


def reference_run(initial, images, labels, model, rates, clip_norm, ema_decay):
    """SGD on the concatenated batch of each update, by hand: the rate of update t is rates[t];
    the gradient is clipped by its global norm; the average moves once per update."""
    for v, w in zip(model.trainable_variables, initial):
        v.assign(w)
    averages = [w.copy() for w in initial]
    for t, rate in enumerate(rates):
        chunk = slice(t * G, (t + 1) * G)
        with tf.device("/cpu:0"), tf.GradientTape() as tape:
            logits = model(images[chunk], training=True)
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels[chunk], logits))
            loss += model.regularization()
        grads = tape.gradient(loss, model.trainable_variables)
        grads, _ = tf.clip_by_global_norm(grads, clip_norm)
        for v, g in zip(model.trainable_variables, grads):
            v.assign_sub(rate * g)
        decay = min(ema_decay, (2.0 + t) / (11.0 + t))  # update number t + 1
        averages = [decay * a + (1 - decay) * w for a, w in zip(averages, weights(model))]
    return weights(model), averages


@pytest.mark.parametrize("mode", ["tower", "mirrored"])
def test_rate_clipping_average_and_step_advance_once_per_update(mode):
    updates = 4
    run = make_run(mode=mode, num_gpus=TOWERS, accum=ACCUM, batch_size=BATCH, optimizer="sgd",
                   learning_rate=0.2, lr_schedule="cosine", warmup_steps=2, max_steps=updates,
                   clip_norm=0.5, ema_decay=0.9)
    initial = weights(run.state.model)
    rng = np.random.default_rng(3)
    images = rng.normal(size=(updates * G, 24, 24, 3)).astype(np.float32)
    labels = rng.integers(0, 10, size=updates * G).astype(np.int32)
    micro = BATCH * TOWERS
    batches = fed(run.inner, [unit_weighted(images[i:i + micro], labels[i:i + micro])
                              for i in range(0, len(labels), micro)])
    rates = []
    for _ in range(updates):
        rates.append(float(run.state.optimizer.learning_rate))
        assert run.inner.run_update(batches).applied
    schedule = UpdateSchedule(0.2, "cosine", warmup_steps=2, total_steps=updates)
    np.testing.assert_allclose(rates, [float(schedule(t)) for t in range(updates)], rtol=1e-6)
    assert len(set(rates)) == 3  # 0.1, 0.2, 0.2, 0.1: a per-micro-step schedule would differ
    assert run.state.step.numpy() == updates and run.state.optimizer.iterations.numpy() == updates

    reference = make_run(num_gpus=0, batch_size=G, optimizer="sgd")
    want_weights, want_averages = reference_run(initial, images, labels, reference.state.model,
                                                rates, clip_norm=0.5, ema_decay=0.9)
    for got, want in zip(weights(run.state.model), want_weights):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
    averages = [np.asarray(tf.convert_to_tensor(a)) for a in run.state.moving_average.averages]
    for got, want in zip(averages, want_averages):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)


def test_clipping_acts_on_the_whole_update_not_on_a_share():
    # The update's mean gradient has a global norm above 0.5 here, so clipping is active; clipping
    # each tower's or micro-step's share instead would move the weights differently.
    run = make_run(num_gpus=TOWERS, accum=ACCUM, batch_size=BATCH, optimizer="sgd", learning_rate=1.0,
                   clip_norm=0.5, ema_decay=0.0)
    unclipped = make_run(num_gpus=TOWERS, accum=ACCUM, batch_size=BATCH, optimizer="sgd",
                         learning_rate=1.0, ema_decay=0.0)
    rng = np.random.default_rng(5)
    images = rng.normal(size=(G, 24, 24, 3)).astype(np.float32)
    labels = rng.integers(0, 10, size=G).astype(np.int32)
    micro = BATCH * TOWERS
    steps = []
    for r in (run, unclipped):
        before = weights(r.state.model)
        r.inner.run_update(fed(r.inner, [unit_weighted(images[i:i + micro], labels[i:i + micro]) for i in range(0, G, micro)]))
        steps.append([b - a for a, b in zip(weights(r.state.model), before)])
    clipped_norm = math.sqrt(sum(float(np.sum(d ** 2)) for d in steps[0]))
    full_norm = math.sqrt(sum(float(np.sum(d ** 2)) for d in steps[1]))
    assert full_norm > 0.5 and clipped_norm == pytest.approx(0.5, rel=1e-4)
    for c, f in zip(steps[0], steps[1]):  # the same direction, only shorter
        np.testing.assert_allclose(c, f * (0.5 / full_norm), rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("mode", ["tower", "mirrored"])
def test_weight_decay_counts_once_per_update_whatever_n_and_k(mode):
    # The step minus the data loss's gradient (computed independently, before the update) is the
    # regularization's gradient: 0.004 x w for local3 and local4 at rate 1, once. Counted per
    # tower or per micro-step it would be N x K = 6 times that.
    layout = dict(mode=mode, num_gpus=TOWERS, accum=ACCUM, batch_size=BATCH, optimizer="sgd",
                  learning_rate=1.0, ema_decay=0.0)
    run = make_run(**layout)
    rng = np.random.default_rng(11)
    images = rng.normal(size=(G, 24, 24, 3)).astype(np.float32)
    labels = rng.integers(0, 10, size=G).astype(np.int32)
    micro = BATCH * TOWERS
    model = run.state.model
    before = {name: np.asarray(tf.convert_to_tensor(getattr(model, name).kernel)) for name in ("local3", "local4")}
    with tf.device("/cpu:0"), tf.GradientTape() as tape:
        data_loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels, model(images, training=True)))
    data_grads = dict(zip(("local3", "local4"), tape.gradient(
        data_loss, [model.local3.kernel, model.local4.kernel])))
    run.inner.run_update(fed(run.inner, [unit_weighted(images[i:i + micro], labels[i:i + micro])
                                         for i in range(0, G, micro)]))
    for name in ("local3", "local4"):
        after = np.asarray(tf.convert_to_tensor(getattr(model, name).kernel))
        regularization_step = (before[name] - after) - data_grads[name].numpy()
        np.testing.assert_allclose(regularization_step, 0.004 * before[name], rtol=1e-3, atol=2e-7)
