"""The built-in image data sets, both CIFAR-shaped (32x32x3 uint8 images, 10 classes), and the
original tutorial's preprocessing for them.

* ``synthetic`` (the default): generated in memory from a constant seed, never downloaded.
* ``cifar10``: the original binary files (``data_batch_1.bin`` .. ``data_batch_5.bin``, ``test_batch.bin``).

Each is an `ArraySource` of raw uint8 images [n, 32, 32, 3] whose `preprocess`
is the original's: a central 24x24 crop and per-image standardization, or, in
training with ``--augment``, the original's distortions (random crop, flip,
brightness, contrast) drawn from each example's stateless seed [seed, position].
"""

from __future__ import annotations

import functools
import os

import numpy as np
import tensorflow as tf

from tower_train.data.array_source import ArraySource
from tower_train.data.source import DataError

BUILT_IN = ("synthetic", "cifar10")
IMAGE_SIZE = 24  # the model's input side: the original's crop
NUM_CLASSES = 10

_RAW_SIZE = 32
_CHANNELS = 3
_RECORD_BYTES = 1 + _RAW_SIZE * _RAW_SIZE * _CHANNELS  # 3073: label byte + depth-major image
_CIFAR10_TRAIN_FILES = tuple(f"data_batch_{i}.bin" for i in range(1, 6))
_CIFAR10_EVAL_FILE = "test_batch.bin"
_CIFAR10_FILES = _CIFAR10_TRAIN_FILES + (_CIFAR10_EVAL_FILE,)

_CROP_OFFSET = (_RAW_SIZE - IMAGE_SIZE) // 2
_MAX_BRIGHTNESS_DELTA = 63.0  # on the 0..255 scale, as in the original
_CONTRAST_RANGE = (0.2, 1.8)

# The synthetic data set is a constant: its seed has nothing to do with the training --seed.
_SYNTHETIC_DATA_SEED = 20_240_601
_SYNTHETIC_TRAIN = 20_000
_SYNTHETIC_EVAL = 2_000
_SYNTHETIC_PROTOTYPE_SIDE = 4  # low-res class pattern, upsampled: smooth, so a CNN can find it
_SYNTHETIC_MAX_SHIFT = 2  # per-example translation of the class pattern, in pixels
_SYNTHETIC_SIGNAL = 20.0  # class pattern amplitude (0..255 scale), times U(0.5, 1.5) per example
_SYNTHETIC_NUISANCE = 50.0  # a per-example smooth pattern of the same kind, unrelated to the class
_SYNTHETIC_NOISE_STD = 50.0  # per-pixel noise
_SYNTHETIC_BRIGHTNESS = 40.0  # per-example offset, U(-b, b)



def load(name: str, data_dir: str | None, augment: bool) -> ArraySource:
    """The built-in data set `name` (check_data_dir first), with the original's preprocessing."""
    check_data_dir(name, data_dir)
    if name == "synthetic":
        arrays = _synthetic_arrays()
    else:
        assert data_dir is not None  # check_data_dir guarantees it; narrows the type
        parts = [_read_records(os.path.join(data_dir, f)) for f in _CIFAR10_TRAIN_FILES]
        arrays = (np.concatenate([images for images, _ in parts]),
                  np.concatenate([labels for _, labels in parts]),
                  *_read_records(os.path.join(data_dir, _CIFAR10_EVAL_FILE)))
    return image_source(name, *arrays, augment=augment)


def image_source(name: str, train_images: np.ndarray, train_labels: np.ndarray,
                 eval_images: np.ndarray, eval_labels: np.ndarray, augment: bool = False) -> ArraySource:
    """uint8 [n, 32, 32, 3] images and labels in 0..9 as a source with the original's preprocessing."""
    for split, images in (("train", train_images), ("eval", eval_images)):
        if images.dtype != np.uint8 or images.shape[1:] != (_RAW_SIZE, _RAW_SIZE, _CHANNELS):
            raise DataError(f"{name}: {split} images must be uint8 [n, 32, 32, 3], got "
                            f"{images.dtype} {list(images.shape)}")
    return ArraySource(train_images, train_labels, eval_features=eval_images, eval_labels=eval_labels,
                       preprocess=functools.partial(preprocess, augment=augment),
                       num_classes=NUM_CLASSES, name=name)


def preprocess(images: tf.Tensor, seeds: tf.Tensor, training: bool, augment: bool = False) -> tf.Tensor:
    """uint8 [b, 32, 32, 3] -> float32 [b, 24, 24, 3]: the distortions of each image's seed (int64 [b, 2])
    in training with `augment`, else the central crop; then per-image standardization."""
    if not (training and augment):
        return center_standardize(images)
    return distort(images, *distortions(seeds))


def check_data_dir(dataset: str, data_dir: str | None) -> None:
    """Cheap start-up check of the --dataset/--data_dir pair; reads no file contents.

    For 'cifar10', data_dir must be a directory holding data_batch_1.bin..data_batch_5.bin and test_batch.bin,
    each readable and a positive whole number of 3073-byte records. For 'synthetic', data_dir must be None.
    Raises DataError with a one-line message naming the culprit and what is expected.
    """
    if dataset == "synthetic":
        if data_dir is not None:
            raise DataError(
                f"--data_dir={data_dir!r} given with --dataset=synthetic: "
                "--data_dir is only read with --dataset=cifar10"
            )
        return
    if data_dir is None:
        raise DataError(
            "--dataset=cifar10 needs --data_dir: a directory holding the CIFAR-10 binary version "
            "(data_batch_1.bin..data_batch_5.bin, test_batch.bin)"
        )
    expected = "expected a directory holding the CIFAR-10 .bin files"
    if not os.path.exists(data_dir):
        raise DataError(f"--data_dir {data_dir!r} does not exist: {expected}")
    if not os.path.isdir(data_dir):
        raise DataError(f"--data_dir {data_dir!r} is not a directory: {expected}")
    for name in _CIFAR10_FILES:
        _check_record_file(os.path.join(data_dir, name))


def _check_record_file(path: str) -> None:
    if not os.path.exists(path):
        raise DataError(
            f"{path!r} is missing: --data_dir must hold data_batch_1.bin..data_batch_5.bin and test_batch.bin "
            "(the CIFAR-10 binary version)"
        )
    if not os.path.isfile(path):
        raise DataError(f"{path!r} is not a regular file: expected CIFAR-10 records of {_RECORD_BYTES} bytes")
    _check_record_bytes(path, os.path.getsize(path))
    try:
        # Opening is the real readability test: os.access says yes to root whatever the mode.
        with open(path, "rb"):
            pass
    except OSError as e:
        raise DataError(f"cannot read {path!r}: {e.strerror or e}") from e


def _check_record_bytes(path: str, size: int) -> None:
    if size == 0:
        raise DataError(f"{path!r} is empty: expected a positive whole number of {_RECORD_BYTES}-byte CIFAR-10 records")
    if size % _RECORD_BYTES:
        raise DataError(
            f"{path!r} has {size} bytes, not a whole number of {_RECORD_BYTES}-byte CIFAR-10 records "
            "(1 label byte + 3072 image bytes)"
        )


def _read_records(path: str) -> tuple[np.ndarray, np.ndarray]:
    """One CIFAR-10 binary file -> (uint8 [n, 32, 32, 3], int32 [n])."""
    try:
        raw = np.fromfile(path, dtype=np.uint8)
    except OSError as e:
        raise DataError(f"cannot read {path!r}: {e.strerror or e}") from e
    _check_record_bytes(path, raw.size)  # the file may have changed since check_data_dir
    records = raw.reshape(-1, _RECORD_BYTES)
    labels = records[:, 0]
    bad = np.flatnonzero(labels >= NUM_CLASSES)
    if bad.size:
        raise DataError(
            f"{path!r}: record {bad[0]} has label byte {labels[bad[0]]}, CIFAR-10 labels are 0..{NUM_CLASSES - 1} "
            "(is this the binary version of CIFAR-10?)"
        )
    # Records store the image depth-major [3][32][32]; the model wants [32][32][3].
    images = records[:, 1:].reshape(-1, _CHANNELS, _RAW_SIZE, _RAW_SIZE).transpose(0, 2, 3, 1)
    return np.ascontiguousarray(images), labels.astype(np.int32)


# --------------------------------------------------------------------------------------------------
# The synthetic data set


def _bilinear_upsample_matrix(low: int, high: int) -> np.ndarray:
    """float32 [high, low]: row y holds the bilinear weights of the low-res samples for output pixel y."""
    centres = np.clip((np.arange(high) + 0.5) * low / high - 0.5, 0, low - 1)
    left = np.floor(centres).astype(np.int64)
    right = np.minimum(left + 1, low - 1)
    frac = (centres - left).astype(np.float32)
    weights = np.zeros((high, low), np.float32)
    np.add.at(weights, (np.arange(high), left), 1 - frac)
    np.add.at(weights, (np.arange(high), right), frac)
    return weights


@functools.cache
def _synthetic_arrays() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The embedded data set: generated once per process (well under a second), arrays read-only.

    Each example: 128 + brightness offset + amp * (its class's smooth colour pattern, shifted by up to 2 px)
    + a smooth nuisance pattern of its own + per-pixel noise, clipped to 0..255. The nuisance lives in the same
    low-frequency space as the class signal, so no classifier can be perfect, but the class is learnable.
    """
    rng = np.random.default_rng(_SYNTHETIC_DATA_SEED)
    n = _SYNTHETIC_TRAIN + _SYNTHETIC_EVAL
    low, shift = _SYNTHETIC_PROTOTYPE_SIDE, _SYNTHETIC_MAX_SHIFT

    # Every (class, shift) variant of the pattern is precomputed so each example is one cheap row copy.
    up_wide = _bilinear_upsample_matrix(low, _RAW_SIZE + 2 * shift)
    prototypes = np.einsum("yi,cijk,xj->cyxk", up_wide, rng.uniform(-1, 1, (NUM_CLASSES, low, low, _CHANNELS)), up_wide)
    n_shifts = (2 * shift + 1) ** 2
    variants = np.stack(
        [
            prototypes[:, dy : dy + _RAW_SIZE, dx : dx + _RAW_SIZE]
            for dy in range(2 * shift + 1)
            for dx in range(2 * shift + 1)
        ],
        axis=1,
    ).reshape(NUM_CLASSES * n_shifts, _RAW_SIZE, _RAW_SIZE, _CHANNELS)
    variants = (_SYNTHETIC_SIGNAL * variants).astype(np.float32)

    # Each split exactly balanced.
    labels = np.concatenate(
        [rng.permutation(np.arange(size) % NUM_CLASSES) for size in (_SYNTHETIC_TRAIN, _SYNTHETIC_EVAL)]
    ).astype(np.int32)
    variant = labels * n_shifts + rng.integers(0, n_shifts, n)
    amplitude = rng.uniform(0.5, 1.5, (n, 1, 1, 1)).astype(np.float32)
    offset = (128 + rng.uniform(-_SYNTHETIC_BRIGHTNESS, _SYNTHETIC_BRIGHTNESS, (n, 1, 1, 1))).astype(np.float32)
    nuisance_low = rng.uniform(-_SYNTHETIC_NUISANCE, _SYNTHETIC_NUISANCE, (n, low, low, _CHANNELS)).astype(np.float32)
    up = _bilinear_upsample_matrix(low, _RAW_SIZE)
    # Uniform noise with the wanted std: 3x cheaper to draw than Gaussian, and this set must be quick to make.
    noise_scale = np.float32(_SYNTHETIC_NOISE_STD * np.sqrt(12.0) / 256.0)

    images = np.empty((n, _RAW_SIZE, _RAW_SIZE, _CHANNELS), np.uint8)
    chunk = 1000  # float32 work in cache-sized pieces rather than one 270 MB array
    for start in range(0, n, chunk):
        part = slice(start, min(n, start + chunk))
        x = variants[variant[part]]
        x *= amplitude[part]
        x += offset[part]
        x += np.einsum("yi,nijk,xj->nyxk", up, nuisance_low[part], up, optimize=True)
        noise = rng.integers(0, 256, x.shape, dtype=np.uint8).astype(np.float32)
        noise -= 127.5
        noise *= noise_scale
        x += noise
        np.clip(x, 0, 255, out=x)
        images[part] = np.rint(x)

    split = _SYNTHETIC_TRAIN
    arrays = (images[:split], labels[:split], images[split:], labels[split:])
    for array in arrays:
        array.flags.writeable = False  # shared by every caller in the process
    return arrays


def center_standardize(images: tf.Tensor) -> tf.Tensor:
    """uint8 [b, 32, 32, 3] -> float32 [b, 24, 24, 3]: central crop, per-image standardization."""
    crop = images[:, _CROP_OFFSET : _CROP_OFFSET + IMAGE_SIZE, _CROP_OFFSET : _CROP_OFFSET + IMAGE_SIZE, :]
    return tf.image.per_image_standardization(tf.cast(crop, tf.float32))



def distortions(seeds: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor, tf.Tensor, tf.Tensor]:
    """Each image's distortion, a pure function of its seed (int64 [b, 2]), drawn for the whole
    batch at once: crop offsets dy, dx int32 [b] uniform in 0..8, flip bool [b] with p = 1/2,
    brightness delta float32 [b] uniform in [-63, 63), contrast factor float32 [b] uniform in
    [0.2, 1.8): the original's distributions. tf.image's stateless ops take one seed per call,
    which would mean a loop over the images; a counter-based hash of the seed takes none."""
    words = tf.bitcast(seeds, tf.uint32)  # [b, 2, 2]: each int64 as two 32-bit words
    key = _pcg_hash(words[:, 0, 0])
    for word in (words[:, 0, 1], words[:, 1, 0], words[:, 1, 1]):
        key = _pcg_hash(key ^ word)

    def uniform(draw: int) -> tf.Tensor:
        """float32 [b] in [0, 1): the draw-th number of each image's stream."""
        bits = _pcg_hash(key + tf.constant((draw + 1) * 0x9E3779B9 % 2**32, tf.uint32))
        return tf.cast(tf.bitwise.right_shift(bits, 8), tf.float32) * 2.0**-24

    offsets = _RAW_SIZE - IMAGE_SIZE + 1
    dy, dx = (tf.minimum(tf.cast(uniform(i) * offsets, tf.int32), offsets - 1) for i in (0, 1))
    low, high = _CONTRAST_RANGE
    return (dy, dx, uniform(2) < 0.5, (2.0 * uniform(3) - 1.0) * _MAX_BRIGHTNESS_DELTA,
            low + (high - low) * uniform(4))


def distort(images: tf.Tensor, dy: tf.Tensor, dx: tf.Tensor, flip: tf.Tensor, brightness: tf.Tensor,
            contrast: tf.Tensor) -> tf.Tensor:
    """uint8 [b, 32, 32, 3] -> float32 [b, 24, 24, 3]: the original's training distortions, as
    `distortions` drew them, on the whole batch: the crop at (dy, dx), flipped left-right where
    `flip`, the brightness delta added and the contrast scaled, then per-image standardization."""
    steps = tf.range(IMAGE_SIZE)
    rows = dy[:, None] + steps
    columns = dx[:, None] + tf.where(flip[:, None], IMAGE_SIZE - 1 - steps, steps)  # the flip, read backwards
    x = tf.gather(tf.gather(images, rows, axis=1, batch_dims=1), columns, axis=2, batch_dims=1)
    # As in the original: on the 0..255 scale and unclipped, so the standardization below removes the
    # brightness shift again (up to rounding); kept for fidelity, crop/flip/contrast do the distorting.
    x = tf.cast(x, tf.float32) + brightness[:, None, None, None]
    mean = tf.reduce_mean(x, axis=[1, 2], keepdims=True)  # per channel, as tf.image.adjust_contrast
    x = (x - mean) * contrast[:, None, None, None] + mean
    return tf.image.per_image_standardization(x)


def _pcg_hash(x: tf.Tensor) -> tf.Tensor:
    """uint32 -> uint32: the PCG output permutation of one LCG step (Jarzynski and Olano,
    "Hash Functions for GPU Rendering", 2020), a cheap hash with well-mixed bits."""
    state = x * tf.constant(747796405, tf.uint32) + tf.constant(2891336453, tf.uint32)
    shift = tf.bitwise.right_shift(state, 28) + tf.constant(4, tf.uint32)
    word = (tf.bitwise.right_shift(state, shift) ^ state) * tf.constant(277803737, tf.uint32)
    return tf.bitwise.right_shift(word, 22) ^ word

