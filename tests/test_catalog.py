"""Tests of tower_train.data.catalog: names looked up among the built-in sets and the registered
ones, and a user's function checked."""

from __future__ import annotations

import numpy as np
import pytest

from tower_train.data import source as data
from tower_train.data import catalog
from tower_train.data.array_source import ArraySource
from tower_train.errors import UsageError


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

