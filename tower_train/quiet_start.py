"""TensorFlow's C++ start-up lines (oneDNN, the CUDA stubs, cuInit, cpu_feature_guard, Grappler's
loop_optimizer) kept out of stderr: they tell a user nothing to act on, and would bury the
one-line errors and the device plan's log line, which says the same in plain words.

Every command loads TensorFlow where they are hidden (`load_tensorflow`, from `startup.start`).
`import tower_train` calls `quiet_tensorflow_start`, so that a Python-API script that imports
tower_train before keras or tensorflow prints none of them either. A user who sets
TF_CPP_MIN_LOG_LEVEL gets TensorFlow's own behaviour, untouched: the commands' filter of TF's C++
log lines (cpp_lines.py) asks `level_set_by_user`.
"""
from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import os
import sys
import tempfile
from types import ModuleType
from typing import Iterator

from tower_train.errors import UsageError

LEVEL_VARIABLE = "TF_CPP_MIN_LOG_LEVEL"
_level_set_here = False  # by quiet_tensorflow_start, in this process


def quiet_tensorflow_start() -> None:
    """Unless the environment sets TF_CPP_MIN_LOG_LEVEL or TensorFlow is loaded already: sets it to
    2, which hides TF's C++ info and warnings once it runs, and has TensorFlow's first import run
    in `native_startup_lines_hidden`, for what it prints while loading, before any log level
    applies."""
    global _level_set_here
    if LEVEL_VARIABLE in os.environ or "tensorflow" in sys.modules:
        return
    os.environ[LEVEL_VARIABLE] = "2"
    _level_set_here = True
    sys.meta_path.insert(0, _FirstTensorFlowImport())


def level_set_by_user() -> bool:
    """Whether the environment's TF_CPP_MIN_LOG_LEVEL is the user's, not `quiet_tensorflow_start`'s."""
    return LEVEL_VARIABLE in os.environ and not _level_set_here


def users_environment() -> dict[str, str]:
    """This process's environment as the user gave it, for a command that it starts (a worker of
    the launcher), which then decides as one that the user started would: without the
    TF_CPP_MIN_LOG_LEVEL that `quiet_tensorflow_start` set, which it would take for the user's."""
    return {name: value for name, value in os.environ.items()
            if name != LEVEL_VARIABLE or level_set_by_user()}


@contextlib.contextmanager
def native_startup_lines_hidden() -> Iterator[None]:
    """Hides what TF's C++ side prints to the process's stderr inside the block. If the block
    fails, the lines are shown after all; a usage error or a Ctrl-C is the user's, not TF's, and
    stays one line."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield
        except (UsageError, KeyboardInterrupt):
            raise
        except BaseException:
            os.dup2(saved, 2)
            sink.seek(0)
            sys.stderr.write(sink.read().decode(errors="replace"))
            raise
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def load_tensorflow() -> None:
    """Loads TensorFlow and probes for GPUs where the lines its C++ side prints are hidden, unless
    it is loaded already. `startup.start` calls it once the checks that need no TensorFlow have
    passed: a bad directory is then refused in a fraction of a second, not after TensorFlow's
    seconds of loading."""
    if "tensorflow" in sys.modules:
        return
    with native_startup_lines_hidden():
        import tensorflow as tf

        tf.config.list_physical_devices("GPU")


class _FirstTensorFlowImport(importlib.abc.MetaPathFinder):
    """Finds `tensorflow` once, as the other finders would, with a loader that hides its lines."""

    def find_spec(self, name, path, target=None):
        if name != "tensorflow":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            spec.loader = _HiddenLinesLoader(spec.loader)
        return spec


class _HiddenLinesLoader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader):
        self._loader = loader

    def __getattr__(self, name: str):  # the wrapped loader's own methods (resources and the like)
        return getattr(self._loader, name)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        with native_startup_lines_hidden():
            self._loader.exec_module(module)
            # Probing for GPUs prints cuInit's lines where CUDA is installed but no driver is.
            module.config.list_physical_devices("GPU")
