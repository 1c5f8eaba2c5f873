"""Bytes per update across devices, counted from the traced graphs (tower_train/traffic.py), against
sizes computed here, and against the sends of the runtime's partition graphs; the weight copies of
--tower_weights=per_update."""
import re

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.eager import context

import tower_train.models as models
from tower_train.config import TrainConfig
from tower_train.errors import UsageError
from tower_train.traffic import count_traffic, device_name
from helpers import make_run, weights

TOWERS, BATCH, CHANNELS = 2, 4, 6
FEATURES = (24, 24, 3)  # the embedded data set's


@models.register("test_traffic_probe")
class TrafficProbe(models.TowerModel):
    """Dense, BN, Dense: weights of a few sizes and one BN layer, quick to trace."""

    def __init__(self, num_classes: int, **kwargs):
        super().__init__(num_classes, **kwargs)
        self.flatten = keras.layers.Flatten()
        self.hidden = keras.layers.Dense(CHANNELS)
        self.bn = self.batch_norm(momentum=0.5)
        self.logits = keras.layers.Dense(num_classes)

    def call(self, features: tf.Tensor, training: bool = False) -> tf.Tensor:
        return self.logits(self.bn(self.hidden(self.flatten(features)), training=training))


def batch_spec(micro: int) -> tuple:
    return (tf.TensorSpec([micro, *FEATURES], tf.float32), tf.TensorSpec([micro], tf.int32),
            tf.TensorSpec([micro], tf.float32))


def size_in_bytes(variables) -> int:
    return sum(int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size for v in variables)


def test_device_strings_are_normalized():
    full = "/job:localhost/replica:0/task:0/device:CPU:1"
    assert {device_name(d) for d in ("/cpu:1", "/device:CPU:1", "/CPU:1", full)} == {full}
    assert device_name("/cpu:0") != device_name("/cpu:1")
    assert device_name("/job:worker/task:1/device:CPU:0") != device_name("/cpu:0")  # another machine's
    assert device_name("") == ""


def test_the_towers_receive_raw_uint8_images_and_their_seeds_not_float32_model_input():
    run = make_run(model="test_traffic_probe", num_gpus=TOWERS, accum=2, batch_size=BATCH, augment=True)
    # What training reads: the towers' shards, left on the host, since logical CPU devices get
    # no copy ahead (step/device_feed.py).
    shards = next(run.batches())
    assert len(shards) == TOWERS and all(features.features.dtype == tf.uint8 for features, _, _ in shards)
    assert {device_name(features.features.device) for features, _, _ in shards} == {device_name("/cpu:0")}
    stream = run.source.train_stream(seed=0, start_position=0, micro_batch=BATCH * TOWERS, preprocessed=False)
    traffic = count_traffic(run.inner.traced_update(stream.element_spec), run.inner.variable_roles(),
                            run.mode.plan.param_device)
    # Each micro-step, every example's uint8 [32, 32, 3] image and int64 seed pair, int32 label and
    # float32 weight reach its tower, which distorts it there: no float32 [24, 24, 3] image crosses.
    assert traffic.copied["input"] == 2 * TOWERS * BATCH * (32 * 32 * 3 + 2 * 8 + 4 + 4)


@pytest.mark.parametrize("accum,tower_weights,weight_fetches", [
    (1, "per_update", 1), (4, "per_update", 1), (4, "per_micro_step", 4)])
def test_tower_mode_moves_the_weights_once_per_update_whatever_k(accum, tower_weights, weight_fetches):
    run = make_run(model="test_traffic_probe", num_gpus=TOWERS, accum=accum, batch_size=BATCH,
                   tower_weights=tower_weights)
    model = run.state.model
    micro = TOWERS * BATCH
    traffic = count_traffic(run.inner.traced_update(batch_spec(micro)), run.inner.variable_roles(),
                            run.mode.plan.param_device)
    p = size_in_bytes(model.trainable_variables)
    assert p == 4 * (int(np.prod(FEATURES)) * CHANNELS + CHANNELS + 2 * CHANNELS + CHANNELS * 10 + 10)
    assert traffic.copied["weights"] == weight_fetches * TOWERS * p
    # The gradient sums and each tower's loss and weight sums (2 float32) move once, at the update.
    assert traffic.copied["gradients"] == TOWERS * (p + 2 * 4)
    # BN's moving mean and variance: read by every tower call and written back, N x K calls.
    assert traffic.copied["statistics"] == TOWERS * accum * 2 * 2 * CHANNELS * 4
    # Each micro-step's shards (features, int32 labels, float32 weights) reach their towers.
    assert traffic.copied["input"] == accum * micro * (int(np.prod(FEATURES)) * 4 + 4 + 4)
    assert traffic.copied["other"] == 0 and sum(traffic.collective.values()) == 0


@models.register("test_traffic_decay")
class DecayedProbe(TrafficProbe):
    """The probe with weight decay on its hidden kernel: a regularization that reads weights."""

    def regularization(self) -> tf.Tensor:
        return 1e-3 * models.l2_loss(self.hidden.kernel)


def test_mirrored_moves_no_weights_and_reduces_the_gradients_through_the_host():
    run = make_run(model="test_traffic_decay", mode="mirrored", num_gpus=TOWERS, accum=2, batch_size=BATCH)
    traffic = count_traffic(run.inner.traced_update(batch_spec(TOWERS * BATCH)), run.inner.variable_roles(),
                            "/cpu:0")
    p = size_in_bytes(run.state.model.trainable_variables)
    # Every replica holds the weights; the reported regularization is computed beside the first
    # copy, and only its value is fetched.
    assert traffic.copied["weights"] == 0 and traffic.copied["other"] > 0
    # one_device: every replica's gradient sum to the host and the sum back, plus the three
    # scalars (loss sum, weight sum, non-finite count) of each replica's part of finish's sum,
    # and their sum once more, to the first copy of the weights, where the update is decided.
    assert traffic.copied["gradients"] == 2 * TOWERS * p + TOWERS * 3 * 4 + 3 * 4
    assert sum(traffic.collective.values()) == 0  # no collective op: the reduction is by copies


def test_per_update_copies_give_the_same_updates_and_are_not_checkpointed(tmp_path):
    trained, saved = {}, {}
    for tower_weights in ("per_update", "per_micro_step"):
        run = make_run(model="test_traffic_probe", num_gpus=TOWERS, accum=3, batch_size=BATCH,
                       optimizer="sgd", learning_rate=0.1, tower_weights=tower_weights)
        assert run.inner.copies_weights == (tower_weights == "per_update")
        batches = run.batches()
        for _ in range(2):
            assert run.inner.run_update(batches).applied
        trained[tower_weights] = weights(run.state.model) + [
            np.asarray(tf.convert_to_tensor(v)) for v in run.state.model.non_trainable_variables]
        path = run.state.checkpoint().write(str(tmp_path / tower_weights / "ckpt"))
        saved[tower_weights] = tf.train.list_variables(path)
    for got, want in zip(trained["per_update"], trained["per_micro_step"], strict=True):
        np.testing.assert_array_equal(got, want)
    assert saved["per_update"] == saved["per_micro_step"]


def test_the_counts_are_what_the_runtime_sends():
    """The partition graphs of the functions an update ran: each _Send between two devices is
    one tensor moved; its bytes come from the traced op of the same name."""
    run = make_run(model="test_traffic_probe", num_gpus=TOWERS, accum=2, batch_size=BATCH,
                   tower_weights="per_update", ema_decay=0.0)
    stream = run.source.train_stream(seed=0, start_position=0, micro_batch=BATCH * TOWERS, preprocessed=False)
    runs = run.inner.traced_update(stream.element_spec)  # traced, not yet run
    stream = run.inner.feed(stream)
    context.context().enable_run_metadata()  # before the first call: partitioning is recorded then
    try:
        run.inner.run_update(stream)
        metadata = context.context().export_run_metadata()
    finally:
        context.context().disable_run_metadata()
    param = device_name(run.mode.plan.param_device)
    sent = {"to the parameter device": 0, "from the parameter device": 0}
    for function in metadata.function_graphs:
        names = {node.name for node in function.pre_optimization_graph.node}
        graph = max((f.graph for f, _ in runs), key=lambda g: len(names & {op.name for op in g.get_operations()}))
        for node in (n for partition in function.partition_graphs for n in partition.node):
            source, target = (device_name(node.attr[a].s.decode()) for a in ("send_device", "recv_device"))
            if node.op != "_Send" or source == target or node.attr["T"].type == tf.resource.as_datatype_enum:
                continue
            name = re.sub(r"^edge_\d+_", "", node.attr["tensor_name"].s.decode())
            if name.startswith("GroupCrossDeviceControlEdges"):  # the partitioner's control edges: no data
                continue
            op = graph.get_operation_by_name(name)
            (tensor,) = [t for t in op.outputs if t.dtype.as_datatype_enum == node.attr["T"].type][:1]
            # Not the shards: the arguments, which arrive on the host (logical CPU devices get no copy
            # ahead, step/device_feed.py), as count_traffic counts them from there, as input.
            if source == param and op.type != "Placeholder":
                sent["from the parameter device"] += tensor.shape.num_elements() * tensor.dtype.size
            elif target == param:
                sent["to the parameter device"] += tensor.shape.num_elements() * tensor.dtype.size
    counted = count_traffic(runs, run.inner.variable_roles(), run.mode.plan.param_device).copied
    assert sent["from the parameter device"] == counted["weights"] + counted["statistics"] // 2
    assert sent["to the parameter device"] == counted["gradients"] + counted["statistics"] // 2


def test_collectives_count_the_bytes_entering_them_per_replica():
    devices = ["/cpu:1", "/cpu:2"]
    sums = []
    for device in devices:
        with tf.device(device):
            sums.append(tf.Variable(tf.zeros([5, 7])))

    @tf.function
    def all_reduce():
        reduced = []
        for device, gradient_sum in zip(devices, sums):
            with tf.device(device):
                reduced.append(tf.raw_ops.CollectiveReduceV2(
                    input=gradient_sum.read_value() * 0.5, group_size=2, group_key=1, instance_key=1,
                    ordering_token=[], merge_op="Add", final_op="Id"))
        return reduced

    traffic = count_traffic([(all_reduce.get_concrete_function(), 3)], {"gradients": sums}, "/cpu:1")
    assert traffic.collective["gradients"] == 3 * 2 * 5 * 7 * 4  # traced only: never run
    # Replica 2's reduced gradient, fetched to /cpu:1 as the function's result.
    assert dict(traffic.copied) == {"weights": 0, "gradients": 0, "statistics": 0, "input": 0,
                                    "other": 3 * 5 * 7 * 4}


def test_tower_weights_is_checked_once_in_the_config():
    with pytest.raises(UsageError, match=r"^--tower_weights=sometimes: unknown; allowed: per_update, "
                                         r"per_micro_step$"):
        TrainConfig(tower_weights="sometimes")
    with pytest.raises(UsageError, match=r"^--tower_weights=per_micro_step: only with --mode=tower"):
        TrainConfig(mode="mirrored", tower_weights="per_micro_step")
    assert TrainConfig().tower_weights == "per_update"


@pytest.mark.parametrize("precision, transfer_precision, accum", [
    pytest.param("bf16", "fp32", 1, marks=pytest.mark.bf16), pytest.param("bf16", "bf16", 4, marks=pytest.mark.bf16),
    ("fp32", "bf16", 4), ("fp16", "fp16", 1)])
def test_16_bit_transfers_halve_the_weight_and_gradient_bytes(precision, transfer_precision, accum):
    run = make_run(model="test_traffic_probe", num_gpus=TOWERS, accum=accum, batch_size=BATCH,
                   precision=precision, transfer_precision=transfer_precision)
    model = run.state.model
    traffic = count_traffic(run.inner.traced_update(batch_spec(TOWERS * BATCH)), run.inner.variable_roles(),
                            run.mode.plan.param_device)
    p = size_in_bytes(model.trainable_variables)
    bn = size_in_bytes(model.bn.trainable_variables)  # gamma and beta: BN reads them in float32
    # Under a 16-bit precision the Dense layers' weights travel in it, BN's in float32.
    sent_weights = p if precision == "fp32" else (p - bn) // 2 + bn
    assert traffic.copied["weights"] == TOWERS * sent_weights
    # Every gradient sum in the transfer dtype; each tower's loss and weight sums in float32.
    sent_gradients = p if transfer_precision == "fp32" else p // 2
    assert traffic.copied["gradients"] == TOWERS * (sent_gradients + 2 * 4)
    assert traffic.copied["statistics"] == TOWERS * accum * 2 * 2 * CHANNELS * 4  # as in float32
