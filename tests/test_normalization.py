"""tower_train/normalization.py: `compare_normalizations`' three numbers per update against a
plain GradientTape over each update's examples, computed here; and the command's printed lines."""
import re
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from tower_train.data import catalog
from tower_train.config import TrainConfig
from tower_train.model_spec import build_model, resolve_model
from tower_train.normalization import compare_normalizations
from tower_train.startup import NORMALIZATION, start
from test_cli_errors import ROOT

UPDATES = 2
# Padded sequences of 7 to 47 real tokens in shards of 2 sequences: the shards' weights differ.
SEQUENCES = dict(model="tiny_transformer", dataset="markov_text", num_gpus=2, batch_size=2, accum=2)
# One label per example, every one weighing 1, in equal shards: the two normalizations agree.
IMAGES = dict(dataset="synthetic", num_gpus=2, batch_size=4, accum=2)


def config_of(options: dict) -> TrainConfig:
    return TrainConfig(train_dir="/unused", **options)


def normalizations(options: dict) -> list[tuple[float, float, float]]:
    """`compare_normalizations` of a run started as the command starts it."""
    with start(NORMALIZATION, {"train_dir": "/unused", **options}) as run:
        return compare_normalizations(run, UPDATES)


def by_hand(config: TrainConfig, updates: int) -> list[tuple[float, float, float]]:
    """(sum(w * loss) / sum(w), the mean over the N x K shards of each one's sum(w * loss) /
    sum(w), |g_means - g| / |g|) per update, from one tape over the update's G examples, on the
    initial model the command builds (same seed); softmax cross-entropy, no regularization."""
    source = catalog.load_source(config.dataset, None, False)
    keras.utils.set_random_seed(config.seed)
    model = build_model(resolve_model(None, config, None, source.num_classes), source, config)
    micro_batch = sum(config.tower_shard_sizes)
    stream = source.train_stream(seed=config.seed, start_position=0,
                                 micro_batch=micro_batch).as_numpy_iterator()
    # The update's examples are its K micro-batches one after the other, each cut into the
    # towers' shards in order.
    bounds = np.cumsum([0, *config.tower_shard_sizes * config.accum])
    results = []
    for _ in range(updates):
        x, y, w = (np.concatenate(part) for part in zip(*(next(stream) for _ in range(config.accum))))
        shard_weights = [w[a:b].sum() for a, b in zip(bounds[:-1], bounds[1:])]
        with tf.GradientTape(persistent=True) as tape:
            weighted = w * tf.nn.sparse_softmax_cross_entropy_with_logits(y, model(x, training=True))
            loss = tf.reduce_sum(weighted) / w.sum()
            mean_loss = tf.add_n([tf.reduce_sum(weighted[a:b]) / total for a, b, total in
                                  zip(bounds[:-1], bounds[1:], shard_weights)]) / len(shard_weights)
        gradient, means = ([tf.convert_to_tensor(g).numpy().astype(np.float64)
                            for g in tape.gradient(target, model.trainable_variables)]
                           for target in (loss, mean_loss))
        error = (np.sqrt(sum(np.sum((m - g) ** 2) for m, g in zip(means, gradient)))
                 / np.sqrt(sum(np.sum(g ** 2) for g in gradient)))
        results.append((float(loss), float(mean_loss), float(error)))
    return results


@pytest.fixture(scope="module")
def sequences():
    return normalizations(SEQUENCES), by_hand(config_of(SEQUENCES), UPDATES)


def test_on_padded_sequences_the_two_losses_and_the_gradient_error_are_those_computed_by_hand(sequences):
    got, want = sequences
    assert len(got) == UPDATES
    for (loss, mean_loss, error), (want_loss, want_mean, want_error) in zip(got, want):
        assert abs(want_loss - want_mean) > 1e-3  # apart: swapping them would show
        assert (loss, mean_loss) == (pytest.approx(want_loss, rel=1e-5), pytest.approx(want_mean, rel=1e-5))
        assert want_error > 0.01
        assert error == pytest.approx(want_error, rel=1e-4)
    assert got[0] != pytest.approx(got[1])  # each update reads its own examples


def test_with_equal_shards_of_labels_weighing_one_the_two_normalizations_agree():
    got, want = normalizations(IMAGES), by_hand(config_of(IMAGES), UPDATES)
    for (loss, mean_loss, error), (want_loss, want_mean, want_error) in zip(got, want, strict=True):
        assert want_mean == pytest.approx(want_loss, rel=1e-6) and want_error < 1e-5
        assert (loss, mean_loss) == (pytest.approx(want_loss, rel=1e-5), pytest.approx(want_loss, rel=1e-5))
        assert error < 1e-5


# The printed numbers are compared with this process's, computed on its CPU.
@pytest.mark.cpu_only
def test_the_command_prints_the_layout_and_each_updates_numbers(sequences):
    flags = [f"--{name}={value}" for name, value in SEQUENCES.items()]
    result = subprocess.run([sys.executable, "-m", "tower_train.normalization", f"--updates={UPDATES}",
                             *flags], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    assert lines[0] == "tiny_transformer on markov_text: G = 8 examples per update in 2 x 2 shards of 2/2"
    number = r"(\d+\.\d{4})"
    pattern = (rf"update (\d): loss {number} \(sum\(w\*loss\)/sum\(w\)\) vs {number} \(mean of shard "
               rf"means\); gradient relative error of the mean of means {number}")
    printed = [re.fullmatch(pattern, line) for line in lines[1:]]
    assert len(printed) == UPDATES and all(printed), lines
    got, _ = sequences
    for update, (match, numbers) in enumerate(zip(printed, got, strict=True), start=1):
        assert int(match[1]) == update
        assert [float(match[i]) for i in (2, 3, 4)] == pytest.approx(numbers, abs=1e-4)
