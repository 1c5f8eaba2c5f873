"""The built-in ImageNet-shaped data set, ``synthetic_imagenet``: 224x224x3 uint8 images and
labels in 0..999, drawn uniformly at random from a constant seed when first asked for (never
downloaded, never stored), for --model=resnet50.

Nothing in it is learnable: it measures what an update of an ImageNet-sized network costs, with
ImageNet's shapes, dtype and per-channel standardization, without the data set. 1,024 training
and 256 held-out examples: 193 MB of uint8, small enough to hold in memory.
"""
from __future__ import annotations

import functools

import numpy as np
import tensorflow as tf

from tower_train.data.array_source import ArraySource

IMAGE_SIZE = 224
CHANNELS = 3
NUM_CLASSES = 1000
TRAIN_SIZE, EVAL_SIZE = 1_024, 256
_SEED = 20_261_201  # the data set is a constant: nothing to do with the training --seed
# ImageNet's per-channel mean and standard deviation, on the 0..1 scale (RGB): the usual
# standardization of ImageNet pipelines.
_MEAN = (0.485, 0.456, 0.406)
_STD = (0.229, 0.224, 0.225)


@functools.cache
def _arrays() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Drawn once per process, arrays read-only (shared by every caller)."""
    rng = np.random.default_rng(_SEED)
    n = TRAIN_SIZE + EVAL_SIZE
    images = rng.integers(0, 256, (n, IMAGE_SIZE, IMAGE_SIZE, CHANNELS), dtype=np.uint8)
    labels = rng.integers(0, NUM_CLASSES, n, dtype=np.int32)
    arrays = (images[:TRAIN_SIZE], labels[:TRAIN_SIZE], images[TRAIN_SIZE:], labels[TRAIN_SIZE:])
    for array in arrays:
        array.flags.writeable = False
    return arrays


def standardize(images: tf.Tensor, seeds: tf.Tensor, training: bool) -> tf.Tensor:
    """uint8 [b, 224, 224, 3] -> float32, each channel standardized by ImageNet's mean and
    standard deviation; no augmentation (`seeds` and `training` are unused)."""
    scaled = tf.cast(images, tf.float32) * (1.0 / 255.0)
    return (scaled - tf.constant(_MEAN)) * tf.constant([1.0 / s for s in _STD])


def synthetic_imagenet() -> ArraySource:
    """The built-in ImageNet-shaped set (module docstring), for --model=resnet50."""
    return ArraySource(*_arrays()[:2], eval_features=_arrays()[2], eval_labels=_arrays()[3],
                       preprocess=standardize, num_classes=NUM_CLASSES, name="synthetic_imagenet")
