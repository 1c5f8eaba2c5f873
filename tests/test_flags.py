"""tower_train.flags in this process: one flag per TrainConfig field with the field's type,
default and help; the parsed flags as the config; every recipe in flags/ parsed into the values its
file writes; the launcher's own flag set; the benchmark's measures as flags.md lists them. Each
test leaves the global flags unparsed."""
import dataclasses
import glob
import os
import re
import typing

import pytest
from absl import flags

from tower_train import flags as tt_flags
from tower_train.benchmark.names import MEASURES
from tower_train.config import AUTO_OR_BOOL, TrainConfig
from tower_train.rules import AUTO

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIELDS = dataclasses.fields(TrainConfig)
# absl's flag class for each Python type of a field (bool | None is still a bool flag, and so is
# an option that may also be "auto": its --name and --noname are a bool flag's).
FLAG_TYPES = {str: "string", int: "int", float: "float", bool: "bool", AUTO_OR_BOOL: "bool"}


@pytest.fixture(autouse=True)
def unparsed_flags():
    yield
    flags.FLAGS.unparse_flags()


def field_type(field) -> type:
    annotation = typing.get_type_hints(TrainConfig)[field.name]
    if annotation == AUTO_OR_BOOL:
        return annotation
    choices = [a for a in typing.get_args(annotation) if a is not type(None)] or [annotation]
    assert len(choices) == 1, field.name
    return choices[0]


def test_every_field_of_train_config_is_exactly_one_flag_with_its_type_default_and_help():
    assert list(tt_flags.TRAINING_FLAGS) == [f.name for f in FIELDS]
    for field in FIELDS:
        flag = flags.FLAGS[field.name]
        assert tt_flags.TRAINING_FLAGS[field.name].name == field.name
        assert flag.flag_type() == FLAG_TYPES[field_type(field)], field.name
        assert flag.default == field.default, field.name
        assert flag.help == field.metadata["help"], field.name
    assert tt_flags.MAIN_FLAGS == tuple(f.name for f in FIELDS if f.metadata["main"])
    assert 0 < len(tt_flags.MAIN_FLAGS) < len(FIELDS)


def test_no_flags_give_the_default_config_and_given_flags_reach_their_fields():
    flags.FLAGS(["tower_train"])
    assert tt_flags.config_from_flags() == TrainConfig()
    flags.FLAGS.unparse_flags()
    flags.FLAGS(["tower_train", "--accum=3", "--learning_rate=0.25", "--noaugment", "--augment",
                 "--optimizer=adam", "--clip_norm=2"])
    assert tt_flags.config_from_flags() == TrainConfig(accum=3, learning_rate=0.25, augment=True,
                                                       optimizer="adam", clip_norm=2.0)


@pytest.mark.parametrize("argv,value", [([], AUTO), (["--jit_compile"], True), (["--nojit_compile"], False),
                                        (["--jit_compile=auto"], AUTO), (["--jit_compile=false"], False)])
def test_an_option_that_may_be_auto_takes_a_bool_flags_forms_and_auto(argv, value):
    flags.FLAGS(["tower_train", *argv])
    assert tt_flags.config_from_flags().jit_compile == value


def test_an_option_that_may_be_auto_names_its_values_when_given_another():
    with pytest.raises(flags.IllegalFlagValueError, match="allowed: true, false, auto"):
        flags.FLAGS(["tower_train", "--jit_compile=sometimes"])


def recipe_values(path: str) -> dict[str, object]:
    """A recipe's `--name=value` and `--name` lines, read here, as the fields' types."""
    types = {f.name: field_type(f) for f in FIELDS}
    values = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            name, _, text = line.removeprefix("--").partition("=")
            values[name] = True if not text else types[name](text)
    return values


RECIPES = sorted(glob.glob(os.path.join(ROOT, "flags", "*.flags")))


def test_the_recipes_are_the_ones_the_docs_name():
    assert [os.path.basename(p) for p in RECIPES] == ["cifar10.flags", "main.flags", "quick.flags",
                                                      "sequence.flags"]


@pytest.mark.parametrize("path", RECIPES, ids=os.path.basename)
def test_a_recipe_parses_into_the_values_its_file_writes_and_defaults_elsewhere(path):
    written = recipe_values(path)
    assert written and set(written) <= set(tt_flags.TRAINING_FLAGS)
    flags.FLAGS(["tower_train", f"--flagfile={path}"])
    config = tt_flags.config_from_flags()
    for field in FIELDS:
        assert getattr(config, field.name) == written.get(field.name, field.default), field.name


def test_the_launchers_flags_are_a_set_of_their_own():
    launch_flags, holders = tt_flags.define_launch_flags()
    rest = launch_flags(["launch", "--workers=3", "--port=5000", "--", "--num_gpus=2"])
    assert (holders["workers"].value, holders["port"].value, holders["help"].value) == (3, 5000, False)
    assert rest == ["launch", "--num_gpus=2"]
    assert sorted(holders) == ["help", "port", "workers"] and set(launch_flags) == {"workers", "port",
                                                                                   "help", "h"}
    assert "workers" not in flags.FLAGS and "num_gpus" not in launch_flags


def test_flags_md_lists_each_measure_of_the_benchmark():
    with open(os.path.join(ROOT, "docs", "flags.md")) as f:
        listed = re.search(r"`--measure` \(([^)]*)\)", f.read()).group(1)
    assert re.findall(r"`(\w+)`", listed) == list(MEASURES)
