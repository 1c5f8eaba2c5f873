"""`DatasetSource`: the user's own `tf.data` pipeline as a source, which the trainer alone batches.

    source = tower_train.DatasetSource(
        train=lambda: tf.data.Dataset.from_tensor_slices((x, y)).shuffle(10_000, seed=1),
        eval=lambda: tf.data.Dataset.from_tensor_slices((xe, ye)))

`train` and `eval` are zero-argument callables that return a `tf.data.Dataset` of
``(features, labels)`` or ``(features, labels, weights)``, one example per element, or batched
as Keras's fit takes it (read as its examples, in order). The class docstring says how that
becomes the one training stream of `tower_train.data.source`.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import tensorflow as tf

from tower_train.data.source import DataError, Preprocess, Source, weight_check
from tower_train.user_code import call_user_code

DatasetFunction = Callable[[], tf.data.Dataset]
# Examples of two fresh train() datasets compared by `check`: enough that an unseeded shuffle (or
# other random order) shows at once, few enough to cost nothing beyond filling a shuffle buffer.
DETERMINISM_EXAMPLES = 16
_LABELS_READ_AT_ONCE = 4096  # labels per batch while `check` counts the classes


class DatasetSource(Source):
    """A `tf.data` pipeline of the user's: ``train()`` and ``eval()`` return datasets of examples.

    A batched pipeline (``.batch``, as Keras's fit takes it) is read unbatched (``unbatch``):
    its examples in order, which the trainer batches again by batch_size x towers x accum, so
    its own batch size changes nothing, and positions and resumes count examples as below.

    The training stream is ``train()`` read from its start and repeated as ``Dataset.repeat``
    repeats it: epoch e is the e-th pass over that one dataset, so a shuffle with
    ``reshuffle_each_iteration`` (its default) gives every epoch another order, fixed by its
    seed. Stream position p is the p-th example of that sequence, whatever the batch size, so
    every layout of G reads the same examples. The order is the pipeline's own: the run's
    --seed does not reorder it (it seeds `preprocess`, which gets ``[seed, position]`` per
    example). So the pipeline must give the same examples in the same order every time it is
    made: a shuffle needs a seed of its own, and random augmentation belongs in `preprocess`.
    `check` refuses a pipeline whose first `DETERMINISM_EXAMPLES` examples differ between two
    calls of ``train()``, or whose options set ``deterministic=False``.

    Resuming at stream position s skips s examples of the repeated dataset
    (``Dataset.skip``): they are made by the whole pipeline and dropped, so a resume costs
    the input work of everything trained so far (docs/data.md has a measured figure). tf.data's
    own iterator checkpointing would resume without that work, but it saves the iterator's
    buffers (a shuffle buffer of examples, prefetched batches) in every checkpoint and restores
    only the very same pipeline, batch size included; the skip keeps the source's contract that
    a run may resume in any layout, at any worker count.

    Multi-worker training reads the base class's way: every worker makes the whole stream and
    keeps its slice of each global micro-batch, so the workers together train on exactly the
    examples of one process (each worker does all of the pipeline's work).

    Args:
      train: zero-argument callable -> `tf.data.Dataset` of (features, labels) or
        (features, labels, weights), unbatched or batched: features of any dtype, labels integers in
        0 .. num_classes - 1, weights numbers >= 0 of the labels' shape (every label counts 1
        without them); each of a fully known shape. Finite, or infinite with `num_classes`.
      eval: the same for the held-out set (every example once, in order; the last batch may be
        partial), with train's features and labels; None for no held-out set.
      num_classes: labels lie in 0 .. num_classes - 1; None: one more than the largest label of
        one epoch of ``train()`` and all of ``eval()``, which `check` reads once to count them
        (and the epoch's examples, the train_size).
      preprocess: see `tower_train.data.source`; None hands the features over as they are.
      name: for messages and the run record.

    Nothing runs TensorFlow here: the datasets are made and checked by `check` (which `fit`
    calls once the devices exist), and the attributes that need them (feature_spec, label_spec,
    num_classes, train_size) call it on first use.

    Raises:
      DataError: train or eval not callable, in one line; from `check`: a dataset that is not a
        `tf.data.Dataset`, is of another structure, labels that are not integers,
        weights not of the labels' shape, features or labels of train and eval that differ, or a
        train() that is not deterministic, each in one line naming train= or eval=.
      UserCodeError: train() or eval() raised (one line with its file:line); from `check`.
    """

    def __init__(self, train: DatasetFunction, eval: DatasetFunction | None = None,  # noqa: A002
                 num_classes: int | None = None, *, preprocess: Preprocess | None = None,
                 name: str = "dataset"):
        self.name = name
        self.preprocess = preprocess
        for role, function in (("train", train), ("eval", eval)):
            if not callable(function) and not (role == "eval" and function is None):
                raise DataError(f"DatasetSource({role}={function!r}): must be a zero-argument callable "
                                "returning a tf.data.Dataset of (features, labels) or "
                                f"(features, labels, weights){' (or None)' if role == 'eval' else ''}")
        if num_classes is not None and (isinstance(num_classes, bool) or not isinstance(
                num_classes, (int, np.integer)) or num_classes < 1):
            raise DataError(f"DatasetSource(num_classes={num_classes!r}): must be an integer >= 1, "
                            "or None to count the labels")
        self.train, self.eval = train, eval
        self._num_classes = None if num_classes is None else int(num_classes)
        self._specs: dict[str, tuple[tf.TensorSpec, ...]] | None = None  # per role, set by `check`
        self._train_size: int | None = None

    # ----------------------------------------------------------------------------------------------
    # What `check` learns

    @property
    def feature_spec(self) -> tf.TensorSpec:
        return self._checked_specs()["train"][0]

    @property
    def label_spec(self) -> tf.TensorSpec:
        return tf.TensorSpec(self._checked_specs()["train"][1].shape, tf.int32)

    @property
    def num_classes(self) -> int:
        self._checked_specs()
        return self._num_classes

    @property
    def train_size(self) -> int | None:
        self._checked_specs()
        return self._train_size

    def _checked_specs(self) -> dict[str, tuple[tf.TensorSpec, ...]]:
        if self._specs is None:
            self.check()
        return self._specs

    # ----------------------------------------------------------------------------------------------
    # The Source interface

    def _raw_train_batches(self, seed: int, start_position: int, batch: int) -> tf.data.Dataset:
        self._checked_specs()  # eagerly: `_completed` runs traced, where check() could not read
        examples = self._dataset("train").repeat()
        if start_position:
            examples = examples.skip(start_position)
        options = tf.data.Options()
        options.deterministic = True

        # Positions are counted per batch, not zipped to each example: one op less per example.
        def numbered(index, example):
            positions = start_position + index * batch + tf.range(batch, dtype=tf.int64)
            return (positions, *self._completed("train", example))

        # drop_remainder on an infinite stream only makes the static batch dimension known.
        return examples.with_options(options).batch(batch, drop_remainder=True).enumerate().map(
            numbered, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)

    def _raw_eval_batches(self, batch_size: int) -> tf.data.Dataset:
        specs = self._checked_specs()
        if self.eval is None:
            train = specs["train"]
            examples = tf.data.Dataset.from_tensor_slices(
                tuple(tf.zeros([0, *spec.shape], spec.dtype) for spec in train[:2]))
            role = "train"
        else:
            examples, role = self._dataset("eval"), "eval"
        examples = tf.data.Dataset.zip(tf.data.Dataset.counter(), examples)
        return examples.batch(batch_size).map(
            lambda indices, example: (indices, *self._completed(role, example)),
            num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)

    def check(self) -> None:
        """Makes the datasets and checks them, once: their structure and specs, train() against
        eval(), and that two calls of train() give the same first examples; counts the classes
        when num_classes is None. Not done in the constructor: it starts TensorFlow's runtime,
        after which `fit` could no longer create the logical devices."""
        if self._specs is not None:
            return
        train = self._dataset("train")
        specs = {"train": self._example_specs("train", train)}
        if self.eval is not None:
            specs["eval"] = self._example_specs("eval", self._dataset("eval"))
            for i, what in enumerate(("features", "labels")):
                got, want = specs["eval"][i], specs["train"][i]
                if got.dtype != want.dtype or got.shape != want.shape:
                    raise DataError(f"{self._culprit('eval')}: eval()'s {what} are {_describe(got)}, "
                                    f"train()'s {_describe(want)}: each example must have the same "
                                    "shape and dtype")
        self._check_deterministic(train)
        cardinality = int(train.cardinality())
        self._train_size = cardinality if cardinality > 0 else None
        if self._num_classes is None:
            self._num_classes, self._train_size = self._count_classes(train, cardinality)
        self._specs = specs

    # ----------------------------------------------------------------------------------------------
    # The checks

    def _culprit(self, role: str) -> str:
        function = getattr(self, role)
        label = getattr(function, "__qualname__", None) or type(function).__qualname__
        return f"DatasetSource({role}={getattr(function, '__module__', None) or '?'}.{label})"

    def _dataset(self, role: str) -> tf.data.Dataset:
        """A fresh dataset of examples from the user's `train` or `eval`, unbatched if batched."""
        culprit = self._culprit(role)
        dataset = call_user_code(getattr(self, role), culprit)
        if not isinstance(dataset, tf.data.Dataset):
            raise DataError(f"{culprit}: {role}() returned {type(dataset).__name__}, not a "
                            "tf.data.Dataset of (features, labels) or (features, labels, weights)")
        batching = _batching(dataset)
        if batching:
            try:
                dataset = dataset.unbatch()
            except ValueError as e:  # an element of rank 0: tf.data says which
                raise DataError(f"{culprit}: {role}() returns a batched dataset ({batching}) that "
                                f"cannot be unbatched into examples ({' '.join(str(e).split())})") from None
        return dataset

    def _example_specs(self, role: str, dataset: tf.data.Dataset) -> tuple[tf.TensorSpec, ...]:
        """One example's (features, labels[, weights]) specs, or DataError naming what is wrong."""
        culprit, spec = self._culprit(role), dataset.element_spec
        expected = ("(features, labels) or (features, labels, weights) tensors, one example per "
                    "element")
        if not isinstance(spec, tuple) or len(spec) not in (2, 3) or not all(
                isinstance(s, tf.TensorSpec) for s in spec):
            raise DataError(f"{culprit}: {role}() yields {_describe(spec)}: expected {expected}")
        for what, s in zip(("features", "labels", "weights"), spec):
            if not s.shape.is_fully_defined():
                batched = s.shape.rank and s.shape[0] is None
                raise DataError(f"{culprit}: {role}()'s {what} are {_describe(s)}: "
                                + ("batched? (.batch leaves the first dimension unknown) "
                                   if batched else "")
                                + "each example needs a fully known shape (pad it, or "
                                "tf.ensure_shape in a map), one example per element")
        if not spec[1].dtype.is_integer:
            raise DataError(f"{culprit}: {role}()'s labels are {_describe(spec[1])}: class labels "
                            "must be integers")
        if len(spec) == 3 and (spec[2].shape != spec[1].shape or not (
                spec[2].dtype.is_floating or spec[2].dtype.is_integer)):
            raise DataError(f"{culprit}: {role}()'s weights are {_describe(spec[2])}: they must be "
                            f"numbers of the labels' shape {spec[1].shape.as_list()}")
        if dataset.options().deterministic is False:
            raise DataError(f"{culprit}: {role}() sets tf.data.Options().deterministic = False: "
                            "exact resume and the same order in every layout need the same order "
                            "every time")
        return spec

    def _check_deterministic(self, train: tf.data.Dataset) -> None:
        first = list(train.take(DETERMINISM_EXAMPLES).as_numpy_iterator())
        if not first:
            raise DataError(f"{self._culprit('train')}: train() yields no example; a source needs "
                            "at least one")
        again = list(self._dataset("train").take(DETERMINISM_EXAMPLES).as_numpy_iterator())
        if not _same_examples(first, again):
            raise DataError(f"{self._culprit('train')}: train() is not deterministic: two calls gave "
                            f"different examples among the first {DETERMINISM_EXAMPLES} (a shuffle "
                            "without a seed? random ops in a map?); exact resume and the same order "
                            "in every layout need the same order every time: seed the shuffle, and "
                            "augment in preprocess=, which gets each example's seed")

    def _count_classes(self, train: tf.data.Dataset, cardinality: int) -> tuple[int, int]:
        """(one more than the largest label of an epoch of train and all of eval, train's
        examples in one epoch), read once."""
        culprit = self._culprit("train")
        if cardinality == tf.data.INFINITE_CARDINALITY:
            raise DataError(f"{culprit}: train() is infinite, so its labels cannot be counted: give "
                            "DatasetSource(num_classes=...)")

        def labels(role: str, dataset: tf.data.Dataset) -> tuple[int, int]:
            """(examples, largest label or -1 for none), refusing a negative label."""
            batches = dataset.map(lambda *example: tf.cast(example[1], tf.int64)).batch(
                _LABELS_READ_AT_ONCE)
            state = (tf.constant(0, tf.int64), tf.constant(np.iinfo(np.int64).max),
                     tf.constant(-1, tf.int64))
            count, smallest, largest = call_user_code(lambda: batches.reduce(state, lambda s, b: (
                s[0] + tf.shape(b, out_type=tf.int64)[0], tf.minimum(s[1], tf.reduce_min(b)),
                tf.maximum(s[2], tf.reduce_max(b)))), self._culprit(role))
            if int(count) and int(smallest) < 0:
                raise DataError(f"{self._culprit(role)}: {role}() has label {int(smallest)}: labels "
                                "must be >= 0")
            return int(count), int(largest)

        examples, largest = labels("train", train)
        if self.eval is not None:
            largest = max(largest, labels("eval", self._dataset("eval"))[1])
        if largest >= np.iinfo(np.int32).max:
            raise DataError(f"{culprit}: a label is {largest}: labels must fit in int32")
        return largest + 1, examples

    # ----------------------------------------------------------------------------------------------

    def _completed(self, role: str, example: tuple) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
        """A batch of the user's examples as (features, labels int32, weights float32), labels
        checked against the classes and weights against being negative or not finite. Runs
        traced, after `check`."""
        features, labels = example[0], tf.cast(example[1], tf.int64)
        in_range = tf.reduce_all((labels >= 0) & (labels < self._num_classes))
        check = tf.debugging.Assert(in_range, [
            f"{self.name}: {role}() has a label outside 0..{self._num_classes - 1}:", labels],
            summarize=16)
        if len(example) == 3:
            weights = tf.cast(example[2], tf.float32)
            valid = weight_check(weights, f"{self.name}: {role}() has")
        else:
            weights, valid = tf.ones_like(labels, tf.float32), tf.no_op()
        with tf.control_dependencies([check, valid]):
            return features, tf.cast(labels, tf.int32), tf.identity(weights)


def _batching(dataset: tf.data.Dataset) -> str | None:
    """The batching transformation (its class, e.g. '_BatchDataset') the dataset ends in, if one
    precedes any unbatch on the way to its sources; None if there is none. A batch with
    drop_remainder leaves a fully known shape, so the element spec alone cannot tell it from an
    example; the chain of transformations can (tf.data's `_inputs`, private but long stable)."""
    pending = [dataset]
    while pending:
        current = pending.pop()
        kind = type(current).__name__
        if "Unbatch" in kind:
            continue
        if "Batch" in kind or "GroupByWindow" in kind:
            return f"{kind.strip('_')}: .batch, .padded_batch, .ragged_batch or a bucketing"
        pending.extend(getattr(current, "_inputs", list)())
    return None


def _describe(spec: object) -> str:
    """An element spec in a few words: 'float32 [6]', '(float32 [6], int64 [])', 'a dict'."""
    if isinstance(spec, tf.TensorSpec):
        shape = spec.shape.as_list() if spec.shape.rank is not None else "(unknown shape)"
        return f"{spec.dtype.name} {shape}"
    if isinstance(spec, tuple):
        return f"a tuple of {len(spec)} ({', '.join(_describe(s) for s in spec)})"
    if isinstance(spec, dict):
        return f"a dict ({', '.join(map(str, spec))})"
    return type(spec).__name__


def _same_examples(first: list, again: list) -> bool:
    if len(first) != len(again):
        return False
    for a, b in zip(first, again):
        for x, y in zip(a, b):
            x, y = np.asarray(x), np.asarray(y)
            nan = np.issubdtype(x.dtype, np.inexact)
            if x.shape != y.shape or not np.array_equal(x, y, equal_nan=nan):
                return False
    return True
