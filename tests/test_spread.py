"""--ps_device=spread (tower_train/step/spread.py: slice_rows, SpreadState, SpreadLayout's reduction on
the owners): where the slices go, that an update is the one --ps_device=cpu applies, that refused
updates move nothing, that checkpoints are the same whatever the placement, and what crosses
devices."""
import collections
import math

import keras
import numpy as np
import pytest
import tensorflow as tf

import tower_train
from tower_train.devices import canonical_device
from tower_train.step.inner_step import Decision
from tower_train.step.spread import Slice, SpreadPlacement, SpreadState, slice_rows
from tower_train.traffic import count_traffic
from helpers import fed, host_batches, make_run, weights
import test_recompute  # noqa: F401 (registers test_recompute_bn: two conv-BN-ReLU blocks)
from test_train import checkpoint_values
from test_traffic import batch_spec, size_in_bytes


def held_bytes(slices, variable_rows, owners):
    held = [0] * owners
    for s in slices:
        held[s.owner] += (s.stop - s.start) * variable_rows[s.variable][1]
    return held


@pytest.mark.parametrize("variable_rows, owners", [
    ([(10, 4), (100, 8), (1, 4)], 3),
    ([(7, 12)], 4),  # one variable of few rows
    ([(1, 4)] * 9, 4),  # scalars: each one row
    ([(3, 4), (2, 4)], 8),  # more devices than rows: some hold nothing
    ([(1000, 4), (5, 4000), (64, 4), (64, 4)], 1),
    ([(3, 4), (5, 0), (0, 4)], 2),  # variables of no bytes: one slice each, on the first device
])
def test_slices_cover_every_row_once_in_order_and_balance_the_bytes(variable_rows, owners):
    slices = slice_rows(variable_rows, owners)
    for j, (rows, _) in enumerate(variable_rows):
        own = [s for s in slices if s.variable == j]
        assert [s.start for s in own] == [0] + [s.stop for s in own[:-1]] and own[-1].stop == rows
        assert [s.owner for s in own] == sorted(s.owner for s in own)  # contiguous shares
    total = sum(rows * size for rows, size in variable_rows)
    widest_row = max(size for _, size in variable_rows)
    assert all(s.owner == 0 for s in slices if variable_rows[s.variable][0] * variable_rows[s.variable][1] == 0)
    assert max(held_bytes(slices, variable_rows, owners)) <= total / owners + widest_row
    assert sum(held_bytes(slices, variable_rows, owners)) == total


RANDOM_ROWS = [(int(r), int(b)) for r, b in zip(np.random.default_rng(7).integers(0, 40, 20),
                                                  np.random.default_rng(8).integers(0, 3, 20) * 4)]


@pytest.mark.parametrize("variable_rows, owners", [
    ([(10, 4), (100, 8), (1, 4)], 3),
    ([(3, 4), (2, 4)], 8),
    ([(3, 4), (5, 0), (0, 4)], 2),
    (RANDOM_ROWS, 5),  # ties of size, rows of no bytes, variables of no rows
])
def test_each_row_goes_once_to_the_device_its_first_byte_falls_in(variable_rows, owners):
    """An independent count, row by row: the variables laid end to end, largest first (ties in
    their order), each row belongs to the device d whose share [d T / N, (d + 1) T / N) of the
    line holds its first byte; a variable of no bytes wholly to device 0."""
    total = sum(rows * size for rows, size in variable_rows)
    want, offset = {}, 0
    for j in sorted(range(len(variable_rows)), key=lambda j: -variable_rows[j][0] * variable_rows[j][1]):
        rows, size = variable_rows[j]
        for row in range(rows):
            want[j, row] = (offset + row * size) * owners // total if rows * size else 0
        offset += rows * size
    given = collections.Counter((s.variable, row, s.owner) for s in slice_rows(variable_rows, owners)
                                for row in range(s.start, s.stop))
    assert set(given.values()) <= {1}  # no row twice
    assert {(j, row): owner for j, row, owner in given} == want


def test_spread_state_holds_each_slice_on_its_owner_and_gathers_them_back():
    with tf.device("/cpu:0"):
        variables = [keras.Variable(np.arange(24, dtype=np.float32).reshape(6, 4), name="kernel"),
                     keras.Variable(np.arange(3, dtype=np.float32), name="bias")]
        optimizer = keras.optimizers.Adam(0.1)
        optimizer.build(variables)
    state = SpreadState(variables, optimizer, None, SpreadPlacement("/cpu:0", ("/cpu:1", "/cpu:2")))
    # 96 + 12 bytes, halves at byte 54: kernel rows 0-3 (64 bytes) on /cpu:1, the rest on /cpu:2.
    assert state.slices == [Slice(0, 0, 4, 0), Slice(0, 4, 6, 1), Slice(1, 0, 3, 1)]
    for piece, weight in zip(state.slices, state.weights, strict=True):
        assert device_of(weight) == f"CPU:{piece.owner + 1}"
        np.testing.assert_array_equal(weight.numpy(), variables[piece.variable].numpy()[piece.start:piece.stop])
    assert len(state.held_variables()) == 2 * 3  # Adam's two slots of each slice
    assert all(device_of(v) in ("CPU:1", "CPU:2") for v in state.held_variables())
    for weight in state.weights:
        weight.assign(weight + 100.0)
    state.gather()
    np.testing.assert_array_equal(variables[0].numpy(), np.arange(24).reshape(6, 4) + 100.0)
    np.testing.assert_array_equal(variables[1].numpy(), np.arange(3) + 100.0)


def test_cifar10_cnns_local3_kernel_is_cut_over_every_device():
    run = make_run(num_gpus=4, ps_device="spread")
    variables = run.state.model.trainable_variables
    slices = run.inner.layout.state.slices
    local3 = max(range(len(variables)), key=lambda j: variables[j].shape.num_elements())
    assert variables[local3].shape.num_elements() / sum(v.shape.num_elements() for v in variables) > 0.8
    assert sorted(s.owner for s in slices if s.variable == local3) == [0, 1, 2, 3]
    # The largest first: the first device's share is local3's first rows alone.
    assert Slice(local3, 0, next(s.stop for s in slices if s.variable == local3), 0) in slices
    assert all(s.variable == local3 for s in slices if s.owner == 0)
    line = run.describe_layout()
    assert ("variables on /cpu:1 1.07 MB, /cpu:2 1.07 MB, /cpu:3 1.07 MB, /cpu:4 1.07 MB of weights in slices "
            "(their slots and averages beside them), counters on /cpu:0, ") in line


def device_of(variable) -> str:
    return canonical_device(variable.value.device if isinstance(variable, keras.Variable) else variable.device)


def test_slices_slots_and_averages_live_on_their_owners_and_the_checkpointed_state_on_the_host():
    run = make_run(num_gpus=3, accum=2, batch_size=4, ps_device="spread", optimizer="momentum", ema_decay=0.9)
    spread, state = run.inner.layout.state, run.state
    towers = [canonical_device(d) for d in run.mode.plan.tower_devices]
    for k, piece in enumerate(spread.slices):
        assert device_of(spread.weights[k]) == towers[piece.owner]
    held = spread.held_variables()
    assert len(held) == 2 * len(spread.slices)  # a momentum and an average per slice
    assert {device_of(v) for v in held} == set(towers)
    for piece, momentum in zip(spread.slices, held, strict=False):
        assert device_of(momentum) == towers[piece.owner]
    checkpointed = state.checkpoint_variables() + [state.step, state.examples_seen]
    assert {device_of(v) for v in checkpointed} == {"CPU:0"}


def trained(ps_device, updates=3, **options):
    run = make_run(ps_device=ps_device, **options)
    batches = run.batches()
    results = [run.inner.run_update(batches) for _ in range(updates)]
    run.inner.sync_state()
    return run, results


def state_values(run):
    state = run.state
    values = [np.asarray(tf.convert_to_tensor(v)) for v in state.checkpoint_variables()]
    return values + ([] if state.loss_scale is None else [state.loss_scale.value.numpy()])


def start_from(run, values) -> None:
    """Sets a run's checkpointed state (as `state_values` lists it) to `values`."""
    state = run.state
    variables = state.checkpoint_variables()
    for variable, value in zip(variables, values[:len(variables)], strict=True):
        variable.assign(value)
    if state.loss_scale is not None:
        state.loss_scale.value.assign(values[-1])
    run.inner.state_written()


# Each update is compared from the same state: before each one the cpu run takes the state that
# spread's previous update left. From the same state the placements differ only in the order of
# their float32 sums (the gradient sums on their owners, the global norm): a few ulps of each
# value after an update (eps = 1.2e-7; 1.5e-8 at most in every float32 case below, on AMD EPYC by
# default, with TF_ENABLE_ONEDNN_OPTS=0 and with ONEDNN_MAX_CPU_ISA=AVX2). 1e-5 is ~80 ulps of a
# value, and 1/10 of the least an update moves (`moved`). Compared across updates instead, that
# difference grows with each update, by how much depending on the CPU's kernels (resnet20's BN
# on shards of 2 examples took it from 7e-9 to 3.4e-5 in three updates with oneDNN off), so
# a tolerance there would say nothing about the placements. A 16-bit tower rounds its weights:
# a last-bit difference of a float32 weight can round to another 16-bit value, so there the
# placements agree to the compute dtype's rounding (2.4e-5 at most measured, against 1e-3).
EQUIVALENT = [
    (dict(num_gpus=4, accum=2, optimizer="momentum", ema_decay=0.9, clip_norm=0.01), 1e-5),
    (dict(num_gpus=3, accum=1, optimizer="adam", ema_decay=0.5, learning_rate=1e-4), 1e-5),
    (dict(num_gpus=2, accum=3, batch_size=4, tower_split="1,3", optimizer="momentum"), 1e-5),
    # BN's moving statistics: two of resnet20's kind of conv-BN block rather than its 19 (tracing
    # resnet20's steps for both placements took 60 s on CI); the statistics take the same path.
    (dict(num_gpus=2, accum=2, batch_size=2, model="test_recompute_bn", optimizer="momentum",
          learning_rate=0.01), 1e-5),
    (dict(num_gpus=2, accum=2, precision="fp16", transfer_precision="fp16", optimizer="adam",
          learning_rate=1e-4), 1e-3),
    pytest.param(dict(num_gpus=2, accum=2, precision="bf16", transfer_precision="bf16", optimizer="momentum"), 1e-3,
                 marks=pytest.mark.bf16),
]


@pytest.mark.parametrize("options, tolerance", EQUIVALENT,
                         ids=["clip-ema-k2", "adam-k1", "split", "batchnorm", "fp16", "bf16"])
def test_spread_applies_the_updates_of_the_cpu_placement(options, tolerance):
    options = {"batch_size": 8, "learning_rate": 0.05, **options}
    cpu, spread = make_run(ps_device="cpu", **options), make_run(ps_device="spread", **options)
    start = weights(spread.state.model)
    cpu_batches, spread_batches = cpu.batches(), spread.batches()
    decisions = []
    for update in range(1, 4):
        start_from(cpu, state_values(spread))
        want, got = cpu.inner.run_update(cpu_batches), spread.inner.run_update(spread_batches)
        spread.inner.sync_state()  # spread's next update must go on from what this writes back
        assert got.decision == want.decision
        decisions.append(got.decision)
        np.testing.assert_allclose(got.loss, want.loss, rtol=tolerance, err_msg=f"update {update}")
        # Everything a checkpoint holds: weights, BN statistics, slots, counters, averages, loss scale.
        for got_value, want_value in zip(state_values(spread), state_values(cpu), strict=True):
            np.testing.assert_allclose(got_value, want_value, rtol=tolerance, atol=tolerance,
                                       err_msg=f"update {update}")
    assert Decision.APPLIED in decisions
    moved = max(np.abs(a - b).max() for a, b in zip(weights(spread.state.model), start))
    assert moved > 1e-4  # the updates did something, so agreement means something


def test_clip_norm_clips_the_whole_gradient_by_its_global_norm_over_the_devices():
    options = dict(num_gpus=4, accum=1, batch_size=4, optimizer="sgd", learning_rate=1.0)
    clipped, _ = trained("spread", updates=1, clip_norm=1e-3, **options)
    free, _ = trained("spread", updates=1, **options)
    start = weights(make_run(**options).state.model)
    step_clipped = np.concatenate([(a - b).ravel() for a, b in zip(weights(clipped.state.model), start)])
    step_free = np.concatenate([(a - b).ravel() for a, b in zip(weights(free.state.model), start)])
    assert np.linalg.norm(step_clipped) == pytest.approx(1e-3, rel=1e-3)  # SGD at rate 1: the gradient
    # To the float32 resolution of a step taken from weights of ~0.05 (4e-9).
    np.testing.assert_allclose(step_clipped, step_free * 1e-3 / np.linalg.norm(step_free), rtol=1e-3, atol=1e-8)


@pytest.mark.parametrize("poison, decision", [("weights", Decision.EMPTY), ("features", Decision.NONFINITE)])
def test_a_refused_update_moves_no_slice_slot_or_average(poison, decision):
    run = make_run(num_gpus=2, accum=2, batch_size=4, ps_device="spread", optimizer="momentum", ema_decay=0.9)
    batches = host_batches(run)  # float images, which can hold a NaN
    run.inner.run_update(fed(run.inner, [next(batches), next(batches)]))  # slots and averages away from their start
    spread = run.inner.layout.state
    before = [v.numpy() for v in spread.weights + spread.held_variables()]

    def poisoned(batch):
        features, labels, label_weights = batch
        if poison == "weights":
            return features, labels, tf.zeros_like(label_weights)
        return tf.where(tf.range(tf.shape(features)[0])[:, None, None, None] == 0, math.nan, features), labels, \
            label_weights

    result = run.inner.run_update(fed(run.inner, [poisoned(next(batches)) for _ in range(2)]))
    assert result.decision == decision
    for got, want in zip([v.numpy() for v in spread.weights + spread.held_variables()], before, strict=True):
        np.testing.assert_array_equal(got, want)
    assert int(run.state.step.numpy()) == 1 and int(spread.optimizer.iterations.numpy()) == 1


def test_the_checkpointed_state_is_written_back_only_when_asked_and_kept_finite():
    run = make_run(num_gpus=2, accum=1, batch_size=4, ps_device="spread", optimizer="momentum")
    start = weights(run.state.model)
    run.inner.run_update(run.batches())
    # The update moved the slices, not yet the TrainState's weights (no traffic to the host).
    for got, want in zip(weights(run.state.model), start, strict=True):
        np.testing.assert_array_equal(got, want)
    run.inner.sync_state()
    assert max(np.abs(a - b).max() for a, b in zip(weights(run.state.model), start)) > 1e-4
    assert run.inner.held_finite()
    held = run.inner.layout.state.held_variables()[0]
    held.assign(tf.fill(held.shape, math.inf))
    assert not run.inner.held_finite()


class Net(tower_train.TowerModel):
    """[B, 6] -> [B, 4], small enough to train in a few seconds, with a regularization."""

    def __init__(self, num_classes: int = 4, **kwargs):
        super().__init__(num_classes, **kwargs)
        self.hidden = keras.layers.Dense(16, activation="tanh")
        self.logits = keras.layers.Dense(num_classes)

    def call(self, features, training=False):
        return self.logits(self.hidden(features))

    def regularization(self):
        return 1e-3 * tower_train.models.l2_loss(self.hidden.kernel)


def arrays():
    rng = np.random.default_rng(5)
    return rng.normal(size=(256, 6)).astype(np.float32), rng.integers(0, 4, 256)


@pytest.mark.parametrize("first, then", [("cpu", "spread"), ("spread", "cpu")])
def test_a_run_resumes_under_the_other_placement_as_if_never_stopped(tmp_path, first, then):
    # A constant rate: a schedule's end is --max_steps, which the first part sets apart.
    options = dict(model=Net, data=arrays(), num_gpus=3, batch_size=4, accum=2, optimizer="adam",
                   ema_decay=0.9, learning_rate=0.01, lr_schedule="constant", eval_every=0)
    whole = tower_train.fit(train_dir=str(tmp_path / "whole"), max_steps=4, ps_device=first, **options)
    tower_train.fit(train_dir=str(tmp_path / "parts"), max_steps=2, ps_device=first, **options)
    resumed = tower_train.fit(train_dir=str(tmp_path / "parts"), max_steps=4, ps_device=then, **options)
    assert resumed.step == whole.step == 4
    assert resumed.loss == pytest.approx(whole.loss, rel=1e-5)
    want, got = checkpoint_values(tmp_path / "whole"), checkpoint_values(tmp_path / "parts")
    assert got.keys() == want.keys()
    numbers = [name for name in want if np.asarray(want[name]).dtype.kind in "fiu" and "save_counter" not in name]
    assert len(numbers) == 4 + 8 + 4 + 3  # weights, Adam's two slots each, averages, 3 counters
    for name in numbers:  # all but the object graph and how often each process saved
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6, err_msg=name)


class Scaled(keras.layers.Layer):
    """x * w + u, with weights named `weight_names` (None: Keras's own "variable", "variable_1")."""

    def __init__(self, weight_names=(None, None), **kwargs):
        super().__init__(**kwargs)
        self.weight_names = weight_names

    def build(self, shape):
        self.w, self.u = (self.add_weight(shape=(shape[-1],), initializer="ones", name=name)
                          for name in self.weight_names)

    def call(self, x):
        return x * self.w + self.u


class UnnamedWeights(Net):
    """Net with a layer whose two weights Keras names "variable" and "variable_1"."""

    def __init__(self, num_classes: int = 4, **kwargs):
        super().__init__(num_classes, **kwargs)
        self.scaled = Scaled()

    def call(self, features, training=False):
        return super().call(self.scaled(features), training)


class CollidingWeights(Net):
    """Weights a/b_c and a_b/c: their slots would both be named "a_b_c_<slot>"."""

    def __init__(self, num_classes: int = 4, **kwargs):
        super().__init__(num_classes, **kwargs)
        self.first = Scaled(("b_c", "d"), name="a")
        self.second = Scaled(("c", "e"), name="a_b")

    def call(self, features, training=False):
        return super().call(self.second(self.first(features)), training)


def test_slots_pair_with_their_weights_by_name_or_the_run_is_refused_naming_them(tmp_path):
    options = dict(data=arrays(), num_gpus=2, batch_size=4, optimizer="adam", max_steps=2, eval_every=0)
    whole = tower_train.fit(model=UnnamedWeights, train_dir=str(tmp_path / "cpu"), **options)
    spread = tower_train.fit(model=UnnamedWeights, train_dir=str(tmp_path / "spread"), ps_device="spread", **options)
    assert spread.loss == pytest.approx(whole.loss, rel=1e-6)
    want, got = checkpoint_values(tmp_path / "cpu"), checkpoint_values(tmp_path / "spread")
    slots = [name for name in want if name.startswith("optimizer/")]
    assert len(slots) > 8  # Adam's two slots for each weight, the unnamed ones' included
    for name in slots:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-7, err_msg=name)
    with pytest.raises(tower_train.UsageError) as refused:
        tower_train.fit(model=CollidingWeights, train_dir=str(tmp_path / "colliding"), ps_device="spread", **options)
    assert "weights" in str(refused.value) and "a/b_c" in str(refused.value) and "a_b/c" in str(refused.value)


class WeightsSeen(keras.callbacks.Callback):
    """Records the weights after every update, and zeroes the hidden layer's kernel before update 3."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def on_train_batch_begin(self, batch, logs=None):
        if batch == 3:
            kernel = self.model.hidden.kernel
            kernel.assign(tf.zeros_like(kernel))

    def on_train_batch_end(self, batch, logs=None):
        self.seen.append([w.copy() for w in self.model.get_weights()])


def test_evaluations_and_callbacks_read_and_write_the_current_state_as_with_the_cpu_placement(tmp_path):
    options = dict(model=Net, data=arrays(), eval_data=arrays(), num_gpus=3, batch_size=4, accum=1,
                   optimizer="momentum", learning_rate=0.1, max_steps=4, eval_every=1)
    results, callbacks = {}, {}
    for ps_device in ("cpu", "spread"):
        callbacks[ps_device] = WeightsSeen()
        results[ps_device] = tower_train.fit(train_dir=str(tmp_path / ps_device), ps_device=ps_device,
                                             callbacks=[callbacks[ps_device]], **options)
    seen = {ps_device: callback.seen for ps_device, callback in callbacks.items()}
    assert len(seen["spread"]) == 4
    for update, (got, want) in enumerate(zip(seen["spread"], seen["cpu"], strict=True)):
        for a, b in zip(got, want, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=f"update {update + 1}")
    # The zeroed kernel took effect: update 3 started from it.
    assert np.abs(seen["spread"][2][0]).max() < np.abs(seen["spread"][1][0]).max() / 10
    np.testing.assert_allclose(results["spread"].history["val_loss"], results["cpu"].history["val_loss"], rtol=1e-5)
    assert len(results["spread"].history["val_loss"]) == 4


def test_each_tower_receives_the_weights_and_sends_the_gradients_it_does_not_own():
    towers, batch, accum = 3, 4, 4
    run = make_run(model="test_traffic_probe", num_gpus=towers, accum=accum, batch_size=batch,
                   ps_device="spread")
    traffic = count_traffic(run.inner.traced_update(batch_spec(towers * batch)), run.inner.variable_roles(),
                            run.mode.plan.param_device)
    p = size_in_bytes(run.state.model.trainable_variables)
    spread = run.inner.layout.state
    owned = [sum(size_in_bytes([spread.weights[k]]) for k in spread.owned[d]) for d in range(towers)]
    assert sum(owned) == p
    assert traffic.copied["weights"] == sum(p - own for own in owned) == (towers - 1) * p
    # The gradient sums' rows to their owners; each tower's loss and weight sums (2 float32) to the
    # host, and W back to each owner; each owner's finite flag to the host, and the decision back.
    assert traffic.copied["gradients"] == (towers - 1) * p + towers * (8 + 4 + 1 + 1)


def test_at_four_towers_and_k8_the_busiest_device_moves_at_most_half_of_the_cpu_placements():
    """The issue's goal, from the traced graphs: cifar10_cnn, N = 4, K = 8."""
    busiest = {}
    for ps_device in ("cpu", "spread"):
        run = make_run(num_gpus=4, accum=8, batch_size=4, ps_device=ps_device)
        traffic = count_traffic(run.inner.traced_update(batch_spec(16)), run.inner.variable_roles(),
                                run.mode.plan.param_device)
        busiest[ps_device] = traffic.busiest_device_bytes
    assert busiest["spread"] <= 0.5 * busiest["cpu"]
