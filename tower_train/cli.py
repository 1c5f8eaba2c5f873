"""The command line: flags -> validated config -> devices -> training.

Bad input of any kind ends here as one line on stderr and exit status 2,
before anything is written.
"""
from __future__ import annotations

import contextlib
import logging as stdlib_logging
import os
import sys
import tempfile
from typing import TYPE_CHECKING, Iterator

from absl import app, flags, logging

from tower_train import cluster
from tower_train import flags as tt_flags
from tower_train.config import TrainConfig, check_train_dir
from tower_train.errors import Stopped, TrainingError, UsageError
from tower_train.stop_signals import StopSignals

if TYPE_CHECKING:
    from tower_train.devices import DevicePlan

PROG = "tower_train"


def main(argv: list[str] | None = None) -> int:
    """Runs `python -m tower_train`; returns the exit status."""
    try:
        config = parse_config(sys.argv if argv is None else argv)
        worker, watchdog = cluster.SINGLE_PROCESS, None
        if config.mode == "multi_worker":
            worker = cluster.parse_tf_config(os.environ.get("TF_CONFIG"))
            watchdog = cluster.PeerWatchdog(worker, config.collective_timeout, PROG)  # before TF loads
        with _native_startup_lines_hidden():
            from tower_train import data, trainer
        check_train_dir(config.train_dir)
        data.check_data_dir(config.dataset, config.data_dir)
        # The trainer announces the plan once the model is built: a model that cannot run in
        # this mode is then refused in one line, before anything else is said.
        plan = prepare_devices(config, announce=False)
        stop = StopSignals()
        if watchdog is None:
            trainer.train(config, plan, stop=stop)
        else:
            _train_worker(config, plan, worker, watchdog, stop)
    except (UsageError, flags.Error) as e:
        return fail(e)
    except Stopped as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return e.exit_status
    except TrainingError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 1
    return 0


def _train_worker(config: TrainConfig, plan: DevicePlan, worker: cluster.WorkerInfo,
                  watchdog: cluster.PeerWatchdog, stop: StopSignals) -> None:
    """One worker of a multi_worker run; a collective that fails for a lost peer ends it in one line."""
    import tensorflow as tf

    from tower_train import trainer

    try:
        trainer.train(config, plan, worker, heartbeat=watchdog.progress, stop=stop)
    except (tf.errors.UnavailableError, tf.errors.DeadlineExceededError,
            tf.errors.CancelledError, tf.errors.AbortedError) as e:
        raise TrainingError(f"[{worker.name}] a collective failed ({type(e).__name__}): "
                            f"{cluster.peer_trouble(worker)}") from None
    finally:
        watchdog.stop()


def parse_config(argv: list[str]) -> TrainConfig:
    """Parses the command line into a validated config, and sets up logging."""
    app.define_help_flags()
    rest = flags.FLAGS(argv)
    if len(rest) > 1:
        raise UsageError(f"unexpected argument {rest[1]!r}: only --flags are accepted")
    config = tt_flags.config_from_flags()
    logging.use_absl_handler()
    logging.set_verbosity(logging.INFO)
    logging.get_absl_handler().addFilter(_no_tensorflow_info)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TF's C++ info and warnings
    return config


def prepare_devices(config: TrainConfig, announce: bool = True) -> DevicePlan:
    """Checks the model name and that the mode fits the devices, then creates the logical
    devices and, if `announce`, logs the plan. Writes nothing."""
    with _native_startup_lines_hidden():
        from tower_train import devices, modes

        machine_plan = devices.plan_for_this_machine(
            config.num_gpus, config.ps_device, config.gpu_memory_mb)
    plan = modes.fit_plan_to_mode(config.mode, machine_plan)
    modes.resolve_all_reduce(config.mode, config.all_reduce, plan)
    from models import model_class

    model_class(config.model, config.model_module)
    devices.apply_device_plan(plan)
    if announce:
        logging.info("%s", plan.message)
    return plan


def _no_tensorflow_info(record: stdlib_logging.LogRecord) -> bool:
    """TF's own INFO lines (one per checkpoint, for instance) would interleave the progress lines."""
    return record.levelno >= stdlib_logging.WARNING or f"{os.sep}tensorflow{os.sep}" not in record.pathname


@contextlib.contextmanager
def _native_startup_lines_hidden() -> Iterator[None]:
    """Hides what TF's C++ side prints while it loads and probes for GPUs.

    Those lines (oneDNN, CUDA probing) are written before any log level
    applies, and would bury both the one-line errors and the device plan's
    log line, which says the same in plain words. If loading fails, they are
    shown after all; a usage error is the user's, not TF's, and stays one line.
    """
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield
        except UsageError:
            raise
        except BaseException:
            os.dup2(saved, 2)
            sink.seek(0)
            sys.stderr.write(sink.read().decode(errors="replace"))
            raise
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def fail(error: Exception) -> int:
    """Prints a bad-input error as one line; returns the exit status for it."""
    print(f"{PROG}: error: {error}", file=sys.stderr)
    return 2


def run() -> None:
    """The `tower-train` console script and `python -m tower_train`."""
    sys.exit(main())
