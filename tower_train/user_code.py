"""Running the user's own code (a --model_module, a data set function, a model's __init__): an
error there becomes one line that names the user's file and line, never a traceback.

Set the environment variable TOWER_TRAIN_TRACEBACK=1 to have the CLI print the full traceback
of such an error as well.
"""
from __future__ import annotations

import importlib
import os
import sys
import sysconfig
import traceback
from typing import Callable, TypeVar

from tower_train.errors import UsageError, first_line

T = TypeVar("T")
TRACEBACK_VARIABLE = "TOWER_TRAIN_TRACEBACK"
# Frames under these directories are not the user's: this package (and tower_train.models, which
# lives in the repository's models/ folder), the installed libraries and Python's own.
_NOT_THE_USERS = tuple(os.path.join(os.path.realpath(path), "") for path in (
    os.path.dirname(__file__), os.path.join(os.path.dirname(os.path.dirname(__file__)), "models"),
    *{sysconfig.get_paths()[key] for key in ("stdlib", "purelib", "platlib")}))


class UserCodeError(UsageError):
    """The user's own code raised; the message names its file:line. `__cause__` holds the error."""


def where(error: BaseException) -> str:
    """file:line of the innermost frame of the error's traceback that is the user's (not this
    package's, a library's or Python's); for a SyntaxError, the offending line itself."""
    if isinstance(error, SyntaxError) and error.filename:
        return f"{error.filename}:{error.lineno}"
    frames = traceback.extract_tb(error.__traceback__)
    mine = [f for f in frames if not os.path.realpath(f.filename).startswith(_NOT_THE_USERS)
            and not f.filename.startswith("<")]
    frame = (mine or frames or [None])[-1]
    return "?" if frame is None else f"{frame.filename}:{frame.lineno}"


def describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {first_line(error)}"


def call_user_code(function: Callable[[], T], what: str) -> T:
    """`function()`, whose errors are the user's: UsageError passes as it is, any other becomes a
    UserCodeError "<what>: <file>:<line>: <Type>: <message>"."""
    try:
        return function()
    except UsageError:
        raise
    except Exception as e:  # the user's code may raise anything
        raise UserCodeError(f"{what}: {where(e)}: {describe(e)}") from e


def import_user_module(module: str, flag: str) -> None:
    """Imports the user's module for `flag` (--model_module, --data_module), the current
    directory first, as `python -m` would find it, whichever way tower-train was started."""
    cwd = os.getcwd()
    added = cwd not in sys.path and "" not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name and (e.name == module or module.startswith(e.name + ".")):
            raise UsageError(f"{flag}={module}: no such module in {cwd} or on PYTHONPATH") from None
        raise UserCodeError(f"{flag}={module}: {where(e)}: {describe(e)}") from e
    except UsageError:
        raise
    except BaseException as e:  # SyntaxError and anything its top level raises, SystemExit too
        if isinstance(e, KeyboardInterrupt):
            raise
        raise UserCodeError(f"{flag}={module}: {where(e)}: {describe(e)}") from e
    finally:
        if added:
            sys.path.remove(cwd)
