"""The data sets a run names with ``--dataset``: the built-in image sets (``synthetic``,
``cifar10``, `tower_train.data.image_sets`), the built-in sequence set (``markov_text``,
`tower_train.data.text_sets`), the built-in ImageNet-shaped set (``synthetic_imagenet``,
`tower_train.data.imagenet_shaped`) and those a user's module registers with
`tower_train.data.register`.

It imports the built-in sets and `tower_train.data.source`; neither imports it back.
"""
from __future__ import annotations

from typing import Callable

from tower_train.data import image_sets
from tower_train.data import imagenet_shaped
from tower_train.data import text_sets
from tower_train.data.source import DataError, Source, register, registered
from tower_train.user_code import call_user_code

# markov_text and synthetic_imagenet are registered as a user's set would be: they take no
# --data_dir or --augment.
register("markov_text")(text_sets.markov_text)
register("synthetic_imagenet")(imagenet_shaped.synthetic_imagenet)


def dataset_names() -> tuple[str, ...]:
    return tuple(sorted({*image_sets.BUILT_IN, *registered()}))


def check_dataset(name: str, data_dir: str | None, augment: bool) -> None:
    """Cheap start-up check of --dataset with --data_dir and --augment; reads no file contents."""
    if name in image_sets.BUILT_IN:
        image_sets.check_data_dir(name, data_dir)
        return
    if name not in registered():
        raise DataError(f"--dataset={name}: unknown; registered: {', '.join(dataset_names())} "
                        "(a module of yours registers more: --data_module=MODULE)")
    for flag, given in (("--data_dir", data_dir is not None), ("--augment", augment)):
        if given:
            raise DataError(f"{flag}: only for the built-in image data sets (synthetic, cifar10); "
                            f"--dataset={name} reads and preprocesses its own data")


def load_source(name: str, data_dir: str | None = None, augment: bool = False) -> Source:
    """The source registered as `name` (check_dataset first).

    Raises:
      DataError: anything unusable, in one line; a user's function that fails or returns
        something else is named with its error.
    """
    check_dataset(name, data_dir, augment)
    if name in image_sets.BUILT_IN:
        return image_sets.load(name, data_dir, augment)
    factory = registered()[name]
    source = call_user_code(factory, f"--dataset={name}")
    if not isinstance(source, Source):
        raise DataError(f"--dataset={name}: {_qualified(factory)} returned {type(source).__name__}, "
                        "not a tower_train.ArraySource or another tower_train.data.source.Source")
    return source


def _qualified(function: Callable) -> str:
    return f"{getattr(function, '__module__', '?')}.{getattr(function, '__qualname__', function)}"
