"""`tower_train.fit`: train any TowerModel or Keras model on any data source, from a script or the
command line.

    import tower_train
    result = tower_train.fit(model=MyNet, data=tower_train.ArraySource(x, y, eval_features=xe,
                             eval_labels=ye), train_dir="/tmp/run", num_gpus=4, accum=8)
    result = tower_train.fit(model=keras_model, loss="sparse_categorical_crossentropy",
                             data=(x, y), eval_data=(xe, ye), train_dir="/tmp/run2")

Every training option is a keyword with the flag's name and default (the fields
of `TrainConfig`). Everything is checked once, in order of cost, by the start-up
every command goes through (`tower_train.startup.start`): the options, the
train_dir and export_dir, the data set's name and files, the model's name, the
devices; then the strategy is created (before any other TensorFlow op, as a
multi-worker strategy needs), the data loaded and checked, and the model built
and checked against it. Bad input raises UsageError with the one-line message
the CLI prints; nothing is printed and nothing exits.
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import Iterator

from tower_train import startup
from tower_train.workers import peer_watchdog
from tower_train.config import TrainConfig
from tower_train.errors import TrainingError, UsageError

# The options that make the rate of --optimizer's optimizer; an optimizer object has its own.
_RATE_OPTIONS = ("learning_rate", "lr_schedule", "warmup_steps", "scale_lr")
# The num_gpus of this process's last create_devices call, which a fit on fewer towers leaves idle.
_created_num_gpus: int | None = None


def optimizer_object(options: dict) -> object:
    """The `optimizer` option when it is an object (a Keras optimizer, checked by
    `model_spec.resolve_model`), taken out of `options`; None when it names one of --optimizer's.

    Raises:
      UsageError: an option that sets --optimizer's learning rate given beside an object.
    """
    if isinstance(options.get("optimizer", ""), str):
        return None
    optimizer = options.pop("optimizer")
    given = [name for name in _RATE_OPTIONS if name in options]
    if given:
        raise UsageError(f"{given[0]}=: is for --optimizer's rate; optimizer={type(optimizer).__name__} "
                         "has its own (give the object its learning rate or schedule)")
    return optimizer


def create_devices(**options) -> None:
    """Creates the logical devices that `fit` with these options trains on, now.

    With fewer GPUs than `num_gpus`, `fit` splits a GPU or the CPU into logical devices, which
    TensorFlow allows only before its runtime starts; making a Keras model starts it. Call this
    first, with fit's options, then make the model: fit finds the devices there.

    Raises:
      UsageError: an unknown or bad option, or devices the runtime, already started, lacks.
    """
    global _created_num_gpus
    config = startup.make_config(options)
    startup.prepare_devices(config)
    _created_num_gpus = config.num_gpus


def _warn_unused_devices(config: TrainConfig) -> None:
    """One line when create_devices made towers for another num_gpus than this fit's: a fit
    without num_gpus= trains one tower, whatever create_devices made."""
    from absl import logging as absl_logging

    if _created_num_gpus is not None and _created_num_gpus != config.num_gpus:
        absl_logging.warning("fit: trains on num_gpus=%d, where create_devices made the devices "
                             "for num_gpus=%d; pass num_gpus=%d to fit to train on them",
                             config.num_gpus, _created_num_gpus, _created_num_gpus)


def fit(model: object = None, data: object = None, *, num_classes: int | None = None,
        loss: object = None, eval_data: tuple | None = None, shuffle: bool | None = None,
        callbacks: list | None = None, metrics: list | None = None, stop=None,
        watchdog: peer_watchdog.PeerClock | None = None, show_progress: bool = True,
        initial_step: int = 0, **options):
    """Trains `model` on `data` until --max_steps updates, resuming from train_dir.

    Args:
      model: None (the `model` option's registered name, by default cifar10_cnn), a registered
        name, a `tower_train.TowerModel` subclass, or a zero-argument callable returning one;
        or any other `keras.Model` (Sequential, functional or subclassed; cloned, see
        docs/models.md), or a zero-argument callable returning one, with `loss`.
      data: None (the `dataset` option), a registered data set name, a source such as
        `tower_train.ArraySource` or `tower_train.DatasetSource` (a tf.data pipeline), or numpy
        arrays (x, y) or (x, y, w), which stand for
        `ArraySource(x, y, w, *eval_data, shuffle=shuffle, num_classes=num_classes)`.
      num_classes: passed to a model class (else it is called without it); a registered name
        is made with this or the source's number of classes; with arrays, the ArraySource's.
      loss: required for a keras.Model that is not a TowerModel, refused for a TowerModel: a
        Keras loss name, a `keras.losses.Loss` (used with reduction none), or a callable
        (labels, outputs) -> one loss per label.
      eval_data: with data=(x, y[, w]), the held-out arrays (x, y) or (x, y, w).
      shuffle: with data=(x, y[, w]), the ArraySource's shuffle (default True).
      callbacks: a list of `keras.callbacks.Callback` objects, told of each update and held-out
        evaluation; `model.stop_training = True` stops the run at the update boundary, saved
        (docs/models.md#keras-callbacks).
      metrics: Keras metric names ("sparse_top_k_categorical_accuracy") or `keras.metrics.Metric`
        objects, computed at every held-out evaluation over every held-out example once, beside
        precision @ 1 and the held-out loss (docs/models.md#held-out-metrics).
      stop: a `tower_train.training.stop_signals.StopSignals` to stop at an update boundary on SIGTERM,
        SIGINT or SIGHUP, SIGHUP only where it is not ignored (nohup); the CLI passes one. None
        leaves signals alone.
      watchdog: told of progress and of local work (the CLI's multi-worker `PeerWatchdog`).
      show_progress: True: a live line when stderr is a terminal, and the run's log lines (the
        start, "resumed from", a progress line every log_every updates when stderr is no
        terminal, the end) shown even where the logging set-up would drop them (`log_shown`).
        False: neither, for a caller that shows its own (`tower_train.keras.fit` prints Keras's);
        the lines then go where the logging set-up sends them.
      initial_step: where a run whose train_dir holds no checkpoint starts, as if it had
        trained that many updates: its step count, its place in the data stream and its seeds
        continue from there as an uninterrupted run's would (`tower_train.keras.fit` passes its
        initial_epoch's first update).
      **options: every training option, by its flag's name (see `TrainConfig`); `optimizer`
        may also be a `keras.optimizers.Optimizer` object (a copy of it trains, with its own
        rate or schedule and clipping: the learning-rate options are then refused).

    Returns:
      A `tower_train.training.train.TrainResult`: step, loss, eval_precision, eval_loss, eval_examples,
      eval_metrics, checkpoint, model (the trained network, the user's own object) and history.

    Raises:
      UsageError: bad input, in one line (also an error a callback raises, after saving).
      TrainingError: training cannot go on (a non-finite update under --nonfinite=stop, a lost
      peer). Stopped: a stop signal, after saving.
    """
    optimizer = optimizer_object(options)
    if callbacks is not None:
        from tower_train.training.keras_callbacks import check_callbacks

        callbacks = check_callbacks(callbacks)
    if metrics is not None:
        from tower_train.training.evaluation.held_out import check_metrics

        metrics = check_metrics(metrics)
    shown = log_shown() if show_progress else contextlib.nullcontext()
    with shown, startup.start(startup.FIT, options, model, data, eval_data=eval_data,
                              shuffle=shuffle, num_classes=num_classes, loss=loss,
                              optimizer=optimizer, watchdog=watchdog) as run:
        _warn_unused_devices(run.config)
        return _train(run, callbacks or [], metrics or [], stop, watchdog or peer_watchdog.PeerClock(),
                      show_progress and sys.stderr.isatty(), initial_step)


@contextlib.contextmanager
def log_shown() -> Iterator[None]:
    """absl's logger, which the run logs to, at INFO while in the block when it would drop INFO
    lines (a script's default: WARNING), its level restored afterwards. A script whose stderr is
    a log file, a CI log or a notebook then gets the run's lines as the command line's log does,
    through absl's handler or, where logging has none, the stderr handler that absl's first line
    sets up. A level set above INFO is raised too: TensorFlow sets WARNING after saving a
    SavedModel, which cannot be told from a user's choice (show_progress=False keeps it).
    TensorFlow's own lines below the level it had (its "Sharding callback duration" at every
    checkpoint) stay dropped: only the run's are meant to show."""
    from absl import logging as absl_logging

    logger = absl_logging.get_absl_logger()
    if logger.isEnabledFor(logging.INFO):  # the CLI's INFO, or a lower level
        yield
        return
    level = logger.getEffectiveLevel()
    set_level = logger.level

    def not_tensorflows(record: logging.LogRecord) -> bool:
        return record.levelno >= level or f"{os.sep}tensorflow{os.sep}" not in record.pathname

    logger.setLevel(logging.INFO)
    logger.addFilter(not_tensorflows)
    try:
        yield
    finally:
        logger.removeFilter(not_tensorflows)
        logger.setLevel(set_level)


def _train(run: startup.Started, callbacks: list, metrics: list, stop,
           watchdog: peer_watchdog.PeerClock, live_progress: bool, initial_step: int = 0):
    """`fit` once the run is started: its train_dir locked, its checks passed."""
    import tensorflow as tf

    from tower_train.training.train import train
    from tower_train.training.evaluation.held_out import make_metrics

    with watchdog.local_work():
        metrics = make_metrics(metrics)
    try:
        return train(run.config, run.spec, run.source, run.mode, watchdog, stop,
                     live_progress=live_progress, callbacks=callbacks, metrics=metrics,
                     initial_step=initial_step)
    except (tf.errors.UnavailableError, tf.errors.DeadlineExceededError,
            tf.errors.CancelledError, tf.errors.AbortedError) as e:
        if run.worker.count == 1:
            raise
        raise TrainingError(f"[{run.worker.name}] a collective failed ({type(e).__name__}): "
                            f"{peer_watchdog.peer_trouble(run.worker)}") from None
