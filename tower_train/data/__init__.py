"""Input: the data sources, one per file, and the built-in data sets.

- `source`: what a source is (`Source`), the training stream's rules, and `register` for named sets;
- `array_source`: `ArraySource`, arrays in memory;
- `tfrecord`: `TFRecordSource`, streamed TFRecord files; `tfrecord_check` (the files' checksums
  and patterns) and `tfrecord_writer` (`write_examples`) beside it;
- `tf_dataset`: `DatasetSource`, the user's own `tf.data` pipeline;
- `image_sets` and `text_sets`: the built-in sets; `catalog`: a `--dataset` name looked up among them and
  the registered ones.

The names a user's code reaches for are here too: `tower_train.data.register`, `Source`,
`DataError`, `ArraySource` and `write_examples`.
"""
from tower_train.data.array_source import ArraySource
from tower_train.data.source import DataError, Source, register
from tower_train.data.tfrecord_writer import write_examples

__all__ = ["ArraySource", "DataError", "Source", "register", "write_examples"]
