"""--measure=keras: seconds per epoch of `tower_train.keras.fit(..., num_gpus=1)` against Keras's
own `model.fit`, on the same compiled model, data and batch: what a Keras user compares first.

Two models, the issue's: a small LSTM classifier (Embedding(500, 32), LSTM(32), Dense(2),
`accuracy`, b = 64, 2,048 sequences of 40 tokens) and a dense regressor (128-128-1, `mae`,
b = 128, 8,192 examples), both under Adam with `shuffle=False`; and the dense regressor again
in updates of K = 8 micro-batches of 16 (`dense_k8`: `accum=8` against Keras's
`gradient_accumulation_steps=8`), where Python's cost per micro-step shows. Each try trains a fresh copy
from the same initial weights for EPOCHS epochs and times every epoch but the first
(tracing); the tries alternate between the two trainers, --rounds times, and the report takes
each trainer's best epoch, since on a shared machine the other jobs only ever add time.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable

import numpy as np

SEED = 7
EPOCHS = 3  # the first traces; two are timed per try


@dataclasses.dataclass(frozen=True)
class KerasEpochs:
    model: str
    batch_size: int
    examples: int
    keras_seconds: list[float]  # every timed epoch of every try, in order
    tower_train_seconds: list[float]
    accum: int = 1  # micro-batches of batch_size per update

    @property
    def ratio(self) -> float:
        """tower-train's best epoch over Keras's: <= 1.15 is the goal (docs/performance.md)."""
        return min(self.tower_train_seconds) / min(self.keras_seconds)


def _lstm():
    import keras

    model = keras.Sequential([keras.Input((40,), dtype="int32"), keras.layers.Embedding(500, 32),
                              keras.layers.LSTM(32), keras.layers.Dense(2, activation="softmax")])
    rng = np.random.default_rng(SEED)
    x = rng.integers(0, 500, (2048, 40)).astype(np.int32)
    return model, x, (x[:, 0] % 2).astype(np.int32), "sparse_categorical_crossentropy", "accuracy", 64


def _dense():
    import keras

    model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(128, activation="relu"),
                              keras.layers.Dense(128, activation="relu"), keras.layers.Dense(1)])
    rng = np.random.default_rng(SEED)
    x = rng.normal(size=(8192, 32)).astype(np.float32)
    return model, x, x[:, :4].sum(axis=1, keepdims=True), "mse", "mae", 128


def _dense_k8():
    return (*_dense()[:5], 16)


MODELS: dict[str, Callable] = {"lstm": _lstm, "dense": _dense, "dense_k8": _dense_k8}
ACCUM = {"dense_k8": 8}  # micro-batches per update; 1 for the others


def _timed_epochs(train: Callable[[list], object]) -> list[float]:
    """The seconds of every epoch of `train(callbacks)` but the first."""
    import keras

    class EpochClock(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.seconds: list[float] = []

        def on_epoch_begin(self, epoch, logs=None):
            self.started = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            self.seconds.append(time.perf_counter() - self.started)

    clock = EpochClock()
    train([clock])
    return clock.seconds[1:]


def measure_keras_epochs(rounds: int, epochs: int = EPOCHS) -> list[KerasEpochs]:
    """Each model of MODELS, Keras's fit and tower-train's alternating `rounds` times."""
    import keras

    import tower_train.keras

    tower_train.create_devices(num_gpus=1)  # before the first model, which starts TensorFlow
    results = []
    for name, make in MODELS.items():
        keras.utils.set_random_seed(SEED)
        network, x, y, loss, metric, batch_size = make()
        initial, accum = network.get_weights(), ACCUM.get(name, 1)

        def fresh(keras_accumulates: bool):
            model = keras.models.clone_model(network)
            model.set_weights(initial)
            steps = accum if keras_accumulates and accum > 1 else None
            model.compile(optimizer=keras.optimizers.Adam(1e-3, gradient_accumulation_steps=steps),
                          loss=loss, metrics=[metric])
            return model

        own, ours = [], []
        for _ in range(rounds):
            own += _timed_epochs(lambda callbacks: fresh(True).fit(
                x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0,
                callbacks=callbacks))
            ours += _timed_epochs(lambda callbacks: tower_train.keras.fit(
                fresh(False), x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0,
                callbacks=callbacks, num_gpus=1, accum=accum))
        results.append(KerasEpochs(name, batch_size, len(x), own, ours, accum))
    return results


def format_keras_report(results: list[KerasEpochs]) -> str:
    lines = [f"{'model':<8} {'b':>4} {'K':>2} {'examples':>8} {'keras s/epoch':>14} "
             f"{'tower_train s/epoch':>20} {'ratio':>6}  (best epoch after the first; goal <= 1.15)"]
    for r in results:
        lines.append(f"{r.model:<8} {r.batch_size:>4} {r.accum:>2} {r.examples:>8} "
                     f"{min(r.keras_seconds):>14.3f} {min(r.tower_train_seconds):>20.3f} {r.ratio:>6.2f}")
    return "\n".join(lines)
