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
    assert row.split() == ["lstm", "64", "1", "2048", "0.400", "0.440", "1.10"]


def test_an_accumulating_model_trains_k_micro_batches_per_update_in_both_trainers(monkeypatch):
    import tower_train.keras

    monkeypatch.setattr(keras_epochs, "MODELS", {"tiny_k2": tiny})
    monkeypatch.setattr(keras_epochs, "ACCUM", {"tiny_k2": 2})
    seen = []  # (trainer, K) of every fit
    keras_fit, ours = keras.Model.fit, tower_train.keras.fit

    def spied_keras_fit(model, *args, **kwargs):
        seen.append(("keras", model.optimizer.gradient_accumulation_steps))
        return keras_fit(model, *args, **kwargs)

    def spied_ours(model, *args, **kwargs):
        seen.append(("tower_train", kwargs["accum"]))
        return ours(model, *args, **kwargs)

    monkeypatch.setattr(keras.Model, "fit", spied_keras_fit)
    monkeypatch.setattr(tower_train.keras, "fit", spied_ours)
    (result,) = measure_keras_epochs(rounds=1, epochs=2)
    assert seen == [("keras", 2), ("tower_train", 2)] and result.accum == 2
    assert format_keras_report([result]).splitlines()[1].split()[:4] == ["tiny_k2", "16", "2", "64"]
