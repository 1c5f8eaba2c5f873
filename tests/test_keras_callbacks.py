"""Keras callbacks given to `tower_train.fit(callbacks=[...])` (tower_train/training/keras_callbacks.py): what
they hear and when, a stop by `model.stop_training` at an update boundary that resumes bit for
bit, a callback's error, TerminateOnNaN beside the non-finite policy, and bad input."""
import csv
import glob
import logging
import math

from pathlib import Path
from types import SimpleNamespace

import keras
import numpy as np
import pytest
import tensorflow as tf

import tower_train
from tower_train.training.keras_callbacks import KerasCallbacks

CLASSES, FEATURES, EXAMPLES = 3, 6, 48
LR = 0.1


def arrays(n=EXAMPLES, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, FEATURES)).astype(np.float32), rng.integers(0, CLASSES, n)


_rng = np.random.default_rng(2)
INITIAL = [_rng.normal(size=(FEATURES, 8)).astype(np.float32) * 0.5, np.zeros(8, np.float32),
           _rng.normal(size=(8, CLASSES)).astype(np.float32) * 0.5, np.zeros(CLASSES, np.float32)]


def network() -> keras.Sequential:
    """The same weights (INITIAL) every time, made wherever fit makes it."""
    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(8, activation="tanh"),
                              keras.layers.Dense(CLASSES)])
    model.set_weights(INITIAL)
    return model


def run(train_dir, features=None, **options):
    """fit on 2 towers x 4 examples (G = 8), in order, SGD at a constant rate LR."""
    x, y = arrays()
    options = {**dict(max_steps=4, ema_decay=0.0, optimizer="sgd", learning_rate=LR,
                      lr_schedule="constant", warmup_steps=0, scale_lr=False), **options}
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    return tower_train.fit(model=network, loss=loss,
                           data=(x if features is None else features, y), shuffle=False,
                           num_gpus=2, batch_size=4, train_dir=train_dir, **options)


class Recorder(keras.callbacks.Callback):
    """A user's own callback: every call, its index and its logs, in order."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def on_train_begin(self, logs=None):
        self.calls.append(("train_begin",))

    def on_train_batch_begin(self, batch, logs=None):
        self.calls.append(("batch_begin", batch))

    def on_train_batch_end(self, batch, logs=None):
        self.calls.append(("batch_end", batch, dict(logs)))

    def on_epoch_end(self, epoch, logs=None):
        self.calls.append(("epoch_end", epoch, dict(logs)))

    def on_train_end(self, logs=None):
        self.calls.append(("train_end",))

    def indices(self, kind):
        return [call[1] for call in self.calls if call[0] == kind]


class StopsAt(keras.callbacks.Callback):
    """Asks to stop after update `step`."""

    def __init__(self, step):
        super().__init__()
        self.step = step

    def on_train_batch_end(self, batch, logs=None):
        if batch == self.step:
            self.model.stop_training = True


class AlsoStopsAt(StopsAt):
    pass


def test_keras_callbacks_tell_each_update_and_evaluation_as_keras_logs_and_name_the_first_stop():
    """Updates 3 and 4 of a resumed run with an evaluation after each; the Controller's calls
    of its hook made here by hand."""
    model, recorder = network(), Recorder()
    model.stop_training = True  # left by an earlier run: training begins without it
    told = KerasCallbacks(callbacks=[recorder, StopsAt(4), AlsoStopsAt(4)], model=model)
    assert recorder.model is model and told.user_code
    told.train_begin()
    assert told.stop_asked() is None
    state = SimpleNamespace(optimizer=keras.optimizers.SGD(0.25))
    for step, loss, precision, held_out_loss in ((3, 0.5, 0.5, 1.25), (4, 0.375, 0.75, 1.0)):
        told.update_begin(step)
        assert told.after_update(SimpleNamespace(step=step, loss=loss, state=state)) is None
        held_out = {"val_precision": precision, "val_loss": held_out_loss}
        told.after_evaluation(step, held_out)
        assert told.stop_asked() == ("callback StopsAt.on_train_batch_end" if step == 4 else None)
    told.train_end()
    assert recorder.calls == [
        ("train_begin",),
        ("batch_begin", 3), ("batch_end", 3, {"loss": 0.5, "learning_rate": 0.25}),
        ("epoch_end", 3, {"val_precision": 0.5, "val_loss": 1.25}),
        ("batch_begin", 4), ("batch_end", 4, {"loss": 0.375, "learning_rate": 0.25}),
        ("epoch_end", 4, {"val_precision": 0.75, "val_loss": 1.0}),
        ("train_end",)]
    assert told.weights_written_by is None


class Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture(scope="module")
def heard(tmp_path_factory):
    """One run of 4 updates, held-out data (20 examples, in batches of 7) evaluated after update
    2 and at the end with a top-2 metric, with a Recorder and a CSVLogger; and its log lines."""
    directory = tmp_path_factory.mktemp("heard")
    recorder, csv_path = Recorder(), directory / "log.csv"
    held_x, held_y = arrays(n=20, seed=1)
    # absl's own logger, at INFO here: an earlier test in the process may have left it at WARNING.
    absl, lines = logging.getLogger("absl"), Lines()
    level = absl.level
    absl.setLevel(logging.INFO)
    absl.addHandler(lines)
    try:
        result = run(directory / "run", eval_data=(held_x, held_y), eval_every=2, log_every=1,
                     eval_batch_size=7,
                     metrics=[keras.metrics.SparseTopKCategoricalAccuracy(k=2, name="top2")],
                     callbacks=[recorder, keras.callbacks.CSVLogger(str(csv_path))])
    finally:
        absl.removeHandler(lines)
        absl.setLevel(level)
    return result, recorder, csv_path, (held_x, held_y), lines.lines


def test_a_users_callback_hears_every_update_and_evaluation_in_order(heard):
    result, recorder, _, (held_x, held_y), _ = heard
    kinds = [(call[0], *call[1:2]) for call in recorder.calls]
    assert kinds == [("train_begin",),
                     ("batch_begin", 1), ("batch_end", 1), ("batch_begin", 2), ("batch_end", 2),
                     ("epoch_end", 2),
                     ("batch_begin", 3), ("batch_end", 3), ("batch_begin", 4), ("batch_end", 4),
                     ("epoch_end", 4), ("train_end",)]
    ends = [call[2] for call in recorder.calls if call[0] == "batch_end"]
    assert [logs["loss"] for logs in ends] == result.history["loss"]
    assert [logs["learning_rate"] for logs in ends] == [pytest.approx(LR)] * 4
    # The first update's loss: the initial weights' mean cross-entropy on examples 0..7.
    x, y = arrays()
    kernel, bias, out_kernel, out_bias = INITIAL
    logits = np.tanh(x[:8] @ kernel + bias) @ out_kernel + out_bias
    log_softmax = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    assert ends[0]["loss"] == pytest.approx(-np.mean(log_softmax[np.arange(8), y[:8]]), rel=1e-5)
    epochs = [call[2] for call in recorder.calls if call[0] == "epoch_end"]
    assert [set(logs) for logs in epochs] == [{"val_precision", "val_loss", "val_top2"}] * 2
    for name in ("val_precision", "val_loss", "val_top2"):
        assert [logs[name] for logs in epochs] == result.history[name]
    # The last one is the trained network's over the held-out set, computed here.
    predicted = result.model.predict(held_x, verbose=0).argmax(1)
    assert epochs[-1]["val_precision"] == pytest.approx(np.mean(predicted == held_y))
    # The callback was given the network that TrainResult.model is (a callable's model).
    assert recorder.model is result.model


def test_csv_logger_writes_a_row_per_held_out_evaluation(heard):
    """Keras's CSVLogger writes at on_epoch_end: here, one row per evaluation, at its update."""
    result, _, csv_path, _, _ = heard
    with open(csv_path, newline="") as file:
        rows = list(csv.DictReader(file))
    assert [int(row["epoch"]) for row in rows] == result.history["val_step"] == [2, 4]
    assert set(rows[0]) == {"epoch", "val_precision", "val_loss", "val_top2"}
    assert [float(row["val_precision"]) for row in rows] == pytest.approx(
        result.history["val_precision"])


def test_held_out_loss_and_metrics_reach_the_log_tensorboard_and_the_result(heard):
    """Against numpy over the trained network's weights: the loss is the held-out mean
    cross-entropy, top2 the fraction whose label scores among the 2 highest."""
    result, _, _, (held_x, held_y), lines = heard
    kernel, bias, out_kernel, out_bias = (np.asarray(w, np.float64) for w in result.model.get_weights())
    logits = np.tanh(held_x @ kernel + bias) @ out_kernel + out_bias
    shifted = logits - logits.max(1, keepdims=True)
    cross_entropy = np.log(np.exp(shifted).sum(1)) - shifted[np.arange(20), held_y]
    above = (logits > logits[np.arange(20), held_y][:, None]).sum(1)
    assert result.eval_loss == result.history["val_loss"][-1] == pytest.approx(np.mean(cross_entropy),
                                                                               rel=1e-5)
    assert result.eval_metrics == {"top2": result.history["val_top2"][-1]}
    assert result.eval_metrics["top2"] == pytest.approx(np.mean(above < 2))
    assert result.eval_precision == pytest.approx(np.mean(above == 0))
    assert 0 < result.eval_precision < result.eval_metrics["top2"] < 1  # top-2 is not top-1
    assert result.eval_examples == 20
    step_2 = "step 2, held-out precision @ 1 = {:.4f}, loss = {:.4f}, top2 = {:.4f} (20 examples, ".format(
        *(result.history[name][0] for name in ("val_precision", "val_loss", "val_top2")))
    assert [line for line in lines if line.startswith(step_2)], lines
    done = (f"done: step 4, loss = {result.loss:.4f}; held-out precision @ 1 = "
            f"{result.eval_precision:.4f}, loss = {result.eval_loss:.4f}, top2 = "
            f"{result.eval_metrics['top2']:.4f} (20 examples)")
    assert done in lines, lines
    train_dir = Path(result.checkpoint).parent
    scalars = {}
    for path in glob.glob(str(train_dir / "events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                scalars[(value.tag, event.step)] = float(tf.make_ndarray(value.tensor))
    # TensorBoard's tags are the history's names; the final evaluation, after the last update,
    # is written at its step too, with the values checked against numpy above.
    assert sorted(step for tag, step in scalars if tag.startswith("val_")) == [2, 2, 2, 4, 4, 4]
    for name in ("precision", "loss", "top2"):
        assert scalars[(f"val_{name}", 2)] == pytest.approx(result.history[f"val_{name}"][0])
    final = {"precision": result.eval_precision, "loss": result.eval_loss, **result.eval_metrics}
    for name, value in final.items():
        assert scalars[(f"val_{name}", 4)] == pytest.approx(value, rel=1e-6), name


def checkpoint_values(prefix):
    """Every value a checkpoint holds but its graph and how many saves wrote it."""
    return {name: tf.train.load_variable(prefix, name) for name, _ in tf.train.list_variables(prefix)
            if not name.startswith(("_CHECKPOINTABLE_OBJECT_GRAPH", "save_counter"))}


def test_early_stopping_stops_at_an_update_boundary_saved_and_resumes_bit_exactly(tmp_path, caplog):
    options = dict(eval_data=arrays(n=20, seed=1), eval_every=2, max_steps=8, deterministic=True)
    # min_delta=100 makes no evaluation an improvement on the first: it stops at the second.
    early = keras.callbacks.EarlyStopping(monitor="val_loss", min_delta=100.0, patience=1)
    with caplog.at_level(logging.INFO, logger="absl"):  # an earlier test may have left absl at WARNING
        stopped = run(tmp_path / "resumed", callbacks=[early], **options)
    assert stopped.step == 4 and early.stopped_epoch == 4
    assert stopped.checkpoint == str(tmp_path / "resumed" / "ckpt-4")
    assert int(tf.train.load_variable(stopped.checkpoint, "step/.ATTRIBUTES/VARIABLE_VALUE")) == 4
    assert stopped.history["val_step"] == [2, 4]  # the end's evaluation is not told twice
    assert len(stopped.history["val_loss"]) == 2
    assert any("callback EarlyStopping.on_epoch_end set model.stop_training: stopped after "
               "update 4, saved" in record.getMessage() for record in caplog.records)

    resumed = run(tmp_path / "resumed", **options)
    straight = run(tmp_path / "straight", **options)
    assert resumed.step == straight.step == 8
    got, want = checkpoint_values(resumed.checkpoint), checkpoint_values(straight.checkpoint)
    assert got.keys() == want.keys() and len(got) > 4
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_early_stopping_that_restores_its_best_weights_has_the_result_say_which_weights_each_holds(
        tmp_path, caplog):
    options = dict(eval_data=arrays(n=20, seed=1), eval_every=2, max_steps=8, deterministic=True)
    # No evaluation improves on the first (at update 2): it stops after the second (at 4) and
    # restores update 2's weights.
    early = keras.callbacks.EarlyStopping(monitor="val_loss", min_delta=100.0, patience=1,
                                          restore_best_weights=True)
    with caplog.at_level(logging.INFO, logger="absl"):
        result = run(tmp_path / "early", callbacks=[early], **options)
    best = run(tmp_path / "best", **{**options, "max_steps": 2})
    assert result.step == 4 and result.weights_written_by == "callback EarlyStopping.on_train_end"
    for got, want in zip(result.model.get_weights(), best.model.get_weights(), strict=True):
        np.testing.assert_array_equal(got, want)
    assert result.eval_loss == best.eval_loss == result.history["val_loss"][0]
    assert result.eval_loss != result.history["val_loss"][1]  # update 4's, which ckpt-4 holds
    # ckpt-4 holds update 4's state, as a run of 4 updates without the callback has it.
    late = run(tmp_path / "late", **{**options, "max_steps": 4})
    assert late.weights_written_by is None
    got, want = checkpoint_values(result.checkpoint), checkpoint_values(late.checkpoint)
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    assert np.abs(late.model.get_weights()[0] - result.model.get_weights()[0]).max() > 1e-4
    assert any(record.getMessage() == (
        "callback EarlyStopping.on_train_end set the weights: TrainResult.model and its held-out "
        f"evaluation are of them, not of update 4, which {tmp_path / 'early' / 'ckpt-4'} holds")
        for record in caplog.records)


class FailsAt(keras.callbacks.Callback):
    def __init__(self, step):
        super().__init__()
        self.step = step

    def on_train_batch_end(self, batch, logs=None):
        if batch == self.step:
            raise RuntimeError(f"no good at {batch}")


def test_a_callback_that_raises_is_one_line_naming_it_with_training_saved(tmp_path):
    with pytest.raises(tower_train.UsageError) as error:
        run(tmp_path / "run", max_steps=6, callbacks=[FailsAt(3)])
    message = str(error.value)
    saved = tmp_path / "run" / "ckpt-3"
    assert message.startswith(f"callback FailsAt.on_train_batch_end: {__file__}:")
    assert message.endswith(f": RuntimeError: no good at 3; training is saved in {saved}")
    assert "\n" not in message
    assert int(tf.train.load_variable(str(saved), "step/.ATTRIBUTES/VARIABLE_VALUE")) == 3


def test_terminate_on_nan_never_sees_a_non_finite_loss_which_the_trainer_refuses(tmp_path):
    """A non-finite update is refused before callbacks hear of its end: with --nonfinite=skip
    the run goes on (TerminateOnNaN never stops it); with stop and no TerminateOnNaN it ends in a
    TrainingError."""
    x, _ = arrays()
    x[9, 0] = np.nan  # in update 2's examples (8..15)
    recorder, terminate = Recorder(), keras.callbacks.TerminateOnNaN()
    result = run(tmp_path / "skip", features=x, nonfinite="skip", callbacks=[terminate, recorder])
    assert result.step == 4
    # Update 2 is announced, refused, and announced again for the next examples.
    assert recorder.indices("batch_begin") == [1, 2, 2, 3, 4]
    assert recorder.indices("batch_end") == [1, 2, 3, 4]
    assert all(math.isfinite(call[2]["loss"]) for call in recorder.calls if call[0] == "batch_end")
    assert recorder.model.stop_training is False

    recorder = Recorder()
    with pytest.raises(tower_train.TrainingError, match="update 2 has a non-finite loss"):
        run(tmp_path / "stop", features=x, callbacks=[recorder])
    assert recorder.indices("batch_begin") == [1, 2] and recorder.indices("batch_end") == [1]


def test_terminate_on_nan_under_nonfinite_stop_ends_the_run_at_the_refused_update(tmp_path,
                                                                                 caplog):
    """As Keras's fit stops at a NaN loss and returns: the update is refused, the run stops there
    saved, with one warning naming it, the callbacks hear on_train_end, and fit returns the
    TrainResult of the update before it, whose weights are those of a run of that update alone."""
    x, _ = arrays()
    reference = run(tmp_path / "one", features=x.copy(), max_steps=1)
    x[9, 0] = np.nan  # in update 2's examples (8..15)
    recorder = Recorder()
    result = run(tmp_path / "stop", features=x,
                 callbacks=[keras.callbacks.TerminateOnNaN(), recorder])
    assert result.step == 1 and result.loss == reference.loss
    for got, expected in zip(result.model.get_weights(), reference.model.get_weights(),
                             strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-6)
    assert np.abs(result.model.get_weights()[0] - INITIAL[0]).max() > 1e-3  # update 1 applied
    assert [call[0] for call in recorder.calls] == [
        "train_begin", "batch_begin", "batch_end", "batch_begin", "train_end"]
    assert recorder.indices("batch_begin") == [1, 2]
    saved = tmp_path / "stop" / "ckpt-1"
    assert result.checkpoint == str(saved)
    assert int(tf.train.load_variable(str(saved), "step/.ATTRIBUTES/VARIABLE_VALUE")) == 1
    warnings = [record.getMessage() for record in caplog.records if record.levelname == "WARNING"]
    assert [warning for warning in warnings if "TerminateOnNaN" in warning] == [
        "update 2 has a non-finite loss or gradient (loss = nan) and was not applied; callback "
        f"TerminateOnNaN stops the run there (--nonfinite=stop): stopped after update 1, saved "
        f"{saved}"], warnings


@pytest.mark.parametrize("callbacks, message", [
    (keras.callbacks.TerminateOnNaN(), "callbacks=TerminateOnNaN: expected a list of "
                                       "keras.callbacks.Callback objects"),
    ([keras.callbacks.TerminateOnNaN], "callbacks[0]=<class"),
    ([Recorder(), "csv"], "callbacks[1]='csv': not a keras.callbacks.Callback"),
])
def test_callbacks_of_a_wrong_type_are_one_usage_error_line_and_write_nothing(tmp_path, callbacks,
                                                                             message):
    with pytest.raises(tower_train.UsageError) as error:
        run(tmp_path / "run", callbacks=callbacks)
    assert str(error.value).startswith(message) and "\n" not in str(error.value), error.value
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("metrics, message", [
    ("sparse_top_k_categorical_accuracy", "metrics=str: expected a list of Keras metric names"),
    (["no_such_metric"], "metrics[0]='no_such_metric': not a Keras metric name (keras.metrics)"),
    (["sparse_categorical_accuracy", keras.metrics.AUC],
     "metrics[1]=<class 'keras.src.metrics.confusion_metrics.AUC'>: not a Keras metric name or "
     "keras.metrics.Metric object (a class must be instantiated: AUC())"),
    ([keras.losses.MeanSquaredError()], "metrics[0]=<LossFunctionWrapper("),
    (["accuracy"], "metrics[0]='accuracy': Keras's Accuracy compares the outputs with the labels"),
    ([keras.metrics.Mean(name="loss")], "metrics[0]: its name 'loss' is taken (by the held-out loss)"),
    (["sparse_top_k_categorical_accuracy", "sparse_top_k_categorical_accuracy"],
     "metrics[1]: its name 'sparse_top_k_categorical_accuracy' is taken (by another metric)"),
])
def test_metrics_that_are_unknown_or_no_metric_are_one_usage_error_line_and_write_nothing(
        tmp_path, metrics, message):
    with pytest.raises(tower_train.UsageError) as error:
        run(tmp_path / "run", eval_data=arrays(n=20, seed=1), metrics=metrics)
    assert str(error.value).startswith(message) and "\n" not in str(error.value), error.value
    assert not (tmp_path / "run").exists()


def test_a_metric_that_cannot_take_the_outputs_is_one_usage_error_line_before_training(tmp_path):
    with pytest.raises(tower_train.UsageError) as error:
        run(tmp_path / "run", eval_data=arrays(n=20, seed=1), metrics=[keras.metrics.F1Score()])
    line = str(error.value)
    assert line.startswith("metrics: f1_score, on outputs float32 [20, 3] and labels int32 [20]: "), line
    assert line.endswith("ValueError: FBetaScore expects 2D inputs with shape (batch_size, "
                         "output_dim). Received input shapes: y_pred.shape=(20, 3) and "
                         "y_true.shape=(20,)."), line
    assert "\n" not in line
    assert not glob.glob(str(tmp_path / "run" / "ckpt-*"))


@pytest.mark.parametrize("metric", [keras.metrics.AUC(), keras.metrics.Precision(name="precision_0")], ids=["auc", "precision"])
def test_a_metric_that_broadcasts_one_example_but_not_a_batch_is_one_usage_error_line_before_training(
        tmp_path, metric):
    """[1] labels beside [1, 3] outputs broadcast, [20] beside [20, 3] do not: checked on one
    example, such a metric passed and failed only at the final evaluation, naming no metric."""
    with pytest.raises(tower_train.UsageError) as error:
        run(tmp_path / "run", eval_data=arrays(n=20, seed=1), metrics=[metric])
    line = str(error.value)
    assert line.startswith(f"metrics: {metric.name}, on outputs float32 [20, 3] and labels int32 [20]: "), line
    assert "\n" not in line
    assert not glob.glob(str(tmp_path / "run" / "ckpt-*"))


class PerClass(keras.metrics.Metric):
    """A result of one number per class: nothing a log line or TensorBoard scalar can hold."""

    def update_state(self, y_true, y_pred, sample_weight=None):
        pass

    def result(self):
        return tf.zeros([3])


def test_a_metric_whose_result_is_not_one_number_is_one_usage_error_line_before_training(tmp_path):
    with pytest.raises(tower_train.UsageError) as error:
        run(tmp_path / "run", eval_data=arrays(n=20, seed=1), metrics=[PerClass(name="per_class")])
    assert str(error.value) == (
        "metrics: per_class, on outputs float32 [20, 3] and labels int32 [20]: its result has shape "
        "[3], not one number to log (for F1Score and the like: average='macro' or 'micro')")
    assert not glob.glob(str(tmp_path / "run" / "ckpt-*"))


class EpochsOnly(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        pass


class SaysWhen(keras.callbacks.Callback):
    """A callback that says itself after which updates it reads the state, as
    tower_train.keras.fit's own loop does."""

    def reads_state(self, step: int) -> bool:
        return step == 3


def test_the_callbacks_read_the_state_after_an_update_only_where_one_has_batch_hooks_or_says_so():
    model = network()
    assert not any(KerasCallbacks(callbacks=[EpochsOnly(), keras.callbacks.CSVLogger("unused.csv")],
                                  model=model).reads_state(step) for step in range(1, 5))
    assert all(KerasCallbacks(callbacks=[EpochsOnly(), Recorder()], model=model).reads_state(step)
               for step in range(1, 5))
    says = KerasCallbacks(callbacks=[SaysWhen()], model=model)
    assert [says.reads_state(step) for step in range(1, 5)] == [False, False, True, False]


def test_keras_fit_queues_each_update_before_it_reads_the_last_except_at_an_epochs_end(monkeypatch):
    from tower_train.step.inner_step import UpdateResult
    from tower_train.step.tower_step import TowerStep

    order, numbers, kept = [], {}, []  # kept: no result's id is reused while the run goes on
    run_update, values = TowerStep.run_update, UpdateResult._values

    def noted_run(self, batches, at_once=None):
        result = run_update(self, batches, at_once)
        kept.append(result)
        numbers[id(result)] = len(numbers) + 1
        order.append(("run", numbers[id(result)]))
        return result

    def noted_read(self):
        if self._read is None and id(self) in numbers:
            order.append(("read", numbers[id(self)]))
        return values(self)

    monkeypatch.setattr(TowerStep, "run_update", noted_run)
    monkeypatch.setattr(UpdateResult, "_values", noted_read)
    model = network()
    model.compile(optimizer=keras.optimizers.SGD(LR), loss="sparse_categorical_crossentropy")
    x, y = arrays(n=32)
    tower_train.keras.fit(model, x, y, batch_size=8, epochs=2, shuffle=False, verbose=0,
                          num_gpus=2)  # 4 updates an epoch

    assert sorted(order) == sorted([(what, n) for n in range(1, 9) for what in ("run", "read")])
    # Inside an epoch each update is read while the next one runs; its last is read before the
    # next epoch begins (its metrics, on_epoch_end).
    for n in (2, 3, 6, 7):
        assert order.index(("read", n)) > order.index(("run", n + 1)), order
    assert order.index(("read", 4)) < order.index(("run", 5)), order
