"""tower_train.fit's bad input: a UsageError of one line that names the culprit, raised before
anything is written; errors in the user's own model code name its file and line."""
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import tower_train
from test_cli_errors import run_cli


class FiveLogits(tower_train.TowerModel):
    """Logits [B, 5]: too few for labels up to 9."""

    def __init__(self, num_classes: int = 5, **kwargs):
        super().__init__(num_classes, **kwargs)
        self.logits = keras.layers.Dense(num_classes)

    def call(self, features, training=False):
        return self.logits(keras.layers.Flatten()(features))


class VectorRegularization(FiveLogits):
    def regularization(self):
        return tf.ones([3])


class BrokenInit(tower_train.TowerModel):
    def __init__(self, num_classes: int = 10, **kwargs):
        super().__init__(num_classes, **kwargs)
        raise RuntimeError("no weights today")


def arrays(classes=10, n=16):
    rng = np.random.default_rng(0)
    return tower_train.ArraySource(rng.normal(size=(n, 4)).astype(np.float32),
                                   np.arange(n) % classes)


CASES = [
    (dict(accum=0), "--accum=0: must be a whole number >= 1"),
    (dict(learning_rate=float("inf")), "--learning_rate=inf: must be a finite number > 0"),
    (dict(seed=2**32), "--seed=4294967296: must be a whole number <= 4294967295"),
    (dict(no_such_option=1), "fit(): unknown option 'no_such_option'"),
    (dict(model=42), "model=42: expected a registered name, a tower_train.TowerModel subclass"),
    (dict(model=dict), "model=builtins.dict: is not a subclass of tower_train.TowerModel"),
    (dict(model="no_such_net"), "--model=no_such_net: unknown; registered: "),
    (dict(data=[1, 2]), "data=list: expected a tower_train.ArraySource"),
    (dict(data="no_such_data"), "--dataset=no_such_data: unknown; registered: "),
    (dict(model=FiveLogits, data=arrays()),
     "model=test_api.FiveLogits: its logits are [1, 5] for labels [1] in 0..9 of arrays; they must be [1, C >= 10]"),
    (dict(model=VectorRegularization, data=arrays(classes=5)),
     "model=test_api.VectorRegularization: regularization() returned shape [3]; it must be a scalar"),
    (dict(model=BrokenInit, data=arrays()),
     "model=test_api.BrokenInit: " + __file__ + ":"),
    (dict(model=FiveLogits, data=arrays(classes=5), augment=True),
     "augment: is for a named --dataset; data=arrays was given as a source"),
    (dict(mode="central_storage", model="resnet20"), "--mode=central_storage: --model=resnet20 has moving statistics"),
]


@pytest.mark.parametrize("arguments,message", CASES, ids=[m[:40] for _, m in CASES])
def test_bad_input_to_fit_is_one_usage_error_line_and_writes_nothing(tmp_path, arguments, message):
    train_dir = tmp_path / "run"
    with pytest.raises(tower_train.UsageError) as error:
        tower_train.fit(train_dir=str(train_dir), num_gpus=2, max_steps=1, **arguments)
    assert message in str(error.value) and "\n" not in str(error.value), error.value
    assert not train_dir.exists()


def test_a_train_dir_of_another_run_is_refused_naming_a_fresh_one(tmp_path):
    run = tmp_path / "run"
    options = dict(model=FiveLogits, data=arrays(classes=5), train_dir=str(run), num_gpus=2,
                   batch_size=4, max_steps=1)
    assert tower_train.fit(**options).step == 1
    (tmp_path / "run_2").mkdir()  # taken: the suggestion skips it
    before = sorted(os.listdir(run))
    with pytest.raises(tower_train.UsageError) as error:
        tower_train.fit(**{**options, "seed": 1, "max_steps": 2})
    assert f"holds another run: seed 0 there, 1 here" in str(error.value)
    assert str(error.value).endswith(f"or add --train_dir={tmp_path / 'run_3'}")
    assert sorted(os.listdir(run)) == before


def test_an_error_in_a_models_own_code_is_one_line_unless_a_traceback_is_asked_for(tmp_path):
    (tmp_path / "broken_models.py").write_text(
        "from tower_train.models import TowerModel, register\n\n\n"
        "@register('broken')\n"
        "class Broken(TowerModel):\n"
        "    def call(self, images, training=False):\n"
        "        return images[:, 99999]\n")
    args = ["--model_module=broken_models", "--model=broken", f"--train_dir={tmp_path / 'run'}"]
    result = run_cli(*args, cwd=tmp_path)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith(f"tower_train: error: --model=broken, called on float32 [1, 24, 24, 3]: "
                               f"{tmp_path / 'broken_models.py'}:7: ")
    shown = run_cli(*args, cwd=tmp_path, env={"TOWER_TRAIN_TRACEBACK": "1"})
    assert shown.returncode == 2 and "Traceback (most recent call last)" in shown.stderr
    assert not (tmp_path / "run").exists()
