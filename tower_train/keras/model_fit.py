"""`tower_train.keras.fit(model, ...)`: Keras's `Model.fit`, with its arguments and their meanings,
trained by `tower_train.fit` on towers with gradient accumulation.

    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="binary_crossentropy",
                  metrics=["accuracy"])
    history = tower_train.keras.fit(model, x, y, batch_size=64, epochs=3, validation_split=0.2,
                                    class_weight={0: 1.0, 1: 4.0}, num_gpus=2, accum=2)

It is a translation, not a second trainer: Keras's arguments become `tower_train.fit`'s data
(an `ArraySource` of targets), loss, optimizer object and options, and one Keras callback of its
own (`_KerasFitLoop`) turns the run's updates into Keras's epochs and batches for the user's
callbacks, the History and the progress bar. docs/keras.md maps every argument:

- `batch_size` is examples per micro-step across all towers (each tower takes batch_size / N);
  an update covers G = batch_size x accum examples, as Keras's fit at batch_size x accum, and a
  step, as Keras counts it, is one update: an epoch is ceil(n / G) updates.
- The loss is the compiled loss as Keras computes it over one batch of G (one, or one per
  output with loss_weights; compiled_loss.py): sample_weight and class_weight multiply each
  example's loss, the sum is divided by the number of losses (Keras's "sum_over_batch_size"),
  the model's regularization losses are added once; or the model's own compute_loss, called on
  every tower's share (compiled_loss.py, docs/keras.md). The weights travel
  with the targets (as `(y, sample_weight)`) so that the run's weighted mean, with every example
  weighing 1, is that quotient.
- The optimizer is a copy of the compiled one (its rate or schedule, its clipping); afterwards
  the model holds the trained weights and its own optimizer holds the run's state, so that
  `evaluate`, `predict` and `save` work at once.
- Metrics are the compiled ones, computed by the model's own `compute_metrics`: inside the
  compiled update, from the outputs of every tower's training pass (compiled_loss.py), so they sum
  over the update's G examples as Keras's train step at G would, and on the validation
  data by the model's own `evaluate` at the end of each validated epoch, which tells the
  callbacks on_test_*; History's keys are Keras's (loss, the metrics' names, val_*).
- Checkpoints only when `train_dir=` is given; otherwise a temporary one, removed at the end, so
  a rerun trains afresh.
"""
from __future__ import annotations

import bisect
import itertools
import math
import warnings
from typing import Any, Callable

import keras
import numpy as np
import tensorflow as tf
from absl import logging
from keras.src.utils.python_utils import is_default  # what Keras's CallbackList asks of a callback

from tower_train import api
from tower_train.keras import temp_dir
from tower_train.data.array_source import ArraySource
from tower_train.training.keras_callbacks import check_callbacks
from tower_train.config import TrainConfig
from tower_train.errors import UsageError
from tower_train.keras.data import OUT_OF_DATA, epoch_lengths, read_dataset, split_data
from tower_train.keras.compiled_loss import CompiledLoss

# The options this module sets from Keras's arguments and compile(), and where each comes from.
_SET_HERE = {
    "max_steps": "epochs and steps_per_epoch", "eval_every": "validation_data and validation_freq",
    "optimizer": "model.compile(optimizer=...)", "learning_rate": "the compiled optimizer",
    "lr_schedule": "the compiled optimizer", "warmup_steps": "the compiled optimizer",
    "scale_lr": "the compiled optimizer", "model": "the model argument",
    "dataset": "x and y", "data_dir": "x and y", "augment": "x and y", "data_module": "x and y",
    "model_module": "the model argument", "precision": "the model's own dtype policy",
}
_VERBOSE = (0, 1, 2, "auto")
DEFAULT_BATCH_SIZE = 32  # Keras's


def fit(model: keras.Model, x: Any = None, y: Any = None, batch_size: int | None = None,
        epochs: int = 1, verbose: int | str = "auto",
        callbacks: list[keras.callbacks.Callback] | None = None, validation_split: float = 0.0,
        validation_data: Any = None, shuffle: bool = True, class_weight: dict | None = None,
        sample_weight: np.ndarray | None = None, initial_epoch: int = 0,
        steps_per_epoch: int | None = None, validation_steps: int | None = None,
        validation_batch_size: int | None = None, validation_freq: int = 1, *,
        num_gpus: int = 1, accum: int = 1, **options) -> keras.callbacks.History:
    """Trains the compiled `model` as `model.fit` with these arguments would, on `num_gpus`
    towers accumulating `accum` micro-steps per update (module docstring; docs/keras.md).

    Args:
      model: a compiled keras.Model (not a tower_train.TowerModel); it gets the trained weights.
      x, y, batch_size, epochs, verbose, callbacks, validation_split, validation_data, shuffle,
        class_weight, sample_weight, initial_epoch, steps_per_epoch, validation_steps,
        validation_batch_size, validation_freq: Keras's (x and y numpy arrays; x may be a
        dict, list or tuple of them);
        batch_size counts the examples of one micro-step across all towers.
      num_gpus, accum: the towers N and the micro-steps K of each update.
      **options: any other option of `tower_train.fit` (train_dir, mode, ps_device, seed, ...).

    Returns:
      The `keras.callbacks.History` of the epochs trained (also `model.history`).

    Raises:
      UsageError: in one line, an argument Keras would refuse or this does not take yet, or a
        model that is not compiled. TrainingError: as `tower_train.fit`.
    """
    verbose = _check_arguments(model, verbose, epochs, initial_epoch, validation_freq, shuffle,
                               options)
    callbacks = [] if callbacks is None else check_callbacks(callbacks)
    initial_epoch = _restored_epoch(model, callbacks, initial_epoch)
    epoch_examples = None  # of a dataset, read once per epoch; else the arrays' own
    if isinstance(x, (tf.data.Dataset, keras.utils.PyDataset)):
        x, y, sample_weight, batch_size, epoch_examples = read_dataset(
            x, y, sample_weight, batch_size, validation_split, max(epochs, 1), shuffle)
        shuffle = False  # each epoch's order is the one Keras's fit would have read
    batch_size = DEFAULT_BATCH_SIZE if batch_size is None else batch_size
    for name, value, least in (("batch_size", batch_size, 1), ("num_gpus", num_gpus, 0),
                               ("accum", accum, 1)):
        _whole_number(name, value, least)
    if validation_batch_size is not None:
        _whole_number("validation_batch_size", validation_batch_size, 1)
    towers = max(num_gpus, 1)
    if batch_size % towers:
        raise UsageError(f"batch_size={batch_size}: examples per micro-step across all towers, so "
                         f"it must be a multiple of num_gpus={num_gpus} (each tower takes "
                         "batch_size / num_gpus)")
    (features, targets, weights), held_out = split_data(
        x, y, sample_weight, class_weight, validation_split, validation_data)
    names = list(getattr(model, "output_names", None) or [])
    if isinstance(targets, (list, tuple)) and len(names) == len(targets) > 1:
        targets = dict(zip(names, targets))  # ArraySource takes no list of arrays in a tuple
    source = ArraySource(features, (targets, weights), shuffle=shuffle, name="arrays")
    if steps_per_epoch is not None:
        _whole_number("steps_per_epoch", steps_per_epoch, 1)
    # One pass of the data, in updates of G examples: Keras's batches at batch_size x accum.
    batches = math.ceil((epoch_examples or source.train_size) / (batch_size * accum))
    per_epoch = batches if steps_per_epoch is None else steps_per_epoch
    # Every epoch from 0: a run that starts at initial_epoch (or a BackupAndRestore's) reads the
    # data and draws the seeds there as the uninterrupted run did.
    lengths = epoch_lengths(steps_per_epoch, batches, epochs)
    loss = CompiledLoss(model, *tf.nest.map_structure(lambda a: a[:1], (features, targets)),
                        weighted=sample_weight is not None or class_weight is not None)
    loop = _KerasFitLoop(model, callbacks, verbose, epochs, initial_epoch, per_epoch, lengths, held_out,
                         validation_freq, validation_steps, validation_batch_size or batch_size,
                         loss.tracks_metrics)
    if epochs <= initial_epoch:  # as Keras: nothing to train
        loop.list.on_train_begin()
        loop.list.on_train_end()
        return loop.history
    _warn_differences(model, towers, accum, options)
    given_dir = options.pop("train_dir", None)
    train_dir = given_dir if given_dir is not None else temp_dir.make("tower_train_keras_")
    options.setdefault("ema_decay", 0.0)  # Keras keeps no moving average
    # compile()'s jit_compile, as Keras decided it ("auto": on where a GPU computes, as here).
    options.setdefault("jit_compile", bool(model.jit_compile))
    options.setdefault("sparse_steps", True)  # an Embedding's rows per occurrence, as Keras steps them
    options.setdefault("bn_statistics", "per_update")  # BN's moving statistics as Keras's fit at G moves them
    # A log line and TensorBoard point at each epoch's end, where Keras's fit reports: one every
    # 10 updates read the state and wrote summaries between Keras's reads (20% of a small
    # model's epoch, docs/performance.md).
    options.setdefault("log_every", per_epoch)
    if given_dir is None:  # nothing resumes from it: only the save at the end, which is required
        options.setdefault("checkpoint_every", sum(lengths))  # the last update's
    try:
        # Tower mode trains the model itself, wherever Keras made its weights, as Keras's fit
        # does (a model whose layers Keras cannot remake from their config trains too); a
        # strategy must make its own copy of the weights, so it trains a clone.
        in_place = options.get("mode", TrainConfig.mode) == TrainConfig.mode
        if isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer):
            # mixed_float16's: the run scales the loss itself, once per update (precision fp16),
            # with the policy of Keras's LossScaleOptimizer, which would count micro-steps.
            options["precision"] = "fp16"
        # The checkpoint holds the model with its compiled optimizer, unbuilt in a fresh model:
        # an unbuilt copy stands in for it while the run trains, so that a model whose optimizer
        # was built (loaded, fit before, restored by BackupAndRestore) resumes the train_dir.
        model.optimizer = type(loop.own_optimizer).from_config(loop.own_optimizer.get_config())
        api.fit(model=_returning(model) if in_place else model, loss=loss,
                optimizer=_stepping(loop.own_optimizer), data=source, callbacks=[loop],
                show_progress=False,
                num_gpus=num_gpus, accum=accum, batch_size=batch_size // towers,
                max_steps=sum(lengths), initial_step=sum(lengths[:initial_epoch]),
                train_dir=train_dir, **options)
    finally:
        # compile()'s optimizer goes back, tracked again, where the run gave the trained network
        # its own (training/controller.py) and the copy stood in.
        model.optimizer = loop.own_optimizer
        if given_dir is None:
            temp_dir.remove(train_dir)
    loop.hand_back_optimizer()
    return loop.history


def _check_arguments(model, verbose, epochs, initial_epoch, validation_freq, shuffle,
                     options: dict) -> int:
    """The checks that need no data; returns verbose as 0, 1 or 2."""
    from tower_train.models import TowerModel

    if not isinstance(model, keras.Model) or isinstance(model, TowerModel):
        raise UsageError(f"model={type(model).__name__}: tower_train.keras.fit takes a compiled "
                         "keras.Model (for a tower_train.TowerModel use tower_train.fit)")
    own = type(model)
    if own.train_step is not keras.Model.train_step:
        raise UsageError(f"model {model.name}: {own.__module__}.{own.__qualname__}.train_step is "
                         "never called by tower_train.keras.fit, which runs its own update over "
                         "towers and micro-steps; override compute_loss(self, x, y, y_pred, "
                         "sample_weight, training) instead, which it calls on every tower "
                         "(docs/keras.md), or train with Keras's own fit")
    own_loss = own.compute_loss is not keras.Model.compute_loss
    if not getattr(model, "compiled", False) or (model.loss is None and not own_loss):
        raise UsageError(f"model {model.name}: is not compiled with a loss; call model.compile("
                         "optimizer=..., loss=...) first, as for model.fit")
    mode = options.get("mode", TrainConfig.mode)
    if own_loss and mode != TrainConfig.mode:
        # A strategy trains a clone, and Keras's losses divide by its replicas in replica context.
        raise UsageError(f"mode={mode!r}: {own.__module__}.{own.__qualname__} overrides "
                         f"compute_loss, which tower_train.keras.fit calls in mode="
                         f"{TrainConfig.mode!r} (the default) only")
    for name in options:
        if name in _SET_HERE:
            raise UsageError(f"{name}=: tower_train.keras.fit sets it from {_SET_HERE[name]}; "
                             "leave it out")
    if verbose not in _VERBOSE or isinstance(verbose, bool):
        raise UsageError(f"verbose={verbose!r}: must be 0, 1, 2 or 'auto', as for model.fit")
    for name, value, least in (("epochs", epochs, 0), ("initial_epoch", initial_epoch, 0),
                               ("validation_freq", validation_freq, 1)):
        _whole_number(name, value, least)
    if not isinstance(shuffle, bool):
        raise UsageError(f"shuffle={shuffle!r}: must be True or False (tower_train.keras.fit "
                         "shuffles every epoch or not at all)")
    return 1 if verbose == "auto" else verbose


def _whole_number(name: str, value: object, least: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise UsageError(f"{name}={value!r}: must be a whole number >= {least}")


def _restored_epoch(model: keras.Model, callbacks: list, initial_epoch: int) -> int:
    """The epoch to start from: where a `keras.callbacks.BackupAndRestore` left off, else
    `initial_epoch`. Keras's fit reads it from the model after the callbacks' on_train_begin,
    which restores the weights and sets `model._initial_epoch`; the run's length depends on it,
    so here a BackupAndRestore restores before the run (and again, idempotently, when the run
    begins, into the network it trains)."""
    restoring = [callback for callback in callbacks
                 if isinstance(callback, keras.callbacks.BackupAndRestore)]
    for callback in restoring:
        callback.set_model(model)
        callback.on_train_begin()
    restored = getattr(model, "_initial_epoch", None)
    model._initial_epoch = None  # as Keras's fit leaves it, for a later fit
    return restored or initial_epoch


def _warn_differences(model: keras.Model, towers: int, accum: int, options: dict) -> None:
    """One line for each way the result will differ from Keras's fit at batch_size x accum."""
    if (towers != 1 or accum != 1) and not options.get("sync_bn"):
        normalizing = [layer.name for layer in model._flatten_layers()  # every nested layer
                       if isinstance(layer, keras.layers.BatchNormalization)]
        if normalizing:
            logging.warning("tower_train.keras.fit: %s normalizes each tower's micro-batch of "
                            "batch_size / num_gpus examples, not the update's batch_size x accum "
                            "as Keras's fit would (docs/batchnorm.md)", ", ".join(normalizing))


def _returning(model: keras.Model) -> Callable[[], keras.Model]:
    """A function that returns `model`, named as its class, so that the run's messages name the
    user's model (model=module.Class) rather than a function of this module."""
    def returning() -> keras.Model:
        return model

    returning.__module__, returning.__qualname__ = type(model).__module__, type(model).__qualname__
    return returning


def _stepping(optimizer: keras.optimizers.Optimizer) -> keras.optimizers.Optimizer:
    """The optimizer that steps the weights: a LossScaleOptimizer's inner one (the run scales
    the loss itself), else `optimizer`."""
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return optimizer.inner_optimizer
    return optimizer


def _copy_state(values: list[np.ndarray], optimizer: keras.optimizers.Optimizer) -> None:
    """`values`, the variables of an optimizer of the same class and config built on the same
    weights, into `optimizer`'s."""
    if len(optimizer.variables) != len(values):
        raise UsageError(f"optimizer {optimizer.name}: holds {len(optimizer.variables)} variables "
                         f"where its copy holds {len(values)}; the state cannot be copied")
    for variable, value in zip(optimizer.variables, values, strict=True):
        variable.assign(value)


class _KerasFitLoop(keras.callbacks.Callback):
    """The one callback `tower_train.fit` is given: it tells the user's callbacks, the History and
    Keras's progress bar (a `keras.callbacks.CallbackList`) of epochs and batches as Keras's fit
    does, an update being one step, reads the compiled metrics and runs the validation.

    Its model (`set_model`) is the network the run trains (the user's model itself in tower
    mode, a clone under a strategy), whose `optimizer` is the run's while it trains; the user's
    callbacks see that network. The user's own model keeps the metrics, which the update moves.
    """

    def __init__(self, model: keras.Model, callbacks, verbose: int, epochs: int, initial_epoch: int,
                 per_epoch: int, lengths: list[int], held_out, validation_freq: int,
                 validation_steps: int | None,
                 validation_batch_size: int, tracks_metrics: bool):
        super().__init__()
        self.history = keras.callbacks.History()
        self.list = keras.callbacks.CallbackList(
            [*callbacks, self.history], add_history=False, add_progbar=verbose != 0,
            model=model, verbose=verbose, epochs=epochs, steps=per_epoch)
        self._user_model, self._per_epoch = model, per_epoch
        # The updates of each epoch from epoch 0 on (keras_data.epoch_lengths), and the
        # number of updates before each.
        self._lengths, self._before = lengths, list(itertools.accumulate(lengths, initial=0))
        self._held_out, self._validation_freq = held_out, validation_freq
        self._validation_steps, self._validation_batch_size = validation_steps, validation_batch_size
        # Updated inside the compiled update from the towers' training outputs (compiled_loss.py).
        self._tracks_metrics = tracks_metrics
        # Whether a callback reads a batch's logs (the progress bar, a user's on_train_batch_end),
        # as Keras's CallbackList tells: else the metrics are read once an epoch, not per update.
        self._batch_logs_read = any(
            not is_default(callback.on_train_batch_end) or not is_default(callback.on_batch_end)
            for callback in self.list.callbacks)
        self._loss_sum = 0.0  # of the updates of this epoch that this call applied
        self._epoch_updates: int | None = None  # those updates; None between epochs
        self._last_epoch = initial_epoch  # of the last update applied
        self._optimizer_state: list[np.ndarray] | None = None
        # compile()'s, which the run's copy stands in for as the trained network's `optimizer`.
        self.own_optimizer: keras.optimizers.Optimizer = model.optimizer

    @property
    def callbacks(self) -> list[keras.callbacks.Callback]:
        """The callbacks it tells, listed as a CallbackList lists them: the run finds a
        TerminateOnNaN of the user's among them (training/keras_callbacks.py)."""
        return self.list.callbacks

    def set_model(self, model: keras.Model) -> None:
        super().set_model(model)
        self.list.set_model(model)

    def _place(self, step: int) -> tuple[int, int]:
        """Keras's (epoch, batch) of update `step` (1-based)."""
        epoch = bisect.bisect_right(self._before, step - 1) - 1
        return epoch, step - 1 - self._before[epoch]

    def on_train_begin(self, logs=None) -> None:
        """Before the first update: a fresh run's optimizer continues the state of the model's
        own optimizer when it has trained before, as Keras's next fit would (a run resumed from
        its train_dir keeps the checkpoint's)."""
        own, run = _stepping(self.own_optimizer), self.model.optimizer
        if own.built and int(run.iterations) == 0:
            _copy_state([v.numpy() for v in own.variables], run)
        self.list.on_train_begin()

    def reads_state(self, step: int) -> bool:
        """Whether it reads the run's state after update `step` (`KerasCallbacks.reads_state`):
        after every update where a callback reads batch logs, else at each epoch's end (its
        metrics, validation and on_epoch_end). Between, the run queues the next update first."""
        epoch, batch = self._place(step)
        return self._batch_logs_read or batch == self._lengths[epoch] - 1

    def on_train_batch_begin(self, step: int, logs=None) -> None:
        epoch, batch = self._place(step)
        if self._epoch_updates is None:  # its first update, or the first after resuming in it
            self._loss_sum, self._epoch_updates = 0.0, 0
            self._user_model.reset_metrics()
            self.list.on_epoch_begin(epoch)
        self.list.on_train_batch_begin(batch)

    def on_train_batch_end(self, step: int, logs=None) -> None:
        epoch, batch = self._place(step)
        self._last_epoch = epoch
        self._loss_sum += logs["loss"]
        self._epoch_updates += 1
        self.list.on_train_batch_end(batch, self._epoch_logs() if self._batch_logs_read else {})
        if batch == self._lengths[epoch] - 1:
            if batch < self._per_epoch - 1:  # the data ran out before steps_per_epoch
                warnings.warn(OUT_OF_DATA, stacklevel=2)
            self._end_epoch(epoch)

    def _epoch_logs(self) -> dict[str, float]:
        """The epoch's logs so far: its compiled metrics and its mean loss."""
        return {**self._metrics(), "loss": self._loss_sum / self._epoch_updates}

    def _end_epoch(self, epoch: int) -> None:
        """The epoch's end, validated when due, as Keras's fit ends it."""
        logs = self._epoch_logs()
        self._epoch_updates = None
        if self._held_out is not None and (epoch + 1) % self._validation_freq == 0:
            logs.update(self._validate())
        self.list.on_epoch_end(epoch, logs)

    def on_train_end(self, logs=None) -> None:
        if self._epoch_updates:  # a callback stopped the run within an epoch: Keras's fit ends it
            self._end_epoch(self._last_epoch)
        self._optimizer_state = [v.numpy() for v in self.model.optimizer.variables]
        self.list.on_train_end()

    def _metrics(self) -> dict[str, float]:
        if not self._tracks_metrics:
            return {}
        return {name: float(value) for name, value in self._user_model.get_metrics_result().items()
                if name != "loss"}

    def _validate(self) -> dict[str, float]:
        """The user's model, given the current weights, evaluated on the held-out data as Keras's
        fit evaluates it (after the epoch's training metrics were read: it resets them)."""
        self._user_model.set_weights(self.model.get_weights())
        held_x, held_y, held_weights = self._held_out
        # The callbacks hear on_test_begin, on_test_batch_* and on_test_end(logs) from it, as
        # from Keras's fit, which hands evaluate its CallbackList.
        results = self._user_model.evaluate(
            held_x, held_y, sample_weight=held_weights, batch_size=None if isinstance(
                held_x, tf.data.Dataset) else self._validation_batch_size,
            steps=self._validation_steps, callbacks=self.list, return_dict=True)
        return {f"val_{name}": float(value) for name, value in results.items()}

    def hand_back_optimizer(self) -> None:
        """The user's optimizer built on the model's weights and given the run's state."""
        if self._optimizer_state is None:
            return
        optimizer = self.own_optimizer
        if not optimizer.built:
            optimizer.build(self._user_model.trainable_variables)
        _copy_state(self._optimizer_state, _stepping(optimizer))
        self._user_model.history = self.history
        self.history.set_model(self._user_model)
