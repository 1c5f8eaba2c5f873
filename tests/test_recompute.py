"""--recompute: gradient checkpointing over the models' blocks changes memory, never the numbers.

tf.recompute_grad calls a block twice, so without care a BatchNormalization
layer would move its moving statistics twice per call; TowerModel.run_block
drops the second call's updates. These tests compare a model with
`recompute=True` against the same weights without it: the gradients, the
moving statistics and a few updates of tower mode.
"""
import keras
import numpy as np
import pytest
import tensorflow as tf

import tower_train.models as models
from tower_train.errors import UsageError
from tower_train.model_spec import check_training_pass
from tower_train.step.towers import tower_loss_and_gradients
from helpers import make_run, weights
from test_cli_errors import run_cli


def built(name: str, recompute: bool) -> models.TowerModel:
    keras.utils.set_random_seed(0)
    model = models.model_class(name)(num_classes=10, recompute=recompute)
    model(tf.zeros([1, 24, 24, 3]))
    return model


def values(variables) -> list[np.ndarray]:
    return [np.asarray(tf.convert_to_tensor(v)) for v in variables]


@pytest.mark.parametrize("name", ["cifar10_cnn", "resnet20"])
def test_gradients_and_moving_statistics_are_those_without_recompute(name):
    rng = np.random.default_rng(0)
    images = tf.constant(rng.normal(size=(4, 24, 24, 3)), tf.float32)
    labels = tf.constant(rng.integers(0, 10, size=4), tf.int32)
    results, convolutions = {}, {}
    for recompute in (False, True):
        model = built(name, recompute)

        @tf.function
        def tower(model=model):
            with tf.name_scope("tower_0"):  # as run_on_towers: Keras needs a scope in a graph
                return tower_loss_and_gradients(model, images, labels, tf.ones([4]))

        graph = tower.get_concrete_function().graph
        convolutions[recompute] = sum(op.type == "Conv2D" for op in graph.get_operations())
        result = tower()
        results[recompute] = (float(result.loss_sum), values(result.gradients),
                              values(model.non_trainable_variables))
    # The blocks really are computed twice: every convolution is in one block.
    assert convolutions[True] == 2 * convolutions[False]
    (loss, grads, stats), (loss_rc, grads_rc, stats_rc) = results[False], results[True]
    assert loss_rc == loss
    assert all(np.abs(g).max() > 0 for g in grads_rc)  # recompute_grad reaches every Keras variable
    for got, want in zip(grads_rc, grads, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    # One EMA step per BN call, not two (without run_block's StatelessScope they differ by 0.5).
    assert len(stats_rc) == (38 if name == "resnet20" else 0)
    for got, want in zip(stats_rc, stats, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


@models.register("test_recompute_bn")
class SmallBlocks(models.TowerModel):
    """Two conv-BN-ReLU blocks, pooling, logits: resnet20's kind of block, quick to trace."""

    def __init__(self, num_classes: int, **kwargs):
        super().__init__(num_classes, **kwargs)
        self.convs = [keras.layers.Conv2D(8, 3, padding="same", use_bias=False) for _ in range(2)]
        self.bns = [self.batch_norm(momentum=0.5) for _ in range(2)]
        self.pool = keras.layers.GlobalAveragePooling2D()
        self.logits = keras.layers.Dense(num_classes)

    def call(self, images: tf.Tensor, training: bool = False) -> tf.Tensor:
        x = self.run_block(self._block0, images, training)
        return self.logits(self.pool(self.run_block(self._block1, x, training)))

    def _block0(self, x: tf.Tensor, training: bool = False) -> tf.Tensor:
        return tf.nn.relu(self.bns[0](self.convs[0](x), training=training))

    def _block1(self, x: tf.Tensor, training: bool = False) -> tf.Tensor:
        return tf.nn.relu(self.bns[1](self.convs[1](x), training=training))


def test_resnet20_with_recompute_passes_the_start_up_trace_of_its_training_pass():
    """The trace every run makes before it trains; it once took the gradient, where --recompute
    calls the blocks again, outside a name scope, and Keras's "__basic_block" was refused there."""
    model = built("resnet20", recompute=True)
    check_training_pass("--model=resnet20", model, tf.zeros([1, 24, 24, 3]), tf.zeros([1], tf.int32))


# resnet20's gradients and statistics are checked above; tracing its tower-mode steps takes 30 s.
@pytest.mark.parametrize("name", ["cifar10_cnn", "test_recompute_bn"])
def test_tower_mode_trains_the_same_weights_with_recompute(name):
    """2 towers, K = 2, 2 updates: the weights and moving statistics match those without."""
    trained = {}
    for recompute in (False, True):
        run = make_run(model=name, num_gpus=2, accum=2, batch_size=4, optimizer="sgd",
                       learning_rate=0.1, ema_decay=0.0, recompute=recompute)
        batches = run.batches()
        for _ in range(2):
            assert run.inner.run_update(batches).applied
        trained[recompute] = weights(run.state.model), values(run.state.model.non_trainable_variables)
    start = weights(built(name, False))
    assert max(np.abs(a - b).max() for a, b in zip(trained[False][0], start)) > 1e-3  # it did train
    for got, want in zip(trained[True][0] + trained[True][1], trained[False][0] + trained[False][1],
                         strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@models.register("test_no_blocks")
class NoBlocks(models.TowerModel):
    """Takes recompute=, but runs no block through run_block: --recompute could do nothing."""

    def __init__(self, num_classes: int, **kwargs):
        super().__init__(num_classes, **kwargs)
        self.flatten = keras.layers.Flatten()
        self.logits = keras.layers.Dense(num_classes)

    def call(self, images: tf.Tensor, training: bool = False) -> tf.Tensor:
        return self.logits(self.flatten(images))


def test_recompute_refuses_models_that_cannot_take_it():
    with pytest.raises(UsageError, match=r"^--recompute: --model=test_no_blocks runs no block "
                                         r"through self.run_block") as error:
        make_run(model="test_no_blocks", recompute=True)
    assert "\n" not in str(error.value)
    make_run(model="test_no_blocks")  # without the flag it trains


MODULE = '''
import keras
import tower_train.models as models


@models.register("old_style")
class OldStyle(models.TowerModel):
    def __init__(self, num_classes):
        super().__init__(num_classes)
        self.flatten = keras.layers.Flatten()
        self.logits = keras.layers.Dense(num_classes)

    def call(self, images, training=False):
        return self.logits(self.flatten(images))
'''


def test_the_flag_reaches_the_model_and_an_old_signature_is_one_line(tmp_path):
    (tmp_path / "old_models.py").write_text(MODULE)
    result = run_cli("--model_module=old_models", "--model=old_style", "--recompute",
                     f"--train_dir={tmp_path / 'run'}", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("tower_train: error: --recompute: --model=old_style does not accept "
                               "recompute")
    assert not (tmp_path / "run").exists()
