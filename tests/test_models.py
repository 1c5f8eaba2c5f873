"""The model base class and registry; the README's own-network script and the docs' registered
model, run as written; user modules for --model_module and --data_module in the current directory."""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

import tower_train
import tower_train.models as models
from tower_train.data import catalog
from tower_train.errors import UsageError
from test_cli_errors import ROOT, run_cli


def python_block(document: str, heading: str) -> str:
    """The first ```python block after `heading` in a Markdown file of the repository."""
    text = (Path(ROOT) / document).read_text()
    section = text[text.index(heading):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def readme_model_example() -> str:
    """docs/models.md's my_models.py: the TowerModel, then the Keras function registered below it."""
    return (python_block("docs/models.md", "## Adding a model") + "\n\n"
            + python_block("docs/models.md", "A plain Keras model registers as a function"))


def test_the_readme_keras_script_trains_the_users_own_sequential_on_arrays(tmp_path):
    script = python_block("README.md", "## Your own network on your own data")
    assert '"/tmp/tower_train_keras"' in script and "keras.Sequential" in script
    (tmp_path / "my_keras_training.py").write_text(
        script.replace("/tmp/tower_train_keras", str(tmp_path / "run")))
    result = subprocess.run([sys.executable, "my_keras_training.py"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    match = re.search(r"step 60: loss ([\d.]+), held-out precision @ 1 = ([\d.]+) over 2048 "
                      r"examples\nmodel.predict agrees with the labels on ([\d.]+)", result.stdout)
    assert match, result.stdout
    assert float(match.group(2)) > 0.5  # 16 classes: chance is 0.06
    # The user's own Sequential holds the trained weights the held-out evaluation used.
    assert abs(float(match.group(3)) - float(match.group(2))) <= 0.002, result.stdout
    assert (tmp_path / "run" / "ckpt-60.index").exists()


def test_the_readme_script_trains_a_user_network_on_user_arrays(tmp_path):
    script = python_block("README.md", "**Owning the loss: a `TowerModel`.**")
    assert '"/tmp/tower_train_mlp"' in script
    (tmp_path / "my_training.py").write_text(script.replace("/tmp/tower_train_mlp", str(tmp_path / "run")))
    result = subprocess.run([sys.executable, "my_training.py"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    match = re.search(r"step 60: loss ([\d.]+), held-out precision @ 1 = ([\d.]+) over 2048 examples",
                      result.stdout)
    assert match, result.stdout
    assert float(match.group(2)) > 0.5  # 16 classes: chance is 0.06
    assert (tmp_path / "run" / "ckpt-60.index").exists()


def test_the_readme_tfrecord_script_streams_its_files_and_trains(tmp_path):
    script = python_block("README.md", "**Streaming files.**")
    assert script.count("/tmp/tower_train_records") == 4
    (tmp_path / "my_records.py").write_text(script.replace("/tmp/tower_train_records",
                                                           str(tmp_path / "records")))
    result = subprocess.run([sys.executable, "my_records.py"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r"step 20: held-out precision @ 1 = [\d.]+ over 256 examples", result.stdout), \
        result.stdout
    assert sorted(p.name for p in (tmp_path / "records").iterdir()) == [
        "eval.tfrecord", "train-0.tfrecord", "train-1.tfrecord"]
    assert (tmp_path / "records_run" / "ckpt-20.index").exists()


USER_MODULE = '''
import keras
import numpy as np

import tower_train
from tower_train.models import TowerModel, register


@register("user_sequence_tagger")
class Tagger(TowerModel):
    """Token ids [B, 6] -> logits [B, 6, num_classes]: one label per token."""

    def __init__(self, num_classes, **kwargs):
        super().__init__(num_classes, **kwargs)
        self.embed = keras.layers.Embedding(50, 8)
        self.logits = keras.layers.Dense(num_classes)

    def call(self, tokens, training=False):
        return self.logits(self.embed(tokens))


@tower_train.data.source.register("user_tokens")
def tokens():
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 50, (256, 6))
    return tower_train.ArraySource(ids, ids % 12, eval_features=ids[:64], eval_labels=ids[:64] % 12,
                                   name="user_tokens")
'''


@pytest.mark.parametrize("how", ["python -m", "console script"])
def test_modules_in_the_current_directory_register_models_and_data(tmp_path, how):
    # Named models.py on purpose: the product must neither shadow nor be shadowed by it.
    (tmp_path / "models.py").write_text(USER_MODULE)
    command = ([sys.executable, "-m", "tower_train"] if how == "python -m"
               else [shutil.which("tower-train", path=os.path.dirname(sys.executable))])
    assert command[0], "the tower-train console script is not installed beside this python"
    result = subprocess.run(
        [*command, "--model_module=models", "--model=user_sequence_tagger", "--data_module=models",
         "--dataset=user_tokens", "--num_gpus=2", "--accum=2", "--batch_size=4", "--max_steps=3",
         "--optimizer=sgd", "--learning_rate=0.5", f"--train_dir={tmp_path / 'run'}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TF_CONFIG")})
    assert result.returncode == 0, result.stderr[-3000:]
    # 64 held-out sequences of 6 tokens: precision is over tokens, every one counted once.
    assert "done: step 3" in result.stderr and "(64 examples)" in result.stderr


@pytest.mark.parametrize("name", ["tiny_mlp", "keras_mlp"])
def test_the_docs_registered_models_train_from_the_command_line(tmp_path, name):
    (tmp_path / "my_models.py").write_text(readme_model_example())
    result = run_cli("--model_module=my_models", f"--model={name}", "--num_gpus=2", "--accum=2",
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


def small_keras_network():
    import keras

    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(5, activation="tanh"),
                             keras.layers.Dense(3)])


# Registered with a loss that differs from the default one a mix-up would fall back on: sums the
# per-label cross-entropy times 3, so the update is 3 times as large.
def _tripled_cross_entropy(labels, logits):
    return 3.0 * tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits)


models.register("test_registered_keras", loss=_tripled_cross_entropy)(small_keras_network)


def test_a_registered_keras_function_trains_with_its_registered_loss(tmp_path):
    rng = np.random.default_rng(0)
    arrays = (rng.normal(size=(32, 4)).astype(np.float32), rng.integers(0, 3, 32))
    options = dict(data=arrays, shuffle=False, num_gpus=2, batch_size=4, accum=2, max_steps=2,
                   optimizer="sgd", learning_rate=0.1, ema_decay=0.0)
    by_name = tower_train.fit(model="test_registered_keras", train_dir=tmp_path / "a", **options)
    by_function = tower_train.fit(model=small_keras_network, loss=_tripled_cross_entropy,
                                  train_dir=tmp_path / "b", **options)
    plain = tower_train.fit(model=small_keras_network, loss="sparse_categorical_crossentropy",
                            train_dir=tmp_path / "c", **options)
    assert by_name.loss == by_function.loss != plain.loss
    for got, want in zip(by_name.model.get_weights(), by_function.model.get_weights(), strict=True):
        np.testing.assert_array_equal(got, want)


def test_register_refuses_a_loss_for_a_tower_model_and_a_function_without_one():
    with pytest.raises(ValueError, match="TowerModel, which owns its loss"):
        models.register("test_owns_its_loss", loss="mse")(type("Owner", (models.TowerModel,), {}))
    with pytest.raises(ValueError, match="a zero-argument function returning a keras.Model with its loss="):
        models.register("test_no_loss")(small_keras_network)
    assert "test_owns_its_loss" not in models.model_names() and "test_no_loss" not in models.model_names()


@pytest.mark.parametrize("extra,message", [
    (dict(loss="mse"), "loss=: --model=test_registered_keras was registered with its loss"),
    (dict(num_classes=3), "num_classes=3: --model=test_registered_keras is a registered function")])
def test_fit_refuses_a_second_loss_or_num_classes_for_a_registered_keras_function(tmp_path, extra,
                                                                                   message):
    with pytest.raises(UsageError, match=re.escape(message)):
        tower_train.fit(model="test_registered_keras", data=(np.zeros((8, 4), np.float32),
                        np.zeros(8, int)), train_dir=tmp_path / "run", max_steps=1, **extra)
    assert not (tmp_path / "run").exists()


def test_tiny_transformer_is_causal_and_recompute_keeps_its_gradients():
    from tower_train.data import text_sets
    from tower_train.step.towers import tower_loss_and_gradients

    source = catalog.load_source("markov_text")
    features, labels, label_weights = (tf.constant(a[:4]) for a in (
        source.train_features, source.train_labels, source.train_weights))
    results = {}
    for recompute in (False, True):
        tf.keras.utils.set_random_seed(0)
        model = models.model_class("tiny_transformer")(num_classes=text_sets.VOCABULARY,
                                                      recompute=recompute)
        logits = model(features)
        assert logits.shape == (4, text_sets.LENGTH, text_sets.VOCABULARY)
        # Causal: changing the last token changes no earlier position's logits.
        changed = tf.concat([features[:, :-1], (features[:, -1:] + 1) % text_sets.VOCABULARY], axis=1)
        np.testing.assert_allclose(model(changed)[:, :-1], logits[:, :-1], atol=1e-5)

        @tf.function
        def tower(model=model):
            with tf.name_scope("tower_0"):
                return tower_loss_and_gradients(model, features, labels, label_weights)

        result = tower()
        results[recompute] = float(result.loss_sum), float(result.weight_sum), [g.numpy() for g in result.gradients]
    assert results[True][:2] == pytest.approx(results[False][:2], rel=1e-6)
    assert results[False][1] == float(label_weights.numpy().sum())  # real tokens only
    for got, want in zip(results[True][2], results[False][2], strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_markov_text_is_padded_next_token_data_with_a_weak_unigram_baseline():
    from tower_train.data import text_sets

    source = catalog.load_source("markov_text")
    x, y, w = source.train_features, source.train_labels, source.train_weights
    assert x.shape == y.shape == w.shape == (8000, text_sets.LENGTH) and source.num_classes == 32
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])  # labels are the next tokens
    real = w.sum(axis=1).astype(int)
    assert real.min() == 7 and real.max() == 47 and len(set(real)) > 30  # lengths vary
    for row, tokens in zip(x[:50], real[:50]):
        assert row[0] == text_sets.START and (row[tokens + 1:] == text_sets.PAD).all()
    assert all(y[i, real[i] - 1] == text_sets.END for i in range(50))
    assert ((w == 0) == (y == text_sets.PAD)).all()  # weight 0 exactly on padding
    assert 0.02 < text_sets.unigram_precision() < 0.1


def test_a_model_module_is_a_module_name_or_a_path_to_a_py_file(tmp_path, monkeypatch):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "path_models.py").write_text(
        "from tower_train.models import TowerModel, register\n\n\n"
        "@register('from_a_path')\nclass FromAPath(TowerModel):\n    pass\n")
    monkeypatch.chdir(tmp_path)
    by_relative = models.model_class("from_a_path", "./sub/path_models.py")
    assert by_relative.__name__ == "FromAPath"
    assert models.model_class("from_a_path", str(tmp_path / "sub" / "path_models.py")) is by_relative
    for module, message in [
            ("./sub/missing.py", "--model_module=./sub/missing.py: no such file; give a module name "
                                 "(my_models) or a path to a .py file (./my_models.py)"),
            ("./sub", "--model_module=./sub: not a .py file with a name Python can import; give a "
                      "module name"),
            ("no_such_module_xyz", f"--model_module=no_such_module_xyz: no such module in {tmp_path} "
                                   "or on PYTHONPATH")]:
        with pytest.raises(UsageError) as error:
            models.model_class("from_a_path", module)
        assert str(error.value).startswith(message), error.value
