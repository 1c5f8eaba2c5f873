"""python -m tower_train.eval: held-out precision @ 1 of a checkpoint.

Run commands:
    python -m tower_train.eval --train_dir=/tmp/tower_train              # its latest checkpoint
    python -m tower_train.eval --checkpoint=/tmp/tower_train/ckpt-20 --num_gpus=4
    python -m tower_train.eval --train_dir=/tmp/tower_train --nouse_ema  # the trained weights

It takes the training flags (--model, --model_module, --dataset, --data_dir,
--num_gpus, --eval_batch_size, --train_dir, ...) and --checkpoint, --[no]use_ema.
The CPU (or GPU 0) is split into logical devices exactly as for training, and
every held-out example is counted once, spread over the --num_gpus towers
(`tower_train.evaluation`). The result is one line on stdout:

    precision @ 1 = 0.4755 (2000 examples)

Bad input (no checkpoint, an unreadable one, one of another model, a bad flag)
is one line on stderr and exit status 2. Nothing is ever written.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys

from absl import flags, logging

from tower_train import flags as tt_flags
from tower_train.cli import fail, parse_config, prepare_devices
from tower_train.config import RUN_FILE, TrainConfig
from tower_train.errors import UsageError

EVAL_FLAGS = tt_flags.define_eval_flags()
_MODEL_PREFIX = "model/"
_AVERAGE_PREFIX = "moving_average/"
_STATE_FILE = "checkpoint"  # where tf.train.CheckpointManager lists a directory's checkpoints
_NO_CHECKPOINT_HINT = {True: "; train there first, or name one with --checkpoint",
                       False: " (name a checkpoint prefix such as <train_dir>/ckpt-30, or a run's "
                              "train_dir)"}


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    path: str  # the checkpoint's prefix, e.g. /tmp/tower_train/ckpt-30
    flag: str  # how the user named it, for messages: "--checkpoint=..." or "--train_dir=..."
    has_moving_average: bool


def check_before_tensorflow(checkpoint: str | None, train_dir: str, model: str) -> None:
    """The checks that need no TensorFlow, so that these errors come at once: the path named
    exists, a directory lists checkpoints at all, and the run record beside them (if any)
    names this --model."""
    listed = checkpoint is None or os.path.isdir(checkpoint)  # a directory: its latest checkpoint
    if checkpoint is not None:
        flag, directory = f"--checkpoint={checkpoint}", checkpoint
        if not listed:
            prefix = _prefix(checkpoint)
            if not os.path.isfile(prefix + ".index"):
                raise UsageError(f"{flag}: no such checkpoint ({prefix}.index does not exist); name "
                                 "a checkpoint prefix such as <train_dir>/ckpt-30, or a directory")
            directory = os.path.dirname(prefix) or "."
    else:
        flag, directory = f"--train_dir={train_dir}", train_dir
        if not os.path.isdir(train_dir):
            raise UsageError(f"{flag}: "
                             f"{'is not a directory' if os.path.exists(train_dir) else 'does not exist'}"
                             "; no checkpoint to evaluate (name a run's --train_dir, or --checkpoint)")
    if listed and not os.path.isfile(os.path.join(directory, _STATE_FILE)):
        raise UsageError(f"{flag}: holds no checkpoint{_NO_CHECKPOINT_HINT[checkpoint is None]}")
    _check_run_record(flag, directory, model)


def _check_run_record(flag: str, directory: str, model: str) -> None:
    """Refuses checkpoints whose run record (beside them) names another model."""
    path = os.path.join(directory, RUN_FILE)
    try:
        with open(path) as f:
            trained = json.load(f).get("model")
    except (OSError, ValueError, AttributeError):
        return  # no record (a copied checkpoint): the restore itself checks the structure
    if trained is not None and trained != model:
        raise UsageError(f"{flag}: its checkpoints are of --model={trained} (says {path}), "
                         f"not --model={model}; pass --model={trained}")


def _prefix(checkpoint: str) -> str:
    return checkpoint[:-len(".index")] if checkpoint.endswith(".index") else checkpoint


def find_checkpoint(checkpoint: str | None, train_dir: str) -> CheckpointInfo:
    """The checkpoint to evaluate, checked readable: --checkpoint (a prefix, or a directory's
    latest), else the latest in train_dir."""
    import tensorflow as tf

    directory = train_dir if checkpoint is None else checkpoint
    flag = f"--train_dir={train_dir}" if checkpoint is None else f"--checkpoint={checkpoint}"
    if os.path.isdir(directory):
        path = tf.train.latest_checkpoint(directory)
        if path is None:
            raise UsageError(f"{flag}: holds no checkpoint{_NO_CHECKPOINT_HINT[checkpoint is None]}")
    else:
        path = _prefix(checkpoint)
    try:
        reader = tf.train.load_checkpoint(path)
        names = sorted(reader.get_variable_to_shape_map())
        for name in names:  # read what will be restored now, so a damaged file is named here
            if name.startswith((_MODEL_PREFIX, _AVERAGE_PREFIX)):
                reader.get_tensor(name)
    # TF's reader fails on a damaged file in all of these ways, depending on where it is cut.
    except (tf.errors.OpError, ValueError, IndexError, KeyError) as e:
        raise UsageError(f"{flag}: checkpoint {path} is unreadable ({_first_line(e)})") from None
    if not any(name.startswith(_MODEL_PREFIX) for name in names):
        raise UsageError(f"{flag}: checkpoint {path} holds no 'model' (not written by tower_train?)")
    return CheckpointInfo(path, flag, any(name.startswith(_AVERAGE_PREFIX) for name in names))


def restore(config: TrainConfig, info: CheckpointInfo, with_average: bool, device: str):
    """A fresh --model on `device` with the checkpoint's weights, and its moving average if asked.

    Only the model (and moving_average) is read: the optimizer is not needed.
    Returns (model, moving_average or None).
    """
    import tensorflow as tf

    from models import model_class
    from tower_train import data
    from tower_train.schedules import MovingAverage

    with tf.device(device):
        model = model_class(config.model, config.model_module)(num_classes=data.NUM_CLASSES)
        model(tf.zeros([1, data.IMAGE_SIZE, data.IMAGE_SIZE, 3]))
        average = (MovingAverage(model.trainable_variables, config.ema_decay)
                   if with_average else None)
    objects = {"model": model, **({"moving_average": average} if average is not None else {})}
    mismatch = _shape_mismatch(objects, info.path)
    if mismatch:
        raise UsageError(f"{info.flag}: checkpoint {info.path} does not fit --model={config.model} "
                         f"(a checkpoint of another network?): {mismatch}")
    try:
        tf.train.Checkpoint(**objects).restore(info.path).expect_partial() \
            .assert_existing_objects_matched()
    # TF's reader fails on a damaged data file in all of these ways, depending on where it is cut;
    # a checkpoint of another network fails the match (AssertionError) or a shape (ValueError).
    except (tf.errors.OpError, AssertionError, ValueError, IndexError, KeyError) as e:
        what = ("does not hold the weights of" if isinstance(e, AssertionError)
                else "cannot be restored into")
        raise UsageError(f"{info.flag}: checkpoint {info.path} {what} --model={config.model} "
                         f"({_first_line(e)})") from None
    return model, average


def _shape_mismatch(objects: dict, path: str) -> str | None:
    """The first checkpoint variable whose shape differs from the Python variable it would be
    restored into, found by following its key's attribute names; None if there is none.

    TensorFlow itself raises in the middle of a restore on such a variable, and then warns
    about every other value at exit; this check names the culprit before any restore. Keys
    that do not resolve by attribute name are left to the restore's own matching.
    """
    import tensorflow as tf

    suffix = "/.ATTRIBUTES/VARIABLE_VALUE"
    for key, shape in sorted(tf.train.load_checkpoint(path).get_variable_to_shape_map().items()):
        head, *names = key[:-len(suffix)].split("/") if key.endswith(suffix) else ("", )
        target = objects.get(head)
        for name in names:
            if target is None:
                break
            if name.isdigit() and isinstance(target, (list, tuple)):
                target = target[int(name)] if int(name) < len(target) else None
            else:
                target = getattr(target, name, None)
        here = getattr(target, "shape", None)
        if target is not None and here is not None and list(here) != list(shape):
            return f"{key[:-len(suffix)]} is {list(shape)} there, {list(here)} here"
    return None


def describe_weights(info: CheckpointInfo, use_ema: bool) -> str:
    if info.has_moving_average and use_ema:
        return f"evaluating the moving average of the weights in {info.path} (--use_ema)"
    if info.has_moving_average:
        return (f"evaluating the trained weights in {info.path} (--nouse_ema; it also holds a "
                "moving average)")
    if use_ema:
        return (f"evaluating the trained weights in {info.path}: it holds no moving average "
                "(trained with --ema_decay=0)")
    return f"evaluating the trained weights in {info.path} (--nouse_ema)"


def run_eval(config: TrainConfig, checkpoint: str | None, use_ema: bool) -> tuple[float, int]:
    """Checks everything, splits the devices, restores and evaluates; returns (precision, examples).

    Raises UsageError for any bad input before logging anything, so an error is one line.
    """
    check_before_tensorflow(checkpoint, config.train_dir, config.model)  # at once
    # Evaluation has no strategy: the towers of tower mode, whatever --mode trained the checkpoint.
    device_config = dataclasses.replace(config, mode="tower", all_reduce="auto", sync_bn=False)
    # Checks --model and creates the logical devices; the plan's line is logged below, once
    # every check has passed, so that a bad input is still a one-line error.
    plan = prepare_devices(device_config, announce=False)
    from tower_train import data, evaluation

    data.check_data_dir(config.dataset, config.data_dir)
    info = find_checkpoint(checkpoint, config.train_dir)
    with_average = use_ema and info.has_moving_average
    model, average = restore(config, info, with_average, plan.param_device)
    source = data.load_source(config.dataset, config.data_dir)
    logging.info("%s", plan.message)
    logging.info("%s", describe_weights(info, use_ema))
    if average is not None:
        evaluation.use_moving_average(model, average)
    return evaluation.evaluate(model, source, config.eval_batch_size, plan.tower_devices)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return (text.splitlines()[0] if text else type(error).__name__)[:200]


def main(argv: list[str] | None = None) -> int:
    """Runs `python -m tower_train.eval`; returns the exit status."""
    try:
        config = parse_config(sys.argv if argv is None else argv)
        precision, count = run_eval(config, EVAL_FLAGS["checkpoint"].value, EVAL_FLAGS["use_ema"].value)
    except (UsageError, flags.Error) as e:
        return fail(e)
    print(f"precision @ 1 = {precision:.4f} ({count} examples)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
