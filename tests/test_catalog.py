"""Tests of tower_train.data.catalog: names looked up among the built-in sets and the registered
ones, a user's function checked, and no module of tower_train importing back one that imports it."""

from __future__ import annotations

import ast
import pathlib

import numpy as np
import pytest

from tower_train.data import source as data
from tower_train.data import catalog
from tower_train.data.array_source import ArraySource
from tower_train.errors import UsageError

PACKAGE = pathlib.Path(catalog.__file__).parent.parent  # tower_train/


def one_line(excinfo, *needles: str) -> str:
    message = str(excinfo.value)
    assert isinstance(excinfo.value, UsageError) and "\n" not in message, message
    for needle in needles:
        assert needle in message, (needle, message)
    return message


def test_an_unknown_name_lists_the_known_ones():
    with pytest.raises(data.DataError) as excinfo:
        catalog.check_dataset("imagenet", None, False)
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

    assert catalog.load_source("test_data_tiny").name == "tiny"
    assert "test_data_tiny" in catalog.dataset_names()
    with pytest.raises(UsageError, match="returned dict, not a tower_train.ArraySource"):
        catalog.load_source("test_data_broken")
    with pytest.raises(UsageError) as excinfo:
        catalog.load_source("test_data_raises")
    one_line(excinfo, "--dataset=test_data_raises", "test_catalog.py:", "RuntimeError: disk on fire")
    with pytest.raises(UsageError, match="--augment: only for the built-in image data sets"):
        catalog.load_source("test_data_tiny", augment=True)


def test_the_built_in_sequence_set_is_registered_as_a_users_would_be():
    assert data.registered()["markov_text"] is catalog.text_sets.markov_text
    with pytest.raises(UsageError, match="--data_dir: only for the built-in image data sets"):
        catalog.check_dataset("markov_text", "/tmp", False)


def package_modules() -> dict[str, pathlib.Path]:
    """Every module of tower_train by its dotted name under it ('data.catalog'; a package by its own)."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imported_modules(path: pathlib.Path, modules) -> set[str]:
    """The tower_train modules that `path` imports anywhere in it, functions included."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tower_train"):
            base = node.module.removeprefix("tower_train").removeprefix(".")
            for alias in node.names:
                full = f"{base}.{alias.name}" if base else alias.name
                names.add(full if full in modules else base)
        elif isinstance(node, ast.Import):
            names |= {a.name.removeprefix("tower_train.") for a in node.names if a.name.startswith("tower_train.")}
    return names & modules.keys()


def test_no_module_of_tower_train_is_part_of_an_import_cycle():
    modules = package_modules()
    graph = {name: imported_modules(path, modules) - {name} for name, path in modules.items()}
    assert {"data.image_sets", "data.text_sets"} <= graph["data.catalog"]
    assert "data.source" in graph["data.image_sets"]

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(nxt == goal or (nxt not in seen and reaches(nxt, goal, seen | {nxt}))
                   for nxt in graph[start])

    assert [name for name in graph if reaches(name, name, {name})] == []
