"""A user's network on a user's ArraySource, and weighted per-token losses: every layout of one G,
in tower and mirrored mode, applies the one-big-batch step normalized by the update's total weight.

The reference is computed here, independently: a plain GradientTape on one device over the G
examples of the update, loss = sum(w * loss) / sum(w) + regularization, then plain SGD.
"""
import inspect
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import tower_train
from tower_train.step.inner_step import Decision
from tower_train.models import l2_loss
from helpers import make_run, weights
from test_cli_errors import run_cli
from test_modes import kill_running, start_workers
from test_train import checkpoint_values

LR = 0.5
G = 48
LAYOUTS = [(48, 1, 1), (12, 2, 2), (6, 4, 2), (4, 3, 4), (2, 8, 3)]  # batch, towers, accum
# Every layout in tower mode; mirrored and central_storage, whose equality with tower mode
# test_modes.py checks update by update, in layouts that exercise both towers and micro-steps.
CASES = [("tower", layout, None) for layout in LAYOUTS] + [
    ("mirrored", (12, 2, 2), None), ("mirrored", (4, 3, 4), None), ("central_storage", (4, 3, 4), None),
    # Uneven towers (--tower_split): 12 and 4 examples per micro-step, then 2, 2 and 8.
    ("tower", (8, 2, 3), "3,1"), ("tower", (4, 3, 4), "1,1,4"),
    # --ps_device=spread: the weights in slices on the towers, at K = 1 and K > 1, split too.
    ("tower-spread", (6, 4, 2), None), ("tower-spread", (2, 8, 3), None), ("tower-spread", (12, 4, 1), None),
    ("tower-spread", (4, 3, 4), "1,1,4")]
IDS = [f"{mode}-{b}x{n}x{k}" + (f"-split{split}" if split else "") for mode, (b, n, k), split in CASES]
CLASSES = 12  # more than CIFAR's 10
STEPS, FEATURES = 5, 3  # a user's "time series" per example: [5, 3], nothing like an image


class SeriesNet(tower_train.TowerModel):
    """float32 [B, 5, 3] -> logits [B, 12]."""

    def __init__(self, num_classes: int = CLASSES, **kwargs):
        super().__init__(num_classes, **kwargs)
        self.flatten = keras.layers.Flatten()
        self.hidden = keras.layers.Dense(16, activation="tanh")
        self.logits = keras.layers.Dense(num_classes)

    def call(self, series, training=False):
        return self.logits(self.hidden(self.flatten(series)))

    def regularization(self):
        return 1e-3 * l2_loss(self.hidden.kernel)


class Tagger(tower_train.TowerModel):
    """Token ids [B, T] -> logits [B, T, C]: each token sees itself and the sequence's mean."""

    def __init__(self, num_classes: int = 7, **kwargs):
        super().__init__(num_classes, **kwargs)
        self.embed = keras.layers.Embedding(20, 8)
        self.logits = keras.layers.Dense(num_classes)

    def call(self, tokens, training=False):
        x = self.embed(tokens)
        return self.logits(x + tf.reduce_mean(x, axis=1, keepdims=True))

    def regularization(self):
        return 1e-3 * l2_loss(self.logits.kernel)


def series_source():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(G * 2, STEPS, FEATURES)).astype(np.float32)
    y = rng.integers(0, CLASSES, G * 2)
    return tower_train.ArraySource(train_features=x, train_labels=y, shuffle=False)


def token_source(weighted=True):
    """G sequences of up to 8 tokens, padded with weight 0; the first half hold 1 real token,
    the second half 8, so in most layouts some shards hold far fewer real tokens than others."""
    rng = np.random.default_rng(4)
    tokens = rng.integers(1, 20, (G, 8))
    labels = (tokens * 3 + np.roll(tokens, 1, axis=1)) % 7
    lengths = np.where(np.arange(G) < G // 2, 1, 8)
    mask = (np.arange(8)[None, :] < lengths[:, None]).astype(np.float32)
    return tower_train.ArraySource(train_features=tokens * mask.astype(np.int64), train_labels=labels * mask.astype(np.int64),
                                   train_weights=mask if weighted else None, shuffle=False)


def one_big_batch_step(model, source, normalize=None):
    """Plain SGD on the first G examples of the (unshuffled) source, on one device; `normalize`
    maps (losses [G, ...], weights) to the data loss, by default sum(w * loss) / sum(w)."""
    x, y, w = (tf.constant(a[:G]) for a in (source.train_features, source.train_labels,
                                             source.train_weights))
    normalize = normalize or (lambda losses, w: tf.reduce_sum(losses * w) / tf.reduce_sum(w))
    with tf.device("/cpu:0"), tf.GradientTape() as tape:
        losses = model.per_example_loss(y, model(x, training=True))
        loss = normalize(losses, w) + model.regularization()
    grads = tape.gradient(loss, model.trainable_variables)
    return float(loss), [v.numpy() - LR * tf.convert_to_tensor(g).numpy()
                         for v, g in zip(model.trainable_variables, grads)]


def run_one_update(model, source, mode, layout, split=None):
    """`mode` a --mode, or "tower-spread" for tower mode with --ps_device=spread."""
    batch, towers, accum = layout
    mode, _, ps_device = mode.partition("-")
    run = make_run(model=model, source=source, mode=mode, num_gpus=towers, accum=accum,
                   batch_size=batch, tower_split=split, optimizer="sgd", learning_rate=LR,
                   ema_decay=0.0, ps_device=ps_device or "cpu")
    expected_loss, expected = one_big_batch_step(run.state.model, source)
    result = run.inner.run_update(run.batches())
    run.inner.sync_state()
    return run, result, expected_loss, expected


@pytest.mark.parametrize("mode,layout,split", CASES, ids=IDS)
def test_a_users_network_on_its_arrays_is_one_big_batch_in_every_layout(mode, layout, split):
    run, result, expected_loss, expected = run_one_update(SeriesNet, series_source(), mode, layout, split)
    assert result.applied and result.total_weight == G
    assert result.loss == pytest.approx(expected_loss, rel=1e-5)
    for got, want in zip(weights(run.state.model), expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode,layout,split", CASES, ids=IDS)
def test_padded_sequences_are_normalized_by_the_updates_total_weight(mode, layout, split):
    source = token_source()
    run, result, expected_loss, expected = run_one_update(Tagger, source, mode, layout, split)
    real_tokens = float(source.train_weights[:G].sum())
    assert result.applied and result.total_weight == real_tokens == 24 * 1 + 24 * 8
    assert result.loss == pytest.approx(expected_loss, rel=1e-5)
    for got, want in zip(weights(run.state.model), expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_a_mean_of_shard_means_would_be_far_off():
    """The error the weighted rule avoids: in layout 12x2x2 the first micro-step's shards hold
    12 real tokens each and the second's 96; averaging the four shard means weighs a token of
    the short sequences 8 times more."""
    source = token_source()
    run = make_run(model=Tagger, source=source, num_gpus=2, accum=2, batch_size=12,
                   optimizer="sgd", learning_rate=LR, ema_decay=0.0)
    model = run.state.model

    def mean_of_shard_means(losses, w):
        shards = [(losses[i:i + 12], w[i:i + 12]) for i in range(0, G, 12)]
        return tf.add_n([tf.reduce_sum(l * s) / tf.reduce_sum(s) for l, s in shards]) / len(shards)

    _, right = one_big_batch_step(model, source)
    _, wrong = one_big_batch_step(model, source, mean_of_shard_means)
    gap = max(np.abs(r - w).max() for r, w in zip(right, wrong))
    assert gap > 100 * 1e-5  # a hundred times the tolerance the layouts are held to
    run.inner.run_update(run.batches())
    got = weights(model)
    assert max(np.abs(g - r).max() for g, r in zip(got, right)) < 1e-5
    assert max(np.abs(g - w).max() for g, w in zip(got, wrong)) > 100 * 1e-5


@pytest.mark.parametrize("mode", ["tower", "mirrored"])
def test_an_update_whose_weights_are_all_zero_is_refused_and_changes_nothing(mode):
    source = token_source()
    run = make_run(model=Tagger, source=source, mode=mode, num_gpus=2, accum=2, batch_size=4,
                   optimizer="momentum", learning_rate=LR)
    stream = run.batches()
    empty = [[(x, y, tf.zeros_like(w)) for x, y, w in shards] for shards in (next(stream), next(stream))]
    before = weights(run.state.model)
    result = run.inner.run_update(iter(empty))
    assert result.decision == Decision.EMPTY and result.total_weight == 0
    assert np.isfinite(result.loss)
    assert run.state.step.numpy() == 0 and run.state.optimizer.iterations.numpy() == 0
    for got, want in zip(weights(run.state.model), before):
        np.testing.assert_array_equal(got, want)
    assert run.inner.run_update(stream).applied  # and the next one trains


def test_held_out_precision_counts_weighted_tokens():
    from tower_train.training.evaluation.held_out import check_metrics, evaluate, make_metrics

    tokens = np.array([[1, 2, 3], [4, 5, 6]])
    labels = np.array([[1, 2, 0], [4, 0, 0]])
    mask = np.array([[1, 1, 0], [1, 0, 0]], np.float32)
    source = tower_train.ArraySource(tokens, labels, eval_features=tokens, eval_labels=labels,
                                     eval_weights=mask, num_classes=7)

    class Echo(tower_train.TowerModel):  # predicts the token id itself
        def call(self, tokens, training=False):
            return tf.one_hot(tokens, 7)

    accuracy = make_metrics(check_metrics([keras.metrics.SparseCategoricalAccuracy(name="acc")]))
    evaluation = evaluate(Echo(7), source, 1, ["/cpu:1", "/cpu:2"], accuracy)
    # Real tokens: 1->1 right, 2->2 right, 4->4 right; padding (weight 0) does not count, for
    # precision as for a Keras metric.
    assert (evaluation.precision, evaluation.examples) == (1.0, 2)
    assert evaluation.metrics == {"acc": 1.0}
    wrong = tower_train.ArraySource(tokens, labels, eval_features=tokens, eval_labels=labels,
                                    num_classes=7)
    unweighted = evaluate(Echo(7), wrong, 2, ["/cpu:1"], accuracy)
    assert unweighted.precision == pytest.approx(3 / 6)
    assert unweighted.metrics == {"acc": pytest.approx(3 / 6)}


# The workers import the model and the data from a module of the user's, as a user's would.
TOKENS_MODULE = """
import keras
import numpy as np
import tensorflow as tf

import tower_train
from tower_train.models import l2_loss, register


@register("test_tagger")
""" + inspect.getsource(Tagger) + """

@tower_train.data.source.register("test_padded_tokens")
def padded_tokens():
    # Positions 0-3 of every 8 hold one real token, 4-7 eight: with two workers of 4 examples
    # per micro-step, worker 0 counts 4 tokens and worker 1 counts 32.
    rng = np.random.default_rng(4)
    tokens = rng.integers(1, 20, (64, 8))
    lengths = np.where(np.arange(64) % 8 < 4, 1, 8)
    mask = (np.arange(8)[None, :] < lengths[:, None])
    return tower_train.ArraySource(tokens * mask, (tokens * 3) % 7 * mask, mask.astype(np.float32),
                                   shuffle=False, num_classes=7, name="test_padded_tokens")
"""
TOKENS = ["--model_module=weighted_tokens", "--model=test_tagger", "--data_module=weighted_tokens",
          "--dataset=test_padded_tokens", "--batch_size=4", "--accum=2", "--max_steps=3",
          "--optimizer=sgd", "--learning_rate=0.5", "--ema_decay=0", "--log_every=1"]


@pytest.mark.cpu_only  # multi_worker without a GPU: one CPU replica per worker, ring all-reduce
def test_two_workers_with_unequal_token_counts_apply_tower_modes_weighted_updates(tmp_path):
    (tmp_path / "weighted_tokens.py").write_text(TOKENS_MODULE)
    workers = start_workers(tmp_path / "mw", 2, [*TOKENS, "--collective_timeout=60"], cwd=tmp_path)
    try:
        logs = [w.communicate(timeout=240) for w in workers]
    finally:
        kill_running(workers)
    for worker, (_, err) in zip(workers, logs):
        assert worker.returncode == 0, err[-3000:]
    tower = run_cli("--num_gpus=2", f"--train_dir={tmp_path / 'tower'}", *TOKENS, cwd=tmp_path)
    assert tower.returncode == 0, tower.stderr[-3000:]
    multi, single = checkpoint_values(str(tmp_path / "mw")), checkpoint_values(str(tmp_path / "tower"))
    names = [n for n in single if n.startswith("model/")]
    assert names and multi.keys() == single.keys()
    for name in names:
        np.testing.assert_allclose(multi[name], single[name], rtol=1e-5, atol=1e-6, err_msg=name)
    # The logged losses agree too: the weighted mean over both workers' tokens.
    losses = [re.findall(r"step \d+, loss = ([\d.]+) \(", log) for log in (logs[0][1], tower.stderr)]
    assert losses[0] == losses[1] and len(losses[0]) == 3


def test_a_stream_whose_weights_are_all_zero_stops_after_max_skipped_updates(tmp_path):
    source = token_source()
    silent = tower_train.ArraySource(source.train_features, source.train_labels,
                                     np.zeros_like(source.train_weights), shuffle=False)
    with pytest.raises(tower_train.TrainingError, match=r"^3 updates in a row had total weight 0, up to "
                       r"stream position 24: that reaches --max_skipped=3 .*the last good checkpoint is none$"):
        tower_train.fit(model=Tagger, data=silent, train_dir=str(tmp_path / "run"), num_gpus=2,
                        batch_size=4, max_steps=10, max_skipped=3)
    assert not (tmp_path / "run" / "checkpoint").exists()
