"""`ArraySource`: examples held in numpy arrays, streamed as a `Source` (`tower_train.data.source`) is: every
epoch a fresh permutation fixed by the seed, resumable at any stream position."""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from tower_train.data.source import _HOST, DataError, Preprocess, Source, describe_nest, rows

# Third word of the shuffle seed [seed, epoch, salt]: keeps these permutations apart from any other
# user of index_shuffle seeded with the same training seed.
_SHUFFLE_SALT = 0x5EED_0DE5


def _stream_indices(positions: tf.Tensor, seed: int, n: int, shuffle: bool) -> tf.Tensor:
    """int64 stream positions -> example index: a fresh stateless permutation per epoch, or
    position mod n without shuffling."""
    if not shuffle:
        return positions % n
    epoch = positions // n
    words = [tf.constant(seed, tf.int64), epoch, tf.constant(_SHUFFLE_SALT, tf.int64)]
    seeds = tf.stack([tf.broadcast_to(word, tf.shape(positions)) for word in words], axis=-1)
    # The raw op behind tf.random.experimental.index_shuffle: the wrapper only accepts 2-word seeds, and in
    # TF 2.21 it pads a batch of seeds along the wrong axis, so per-position seeds fail through it.
    return tf.raw_ops.RandomIndexShuffle(
        index=positions % n, seed=seeds, max_index=tf.constant(n - 1, tf.int64), rounds=4)


class ArraySource(Source):
    """Examples held in numpy arrays, axis 0 = examples; any shape and dtype per example.

    Args:
      train_features, train_labels: the training examples; labels integer [n] or [n, ...].
        Features may be a dict, list or tuple of arrays (several inputs); labels that are not
        one integer array (floats, or several arrays) are targets (module docstring).
      train_weights: float, the labels' shape ([n] for targets), or None (every label counts 1).
      eval_features, eval_labels, eval_weights: the held-out examples, the same way; None
        for no held-out set (evaluation then counts no example).
      shuffle: True: every epoch is a fresh permutation fixed by the seed; False: stream
        position p is example p mod n.
      preprocess: see the module docstring; None: the model gets the arrays as they are.
      num_classes: labels lie in 0 .. num_classes - 1; default: one more than the largest label
        (None for targets).
      name: for messages and the run record.

    The checked arrays are kept as the attributes of the same names (labels as int32,
    weights as float32, ones where none were given).

    Raises:
      DataError: arrays that do not fit together, in one line naming them.
    """

    def __init__(self, train_features: np.ndarray, train_labels: np.ndarray,
                 train_weights: np.ndarray | None = None, eval_features: np.ndarray | None = None,
                 eval_labels: np.ndarray | None = None, eval_weights: np.ndarray | None = None,
                 shuffle: bool = True, preprocess: Preprocess | None = None,
                 num_classes: int | None = None, name: str = "arrays"):
        self.name = name
        self.shuffle = shuffle
        self.preprocess = preprocess
        train = _split_arrays("train", train_features, train_labels, train_weights)
        if _examples(train[0]) == 0:
            raise DataError(f"{name}: train_features holds no example; a source needs at least one")
        if (eval_features is None) != (eval_labels is None):
            raise DataError(f"{name}: give eval_features and eval_labels together, or neither")
        held_out = (tuple(rows(a, slice(0, 0)) for a in train) if eval_features is None
                    else _split_arrays("eval", eval_features, eval_labels, eval_weights))
        self.train_features, self.train_labels, self.train_weights = train
        self.eval_features, self.eval_labels, self.eval_weights = held_out
        self.feature_spec, self.label_spec = (_example_spec(a) for a in train[:2])
        for what, train_arrays, held_out in (("features", self.train_features, self.eval_features),
                                             ("labels", self.train_labels, self.eval_labels)):
            if _example_spec(train_arrays) != _example_spec(held_out):
                raise DataError(f"{name}: eval_{what} are {describe_nest(held_out)}, train_{what} "
                                f"{describe_nest(train_arrays)}: each example must have the same "
                                "structure, shape and dtype")
        self._weight_shape = tf.TensorShape(self.train_weights.shape[1:])
        if _are_targets(self.train_labels):
            if num_classes is not None:
                raise DataError(f"{name}: num_classes={num_classes} is for integer class labels; "
                                "these labels are targets (floats or several arrays)")
            self.num_classes = None
        else:
            largest = max(int(labels.max()) if labels.size else -1
                          for labels in (self.train_labels, self.eval_labels))
            self.num_classes = largest + 1 if num_classes is None else num_classes
            if self.num_classes < 1 or largest >= self.num_classes:
                raise DataError(f"{name}: num_classes={self.num_classes} but the largest label is "
                                f"{largest}; labels must lie in 0..num_classes - 1")
        self.train_size = _examples(self.train_features)

    @property
    def weight_shape(self) -> tf.TensorShape:
        return self._weight_shape

    def stream_indices(self, positions: tf.Tensor, seed: int) -> tf.Tensor:
        """The example index at each of the int64 stream `positions` of the run seeded `seed`."""
        return _stream_indices(positions, seed, self.train_size, self.shuffle)

    def _raw_train_batches(self, seed: int, start_position: int, batch: int) -> tf.data.Dataset:
        features, labels, weights = _constants(self.train_features, self.train_labels, self.train_weights)

        def gather(first):
            positions = first + tf.range(batch, dtype=tf.int64)
            indices = self.stream_indices(positions, seed)
            return (positions, _gather(features, indices), _gather(labels, indices),
                    tf.gather(weights, indices))

        # One tf.data element per batch, its positions one range: a counter of single positions,
        # batched, spent 23-38 us of host time per example on tf.data's per-element work, nearly
        # all of this pipeline's cost; this takes about 1 (docs/performance.md).
        dataset = tf.data.Dataset.counter(start=start_position, step=batch, dtype=tf.int64)
        return dataset.map(gather, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)

    def _raw_eval_batches(self, batch_size: int) -> tf.data.Dataset:
        features, labels, weights = _constants(self.eval_features, self.eval_labels, self.eval_weights)

        def gather(indices):
            return (indices, _gather(features, indices), _gather(labels, indices),
                    tf.gather(weights, indices))

        return tf.data.Dataset.range(len(self.eval_weights)).batch(batch_size).map(
            gather, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)


def _split_arrays(split: str, features, labels, weights) -> tuple[object, object, np.ndarray]:
    """Checks one split's arrays; returns (features, labels, weights float32, ones if None), the
    features and targets as the nests of arrays they were given as, class labels as int32."""
    features, labels = _arrays(features), _arrays(labels)
    counts = {f"{split}_{what}{path}": shape for what, nest in (("features", features),
                                                                ("labels", labels))
              for path, shape in _leaf_shapes(nest)}
    if any(not shape for shape in counts.values()) or len({shape[0] for shape in counts.values()}) > 1:
        raise DataError(f"{' and '.join(f'{name} {shape}' for name, shape in counts.items())}: "
                        "axis 0 counts the examples and must agree")
    examples = next(iter(counts.values()))[0]
    if _are_targets(labels):
        for path, leaf in _leaves(labels):
            if not np.issubdtype(leaf.dtype, np.number) and leaf.dtype != bool:
                raise DataError(f"{split}_labels{path} are {leaf.dtype}: targets must be numbers")
            # A NaN would reach the loss as it is, or as -2**63 where it is cast to a class.
            bad = np.argwhere(~np.isfinite(leaf)) if np.issubdtype(leaf.dtype, np.inexact) else ()
            if len(bad):
                raise DataError(f"{split}_labels{path}: example {bad[0][0]} holds "
                                f"{leaf[tuple(bad[0])]}; targets must be finite numbers")
        weight_shape = [examples]  # one weight per example, as Keras's sample_weight
    else:
        if labels.size and labels.min() < 0:
            raise DataError(f"{split}_labels hold {labels.min()}: labels must be >= 0")
        if labels.size and labels.max() > np.iinfo(np.int32).max:  # the cast below would wrap it
            raise DataError(f"{split}_labels hold {labels.max()}: labels must fit in int32 "
                            f"(<= {np.iinfo(np.int32).max})")
        labels = labels.astype(np.int32, copy=False)
        weight_shape = list(labels.shape)
    if weights is None:
        weights = np.ones(weight_shape, np.float32)
    weights = np.asarray(weights)
    if list(weights.shape) != weight_shape:
        whose = "one per example, of targets" if _are_targets(labels) else "the labels' shape"
        raise DataError(f"{split}_weights {list(weights.shape)}: must have {whose} {weight_shape}")
    if not np.issubdtype(weights.dtype, np.number) or not np.all(np.isfinite(weights)) or (
            weights.size and weights.min() < 0):
        raise DataError(f"{split}_weights: must be finite numbers >= 0")
    return features, labels, weights.astype(np.float32, copy=False)


def _arrays(nest):
    """`nest` (an array, or a dict, list or tuple of them) with numpy arrays for leaves, and
    tuples for lists (tf.data would stack a list into one tensor). A list or tuple of anything
    but arrays, tensors and dicts (numbers, lists of numbers) is one array, as numpy makes it."""
    if isinstance(nest, dict):
        return {key: _arrays(value) for key, value in nest.items()}
    if isinstance(nest, (list, tuple)) and nest and all(
            isinstance(item, (np.ndarray, dict)) or tf.is_tensor(item) for item in nest):
        return tuple(_arrays(item) for item in nest)
    return np.asarray(nest)


def _leaves(nest) -> list[tuple[str, np.ndarray]]:
    """Each leaf of a nest of arrays with its path as messages give it ("", "['a']", "[1]"), in
    tf.nest's order (a dict's keys sorted)."""
    return [("".join(f"[{key!r}]" for key in path), leaf) for path, leaf in _paths(nest)]


def _paths(nest) -> list[tuple[tuple, np.ndarray]]:
    if isinstance(nest, dict):
        return [((key, *path), leaf) for key in sorted(nest) for path, leaf in _paths(nest[key])]
    if isinstance(nest, (list, tuple)):
        return [((i, *path), leaf) for i, item in enumerate(nest) for path, leaf in _paths(item)]
    return [((), nest)]


def _leaf_shapes(nest) -> list[tuple[str, list[int]]]:
    return [(path, list(leaf.shape)) for path, leaf in _leaves(nest)]


def _are_targets(labels) -> bool:
    """Labels that are not one array of integers (class labels) are targets of a Keras loss."""
    return tf.nest.is_nested(labels) or not np.issubdtype(labels.dtype, np.integer)


def _examples(nest) -> int:
    return int(tf.nest.flatten(nest)[0].shape[0])


def _example_spec(nest):
    """One example's TensorSpec of each leaf of a nest of arrays."""
    return tf.nest.map_structure(lambda a: tf.TensorSpec(a.shape[1:], tf.as_dtype(a.dtype)), nest)


def _gather(nest, indices: tf.Tensor):
    return tf.nest.map_structure(lambda tensor: tf.gather(tensor, indices), nest)


def _constants(*arrays) -> tuple:
    with tf.device(_HOST):
        return tuple(tf.nest.map_structure(tf.constant, a) for a in arrays)
