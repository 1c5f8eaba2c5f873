"""What the Controller (controller.py) tells its hooks of a run, and `Hook`, their base.

In order, every hook hears: `train_begin()`; for each update `update_begin(step)` before it is
computed (`step`: the number it gets once applied, and the update before it, which may still be
in flight, too) and `after_update(event)` once it is applied;
`after_evaluation(step, held_out)` after each held-out evaluation, whose values (by their Keras
names: val_precision, val_loss, val_<metric>) come from the hook that evaluated
(`evaluation.held_out.EvaluationHook`, whose `after_update` returns them) or from training's final
evaluation; and `train_end()` last. `close()` comes when the loop ends, before training's final
evaluation (`train.train` calls it). The hooks are `progress.Progress` (log, TensorBoard,
`TrainResult.history`), `evaluation.held_out.EvaluationHook` and `keras_callbacks.KerasCallbacks` (the user's
Keras callbacks, the one hook that runs the user's code and may stop the run).
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, ClassVar, Mapping

if TYPE_CHECKING:
    from tower_train.training.run import TrainState


@dataclasses.dataclass(frozen=True)
class UpdateEvent:
    """One applied update, as the hooks see it."""

    step: int
    loss: float
    seconds: float  # wall time of the update; the first one of a process includes tracing
    state: TrainState


class Hook:
    """Told of a run by the Controller (the module docstring); each method does nothing here."""

    # Whether it calls the user's code, which may read and write the training state and ask to
    # stop (`stop_asked`): the Controller makes the state current around its calls and, when
    # one raises, saves the training up to the update boundary first.
    user_code: ClassVar[bool] = False

    def train_begin(self) -> None:
        pass

    def update_begin(self, step: int) -> None:
        pass

    def after_update(self, event: UpdateEvent) -> Mapping[str, float] | None:
        """Returns the held-out values of an evaluation it made after the update, else None."""
        return None

    def reads_state(self, step: int) -> bool:
        """Whether `after_update` of update `step` reads the training state (or needs to be told
        before the next update runs): then the Controller reads that update's result before it
        queues the next. A hook that says nothing is taken to read it."""
        return True

    def after_evaluation(self, step: int, held_out: Mapping[str, float]) -> None:
        pass

    def stop_asked(self) -> str | None:
        """Who asks to stop the run at this update boundary (saved); None: no one."""
        return None

    def stops_at_nonfinite(self) -> str | None:
        """Who stops the run, saved and without an error, at a non-finite update that
        --nonfinite=stop refuses (Keras's TerminateOnNaN); None: no one, the run fails."""
        return None

    def train_end(self) -> None:
        pass

    def close(self) -> None:
        pass
