"""The command line, a thin layer: flags -> the same options -> `tower_train.fit`.

Every command (train, eval, compare, benchmark) runs through `command`, which
turns the library's errors into one line on stderr and an exit status:

    2    bad input (UsageError, a bad flag): `tower_train: error: <message>`
    1    training cannot go on (TrainingError): `tower_train: <message>`
    128+ stopped by a signal at an update boundary, saved (Stopped); 130 for SIGINT outside
         training (start-up, the final evaluation), with nothing saved

The one-line message of an error in the user's own code names its file:line;
with TOWER_TRAIN_TRACEBACK=1 the full traceback follows it.
"""
from __future__ import annotations

import logging as stdlib_logging
import os
import signal
import sys
import traceback
from typing import Callable, Iterable, NoReturn

from absl import flags, logging

from tower_train.workers import cluster
from tower_train.workers import peer_watchdog
from tower_train import cpp_lines
from tower_train import flags as tt_flags
from tower_train.config import TrainConfig
from tower_train.errors import Stopped, TrainingError, UsageError
from tower_train.quiet_start import level_set_by_user
from tower_train.user_code import TRACEBACK_VARIABLE, UserCodeError

PROG = "tower_train"
USAGE = """python -m tower_train (or tower-train): data-parallel training with towers and gradient accumulation.

    python -m tower_train --num_gpus=4 --accum=8          # the main job: 4 towers, 8 micro-steps per update
    python -m tower_train --flagfile=flags/main.flags     # the same job as a recipe
    python -m tower_train --helpfull                      # every flag

With fewer GPUs than --num_gpus, GPU 0 (or the CPU) is split into logical devices, one per
tower. The Python API is tower_train.fit; docs/ holds one page per topic.
"""
_HELP = flags.DEFINE_bool("help", False, "Show the main flags and exit.", short_name="h")
_HELPFULL = flags.DEFINE_bool("helpfull", False, "Show every flag and exit.")


class HelpShown(Exception):
    """--help or --helpfull was asked for: the message is the help text."""


def command(body: Callable[[], int]) -> int:
    """Runs a command's body; returns its exit status, errors as one line (see the module doc)."""
    try:
        return body()
    except HelpShown as e:
        print(e)
        return 0
    except flags.Error as e:
        # absl words some of its errors "ERROR:: ...": the prefix would be said twice.
        return fail(UsageError(str(e).removeprefix("ERROR:: ")))
    except UsageError as e:
        return fail(e)
    except Stopped as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return e.exit_status
    except TrainingError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        # SIGINT before training listens for it (start-up) or after (the final evaluation).
        print(f"{PROG}: interrupted by SIGINT outside training; the checkpoints already written "
              "are intact", file=sys.stderr)
        return 128 + signal.SIGINT


def fail(error: Exception) -> int:
    """Prints a bad-input error as one line; returns the exit status for it."""
    print(f"{PROG}: error: {error}", file=sys.stderr)
    if isinstance(error, UserCodeError) and os.environ.get(TRACEBACK_VARIABLE) and error.__cause__:
        traceback.print_exception(error.__cause__, file=sys.stderr)
    return 2


def parse_config(argv: list[str], usage: str, command_flags: Iterable[str] = (),
                 options: Iterable[str] | None = None) -> TrainConfig:
    """Parses the command line into a validated config, and sets up logging.

    --help shows `usage`, the main training flags among the training `options` the command
    reads (None: training's, all of them) and `command_flags`; --helpfull every flag it reads.
    """
    rest = flags.FLAGS(argv)
    read = set(tt_flags.TRAINING_FLAGS if options is None else options)
    if _HELPFULL.value:
        raise HelpShown(f"{usage.strip()}\n\n{_full_help(options, command_flags)}")
    if _HELP.value:
        shown = [*(name for name in tt_flags.MAIN_FLAGS if name in read), *command_flags]
        raise HelpShown(f"{usage.strip()}\n\nMain flags (--helpfull lists all):\n"
                        + "\n".join(_describe_flag(name) for name in shown)
                        + "\n  --flagfile: Read flags from a file; recipes are in flags/.")
    if len(rest) > 1:
        raise UsageError(f"unexpected argument {rest[1]!r}: only --flags are accepted")
    config = tt_flags.config_from_flags()
    logging.use_absl_handler()
    logging.set_verbosity(logging.INFO)
    logging.get_absl_handler().addFilter(_no_tensorflow_info)
    return config


def _full_help(options: Iterable[str] | None, command_flags: Iterable[str]) -> str:
    """absl's help of every flag (training's, `options` None), or of the command's alone: the
    training `options` it reads, its own, and absl's --flagfile."""
    if options is None:
        return flags.FLAGS.get_help()
    read = flags.FlagValues()
    for name in (*(name for name in tt_flags.TRAINING_FLAGS if name in set(options)), *command_flags):
        read[name] = flags.FLAGS[name]
    return read.get_help()


def _describe_flag(name: str) -> str:
    flag = flags.FLAGS[name]
    default = "" if flag.default is None else f" (default: {flag.default_as_str})"
    return f"  --{name}: {flag.help}{default}"


def main(argv: list[str] | None = None) -> int:
    """Runs `python -m tower_train`; returns the exit status."""
    return command(lambda: _train(sys.argv if argv is None else argv))


def _train(argv: list[str]) -> int:
    config = parse_config(argv, USAGE)
    watchdog = None
    if config.mode_rules.workers:
        worker = cluster.this_worker(config.cluster)
        watchdog = peer_watchdog.PeerWatchdog(worker, config.collective_timeout, PROG)  # before TF loads
    try:
        from tower_train.api import fit
        from tower_train.training.stop_signals import StopSignals

        fit(stop=StopSignals(), watchdog=watchdog,
            **{name: getattr(config, name) for name in tt_flags.TRAINING_FLAGS})
    finally:
        if watchdog is not None:
            watchdog.stop()
    return 0


def _no_tensorflow_info(record: stdlib_logging.LogRecord) -> bool:
    """TF's own INFO lines (one per checkpoint, for instance) would interleave the progress lines,
    and its warnings are about its internals (a tf.function traced once per configuration of the
    benchmark counts as "retracing"): the product's own lines say what the user must know."""
    return record.levelno >= stdlib_logging.ERROR or f"{os.sep}tensorflow{os.sep}" not in record.pathname


def run(command_main: Callable[[], int] = main) -> NoReturn:
    """A command's process (`tower-train`, `python -m tower_train` and every other command's
    `python -m`): TensorFlow's C++ log lines filtered out of its stderr (cpp_lines.py) unless
    the user set TF_CPP_MIN_LOG_LEVEL, then `command_main`, whose status it exits with."""
    if not level_set_by_user():
        cpp_lines.filter_stderr()
    sys.exit(command_main())
