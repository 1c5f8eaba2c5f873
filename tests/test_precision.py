"""--precision and --jit_compile: the same update, computed in another dtype or compiled by XLA.

fp16's dynamic loss scale is part of the update, not of the micro-step: every
micro-step's loss is multiplied by the scale, the accumulated gradient is divided
by it once, an overflow anywhere skips the whole update on every tower and
replica, and the scale moves once per update.
"""
import math
import re

import keras
import numpy as np
import pytest

from helpers import make_run, weights
from test_cli_errors import run_cli
import test_traffic  # noqa: F401 (registers test_traffic_probe: Dense, BN, Dense)
import tower_train.models as models
from tower_train.step import one_device
from tower_train.devices import canonical_device
from tower_train.step.inner_step import Decision
from tower_train.step.towers import read_in_compute_dtype
from tower_train.step.update_rule import LossScale

SGD = dict(optimizer="sgd", learning_rate=0.1, ema_decay=0.0, batch_size=4)


def first_update_delta(**layout) -> tuple[list[np.ndarray], object]:
    """The change of every weight in the first update of a run, and the run."""
    run = make_run(**layout)
    before = weights(run.state.model)
    assert run.inner.run_update(run.batches()).applied
    return [after - start for after, start in zip(weights(run.state.model), before)], run


def relative_error(got: list[np.ndarray], want: list[np.ndarray]) -> float:
    """|got - want| / |want| over all weights together (global norms)."""
    difference = np.sqrt(sum(np.sum((g - w) ** 2) for g, w in zip(got, want, strict=True)))
    return float(difference / np.sqrt(sum(np.sum(w ** 2) for w in want)))


@pytest.mark.parametrize("precision, compute_dtype, tolerance", [pytest.param("bf16", "bfloat16", 0.05, marks=pytest.mark.bf16),
                                                                  ("fp16", "float16", 0.01)])
def test_low_precision_towers_apply_the_float32_update_to_float32_weights(
        precision, compute_dtype, tolerance):
    layout = dict(num_gpus=2, accum=3, **SGD)
    want, _ = first_update_delta(**layout)
    got, run = first_update_delta(precision=precision, **layout)
    assert run.state.model.compute_dtype == compute_dtype
    assert {v.dtype for v in run.state.model.trainable_variables} == {"float32"}
    # bfloat16 keeps 8 bits of mantissa, float16 11: each update is the float32 one to that precision.
    assert relative_error(got, want) < tolerance
    assert min(np.abs(delta).max() for delta in got) > 0  # every weight moved


def test_fp16_loss_scale_moves_once_per_update_not_per_micro_step(monkeypatch):
    monkeypatch.setattr(LossScale, "GROWTH_UPDATES", 2)
    run = make_run(precision="fp16", num_gpus=2, accum=3, **SGD)
    batches = run.batches()
    scale = run.state.loss_scale
    scale.value.assign(2.0 ** 8)  # low enough that this model's float16 gradients do not overflow
    assert run.inner.run_update(batches).applied
    assert (scale.value.numpy(), scale.good_updates.numpy()) == (2.0 ** 8, 1)
    assert run.inner.run_update(batches).applied
    # 2 updates of 3 micro-steps: doubled once. Counting micro-steps would have doubled it 3 times.
    assert (scale.value.numpy(), scale.good_updates.numpy()) == (2.0 ** 9, 0)


def optimizer_state(run) -> list[np.ndarray]:
    return [np.asarray(v.numpy()) for v in run.state.optimizer.variables] + [run.state.step.numpy()]


@pytest.mark.parametrize("mode", ["tower", "mirrored"])
def test_fp16_overflow_skips_the_update_everywhere_and_halves_the_scale(mode):
    layout = dict(mode=mode, num_gpus=2, accum=2, precision="fp16", **{**SGD, "optimizer": "momentum"})
    run, reference = make_run(**layout), make_run(**layout)
    stream = run.batches()
    batches = [next(stream), next(stream)]
    scale = run.state.loss_scale
    # The scaled loss stays finite in float32, but its gradient overflows float16 in the towers.
    scale.value.assign(2.0 ** 60)
    before_weights, before_state = weights(run.state.model), optimizer_state(run)

    result = run.inner.run_update(iter(batches))

    assert result.decision == Decision.OVERFLOW and np.isfinite(result.loss)
    assert scale.value.numpy() == 2.0 ** 59 and scale.good_updates.numpy() == 0
    for got, want in zip(weights(run.state.model) + optimizer_state(run), before_weights + before_state):
        np.testing.assert_array_equal(got, want)
    # Nothing of the skipped update lingers in the accumulators: at the usual scale the same
    # batches now give a fresh run's first update.
    scale.value.assign(LossScale.INITIAL)
    assert run.inner.run_update(iter(batches)).applied
    assert reference.inner.run_update(iter(batches)).applied
    for got, want in zip(weights(run.state.model), weights(reference.state.model)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


class _Normalized(keras.layers.Layer):
    """Dense, then BN: a layer class named with a leading underscore, as resnet20's `_BasicBlock`,
    for which Keras opens the name scope "__normalized", a name that a graph's root scope refuses."""

    def __init__(self, units: int, batch_norm: keras.layers.BatchNormalization, **kwargs):
        super().__init__(**kwargs)
        self.dense, self.bn = keras.layers.Dense(units), batch_norm

    def call(self, x, training=False):
        return self.bn(self.dense(x), training=training)


@models.register("test_precision_blocks")
class Blocks(models.TowerModel):
    """Flatten, `_Normalized`, Dense: BN's moving statistics inside a layer of the model's own."""

    def __init__(self, num_classes: int, **kwargs):
        super().__init__(num_classes, **kwargs)
        self.flatten = keras.layers.Flatten()
        self.block = _Normalized(6, self.batch_norm(momentum=0.5))
        self.logits = keras.layers.Dense(num_classes)

    def call(self, features, training=False):
        return self.logits(self.block(self.flatten(features), training=training))


@pytest.mark.parametrize("layout", [dict(mode="mirrored", num_gpus=2),
                                    dict(mode="tower", num_gpus=1, ps_device="gpu")],
                         ids=["mirrored", "tower-on-its-parameter-device"])
def test_jit_compile_gives_the_same_update(layout):
    layout = dict(accum=2, **layout, **SGD)
    want, _ = first_update_delta(**layout)
    got, _ = first_update_delta(jit_compile=True, **layout)
    assert relative_error(got, want) < 1e-4


class _Counted(keras.layers.Layer):
    """Counts its training calls in a non-trainable variable: a state that moves otherwise than
    BN's moving averages, which each tower must take as the tower before it left it."""

    def build(self, input_shape):
        self.training_calls = self.add_weight(shape=(), initializer="zeros", trainable=False, name="training_calls")

    def call(self, x, training=False):
        if training:
            self.training_calls.assign(self.training_calls + 1.0)
        return x


@models.register("test_precision_counted")
class Counted(models.TowerModel):
    """Flatten, `_Counted`, Dense."""

    def __init__(self, num_classes: int, **kwargs):
        super().__init__(num_classes, **kwargs)
        self.flatten = keras.layers.Flatten()
        self.counted = _Counted()
        self.logits = keras.layers.Dense(num_classes)

    def call(self, features, training=False):
        return self.logits(self.counted(self.flatten(features), training=training))


def compiled_calls(run) -> list[list]:
    """Each function of a run's traced update: its calls of XLA-compiled functions (ops)."""
    return [[op for op in function.graph.get_operations()
             if op.type in ("StatefulPartitionedCall", "PartitionedCall") and "_XlaMustCompile" in op.node_def.attr
             and op.node_def.attr["_XlaMustCompile"].b]
            for function, _ in run.inner.traced_update(test_traffic.batch_spec(4 * 4))]


def calls_before(call, calls: list) -> list[str]:
    """The names of `calls` that `call` waits for, through data or control edges."""
    seen, stack = set(), [call]
    while stack:
        op = stack.pop()
        for before in [tensor.op for tensor in op.inputs] + list(op.control_inputs):
            if before not in seen:
                seen.add(before)
                stack.append(before)
    return [other.name for other in calls if other in seen]


@pytest.mark.parametrize("layout", [
    dict(ps_device="cpu"), dict(ps_device="spread"), dict(ps_device="cpu", tower_weights="per_micro_step"),
    dict(ps_device="cpu", accum=1), dict(ps_device="cpu", model="test_precision_blocks"),
    dict(ps_device="spread", model="test_precision_blocks"), dict(ps_device="cpu", model="test_precision_counted")],
    ids=["cpu", "spread", "cpu-per-micro-step", "cpu-k1", "cpu-batchnorm-in-a-block", "spread-batchnorm-in-a-block",
         "cpu-counted"])
def test_jit_compile_in_tower_mode_compiles_every_tower_off_the_parameter_device(layout):
    """Four towers on /cpu:1..4, variables on /cpu:0 (or in slices on the towers): each tower's
    pass is compiled for its device over the values it is handed, the passes do not wait for
    each other (BN's moving statistics included: `towers.compiled_towers`), except where a pass
    moves another state (`Counted`), and three updates (momentum, the moving statistics, the
    count) equal those without XLA to float rounding."""
    layout = dict(num_gpus=4, **{"accum": 2, **layout}, **{**SGD, "optimizer": "momentum"})
    compiled = make_run(jit_compile=True, **layout)
    functions = compiled_calls(compiled)
    towers = [canonical_device(f"/cpu:{i}") for i in range(1, 5)]
    assert sorted({canonical_device(call.device) for calls in functions for call in calls}) == towers
    assert not any(compiled_calls(make_run(**layout)))
    waits = [[calls_before(call, calls) for call in calls] for calls in functions]
    if layout.get("model") == "test_precision_counted":  # each tower after the one before it
        assert all(len(before) == i for calls in waits for i, before in enumerate(calls)), waits
    else:
        assert not any(before for calls in waits for before in calls), waits
    start = weights(compiled.state.model)
    got, want = trained(compiled), trained(make_run(**layout))
    assert relative_error(got, want) < 1e-4
    assert relative_error(got[:len(start)], start) > 1e-3  # the updates moved the weights
    if layout.get("model") == "test_precision_counted":
        assert got[len(start)] == want[len(start)] == 3 * layout["accum"] * 4  # every tower's calls counted


def test_the_cli_trains_in_fp16_and_logs_the_loss_scale(tmp_path):
    result = run_cli("--precision=fp16", "--num_gpus=2", "--accum=2", "--batch_size=8", "--max_steps=2",
                     "--log_every=1", f"--train_dir={tmp_path}")
    assert result.returncode == 0, result.stderr
    scales = [float(s) for s in re.findall(r"step \d+, loss = [\d.]+, loss scale (\d+) \(", result.stderr)]
    # One progress line per update, each with the scale: 32768 halved by any overflow so far.
    assert len(scales) == 2 and all(s <= LossScale.INITIAL and math.log2(s).is_integer() for s in scales)
    assert "held-out precision @ 1" in result.stderr.strip().splitlines()[-1]


@models.register("test_precision_dense")
class DenseOnly(models.TowerModel):
    """Flatten, Dense, Dense: every weight read in the compute dtype, so that under bf16 every
    gradient a tower sends is a bfloat16 value (a Cast's gradient)."""

    def __init__(self, num_classes: int, **kwargs):
        super().__init__(num_classes, **kwargs)
        self.flatten = keras.layers.Flatten()
        self.hidden = keras.layers.Dense(6, activation="relu")
        self.logits = keras.layers.Dense(num_classes)

    def call(self, features, training=False):
        return self.logits(self.hidden(self.flatten(features)))


def trained(run, updates: int = 3) -> list[np.ndarray]:
    """The weights and BN statistics after `updates` updates, each applied."""
    if run.state.loss_scale is not None:
        run.state.loss_scale.value.assign(2.0 ** 8)  # low enough that no float16 gradient overflows
    batches = run.batches()
    for _ in range(updates):
        assert run.inner.run_update(batches).applied
    run.inner.sync_state()  # spread: the slices' values into the model's variables
    return weights(run.state.model) + [np.asarray(v) for v in run.state.model.non_trainable_variables]


@pytest.mark.parametrize("precision, accum, tower_weights", [
    pytest.param("bf16", 1, "per_update", marks=pytest.mark.bf16),
    pytest.param("bf16", 3, "per_update", marks=pytest.mark.bf16),
    pytest.param("bf16", 3, "per_micro_step", marks=pytest.mark.bf16),
    ("fp16", 3, "per_update")], ids=["bf16-direct-reads-k1", "bf16-copies", "bf16-direct-reads", "fp16-copies"])
def test_weights_sent_in_the_compute_dtype_give_bit_identical_updates(monkeypatch, precision, accum,
                                                                      tower_weights):
    layout = dict(model="test_traffic_probe", precision=precision, num_gpus=2, accum=accum,
                  tower_weights=tower_weights, **SGD)
    narrowed = make_run(**layout)
    # The Dense layers' kernels and biases travel in 16 bits; BN reads its gamma and beta in
    # float32, so they travel in float32.
    assert read_in_compute_dtype(narrowed.state.model) == [True, True, False, False, True, True]
    got = trained(narrowed)
    with monkeypatch.context() as patch:  # as before: every weight sent in float32
        patch.setattr(one_device, "read_in_compute_dtype", lambda model: [False] * 6)
        want = trained(make_run(**layout))
        # And the comparison can fail: gamma and beta sent in 16 bits are rounded, which the towers
        # would not have done.
        patch.setattr(one_device, "read_in_compute_dtype", lambda model: [True] * 6)
        rounded = trained(make_run(**layout))
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)
    assert any(not np.array_equal(r, w) for r, w in zip(rounded, want, strict=True))


@pytest.mark.bf16
def test_bf16_gradient_transfer_is_exact_at_k1_under_bf16_and_rounds_the_sums_at_k2():
    """Under --precision=bf16 a tower's gradient of a weight it reads in bfloat16 is a bfloat16
    value, so at K = 1 sending it in bfloat16 loses nothing; a sum of two is not, so at K = 2 it
    is rounded (each element by at most 2^-8 of it)."""
    def bf16_run(accum, transfer_precision):
        return make_run(model="test_precision_dense", precision="bf16", num_gpus=2, accum=accum,
                        transfer_precision=transfer_precision, **SGD)

    for got, want in zip(trained(bf16_run(1, "bf16")), trained(bf16_run(1, "fp32")), strict=True):
        np.testing.assert_array_equal(got, want)
    got, _ = first_update_delta(model="test_precision_dense", precision="bf16", num_gpus=2, accum=2,
                                transfer_precision="bf16", **SGD)
    want, _ = first_update_delta(model="test_precision_dense", precision="bf16", num_gpus=2, accum=2, **SGD)
    assert 0 < relative_error(got, want) < 2 ** -8
