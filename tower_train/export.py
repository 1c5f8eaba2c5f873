"""--export_dir: a SavedModel that maps raw images to logits, loadable without tower-train.

The SavedModel's default signature, ``serving_default``, takes ``images``: uint8
[None, 32, 32, 3], the data sets' raw format (height, width, channel), applies the
evaluation preprocessing (central 24x24 crop, per-image standardization:
`data.center_standardize`, the very function the held-out evaluation uses) and
returns ``{"logits": float32 [None, num_classes]}``. Load it with TensorFlow alone:

    serve = tf.saved_model.load(export_dir).signatures["serving_default"]
    logits = serve(images=tf.constant(uint8_images))["logits"]

The weights are the moving average when the run kept one (--ema_decay > 0, the
default), as `python -m tower_train.eval` evaluates by default; else the trained
weights. Nothing is overwritten: an export_dir that exists and is not empty is
refused, and the SavedModel is written beside it first, then moved into place.
"""
from __future__ import annotations

import os
import shutil
import tempfile

import tensorflow as tf
from absl import logging

from tower_train import data
from tower_train.config import check_export_dir
from tower_train.errors import UsageError
from tower_train.evaluation import use_moving_average

RAW_IMAGE_SHAPE = (32, 32, 3)  # what data.ExampleSource holds and the signature takes


class ServingModule(tf.Module):
    """Holds an inference copy of the network and its variables; `serve` is the signature."""

    def __init__(self, model):
        super().__init__(name="tower_train_export")
        self.model = model
        self.weights = list(model.variables)  # tracked explicitly, whatever the model tracks

    @tf.function(input_signature=[tf.TensorSpec([None, *RAW_IMAGE_SHAPE], tf.uint8, name="images")],
                 autograph=False)
    def serve(self, images: tf.Tensor) -> dict[str, tf.Tensor]:
        logits = self.model(data.center_standardize(images), training=False)
        return {"logits": tf.cast(logits, tf.float32)}


def inference_copy(model, moving_average=None):
    """A fresh, plain copy of `model` (same class, no strategy, no device pinning) with its
    weights, or, given a moving average, with the averages as trainable weights.

    The trained model is left as it is: it may still be trained or checkpointed.
    """
    copy = type(model)(num_classes=model.num_classes)
    copy(tf.zeros([1, data.IMAGE_SIZE, data.IMAGE_SIZE, RAW_IMAGE_SHAPE[2]]))
    if len(copy.variables) != len(model.variables):
        raise ValueError(f"a fresh {type(model).__name__} has {len(copy.variables)} variables, "
                         f"the trained one {len(model.variables)}")
    for target, source in zip(copy.variables, model.variables):
        target.assign(tf.convert_to_tensor(source))
    if moving_average is not None:
        use_moving_average(copy, moving_average)
    return copy


def export_saved_model(model, moving_average, export_dir: str) -> None:
    """Writes the SavedModel (see the module docstring) to `export_dir`.

    Args:
      model: the trained network (a models.TowerModel).
      moving_average: its schedules.MovingAverage, or None when the run kept none;
        when given, its averages are the exported weights.
      export_dir: absent, or an empty directory.

    Raises:
      UsageError: export_dir exists and is not empty (checked again just before the move).
    """
    check_export_dir(export_dir)
    which = ("the moving average of the weights (--ema_decay > 0)" if moving_average is not None
             else "the trained weights (no moving average: --ema_decay=0)")
    module = ServingModule(inference_copy(model, moving_average))
    parent = os.path.dirname(os.path.abspath(export_dir))
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(export_dir))}.", dir=parent)
    try:
        tf.saved_model.save(module, staging, signatures={"serving_default": module.serve})
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(staging, 0o777 & ~umask)  # mkdtemp's 0700 is for the staging only
        check_export_dir(export_dir)
        try:
            # rename() replaces an absent or empty directory, and fails on a non-empty one.
            os.rename(staging, export_dir)
        except OSError as e:
            raise UsageError(f"--export_dir={export_dir}: cannot write the SavedModel there "
                             f"({e.strerror or e}); nothing was overwritten") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    logging.info("exported %s to %s: serving_default takes uint8 images [None, 32, 32, 3] and "
                 "returns float32 logits [None, %d]", which, export_dir, model.num_classes)
