"""`TFRecordSource`: a streaming source of `tf.train.Example` records in TFRecord files. Its files
are checked whole by `tfrecord_check`; `tfrecord_writer.write_examples` writes such files from
numpy arrays (and is importable from here too, where the docs have always shown it).

The records are read as a stream, never loaded whole, in parallel (`tfrecord_read`): what the
pipeline holds at any time is bounded by the shuffle buffer, the chunks being read and a few
batches, whatever the number of records.
"""

from __future__ import annotations

import re
from typing import Callable, Mapping, Sequence, TypeVar, Union

import numpy as np
import tensorflow as tf

from tower_train.data.batch_parse import parse_batch
from tower_train.data.source import (_HOST, TRAIN_PREFETCH, DataError, Preprocess, Source, check_stream_arguments,
                                     weight_check, without_autotuning)
from tower_train.errors import UsageError, op_error_text
from tower_train.data.tfrecord_check import COMPRESSIONS, Files, checked_chunks, file_fault
from tower_train.data.tfrecord_read import empty_records, numbered, read_records
from tower_train.user_code import UserCodeError, describe, where

FeatureConfig = Union[tf.io.FixedLenFeature, tf.io.VarLenFeature, tf.io.FixedLenSequenceFeature,
                      tf.io.RaggedFeature, tf.io.SparseFeature]
Parse = Callable[[dict], tuple]
T = TypeVar("T")
_FEATURE_TYPES = (tf.io.FixedLenFeature, tf.io.VarLenFeature, tf.io.FixedLenSequenceFeature,
                  tf.io.RaggedFeature, tf.io.SparseFeature)

SHARDINGS = ("stream", "files")
# Second word of the shuffle key [seed, salt]: keeps these shuffles apart from any other use of the
# training seed (ArraySource's permutations, preprocessing's per-example seeds [seed, position]).
_SHUFFLE_SALT = 0x7F5EC0DE
# TensorFlow's DataLossError names the offset of the record it failed on, never the file.
_FAILED_OFFSET = re.compile(r"(?:corrupted|truncated) record at (\d+)")


class TFRecordSource(Source):
    """`tf.train.Example` records in TFRecord files, streamed (never loaded whole).

    Each record is parsed with ``tf.io.parse_single_example(record, features)``, and `parse`
    turns that dict of ONE example into ``(features, labels)`` or ``(features, labels, weights)``:
    features of `feature_spec`, labels of `label_spec` (integers in 0 .. num_classes - 1), weights
    float of the labels' shape (all ones when `parse` returns none). Shapes must be static: a
    variable-length sequence is padded by `parse` to a fixed length, with label 0 and weight 0 on
    the padding. Batches then reach the trainer as features [b, *feature_spec.shape], labels
    [b, *label_spec.shape], weights float32 [b, *label_spec.shape].

    The training stream is a pure function of (seed, stream position), whatever the batch size:
    the train files are read one after the other in their order (see Args); each epoch is that
    sequence of records through a shuffle buffer of `shuffle_buffer` records seeded by
    (seed, epoch) alone (not by TensorFlow's global seed, nor by how often the dataset was
    iterated), and epochs follow each other without end. Stream position p is the p-th record of
    that sequence. So resuming at ``start_position`` continues the very same stream, and any
    factoring of the global batch reads the same examples. With shuffle_buffer 0 or 1 the stream
    is the records in file order, repeating. A buffer shuffles locally only: a record moves at
    most about `shuffle_buffer` places ahead, so files should not be sorted by label; several
    files with mixed contents and a buffer of a few thousand records are the usual remedy.

    Resuming at start_position reads, but does not parse, the records before it: when that is
    more than one epoch, the first epoch is counted (read once, not shuffled) and whole epochs
    are then skipped without reading, so a resume costs at most two epochs of reading.

    Multi-worker training (``train_stream(shard_index=k, num_shards=W)``), `sharding`:

    * ``"stream"`` (default): every worker reads the whole stream, cut into global batches of
      micro_batch x W, and keeps (parses and preprocesses) only slice k of each. Exact: the W
      workers together train on precisely the examples one process would, so results match a
      single-process run and resuming with another W is seamless. Cost: each worker reads all
      records (W x the reading and shuffling of one process in total; per worker, the I/O of the
      full data set), but parses only 1/W of them. Fine while reading is cheap next to the
      model; at scale (many workers, large records, remote storage) reading becomes the limit.
      Equivalence tests (one process vs several) must use "stream".
    * ``"files"``: worker k reads only train files i with i % W == k (what
      ``Dataset.shard(W, k)`` does to the file list), shuffles them with a seed of its own and
      batches its own micro_batch from them. Reading is 1/W per worker, so this scales, but an
      update's examples differ from a single process's (and from any other W): not comparable
      across worker counts, epochs of different workers drift apart when their files hold
      different numbers of records, and it needs at least W train files (better many more, of
      similar size). start_position (examples consumed by all workers) must be a multiple of
      W; worker k resumes its own stream at start_position / W. Preprocessing seeds are
      [seed, local_position * W + k], distinct over the workers.

    With W == 1 both are the same stream.

    Args:
      train_files, eval_files: paths or glob patterns (a string is one pattern), read by
        `tf.io.gfile`, so remote file systems work too. Files are taken in the order of the
        patterns, each pattern's matches in sorted order; a file matched twice is read once.
        Each pattern must match at least one file, and each file must be a whole TFRecord
        file of `compression`: checked here, once, by walking its records' headers
        (`tfrecord_check.file_fault`). eval_files None: no held-out set (evaluation counts no example).
      features: name -> `tf.io.FixedLenFeature`, `VarLenFeature`, ... for parse_single_example.
      parse: dict of one parsed example -> (features, labels) or (features, labels, weights).
        Traced once on no data by `check` (which `fit` calls), to check what it returns
        against the specs.
      feature_spec, label_spec: one example's features and labels (fully known shape, dtype);
        labels of an integer dtype.
      num_classes: labels lie in 0 .. num_classes - 1 (checked as examples are read).
      train_size: examples in one epoch if known (only the exponential learning-rate schedule
        needs it); never counted here.
      shuffle_buffer: records in the shuffle buffer; 0 or 1: no shuffling, file order.
      preprocess: see `tower_train.data.source`: runs on parsed batches, after the worker's slice is
        taken; None hands the features over as they are.
      sharding: "stream" or "files", see above.
      compression: None (or ""), "ZLIB" or "GZIP", for every file.
      name: for messages and the run record.

    Raises:
      DataError: an unusable argument, a pattern that matches no file, a file that is not a
        whole TFRecord file of `compression` (unreadable, truncated, of another compression or
        none), or a `parse` whose results do not fit the specs, in one line naming it.
      UserCodeError: `parse` raised while traced (one line with its file:line); from `check`.
    """

    def __init__(self, train_files: Files, eval_files: Files | None = None, *,
                 features: Mapping[str, FeatureConfig], parse: Parse,
                 feature_spec: tf.TensorSpec, label_spec: tf.TensorSpec, num_classes: int,
                 train_size: int | None = None, shuffle_buffer: int = 10_000,
                 preprocess: Preprocess | None = None, sharding: str = "stream",
                 compression: str | None = None, name: str = "tfrecord"):
        self.name = name
        if sharding not in SHARDINGS:
            raise DataError(f"{name}: sharding={sharding!r}: must be one of "
                            f"{', '.join(map(repr, SHARDINGS))}")
        if compression not in COMPRESSIONS:
            raise DataError(f"{name}: compression={compression!r}: must be None, 'ZLIB' or 'GZIP'")
        _check_int(name, "num_classes", num_classes, 1)
        _check_int(name, "shuffle_buffer", shuffle_buffer, 0)
        if train_size is not None:
            _check_int(name, "train_size", train_size, 1)
        for what, spec in (("feature_spec", feature_spec), ("label_spec", label_spec)):
            if not isinstance(spec, tf.TensorSpec) or not spec.shape.is_fully_defined():
                raise DataError(f"{name}: {what}={spec!r}: must be a tf.TensorSpec of a fully known "
                                "shape (one example, without the batch axis)")
        if not label_spec.dtype.is_integer:
            raise DataError(f"{name}: label_spec has dtype {label_spec.dtype.name}: class labels must "
                            "be integers")
        if not isinstance(features, Mapping) or not features or not all(
                isinstance(key, str) and isinstance(value, _FEATURE_TYPES)
                for key, value in features.items()):
            raise DataError(f"{name}: features must be a non-empty dict of name -> tf.io.FixedLenFeature, "
                            "VarLenFeature, FixedLenSequenceFeature, RaggedFeature or SparseFeature")
        if not callable(parse):
            raise DataError(f"{name}: parse={parse!r} is not callable")
        self.features = dict(features)
        self.parse = parse
        self.feature_spec = feature_spec
        self.label_spec = label_spec
        self.num_classes = int(num_classes)
        self.train_size = None if train_size is None else int(train_size)
        self.shuffle_buffer = int(shuffle_buffer)
        self.preprocess = preprocess
        self.sharding = sharding
        self.compression = compression or None
        self._chunks = checked_chunks(name, "train_files", train_files, self.compression)
        self.train_files = list(self._chunks)
        self.eval_files = None
        if eval_files is not None:
            held_out = checked_chunks(name, "eval_files", eval_files, self.compression)
            self._chunks.update(held_out)
            self.eval_files = list(held_out)
        self._parse_signature: tuple[tf.TensorSpec, ...] | None = None  # known once `check` has traced parse

    # ----------------------------------------------------------------------------------------------
    # The Source interface

    def _raw_train_batches(self, seed: int, start_position: int, batch: int) -> tf.data.Dataset:
        examples = self._train_examples(self.train_files, _shuffle_key(seed), start_position, batch)
        return self._parse_batches(examples, batch, drop_remainder=True)

    def _raw_eval_batches(self, batch_size: int) -> tf.data.Dataset:
        records = (empty_records() if self.eval_files is None else self._read(self.eval_files))
        examples = numbered(records, 0, batch_size, drop_remainder=False)
        return self._parse_batches(examples, batch_size, drop_remainder=False)

    def train_stream(self, *, seed: int, start_position: int, micro_batch: int,
                     shard_index: int = 0, num_shards: int = 1, preprocessed: bool = True) -> tf.data.Dataset:
        """As `Source.train_stream`, with `sharding` deciding what a shard reads (class docstring).

        With num_shards == 1 this is `Source.train_stream`. Otherwise "stream" keeps the base
        class's examples (slice shard_index of each global batch) but drops the other slices
        before parsing them; "files" reads this shard's own files.
        """
        if num_shards == 1:
            return super().train_stream(seed=seed, start_position=start_position, micro_batch=micro_batch,
                                        shard_index=shard_index, num_shards=num_shards,
                                        preprocessed=preprocessed)
        check_stream_arguments(seed, start_position, micro_batch, shard_index, num_shards)
        with tf.device(_HOST):
            if self.sharding == "stream":
                examples = self._train_examples(self.train_files, _shuffle_key(seed), start_position,
                                                micro_batch * num_shards)
                mine = slice(shard_index * micro_batch, (shard_index + 1) * micro_batch)
                examples = examples.map(lambda positions, records: (positions[mine], records[mine]))
            else:
                if start_position % num_shards:
                    raise ValueError(f"sharding='files': start_position {start_position} must be a multiple "
                                     f"of num_shards={num_shards} (examples consumed by all workers)")
                files = self.train_files[shard_index::num_shards]  # = Dataset.shard(num_shards, shard_index)
                if not files:
                    raise DataError(f"{self.name}: sharding='files' with {num_shards} workers needs at least "
                                    f"{num_shards} train files, found {len(self.train_files)}; use "
                                    "sharding='stream' or split the data into more files")
                key = _shuffle_key(seed, shard_index, num_shards)
                examples = self._train_examples(files, key, start_position // num_shards, micro_batch).map(
                    lambda positions, records: (positions * num_shards + shard_index, records))
            batches = self._parse_batches(examples, micro_batch, drop_remainder=True)

            def prepare(positions, features, labels, weights):
                return self.train_input(features, seed, positions, preprocessed), labels, weights

            batches = batches.map(prepare, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
            return without_autotuning(batches.prefetch(TRAIN_PREFETCH))

    def describe_error(self, error: tf.errors.OpError) -> str:
        """As `Source.describe_error`, naming the file, which TensorFlow's error does not (it
        names at most an offset): a file that cannot be read (deleted, corrupted, cut since it
        was checked) is found by checking the files again, one with a record that does not
        parse as `features` by parsing them, file by file, until one fails."""
        parse_error = isinstance(error, tf.errors.InvalidArgumentError) and "ParseExample" in error.message
        if isinstance(error, (tf.errors.DataLossError, tf.errors.NotFoundError)) or parse_error:
            failed = _FAILED_OFFSET.search(error.message)
            suspect = int(failed[1]) if failed else None
            for what, files in (("train_files", self.train_files), ("eval_files", self.eval_files or ())):
                for path in files:
                    if parse_error:
                        fault = (None if self._parses(path)
                                 else f"has a record that does not parse: {op_error_text(error)}")
                    else:
                        fault = file_fault(path, self.compression, suspect)
                    if fault:
                        return f"{self.name}: {what}: {path!r} {fault}"
        return op_error_text(error)

    def _parses(self, path: str) -> bool:
        """Whether every record of the file parses as `features` (a file that cannot be read
        at all is another fault, not this one)."""
        parsed = self._read([path]).batch(1024).map(lambda records: tf.io.parse_example(records, self.features))
        try:
            parsed.reduce(tf.constant(0), lambda count, _: count + 1)
        except tf.errors.InvalidArgumentError:
            return False
        except tf.errors.OpError:
            pass
        return True

    # ----------------------------------------------------------------------------------------------
    # The pipeline

    def _read(self, files: Sequence[str]) -> tf.data.Dataset:
        """The records of `files`, file after file, each file in its order, read in parallel."""
        return read_records(files, self._chunks, self.compression)

    def _epoch(self, files: Sequence[str], key: tf.Tensor, epoch: tf.Tensor) -> tf.data.Dataset:
        """Epoch `epoch`'s records: all of `files` through a shuffle buffer seeded by (key, epoch)."""
        records = self._read(files)
        if self.shuffle_buffer <= 1:
            return records
        words = tf.random.stateless_uniform([2], seed=tf.random.experimental.stateless_fold_in(key, epoch),
                                            minval=None, maxval=None, dtype=tf.int64)
        # Seeds (0, 0) would make the kernel draw a nondeterministic seed.
        seed2 = tf.where(tf.reduce_all(tf.equal(words, 0)), tf.constant(1, tf.int64), words[1])
        # The raw op with explicit seeds: Dataset.shuffle(seed=s) mixes TensorFlow's global seed
        # into its seeds and, with reshuffle_each_iteration, reshuffles every time the same dataset
        # is iterated again; both would break the stream's purity.
        variant = tf.raw_ops.ShuffleDatasetV3(
            input_dataset=tf.data.experimental.to_variant(records),
            buffer_size=tf.constant(self.shuffle_buffer, tf.int64), seed=words[0], seed2=seed2,
            seed_generator=tf.raw_ops.DummySeedGenerator(), reshuffle_each_iteration=False,
            output_types=[tf.string], output_shapes=[tf.TensorShape([])])
        return tf.data.experimental.from_variant(variant, records.element_spec)

    def _train_examples(self, files: Sequence[str], key: tf.Tensor, start_position: int,
                        batch: int) -> tf.data.Dataset:
        """Infinite batches of `batch` consecutive stream positions from `start_position`:
        (positions int64 [batch], records string [batch]), not parsed."""
        first_epoch, first_position = self._skippable_epochs(files, start_position)
        records = tf.data.Dataset.counter(start=first_epoch).flat_map(
            lambda epoch: self._epoch(files, key, epoch))
        if start_position > first_position:  # a skip op costs every later record a call too
            records = records.skip(start_position - first_position)
        examples = numbered(records, start_position, batch, drop_remainder=True)
        options = tf.data.Options()
        options.deterministic = True
        return examples.with_options(options)

    def _skippable_epochs(self, files: Sequence[str], start_position: int) -> tuple[int, int]:
        """(epoch, its first stream position) that the stream at start_position is in, when that
        epoch can be reached without reading the ones before: counts the records of `files`, up
        to start_position + 1 of them. Also refuses files that hold no record at all (the stream
        would wait for ever)."""
        try:
            count = int(self._read(files).take(start_position + 1).reduce(
                tf.constant(0, tf.int64), lambda n, _: n + 1))
        except (tf.errors.DataLossError, tf.errors.NotFoundError) as e:
            raise DataError(self.describe_error(e)) from None
        if count == 0:
            raise DataError(f"{self.name}: the train files ({_describe_files(files)}) hold no record")
        if count <= start_position:  # count is the whole epoch
            epoch = start_position // count
            return epoch, epoch * count
        return 0, 0

    def _parse_batches(self, examples: tf.data.Dataset, batch: int, drop_remainder: bool) -> tf.data.Dataset:
        """Batches of (positions, records) -> (positions int64, features, labels, weights float32).

        When every feature has a fixed length, a batch of records is parsed at once
        (`tf.io.parse_example`) and `parse` run over it by `parse_batch` (vectorized where it
        can be), which costs far less per example than a map over single records; otherwise
        record by record, as `parse` sees a variable-length feature unpadded only then."""
        if not all(isinstance(f, tf.io.FixedLenFeature) for f in self.features.values()):
            def parse_one(position, record):
                return (position, *self._checked(*self._user_parse(record)))

            parsed = examples.unbatch().map(parse_one, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
            return parsed.batch(batch, drop_remainder=drop_remainder)

        def parse_many(positions, records):
            columns = tf.io.parse_example(records, self.features)
            out = parse_batch(self._call_parse, columns, self._signature())
            return (positions, *self._checked(*out, batched=True))

        return examples.map(parse_many, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)

    def _call_parse(self, example: dict[str, tf.Tensor]) -> tuple:
        out = self.parse(example)
        return tuple(out) if isinstance(out, (list, tuple)) else out

    def _user_parse(self, record: tf.Tensor) -> tuple:
        return self._call_parse(tf.io.parse_single_example(record, self.features))

    def _checked(self, *out: tf.Tensor, batched: bool = False) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
        """What parse returned for one example (or, `batched`, for a batch of them) as (features,
        labels, weights float32) of the declared shapes, labels checked against the classes."""
        lead = [None] if batched else []
        features = tf.ensure_shape(out[0], lead + self.feature_spec.shape.as_list())
        labels = tf.ensure_shape(out[1], lead + self.label_spec.shape.as_list())
        in_range = tf.reduce_all((labels >= 0) & (labels < self.num_classes))
        check = tf.debugging.Assert(in_range, [
            f"{self.name}: a record has a label outside 0..{self.num_classes - 1} "
            "(pad label sequences with label 0 and weight 0):", labels], summarize=16)
        with tf.control_dependencies([check]):
            labels = tf.identity(labels)
        if self.returns_weights:
            weights = tf.ensure_shape(tf.cast(out[2], tf.float32), lead + self.label_spec.shape.as_list())
            valid = weight_check(weights, f"{self.name}: a record has")
            with tf.control_dependencies([valid]):
                weights = tf.identity(weights)
        else:
            weights = tf.ones_like(labels, tf.float32)
        return features, labels, weights

    @property
    def returns_weights(self) -> bool:
        return len(self._signature()) == 3

    def _signature(self) -> tuple[tf.TensorSpec, ...]:
        """What `parse` returns for one example: features and labels of their specs, then weights
        (of the labels' shape, in parse's own dtype) if it returns them."""
        self.check()
        return self._parse_signature

    def check(self) -> None:
        """Traces `parse` on no data and checks what it returns against the specs.

        Not done in the constructor: tracing starts TensorFlow's runtime, after which `fit` could
        no longer create the logical devices. `fit` calls it once the devices exist.
        """
        if self._parse_signature is None:
            self._parse_signature = self._check_parse()

    def _check_parse(self) -> tuple[tf.TensorSpec, ...]:
        """Traces `parse` on no data, checks what it returns and returns its `_signature`."""
        def trace(autograph: bool):
            function = (self._user_parse if autograph
                        else tf.autograph.experimental.do_not_convert(self._user_parse))
            return empty_records().map(function).element_spec

        # Traced as plain Python first: an error then names the user's own file and line, where
        # AutoGraph's would name its generated code. A parse that needs AutoGraph (Python control
        # flow on tensors) is traced again as the pipeline will run it.
        try:
            spec = trace(autograph=False)
        except UsageError:
            raise
        except Exception as plain:  # the user's code may raise anything
            spec = _retry_user_code(lambda: trace(autograph=True), f"{self.name}: parse", plain)
        expected = "(features, labels) or (features, labels, weights) tensors"
        if not isinstance(spec, tuple) or len(spec) not in (2, 3) or not all(
                isinstance(s, tf.TensorSpec) for s in spec):
            raise DataError(f"{self.name}: parse returns {spec}: expected {expected}")
        for what, got, want in (("features", spec[0], self.feature_spec),
                                ("labels", spec[1], self.label_spec)):
            if got.dtype != want.dtype or not want.shape.is_compatible_with(got.shape):
                raise DataError(f"{self.name}: parse returns {what} {got.dtype.name} {_shape(got.shape)}, "
                                f"but {what[:-1]}_spec says {want.dtype.name} {_shape(want.shape)}")
        if len(spec) == 3:
            weights = spec[2]
            if not (weights.dtype.is_floating or weights.dtype.is_integer) or not \
                    self.label_spec.shape.is_compatible_with(weights.shape):
                raise DataError(f"{self.name}: parse returns weights {weights.dtype.name} "
                                f"{_shape(weights.shape)}: expected numbers of the labels' shape "
                                f"{_shape(self.label_spec.shape)}")
        return (self.feature_spec, self.label_spec,
                *(tf.TensorSpec(self.label_spec.shape, weights.dtype) for weights in spec[2:]))


# --------------------------------------------------------------------------------------------------
# Helpers


def _retry_user_code(function: Callable[[], T], what: str, error: BaseException) -> T:
    """`function()`; if it raises too, `error` (the first attempt's) as a one-line UserCodeError."""
    try:
        return function()
    except UsageError:
        raise
    except Exception:  # the user's code may raise anything
        raise UserCodeError(f"{what}: {where(error)}: {describe(error)}") from error


def _check_int(name: str, what: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise DataError(f"{name}: {what}={value!r}: must be an integer >= {minimum}")


def _shuffle_key(seed: int, shard_index: int = 0, num_shards: int = 1) -> tf.Tensor:
    """int64 [2]: the key of every epoch's shuffle seed; a worker of sharding="files" has its own."""
    with tf.device(_HOST):
        key = tf.constant([seed, _SHUFFLE_SALT], tf.int64)
        if num_shards > 1:
            key = tf.random.experimental.stateless_fold_in(
                tf.random.experimental.stateless_fold_in(key, num_shards), shard_index)
        return key


def _shape(shape: tf.TensorShape) -> str:
    return str(shape.as_list()) if shape.rank is not None else "(unknown shape)"


def _describe_files(files: Sequence[str]) -> str:
    return repr(files[0]) if len(files) == 1 else f"{files[0]!r} and {len(files) - 1} more"
