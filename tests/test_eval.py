"""Held-out evaluation: every example once over N towers, and `python -m tower_train.eval`.

The command's results are checked against weights restored here independently
(the model from the checkpoint, the moving averages read by name), evaluated by
`evaluate()` with the command's batches and towers, and by a plain one-device pass.
"""
import importlib
import logging
import os
import re
import shutil
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import tower_train
import tower_train.models as models
from tower_train.data import catalog
from tower_train.data import image_sets
from tower_train.training.run_record import TrainDirLock
from tower_train.errors import UsageError
from tower_train.training.evaluation.held_out import check_metrics, evaluate, make_metrics, shard_bounds, shard_pass
from test_cli_errors import ROOT, run_cli

TOWERS = ("/cpu:1", "/cpu:2", "/cpu:3")  # conftest made /cpu:0..8
# A fresh cifar10_cnn predicts one class for (nearly) every image for its first updates, so its
# precision cannot tell two sets of weights apart. This linear model learns visibly in 2 plain-SGD
# updates, and its moving average (decay (1 + t) / (10 + t) early on) predicts differently.
LINEAR_MODULE = '''
import keras
import tower_train.models as models


@models.register("eval_test_linear")
class Linear(models.TowerModel):
    def __init__(self, num_classes, **kwargs):
        super().__init__(num_classes, **kwargs)
        self.flatten = keras.layers.Flatten()
        self.logits = keras.layers.Dense(num_classes)

    def call(self, images, training=False):
        return self.logits(self.flatten(images))
'''
MODEL = ["--model_module=eval_test_models", "--model=eval_test_linear"]
TRAIN = [*MODEL, "--max_steps=2", "--batch_size=8", "--num_gpus=2", "--optimizer=sgd",
         "--learning_rate=0.1", "--log_every=100"]
# 3 towers and 999 per batch: batches of 999, 999 and 2, so the last one leaves a tower empty.
EVAL = [*MODEL, "--num_gpus=3", "--eval_batch_size=999"]
LINE = re.compile(r"precision @ 1 = (\d\.\d{4}), loss = (\d+\.\d{4}) \((\d+) examples\)")


# ------------------------------------------------------------------------------------------------
# evaluate(): every example exactly once, whatever the batch and the number of towers


class SpyModel:
    """Linear logits, and a count of how often each example id was seen (in a variable, so the
    count is kept inside the compiled function). Example i carries its id as the brightest
    pixel of row i, column 0, channel 0 of the central crop."""

    def __init__(self, examples):
        rng = np.random.default_rng(1)
        with tf.device("/cpu:0"):
            self.kernel = tf.constant(rng.normal(size=(24 * 24 * 3, 10)), tf.float32)
            self.seen = tf.Variable(tf.zeros([examples], tf.int64))
        self.examples = examples

    def logits(self, images):
        return tf.reshape(images, [-1, 24 * 24 * 3]) @ self.kernel

    def __call__(self, images, training=False):
        ids = tf.argmax(images[:, :, 0, 0], axis=1, output_type=tf.int32)
        self.seen.assign_add(tf.math.bincount(ids, minlength=self.examples, maxlength=self.examples,
                                              dtype=tf.int64))
        return self.logits(images)

    def per_example_loss(self, labels, logits):
        return tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)

    def update_regularization(self):
        return tf.constant(0.0)

    def batch_loss(self):
        return tf.constant(0.0)


def small_source(examples=10):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 100, (examples, 32, 32, 3), dtype=np.uint8)
    for i in range(examples):
        images[i, 4 + i, 4, 0] = 255  # row i, column 0 of the central 24x24 crop
    return images


@pytest.mark.parametrize("batch_size", [7, 1, 2000])
def test_evaluate_counts_every_example_once_over_three_towers(batch_size):
    images = small_source()
    model = SpyModel(len(images))
    with tf.device("/cpu:0"):  # the plain reference: one device, one batch
        predicted = np.argmax(model.logits(image_sets.center_standardize(images)).numpy(), axis=-1)
    right = np.array([0, 2, 3, 5, 8])  # these examples get their predicted class as label
    labels = np.where(np.isin(np.arange(10), right), predicted, (predicted + 1) % 10).astype(np.int32)
    source = image_sets.image_source("small", images[:1], labels[:1], images, labels)

    evaluation = evaluate(model, source, batch_size, TOWERS)

    assert evaluation.examples == 10
    assert evaluation.precision == np.mean(predicted == labels) == 0.5
    np.testing.assert_array_equal(model.seen.numpy(), np.ones(10))  # each example once, none lost


def test_a_models_later_evaluations_reuse_its_traced_pass(monkeypatch):
    """Tracing the pass (and, on a GPU, its first convolutions) takes seconds: only a model's first
    evaluation on a set of devices pays it, whatever the number of evaluations."""
    from tower_train.training.evaluation import held_out as evaluation_module

    traced = []
    shard_pass_of = evaluation_module.shard_pass
    monkeypatch.setattr(evaluation_module, "shard_pass",
                        lambda *args, **kwargs: traced.append(args) or shard_pass_of(*args, **kwargs))
    images = small_source()
    source = image_sets.image_source("small", images[:1], np.zeros(1, np.int32), images, np.zeros(10, np.int32))
    model, other = SpyModel(len(images)), SpyModel(len(images))
    first = evaluate(model, source, 5, TOWERS)
    assert evaluate(model, source, 5, TOWERS) == first
    evaluate(model, source, 5, TOWERS[:2])
    evaluate(other, source, 5, TOWERS)
    assert [(m is model, devices) for m, devices in traced] == [
        (True, TOWERS), (True, TOWERS[:2]), (False, TOWERS)]


def test_shards_are_contiguous_cover_the_batch_and_differ_by_at_most_one():
    for batch in range(0, 25):
        for towers in range(1, 6):
            bounds = shard_bounds(batch, towers)
            sizes = [end - start for start, end in bounds]
            assert bounds[0][0] == 0 and bounds[-1][1] == batch
            assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
            assert max(sizes) - min(sizes) <= 1


def test_each_shard_runs_on_its_own_tower():
    model = SpyModel(10)
    run_shards = shard_pass(model, TOWERS)
    images = image_sets.center_standardize(small_source())
    graph = run_shards.get_concrete_function(images, tf.zeros([10], tf.int32), tf.ones([10])).graph
    placed = {tf.DeviceSpec.from_string(op.device).device_index for op in graph.get_operations()
              if op.type in ("If", "StatelessIf")}
    assert placed == {1, 2, 3}


class Regularized(models.TowerModel):
    """Linear logits over 12 classes, with a regularization (and an `activity` regularizer on them,
    which Keras divides by the batch size)."""

    def __init__(self, num_classes=12, activity=None, **kwargs):
        super().__init__(num_classes, **kwargs)
        self.dense = keras.layers.Dense(num_classes, activity_regularizer=activity)

    def call(self, features, training=False):
        return self.dense(features)

    def regularization(self):
        return 0.01 * models.l2_loss(self.dense.kernel)


def test_held_out_loss_and_top_5_equal_numpy_over_the_whole_set_with_three_towers():
    rng = np.random.default_rng(3)
    x, y = rng.normal(size=(17, 5)).astype(np.float32), rng.integers(0, 12, 17)
    w = rng.uniform(0.5, 2.0, 17).astype(np.float32)
    w[[2, 9, 16]] = 0  # 16 is alone in the last batch
    source = tower_train.ArraySource(x[:1], y[:1], eval_features=x, eval_labels=y, eval_weights=w,
                                     num_classes=12)
    with tf.device("/cpu:0"):
        model = Regularized()
        model(x[:1])
    # Weights of the test's own, so that the weighted and unweighted values below differ surely.
    model.dense.kernel.assign(rng.normal(size=(5, 12)))
    model.dense.bias.assign(rng.normal(size=12) * 0.1)
    top5, top2 = make_metrics(check_metrics([
        "sparse_top_k_categorical_accuracy",
        keras.metrics.SparseTopKCategoricalAccuracy(k=2, name="top2")]))

    # Batches of 8, 8 and 1 over 3 towers: shards of 2, 3, 3 and of 0, 0, 1 examples.
    first = evaluate(model, source, 8, TOWERS, [top5, top2])
    again = evaluate(model, source, 8, TOWERS, [top5, top2])  # reset, not added to the first

    kernel, bias = (v.numpy().astype(np.float64) for v in (model.dense.kernel, model.dense.bias))
    logits = x.astype(np.float64) @ kernel + bias
    shifted = logits - logits.max(1, keepdims=True)
    cross_entropy = np.log(np.exp(shifted).sum(1)) - shifted[np.arange(17), y]
    above = (logits > logits[np.arange(17), y][:, None]).sum(1)  # classes scored above the label
    weighted = lambda values: np.sum(w * values) / np.sum(w)  # noqa: E731
    assert first == again and first.examples == 17
    assert first.loss == pytest.approx(weighted(cross_entropy) + 0.01 * np.sum(kernel ** 2) / 2,
                                       rel=1e-6)
    assert first.precision == pytest.approx(weighted(above == 0), rel=1e-6)
    assert first.metrics == pytest.approx({"sparse_top_k_categorical_accuracy": weighted(above < 5),
                                           "top2": weighted(above < 2)}, rel=1e-6)
    # The same metrics run by plain Keras on the whole set in one call, on one device.
    for name, k in (("sparse_top_k_categorical_accuracy", 5), ("top2", 2)):
        plain = keras.metrics.SparseTopKCategoricalAccuracy(k=k)
        plain.update_state(y, model(x), sample_weight=w)
        assert first.metrics[name] == pytest.approx(float(plain.result()), rel=1e-6)
    # The weights count: unweighted means differ.
    assert abs(weighted(above < 5) - np.mean(above < 5)) > 0.01
    assert abs(weighted(cross_entropy) - np.mean(cross_entropy)) > 0.01


def test_the_held_out_loss_adds_the_calls_keras_losses_as_their_mean_over_every_example():
    """Batches of 8, 8 and 1 over 3 towers: a mean of the shards' or batches' means would differ."""
    rng = np.random.default_rng(5)
    x, y = rng.normal(size=(17, 5)).astype(np.float32), rng.integers(0, 12, 17)
    w = rng.uniform(0.5, 2.0, 17).astype(np.float32)
    source = tower_train.ArraySource(x[:1], y[:1], eval_features=x, eval_labels=y, eval_weights=w,
                                     num_classes=12)
    with tf.device("/cpu:0"):
        model = Regularized(activity=keras.regularizers.L2(0.3))
        model(x[:1])
    model.dense.kernel.assign(rng.normal(size=(5, 12)))
    got = evaluate(model, source, 8, TOWERS)

    kernel, bias = (v.numpy().astype(np.float64) for v in (model.dense.kernel, model.dense.bias))
    logits = x.astype(np.float64) @ kernel + bias
    shifted = logits - logits.max(1, keepdims=True)
    cross_entropy = np.log(np.exp(shifted).sum(1)) - shifted[np.arange(17), y]
    activity = 0.3 * np.mean(np.sum(logits ** 2, axis=1))
    assert got.loss == pytest.approx(np.sum(w * cross_entropy) / np.sum(w) + 0.01 * np.sum(kernel ** 2) / 2
                                     + activity, rel=1e-6)


def test_check_metrics_makes_no_metric_so_fit_can_still_split_the_devices(tmp_path):
    """A metric made eagerly starts TensorFlow's runtime, after which a fresh process can no
    longer be split into towers: checking the names must make none."""
    script = tmp_path / "check_then_split.py"
    script.write_text(
        "import tensorflow as tf\n"
        "from tower_train.training.evaluation.held_out import check_metrics\n"
        "checked = check_metrics(['sparse_top_k_categorical_accuracy', 'mse'])\n"
        "assert checked == ['sparse_top_k_categorical_accuracy', 'mse'], checked\n"
        "cpu = tf.config.list_physical_devices('CPU')[0]\n"
        "tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 3)\n"
        "assert len(tf.config.list_logical_devices('CPU')) == 3\n")
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr


# ------------------------------------------------------------------------------------------------
# python -m tower_train.eval

# (name, needs the trained checkpoint, flags, text the error must contain); {run} is the trained
# train_dir, {tmp} a scratch directory of the case holding an empty directory and a bad checkpoint.
BAD = [
    ("empty train_dir", False, ["--train_dir={tmp}/empty"], "--train_dir={tmp}/empty: holds no checkpoint"),
    ("missing train_dir", False, ["--train_dir={tmp}/missing"], "--train_dir={tmp}/missing: does not exist"),
    ("missing checkpoint", False, ["--checkpoint={tmp}/empty/ckpt-7"],
     "--checkpoint={tmp}/empty/ckpt-7: no such checkpoint"),
    ("unreadable checkpoint", False, ["--checkpoint={tmp}/garbage/ckpt-2"],
     "--checkpoint={tmp}/garbage/ckpt-2: checkpoint {tmp}/garbage/ckpt-2 is unreadable"),
    ("unknown model", False, ["--checkpoint={tmp}/garbage/ckpt-2", "--model=no_such_net"],
     "--model=no_such_net: unknown; registered: "),
    ("other model, run record", True, ["--train_dir={run}"],
     "--train_dir={run}: its checkpoints are of --model=eval_test_linear "
     "(says {run}/tower_train_run.json), not --model=cifar10_cnn"),
    ("other model, shapes", True, ["--checkpoint={tmp}/copy/ckpt-2"],
     "--checkpoint={tmp}/copy/ckpt-2: checkpoint {tmp}/copy/ckpt-2 does not fit --model=cifar10_cnn"),
]


def start_eval(*args, cwd=ROOT):
    env = {**{k: v for k, v in os.environ.items() if k != "TF_CONFIG"},
           "PYTHONPATH": os.pathsep.join([ROOT, str(cwd)]),
           "PYTHONDONTWRITEBYTECODE": "1"}  # nothing written next to the model module
    return subprocess.Popen([sys.executable, "-m", "tower_train.eval", *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(process):
    stdout, stderr = process.communicate(timeout=300)
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def snapshot(directory):
    """Every file under `directory`, with its size and modification time."""
    return sorted((os.path.relpath(os.path.join(d, f), directory),
                   os.stat(os.path.join(d, f)).st_size, os.stat(os.path.join(d, f)).st_mtime_ns)
                  for d, _, files in os.walk(directory) for f in files)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A directory holding the linear model's module; the commands run there."""
    directory = tmp_path_factory.mktemp("eval")
    (directory / "eval_test_models.py").write_text(LINEAR_MODULE)
    if "eval_test_linear" not in models.model_names():
        sys.path.insert(0, str(directory))
        try:
            importlib.import_module("eval_test_models")
        finally:
            sys.path.remove(str(directory))
    return directory


def start_bad(name, args, workspace, train_dir):
    """Starts one bad-input case in a scratch directory of its own (the default --model,
    cifar10_cnn); returns (process, scratch directory, its files before)."""
    tmp = workspace / name.replace(" ", "_").replace(",", "")
    (tmp / "empty").mkdir(parents=True)
    (tmp / "garbage").mkdir()
    (tmp / "garbage" / "ckpt-2.index").write_bytes(b"not a checkpoint index")
    if os.path.exists(train_dir / "ckpt-2.index"):  # a copy without the run record
        (tmp / "copy").mkdir()
        for f in ("ckpt-2.index", "ckpt-2.data-00000-of-00001"):
            shutil.copy(train_dir / f, tmp / "copy" / f)
    before = snapshot(tmp)
    return start_eval(*(a.format(run=train_dir, tmp=tmp) for a in args), cwd=tmp), tmp, before


@pytest.fixture(scope="module")
def runs(workspace):
    """One 2-update training run of the linear model (it keeps a moving average: the default
    --ema_decay), and meanwhile the bad inputs that do not need it; then, all at once (they are
    independent processes), the command with its default weights, with --nouse_ema, and the
    bad inputs that need the checkpoint, and the command on a copy of the train_dir whose index
    file `checkpoint` is emptied. Returns the train_dir and
    {name: (result, scratch directory or None, its files before)}."""
    train_dir = workspace / "run"
    started = {name: start_bad(name, args, workspace, train_dir)
               for name, needs_run, args, _ in BAD if not needs_run}
    result = run_cli(*TRAIN, f"--train_dir={train_dir}", cwd=workspace,
                     env={"PYTHONPATH": os.pathsep.join([ROOT, str(workspace)]),
                          "PYTHONDONTWRITEBYTECODE": "1"})
    assert result.returncode == 0, result.stderr
    emptied = workspace / "emptied_index"
    shutil.copytree(train_dir, emptied)
    (emptied / "checkpoint").write_text("")
    # As if a run were training there: evaluation takes no lock, so the train_dir's lock is no bar.
    with TrainDirLock(str(train_dir)):
        before = snapshot(train_dir)
        started["ema"] = start_eval(*EVAL, f"--train_dir={train_dir}", cwd=workspace), None, None
        started["emptied index"] = start_eval(*EVAL, f"--train_dir={emptied}", cwd=workspace), None, None
        started["trained"] = start_eval(*EVAL, f"--checkpoint={train_dir / 'ckpt-2'}", "--nouse_ema",
                                        cwd=workspace), None, None
        started.update({name: start_bad(name, args, workspace, train_dir)
                        for name, needs_run, args, _ in BAD if needs_run})
        results = {name: (finish(p), tmp, files) for name, (p, tmp, files) in started.items()}
        assert snapshot(train_dir) == before  # evaluating, even refused, writes nothing there
    return train_dir, results


def restore_independently(path, moving_average):
    """The linear model with the checkpoint's weights, or with its moving averages read by name."""
    with tf.device("/cpu:0"):
        model = models.model_class("eval_test_linear")(num_classes=10)
        model(tf.zeros([1, 24, 24, 3]))
    tf.train.Checkpoint(model=model).restore(path).expect_partial().assert_existing_objects_matched()
    if moving_average:
        for i, weight in enumerate(model.trainable_variables):
            weight.assign(tf.train.load_variable(path, f"moving_average/averages/{i}/.ATTRIBUTES/VARIABLE_VALUE"))
    return model


def plain_correct(model, source):
    """Correct predictions over the held-out split: numpy preprocessing, one device, one batch."""
    crop = source.eval_features[:, 4:28, 4:28, :].astype(np.float64)
    mean = crop.mean(axis=(1, 2, 3), keepdims=True)
    std = np.maximum(crop.std(axis=(1, 2, 3), keepdims=True), 1 / np.sqrt(24 * 24 * 3))
    with tf.device("/cpu:0"):
        logits = model(tf.constant((crop - mean) / std, tf.float32)).numpy()
    return int(np.sum(np.argmax(logits, -1) == source.eval_labels))


def printed(result):
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 1 and LINE.fullmatch(lines[0]), result.stdout
    precision, loss, count = LINE.fullmatch(lines[0]).groups()
    return float(precision), float(loss), int(count)


@pytest.mark.cpu_only  # the command's towers are the /cpu:1..3 it is checked against here
@pytest.mark.parametrize("weights", ["ema", "trained"])
def test_eval_prints_the_precision_of_the_restored_weights(runs, weights):
    train_dir, results = runs
    result = results[weights][0]
    precision, loss, count = printed(result)
    assert count == 2000  # the synthetic held-out split
    source = catalog.load_source("synthetic", None)
    model = restore_independently(str(train_dir / "ckpt-2"), moving_average=weights == "ema")

    expected = evaluate(model, source, 999, TOWERS)
    assert (precision, loss, count) == (round(expected.precision, 4), round(expected.loss, 4),
                                        expected.examples)
    assert abs(plain_correct(model, source) - precision * 2000) <= 1  # float order: at most a tie
    said = "the moving average of the weights" if weights == "ema" else "the trained weights"
    assert f"evaluating {said} in {train_dir / 'ckpt-2'}" in result.stderr
    assert "split the CPU into 4 logical devices, host /cpu:0, towers on /cpu:1../cpu:3" in result.stderr


def test_use_ema_and_nouse_ema_evaluate_different_weights(runs):
    _, results = runs
    assert printed(results["ema"][0])[0] != printed(results["trained"][0])[0]


def test_eval_finds_the_latest_checkpoint_from_its_files_when_the_index_is_emptied(runs):
    _, results = runs
    assert printed(results["emptied index"][0]) == printed(results["ema"][0])


@pytest.mark.parametrize("name,expected", [(b[0], b[3]) for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_is_one_line_and_writes_nothing(runs, name, expected):
    train_dir, results = runs
    result, tmp, before = results[name]
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("tower_train: error: ")
    assert expected.format(run=train_dir, tmp=tmp) in lines[0]
    assert "Traceback" not in result.stderr and result.stdout == ""
    assert snapshot(tmp) == before


def test_a_damaged_data_file_or_another_network_is_refused_in_one_line(runs):
    """The checks after the cheap ones, called in this process."""
    from tower_train.training.evaluation import checkpoint as eval_checkpoint

    train_dir, _ = runs
    copy = train_dir.parent / "damaged"
    copy.mkdir()
    for f in ("ckpt-2.index", "ckpt-2.data-00000-of-00001"):
        shutil.copy(train_dir / f, copy / f)
    info = eval_checkpoint.find_checkpoint(str(copy / "ckpt-2"), "/unused")
    assert info.has_moving_average
    # cifar10_cnn has none of the linear model's names: the restore's own match refuses it.
    with pytest.raises(UsageError, match="does not hold the weights of --model=cifar10_cnn"):
        with tf.device("/cpu:0"):
            cnn = models.model_class("cifar10_cnn")(num_classes=10)
            cnn(tf.zeros([1, 24, 24, 3]))
        eval_checkpoint.restore_for_evaluation(info, {"model": cnn}, "cifar10_cnn")
    with open(copy / "ckpt-2.data-00000-of-00001", "r+b") as f:
        f.truncate(1000)
    with pytest.raises(UsageError, match=f"--checkpoint={copy / 'ckpt-2'}: checkpoint .* is unreadable"):
        eval_checkpoint.find_checkpoint(str(copy / "ckpt-2"), "/unused")


def small_keras_classifier():
    import keras

    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(4)])


# The weights of a Keras model are stored under the optimizer's path in a checkpoint, not the
# model's: the eval command once refused such a checkpoint as holding no model.
models.register("eval_test_keras", loss="sparse_categorical_crossentropy")(small_keras_classifier)


@pytest.mark.parametrize("use_ema", [False, True])
@pytest.mark.parametrize("given", ["registered", "callable"])
def test_a_keras_models_checkpoint_is_evaluated_with_its_weights_or_their_moving_average(
        tmp_path, use_ema, given):
    import tower_train
    from tower_train.eval import evaluate_checkpoint

    rng = np.random.default_rng(3)
    x, held_x = (rng.normal(size=(n, 5)).astype(np.float32) for n in (64, 50))
    y, held_y = (np.argmax(a[:, :4], axis=1) for a in (x, held_x))
    source = tower_train.ArraySource(x, y, eval_features=held_x, eval_labels=held_y)
    options = dict(num_gpus=2, batch_size=8, optimizer="sgd", learning_rate=0.5, ema_decay=0.5,
                   train_dir=tmp_path / "run")
    tower_train.fit(model="eval_test_keras", data=source, max_steps=3, **options)
    model = (dict(model="eval_test_keras") if given == "registered" else
             dict(model=small_keras_classifier, loss="sparse_categorical_crossentropy"))
    top2 = keras.metrics.SparseTopKCategoricalAccuracy(k=2, name="top2")
    evaluation = evaluate_checkpoint(data=source, use_ema=use_ema, metrics=[top2], **model,
                                     **options)
    reader = tf.train.load_checkpoint(str(tmp_path / "run" / "ckpt-3"))
    names = ([f"moving_average/averages/{i}/.ATTRIBUTES/VARIABLE_VALUE" for i in range(2)] if use_ema
             else [f"optimizer/_trainable_variables/{i}/.ATTRIBUTES/VARIABLE_VALUE" for i in range(2)])
    kernel, bias = (reader.get_tensor(name) for name in names)
    logits = held_x @ kernel + bias
    above = (logits > logits[np.arange(50), held_y][:, None]).sum(1)  # classes scored above the label
    assert evaluation.examples == 50
    assert evaluation.precision == pytest.approx(np.mean(above == 0), abs=1e-9)
    assert evaluation.metrics == {"top2": pytest.approx(np.mean(above < 2), abs=1e-6)}
    assert 0 < np.mean(above == 0) < np.mean(above < 2)  # top-2 is not top-1


def test_a_checkpoint_rotated_away_while_the_model_is_built_is_followed_by_the_latest_or_one_line(
        tmp_path, monkeypatch, caplog):
    """As `python -m tower_train.eval` on a train_dir that a run writes: the picked checkpoint's
    files are deleted (by the run's rotation) between the pick and the restore."""
    import tower_train
    from tower_train import model_spec
    from tower_train.eval import evaluate_checkpoint

    rng = np.random.default_rng(4)
    x, held_x = (rng.normal(size=(n, 5)).astype(np.float32) for n in (64, 50))
    y, held_y = (np.argmax(a[:, :4], axis=1) for a in (x, held_x))
    source = tower_train.ArraySource(x, y, eval_features=held_x, eval_labels=held_y)
    options = dict(model="eval_test_keras", data=source, num_gpus=2, batch_size=8, optimizer="sgd",
                   learning_rate=0.5, ema_decay=0.0, train_dir=tmp_path / "run")
    tower_train.fit(max_steps=3, checkpoint_every=1, **options)
    at_2 = evaluate_checkpoint(checkpoint=str(tmp_path / "run" / "ckpt-2"), **options)
    at_3 = evaluate_checkpoint(**options)
    assert at_2.loss != at_3.loss
    real_build = model_spec.build_model
    saved = tmp_path / "saved"
    saved.mkdir()
    for path in (tmp_path / "run").glob("ckpt-3.*"):
        shutil.copy(path, saved)

    def build_then_rotate(*args, **kwargs):
        model = real_build(*args, **kwargs)
        for path in (tmp_path / "run").glob("ckpt-3.*"):
            path.unlink()
        return model

    monkeypatch.setattr(model_spec, "build_model", build_then_rotate)
    with pytest.raises(UsageError) as error:
        evaluate_checkpoint(checkpoint=str(tmp_path / "run" / "ckpt-3"), **options)
    assert str(error.value) == (f"--checkpoint={tmp_path}/run/ckpt-3: checkpoint {tmp_path}/run/ckpt-3 was removed "
                                "while it was read (by the rotation of a run writing there?); name a newer one, or "
                                "evaluate the directory's latest")
    for path in saved.iterdir():  # ckpt-3 back, the latest again
        shutil.copy(path, tmp_path / "run")
    with caplog.at_level(logging.INFO, logger="absl"):
        followed = evaluate_checkpoint(**options)
    assert (followed.loss, followed.precision) == (at_2.loss, at_2.precision)
    assert f"{tmp_path}/run/ckpt-3 was removed while the model was built: evaluating {tmp_path}/run/ckpt-2, now " \
           "the latest" in caplog.text


def test_evaluate_checkpoint_takes_the_data_forms_fit_takes(tmp_path):
    """Arrays given alone are the held-out set; beside eval_data=, eval_data is (as in fit); a
    source's held-out set otherwise. Each gives the precision and loss computed here with numpy
    from the checkpoint's weights, weighted by w where (x, y, w) is given."""
    from tower_train.eval import evaluate_checkpoint

    rng = np.random.default_rng(5)
    x, held_x = (rng.normal(size=(n, 5)).astype(np.float32) for n in (64, 40))
    y, held_y = (np.argmax(a[:, :4], axis=1) for a in (x, held_x))
    w = rng.uniform(0.5, 2.0, size=40).astype(np.float32)
    options = dict(model=small_keras_classifier,
                   loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), num_gpus=2,
                   batch_size=8, optimizer="sgd", learning_rate=0.5, ema_decay=0.0,
                   train_dir=tmp_path / "run")
    tower_train.fit(data=(x, y), eval_data=(held_x, held_y), max_steps=2, **options)
    source = tower_train.ArraySource(x, y, eval_features=held_x, eval_labels=held_y)
    alone = evaluate_checkpoint(data=(held_x, held_y), **options)
    assert evaluate_checkpoint(data=(x, y), eval_data=(held_x, held_y), **options) == alone
    assert evaluate_checkpoint(data=source, **options) == alone
    weighted = evaluate_checkpoint(data=(held_x, held_y, w), **options)
    reader = tf.train.load_checkpoint(str(tmp_path / "run" / "ckpt-2"))
    kernel, bias = (reader.get_tensor(f"optimizer/_trainable_variables/{i}/.ATTRIBUTES/VARIABLE_VALUE")
                    for i in range(2))
    logits = (held_x @ kernel + bias).astype(np.float64)
    losses = np.log(np.exp(logits).sum(1)) - logits[np.arange(40), held_y]
    correct = np.argmax(logits, 1) == held_y
    assert (alone.examples, weighted.examples) == (40, 40)
    assert alone.precision == pytest.approx(correct.mean(), abs=1e-9)
    assert alone.loss == pytest.approx(losses.mean(), rel=1e-5)
    assert weighted.precision == pytest.approx((w * correct).sum() / w.sum(), rel=1e-6)
    assert weighted.loss == pytest.approx((w * losses).sum() / w.sum(), rel=1e-5)
    assert weighted.loss != pytest.approx(alone.loss, rel=1e-5)  # the weights count


@pytest.mark.parametrize("option, message", [
    ("shuffles", "evaluate_checkpoint(): unknown option 'shuffles'; the options are the flags' names"),
    ("validation_data", "evaluate_checkpoint(): validation_data= is Keras's Model.fit argument, not an "
                        "option of tower_train.evaluate_checkpoint (eval_data=(x, y))"),
])
def test_an_unknown_option_of_evaluate_checkpoint_is_named_as_its_own(option, message):
    from tower_train.eval import evaluate_checkpoint

    with pytest.raises(UsageError) as error:
        evaluate_checkpoint(train_dir="/unused", **{option: 1})
    assert str(error.value).startswith(message)
