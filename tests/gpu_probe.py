"""Checks that need a GPU visible to the process, run by tests/test_gpu.py as a child process (the
test process itself hides its GPUs: tests/conftest.py). Prints one JSON line.

    python tests/gpu_probe.py xla    # tower mode with --jit_compile against without, on 2 logical GPUs
    python tests/gpu_probe.py tf32   # the first gradient on /gpu:0 against /cpu:0, TF32 on and off
    python tests/gpu_probe.py cpu_float32  # needs no GPU: the same gradient from two CPU float32
                                           # implementations (oneDNN's and Eigen's convolutions),
                                           # and after one-ulp changes of the weights
    python tests/gpu_probe.py save_cpu_gradients OUT.npz  # cpu_float32's child: the gradients
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
    from tower_train.startup import prepare_devices
    from tower_train.config import TrainConfig
    from tower_train.model_spec import resolve_model
    from tower_train.step.modes import build_mode
    from tower_train.numerics import run_numerics
    from tower_train.training.run import Run

    base = TrainConfig(train_dir="/unused", num_gpus=2, gpu_memory_mb=4000, accum=2, batch_size=32,
                       optimizer="momentum", learning_rate=0.05)
    base, plan = prepare_devices(base)
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


def probe_batch_and_models():
    """One batch of 64 of the default data set, and cifar10_cnn and a dense network built on the
    host from seed 0."""
    import keras
    import tensorflow as tf

    from tower_train.data import catalog
    from tower_train.config import TrainConfig
    from tower_train.model_spec import build_model, resolve_model
    from tower_train.models import TowerModel

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
    keras.utils.set_random_seed(0)  # the same weights in every process
    with tf.device("/cpu:0"):
        features, labels, weights = next(iter(source.train_stream(seed=0, start_position=0, micro_batch=64)))
        cnn = build_model(resolve_model(None, config, None, source.num_classes), source, config)
        dense = Dense(source.num_classes)
        dense(features[:1])
    return (features, labels, weights), {"cnn": cnn, "dense": dense}


def gradient(model, batch, device: str, tf32_on: bool = False, deterministic: bool = False,
             values=None) -> list:
    """The first gradient of `model` on `batch` on `device`, from `values` (default: its weights)."""
    import tensorflow as tf

    from tower_train.numerics import run_numerics
    from tower_train.step.towers import tower_loss_and_gradients

    features, labels, weights = batch
    values = [tf.convert_to_tensor(v) for v in (values or model.trainable_variables)]
    with run_numerics(deterministic=deterministic, tf32=tf32_on), tf.device(device):
        copies = [tf.identity(v) for v in values]
        result = tower_loss_and_gradients(model, tf.identity(features), labels, weights, weight_copies=copies)
        return [g.numpy() for g in result.gradients]


def tf32() -> dict:
    """The gradient of one batch of 64 on /gpu:0 against the same on /cpu:0, from the same weights,
    with TF32 on and off (and off under op determinism, whose cuDNN algorithms differ): for
    cifar10_cnn (convolutions, LRN, matmuls) and for a dense network (matmuls alone)."""
    batch, models = probe_batch_and_models()
    figures = {}
    for name, model in models.items():
        cpu = gradient(model, batch, "/cpu:0")
        figures[name] = {"tf32_on": relative_error(gradient(model, batch, "/gpu:0", True), cpu),
                         "tf32_off": relative_error(gradient(model, batch, "/gpu:0", False), cpu),
                         "tf32_off_deterministic": relative_error(gradient(model, batch, "/gpu:0", False, True), cpu)}
    return figures


def cpu_float32() -> dict:
    """How far float32 arithmetic alone moves the gradients `tf32` compares, on the CPU: between two
    processes, one with oneDNN's kernels (TensorFlow's default) and one with Eigen's
    (TF_ENABLE_ONEDNN_OPTS=0); and in this process, after every nonzero weight moved by one unit
    of its last place (relative 2^-24, random signs)."""
    import os
    import subprocess
    import tempfile

    import numpy as np

    batch, models = probe_batch_and_models()
    figures = {name: {} for name in models}
    with tempfile.TemporaryDirectory() as scratch:
        saved = {}
        for kernels, onednn in (("onednn", "1"), ("eigen", "0")):
            saved[kernels] = os.path.join(scratch, f"{kernels}.npz")
            subprocess.run([sys.executable, __file__, "save_cpu_gradients", saved[kernels]], check=True, timeout=300,
                           env={**os.environ, "TF_ENABLE_ONEDNN_OPTS": onednn}, stdout=subprocess.DEVNULL)
        onednn, eigen = (np.load(saved[k]) for k in ("onednn", "eigen"))
        for name, model in models.items():
            keys = [f"{name}_{i}" for i in range(len(model.trainable_variables))]
            figures[name]["onednn_against_eigen"] = relative_error([onednn[k] for k in keys],
                                                                   [eigen[k] for k in keys])
    rng = np.random.default_rng(1)
    for name, model in models.items():
        values = [np.asarray(v) for v in model.trainable_variables]
        moved = [(v * (1 + rng.choice([-1.0, 1.0], v.shape) * 2.0 ** -24)).astype(np.float32) for v in values]
        figures[name]["one_ulp_of_the_weights"] = relative_error(
            gradient(model, batch, "/cpu:0", values=moved), gradient(model, batch, "/cpu:0"))
    return figures


def save_cpu_gradients() -> dict:
    """`cpu_float32`'s child: saves both models' gradients on the CPU to sys.argv[2]."""
    import numpy as np

    batch, models = probe_batch_and_models()
    np.savez(sys.argv[2], **{f"{name}_{i}": g for name, model in models.items()
                             for i, g in enumerate(gradient(model, batch, "/cpu:0"))})
    return {"saved": sys.argv[2]}


if __name__ == "__main__":
    print(json.dumps({"xla": xla, "tf32": tf32, "cpu_float32": cpu_float32,
                      "save_cpu_gradients": save_cpu_gradients}[sys.argv[1]]()))
