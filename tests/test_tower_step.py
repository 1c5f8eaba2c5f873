"""tower_train.step.tower_step's `TowerStep` built directly in this process, on a tiny model with 2
towers on logical CPUs (/cpu:1, /cpu:2) and its variables on /cpu:0: one update of K = 2 against a
plain GradientTape step on the concatenated batch, what `accumulate` adds and `update` clears, a
refused update (total weight 0, or non-finite) that moves nothing, and the functions
`traced_update` lists. The end-to-end checks through `make_run` are in test_towers.py,
test_weighted.py and test_traffic.py."""
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

from tower_train.devices import canonical_device
from tower_train.step.inner_step import Decision
from tower_train.step.one_device import OneDevice
from tower_train.step.tower_step import TowerStep
from tower_train.step.update_rule import LossScale, UpdateRule
from helpers import DECAY, FEATURES, LR, TinyNet, fed, micro_batches, plain_sgd_step, values

PARAM_DEVICE = "/cpu:0"  # where helpers.plain_sgd_step computes
TOWERS = ("/cpu:1", "/cpu:2")


def make_rule(optimizer=None, normalized=False, loss_scale=False) -> UpdateRule:
    """A built TinyNet, its optimizer and counters on the parameter device, as a mode's variable
    scope creates them."""
    with tf.device(PARAM_DEVICE):
        model = TinyNet(normalized=normalized)
        model(np.zeros((1, FEATURES), np.float32))
        optimizer = optimizer or keras.optimizers.SGD(LR)
        optimizer.build(model.trainable_variables)
        step = tf.Variable(0, dtype=tf.int64, trainable=False)
        scale = LossScale() if loss_scale else None
    return UpdateRule(model, optimizer, step, loss_scale=scale)


def shard_sums(model, batch, shard_sizes):
    """Per shard: sum(w * loss), sum(w) and the gradient of sum(w * loss) / (labels in the shard),
    computed on one device."""
    sums, start = [], 0
    for size in shard_sizes:
        x, y, w = (tf.constant(part[start:start + size]) for part in batch)
        start += size
        with tf.device(PARAM_DEVICE), tf.GradientTape() as tape:
            loss_sum = tf.reduce_sum(
                w * tf.nn.sparse_softmax_cross_entropy_with_logits(y, model(x, training=True)))
            objective = loss_sum / size
        grads = tape.gradient(objective, model.trainable_variables)
        sums.append((float(loss_sum), float(tf.reduce_sum(w)), [g.numpy() for g in grads]))
    return sums


def accumulators(step: TowerStep) -> list[np.ndarray]:
    return values(step.variable_roles()["gradients"])



@pytest.mark.parametrize("copy_ahead, towers", [(False, TOWERS), (True, TOWERS), (False, (PARAM_DEVICE,))],
                         ids=["shards_on_the_host", "copied_ahead", "whole_update_under_xla"])
def test_after_the_first_update_the_k_micro_steps_run_in_one_call_reading_the_feed(copy_ahead, towers):
    """K = 3 on 2 towers, or on one tower on the parameter device under XLA (which compiles the
    whole update): the second update, given the feed's iterator `at_once`, reads its
    micro-batches inside one call and is the plain step on its concatenated batch, as the first,
    made micro-step by micro-step, is."""
    rule = make_rule()
    sizes = (3, 2)[:len(towers)]
    step = TowerStep(rule=rule, tower_devices=towers, placement=OneDevice(PARAM_DEVICE),
                     accum=3, shard_sizes=sizes, jit_compile=len(towers) == 1)
    first, second = micro_batches(sizes, 3, seed=1), micro_batches(sizes, 3, seed=2)
    iterator = fed(step, first + second, copy_ahead)
    for batches in (first, second):
        expected_loss, expected = plain_sgd_step(rule.model, batches)
        result = step.run_update(iterator, at_once=iterator)
        assert result.applied and result.loss == pytest.approx(expected_loss, rel=1e-5)
        for got, want in zip(values(rule.model.trainable_variables), expected, strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert int(rule.step.numpy()) == 2
    # The second update was one call, which read the feed: the micro-step functions ran once.
    assert len(step._micro_steps._list_all_concrete_functions()) == 1

@pytest.mark.parametrize("copy_ahead", [False, True], ids=["shards_on_the_host", "copied_ahead"])
@pytest.mark.parametrize("tower_weights", ["per_update", "per_micro_step"])
@pytest.mark.parametrize("shard_sizes", [(3, 3), (4, 1)], ids=["even", "uneven"])
def test_one_update_of_two_micro_steps_is_one_plain_sgd_step_on_the_concatenated_batch(
        shard_sizes, tower_weights, copy_ahead):
    rule = make_rule()
    step = TowerStep(rule=rule, tower_devices=TOWERS, placement=OneDevice(PARAM_DEVICE),
                     accum=2, shard_sizes=shard_sizes, tower_weights=tower_weights)
    assert step.copies_weights == (tower_weights == "per_update")
    batches = micro_batches(shard_sizes, 2)
    expected_loss, expected = plain_sgd_step(rule.model, batches)
    total_weight = sum(float(w.sum()) for _, _, w in batches)

    result = step.run_update(fed(step, batches, copy_ahead))

    assert result.applied and result.total_weight == pytest.approx(total_weight, rel=1e-6)
    assert result.loss == pytest.approx(expected_loss, rel=1e-5)
    for got, want in zip(values(rule.model.trainable_variables), expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert int(rule.step.numpy()) == int(rule.optimizer.iterations.numpy()) == 1
    # Shards on the host or already on the towers, a list or a tuple: one trace of each function.
    assert len(step.accumulate._list_all_concrete_functions()) == len(step.update._list_all_concrete_functions()) == 1


def test_accumulate_adds_each_towers_sums_on_its_device_and_update_clears_them():
    shard_sizes = (3, 2)
    rule = make_rule()
    step = TowerStep(rule=rule, tower_devices=TOWERS, placement=OneDevice(PARAM_DEVICE),
                     accum=2, shard_sizes=shard_sizes)
    first, last = micro_batches(shard_sizes, 2, seed=1)
    roles = step.variable_roles()
    num_variables = len(rule.model.trainable_variables)
    # Per tower: a gradient sum per trainable variable, then the loss and weight sums.
    assert len(roles["gradients"]) == len(TOWERS) * (num_variables + 2)
    grad_sums = [roles["gradients"][i * num_variables:(i + 1) * num_variables] for i in range(2)]
    loss_sums = roles["gradients"][2 * num_variables:2 * num_variables + 2]
    weight_sums = roles["gradients"][2 * num_variables + 2:]
    for device, grads, loss, weight in zip(TOWERS, grad_sums, loss_sums, weight_sums, strict=True):
        assert {canonical_device(v.device) for v in [*grads, loss, weight]} == {canonical_device(device)}

    step.refresh_weights()
    step.accumulate(next(fed(step, [first])))
    for i, (loss_sum, weight_sum, grads) in enumerate(shard_sums(rule.model, first, shard_sizes)):
        assert float(loss_sums[i].numpy()) == pytest.approx(loss_sum, rel=1e-6)
        assert float(weight_sums[i].numpy()) == pytest.approx(weight_sum, rel=1e-6)
        for got, want in zip(values(grad_sums[i]), grads, strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)

    assert Decision(int(step.update(next(fed(step, [last])))[2])) == Decision.APPLIED
    assert all(not np.any(a) for a in accumulators(step))


def test_an_update_of_total_weight_0_moves_no_weight_slot_counter_or_statistic():
    shard_sizes = (2, 2)
    rule = make_rule(optimizer=keras.optimizers.SGD(LR, momentum=0.9), normalized=True,
                     loss_scale=True)
    step = TowerStep(rule=rule, tower_devices=TOWERS, placement=OneDevice(PARAM_DEVICE),
                     accum=2, shard_sizes=shard_sizes)
    assert step.run_update(fed(step, micro_batches(shard_sizes, 2, seed=2))).applied
    everything = lambda: values([*rule.model.variables, *rule.optimizer.variables, rule.step,
                                 rule.loss_scale.value, rule.loss_scale.good_updates])
    before = everything()
    momentums = [v for v in rule.optimizer.variables if "momentum" in v.name]
    assert momentums and all(np.any(m) for m in values(momentums))  # slots away from 0
    statistics = values(rule.model.norm.non_trainable_weights)

    result = step.run_update(fed(step, micro_batches(shard_sizes, 2, seed=3, zero_weights=True)))

    assert result.decision == Decision.EMPTY
    # The loss of an empty update is the regularization alone.
    assert result.loss == pytest.approx(
        DECAY * float(np.sum(values([rule.model.hidden.kernel])[0] ** 2)) / 2, rel=1e-5)
    for got, want in zip(everything(), before, strict=True):
        np.testing.assert_array_equal(got, want)
    for got, want in zip(values(rule.model.norm.non_trainable_weights), statistics, strict=True):
        np.testing.assert_array_equal(got, want)  # moved by the towers' passes, then put back
    assert all(not np.any(a) for a in accumulators(step))
    assert step.run_update(fed(step, micro_batches(shard_sizes, 2, seed=4))).applied  # and it trains on


def test_a_non_finite_update_is_refused_and_halves_the_loss_scale():
    shard_sizes = (2, 2)
    rule = make_rule(loss_scale=True)
    step = TowerStep(rule=rule, tower_devices=TOWERS, placement=OneDevice(PARAM_DEVICE),
                     accum=2, shard_sizes=shard_sizes)
    batches = micro_batches(shard_sizes, 2, seed=5)
    batches[0][0][3, 1] = np.nan  # one feature of tower 1's first shard
    batches[0][2][3] = 1.0
    before = values([*rule.model.variables, *rule.optimizer.variables, rule.step])

    result = step.run_update(fed(step, batches))

    assert result.decision == Decision.NONFINITE
    for got, want in zip(values([*rule.model.variables, *rule.optimizer.variables, rule.step]),
                         before, strict=True):
        np.testing.assert_array_equal(got, want)
    assert float(rule.loss_scale.value.numpy()) == LossScale.INITIAL / 2
    assert all(not np.any(a) for a in accumulators(step))


def test_an_update_whose_loss_is_not_finite_only_through_the_regularization_is_refused():
    # Every sum and gradient stays finite (tanh saturates; the decay's gradient is 1e18), but the
    # L2 term of a 1e20 weight is inf, and so is the update's loss.
    rule = make_rule()
    step = TowerStep(rule=rule, tower_devices=TOWERS, placement=OneDevice(PARAM_DEVICE),
                     accum=2, shard_sizes=(2, 2))
    kernel = rule.model.hidden.kernel
    kernel.assign(tf.tensor_scatter_nd_update(tf.convert_to_tensor(kernel), [[0, 0]], [1e20]))
    before = values([*rule.model.variables, *rule.optimizer.variables, rule.step])

    result = step.run_update(fed(step, micro_batches((2, 2), 2, seed=6)))

    assert result.decision == Decision.NONFINITE and result.loss == np.inf
    for got, want in zip(values([*rule.model.variables, *rule.optimizer.variables, rule.step]),
                         before, strict=True):
        np.testing.assert_array_equal(got, want)


def function_name(concrete) -> str:
    """The Python name of the method a concrete function traces (`_update`, ...)."""
    return re.fullmatch(r"__inference_(\w+?)_\d+", concrete.name.decode()
                        if isinstance(concrete.name, bytes) else concrete.name).group(1)


@pytest.mark.parametrize("accum, tower_weights, expected", [
    (1, "per_update", [("_update", 1)]),
    (1, "per_micro_step", [("_update", 1)]),
    (3, "per_update", [("_refresh_weights", 1), ("_accumulate", 2), ("_update", 1)]),
    (3, "per_micro_step", [("_accumulate", 2), ("_update", 1)]),
])
def test_traced_update_lists_each_function_of_an_update_with_its_calls(accum, tower_weights, expected):
    rule = make_rule()
    # Tower 0 shares the parameter device, so only tower 1 ever keeps a copy of the weights.
    step = TowerStep(rule=rule, tower_devices=(PARAM_DEVICE, TOWERS[0]), placement=OneDevice(PARAM_DEVICE),
                     accum=accum, shard_sizes=(2, 2), tower_weights=tower_weights)
    spec = (tf.TensorSpec([4, FEATURES], tf.float32), tf.TensorSpec([4], tf.int32),
            tf.TensorSpec([4], tf.float32))
    runs = step.traced_update(spec)
    assert [(function_name(f), calls) for f, calls in runs] == expected
    copies = len(step.variable_roles()["weights"]) - len(rule.model.trainable_variables)
    assert copies == (len(rule.model.trainable_variables) if expected[0][0] == "_refresh_weights" else 0)
    # No accumulators at K = 1: a lone micro-step goes straight to the update.
    assert (len(step.variable_roles()["gradients"]) == 0) == (accum == 1)


def test_bf16_transfer_rounds_each_remote_towers_gradient_sum_once_and_nothing_else():
    """Tower 0 shares the parameter device and sends nothing; tower 1's gradient sum over the
    update crosses devices in bfloat16: the update is the one computed here from tower 1's sum
    rounded to bfloat16, not from the float32 sums."""
    shard_sizes = (3, 2)
    rule = make_rule()
    step = TowerStep(rule=rule, tower_devices=(PARAM_DEVICE, TOWERS[0]), placement=OneDevice(PARAM_DEVICE),
                     accum=2, shard_sizes=shard_sizes, transfer_dtype="bfloat16")
    batches = micro_batches(shard_sizes, 2, seed=6)
    per_batch = [shard_sums(rule.model, batch, shard_sizes) for batch in batches]
    sums = [[sum(grads) for grads in zip(*(shards[i][2] for shards in per_batch))]
            for i in range(len(shard_sizes))]
    rounded = [sums[0], [tf.cast(tf.cast(g, tf.bfloat16), tf.float32).numpy() for g in sums[1]]]
    total_weight = sum(float(w.sum()) for _, _, w in batches)
    before = values(rule.model.trainable_variables)

    def sgd(tower_sums):
        mean = [sum(s[v] * size / total_weight for s, size in zip(tower_sums, shard_sizes))
                for v in range(len(before))]
        mean[0] = mean[0] + DECAY * before[0]  # the hidden kernel's weight decay
        return [w - LR * g for w, g in zip(before, mean, strict=True)]

    assert step.run_update(fed(step, batches)).applied

    got = values(rule.model.trainable_variables)
    for g, w in zip(got, sgd(rounded), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7)
    exact = sgd(sums)
    delta = lambda weights: np.concatenate([(w - b).ravel() for w, b in zip(weights, before)])
    # bfloat16 keeps 8 significant bits: each element of tower 1's sum moves by at most 2^-8 of it.
    error = np.linalg.norm(delta(got) - delta(exact)) / np.linalg.norm(delta(exact))
    assert 1e-5 < error < 2 ** -8


@pytest.mark.parametrize("where", ["on_its_device", "one_elsewhere"])
def test_under_xla_one_tower_holding_every_variable_compiles_the_whole_update(where, caplog):
    """One tower on the parameter device (/cpu:0), K = 2: XLA compiles accumulate and update
    whole, the apply included, and the update is the plain step's; with a variable the update
    reads elsewhere (here its step counter) it compiles the passes only and says so in one line."""
    rule = make_rule()
    if where == "one_elsewhere":
        with tf.device(TOWERS[0]):
            counter = tf.Variable(0, dtype=tf.int64, trainable=False)
        rule = UpdateRule(rule.model, rule.optimizer, counter)
    step = TowerStep(rule=rule, tower_devices=(PARAM_DEVICE,), placement=OneDevice(PARAM_DEVICE),
                     accum=2, shard_sizes=(4,), jit_compile=True)
    batches = micro_batches((4,), 2)
    expected_loss, expected = plain_sgd_step(rule.model, batches)

    result = step.run_update(fed(step, batches, False))

    assert result.applied and result.loss == pytest.approx(expected_loss, rel=1e-5)
    for got, want in zip(values(rule.model.trainable_variables), expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    whole = step._steps[1] is not step.update.get_concrete_function(tuple(next(fed(step, batches[:1], False))))
    said = [r.getMessage() for r in caplog.records if "XLA compiles the towers' passes only" in r.getMessage()]
    assert (whole, len(said)) == ((True, 0) if where == "on_its_device" else (False, 1))
