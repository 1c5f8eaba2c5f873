"""One start-up path for every command: options, model and data turned into a checked run.

`start` checks everything in order of cost, the same way for each command (`tower_train.fit`,
and through it `tower_train.keras.fit` and the export at the end of training; `evaluate_checkpoint`
and `python -m tower_train.eval`; compare; normalization; the benchmark):

1. the options, as a validated `TrainConfig` (an unknown one is named);
2. the directories the command writes (train_dir, export_dir); then TensorFlow loads
   (`quiet_start.load_tensorflow`), as the steps below need it;
3. the checkpoint the command reads; the data arguments (a named data set, a source, or numpy arrays);
4. the model's name;
5. the devices (`prepare_devices`, which also decides the "auto" options);
6. the numerics, TensorFlow's op determinism and TF32, for the rest of the command;
7. the mode, where the command trains in one (fit: a multi-worker strategy precedes other ops);
8. the source, loaded and checked: `Source.check`, and the memory of the batches it will hold;
9. the model's spec.

A `Command` says which of these apply to it, so that each check runs wherever it applies.
Bad input raises UsageError in one line; nothing is printed and nothing exits.
"""
from __future__ import annotations

import contextlib
import dataclasses
import sys
from typing import TYPE_CHECKING, Iterator

from tower_train.config import TrainConfig, check_directories

from tower_train.rules import HAND_PLACED_MODE
from tower_train.errors import UsageError
from tower_train.quiet_start import load_tensorflow
from tower_train.workers import cluster, peer_watchdog

if TYPE_CHECKING:  # TensorFlow loads only once a command's flags are checked
    from tower_train.data.source import Source
    from tower_train.devices import DevicePlan
    from tower_train.model_spec import ModelSpec
    from tower_train.step.modes import Mode

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


@dataclasses.dataclass(frozen=True)
class Command:
    """Which of `start`'s checks apply to a command, by what it does."""

    name: str  # as an error names it: "fit()", or the command's module
    writes: bool = False  # to train_dir (and export_dir): checked first, locked while it runs
    reads_checkpoint: bool = False  # the checkpoint in train_dir, or the one named
    trains_in_one_mode: bool = False  # its mode built by start, a multi-worker one included
    # Evaluation: the towers of tower mode, whatever mode trained the checkpoint; data=(x, y[, w])
    # alone is the held-out set.
    evaluates: bool = False
    holds_training_batches: bool = False  # the training stream's, whose memory is checked


FIT = Command("fit()", writes=True, trains_in_one_mode=True, holds_training_batches=True)
EVALUATE = Command("evaluate_checkpoint()", reads_checkpoint=True, evaluates=True)
COMPARE = Command("compare", writes=True, holds_training_batches=True)
NORMALIZATION = Command("normalization", holds_training_batches=True)
BENCHMARK = Command("benchmark", holds_training_batches=True)


@dataclasses.dataclass(frozen=True)
class Started:
    """A checked run, as `start` made it."""

    config: TrainConfig  # its "auto" options decided for this machine
    worker: cluster.WorkerInfo
    plan: DevicePlan
    mode: Mode | None  # the command's mode, when `trains_in_one_mode`
    source: Source
    spec: ModelSpec


@contextlib.contextmanager
def start(command: Command, options: dict, model: object = None, data: object = None, *,
          eval_data: tuple | None = None, shuffle: bool | None = None,
          num_classes: int | None = None, loss: object = None, optimizer: object = None,
          checkpoint: str | None = None, watchdog: peer_watchdog.PeerClock | None = None,
          announce: bool = False) -> Iterator[Started]:
    """The checks and the making of the module docstring's list, in its order; inside the block,
    the run, with the train_dir locked (`command.writes`, the chief) and the numerics set.

    `options`, `model`, `data`, `eval_data`, `shuffle`, `num_classes`, `loss` and `optimizer`
    (an object, see `api.optimizer_object`) are `tower_train.fit`'s; `checkpoint` evaluation's
    (`training/evaluation/checkpoint.check_named_checkpoint`). `watchdog` is told of progress and local
    work (fit's, multi-worker). `announce` logs the device line once the devices are made.
    """
    config, model, data = config_and_objects(model, data, dict(options), command.name)
    if command.writes:
        check_directories(config)
    load_tensorflow()
    if command.reads_checkpoint:
        from tower_train.training.evaluation.checkpoint import check_named_checkpoint

        # A model given as an object has no name yet to compare with the run record's.
        check_named_checkpoint(checkpoint, config.train_dir, config.model if model is None else None)
    watchdog = watchdog or peer_watchdog.PeerClock()
    worker = _worker(config, watchdog) if command.trains_in_one_mode else cluster.SINGLE_PROCESS
    if command.evaluates and isinstance(data, tuple) and eval_data is None:
        eval_data = data  # the arrays evaluation is given are what it evaluates: its held-out set
    data = array_source(data, eval_data, shuffle, num_classes, model)
    check_data(config, data)
    if model is None:
        from tower_train.models import model_class

        model_class(config.model, config.model_module)  # a bad name fails before the devices
    if command.evaluates:  # evaluation has no strategy
        config = dataclasses.replace(config, mode=HAND_PLACED_MODE, all_reduce="auto", sync_bn=False)
    from tower_train.training.run_record import TrainDirLock

    with contextlib.ExitStack() as held:
        if command.writes and worker.is_chief:  # the chief writes, so it holds the train_dir
            held.enter_context(TrainDirLock(config.train_dir))
        config, plan, all_reduce = devices_and_reduction(config, announce, model)
        from tower_train import numerics
        from tower_train.data import catalog
        from tower_train.model_spec import resolve_model
        from tower_train.step.modes import build_mode

        held.enter_context(numerics.run_numerics(config.deterministic, config.tf32))
        mode = None
        if command.trains_in_one_mode:
            watchdog.progress()  # the clock starts: a multi-worker strategy's start-up waits on the peers
            mode = build_mode(config, plan, worker, all_reduce)  # before any other op
        with watchdog.local_work():
            source = data if data is not None else catalog.load_source(
                config.dataset, config.data_dir, config.augment)
            source.check()
            check_input_memory(config, source, len(plan.tower_devices),
                               training=command.holds_training_batches,
                               held_out=command.trains_in_one_mode or command.evaluates)
            spec = resolve_model(model, config, num_classes, source.num_classes, loss, optimizer)
        yield Started(config, worker, plan, mode, source, spec)


def options_of(config: TrainConfig) -> dict:
    """A config's options, as `start` takes them (a command's parsed flags)."""
    return {name: getattr(config, name) for name in _OPTIONS}


def _worker(config: TrainConfig, watchdog: peer_watchdog.PeerClock) -> cluster.WorkerInfo:
    if isinstance(watchdog, peer_watchdog.PeerWatchdog):  # the CLI's: it read TF_CONFIG or Slurm's already
        return watchdog.worker
    if config.mode_rules.workers:
        return cluster.this_worker(config.cluster)
    return cluster.SINGLE_PROCESS


def make_config(options: dict, caller: str = FIT.name) -> TrainConfig:
    """The options as a validated config; UsageError names an unknown one."""
    unknown = sorted(set(options) - set(_OPTIONS))
    function = caller.removesuffix("()")
    if unknown and unknown[0] in _KERAS_FIT_ARGUMENTS:
        raise UsageError(f"{caller}: {unknown[0]}= is Keras's Model.fit argument, not an option of "
                         f"tower_train.{function} ({_KERAS_FIT_ARGUMENTS[unknown[0]]}); "
                         "tower_train.keras.fit(model, ...) takes Model.fit's arguments")
    if unknown:
        raise UsageError(f"{caller}: unknown option {unknown[0]!r}; the options are the flags' names: "
                         f"{', '.join(_OPTIONS)}")
    return TrainConfig(**options)


def config_and_objects(model: object, data: object, options: dict,
                       caller: str = FIT.name) -> tuple[TrainConfig, object, object]:
    """The config of `options`, with `model` or `data` in it when they name a registered model or
    data set (then None is returned in their place), and the objects given otherwise."""
    if isinstance(model, str):
        options["model"], model = model, None
    if isinstance(data, str):
        options["dataset"], data = data, None
    return make_config(options, caller), model, data


def prepare_devices(config: TrainConfig, announce: bool = False, model: object = None) -> tuple[TrainConfig, object]:
    """Checks that the mode fits the devices and creates the logical devices.

    Returns the config with its "auto" options decided for this machine (--ps_device,
    --jit_compile, the latter also by `model`'s layers where it is a built Keras model), and
    the DevicePlan, whose line says what each "auto" chose and why. The line is logged when
    `announce`; training logs it once the model is built.
    """
    return devices_and_reduction(config, announce, model)[:2]


def devices_and_reduction(config: TrainConfig, announce: bool = False,
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


def check_input_memory(config: TrainConfig, source, towers: int, training: bool = True,
                       held_out: bool = True) -> None:
    """Refuses a training (`training`) or evaluation (`held_out`) batch whose inputs alone would
    not fit in memory."""
    from tower_train.data import source as data_module

    available = data_module.available_memory_bytes()
    if available is None:
        return
    per_example = data_module.input_bytes_per_example(source)
    if training:
        data_module.check_batch_memory(
            per_example, config.batch_size * towers, data_module.TRAIN_BATCHES_HELD,
            f"--batch_size={config.batch_size} x {towers} tower(s)", available)
    if held_out:
        data_module.check_batch_memory(per_example, config.eval_batch_size, 2,
                                       f"--eval_batch_size={config.eval_batch_size}", available)
