"""--export_dir: a SavedModel of the averaged weights, raw features in (uint8 images for the
built-in data), logits out, that loads without tower-train and refuses any other shape; and
nothing is ever overwritten."""
import logging
import os
import stat
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
from absl import logging as absl_logging

import tower_train.models as models
from tower_train import config, export
from tower_train.data import catalog
from tower_train.data import image_sets
from tower_train.model_spec import ModelSpec
from tower_train.errors import UsageError
from helpers import END_PAUSE_LIMIT, end_pause_seconds
from test_cli_errors import run_cli

# Loads the SavedModel with the project's packages blocked, and writes the logits of some images.
LOAD_WITHOUT_TOWER_TRAIN = """
import sys
sys.modules["tower_train"] = None
sys.modules["models"] = None
import numpy as np
import tensorflow as tf

export_dir, images_file, logits_file = sys.argv[1:]
serve = tf.saved_model.load(export_dir).signatures["serving_default"]
spec = serve.structured_input_signature[1]["features"]
assert spec.shape.as_list() == [None, 32, 32, 3] and spec.dtype == tf.uint8, spec
logits = serve(features=tf.constant(np.load(images_file)))["logits"]
assert logits.dtype == tf.float32 and logits.shape[1:] == [10], logits
np.save(logits_file, logits.numpy())
"""


def raw_images():
    """uint8 [18, 32, 32, 3]: 16 held-out images, a black one and a white one (zero variance)."""
    held_out = catalog.load_source("synthetic", None).eval_features[:16]
    flat = np.stack([np.zeros((32, 32, 3), np.uint8), np.full((32, 32, 3), 255, np.uint8)])
    return np.concatenate([held_out, flat])


def cnn_from_checkpoint(path, moving_average):
    """cifar10_cnn with the checkpoint's weights, or with its moving averages read by name."""
    with tf.device("/cpu:0"):
        model = models.model_class("cifar10_cnn")(num_classes=10)
        model(tf.zeros([1, 24, 24, 3]))
    tf.train.Checkpoint(model=model).restore(path).expect_partial().assert_existing_objects_matched()
    if moving_average:
        for i, weight in enumerate(model.trainable_variables):
            weight.assign(tf.train.load_variable(path, f"moving_average/averages/{i}/.ATTRIBUTES/VARIABLE_VALUE"))
    return model


def test_the_export_serves_the_averaged_weights_without_tower_train(tmp_path):
    train_dir, export_dir = tmp_path / "run", tmp_path / "export"
    result = run_cli("--max_steps=2", "--batch_size=8", "--num_gpus=2", "--optimizer=sgd",
                     "--learning_rate=0.1", "--log_every=100", f"--train_dir={train_dir}",
                     f"--export_dir={export_dir}")
    assert result.returncode == 0, result.stderr
    assert f"exporting a SavedModel to {export_dir}" in result.stderr
    assert f"exported the moving average of the weights (--ema_decay > 0) to {export_dir}" in result.stderr
    assert "done: step 2" in result.stderr.strip().splitlines()[-1]
    assert "exported in " in result.stderr
    assert end_pause_seconds(result.stderr, 2) <= END_PAUSE_LIMIT, result.stderr
    assert sorted(os.listdir(tmp_path)) == ["export", "run"]  # no staging directory left
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(export_dir).st_mode & 0o777 == 0o777 & ~umask  # as a plain mkdir would make it

    images = raw_images()
    np.save(tmp_path / "images.npy", images)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TF_CONFIG")}
    loaded = subprocess.run(
        [sys.executable, "-c", LOAD_WITHOUT_TOWER_TRAIN, str(export_dir), str(tmp_path / "images.npy"),
         str(tmp_path / "logits.npy")], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=300)
    assert loaded.returncode == 0, loaded.stderr
    served = np.load(tmp_path / "logits.npy")

    checkpoint = str(train_dir / "ckpt-2")
    averaged = cnn_from_checkpoint(checkpoint, moving_average=True)
    with tf.device("/cpu:0"):
        expected = averaged(image_sets.center_standardize(images)).numpy()
        trained = cnn_from_checkpoint(checkpoint, moving_average=False)(
            image_sets.center_standardize(images)).numpy()
    assert served.shape == (18, 10)
    np.testing.assert_allclose(served, expected, rtol=1e-5, atol=1e-5)
    assert np.max(np.abs(served - trained)) > 1e-3  # the averages, not the trained weights


def test_a_non_empty_export_dir_is_refused_at_start_up_and_left_untouched(tmp_path):
    export_dir = tmp_path / "export"
    export_dir.mkdir()
    (export_dir / "saved_model.pb").write_text("precious")
    result = run_cli("--max_steps=1", f"--train_dir={tmp_path / 'run'}", f"--export_dir={export_dir}")
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines == [f"tower_train: error: --export_dir={export_dir}: exists and is not empty; "
                     "name a new directory (nothing is overwritten)"]
    assert sorted(os.listdir(tmp_path)) == ["export"]  # no train_dir either
    assert os.listdir(export_dir) == ["saved_model.pb"]
    assert (export_dir / "saved_model.pb").read_text() == "precious"


@pytest.mark.parametrize("target", ["empty_dir", "missing"])
def test_a_link_at_export_dir_is_refused_at_start_up_and_nothing_is_written(tmp_path, target):
    """A link to an empty directory passed the check and the run failed after training, on the
    move ("Not a directory"); a dangling link the same way."""
    export_dir = tmp_path / "export"
    if target == "empty_dir":
        (tmp_path / target).mkdir()
    export_dir.symlink_to(tmp_path / target)
    result = run_cli("--max_steps=1", f"--train_dir={tmp_path / 'run'}", f"--export_dir={export_dir}")
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"tower_train: error: --export_dir={export_dir}: is a symbolic link to {tmp_path / target}; "
        "name the directory itself (nothing is written through a link)"]
    assert sorted(os.listdir(tmp_path)) == sorted({"export", target} - {"missing"})  # no train_dir
    assert target == "missing" or os.listdir(tmp_path / target) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="gives a directory to another user (chown)")
def test_an_empty_export_dir_that_the_sticky_bit_keeps_from_this_user_is_refused_at_start_up(
        tmp_path, monkeypatch):
    """In a sticky directory such as /tmp only its owner may replace another user's empty
    directory: the move at the end would fail with EPERM, after training."""
    parent = tmp_path / "shared"
    parent.mkdir()
    os.chmod(parent, 0o1777)
    export_dir = parent / "export"
    export_dir.mkdir()
    os.chown(export_dir, 12345, 12345)
    monkeypatch.setattr(config.os, "geteuid", lambda: 23456)  # neither root nor an owner
    with pytest.raises(UsageError) as error:
        config.check_export_dir(str(export_dir))
    assert str(error.value) == (f"--export_dir={export_dir}: belongs to another user in {parent}, "
                                "whose sticky bit lets only its owner replace it; name a new "
                                "directory")
    monkeypatch.setattr(config.os, "geteuid", lambda: 12345)  # its owner may
    config.check_export_dir(str(export_dir))


CNN = ModelSpec("cifar10_cnn", lambda: models.model_class("cifar10_cnn")(num_classes=10))


def fresh_cnn():
    with tf.device("/cpu:0"):
        model = CNN.make()
        model(tf.zeros([1, 24, 24, 3]))
    return model


def test_export_dir_filled_while_writing_is_not_overwritten(tmp_path, monkeypatch):
    export_dir = tmp_path / "export"
    save = tf.saved_model.save

    def save_then_someone_writes(*args, **kwargs):
        save(*args, **kwargs)
        export_dir.mkdir()
        (export_dir / "theirs").write_text("precious")

    monkeypatch.setattr(export.tf.saved_model, "save", save_then_someone_writes)
    with pytest.raises(UsageError, match="exists and is not empty"):
        export.export_saved_model(CNN, catalog.load_source("synthetic"), fresh_cnn(), None, str(export_dir))
    assert sorted(os.listdir(tmp_path)) == ["export"]  # the staging directory is gone
    assert os.listdir(export_dir) == ["theirs"]
    assert (export_dir / "theirs").read_text() == "precious"


def test_without_a_moving_average_the_trained_weights_go_into_an_empty_export_dir_of_its_mode(
        tmp_path, caplog):
    export_dir = tmp_path / "export"
    export_dir.mkdir()  # empty: allowed
    os.chmod(export_dir, 0o701)  # no umask makes this; the staging directory replaced it with 0o755
    model = fresh_cnn()
    verbosity = absl_logging.get_verbosity()
    absl_logging.set_verbosity(absl_logging.INFO)  # as the CLI does; else saving resets it to WARNING
    try:
        with caplog.at_level(logging.INFO):
            export.export_saved_model(CNN, catalog.load_source("synthetic"), model, None, str(export_dir))
    finally:
        absl_logging.set_verbosity(verbosity)
    assert "exported the trained weights (no moving average: --ema_decay=0)" in caplog.text
    assert stat.S_IMODE(os.stat(export_dir).st_mode) == 0o701
    assert sorted(os.listdir(tmp_path)) == ["export"]
    images = raw_images()[-4:]
    serve = tf.saved_model.load(str(export_dir)).signatures["serving_default"]
    served = serve(features=tf.constant(images))["logits"]
    with tf.device("/cpu:0"):
        expected = model(image_sets.center_standardize(images))
    np.testing.assert_allclose(served.numpy(), expected.numpy(), rtol=1e-5, atol=1e-5)
    # Any other shape or dtype is refused at the signature, with the declared one named.
    for wrong in (np.zeros((2, 64, 64, 3), np.uint8), np.zeros((2, 24, 24, 3), np.uint8),
                  np.zeros((2, 32, 32, 3), np.float32)):
        with pytest.raises((TypeError, ValueError, tf.errors.InvalidArgumentError)) as error:
            serve(features=tf.constant(wrong))
        assert "uint8" in str(error.value), error.value
