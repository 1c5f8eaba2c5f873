"""--export_dir: a SavedModel that maps raw features to logits, loadable without tower-train.

The SavedModel's default signature, ``serving_default``, takes ``features``: a
batch of raw examples of exactly the data source's shape and dtype per example
(uint8 [None, 32, 32, 3] for the built-in image sets), applies the source's
evaluation preprocessing (for the built-in sets the central 24x24 crop and
per-image standardization, the very function held-out evaluation uses) and
returns ``{"logits": float32 [None, ..., num_classes]}``. Any other shape or
dtype is refused when the signature is called. Load it with TensorFlow alone:

    serve = tf.saved_model.load(export_dir).signatures["serving_default"]
    logits = serve(features=tf.constant(uint8_images))["logits"]

The weights are the moving average when the run kept one (--ema_decay > 0, the
default), as `python -m tower_train.eval` evaluates by default; else the trained
weights. Nothing is overwritten: an export_dir that exists and is not empty is
refused, and the SavedModel is written beside it first, then moved into place; an
empty export_dir it replaces keeps its mode. A symbolic link is refused, never
written through.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import stat
import tempfile

import tensorflow as tf
from absl import logging

from tower_train.config import TrainConfig, check_export_dir
from tower_train.data.source import Source
from tower_train.errors import UsageError
from tower_train.model_spec import ModelSpec, build_model, use_moving_average


class ServingModule(tf.Module):
    """Holds an inference copy of the network, its variables and the source's preprocessing;
    `serve` is the signature, fixed to the source's raw feature shape and dtype."""

    def __init__(self, model, source: Source):
        super().__init__(name="tower_train_export")
        self.model = model
        self.weights = list(model.variables)  # tracked explicitly, whatever the model tracks
        spec = tf.TensorSpec([None, *source.feature_spec.shape], source.feature_spec.dtype,
                             name="features")

        declared = f"{source.feature_spec.dtype.name} {spec.shape}"

        def serve(features: tf.Tensor) -> dict[str, tf.Tensor]:
            # A loaded signature does not check shapes itself, and a crop would serve any larger image.
            tf.debugging.assert_equal(tf.shape(features)[1:], tf.constant(spec.shape[1:].as_list(), tf.int32),
                                      message=f"serving_default takes features {declared}")
            seeds = tf.zeros([tf.shape(features)[0], 2], tf.int64)  # no randomness outside training
            logits = model(source.model_input(features, seeds, training=False), training=False)
            return {"logits": tf.cast(logits, tf.float32)}

        self.serve = tf.function(serve, input_signature=[spec], autograph=False)


def inference_copy(spec: ModelSpec, source: Source, model, moving_average=None):
    """A fresh, plain float32 copy of `model` (made by the same spec, no strategy, no device
    pinning) with its weights, or, given a moving average, with the averages as trainable weights.

    The trained model is left as it is: it may still be trained or checkpointed.
    """
    copy = build_model(spec, source, dataclasses.replace(TrainConfig(train_dir="."), precision="fp32"))
    if len(copy.variables) != len(model.variables):
        raise ValueError(f"a fresh {spec.name} has {len(copy.variables)} variables, "
                         f"the trained one {len(model.variables)}")
    for target, weights in zip(copy.variables, model.variables):
        target.assign(tf.convert_to_tensor(weights))
    if moving_average is not None:
        use_moving_average(copy, moving_average)
    return copy


def _export_mode(export_dir: str) -> int:
    """The mode the export gets: that of the empty directory it replaces, else a plain mkdir's
    (mkdtemp's 0700 is for the staging only)."""
    try:
        return stat.S_IMODE(os.lstat(export_dir).st_mode)
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o777 & ~umask


def export_saved_model(spec: ModelSpec, source: Source, model, moving_average, export_dir: str) -> None:
    """Writes the SavedModel (see the module docstring) to `export_dir`.

    Args:
      spec, source: how the model was made, and the data it was trained on.
      model: the trained network (a tower_train.TowerModel).
      moving_average: its schedules.MovingAverage, or None when the run kept none;
        when given, its averages are the exported weights.
      export_dir: absent, or an empty directory (not a link).

    Raises:
      UsageError: export_dir is refused by `config.check_export_dir` (checked again just before
        the move).
    """
    check_export_dir(export_dir)
    which = ("the moving average of the weights (--ema_decay > 0)" if moving_average is not None
             else "the trained weights (no moving average: --ema_decay=0)")
    module = ServingModule(inference_copy(spec, source, model, moving_average), source)
    parent = os.path.dirname(os.path.abspath(export_dir))
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(export_dir))}.", dir=parent)
    try:
        tf.saved_model.save(module, staging, signatures={"serving_default": module.serve})
        check_export_dir(export_dir)
        os.chmod(staging, _export_mode(export_dir))
        try:
            # rename() replaces an absent or empty directory, and fails on a non-empty one.
            os.rename(staging, export_dir)
        except OSError as e:
            raise UsageError(f"--export_dir={export_dir}: cannot write the SavedModel there "
                             f"({e.strerror or e}); nothing was overwritten") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    shape = ", ".join(["None", *map(str, source.feature_spec.shape)])
    logging.info("exported %s to %s: serving_default takes %s features [%s] and returns float32 "
                 "logits", which, export_dir, source.feature_spec.dtype.name, shape)
