"""--measure=keras (tower_train/benchmark/keras_epochs.py): Keras's fit and tower_train.keras.fit
timed per epoch on the same model, data and batch, and the report of their ratio. No timing is
asserted: only what is timed and how the report reads it."""
import keras
import numpy as np

from tower_train.benchmark import keras_epochs
from tower_train.benchmark.keras_epochs import KerasEpochs, format_keras_report, measure_keras_epochs


def tiny():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, activation="softmax")])
    x = np.random.default_rng(0).normal(size=(64, 3)).astype(np.float32)
    return model, x, (x[:, 0] > 0).astype(np.int32), "sparse_categorical_crossentropy", "accuracy", 16


def test_each_try_times_every_epoch_but_the_first_for_both_trainers(monkeypatch):
    monkeypatch.setattr(keras_epochs, "MODELS", {"tiny": tiny})
    (result,) = measure_keras_epochs(rounds=2, epochs=3)
    assert (result.model, result.batch_size, result.examples) == ("tiny", 16, 64)
    # Two tries of each trainer, two timed epochs each.
    assert len(result.keras_seconds) == len(result.tower_train_seconds) == 4
    assert all(s > 0 for s in result.keras_seconds + result.tower_train_seconds)


def test_the_report_gives_each_trainers_best_epoch_and_their_ratio():
    result = KerasEpochs("lstm", 64, 2048, keras_seconds=[0.5, 0.4, 0.45],
                         tower_train_seconds=[0.6, 0.44, 0.9])
    assert result.ratio == 0.44 / 0.4
    header, row = format_keras_report([result]).splitlines()
    assert "goal <= 1.15" in header
    assert row.split() == ["lstm", "64", "2048", "0.400", "0.440", "1.10"]
