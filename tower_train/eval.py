"""python -m tower_train.eval: held-out precision @ 1 and loss of a checkpoint.

Run commands:
    python -m tower_train.eval --train_dir=/tmp/tower_train              # its latest checkpoint
    python -m tower_train.eval --checkpoint=/tmp/tower_train/ckpt-30 --num_gpus=4  # the main job's last
    python -m tower_train.eval --train_dir=/tmp/tower_train --nouse_ema  # the trained weights

It takes the training flags (--model, --model_module, --dataset, --data_module,
--data_dir, --num_gpus, --eval_batch_size, --train_dir, ...) and --checkpoint,
--[no]use_ema.
The CPU (or GPU 0) is split into logical devices exactly as for training, and
every held-out example is counted once, spread over the --num_gpus towers
(`tower_train.training.evaluation.held_out`). The result is one line on stdout:

    precision @ 1 = 0.2650, loss = 3.1382 (2000 examples)   # flags/quick.flags' 20 updates

Bad input (no checkpoint, an unreadable one, one of another model, a bad flag)
is one line on stderr and exit status 2; held-out data that fails while it is read
(a file corrupted or deleted meanwhile) is one line and exit status 1. Nothing is
ever written.
"""
from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

from absl import flags

from tower_train import flags as tt_flags
from tower_train import startup
from tower_train.cli import command, parse_config, run

if TYPE_CHECKING:  # TensorFlow loads only once the flags are checked
    from tower_train.training.evaluation.held_out import Evaluation

EVAL_FLAGS = tt_flags.define_eval_flags()


def describe_weights(path: str, has_moving_average: bool, use_ema: bool) -> str:
    if has_moving_average and use_ema:
        return f"evaluating the moving average of the weights in {path} (--use_ema)"
    if has_moving_average:
        return f"evaluating the trained weights in {path} (--nouse_ema; it also holds a moving average)"
    if use_ema:
        return (f"evaluating the trained weights in {path}: it holds no moving average "
                "(trained with --ema_decay=0)")
    return f"evaluating the trained weights in {path} (--nouse_ema)"


def evaluate_checkpoint(model: object = None, data: object = None, *, checkpoint: str | None = None,
                        use_ema: bool = True, num_classes: int | None = None, loss: object = None,
                        eval_data: tuple | None = None, metrics: list | None = None,
                        **options) -> Evaluation:
    """Weighted precision @ 1, the held-out loss and `metrics` of a checkpoint, and the examples
    counted (an `Evaluation`).

    `model`, `data`, `num_classes`, `loss`, `eval_data` and the options are those of
    `tower_train.fit` (the checkpoint's run), `metrics` as fit's: the held-out set of the data
    is evaluated, and numpy arrays `data=(x, y)` or `(x, y, w)` given alone are that held-out set.
    `checkpoint` is a prefix such as <train_dir>/ckpt-30 or a directory (its latest), by default
    the latest in train_dir; `use_ema` evaluates the moving average when the checkpoint holds one.
    The towers of tower mode spread every batch, whatever mode trained it. Nothing is written.
    Raises UsageError for any bad input before logging anything.
    """
    from absl import logging

    if metrics is not None:
        from tower_train.training.evaluation.held_out import check_metrics

        metrics = check_metrics(metrics)
    with startup.start(startup.EVALUATE, options, model, data, eval_data=eval_data,
                       num_classes=num_classes, loss=loss, checkpoint=checkpoint) as run:
        import tensorflow as tf

        from tower_train.training import checkpoints
        from tower_train.training.evaluation import checkpoint as eval_checkpoint
        from tower_train.training.evaluation import held_out
        from tower_train.model_spec import build_model, use_moving_average
        from tower_train.step.schedules import MovingAverage

        config, plan, source, spec = run.config, run.plan, run.source, run.spec
        info = eval_checkpoint.find_checkpoint(checkpoint, config.train_dir)
        with_average = use_ema and info.has_moving_average
        with tf.device(plan.param_device):
            net = build_model(spec, source, config)
            average = MovingAverage(net.trainable_variables, config.ema_decay) if with_average else None
        objects = {"model": net, **({"moving_average": average} if average is not None else {})}
        # Building the model takes seconds, in which a run writing the train_dir may rotate the
        # checkpoint away: a directory's latest is then taken again, as often as there are kept ones.
        for attempt in range(checkpoints.CHECKPOINTS_KEPT, -1, -1):
            try:
                eval_checkpoint.restore_for_evaluation(info, objects, spec.name)
                break
            except eval_checkpoint.CheckpointGone:
                if not attempt or not os.path.isdir(checkpoint or config.train_dir):
                    raise
                gone, info = info.path, eval_checkpoint.find_checkpoint(checkpoint, config.train_dir)
                logging.info("%s was removed while the model was built: evaluating %s, now the latest",
                             gone, info.path)
        metrics = held_out.make_metrics(metrics or [])
        held_out.check_metrics_against(metrics, net, source, config.eval_batch_size)
        logging.info("%s", plan.message)
        logging.info("%s", describe_weights(info.path, info.has_moving_average, use_ema))
        if average is not None:
            use_moving_average(net, average)
        return held_out.evaluate(net, source, config.eval_batch_size, plan.tower_devices, metrics)


def _eval(argv: list[str]) -> int:
    flags.FLAGS["train_dir"].help = tt_flags.EVAL_TRAIN_DIR_HELP  # the command's, once it runs
    config = parse_config(argv, __doc__ or "", EVAL_FLAGS, tt_flags.EVAL_OPTIONS)
    evaluation = evaluate_checkpoint(checkpoint=EVAL_FLAGS["checkpoint"].value,
                                     use_ema=EVAL_FLAGS["use_ema"].value, **startup.options_of(config))
    if evaluation.precision is None:
        print(f"precision @ 1 = none: no held-out label has any weight ({evaluation.examples} examples)")
    else:
        print(f"{evaluation.describe()} ({evaluation.examples} examples)")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Runs `python -m tower_train.eval`; returns the exit status."""
    return command(lambda: _eval(sys.argv if argv is None else argv))


if __name__ == "__main__":
    run(main)
