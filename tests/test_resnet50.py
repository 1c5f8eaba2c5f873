"""Issue 40 item 6, what runs on the CPU: the built-in `resnet50` (Keras's ResNet-50) and
`synthetic_imagenet`, and the benchmark's keras_fit with Keras's own defaults (jit_compile
"auto", the global dtype policy of --precision). ResNet-50 is built and run forward once, at
batch 1: one update at 224x224 takes over 20 s on a 2-core CPU (docs/performance.md)."""
import dataclasses

import keras
import numpy as np
import pytest

from tower_train.benchmark.names import parse_config_name
from tower_train.benchmark.workloads import build_workload
from tower_train.config import TrainConfig
from tower_train.data import catalog, imagenet_shaped
from tower_train.devices import plan_devices
from tower_train.errors import UsageError
from tower_train.rules import AUTO
from tower_train.model_spec import build_model, resolve_model
from tower_train.models import TowerModel, model_class, register, registered_loss

KERAS_RESNET50_PARAMETERS = 25_636_712  # keras.applications.ResNet50(weights=None), 1,000 classes


@pytest.fixture(scope="module")
def imagenet():
    return catalog.load_source("synthetic_imagenet")


def test_synthetic_imagenet_is_seeded_imagenet_shaped_uint8_with_1000_classes(imagenet):
    assert (imagenet.train_size, len(imagenet.eval_labels)) == (1_024, 256)
    for images, labels in ((imagenet.train_features, imagenet.train_labels),
                           (imagenet.eval_features, imagenet.eval_labels)):
        assert images.dtype == np.uint8 and images.shape[1:] == (224, 224, 3)
        assert labels.min() >= 0 and labels.max() < 1000
    assert imagenet.num_classes == 1000
    # Drawn afresh from its seed, it is the same data set: a constant, not stored anywhere.
    imagenet_shaped._arrays.cache_clear()
    again = catalog.load_source("synthetic_imagenet")
    np.testing.assert_array_equal(again.train_features, imagenet.train_features)
    np.testing.assert_array_equal(again.eval_labels, imagenet.eval_labels)
    # Its preprocessing: each channel standardized by ImageNet's mean and standard deviation.
    pixels = imagenet.train_features[:2].astype(np.float64) / 255
    expected = (pixels - [0.485, 0.456, 0.406]) / [0.229, 0.224, 0.225]
    got = imagenet.preprocess(imagenet.train_features[:2], None, True)
    np.testing.assert_allclose(got.numpy(), expected, atol=1e-5)


def test_resnet50_is_keras_resnet50_returning_logits(imagenet):
    assert callable(model_class("resnet50")) and registered_loss("resnet50") is not None
    config = TrainConfig(train_dir="/unused", model="resnet50", dataset="synthetic_imagenet")
    # Built as a run builds it: on one example of the data set, one forward pass at batch 1.
    model = build_model(resolve_model(None, config, None, imagenet.num_classes), imagenet, config)
    assert model.count_params() == KERAS_RESNET50_PARAMETERS
    reference = keras.applications.ResNet50(weights=None)  # Keras's defaults: 224x224x3, 1,000 classes
    assert reference.count_params() == KERAS_RESNET50_PARAMETERS
    assert ([(w.path.split("/", 1)[1], w.shape) for w in model.network.weights]
            == [(w.path.split("/", 1)[1], w.shape) for w in reference.weights])
    # The same weights compute Keras's probabilities: softmax of the model's logits.
    reference.set_weights(model.network.get_weights())
    image = imagenet.preprocess(imagenet.train_features[:1], None, False)
    logits = model(image, training=False).numpy()
    assert logits.shape == (1, 1000)
    np.testing.assert_allclose(keras.ops.softmax(logits).numpy(), reference(image, training=False).numpy(),
                               rtol=1e-4, atol=1e-7)


def test_resnet50_on_the_default_cifar_shaped_data_is_one_line_naming_it():
    config = TrainConfig(train_dir="/unused", model="resnet50")  # --dataset=synthetic, 24x24x3
    source = catalog.load_source(config.dataset)
    with pytest.raises(UsageError) as excinfo:
        build_model(resolve_model(None, config, None, source.num_classes), source, config)
    message = str(excinfo.value)
    assert "\n" not in message and "--model=resnet50" in message, message
    assert "expected shape=(None, 224, 224, 3), found shape=(1, 24, 24, 3)" in message, message


@register("pooled_for_test_resnet50")
class Pooled(TowerModel):
    """The smallest network on the built-in images: the checks below are of how Keras's fit is
    compiled, and tracing cifar10_cnn under XLA would be most of their time."""

    def __init__(self, num_classes, **kwargs):
        super().__init__(num_classes, **kwargs)
        self.pool = keras.layers.GlobalAveragePooling2D()
        self.logits = keras.layers.Dense(num_classes)

    def call(self, images, training=False):
        return self.logits(self.pool(images))


TOWERS, BATCH = 2, 2
CONFIG = TrainConfig(train_dir="/unused", num_gpus=TOWERS, batch_size=BATCH, model="pooled_for_test_resnet50")
PLAN = plan_devices(TOWERS, CONFIG.ps_device, num_physical_gpus=0)


@pytest.fixture
def compiled(monkeypatch) -> list[dict]:
    """What each keras.Model.compile was called with: its jit_compile and the global dtype policy."""
    calls = []
    compile_ = keras.Model.compile

    def recorded(self, *args, **kwargs):
        calls.append({"jit_compile": kwargs.get("jit_compile"), "policy": keras.config.dtype_policy().name})
        return compile_(self, *args, **kwargs)

    monkeypatch.setattr(keras.Model, "compile", recorded)
    return calls


@pytest.mark.parametrize("given, xla", [(AUTO, False), (True, True), (False, False)])
def test_keras_fit_compiles_with_keras_defaults_unless_jit_compile_is_given(compiled, given, xla):
    # The run's config comes resolved by start-up (here off: no GPU); keras_fit takes the flag as
    # given, and Keras's own auto is off on a CPU-only machine.
    workload = build_workload(parse_config_name("keras_fit_k1", BATCH), CONFIG, PLAN, keras_jit_compile=given)
    assert compiled == [{"jit_compile": "auto" if given == AUTO else given, "policy": "float32"}]
    assert workload.jit_compile is xla
    assert workload.run(1) > 0  # an update runs, under XLA with True


def test_keras_fit_under_bf16_compiles_under_mixed_bfloat16(compiled):
    config = dataclasses.replace(CONFIG, precision="bf16")
    workload = build_workload(parse_config_name("keras_fit_k1", BATCH), config, PLAN)
    assert compiled == [{"jit_compile": "auto", "policy": "mixed_bfloat16"}]
    assert keras.config.dtype_policy().name == "float32"  # set while the model is made and compiled only
    assert workload.run(1) > 0
