"""The import path README.md gave for `write_examples` and `TFRecordSource` before the data sources
moved into `tower_train.data` (issue 32): users' scripts that import from here keep working."""
from tower_train.data.tfrecord import TFRecordSource
from tower_train.data.tfrecord_writer import write_examples

__all__ = ["TFRecordSource", "write_examples"]
