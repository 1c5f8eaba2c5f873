"""tower_train.step.update_rule in this process, on the default CPU device: the loss scale's policy
(Keras's LossScaleOptimizer, one decision per update), clipping by the update's global norm, what
one applied or refused update moves, and BatchNorm's statistics kept and restored; each against
numpy, Keras or a formula written out here."""
import inspect

import keras
import numpy as np
import pytest
import tensorflow as tf

from tower_train.models.base import TowerModel
from tower_train.step.schedules import MovingAverage, UpdateSchedule
from tower_train.step.inner_step import Decision
from tower_train.step.update_rule import LossScale, TrainingStatistics, UpdateRule

FEATURES = 4


class TinyNet(TowerModel):
    """One Dense layer: a kernel [4, 3] and a bias [3]."""

    def __init__(self, num_classes: int = 3, **kwargs):
        super().__init__(num_classes, **kwargs)
        self.logits = keras.layers.Dense(num_classes)

    def call(self, features, training=False):
        return self.logits(features)


class NormalizedNet(TinyNet):
    """BatchNorm's moving statistics, and a Dropout whose SeedGenerator state is no statistic."""

    def __init__(self, num_classes: int = 3, **kwargs):
        super().__init__(num_classes, **kwargs)
        self.norm = self.batch_norm(momentum=0.5)
        self.dropout = keras.layers.Dropout(0.5)

    def call(self, features, training=False):
        return self.dropout(self.norm(super().call(features), training=training), training=training)


class QuickLossScale(LossScale):
    GROWTH_UPDATES = 3


def make_rule(optimizer: keras.optimizers.Optimizer | None = None, clip_norm: float | None = None,
              ema_decay: float = 0.0, loss_scale: LossScale | None = None) -> UpdateRule:
    """A rule for a built TinyNet, its optimizer built as the trainer builds it."""
    model = TinyNet()
    model(np.zeros((1, FEATURES), np.float32))
    optimizer = optimizer or keras.optimizers.SGD(0.1)
    optimizer.build(model.trainable_variables)
    step = tf.Variable(0, dtype=tf.int64, trainable=False)
    average = MovingAverage(model.trainable_variables, ema_decay) if ema_decay else None
    return UpdateRule(model, optimizer, step, clip_norm, average, loss_scale)


def random_gradients(model: TowerModel, seed: int, scale: float = 1.0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [(scale * rng.normal(size=v.shape)).astype(np.float32) for v in model.trainable_variables]


def values(variables) -> list[np.ndarray]:
    return [np.array(tf.convert_to_tensor(v)) for v in variables]


def numpy_clip(gradients: list[np.ndarray], clip_norm: float) -> list[np.ndarray]:
    """Rescaled to a global norm of at most clip_norm, in float64."""
    norm = np.sqrt(sum(np.sum(g.astype(np.float64) ** 2) for g in gradients))
    return [g * (clip_norm / max(norm, clip_norm)) for g in gradients]


def global_norm(gradients) -> float:
    return float(np.sqrt(sum(np.sum(np.asarray(g, np.float64) ** 2) for g in gradients)))


def scale_state(scale: LossScale) -> tuple[float, int]:
    return float(scale.value.numpy()), int(scale.good_updates.numpy())


# --------------------------------------------------------------------------------------------------
# LossScale


def test_loss_scale_starts_where_keras_loss_scale_optimizer_starts():
    keras_defaults = inspect.signature(keras.optimizers.LossScaleOptimizer).parameters
    assert LossScale.INITIAL == keras_defaults["initial_scale"].default == 2.0 ** 15
    assert LossScale.GROWTH_UPDATES == keras_defaults["dynamic_growth_steps"].default == 2000
    assert scale_state(LossScale()) == (2.0 ** 15, 0)


def test_loss_scale_halves_on_a_refusal_and_doubles_after_growth_updates_good_ones_in_a_row():
    scale = QuickLossScale()
    # (event, scale after it, good updates in a row after it), with GROWTH_UPDATES = 3.
    expected = [("applied", 2.0 ** 15, 1), ("applied", 2.0 ** 15, 2),
                ("refused", 2.0 ** 14, 0),  # the refusal breaks the run of 2
                ("applied", 2.0 ** 14, 1), ("applied", 2.0 ** 14, 2), ("applied", 2.0 ** 15, 0),
                ("applied", 2.0 ** 15, 1), ("applied", 2.0 ** 15, 2), ("applied", 2.0 ** 16, 0),
                ("refused", 2.0 ** 15, 0), ("refused", 2.0 ** 14, 0)]
    for event, value, good in expected:
        scale.after_applied() if event == "applied" else scale.after_refused()
        assert scale_state(scale) == (value, good), event


def test_loss_scale_follows_keras_loss_scale_optimizer_one_update_per_step():
    """Keras's optimizer, given a finite gradient for each applied update and a NaN one for each
    refused update, moves its scale and its counter exactly as LossScale does."""
    keras_scale = keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(0.0), initial_scale=LossScale.INITIAL,
        dynamic_growth_steps=QuickLossScale.GROWTH_UPDATES)
    variable = keras.Variable(np.zeros(2, np.float32))
    keras_scale.build([variable])
    scale = QuickLossScale()
    refused = np.random.default_rng(7).random(40) < 0.3
    assert 5 < refused.sum() < 35
    seen = [LossScale.INITIAL]
    for i, refuse in enumerate(refused):
        keras_scale.apply([tf.constant([np.nan if refuse else 1.0, 1.0])], [variable])
        scale.after_refused() if refuse else scale.after_applied()
        assert scale_state(scale) == (float(keras_scale.dynamic_scale.numpy()),
                                      int(keras_scale.step_counter.numpy())), f"update {i}"
        seen.append(scale_state(scale)[0])
    steps = np.diff(np.log2(seen))
    assert set(steps) == {-1.0, 0.0, 1.0}  # the sequence both halves and doubles the scale


def test_unscale_divides_by_the_current_value():
    scale = LossScale()
    scale.value.assign(96.0)
    gradients = [np.random.default_rng(1).normal(size=(4, 3)).astype(np.float32),
                 np.arange(1, 4, dtype=np.float32)]
    for got, want in zip(scale.unscale([tf.constant(g) for g in gradients]), gradients, strict=True):
        np.testing.assert_allclose(got.numpy(), want / np.float32(96.0), rtol=1e-7)
    scale.after_refused()  # the value it divides by is the variable's, read at the call
    for got, want in zip(scale.unscale([tf.constant(g) for g in gradients]), gradients, strict=True):
        np.testing.assert_allclose(got.numpy(), want / np.float32(48.0), rtol=1e-7)


# --------------------------------------------------------------------------------------------------
# UpdateRule


@pytest.mark.parametrize("clip_norm, size", [(None, 100.0), (1.0, 0.1), (1.0, 100.0), (0.3, 1.0)],
                         ids=["no-clip_norm", "under-the-norm", "over-the-norm", "over-a-small-norm"])
def test_clip_rescales_the_whole_gradient_to_the_global_norm_as_numpy_does(clip_norm, size):
    rule = make_rule(clip_norm=clip_norm)
    gradients = random_gradients(rule.model, seed=2, scale=size)
    got = [np.asarray(g) for g in rule.clip([tf.constant(g) for g in gradients])]
    want = gradients if clip_norm is None else numpy_clip(gradients, clip_norm)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-8)
    norm = global_norm(gradients)
    assert global_norm(got) == pytest.approx(norm if clip_norm is None else min(norm, clip_norm), rel=1e-5)


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "tf.function"])
def test_an_applied_update_moves_the_weights_once_at_the_schedules_rate_and_counts_once(traced):
    # Warm-up over 4 updates of a base rate 0.4: update t (from 0) runs at 0.4 x (t + 1) / 4, read
    # from optimizer.iterations before the update moves it.
    schedule = UpdateSchedule(0.4, "constant", warmup_steps=4)
    rule = make_rule(optimizer=keras.optimizers.SGD(schedule), clip_norm=1.0)

    def update(gradients):
        rule.apply(rule.clip(gradients))

    update = tf.function(update) if traced else update
    want = [w.astype(np.float64) for w in values(rule.model.trainable_variables)]
    for t, size in enumerate([0.1, 10.0, 1.0]):  # under, over, about at the clip norm
        gradients = random_gradients(rule.model, seed=10 + t, scale=size)
        update([tf.constant(g) for g in gradients])
        rate = 0.4 * (t + 1) / 4
        want = [w - rate * g for w, g in zip(want, numpy_clip(gradients, 1.0), strict=True)]
        for got, w in zip(values(rule.model.trainable_variables), want, strict=True):
            np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-6)
        assert int(rule.step.numpy()) == int(rule.optimizer.iterations.numpy()) == t + 1


def test_a_refused_update_moves_nothing_but_the_loss_scale():
    rule = make_rule(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), ema_decay=0.5,
                     loss_scale=QuickLossScale())
    rule.apply(random_gradients(rule.model, seed=3))  # momentum and average away from their start
    state = lambda: values([*rule.model.trainable_variables, *rule.optimizer.variables,
                            *rule.moving_average.averages, rule.step])
    before = state()
    assert int(rule.optimizer.iterations.numpy()) == 1
    momentums = [v for v in rule.optimizer.variables if "momentum" in v.name]
    assert len(momentums) == 2 and all(np.any(m != 0) for m in values(momentums))

    rule.refuse(Decision.NONFINITE)

    for got, want in zip(state(), before, strict=True):
        np.testing.assert_array_equal(got, want)
    assert scale_state(rule.loss_scale) == (2.0 ** 14, 0)


def test_without_a_loss_scale_a_refused_update_moves_nothing():
    rule = make_rule(optimizer=keras.optimizers.Adam(0.1), ema_decay=0.5)
    rule.apply(random_gradients(rule.model, seed=4))
    before = values([*rule.model.variables, *rule.optimizer.variables, *rule.moving_average.averages,
                     rule.step])
    rule.refuse(Decision.NONFINITE)
    after = values([*rule.model.variables, *rule.optimizer.variables, *rule.moving_average.averages,
                    rule.step])
    for got, want in zip(after, before, strict=True):
        np.testing.assert_array_equal(got, want)


def test_the_loss_scale_counts_applied_updates_and_refusals_through_the_rule():
    rule = make_rule(loss_scale=QuickLossScale())
    gradients = random_gradients(rule.model, seed=5)
    rule.apply(gradients)
    rule.apply(gradients)
    assert scale_state(rule.loss_scale) == (2.0 ** 15, 2)
    rule.refuse(Decision.EMPTY)  # no label counted: no overflow either
    assert scale_state(rule.loss_scale) == (2.0 ** 15, 2)
    rule.refuse(Decision.OVERFLOW)
    assert scale_state(rule.loss_scale) == (2.0 ** 14, 0)
    for _ in range(3):
        rule.apply(gradients)
    assert scale_state(rule.loss_scale) == (2.0 ** 15, 0)


@pytest.mark.parametrize("total_weight, finite, loss, scale, decision", [
    (16.0, True, 2.5, None, Decision.APPLIED),
    (16.0, False, 2.5, None, Decision.NONFINITE),  # without a loss scale nothing is an overflow
    (16.0, False, np.nan, None, Decision.NONFINITE),
    (0.0, True, 0.0, None, Decision.EMPTY),
    (0.0, False, np.nan, 2.0 ** 15, Decision.EMPTY),  # no label counted: neither fault nor overflow
    (16.0, True, 2.5, 2.0 ** 15, Decision.APPLIED),
    (16.0, False, 2.5, 2.0 ** 15, Decision.OVERFLOW),
    (16.0, False, 2.5, 2.0, Decision.OVERFLOW),  # halved to 1: the scale still guards float16's range
    (16.0, False, 2.5, 1.0, Decision.NONFINITE),  # halved to 0.5: the gradient itself is non-finite
    (16.0, False, np.inf, 2.0 ** 15, Decision.NONFINITE),  # a non-finite loss is never an overflow
    (16.0, False, np.nan, 2.0 ** 15, Decision.NONFINITE),
])
@pytest.mark.parametrize("traced", [False, True])
def test_decide_names_what_becomes_of_an_update(total_weight, finite, loss, scale, decision, traced):
    rule = make_rule(loss_scale=None if scale is None else LossScale())
    if scale is not None:
        rule.loss_scale.value.assign(scale)
    decide = tf.function(rule.decide) if traced else rule.decide

    got = decide(tf.constant(total_weight), tf.constant(finite), tf.constant(loss, tf.float32))

    assert got.dtype == tf.int32 and Decision(int(got)) == decision


def test_the_moving_average_takes_one_step_per_applied_update():
    # decay at update t (from 1) = min(0.2, (1 + t) / (10 + t)): 2/11 at t = 1, then 0.2.
    rule = make_rule(ema_decay=0.2)
    want = [w.astype(np.float64) for w in values(rule.model.trainable_variables)]
    t = 0
    for event, seed in [("apply", 6), ("refuse", None), ("apply", 7), ("apply", 8)]:
        if event == "refuse":
            rule.refuse(Decision.NONFINITE)
        else:
            rule.apply(random_gradients(rule.model, seed))
            t += 1
            decay = min(0.2, (1 + t) / (10 + t))
            want = [decay * a + (1 - decay) * w
                    for a, w in zip(want, values(rule.model.trainable_variables), strict=True)]
        for got, w in zip(values(rule.moving_average.averages), want, strict=True):
            np.testing.assert_allclose(got, w, rtol=1e-6, atol=1e-7)
    assert int(rule.step.numpy()) == 3


# --------------------------------------------------------------------------------------------------
# TrainingStatistics


def test_training_statistics_restore_the_moving_statistics_kept_and_not_the_dropout_seed():
    model = NormalizedNet()
    x = np.random.default_rng(9).normal(size=(8, FEATURES)).astype(np.float32)
    model(x[:1])
    statistics = TrainingStatistics(model)
    seed_ids = {id(v.value) for v in model.seed_states}
    assert len(model.seed_states) == 1 and not seed_ids & {id(v) for v in statistics.live}
    norm = model.norm
    moving = lambda: values([norm.moving_mean, norm.moving_variance])
    start = moving()

    model(x, training=True)  # an update's micro-step moves them, and draws a dropout mask
    moved, seed_moved = moving(), values(model.seed_states)
    assert not np.allclose(moved[0], start[0])
    statistics.restore()  # a refused update: back to the last kept
    for got, want in zip(moving(), start, strict=True):
        np.testing.assert_array_equal(got, want)
    for got, want in zip(values(model.seed_states), seed_moved, strict=True):
        np.testing.assert_array_equal(got, want)  # a seed state is not rewound

    model(x, training=True)
    statistics.keep()  # an applied update
    kept = moving()
    model(2.0 * x, training=True)
    statistics.restore()
    for got, want in zip(moving(), kept, strict=True):
        np.testing.assert_array_equal(got, want)
