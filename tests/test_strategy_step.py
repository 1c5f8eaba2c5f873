"""tower_train.step.strategy_step's `StrategyStep` built directly in this process, under a
MirroredStrategy over 2 logical CPUs (/cpu:1, /cpu:2) reducing through /cpu:0: one update of K = 2
against a plain GradientTape step on the concatenated batch, the replica-local accumulators cleared
after it, a refused update (total weight 0, or non-finite) that moves nothing on either replica,
and the functions `traced_update` lists. The end-to-end checks through `make_run` (equality with
tower mode, no all-reduce in micro-steps) are in test_modes.py and test_weighted.py."""
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

from tower_train.step.inner_step import Decision
from tower_train.step.strategy_step import StrategyStep
from tower_train.step.update_rule import LossScale, UpdateRule
from helpers import DECAY, FEATURES, LR, TinyNet, fed, micro_batches, plain_sgd_step, values

REPLICAS = ("/cpu:1", "/cpu:2")
# One strategy for the file: a step's variables are its own, and a strategy holds no state of a run.
STRATEGY = tf.distribute.MirroredStrategy(
    list(REPLICAS), cross_device_ops=tf.distribute.ReductionToOneDevice(reduce_to_device="/cpu:0"))


def make_step(accum=2, momentum=0.0, normalized=False,
              loss_scale=False, shard_size=2) -> tuple[StrategyStep, UpdateRule]:
    """A StrategyStep over STRATEGY taking `shard_size` examples per replica, and its rule: a
    built TinyNet, its optimizer and counters created in the strategy's scope."""
    with STRATEGY.scope():
        model = TinyNet(normalized=normalized)
        model(np.zeros((1, FEATURES), np.float32))
        optimizer = keras.optimizers.SGD(LR, momentum=momentum)
        optimizer.build(model.trainable_variables)
        step = tf.Variable(0, dtype=tf.int64, trainable=False)
        scale = LossScale() if loss_scale else None
    rule = UpdateRule(model, optimizer, step, loss_scale=scale)
    return StrategyStep(strategy=STRATEGY, rule=rule, accum=accum, shard_size=shard_size), rule


def replica_values(variables) -> list[list[np.ndarray]]:
    """Each variable's value on each replica (MirroredStrategy's local results)."""
    return [[tf.convert_to_tensor(v).numpy() for v in STRATEGY.experimental_local_results(
        variable.value if isinstance(variable, keras.Variable) else variable)] for variable in variables]


def assert_cleared(step: StrategyStep) -> None:
    for variable, per_replica in zip(step.variable_roles()["gradients"],
                                     replica_values(step.variable_roles()["gradients"])):
        assert len(per_replica) == len(REPLICAS)
        assert all(not np.any(v) for v in per_replica), variable.name


def everything(rule: UpdateRule) -> list[list[np.ndarray]]:
    state = [*rule.model.variables, *rule.optimizer.variables, rule.step]
    if rule.loss_scale is not None:
        state += [rule.loss_scale.value, rule.loss_scale.good_updates]
    return replica_values(state)


@pytest.mark.parametrize("copy_ahead", [False, True], ids=["shards_on_the_host", "copied_ahead"])
def test_one_update_of_two_micro_steps_is_one_plain_sgd_step_on_the_concatenated_batch(copy_ahead):
    step, rule = make_step(shard_size=3)
    batches = micro_batches((3, 3), 2)
    expected_loss, expected = plain_sgd_step(rule.model, batches)
    total_weight = sum(float(w.sum()) for _, _, w in batches)
    # A third micro-batch, which the update must leave.
    stream = fed(step, batches + batches[:1], copy_ahead)

    result = step.run_update(stream)

    next(stream)
    with pytest.raises(StopIteration):
        next(stream)
    assert result.applied and result.total_weight == pytest.approx(total_weight, rel=1e-6)
    assert result.loss == pytest.approx(expected_loss, rel=1e-5)
    for per_replica, want in zip(replica_values(rule.model.trainable_variables), expected,
                                 strict=True):
        assert len(per_replica) == len(REPLICAS)
        for got in per_replica:
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert int(rule.step.numpy()) == int(rule.optimizer.iterations.numpy()) == 1
    assert_cleared(step)


def test_accumulate_keeps_each_replicas_sums_on_the_replica():
    step, rule = make_step(shard_size=3)
    batch = micro_batches((3, 3), 1, seed=1)[0]
    step.accumulate(next(fed(step, [batch])))
    loss_sum, weight_sum = replica_values(step.variable_roles()["gradients"][-2:])
    x, y, w = batch
    with tf.device("/cpu:0"):
        losses = tf.nn.sparse_softmax_cross_entropy_with_logits(y, rule.model(x, training=True)).numpy()
    np.testing.assert_allclose(weight_sum, [w[:3].sum(), w[3:].sum()], rtol=1e-6)
    np.testing.assert_allclose(loss_sum, [(w * losses)[:3].sum(), (w * losses)[3:].sum()], rtol=1e-5)
    assert int(rule.step.numpy()) == 0


def test_an_update_of_total_weight_0_moves_nothing_on_any_replica():
    step, rule = make_step(momentum=0.9, normalized=True,
                           loss_scale=True)
    assert step.run_update(fed(step, micro_batches((2, 2), 2, seed=2))).applied
    before = everything(rule)
    momentums = [v for v in rule.optimizer.variables if "momentum" in v.name]
    assert momentums and all(np.any(m) for m in values(momentums))  # slots away from 0

    result = step.run_update(fed(step, micro_batches((2, 2), 2, seed=3, zero_weights=True)))

    assert result.decision == Decision.EMPTY
    # The loss of an empty update is the regularization alone.
    assert result.loss == pytest.approx(
        DECAY * float(np.sum(values([rule.model.hidden.kernel])[0] ** 2)) / 2, rel=1e-5)
    for got, want in zip(everything(rule), before, strict=True):
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(g, w)
    assert_cleared(step)
    assert step.run_update(fed(step, micro_batches((2, 2), 2, seed=4))).applied  # and it trains on


def test_a_non_finite_update_is_refused_and_halves_the_loss_scale():
    step, rule = make_step(loss_scale=True)
    batches = micro_batches((2, 2), 2, seed=5)
    batches[1][0][3, 1] = np.nan  # one feature of replica 1's shard of the last micro-step
    batches[1][2][3] = 1.0
    before = everything(rule)[:-2]

    result = step.run_update(fed(step, batches))

    assert result.decision == Decision.NONFINITE
    for got, want in zip(everything(rule)[:-2], before, strict=True):
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(g, w)
    assert float(rule.loss_scale.value.numpy()) == LossScale.INITIAL / 2
    assert_cleared(step)


def test_an_update_whose_loss_is_not_finite_only_through_the_regularization_is_refused():
    # As in tower mode: every sum and gradient stays finite (tanh saturates; the decay's gradient
    # is 1e18), but the L2 term of a 1e20 weight is inf, and so is the update's loss.
    step, rule = make_step()
    kernel = rule.model.hidden.kernel
    kernel.assign(tf.tensor_scatter_nd_update(tf.convert_to_tensor(kernel), [[0, 0]], [1e20]))
    before = everything(rule)

    result = step.run_update(fed(step, micro_batches((2, 2), 2, seed=6)))

    assert result.decision == Decision.NONFINITE and result.loss == np.inf
    for got, want in zip(everything(rule), before, strict=True):
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(g, w)


def function_name(concrete) -> str:
    """The Python name of the method a concrete function traces (`_finish`, ...)."""
    return re.fullmatch(r"__inference_(\w+?)_\d+", concrete.name.decode()
                        if isinstance(concrete.name, bytes) else concrete.name).group(1)


@pytest.mark.parametrize("accum, expected", [
    (1, [("_finish", 1), ("_apply", 1)]),
    (3, [("_accumulate", 2), ("_finish", 1), ("_apply", 1)]),
])
def test_traced_update_lists_each_function_of_an_applied_update_with_its_calls(accum, expected):
    step, _ = make_step(accum=accum)
    spec = (tf.TensorSpec([4, FEATURES], tf.float32), tf.TensorSpec([4], tf.int32),
            tf.TensorSpec([4], tf.float32))
    assert [(function_name(f), calls) for f, calls in step.traced_update(spec)] == expected
