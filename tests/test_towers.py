"""The tower math against independent computations, layout invariance, placement and traffic."""
import keras
import numpy as np
import pytest
import tensorflow as tf

from tower_train.data.source import RawInput
from tower_train.devices import canonical_device
from tower_train.step.device_feed import shard_specs
from tower_train.step.towers import combine_gradients
from helpers import cross_tower_ops, fed, make_run, weights

LR = 0.1


def plain_sgd_reference(model, images, labels):
    """One SGD step on the whole batch with a plain GradientTape on one device: the golden reference."""
    with tf.device("/cpu:0"):
        with tf.GradientTape() as tape:
            logits = model(images, training=True)
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits))
            loss += 0.004 * sum(tf.reduce_sum(tf.square(v)) / 2
                                for v in (model.local3.kernel, model.local4.kernel))
        grads = tape.gradient(loss, model.trainable_variables)
        return float(loss), [w.numpy() - LR * g.numpy()
                             for w, g in zip(model.trainable_variables, grads)]


def test_combine_gradients_weighs_each_towers_sum_by_its_labels_over_the_total_weight():
    a = [tf.constant([1.0, 2.0]), tf.constant(3.0)]
    b = [tf.constant([5.0, 6.0]), tf.constant(7.0)]
    # Equal shards of c = 4 labels, unit weights, 2 towers x 2 micro-steps: W = 16, the plain mean.
    mean = combine_gradients([a, b], [4, 4], tf.constant(16.0))
    np.testing.assert_allclose(mean[0], [1.5, 2.0])
    np.testing.assert_allclose(mean[1], 2.5)
    # Unequal shards (3 and 1 labels) and W = 2: tower sums scaled by 3/2 and 1/2.
    skewed = combine_gradients([a, b], [3, 1], tf.constant(2.0))
    np.testing.assert_allclose(skewed[0], [1.5 * 1 + 0.5 * 5, 1.5 * 2 + 0.5 * 6])


@pytest.mark.parametrize("num_gpus,accum", [(4, 2), (2, 3), (1, 4), (3, 1)])
def test_towers_and_accumulation_equal_one_plain_step_on_the_concatenated_batch(num_gpus, accum):
    batch = 8
    run = make_run(num_gpus=num_gpus, accum=accum, batch_size=batch, optimizer="sgd",
                    learning_rate=LR)
    rng = np.random.default_rng(7)
    g = batch * num_gpus * accum
    images = rng.normal(size=(g, 24, 24, 3)).astype(np.float32)
    labels = rng.integers(0, 10, size=g).astype(np.int32)
    expected_loss, expected = plain_sgd_reference(run.state.model, images, labels)

    micro = batch * num_gpus
    ones = np.ones(g, np.float32)
    batches = fed(run.inner, [(images[i:i + micro], labels[i:i + micro], ones[i:i + micro])
                              for i in range(0, g, micro)])
    result = run.inner.run_update(batches)
    assert result.applied and result.total_weight == g

    assert result.loss == pytest.approx(expected_loss, rel=1e-5)
    for got, want in zip(weights(run.state.model), expected):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["tower", "mirrored"])
def test_towers_preprocessing_their_raw_shards_equal_one_plain_step_on_the_host_preprocessed_batch(mode):
    """Training reads the stream raw (uint8 images and each example's seed) and each tower or
    replica distorts its own shard: the update equals plain SGD on the same examples distorted
    on the host, by the stream's default (preprocessed) form."""
    batch, towers, accum = 4, 2, 2
    run = make_run(mode=mode, num_gpus=towers, accum=accum, batch_size=batch, optimizer="sgd",
                   learning_rate=LR, augment=True)
    stream = run.batches()
    raw = [next(stream) for _ in range(accum)]
    first_shard_features = raw[0][0][0]
    assert isinstance(first_shard_features, RawInput) and first_shard_features.features.dtype == tf.uint8
    host = iter(run.source.train_stream(seed=run.config.seed, start_position=0, micro_batch=batch * towers))
    images, labels, _ = (np.concatenate(part) for part in zip(*(next(host) for _ in range(accum))))
    assert images.dtype == np.float32 and images.shape == (batch * towers * accum, 24, 24, 3)
    expected_loss, expected = plain_sgd_reference(run.state.model, images, labels)

    result = run.inner.run_update(iter(raw))
    assert result.applied and result.loss == pytest.approx(expected_loss, rel=1e-5)
    for got, want in zip(weights(run.state.model), expected):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_weights_depend_only_on_the_examples_not_on_the_layout():
    # (batch, towers, accum, --ps_device), G = 64 each: one tower with and without accumulation,
    # several towers with and without it, and spread with and without it (at 8 towers, its finest
    # slices). Each is a path of its own; another tower count or shard size on one of these paths
    # runs the same code again (test_spread.py checks spread at 2 and 3 towers against cpu).
    layouts = [(64, 1, 1, "cpu"), (8, 1, 8, "cpu"), (8, 4, 2, "cpu"), (8, 8, 1, "cpu"),
               (8, 4, 2, "spread"), (8, 8, 1, "spread")]
    trajectories = {}
    for batch, num_gpus, accum, ps_device in layouts:
        run = make_run(batch_size=batch, num_gpus=num_gpus, accum=accum, optimizer="sgd",
                       learning_rate=LR, ps_device=ps_device)
        batches = run.batches()
        trajectories[batch, num_gpus, accum, ps_device] = []
        for _ in range(3):
            run.inner.run_update(batches)
            run.inner.sync_state()
            trajectories[batch, num_gpus, accum, ps_device].append(weights(run.state.model))
    reference = trajectories[layouts[0]]
    moved = max(np.abs(a - b).max() for a, b in zip(reference[-1], make_run().state.model.trainable_variables))
    assert moved > 1e-3  # the updates did something, so agreement means something
    for layout, trajectory in trajectories.items():
        for update, (got_weights, want_weights) in enumerate(zip(trajectory, reference)):
            for got, want in zip(got_weights, want_weights):
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6,
                                           err_msg=f"layout {layout}, update {update + 1}")


@pytest.mark.parametrize("ps_device,expected", [("cpu", "/cpu:0"), ("gpu", "/cpu:1")])
def test_every_variable_lives_on_the_parameter_device(ps_device, expected):
    run = make_run(num_gpus=3, accum=2, batch_size=4, ps_device=ps_device, optimizer="momentum")
    variables = run.state.model.weights + run.state.optimizer.variables
    assert len(run.state.optimizer.variables) > len(run.state.model.trainable_variables)  # slots exist
    for v in variables + [run.state.step, run.state.examples_seen]:
        device = v.value.device if isinstance(v, keras.Variable) else v.device
        assert canonical_device(device) == canonical_device(expected), v.name
    for device, sums in zip(run.mode.plan.tower_devices, run.inner._sums, strict=True):  # but each tower's sums
        assert {canonical_device(s.device) for s in sums.gradient_variables + sums.scalar_variables} == {
            canonical_device(device)}


def test_apply_runs_once_per_update_and_steps_count_updates():
    run = make_run(num_gpus=2, accum=4, batch_size=4, optimizer="momentum")
    batches = run.batches()
    for _ in range(3):
        run.inner.run_update(batches)
    assert run.state.step.numpy() == 3
    assert run.state.optimizer.iterations.numpy() == 3
    for sums in run.inner._sums:  # cleared after each update
        assert all(not np.any(s.numpy()) for s in sums.gradient_variables + sums.scalar_variables)


def test_micro_steps_that_do_not_update_move_no_gradient_across_devices():
    run = make_run(num_gpus=3, accum=4, batch_size=4)
    spec = (tf.TensorSpec([12, 24, 24, 3], tf.float32), tf.TensorSpec([12], tf.int32),
            tf.TensorSpec([12], tf.float32))
    shards = shard_specs(spec, (4, 4, 4))
    accumulate = run.inner.accumulate.get_concrete_function(shards).graph
    update = run.inner.update.get_concrete_function(shards).graph
    param = canonical_device(run.mode.plan.param_device)

    assert cross_tower_ops(accumulate, run.mode.plan.tower_devices) == []
    assert [op.name for op in accumulate.get_operations()
            if op.device and canonical_device(op.device) == param] == []

    reductions = cross_tower_ops(update, run.mode.plan.tower_devices)
    num_variables = len(run.state.model.trainable_variables)
    assert len(reductions) >= num_variables  # one per variable (plus the loss)
    assert {canonical_device(op.device) for op in reductions} == {param}
