"""The Keras door: `tower_train.keras.fit(model, x, y, ...)`, Keras's `Model.fit` with its
arguments and their meanings, trained by `tower_train.fit` on towers with gradient accumulation
(docs/keras.md).

- `model_fit.py`: `fit`, Keras's arguments mapped onto `tower_train.fit`, and the one callback
  that tells Keras's epochs and batches to the user's callbacks, the History and the progress bar;
- `data.py`: Keras's data arguments as the arrays to train on and the held-out data;
- `compiled_loss.py`: compile()'s loss, or the model's own `compute_loss`, as the run's
  per-example loss;
- `temp_dir.py`: the temporary train_dir of a fit without `train_dir=`.
"""
from tower_train.keras.model_fit import fit

__all__ = ["fit"]
