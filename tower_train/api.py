"""`tower_train.fit`: train any TowerModel or Keras model on any data source, from a script or the
command line.

    import tower_train
    result = tower_train.fit(model=MyNet, data=tower_train.ArraySource(x, y, eval_features=xe,
                             eval_labels=ye), train_dir="/tmp/run", num_gpus=4, accum=8)
    result = tower_train.fit(model=keras_model, loss="sparse_categorical_crossentropy",
                             data=(x, y), eval_data=(xe, ye), train_dir="/tmp/run2")

Every training option is a keyword with the flag's name and default (the fields
of `TrainConfig`). Everything is checked here, once, in order of cost: the
options, the train_dir and export_dir, the data set's name and files, the
model's name, the devices; then the strategy is created (before any other
TensorFlow op, as a multi-worker strategy needs), the data loaded and the
model built and checked against it. Bad input raises UsageError with the
one-line message the CLI prints; nothing is printed and nothing exits.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
from typing import Iterator

from tower_train.workers import cluster
from tower_train.workers import peer_watchdog
from tower_train.config import TrainConfig, check_directories
from tower_train.errors import TrainingError, UsageError

_OPTIONS = tuple(field.name for field in dataclasses.fields(TrainConfig))
# Keras's Model.fit arguments that are no option here, and what stands for each.
_KERAS_FIT_ARGUMENTS = {
    "epochs": "max_steps counts updates", "steps_per_epoch": "max_steps counts updates",
    "initial_epoch": "a run resumes from its train_dir",
    "validation_split": "eval_data=(x, y) holds out arrays", "validation_data": "eval_data=(x, y)",
    "validation_freq": "eval_every counts updates", "validation_steps": "eval_data=(x, y)",
    "validation_batch_size": "eval_batch_size", "class_weight": "data=(x, y, w) weighs each label",
    "sample_weight": "data=(x, y, w) weighs each label", "verbose": "progress goes to the log",
    "x": "data=(x, y)", "y": "data=(x, y)",
}
# The options that make the rate of --optimizer's optimizer; an optimizer object has its own.
_RATE_OPTIONS = ("learning_rate", "lr_schedule", "warmup_steps", "scale_lr")
# The num_gpus of this process's last create_devices call, which a fit on fewer towers leaves idle.
_created_num_gpus: int | None = None


def make_config(options: dict) -> TrainConfig:
    """The options as a validated config; UsageError names an unknown one."""
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown and unknown[0] in _KERAS_FIT_ARGUMENTS:
        raise UsageError(f"fit(): {unknown[0]}= is Keras's Model.fit argument, not an option of "
                         f"tower_train.fit ({_KERAS_FIT_ARGUMENTS[unknown[0]]}); "
                         "tower_train.keras.fit(model, ...) takes Model.fit's arguments")
    if unknown:
        raise UsageError(f"fit(): unknown option {unknown[0]!r}; the options are the flags' names: "
                         f"{', '.join(_OPTIONS)}")
    return TrainConfig(**options)


def config_and_objects(model: object, data: object, options: dict) -> tuple[TrainConfig, object, object]:
    """The config of `options`, with `model` or `data` in it when they name a registered model or
    data set (then None is returned in their place), and the objects given otherwise."""
    if isinstance(model, str):
        options["model"], model = model, None
    if isinstance(data, str):
        options["dataset"], data = data, None
    return make_config(options), model, data


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
    config = make_config(options)
    prepare_devices(config)
    _created_num_gpus = config.num_gpus


def _warn_unused_devices(config: TrainConfig) -> None:
    """One line when create_devices made towers for another num_gpus than this fit's: a fit
    without num_gpus= trains one tower, whatever create_devices made."""
    from absl import logging as absl_logging

    if _created_num_gpus is not None and _created_num_gpus != config.num_gpus:
        absl_logging.warning("fit: trains on num_gpus=%d, where create_devices made the devices "
                             "for num_gpus=%d; pass num_gpus=%d to fit to train on them",
                             config.num_gpus, _created_num_gpus, _created_num_gpus)


def prepare_devices(config: TrainConfig, announce: bool = False, model: object = None) -> tuple[TrainConfig, object]:
    """Checks that the mode fits the devices and creates the logical devices.

    Returns the config with its "auto" options decided for this machine (--ps_device,
    --jit_compile, the latter also by `model`'s layers where it is a built Keras model), and
    the DevicePlan, whose line says what each "auto" chose and why. The line is logged when
    `announce`; training logs it once the model is built.
    """
    return _devices_and_reduction(config, announce, model)[:2]


def _devices_and_reduction(config: TrainConfig, announce: bool = False,
                           model: object = None) -> tuple[TrainConfig, object, str]:
    """`prepare_devices`'s config and plan, and the reduction --all_reduce resolves to on it,
    which the mode is built with."""
    from absl import logging

    from tower_train import devices
    from tower_train.step import modes
    from tower_train.numerics import tf32_note

    machine_plan = devices.plan_for_this_machine(config.num_gpus, config.ps_device, config.gpu_memory_mb)
    plan = modes.fit_plan_to_mode(config.mode, machine_plan)
    jit_compile, why = modes.resolve_jit_compile(config, plan, model)
    if why:
        plan = dataclasses.replace(plan, choices=(
            *plan.choices, f"--jit_compile=auto chose {'on' if jit_compile else 'off'}: {why}"))
    config = dataclasses.replace(config, ps_device=plan.ps_device, jit_compile=jit_compile)
    all_reduce = modes.resolve_all_reduce(config.mode, config.all_reduce, plan)
    devices.apply_device_plan(plan)
    if announce:
        logging.info("%s%s", plan.message, tf32_note(plan.tower_devices, config.tf32))
    return config, plan, all_reduce


def array_source(data: object, eval_data: object, shuffle: bool | None,
                 num_classes: int | None, model: object = None) -> object:
    """`data` as fit takes it, with `data=(x, y[, w])` and `eval_data=(x, y[, w])` numpy arrays
    made the ArraySource they stand for (`shuffle` and `num_classes` its own; by default it
    shuffles, and counts the classes from the labels). Integer labels for a `model` of one output
    unit (`_one_unit_output`) are 0/1 targets, cast to float32 as Keras's binary losses cast them:
    as class labels they would need one output per class. No TensorFlow op runs.

    Raises:
      UsageError: eval_data or shuffle without arrays, or arrays that do not fit together.
    """
    from tower_train.data.array_source import ArraySource

    if not isinstance(data, tuple):
        given = "None (a --dataset)" if data is None else type(data).__name__
        for name, value in (("eval_data", eval_data), ("shuffle", shuffle)):
            if value is not None:
                raise UsageError(f"{name}=: is for data=(x, y) or (x, y, w) numpy arrays; data="
                                 f"{given} is not (a source has its own held-out set and "
                                 "shuffling: ArraySource(eval_features=..., shuffle=...))")
        return data
    for name, value in (("data", data), ("eval_data", eval_data)):
        if value is not None and not (isinstance(value, tuple) and len(value) in (2, 3)):
            raise UsageError(f"{name}=: expected a tuple (x, y) or (x, y, w) of numpy arrays, got "
                             f"{type(value).__name__}"
                             f"{f' of {len(value)}' if isinstance(value, tuple) else ''}")
    if shuffle is not None and not isinstance(shuffle, bool):
        raise UsageError(f"shuffle={shuffle!r}: must be True or False")
    if _one_unit_output(model):
        data, eval_data = (None if arrays is None else _float_labels(arrays)
                           for arrays in (data, eval_data))
    held_out = (None, None, None) if eval_data is None else (*eval_data, None)[:3]
    return ArraySource(*(*data, None)[:3], *held_out, shuffle=True if shuffle is None else shuffle,
                       num_classes=num_classes)


def _one_unit_output(model: object) -> bool:
    """Whether `model` is a keras.Model (no TowerModel) of one output whose last dimension is 1,
    such as a 1-unit sigmoid; False where its outputs are not known before it is called."""
    keras = sys.modules.get("keras")  # a keras.Model exists only once Keras is imported
    if keras is None or not isinstance(model, keras.Model):
        return False
    from tower_train.models import TowerModel

    try:
        outputs = model.outputs  # Sequential and functional models with an Input
    except (AttributeError, ValueError):
        return False
    return (not isinstance(model, TowerModel) and isinstance(outputs, list) and len(outputs) == 1
            and outputs[0].shape[-1] == 1)


def _float_labels(arrays: tuple) -> tuple:
    """(x, y[, w]) with integer labels y as float32."""
    import numpy as np

    labels = arrays[1]
    if isinstance(labels, np.ndarray) and np.issubdtype(labels.dtype, np.integer):
        return (arrays[0], labels.astype(np.float32), *arrays[2:])
    return arrays


def check_data(config: TrainConfig, data: object) -> None:
    """The data argument and the data options, before anything is loaded."""
    from tower_train.data import source as data_module
    from tower_train.data import catalog
    from tower_train.user_code import import_user_module

    if data is None:
        if config.data_module:
            import_user_module(config.data_module, "--data_module")
        catalog.check_dataset(config.dataset, config.data_dir, config.augment)
        return
    if not isinstance(data, data_module.Source):
        hint = (" (wrap a tf.data pipeline as DatasetSource(train=lambda: ...))"
                if type(data).__module__.startswith("tensorflow") else "")
        raise UsageError(f"data={type(data).__name__}: expected a tower_train.ArraySource, "
                         "TFRecordSource, DatasetSource or another tower_train.data.source.Source, or numpy "
                         f"arrays (x, y) or (x, y, w) (or leave it out and name --dataset){hint}")
    for name in ("data_dir", "augment", "data_module"):
        if getattr(config, name) != getattr(TrainConfig, name):
            raise UsageError(f"{name}: is for a named --dataset; data={data.name} was given as a "
                             "source (augment in its preprocess)")


def check_input_memory(config: TrainConfig, source, towers: int) -> None:
    """Refuses a training or evaluation batch whose inputs alone would not fit in memory."""
    from tower_train.data import source as data_module

    available = data_module.available_memory_bytes()
    if available is None:
        return
    per_example = data_module.input_bytes_per_example(source)
    data_module.check_batch_memory(
        per_example, config.batch_size * towers, data_module.TRAIN_BATCHES_HELD,
        f"--batch_size={config.batch_size} x {towers} tower(s)", available)
    data_module.check_batch_memory(per_example, config.eval_batch_size, 2,
                                   f"--eval_batch_size={config.eval_batch_size}", available)


def fit(model: object = None, data: object = None, *, num_classes: int | None = None,
        loss: object = None, eval_data: tuple | None = None, shuffle: bool | None = None,
        callbacks: list | None = None, metrics: list | None = None, stop=None,
        watchdog: peer_watchdog.PeerClock | None = None, show_progress: bool = True, **options):
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
      **options: every training option, by its flag's name (see `TrainConfig`); `optimizer`
        may also be a `keras.optimizers.Optimizer` object (a copy of it trains, with its own
        rate or schedule and clipping: the learning-rate options are then refused).

    Returns:
      A `tower_train.training.controller.TrainResult`: step, loss, eval_precision, eval_loss, eval_examples,
      eval_metrics, checkpoint, model (the trained network, the user's own object) and history.

    Raises:
      UsageError: bad input, in one line (also an error a callback raises, after saving).
      TrainingError: training cannot go on (a non-finite update under --nonfinite=stop, a lost
      peer). Stopped: a stop signal, after saving.
    """
    optimizer = optimizer_object(options)
    config, model, data = config_and_objects(model, data, options)
    _warn_unused_devices(config)
    if callbacks is not None:
        from tower_train.training.keras_callbacks import check_callbacks

        callbacks = check_callbacks(callbacks)
    if metrics is not None:
        from tower_train.training.held_out import check_metrics

        metrics = check_metrics(metrics)
    check_directories(config)
    if isinstance(watchdog, peer_watchdog.PeerWatchdog):  # the CLI's: it read TF_CONFIG or Slurm's already
        worker = watchdog.worker
    elif config.mode_rules.workers:
        worker = cluster.this_worker(config.cluster)
    else:
        worker = cluster.SINGLE_PROCESS
    data = array_source(data, eval_data, shuffle, num_classes, model)
    check_data(config, data)
    if model is None:
        from tower_train.models import model_class

        model_class(config.model, config.model_module)  # a bad name fails before the devices
    from tower_train.training.run_record import TrainDirLock

    # The chief writes the checkpoints, so it holds the train_dir for the whole run.
    shown = log_shown() if show_progress else contextlib.nullcontext()
    with TrainDirLock(config.train_dir) if worker.is_chief else contextlib.nullcontext(), shown:
        return _fit(config, worker, model, loss, optimizer, data, num_classes, callbacks or [],
                    metrics or [], stop, watchdog or peer_watchdog.PeerClock(),
                    show_progress and sys.stderr.isatty())


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


def _fit(config: TrainConfig, worker, model, loss, optimizer, data, num_classes, callbacks,
         metrics, stop, watchdog: peer_watchdog.PeerClock, live_progress: bool):
    """`fit` once the inputs are checked and the train_dir is this run's."""
    config, plan, all_reduce = _devices_and_reduction(config, model=model)

    import tensorflow as tf

    from tower_train.data import catalog
    from tower_train.training import controller
    from tower_train.training.held_out import make_metrics
    from tower_train.model_spec import resolve_model
    from tower_train.step.modes import build_mode

    watchdog.progress()  # the clock starts: a multi-worker strategy's start-up waits on the peers
    mode = build_mode(config, plan, worker, all_reduce)  # first: a multi-worker strategy must precede other ops
    with watchdog.local_work():
        metrics = make_metrics(metrics)
        source = data if data is not None else catalog.load_source(
            config.dataset, config.data_dir, config.augment)
        source.check()
        check_input_memory(config, source, len(plan.tower_devices))
        spec = resolve_model(model, config, num_classes, source.num_classes, loss, optimizer)
    try:
        return controller.train(config, spec, source, mode, watchdog, stop,
                             live_progress=live_progress, callbacks=callbacks,
                             metrics=metrics)
    except (tf.errors.UnavailableError, tf.errors.DeadlineExceededError,
            tf.errors.CancelledError, tf.errors.AbortedError) as e:
        if worker.count == 1:
            raise
        raise TrainingError(f"[{worker.name}] a collective failed ({type(e).__name__}): "
                            f"{peer_watchdog.peer_trouble(worker)}") from None
