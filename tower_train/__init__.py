"""tower-train: data-parallel training with towers and gradient accumulation in TF2.

The Python API (`fit`, `ArraySource`, `TFRecordSource`, `DatasetSource`, `TowerModel`) is loaded on
first use, so that the command line can check its flags before TensorFlow loads.
"""
from __future__ import annotations

import importlib

from tower_train.errors import Stopped, TrainingError, UsageError
from tower_train.quiet_start import quiet_tensorflow_start

# Before anything loads TensorFlow: a script that imports tower_train first, then keras, sees
# none of TensorFlow's C++ start-up lines (README.md, "TensorFlow's start-up lines").
quiet_tensorflow_start()

_LAZY = {
    "fit": "tower_train.api",
    "create_devices": "tower_train.api",
    "evaluate_checkpoint": "tower_train.eval",
    "ArraySource": "tower_train.data.array_source",
    "Source": "tower_train.data.source",
    "DatasetSource": "tower_train.data.tf_dataset",
    "TFRecordSource": "tower_train.data.tfrecord",
    "TowerModel": "tower_train.models",
    "TrainResult": "tower_train.training.train",
}

__all__ = ["Stopped", "TrainingError", "UsageError", *_LAZY]


def __getattr__(name: str):
    if name == "keras":  # tower_train.keras.fit: Keras's Model.fit on towers
        return importlib.import_module("tower_train.keras")
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tower_train' has no attribute {name!r}")
