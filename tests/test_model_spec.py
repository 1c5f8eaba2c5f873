"""What `model_spec` makes of a model beyond its shapes: Keras weight regularizers count once per
update, and the losses a call adds through Keras (activity regularizers, add_loss) as their mean over
the update's examples, as Keras's own loss on the one big batch counts them, in every layout; and the
moving averages copied into a model's weights for evaluation and export."""
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import tower_train
from tower_train.model_spec import use_moving_average
from tower_train.models import model_class
from tower_train.step.schedules import MovingAverage
from helpers import make_run, weights
from test_weighted import CLASSES, G, LR, Tagger, series_source, token_source

LAYOUTS = [("tower", (12, 2, 2), None), ("tower", (8, 2, 3), "3,1"), ("mirrored", (12, 2, 2), None)]


class KerasRegularized(tower_train.TowerModel):
    """Penalties in Keras's own form (kernel and bias regularizers, large so that they show) beside
    one of its own."""

    def __init__(self, num_classes: int = CLASSES, **kwargs):
        super().__init__(num_classes, **kwargs)
        self.flatten = keras.layers.Flatten()
        self.hidden = keras.layers.Dense(16, activation="tanh", kernel_regularizer=keras.regularizers.L2(0.5),
                                         bias_initializer="ones", bias_regularizer=keras.regularizers.L1(0.2))
        self.logits = keras.layers.Dense(num_classes)

    def call(self, series, training=False):
        return self.logits(self.hidden(self.flatten(series)))

    def regularization(self):
        return 0.3 * tf.reduce_sum(self.logits.kernel ** 2)


def keras_big_batch_step(model, source, keras_penalties=True):
    """Plain SGD on the first G examples on one device, with the loss Keras's fit would take:
    the mean loss, the model's regularization() and `model.losses` (Keras's own penalties)."""
    x, y = tf.constant(source.train_features[:G]), tf.constant(source.train_labels[:G])
    with tf.device("/cpu:0"), tf.GradientTape() as tape:
        loss = tf.reduce_mean(model.per_example_loss(y, model(x, training=True)))
        assert len(model.losses) == 2
        loss += model.regularization() + (tf.add_n(model.losses) if keras_penalties else 0.0)
    grads = tape.gradient(loss, model.trainable_variables)
    return float(loss), [v.numpy() - LR * g.numpy() for v, g in zip(model.trainable_variables, grads)]


def one_update_equals_the_reference(model, source, mode, layout, split, reference) -> tuple[float, list]:
    """Applies one update of `model` on `source` in this layout and checks its loss and weights
    against `reference(model, source, True)` from the same initial weights; returns how far that
    reference is from `reference(model, source, False)`, which leaves the losses under test out:
    (in the loss, in each variable's largest weight)."""
    batch, towers, accum = layout
    run = make_run(model=model, source=source, mode=mode, num_gpus=towers, accum=accum,
                   batch_size=batch, tower_split=split, optimizer="sgd", learning_rate=LR, ema_decay=0.0)
    expected_loss, expected = reference(run.state.model, source, True)
    without_loss, without = reference(run.state.model, source, False)
    result = run.inner.run_update(run.batches())
    assert result.applied and result.loss == pytest.approx(expected_loss, rel=1e-5)
    for got, want in zip(weights(run.state.model), expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    return expected_loss - without_loss, [np.abs(e - w).max() for e, w in zip(expected, without)]


@pytest.mark.parametrize("mode,layout,split", LAYOUTS, ids=[f"{m}-{b}x{n}x{k}-{s}" for m, (b, n, k), s in LAYOUTS])
def test_keras_weight_regularizers_count_once_per_update_as_on_one_big_batch(mode, layout, split):
    in_loss, in_weights = one_update_equals_the_reference(KerasRegularized, series_source(), mode, layout, split,
                                                          keras_big_batch_step)
    # Large enough that leaving them out (as before) would fail the comparisons.
    assert in_loss > 1.0 and in_weights[0] > 1e-2 and in_weights[1] > 1e-2  # the kernel's and bias's


class ActivityTagger(Tagger):
    """The token tagger with losses of the batch, large so that they show: an activity regularizer
    (Keras divides it by the batch size), and in training an add_loss of a mean over the batch."""

    def __init__(self, num_classes: int = 7, **kwargs):
        super().__init__(num_classes, **kwargs)
        self.hidden = keras.layers.Dense(8, activation="tanh", activity_regularizer=keras.regularizers.L2(0.5))

    def call(self, tokens, training=False):
        x = self.hidden(self.embed(tokens))
        if training:
            self.add_loss(0.7 * tf.reduce_mean(tf.reduce_sum(x, axis=[1, 2]) ** 2))
        return self.logits(x + tf.reduce_mean(x, axis=1, keepdims=True))


def big_batch_step_with_batch_losses(model, source, batch_losses=True):
    """Plain SGD on the first G examples on one device: sum(w * loss) / sum(w) over their tokens,
    the regularization, and the call's Keras losses taken on all G at once."""
    x, y, w = (tf.constant(a[:G]) for a in (source.train_features, source.train_labels, source.train_weights))
    with tf.device("/cpu:0"), tf.GradientTape() as tape:
        losses = model.per_example_loss(y, model(x, training=True))
        assert len(model.losses) == 2  # the activity regularizer's and add_loss's
        loss = tf.reduce_sum(losses * w) / tf.reduce_sum(w) + model.regularization()
        loss += tf.add_n(model.losses) if batch_losses else 0.0
    grads = tape.gradient(loss, model.trainable_variables)
    return float(loss), [v.numpy() - LR * tf.convert_to_tensor(g).numpy() for v, g in zip(model.trainable_variables, grads)]


BATCH_LOSS_LAYOUTS = [("tower", (24, 2, 1), None), ("tower", (6, 4, 2), None), ("tower", (8, 2, 3), "3,1"),
                      ("mirrored", (12, 2, 2), None)]


@pytest.mark.parametrize("mode,layout,split", BATCH_LOSS_LAYOUTS,
                         ids=[f"{m}-{b}x{n}x{k}-{s}" for m, (b, n, k), s in BATCH_LOSS_LAYOUTS])
def test_losses_a_call_adds_count_as_their_mean_over_the_updates_examples(mode, layout, split):
    """Per-token weights make W differ from the examples' count, and the split makes towers'
    shards unequal: a mean of per-shard means, or dividing by W, would show."""
    in_loss, in_weights = one_update_equals_the_reference(ActivityTagger, token_source(), mode, layout, split,
                                                          big_batch_step_with_batch_losses)
    assert in_loss > 0.1 and max(in_weights) > 1e-2


ADD_LOSS_NOW = [False]


class LateLoss(tower_train.TowerModel):
    """Adds a loss of the batch only once ADD_LOSS_NOW says so: after its start-up trace."""

    def __init__(self, num_classes: int = CLASSES, **kwargs):
        super().__init__(num_classes, **kwargs)
        self.flatten = keras.layers.Flatten()
        self.logits = keras.layers.Dense(num_classes)

    def call(self, series, training=False):
        logits = self.logits(self.flatten(series))
        if training and ADD_LOSS_NOW[0]:
            self.add_loss(tf.reduce_mean(logits ** 2))
        return logits


class AddLossFromNowOn(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        ADD_LOSS_NOW[0] = True


def test_a_loss_of_the_batch_first_added_after_the_start_up_trace_is_one_line_not_left_out(tmp_path):
    try:
        with pytest.raises(tower_train.UsageError) as error:
            tower_train.fit(model=LateLoss, data=series_source(), num_gpus=2, batch_size=4, accum=2,
                            max_steps=2, callbacks=[AddLossFromNowOn()], train_dir=tmp_path / "run")
    finally:
        ADD_LOSS_NOW[0] = False
    assert str(error.value) == ("LateLoss: a training call added losses through Keras (add_loss, "
                                "activity_regularizer) that its start-up trace did not; add them in "
                                "every training call")
    assert not any(name.startswith("ckpt-") for name in os.listdir(tmp_path / "run"))


def test_use_moving_average_copies_the_averages_into_the_weights():
    with tf.device("/cpu:0"):
        model = model_class("cifar10_cnn")(num_classes=10)
        model(tf.zeros([1, 24, 24, 3]))
        average = MovingAverage(model.trainable_variables, 0.9)
    for a in average.averages:
        a.assign(tf.fill(a.shape, 0.5))
    use_moving_average(model, average)
    for w in model.trainable_variables:
        np.testing.assert_array_equal(w.numpy(), np.full(w.shape, 0.5, np.float32))
