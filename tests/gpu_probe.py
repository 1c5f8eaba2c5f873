"""Checks that need a GPU visible to the process, run by tests/test_gpu.py as a child process (the
test process itself hides its GPUs: tests/conftest.py). Prints one JSON line.

    python tests/gpu_probe.py xla    # tower mode with --jit_compile against without, on 2 logical GPUs
    python tests/gpu_probe.py tf32   # the first gradient on /gpu:0 against /cpu:0, TF32 on and off
"""
import dataclasses
import json
import sys

import numpy as np


def relative_error(got, want) -> float:
    """|got - want| / |want| over all tensors together (global norms)."""
    difference = np.sqrt(sum(np.sum((np.asarray(g) - np.asarray(w)) ** 2) for g, w in zip(got, want, strict=True)))
    return float(difference / np.sqrt(sum(np.sum(np.asarray(w) ** 2) for w in want)))


def xla() -> dict:
    """Three updates of 2 towers on logical GPUs, K = 2, momentum, TF32 off: with --jit_compile
    against without, for the parameter device on the host and spread over the towers."""
    import tensorflow as tf

    from tower_train.data import catalog
    from tower_train.api import prepare_devices
    from tower_train.config import TrainConfig
    from tower_train.model_spec import resolve_model
    from tower_train.step.modes import build_mode
    from tower_train.numerics import run_numerics
    from tower_train.training.run import Run

    base = TrainConfig(train_dir="/unused", num_gpus=2, gpu_memory_mb=4000, accum=2, batch_size=32,
                       optimizer="momentum", learning_rate=0.05)
    plan = prepare_devices(base)
    errors = {}
    for ps_device in ("cpu", "spread"):
        trained = []
        for jit_compile in (False, True):
            config = dataclasses.replace(base, ps_device=ps_device, jit_compile=jit_compile)
            source = catalog.load_source(config.dataset, None, config.augment)
            run = Run.create(resolve_model(None, config, None, source.num_classes), source, build_mode(config, plan))
            batches = run.batches()
            with run_numerics(deterministic=False, tf32=False):
                for _ in range(3):
                    assert run.inner.run_update(batches).applied
            run.inner.sync_state()
            trained.append([tf.convert_to_tensor(v).numpy() for v in run.state.model.trainable_variables])
        errors[ps_device] = relative_error(trained[1], trained[0])
    return {"towers": list(plan.tower_devices), "relative_error": errors}


def tf32() -> dict:
    """The gradient of one batch of 64 on /gpu:0 against the same on /cpu:0, from the same weights,
    with TF32 on and off (and off under op determinism, whose cuDNN algorithms differ): for
    cifar10_cnn (convolutions, LRN, matmuls) and for a dense network (matmuls alone)."""
    import keras
    import tensorflow as tf

    from tower_train.data import catalog
    from tower_train.config import TrainConfig
    from tower_train.model_spec import build_model, resolve_model
    from tower_train.models import TowerModel
    from tower_train.numerics import run_numerics
    from tower_train.step.towers import tower_loss_and_gradients

    class Dense(TowerModel):
        def __init__(self, num_classes: int, **kwargs):
            super().__init__(num_classes, **kwargs)
            self.flatten = keras.layers.Flatten()
            self.hidden = keras.layers.Dense(256, activation="relu")
            self.logits = keras.layers.Dense(num_classes)

        def call(self, features, training=False):
            return self.logits(self.hidden(self.flatten(features)))

    config = TrainConfig(train_dir="/unused")
    source = catalog.load_source(config.dataset, None, config.augment)
    with tf.device("/cpu:0"):
        features, labels, weights = next(iter(source.train_stream(seed=0, start_position=0, micro_batch=64)))
        cnn = build_model(resolve_model(None, config, None, source.num_classes), source, config)
        dense = Dense(source.num_classes)
        dense(features[:1])

    def gradient(model, device: str, tf32_on: bool, deterministic: bool = False) -> list:
        values = [tf.convert_to_tensor(v) for v in model.trainable_variables]
        with run_numerics(deterministic=deterministic, tf32=tf32_on), tf.device(device):
            copies = [tf.identity(v) for v in values]
            result = tower_loss_and_gradients(model, tf.identity(features), labels, weights, weight_copies=copies)
            return [g.numpy() for g in result.gradients]

    figures = {}
    for name, model in (("cnn", cnn), ("dense", dense)):
        cpu = gradient(model, "/cpu:0", False)
        figures[name] = {"tf32_on": relative_error(gradient(model, "/gpu:0", True), cpu),
                         "tf32_off": relative_error(gradient(model, "/gpu:0", False), cpu),
                         "tf32_off_deterministic": relative_error(gradient(model, "/gpu:0", False, True), cpu)}
    return figures


if __name__ == "__main__":
    print(json.dumps({"xla": xla, "tf32": tf32}[sys.argv[1]]()))
