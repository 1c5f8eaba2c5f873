"""The strategy modes: same updates as tower mode, one all-reduce per update, and their set-up."""
import json
import os
import socket
import subprocess
import sys
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

import tower_train
from tower_train.workers.cluster import WorkerInfo, parse_tf_config
from tower_train.config import TrainConfig
from tower_train.rules import MODE_RULES
from tower_train.devices import canonical_device, plan_devices
from tower_train.errors import UsageError
from tower_train.step.device_feed import shard_specs
from tower_train.step.modes import MODE_CLASSES, build_mode, fit_plan_to_mode, resolve_all_reduce, resolve_jit_compile
from helpers import cross_tower_ops, make_run, read_until, weights
from test_cli_errors import ROOT
from test_train import checkpoint_values


def worker_config(workers, index, chief=False):
    return json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}})


def test_tf_config_gives_index_count_chief_and_peers():
    assert parse_tf_config(worker_config(["a:1", "b:2"], 1)) == WorkerInfo(1, 2, False, ("a:1",),
                                                                           address="b:2")
    assert parse_tf_config(worker_config(["a:1", "b:2"], 0)).is_chief
    with_chief = json.dumps({"cluster": {"chief": ["c:0"], "worker": ["a:1"]},
                             "task": {"type": "worker", "index": 0}})
    assert parse_tf_config(with_chief) == WorkerInfo(1, 2, False, ("c:0",), address="a:1")


@pytest.mark.parametrize("text,expected", [
    (None, "needs TF_CONFIG"),
    ("{not json", "not valid JSON"),
    ("[1, 2]", "JSON object"),
    ('{"cluster": {"worker": ["a:1"]}}', "'task' object"),
    ('{"cluster": {"ps": ["a:1"]}, "task": {"type": "ps", "index": 0}}', "job 'ps'"),
    ('{"cluster": {"worker": ["nohostport"]}, "task": {"type": "worker", "index": 0}}', "host:port"),
    (worker_config(["a:1", "b:2"], 2), "task.index=2: out of range"),
    (worker_config(["a:1"], -1), "task.index=-1"),
    ('{"cluster": {"worker": ["a:1"]}, "task": {"type": "chief", "index": 0}}', "task.type='chief'"),
])
def test_bad_tf_config_is_one_line_naming_the_fault(text, expected):
    with pytest.raises(UsageError, match=expected) as error:
        parse_tf_config(text)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("mode, holder", [("tower", "CPU:0"), ("central_storage", "CPU:0"), ("mirrored", None)])
def test_a_mode_creates_variables_where_its_placement_says(mode, holder):
    plan = plan_devices(2, "cpu", num_physical_gpus=0)  # towers /cpu:1, /cpu:2; parameters /cpu:0
    built = build_mode(TrainConfig(train_dir="/unused", mode=mode, num_gpus=2), plan)
    with built.variable_scope():
        variable = tf.Variable(tf.zeros([3]))

    assert type(built) is MODE_CLASSES[mode] and (built.strategy is None) == (mode == "tower")
    if holder is not None:
        assert canonical_device(variable.device) == canonical_device(built.placement.device_of(variable)) == holder
        assert built.placement.describe([variable]) == "/cpu:0"
    else:  # a copy on every tower; the first is the one device_of names
        copies = built.strategy.experimental_local_results(variable)
        assert [canonical_device(c.device) for c in copies] == ["CPU:1", "CPU:2"]
        assert canonical_device(built.placement.device_of(variable)) == "CPU:1"
        assert built.placement.describe([variable]) == "every replica (mirrored)"


def test_all_reduce_choice_follows_the_devices():
    gpus = plan_devices(4, "cpu", num_physical_gpus=4)
    split_gpu = plan_devices(4, "cpu", num_physical_gpus=1, gpu0_memory_mb=8000)
    cpus = plan_devices(4, "cpu", num_physical_gpus=0)
    assert resolve_all_reduce("mirrored", "auto", gpus) == "nccl"
    assert resolve_all_reduce("mirrored", "auto", split_gpu) == "one_device"
    assert resolve_all_reduce("mirrored", "auto", cpus) == "one_device"
    assert resolve_all_reduce("mirrored", "hierarchical_copy", gpus) == "hierarchical_copy"
    assert resolve_all_reduce("multi_worker", "auto", gpus) == "nccl"
    assert resolve_all_reduce("multi_worker", "auto", plan_devices(0, "cpu", 0)) == "ring"
    assert resolve_all_reduce("tower", "auto", cpus) == "parameter_device"
    with pytest.raises(UsageError, match="--all_reduce=nccl: needs one physical GPU per tower"):
        resolve_all_reduce("mirrored", "nccl", split_gpu)


def test_auto_jit_compile_decides_as_kerass_fit_on_gpus_and_keeps_a_given_value():
    """XLA where GPUs compute the towers, as Keras's fit decides its own jit_compile="auto"; off
    on a CPU, under --deterministic, where central_storage's replicas read the host's
    variables, and for a Keras model with a layer whose supports_jit is False."""
    gpus = plan_devices(2, "auto", num_physical_gpus=2)
    cpus = plan_devices(2, "auto", num_physical_gpus=0)
    auto = TrainConfig()
    assert resolve_jit_compile(auto, gpus) == (True, "GPUs compute the towers")
    assert resolve_jit_compile(auto, cpus) == (False, "no GPU computes the towers")
    assert resolve_jit_compile(TrainConfig(deterministic=True), gpus) == (False, "--deterministic")
    assert resolve_jit_compile(TrainConfig(mode="central_storage"), gpus) == (
        False, "--mode=central_storage reads the variables on /cpu:0")
    assert resolve_jit_compile(TrainConfig(jit_compile=True), cpus) == (True, "")
    assert resolve_jit_compile(TrainConfig(jit_compile=False), gpus) == (False, "")

    class NoXla(keras.layers.Layer):
        def __init__(self):
            super().__init__(name="no_xla")
            self.supports_jit = False

        def call(self, x):
            return x

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2), NoXla()])
    assert resolve_jit_compile(auto, gpus, model) == (False, "layer no_xla (NoXla) does not support XLA")
    assert resolve_jit_compile(auto, gpus, keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])) == (
        True, "GPUs compute the towers")


def test_a_mode_built_from_an_auto_config_resolves_it_for_its_plan():
    mode = build_mode(TrainConfig(num_gpus=2), plan_devices(2, "auto", num_physical_gpus=0))
    assert (mode.config.jit_compile, mode.config.ps_device) == (False, "cpu")


def test_multi_worker_runs_one_cpu_replica_per_worker():
    assert fit_plan_to_mode("multi_worker", plan_devices(1, "cpu", 0)).tower_devices == ("/cpu:0",)
    assert fit_plan_to_mode("multi_worker", plan_devices(2, "cpu", 2)).tower_devices == ("/gpu:0", "/gpu:1")
    with pytest.raises(UsageError, match="pass --num_gpus=1"):
        fit_plan_to_mode("multi_worker", plan_devices(2, "cpu", 0))


@pytest.mark.parametrize("mode", ["mirrored", "central_storage"])
def test_strategy_modes_apply_tower_modes_updates(mode):
    layout = dict(num_gpus=3, accum=2, batch_size=8, optimizer="momentum", learning_rate=0.05)
    tower, other = make_run(**layout), make_run(mode=mode, **layout)
    tower_batches, other_batches = tower.batches(), other.batches()
    for update in range(3):
        tower_loss = tower.inner.run_update(tower_batches).loss
        other_loss = other.inner.run_update(other_batches).loss
        assert other_loss == pytest.approx(tower_loss, rel=1e-5)
        for got, want in zip(weights(other.state.model), weights(tower.state.model)):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=f"update {update}")
    assert other.state.step.numpy() == 3 and other.state.optimizer.iterations.numpy() == 3


def test_mirrored_micro_steps_that_do_not_update_run_no_all_reduce():
    run = make_run(mode="mirrored", num_gpus=3, accum=4, batch_size=4)
    spec = (tf.TensorSpec([12, 24, 24, 3], tf.float32), tf.TensorSpec([12], tf.int32),
            tf.TensorSpec([12], tf.float32))
    shards = shard_specs(spec, (4, 4, 4))
    accumulate = run.inner.accumulate.get_concrete_function(shards).graph
    finish = run.inner.finish.get_concrete_function(shards).graph
    apply = run.inner.apply.get_concrete_function(tf.TensorSpec([], tf.float32)).graph
    num_variables = len(run.state.model.trainable_variables)
    assert cross_tower_ops(accumulate, run.mode.plan.tower_devices) == []
    assert len(cross_tower_ops(finish, run.mode.plan.tower_devices)) < num_variables  # two scalars only
    assert len(cross_tower_ops(apply, run.mode.plan.tower_devices)) >= num_variables


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_workers(train_dir, count, extra=(), cwd=ROOT):
    addresses = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    return [subprocess.Popen(
        [sys.executable, "-m", "tower_train", "--mode=multi_worker", "--num_gpus=1",
         f"--train_dir={train_dir}", *extra],
        cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "TF_CONFIG": worker_config(addresses, i)})
        for i in range(count)]


def kill_running(processes):
    """Kills those still running: a failed test must not leave processes training."""
    for process in processes:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=60)


# Each worker's flags, and (as options of tower_train.fit) tower mode's on two towers, G = 64 both.
TOWER_LAYOUT = dict(batch_size=16, accum=2, max_steps=4, optimizer="sgd", learning_rate=0.1, log_every=1)
LAYOUT = [f"--{name}={value}" for name, value in TOWER_LAYOUT.items()] + ["--collective_timeout=60"]


@pytest.mark.cpu_only
def test_two_workers_equal_tower_mode_with_two_towers(tmp_path):
    workers = start_workers(tmp_path / "mw", 2, LAYOUT)
    try:
        logs = [w.communicate(timeout=240) for w in workers]
    finally:
        kill_running(workers)
    for worker, (_, err) in zip(workers, logs):
        assert worker.returncode == 0, err
    assert "[worker 0/2] step 4, loss = " in logs[0][1] and "[worker 1/2] step 4, loss = " in logs[1][1]
    assert "mode=multi_worker (ring reduction)" in logs[0][1] and "global batch G = 64" in logs[0][1]
    written = [f for f in os.listdir(tmp_path / "mw") if not f.startswith("events")]
    assert sorted(written) == ["checkpoint", "ckpt-4.data-00000-of-00001", "ckpt-4.index", "lock",
                               "tower_train_run.json"]  # no worker's temp dir left; the chief's lock
    # The reference in this process (a command's start-up would add nothing to the comparison).
    tower = tower_train.fit(train_dir=str(tmp_path / "tower"), num_gpus=2, **TOWER_LAYOUT)
    assert tower.step == 4
    multi, single = checkpoint_values(str(tmp_path / "mw")), checkpoint_values(str(tmp_path / "tower"))
    assert multi.keys() == single.keys()
    for name in (n for n in single if n.startswith("model/")):
        np.testing.assert_allclose(multi[name], single[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_a_worker_whose_peer_never_comes_exits_in_bounded_time(tmp_path):
    start = time.monotonic()
    (worker,) = start_workers(tmp_path / "alone", 1, ["--collective_timeout=10", "--max_steps=2"])
    try:
        _, err = worker.communicate(timeout=120)
    finally:
        kill_running([worker])
    assert worker.returncode != 0
    assert time.monotonic() - start < 60
    last = err.strip().splitlines()[-1]
    assert last.startswith("tower_train: [worker 0/2] no progress for 10 s while waiting on the peers (--collective_timeout): peer(s) 127.0.0.1:")
    assert "not reachable" in last and "Traceback" not in err


@pytest.mark.cpu_only
def test_a_worker_whose_peer_dies_exits_naming_it(tmp_path):
    workers = start_workers(tmp_path / "dies", 2, ["--batch_size=16", "--max_steps=100000",
                                                   "--log_every=1", "--collective_timeout=30"])
    try:
        read_until(workers[1], "step 3,", timeout=240)
        workers[1].kill()
        killed = time.monotonic()
        _, err = workers[0].communicate(timeout=120)
        assert workers[0].returncode != 0
        assert time.monotonic() - killed < 45
        last = err.strip().splitlines()[-1]
        assert last.startswith("tower_train: [worker 0/2] ") and "not reachable" in last, err[-2000:]
        assert "Traceback" not in err
        # TensorFlow's multi-line C++ errors about the lost peer are hidden: the last line says it.
        assert ".cc:" not in err and "unhealthy" not in err, err[-2000:]
        workers[1].wait(timeout=60)
    finally:
        kill_running(workers)


def test_every_mode_of_the_rules_has_its_class_which_takes_its_rules_from_them():
    assert {name: mode.rules for name, mode in MODE_CLASSES.items()} == MODE_RULES
