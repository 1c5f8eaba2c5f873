"""Tests of tower_train.datasets: names looked up among the built-in sets and the registered
ones, a user's function checked, and no module of tower_train importing back one that imports it."""

from __future__ import annotations

import ast
import pathlib

import numpy as np
import pytest

from tower_train import data, datasets
from tower_train.array_source import ArraySource
from tower_train.errors import UsageError

PACKAGE = pathlib.Path(datasets.__file__).parent


def one_line(excinfo, *needles: str) -> str:
    message = str(excinfo.value)
    assert isinstance(excinfo.value, UsageError) and "\n" not in message, message
    for needle in needles:
        assert needle in message, (needle, message)
    return message


def test_an_unknown_name_lists_the_known_ones():
    with pytest.raises(data.DataError) as excinfo:
        datasets.check_dataset("imagenet", None, False)
    one_line(excinfo, "--dataset=imagenet", "cifar10", "markov_text", "synthetic", "--data_module")


def test_registered_data_sets_are_loaded_by_name_and_checked():
    @data.register("test_data_tiny")
    def tiny():
        return ArraySource(np.zeros((4, 2)), np.arange(4), name="tiny")

    @data.register("test_data_broken")
    def broken():
        return {"not": "a source"}

    @data.register("test_data_raises")
    def raises():
        raise RuntimeError("disk on fire")

    assert datasets.load_source("test_data_tiny").name == "tiny"
    assert "test_data_tiny" in datasets.dataset_names()
    with pytest.raises(UsageError, match="returned dict, not a tower_train.ArraySource"):
        datasets.load_source("test_data_broken")
    with pytest.raises(UsageError) as excinfo:
        datasets.load_source("test_data_raises")
    one_line(excinfo, "--dataset=test_data_raises", "test_datasets.py:", "RuntimeError: disk on fire")
    with pytest.raises(UsageError, match="--augment: only for the built-in image data sets"):
        datasets.load_source("test_data_tiny", augment=True)


def test_the_built_in_sequence_set_is_registered_as_a_users_would_be():
    assert data.registered()["markov_text"] is datasets.text_data.markov_text
    with pytest.raises(UsageError, match="--data_dir: only for the built-in image data sets"):
        datasets.check_dataset("markov_text", "/tmp", False)


def imported_modules(path: pathlib.Path) -> set[str]:
    """The tower_train modules that `path` imports anywhere in it, functions included."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "tower_train":
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tower_train."):
            names.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            names |= {a.name.split(".")[1] for a in node.names if a.name.startswith("tower_train.")}
    return names


def test_no_module_of_tower_train_is_part_of_an_import_cycle():
    modules = {path.stem: path for path in PACKAGE.glob("*.py")}
    graph = {name: imported_modules(path) & modules.keys() - {name} for name, path in modules.items()}
    assert {"image_data", "text_data"} <= graph["datasets"] and "data" in graph["image_data"]

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(nxt == goal or (nxt not in seen and reaches(nxt, goal, seen | {nxt}))
                   for nxt in graph[start])

    assert [name for name in graph if reaches(name, name, {name})] == []
