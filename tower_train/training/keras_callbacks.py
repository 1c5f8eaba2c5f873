"""The user's `keras.callbacks.Callback` objects (`fit(callbacks=[...])`), told of a run as
Keras's `fit` tells them, with an update in the place of a batch and a held-out evaluation in the
place of an epoch:

- `on_train_begin` before the first update, `on_train_end` after the last evaluation;
- `on_train_batch_begin(step)` before each update is computed (`step` is the number it gets
  once applied), `on_train_batch_end(step, {"loss", "learning_rate"})` after it is applied;
- `on_epoch_end(step, {"val_precision", ...})` after each held-out evaluation: the held-out
  values the Controller tells its hooks (hooks.py), as in `TrainResult.history`, at the update
  it followed.

`model.stop_training = True` asks the Controller to stop at the update boundary, saved. A
`keras.callbacks.TerminateOnNaN` never hears of a non-finite loss, whose update is refused before
its end is told; under --nonfinite=stop it stops the run there instead, as Keras's fit stops at
that loss and returns (`stops_at_nonfinite`). An error in a callback is the user's: one line
naming its file:line (`user_code.call_user_code`).
"""
from __future__ import annotations

from typing import Mapping, Sequence

import keras
from keras.src.utils.python_utils import is_default  # what Keras's CallbackList asks of a callback
import numpy as np

from tower_train.errors import UsageError
from tower_train.training.hooks import Hook, UpdateEvent
from tower_train.training.progress import learning_rate
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


class KerasCallbacks(Hook):
    """The callbacks as a Controller hook, on `model` (the network `TrainResult.model` is, or
    for a Keras instance the clone the run trains)."""

    user_code = True

    def __init__(self, *, callbacks: Sequence[keras.callbacks.Callback], model: keras.Model):
        self._callbacks, self._model = list(callbacks), model
        self._stopped_by: str | None = None  # the callback that set model.stop_training first
        self.weights_written_by: str | None = None
        for callback in self._callbacks:
            callback.set_model(model)
        # What `reads_state` asks, sorted once: it is asked before every update.
        self._saying = [callback for callback in self._callbacks if hasattr(callback, "reads_state")]
        self._batch_hooks = any(not (is_default(callback.on_train_batch_end) and is_default(callback.on_batch_end))
                                for callback in self._callbacks if not hasattr(callback, "reads_state"))

    def stop_asked(self) -> str | None:
        return self._stopped_by if self._model.stop_training else None

    def stops_at_nonfinite(self) -> str | None:
        terminating = _terminate_on_nan(self._callbacks)
        return None if terminating is None else f"callback {type(terminating).__name__}"

    def train_begin(self) -> None:
        self._model.stop_training = False
        self._call("on_train_begin")

    def update_begin(self, step: int) -> None:
        self._call("on_train_batch_begin", step)

    def reads_state(self, step: int) -> bool:
        """Whether a callback is told anything after update `step` that reads the state: one
        with batch-end hooks after every update; `tower_train.keras.fit`'s loop says when (its
        `reads_state`). The others are told epochs at evaluations, which read it anyway."""
        return self._batch_hooks or any(callback.reads_state(step) for callback in self._saying)

    def after_update(self, event: UpdateEvent) -> None:
        logs = {"loss": event.loss}
        if self.reads_state(event.step):  # else no callback reads it, and the read would wait
            logs["learning_rate"] = learning_rate(event.state.optimizer)  # on the queued update
        self._call("on_train_batch_end", event.step, logs)

    def after_evaluation(self, step: int, held_out: Mapping[str, float]) -> None:
        self._call("on_epoch_end", step, dict(held_out))

    def train_end(self) -> None:
        """`weights_written_by` names the first callback whose on_train_end set the network's
        weights (EarlyStopping restoring its best)."""
        for callback in self._callbacks:
            before = self._model.get_weights()
            self._call_one(callback, "on_train_end")
            if self.weights_written_by is None and not all(
                    np.array_equal(a, b) for a, b in zip(before, self._model.get_weights(), strict=True)):
                self.weights_written_by = f"callback {type(callback).__name__}.on_train_end"

    def _call(self, method: str, *args) -> None:
        for callback in self._callbacks:
            self._call_one(callback, method, *args)

    def _call_one(self, callback: keras.callbacks.Callback, method: str, *args) -> None:
        name = f"callback {type(callback).__name__}.{method}"
        call_user_code(lambda: getattr(callback, method)(*args), name)
        if self._stopped_by is None and self._model.stop_training:
            self._stopped_by = name


def _terminate_on_nan(callbacks: Sequence[keras.callbacks.Callback]
                      ) -> keras.callbacks.TerminateOnNaN | None:
    """The first TerminateOnNaN among `callbacks` or among those one of them tells in turn, which
    it lists in `callbacks` as a `keras.callbacks.CallbackList` does (tower_train.keras.fit's
    loop, which tells the user's)."""
    for callback in callbacks:
        if isinstance(callback, keras.callbacks.TerminateOnNaN):
            return callback
        told = getattr(callback, "callbacks", None)
        if isinstance(told, (list, tuple)) and (found := _terminate_on_nan(told)) is not None:
            return found
    return None
