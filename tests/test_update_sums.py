"""`update_sums.py` in the test process: a tower's sums over an update's micro-steps, with and
without a model's losses of the batch, against the tower passes' values added up in numpy."""
import keras
import numpy as np
import pytest
import tensorflow as tf

from tower_train.models import TowerModel
from tower_train.step.towers import TowerResult
from tower_train.step.update_sums import UpdateSums


class Net(TowerModel):
    def __init__(self, num_classes: int = 3, **kwargs):
        super().__init__(num_classes, **kwargs)
        self.dense = keras.layers.Dense(num_classes)

    def call(self, features, training=False):
        return self.dense(features)


def built_net(adds_batch_losses):
    net = Net()
    net(tf.zeros([1, 2]))
    net.adds_batch_losses = adds_batch_losses
    return net


def tower_pass(seed, with_batch_losses):
    rng = np.random.default_rng(seed)
    gradients = [tf.constant(rng.normal(size=shape), tf.float32) for shape in ((2, 3), (3,))]
    batch_gradients = [g * 0.5 for g in gradients] if with_batch_losses else None
    return TowerResult(tf.constant(rng.uniform()), tf.constant(rng.uniform()), gradients,
                       tf.constant(rng.uniform()), batch_gradients)


def numpy_values(values):
    return [np.asarray(v) for v in values]


@pytest.mark.parametrize("with_batch_losses", [False, True])
def test_sums_add_micro_steps_read_one_more_and_clear(with_batch_losses):
    sums = UpdateSums(built_net(with_batch_losses), prefix="tower_0_")
    passes = [tower_pass(seed, with_batch_losses) for seed in range(3)]
    for result in passes[:2]:
        sums.add(result)
    total = sums.plus(passes[2])
    for got, *parts in zip(total.gradients, *(p.gradients for p in passes)):
        np.testing.assert_allclose(got, np.sum(numpy_values(parts), axis=0), rtol=1e-6)
    assert float(total.loss_sum) == pytest.approx(sum(float(p.loss_sum) for p in passes), rel=1e-6)
    assert float(total.weight_sum) == pytest.approx(sum(float(p.weight_sum) for p in passes), rel=1e-6)
    if with_batch_losses:
        assert float(total.batch_loss) == pytest.approx(sum(float(p.batch_loss) for p in passes), rel=1e-6)
        for got, *parts in zip(total.batch_gradients, *(p.batch_gradients for p in passes)):
            np.testing.assert_allclose(got, np.sum(numpy_values(parts), axis=0), rtol=1e-6)
        assert len(sums.gradient_variables) == 4 and len(sums.scalar_variables) == 3
    else:
        # Without losses of the batch, none is kept: the last pass's (0) passes through as it is.
        assert total.batch_gradients is None and float(total.batch_loss) == float(passes[2].batch_loss)
        assert len(sums.gradient_variables) == 2 and len(sums.scalar_variables) == 2
    # plus() leaves the sums as the first two passes made them.
    np.testing.assert_allclose(sums.loss.numpy(), sum(float(p.loss_sum) for p in passes[:2]), rtol=1e-6)
    assert all(v.name.startswith("tower_0_") for v in sums.gradient_variables + sums.scalar_variables)
    sums.clear()
    assert all(not np.any(v.numpy()) for v in sums.gradient_variables + sums.scalar_variables)
