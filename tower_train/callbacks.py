"""The user's `keras.callbacks.Callback` objects (`fit(callbacks=[...])`), told of a run as
Keras's `fit` tells them, with an update in the place of a batch and a held-out evaluation in the
place of an epoch:

- `on_train_begin` before the first update, `on_train_end` after the last evaluation;
- `on_train_batch_begin(step)` before each update is computed (`step` is the number it gets
  once applied), `on_train_batch_end(step, {"loss", "learning_rate"})` after it is applied;
- `on_epoch_end(step, {"val_precision", ...})` after each held-out evaluation: every `val_`
  quantity the evaluation recorded in `TrainResult.history`, at the update it followed.

`model.stop_training = True` asks the Controller to stop at the update boundary, saved. An
error in a callback is the user's: one line naming its file:line (`user_code.call_user_code`).
"""
from __future__ import annotations

from typing import Sequence

import keras
import numpy as np

from tower_train.errors import UsageError
from tower_train.progress import learning_rate
from tower_train.user_code import call_user_code


def check_callbacks(callbacks: object) -> list[keras.callbacks.Callback]:
    """`fit`'s `callbacks=` (given, not None) as a list.

    Raises:
      UsageError: it is no list or tuple of keras.callbacks.Callback objects.
    """
    if not isinstance(callbacks, (list, tuple)):
        raise UsageError(f"callbacks={type(callbacks).__name__}: expected a list of "
                         "keras.callbacks.Callback objects")
    for index, callback in enumerate(callbacks):
        if not isinstance(callback, keras.callbacks.Callback):
            raise UsageError(f"callbacks[{index}]={callback!r}: not a keras.callbacks.Callback (a "
                             "class must be instantiated: keras.callbacks.TerminateOnNaN())")
    return list(callbacks)


class KerasCallbacks:
    """The callbacks, on `model` (the network `TrainResult.model` is, or for a Keras instance
    the clone the run trains), reading the held-out evaluations from `history`."""

    def __init__(self, callbacks: Sequence[keras.callbacks.Callback], model: keras.Model,
                 history: dict[str, list[float]]):
        self._callbacks, self._model, self._history = list(callbacks), model, history
        self._evaluations_told = len(history["val_step"])
        self.stopped_by: str | None = None  # the callback that set model.stop_training first
        self.weights_written_by: str | None = None
        for callback in self._callbacks:
            callback.set_model(model)

    @property
    def stop_asked(self) -> bool:
        return bool(self._model.stop_training)

    def train_begin(self) -> None:
        self._model.stop_training = False
        self._call("on_train_begin")

    def update_begin(self, step: int) -> None:
        self._call("on_train_batch_begin", step)

    def after_update(self, event) -> None:
        """`event`: the `tower_train.trainer.UpdateEvent` of an applied update, after the other
        hooks (the evaluation among them) have run."""
        self._call("on_train_batch_end", event.step,
                   {"loss": event.loss, "learning_rate": learning_rate(event.state.optimizer)})
        self._tell_evaluations()

    def train_end(self) -> None:
        """Tells the last evaluation and the end; `weights_written_by` names the first callback
        whose on_train_end set the network's weights (EarlyStopping restoring its best)."""
        self._tell_evaluations()  # the one at the end of training
        for callback in self._callbacks:
            before = self._model.get_weights()
            self._call_one(callback, "on_train_end")
            if self.weights_written_by is None and not all(
                    np.array_equal(a, b) for a, b in zip(before, self._model.get_weights(), strict=True)):
                self.weights_written_by = f"callback {type(callback).__name__}.on_train_end"

    def _tell_evaluations(self) -> None:
        history = self._history
        names = [key for key in history if key.startswith("val_") and key != "val_step"]
        while self._evaluations_told < len(history["val_step"]):
            index = self._evaluations_told
            self._evaluations_told += 1
            self._call("on_epoch_end", history["val_step"][index],
                       {name: history[name][index] for name in names})

    def _call(self, method: str, *args) -> None:
        for callback in self._callbacks:
            self._call_one(callback, method, *args)

    def _call_one(self, callback: keras.callbacks.Callback, method: str, *args) -> None:
        name = f"callback {type(callback).__name__}.{method}"
        call_user_code(lambda: getattr(callback, method)(*args), name)
        if self.stopped_by is None and self._model.stop_training:
            self.stopped_by = name
