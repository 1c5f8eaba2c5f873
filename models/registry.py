"""Maps `--model=NAME` to a network class."""
from __future__ import annotations

from typing import Callable

from tower_train.errors import UsageError
from tower_train.user_code import import_user_module

_MODELS: dict[str, type] = {}


def register(name: str) -> Callable[[type], type]:
    """Class decorator: makes a TowerModel subclass trainable as `--model=name`."""
    def add(cls: type) -> type:
        if name in _MODELS and _MODELS[name] is not cls:
            raise ValueError(f"model name {name!r} is already registered to {_MODELS[name]!r}")
        _MODELS[name] = cls
        return cls
    return add


def model_names() -> tuple[str, ...]:
    return tuple(sorted(_MODELS))


def model_class(name: str, module: str | None = None) -> type:
    """The class registered as `name`, after importing `module` (whose @register may add it).

    Raises:
      UsageError: the module cannot be imported, or no model has that name.
    """
    if module:
        import_user_module(module, "--model_module")
    if name not in _MODELS:
        raise UsageError(f"--model={name}: unknown; registered: {', '.join(model_names())}")
    return _MODELS[name]
