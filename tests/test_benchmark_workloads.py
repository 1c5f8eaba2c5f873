"""The benchmark's workloads (tower_train/benchmark/workloads.py) built in this process on its
logical CPUs: what `build_workload` runs and counts for a configuration, and
`slow_first_tower`'s wait."""
import time
import types

import numpy as np
import pytest
import tensorflow as tf

from helpers import TinyNet, weights
from tower_train.training import run as run_module
from tower_train.benchmark import workloads
from tower_train.benchmark.names import parse_config_name
from tower_train.benchmark.workloads import build_workload, slow_first_tower
from tower_train.config import TrainConfig
from tower_train.devices import plan_devices

TOWERS, BATCH = 2, 2
CONFIG = TrainConfig(train_dir="/unused", num_gpus=TOWERS, batch_size=BATCH)  # cifar10_cnn on synthetic
PLAN = plan_devices(TOWERS, CONFIG.ps_device, num_physical_gpus=0)
CNN_WEIGHTS = 1_068_298  # cifar10_cnn's trainable float32 weights ("1.07 M parameters", docs/models.md)
RAW_IMAGE_BYTES = 32 * 32 * 3  # a uint8 [32, 32, 3] image of the built-in image sets, as they hold it


@pytest.fixture
def built(monkeypatch):
    """build(name, config, slow_tower_ms): the workload of a configuration name and the
    TrainState it trains (recorded as TrainState.create makes it)."""
    states = []
    create = run_module.TrainState.create

    def recorded(*args, **kwargs):
        states.append(create(*args, **kwargs))
        return states[-1]

    monkeypatch.setattr(run_module.TrainState, "create", recorded)

    def build(name: str, config: TrainConfig = CONFIG, slow_tower_ms: float = 0.0):
        workload = build_workload(parse_config_name(name, config.batch_size), config, PLAN, slow_tower_ms)
        assert len(states) == 1, name
        return workload, states.pop()

    return build


@pytest.fixture
def sleeps(monkeypatch) -> list[float]:
    """The seconds of every sleep of slow_first_tower's wait (which still sleeps them)."""
    slept = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        time.sleep(seconds)

    monkeypatch.setattr(workloads, "time", types.SimpleNamespace(sleep=sleep, perf_counter=time.perf_counter))
    return slept


@pytest.mark.parametrize("kind", ["plain", "keras_fit", "tower_pscpu"])
def test_run_applies_that_many_updates_of_g_examples(built, monkeypatch, kind):
    optimizers = []  # keras_fit's own optimizer is the last made
    make_optimizer = run_module.make_optimizer
    monkeypatch.setattr(run_module, "make_optimizer",
                        lambda *args: optimizers.append(make_optimizer(*args)) or optimizers[-1])
    workload, state = built(f"{kind}_k2_b{BATCH}")
    assert workload.global_batch == BATCH * TOWERS * 2  # B x towers x K, whichever runs it
    assert workload.labels_per_example == 1 and workload.read_input is None  # one label; a batch in memory
    before = weights(state.model)
    assert workload.run(3) > 0
    after = weights(state.model)
    assert all(not np.array_equal(b, a) for b, a in zip(before, after))
    if kind == "keras_fit":
        # Keras counts its train steps, K micro-batches of B x towers examples per update, and
        # (`iterations`) the updates its gradient accumulation applied.
        assert (int(optimizers[-1]._iterations), int(optimizers[-1].iterations)) == (3 * 2, 3)
    else:
        assert int(state.step) == 3


@pytest.mark.parametrize("kind", ["plain", "keras_fit"])
def test_one_device_kinds_count_no_traffic_or_state(built, kind):
    workload, _ = built(f"{kind}_k1")
    assert workload.traffic is None and workload.state_bytes is None


@pytest.mark.parametrize("name, devices", [
    ("plain_k1", ["/cpu:1"]), ("keras_fit_k2", ["/cpu:1"]), ("tower_pscpu_k2", ["/cpu:1", "/cpu:2"]),
    ("tower_psspread_k1", ["/cpu:1", "/cpu:2"]), ("mirrored_k1", ["/cpu:1", "/cpu:2"])])
def test_each_kind_computes_where_its_name_says_and_the_baselines_on_the_first_towers_device(built, name, devices):
    """Read from the traced graphs: the baselines build and run on the towers' first device (a GPU
    on a GPU machine, /cpu:1 here), never on the host /cpu:0 that holds tower mode's variables."""
    workload, state = built(name)
    if name.startswith(("plain", "keras_fit")):
        assert {v.value.device for v in state.model.trainable_variables} == {"/job:localhost/replica:0/task:0/device:CPU:1"}
    workload.run(1)
    assert workload.compute_devices() == devices


@pytest.mark.parametrize("kind", ["plain", "keras_fit"])
def test_the_baselines_train_under_xla_on_the_towers_first_device(built, kind):
    # XLA compiles a whole step for the device it is called on, whatever its ops name: called
    # from the host, the plain step failed to read its variables on /cpu:1.
    config = TrainConfig(train_dir="/unused", num_gpus=TOWERS, batch_size=BATCH, jit_compile=True)
    workload, state = built(f"{kind}_k1", config)
    before = weights(state.model)
    assert workload.run(1) > 0
    assert all(not np.array_equal(b, a) for b, a in zip(before, weights(state.model)))


def test_a_tower_kind_counts_its_bytes_per_update_and_the_state_each_device_holds(built):
    workload, state = built(f"tower_pscpu_k2_b{BATCH}")
    p = 4 * CNN_WEIGHTS  # bytes
    assert 4 * sum(int(np.prod(v.shape)) for v in state.model.trainable_variables) == p
    copied = workload.traffic().copied
    # Once per update at K > 1, each tower gets the weights and sends back its gradient sums and
    # its float32 loss and weight sums; each micro-step's shards come from the host: every example's
    # raw uint8 image (each tower preprocesses its own; the central crop reads no seed, so none
    # crosses), int32 label and float32 weight.
    assert copied["weights"] == TOWERS * p
    assert copied["gradients"] == TOWERS * (p + 8)
    assert copied["input"] == 2 * BATCH * TOWERS * (RAW_IMAGE_BYTES + 4 + 4)
    # The host holds the weights, Adam's two slots, their moving average and three int64 counters;
    # each tower its gradient sums, loss and weight sums, and its copy of the weights.
    assert sorted(workload.state_bytes().values()) == [2 * p + 8] * TOWERS + [4 * p + 24]


def test_a_sequence_model_consumes_a_label_per_position():
    config = TrainConfig(train_dir="/unused", model="tiny_transformer", dataset="markov_text", num_gpus=TOWERS,
                         batch_size=BATCH)
    workload = build_workload(parse_config_name("tower_pscpu_k1_data", BATCH), config, PLAN)
    # markov_text's examples are sequences padded to 48 tokens, each a label (docs/data.md).
    assert (workload.global_batch, workload.labels_per_example) == (BATCH * TOWERS, 48)
    assert workload.read_input(2) > 0  # read from the pipeline: a second iterator, no training


def test_the_plain_kind_trains_a_sequence_model_on_its_own():
    # Its step traces the model outside any tower's name scope, where a Keras layer named with a
    # leading underscore (tiny_transformer's blocks, once) is refused as a root name scope.
    config = TrainConfig(train_dir="/unused", model="tiny_transformer", dataset="markov_text", num_gpus=TOWERS,
                         batch_size=BATCH)
    workload = build_workload(parse_config_name("plain_k1", BATCH), config, PLAN)
    assert workload.run(1) > 0


def test_a_slow_tower_ms_makes_tower_0_of_a_tower_kind_wait_per_example_of_its_shard(built, sleeps):
    workload, _ = built("tower_pscpu_k2_b2_s1-3", slow_tower_ms=5.0)
    workload.run(1)
    # A micro-batch of 2 x 2 examples split 1 + 3: tower 0 waits 1 x 5 ms at each of K = 2 micro-steps.
    assert sleeps == [pytest.approx(0.005)] * 2
    sleeps.clear()
    for name in ("mirrored_k2_b2", "plain_k2_b2"):  # no towers of their own: nothing slowed
        built(name, slow_tower_ms=5.0)[0].run(1)
    assert sleeps == []


def test_slow_first_tower_keeps_the_loss_and_waits_only_in_tower_0(sleeps):
    model = TinyNet()
    rng = np.random.default_rng(0)
    labels = tf.constant([0, 2, 1, 1], tf.int32)
    logits = tf.constant(rng.normal(size=(4, 3)), tf.float32)
    unwrapped = model.per_example_loss
    expected = unwrapped(labels, logits).numpy()
    # Softmax cross-entropy, by hand.
    shifted = logits.numpy() - logits.numpy().max(axis=1, keepdims=True)
    by_hand = np.log(np.exp(shifted).sum(axis=1)) - shifted[np.arange(4), labels.numpy()]
    np.testing.assert_allclose(expected, by_hand, rtol=1e-6)

    slow_first_tower(model, 50.0)
    assert model.per_example_loss is not unwrapped
    for scope in (None, "tower_1", "tower_01", "replica/tower_1"):
        if scope is None:
            losses = model.per_example_loss(labels, logits)
        else:
            with tf.name_scope(scope):
                losses = model.per_example_loss(labels, logits)
        np.testing.assert_array_equal(losses.numpy(), expected)
        assert sleeps == [], scope
    for scope in ("tower_0", "replica/tower_0"):
        with tf.name_scope(scope):
            start = time.perf_counter()
            losses = model.per_example_loss(labels, logits).numpy()
            seconds = time.perf_counter() - start
        np.testing.assert_array_equal(losses, expected)
        assert sleeps == [pytest.approx(4 * 0.050)], scope  # 50 ms for each of the 4 examples
        assert seconds >= 0.8 * 4 * 0.050, scope
        sleeps.clear()
