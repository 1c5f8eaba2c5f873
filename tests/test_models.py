"""The model base class and registry, and the README's "Adding a model" example, run as written."""
import re
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

import models
from tower_train.errors import UsageError
from test_cli_errors import ROOT, run_cli


def readme_model_example() -> str:
    readme = (Path(ROOT) / "README.md").read_text()
    section = readme[readme.index("## Adding a model"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_readme_example_trains_from_the_command_line(tmp_path):
    (tmp_path / "my_models.py").write_text(readme_model_example())
    result = run_cli("--model_module=my_models", "--model=tiny_mlp", "--num_gpus=2", "--accum=2",
                     "--batch_size=8", "--max_steps=2", "--log_every=1",
                     f"--train_dir={tmp_path / 'run'}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "step 2, loss = " in result.stderr and "held-out precision" in result.stderr


def test_cifar10_cnn_is_the_original_network():
    model = models.model_class("cifar10_cnn")(num_classes=10)
    logits = model(tf.zeros([2, 24, 24, 3]))
    assert logits.shape == (2, 10)
    shapes = [tuple(v.shape) for v in model.trainable_variables]
    assert shapes == [(5, 5, 3, 64), (64,), (5, 5, 64, 64), (64,), (2304, 384), (384,),
                      (384, 192), (192,), (192, 10), (10,)]
    assert sum(int(np.prod(s)) for s in shapes) == 1_068_298  # "about 1.07 M parameters"
    expected = 0.004 * sum(float(tf.reduce_sum(tf.square(k))) / 2
                           for k in (model.local3.kernel, model.local4.kernel))
    assert float(model.regularization()) == pytest.approx(expected, rel=1e-5)


def test_unknown_model_names_the_registered_ones():
    with pytest.raises(UsageError, match="registered: .*cifar10_cnn"):
        models.model_class("no_such_model")


def test_a_name_cannot_be_taken_twice():
    with pytest.raises(ValueError, match="already registered"):
        models.register("cifar10_cnn")(type("Other", (models.TowerModel,), {}))
