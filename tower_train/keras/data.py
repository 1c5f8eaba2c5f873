"""Keras's data arguments of `fit` as arrays for `tower_train.keras.fit` (keras/model_fit.py): a batched
`tf.data.Dataset` or `keras.utils.PyDataset` read once into arrays, and x, y, sample_weight,
class_weight, validation_split and validation_data as the arrays to train on, each example's
weight, and the held-out data."""
from __future__ import annotations

import math

import keras
import numpy as np
import tensorflow as tf

from keras.src.backend.tensorflow.trainer import TFEpochIterator  # what Keras's fit reads data with

from tower_train.errors import UsageError


def read_dataset(dataset: tf.data.Dataset | keras.utils.PyDataset, y, sample_weight, batch_size,
                  validation_split, epochs: int, shuffle: bool = False):
    """A finite `tf.data.Dataset` or `keras.utils.PyDataset` of batches (x, y) or
    (x, y, sample_weight), one step's each, read into arrays as Keras's fit reads it: anew for
    each of `epochs` epochs, so that a dataset that reshuffles every iteration (a
    `shuffle(...)`, `text_dataset_from_directory`) gives each epoch its own order, and a
    PyDataset's batches are shuffled as fit shuffles them (`shuffle`); one that gives the same
    order twice is read once. Returns (x, y, sample_weight or None, its batch size,
    the examples of one epoch): the arrays hold the epochs one after the other."""
    kind = "Dataset" if isinstance(dataset, tf.data.Dataset) else type(dataset).__name__
    for name, value in (("y", y), ("sample_weight", sample_weight), ("batch_size", batch_size),
                        ("validation_split", validation_split or None)):
        if value is not None:
            raise UsageError(f"{name}=: not with x={kind}, whose elements give the batches "
                             "(x, y[, sample_weight]), as for model.fit")
    if isinstance(dataset, tf.data.Dataset):
        finite = dataset.cardinality() != tf.data.INFINITE_CARDINALITY
    else:
        finite = dataset.num_batches is not None
    if not finite:
        raise UsageError(f"x={kind}: is infinite; tower_train.keras.fit reads it into memory, "
                         "so it must end")
    # Keras's fit reads its epochs through this iterator: the same iterations of a dataset (it
    # starts the next one as an epoch ends, and another as the next epoch begins), a PyDataset's
    # batches shuffled as fit shuffles them, its on_epoch_end called.
    epochs_read = TFEpochIterator(x=dataset, shuffle=shuffle and kind != "Dataset",
                                  distribute_strategy=tf.distribute.get_strategy())

    def read() -> list:
        batches = []
        with epochs_read.catch_stop_iteration():  # as Keras's fit loops over an epoch
            for _, _, iterator in epochs_read:
                batches.append(tf.nest.map_structure(np.asarray, next(iterator)))
        return batches

    passes = [_arrays(kind, read())]
    while len(passes) < epochs:
        passes.append(_arrays(kind, read()))
        if len(passes) == 2 and _same(passes[0][0], passes[1][0]):  # one order, every epoch
            del passes[1]
            break
    batch, epoch_examples = passes[0][1], len(tf.nest.flatten(passes[0][0])[0])
    arrays = tf.nest.map_structure(lambda *parts: np.concatenate(parts), *(p[0] for p in passes))
    return arrays[0], arrays[1], arrays[2] if len(arrays) == 3 else None, batch, epoch_examples


def _arrays(kind: str, elements: list) -> tuple[tuple, int]:
    """One epoch's batches as arrays (x, y[, sample_weight]), and its batch size."""
    elements = [tuple(element) if isinstance(element, list) else element for element in elements]
    if not elements or not isinstance(elements[0], tuple) or len(elements[0]) not in (2, 3):
        raise UsageError(f"x={kind}: expected batches (x, y) or (x, y, sample_weight), one per "
                         "step; it yields " + ("nothing" if not elements else
                                               type(elements[0]).__name__))
    sizes = [len(tf.nest.flatten(element)[0]) for element in elements]
    if any(size != sizes[0] for size in sizes[:-1]) or sizes[-1] > sizes[0]:
        raise UsageError(f"x={kind}: its batches hold {', '.join(map(str, sizes[:8]))}"
                         f"{', ...' if len(sizes) > 8 else ''} examples: each step's batch must be "
                         "full but the last (batch(..., drop_remainder=False) gives that)")
    return tf.nest.map_structure(lambda *parts: np.concatenate(parts), *elements), sizes[0]


def _same(one, other) -> bool:
    """Whether two epochs' arrays are equal: the same structure, shapes and values."""
    try:
        tf.nest.assert_same_structure(one, other)
    except (ValueError, TypeError):
        return False
    return all(a.shape == b.shape and np.array_equal(a, b, equal_nan=a.dtype.kind == "f")
               for a, b in zip(tf.nest.flatten(one), tf.nest.flatten(other)))


# Keras's own words when an epoch of `steps_per_epoch` runs past the end of the data
# (keras/src/trainers/epoch_iterator.py).
OUT_OF_DATA = ("Your input ran out of data; interrupting training. Make sure that your dataset or "
               "generator can generate at least `steps_per_epoch * epochs` batches. You may need to "
               "use the `.repeat()` function when building your dataset.")


def epoch_lengths(steps_per_epoch: int | None, batches: int, epochs: int) -> list[int]:
    """The updates of each of `epochs` epochs as Keras's fit reads its data of `batches` steps a
    pass: without `steps_per_epoch` a pass each; with it, the pass goes on from epoch to epoch,
    and an epoch that reaches the pass's end before `steps_per_epoch` steps ends there (Keras
    warns `OUT_OF_DATA`), the next epoch starting a new pass."""
    if steps_per_epoch is None:
        return [batches] * epochs
    lengths, read = [], 0  # read: the steps of the current pass read so far
    for _ in range(epochs):
        lengths.append(min(steps_per_epoch, batches - read))
        read = (read + lengths[-1]) % batches
    return lengths


def split_data(x, y, sample_weight, class_weight, validation_split, validation_data):
    """((x, y, w) to train on, (x, y, w) held out or None) from Keras's data arguments; w is the
    float32 weight of each example, sample_weight times class_weight's (ones without either)."""
    if x is not None and not isinstance(x, (np.ndarray, dict, list, tuple)) and not tf.is_tensor(x):
        raise UsageError(f"x={type(x).__name__}: tower_train.keras.fit takes numpy arrays, or a "
                         "dict, list or tuple of them, with y, or a batched tf.data.Dataset or a "
                         "keras.utils.PyDataset (not a generator, which cannot be read again for "
                         "another epoch or a resume: read it into arrays)")
    if x is None or y is None:
        raise UsageError("x and y: tower_train.keras.fit needs both, as numpy arrays")
    x, y = (tf.nest.map_structure(np.asarray, value) for value in (x, y))
    if tf.nest.is_nested(y) and class_weight is not None:
        raise UsageError("class_weight=: Keras takes it only for a model of one output")
    if sample_weight is not None and class_weight is not None:
        raise UsageError("sample_weight= and class_weight=: Keras takes one or the other, not both")
    examples = int(tf.nest.flatten(x)[0].shape[0])
    weights = np.ones(examples, np.float32)
    if sample_weight is not None:
        weights = np.asarray(sample_weight, np.float32)
        if weights.shape != (examples,):
            raise UsageError(f"sample_weight {list(weights.shape)}: must be one weight per example, "
                             f"[{examples}]")
    if class_weight is not None:
        if not isinstance(class_weight, dict):
            raise UsageError(f"class_weight={type(class_weight).__name__}: expected a dict of class "
                             "index -> weight")
        weights = class_weights(y, class_weight)
    if not 0.0 <= validation_split < 1.0:
        raise UsageError(f"validation_split={validation_split!r}: must be in [0, 1)")
    held_out = None
    if isinstance(validation_data, tf.data.Dataset):
        held_out = (validation_data, None, None)  # the model's evaluate reads it as it is
    elif validation_data is not None:
        if not isinstance(validation_data, tuple) or len(validation_data) not in (2, 3):
            raise UsageError(f"validation_data={type(validation_data).__name__}: expected a tuple "
                             "(x, y) or (x, y, sample_weight) of numpy arrays, or a tf.data.Dataset")
        held_out = (*validation_data, None)[:3]
    elif validation_split:
        # Keras's: the last fraction of the arrays, before any shuffling.
        cut = int(math.floor(examples * (1.0 - validation_split)))
        if cut in (0, examples):
            raise UsageError(f"validation_split={validation_split}: leaves no example to "
                             f"{'train on' if cut == 0 else 'validate'} of {examples}")
        part = lambda nest, rows: tf.nest.map_structure(lambda a: a[rows], nest)  # noqa: E731
        held_out = (part(x, slice(cut, None)), part(y, slice(cut, None)), weights[cut:]
                    if sample_weight is not None else None)
        x, y, weights = part(x, slice(None, cut)), part(y, slice(None, cut)), weights[:cut]
    return (x, y, weights), held_out


def class_weights(y: np.ndarray, class_weight: dict) -> np.ndarray:
    """Each example's weight from its class, as Keras finds it: the argmax of a one-hot row, the
    value of a [n, 1] or [n] label, rounded."""
    classes = y if y.ndim == 1 else (np.argmax(y, axis=-1) if y.shape[-1] != 1 else y[:, 0])
    classes = np.round(classes).astype(np.int64)
    return np.array([class_weight.get(int(c), 1.0) for c in classes], np.float32)
