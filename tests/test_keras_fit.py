"""`tower_train.keras.fit` (tower_train/keras/model_fit.py): Keras's `Model.fit` arguments on towers. The
trained weights equal Keras's own `fit` at batch_size x accum from the same initial weights; the
History, the callbacks' epochs and batches and the learning rate they set; what the model is
afterwards; bad arguments, one UsageError line each."""
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tower_train
import tower_train.keras

N, B, K = 2, 8, 2  # towers, examples per micro-step across them, micro-steps per update
EXAMPLES, EPOCHS = 64, 2  # 4 updates of B x K = 16 examples per epoch
LAYOUT = dict(num_gpus=N, accum=K)


def dense(inputs, outputs: int, activation: str) -> keras.Model:
    """A dense network of no BatchNorm and no dropout, whose result Keras's layout cannot change."""
    several = list(inputs.values()) if isinstance(inputs, dict) else inputs
    hidden = keras.layers.Dense(8, activation="tanh")(
        keras.layers.Concatenate()(several) if isinstance(inputs, (dict, list)) else inputs)
    return keras.Model(inputs, keras.layers.Dense(outputs, activation=activation)(hidden))


def binary() -> keras.Model:
    return dense(keras.Input((5,)), 1, "sigmoid")


def softmax() -> keras.Model:
    return dense(keras.Input((5,)), 3, "softmax")


def output_list() -> keras.Model:
    """The softmax network, its output given as a list of one, as a functional model may."""
    network = softmax()
    return keras.Model(network.inputs, [network.outputs[0]])


def two_inputs() -> keras.Model:
    return dense({"a": keras.Input((4,), name="a"), "b": keras.Input((3,), name="b")}, 3, "softmax")


def input_list() -> keras.Model:
    return dense([keras.Input((4,)), keras.Input((3,))], 3, "softmax")


def data(case: str, seed: int = 0):
    rng = np.random.default_rng(seed)
    classes = rng.integers(0, 3, EXAMPLES)
    if case == "binary":
        return rng.normal(size=(EXAMPLES, 5)).astype(np.float32), classes % 2
    if case in ("softmax", "output_list"):  # one-hot float labels
        return rng.normal(size=(EXAMPLES, 5)).astype(np.float32), np.eye(3, dtype=np.float32)[classes]
    inputs = {"a": rng.normal(size=(EXAMPLES, 4)).astype(np.float32),
              "b": rng.normal(size=(EXAMPLES, 3)).astype(np.float32)}
    return (inputs if case == "two_inputs" else [inputs["a"], inputs["b"]]), classes


CASES = {"binary": (binary, "binary_crossentropy", dict(class_weight={0: 1.0, 1: 3.0})),
         "softmax": (softmax, "categorical_crossentropy", {}),
         "output_list": (output_list, "categorical_crossentropy", {}),
         "two_inputs": (two_inputs, "sparse_categorical_crossentropy", {}),
         "input_list": (input_list, "sparse_categorical_crossentropy",
                        dict(sample_weight=np.linspace(0.0, 2.0, EXAMPLES)))}


def compiled(make, initial, loss, metrics=()):
    model = make()
    model.set_weights(initial)
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss=loss, metrics=list(metrics))
    return model


@pytest.mark.parametrize("case,mode", [*((case, "tower") for case in CASES),
                                       ("two_inputs", "mirrored"), ("binary", "mirrored")])
def test_weights_equal_kerass_fit_at_batch_size_times_accum(case, mode, tmp_path):
    make, loss, weighting = CASES[case]
    keras.utils.set_random_seed(3)
    initial = make().get_weights()
    x, y = data(case)
    reference = compiled(make, initial, loss)
    want = reference.fit(x, y, batch_size=B * K, epochs=EPOCHS, shuffle=False, verbose=0,
                         **weighting)
    model = compiled(make, initial, loss)
    history = tower_train.keras.fit(model, x, y, batch_size=B, epochs=EPOCHS, shuffle=False,
                                    verbose=0, mode=mode, **weighting, **LAYOUT)
    assert np.abs(model.get_weights()[0] - initial[0]).max() > 1e-2  # it trained
    for got, expected in zip(model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(got, expected, atol=1e-4)
    assert sorted(history.history) == sorted(want.history) == ["loss"]
    np.testing.assert_allclose(history.history["loss"], want.history["loss"], rtol=1e-4)
    assert history.epoch == want.epoch == [0, 1] and model.history is history
    # Afterwards the model is as Keras's fit leaves it: its optimizer holds the same state.
    assert int(model.optimizer.iterations) == int(reference.optimizer.iterations) == 8
    for got, expected in zip(model.optimizer.variables, reference.optimizer.variables, strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(expected), atol=1e-4)
    assert not list(tmp_path.iterdir())  # nothing written without train_dir=
    if weighting:  # the weights change the result, so the comparison sees how they count
        unweighted = compiled(make, initial, loss)
        unweighted.fit(x, y, batch_size=B * K, epochs=EPOCHS, shuffle=False, verbose=0)
        assert np.abs(unweighted.get_weights()[0] - model.get_weights()[0]).max() > 1e-3


def two_outputs() -> keras.Model:
    """A functional model of two named outputs: 3 classes and a 1-unit sigmoid."""
    inputs = keras.Input((5,))
    hidden = keras.layers.Dense(8, activation="tanh")(inputs)
    return keras.Model(inputs, [keras.layers.Dense(3, activation="softmax", name="kind")(hidden),
                                keras.layers.Dense(1, activation="sigmoid", name="flag")(hidden)])


@pytest.mark.parametrize("targets,weighted", [("dict", False), ("list", True)])
def test_a_loss_per_output_with_loss_weights_equals_kerass_fit(targets, weighted):
    """compile(loss={...}, loss_weights={...}) on a model of two outputs, y a dict by output name
    or a list: the weights, and the History (loss, each output's loss, their val_), of Keras's
    fit at batch_size x accum. (Keras's own fit fails on a dict y with sample_weight and
    metrics, KeyError 0 in its compile_utils, so the dict goes unweighted.)"""
    keras.utils.set_random_seed(15)
    initial = two_outputs().get_weights()
    x, classes = data("two_inputs", seed=12)[0]["a"], data("two_inputs", seed=12)[1]
    x = np.concatenate([x, x[:, :1]], axis=1)  # 5 features
    y = {"kind": classes, "flag": (classes == 1).astype(np.float32)}
    if targets == "list":
        y = [y["kind"], y["flag"]]

    def model():
        made = two_outputs()
        made.set_weights(initial)
        made.compile(optimizer=keras.optimizers.Adam(1e-2),
                     loss={"kind": "sparse_categorical_crossentropy", "flag": "binary_crossentropy"},
                     loss_weights={"kind": 1.0, "flag": 0.25}, metrics={"kind": ["accuracy"]})
        return made

    options = dict(epochs=EPOCHS, shuffle=False, verbose=0, validation_split=0.25,
                   sample_weight=np.linspace(0.5, 1.5, EXAMPLES) if weighted else None)
    reference = model()
    want = reference.fit(x, y, batch_size=B * K, **options)
    trained = model()
    history = tower_train.keras.fit(trained, x, y, batch_size=B, **options, **LAYOUT)
    for got, expected in zip(trained.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(got, expected, atol=1e-4)
    assert sorted(history.history) == sorted(want.history)
    for key, values in want.history.items():
        np.testing.assert_allclose(history.history[key], values, rtol=1e-4, err_msg=key)


@pytest.mark.parametrize("mode", ["tower", "mirrored"])
def test_metrics_and_validation_are_kerass_with_kerass_names(mode):
    keras.utils.set_random_seed(4)
    initial = softmax().get_weights()
    x, y = data("softmax", seed=1)
    options = dict(batch_size=B * K, epochs=EPOCHS, validation_split=0.25, shuffle=False, verbose=0)
    want = compiled(softmax, initial, "categorical_crossentropy", ["accuracy"]).fit(x, y, **options)
    model = compiled(softmax, initial, "categorical_crossentropy", ["accuracy"])
    history = tower_train.keras.fit(model, x, y, **{**options, "batch_size": B}, mode=mode, **LAYOUT)
    assert sorted(history.history) == sorted(want.history) == [
        "accuracy", "loss", "val_accuracy", "val_loss"]
    for key, values in want.history.items():
        np.testing.assert_allclose(history.history[key], values, rtol=1e-4, err_msg=key)
    # Afterwards the model evaluates at once, compiled as it was.
    assert set(model.evaluate(x, y, verbose=0, return_dict=True)) == {"accuracy", "loss"}


class Recorder(keras.callbacks.Callback):
    """Every call Keras makes of a callback, with its epoch or batch and its logs' keys."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def _note(self, method, number=None, logs=None):
        self.calls.append((method, number, sorted(logs or {})))

    def on_train_begin(self, logs=None):
        self._note("train_begin")

    def on_epoch_begin(self, epoch, logs=None):
        self._note("epoch_begin", epoch)

    def on_train_batch_begin(self, batch, logs=None):
        self._note("batch_begin", batch)

    def on_train_batch_end(self, batch, logs=None):
        self._note("batch_end", batch, logs)

    def on_epoch_end(self, epoch, logs=None):
        self._note("epoch_end", epoch, logs)

    def on_train_end(self, logs=None):
        self._note("train_end")

    def on_test_begin(self, logs=None):
        self._note("test_begin")

    def on_test_batch_end(self, batch, logs=None):
        self._note("test_batch_end", batch, logs)

    def on_test_end(self, logs=None):
        self._note("test_end", None, logs)


def learning_rate_callbacks():
    """A schedule by epoch, and a plateau that never improves (mode="max" on a falling loss), so
    the rate falls after every epoch but the first."""
    return [keras.callbacks.LearningRateScheduler(lambda epoch, rate: 0.02 / (epoch + 1)),
            keras.callbacks.ReduceLROnPlateau(monitor="loss", mode="max", factor=0.5, patience=0)]


def test_callbacks_get_kerass_epochs_and_batches_and_set_the_rate_of_the_next_update(tmp_path):
    keras.utils.set_random_seed(5)
    initial = binary().get_weights()
    x, y = data("binary", seed=2)
    options = dict(epochs=4, initial_epoch=1, shuffle=False, verbose=0)
    keras_recorder, recorder = Recorder(), Recorder()
    reference = compiled(binary, initial, "binary_crossentropy")
    want = reference.fit(x, y, batch_size=B * K, callbacks=[*learning_rate_callbacks(), keras_recorder],
                         **options)
    model = compiled(binary, initial, "binary_crossentropy")
    board = keras.callbacks.TensorBoard(log_dir=str(tmp_path / "board"))
    history = tower_train.keras.fit(model, x, y, batch_size=B,
                                    callbacks=[*learning_rate_callbacks(), recorder, board],
                                    **options, **LAYOUT)
    assert recorder.calls == keras_recorder.calls
    assert [call[:2] for call in recorder.calls[:3]] == [("train_begin", None), ("epoch_begin", 1),
                                                         ("batch_begin", 0)]
    assert history.epoch == want.epoch == [1, 2, 3]
    assert sorted(history.history) == sorted(want.history) == ["learning_rate", "loss"]
    rates = history.history["learning_rate"]
    assert rates == want.history["learning_rate"] and rates[-1] < rates[0]
    # The rates each epoch's updates used were the callbacks': the same weights as Keras's.
    for got, expected in zip(model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(got, expected, atol=1e-4)
    written = [path.relative_to(tmp_path / "board").parts[0]
               for path in (tmp_path / "board").rglob("events.out.tfevents.*")]
    assert "train" in written


def test_the_validation_tells_the_callbacks_on_test_calls_at_validation_batch_size():
    """The held-out evaluation of each epoch calls on_test_begin, on_test_batch_end and
    on_test_end(logs) as Keras's fit does, in batches of validation_batch_size (16 held-out
    examples in batches of 4: 4 test batches), and the logs have Keras's names."""
    keras.utils.set_random_seed(12)
    initial = softmax().get_weights()
    x, y = data("softmax", seed=9)
    options = dict(epochs=EPOCHS, shuffle=False, verbose=0, validation_split=0.25,
                   validation_batch_size=4)
    keras_recorder, recorder = Recorder(), Recorder()
    want = compiled(softmax, initial, "categorical_crossentropy", ["accuracy"]).fit(
        x, y, batch_size=B * K, callbacks=[keras_recorder], **options)
    history = tower_train.keras.fit(
        compiled(softmax, initial, "categorical_crossentropy", ["accuracy"]), x, y,
        batch_size=B, callbacks=[recorder], **options, **LAYOUT)
    assert recorder.calls == keras_recorder.calls
    tests = [call for call in recorder.calls if call[0].startswith("test_")]
    assert [call[:2] for call in tests[:6]] == [
        ("test_begin", None), *(("test_batch_end", batch) for batch in range(4)),
        ("test_end", None)]
    assert tests[5][2] == ["accuracy", "loss"] and len(tests) == 12  # 2 epochs
    for key, values in want.history.items():
        np.testing.assert_allclose(history.history[key], values, rtol=1e-4, err_msg=key)


def printed(capsys, train) -> list[str]:
    """What `train()` printed to stdout, line by line, its times and figures replaced by # (they
    vary from run to run), a time's unit too (a busy machine turns ms into s); progress bars
    redrawn in place (\\r, \\b) kept as their last state."""
    import re

    capsys.readouterr()
    train()
    lines = re.split(r"\n", capsys.readouterr().out)
    lines = [re.split(r"[\r\b]+", line)[-1] for line in lines]
    lines = [re.sub(r"\d+(\.\d+)?(e[-+]\d+)?", "#", line).strip() for line in lines if line.strip()]
    return [re.sub(r"#(s|ms|us)\b", "#s", line) for line in lines]


@pytest.mark.parametrize("verbose", [0, 1, 2, "auto"])
def test_progress_is_printed_to_stdout_as_keras_prints_it(verbose, capsys):
    keras.utils.set_random_seed(6)
    initial = binary().get_weights()
    x, y = data("binary", seed=3)
    options = dict(epochs=2, shuffle=False, verbose=verbose, validation_split=0.25)
    want = printed(capsys, lambda: compiled(binary, initial, "binary_crossentropy").fit(
        x, y, batch_size=B * K, **options))
    got = printed(capsys, lambda: tower_train.keras.fit(
        compiled(binary, initial, "binary_crossentropy"), x, y, batch_size=B, **options, **LAYOUT))
    assert got == want
    assert bool(got) == (verbose != 0) and (not got or got[0] == "Epoch #/#")


def test_bad_arguments_are_one_usage_error_line():
    x, y = data("binary")
    model = binary()
    uncompiled_message = "is not compiled with a loss; call model.compile("
    with pytest.raises(tower_train.UsageError, match=uncompiled_message.replace("(", r"\(")):
        tower_train.keras.fit(model, x, y)
    model.compile(optimizer="adam", loss="binary_crossentropy")
    cases = [
        (dict(batch_size=9, num_gpus=2), "batch_size=9: examples per micro-step across all towers, "
                                         "so it must be a multiple of num_gpus=2"),
        (dict(max_steps=3), "max_steps=: tower_train.keras.fit sets it from epochs and steps_per_epoch"),
        (dict(learning_rate=0.1), "learning_rate=: tower_train.keras.fit sets it from the compiled optimizer"),
        (dict(verbose=3), "verbose=3: must be 0, 1, 2 or 'auto'"),
        (dict(class_weight={0: 1.0}, sample_weight=np.ones(EXAMPLES)), "sample_weight= and class_weight="),
        (dict(sample_weight=np.ones(3)), f"sample_weight [3]: must be one weight per example, [{EXAMPLES}]"),
        (dict(validation_split=1.5), "validation_split=1.5: must be in [0, 1)"),
        (dict(validation_data=[x, y]), "validation_data=list: expected a tuple (x, y)"),
        (dict(shuffle="batch"), "shuffle='batch': must be True or False"),
        (dict(x=(batch for batch in [(x, y)]), y=None), "x=generator: tower_train.keras.fit takes "
         "numpy arrays"),
        (dict(x=tf.data.Dataset.from_tensor_slices((x, y)).batch(B), y=None, batch_size=B),
         "batch_size=: not with x=Dataset, whose elements give the batches"),
        (dict(x=tf.data.Dataset.from_tensor_slices((x, y)).batch(B).repeat(), y=None),
         "x=Dataset: is infinite"),
        (dict(x=tf.data.Dataset.from_tensor_slices((x[:4], y[:4])).batch(4).concatenate(
            tf.data.Dataset.from_tensor_slices((x, y)).batch(8)), y=None),
         "x=Dataset: its batches hold 4, 8, 8, 8, 8, 8, 8, 8, ... examples: each step's batch must "
         "be full but the last"),
        (dict(y=None), "x and y: tower_train.keras.fit needs both"),
    ]
    for change, message in cases:
        arguments = {"x": x, "y": y, **change}
        with pytest.raises(tower_train.UsageError) as excinfo:
            tower_train.keras.fit(model, **arguments)
        assert message in str(excinfo.value) and "\n" not in str(excinfo.value), (change, excinfo.value)
    # A loss Keras reduces otherwise than over the batch's size.
    model.compile(optimizer="adam", loss=keras.losses.BinaryCrossentropy(reduction="sum"))
    with pytest.raises(tower_train.UsageError, match="takes Keras's default reduction"):
        tower_train.keras.fit(model, x, y)


class OwnStep(keras.Model):
    """As keras-io's VAE: its own train_step, and no loss compiled."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(1)

    def call(self, inputs):
        return self.dense(inputs)

    def train_step(self, data):
        return {}


def test_a_model_with_its_own_train_step_is_refused_in_one_line_naming_it():
    x, y = data("binary")
    model = OwnStep()
    model.compile(optimizer="adam")
    with pytest.raises(tower_train.UsageError) as refused:
        tower_train.keras.fit(model, x, y)
    assert str(refused.value) == (
        f"model {model.name}: test_keras_fit.OwnStep.train_step is never called by "
        "tower_train.keras.fit, which runs its own update over towers and micro-steps; override "
        "compute_loss(self, x, y, y_pred, sample_weight, training) instead, which it calls on "
        "every tower (docs/keras.md), or train with Keras's own fit")
    model = own_loss_model(GuideLoss)
    model.compile(optimizer="adam")
    x, _ = data("softmax")
    with pytest.raises(tower_train.UsageError, match=(
            r"^mode='mirrored': test_keras_fit.GuideLoss overrides compute_loss, which "
            r"tower_train.keras.fit calls in mode='tower' \(the default\) only$")):
        tower_train.keras.fit(model, x, x[:, :1], mode="mirrored", **LAYOUT)
    model = own_loss_model(PerExample)
    model.compile(optimizer="adam")
    with pytest.raises(tower_train.UsageError, match=(
            r"test_keras_fit.PerExample.compute_loss: returned shape \[1\]; it must return a "
            r"scalar, the mean over the batch it is given, as Keras's does$")):
        tower_train.keras.fit(model, x, x[:, :1], **LAYOUT)


class PerExample(keras.Model):
    """A compute_loss that returns one loss per example, not their mean."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        return keras.ops.mean(keras.ops.square(y_pred - y), axis=-1)


class GuideLoss(keras.Model):
    """The customizing-fit guide's compute_loss: its own mean squared error plus self.losses, and
    its own loss tracker as the model's only metric; compiled with no loss."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.loss_tracker = keras.metrics.Mean(name="loss")

    def compute_loss(self, x, y, y_pred, sample_weight, training=True):
        loss = keras.ops.mean((y_pred - y) ** 2)
        loss += keras.ops.sum(self.losses)
        self.loss_tracker.update_state(loss)
        return loss

    def reset_metrics(self):
        self.loss_tracker.reset_state()

    @property
    def metrics(self):
        return [self.loss_tracker]


class Unused(keras.Model):
    """A layer that the outputs never reach, and Keras's own test_step, which evaluate calls."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(1, activation="sigmoid")
        self.unused = keras.layers.Dense(1, name="unused")
        self.unused.build((None, 5))

    def call(self, inputs):
        return self.dense(inputs)

    def test_step(self, data):
        return super().test_step(data)


def test_warnings_name_the_users_model_and_loss_not_tower_trains_own(caplog):
    """The warning of weights the loss never reaches names the model's class and its compiled
    loss, not a function or class of tower_train; nothing warns of test_step, which evaluate
    calls, nor of an own compute_loss, which the towers call."""
    x, y = data("binary")
    model = Unused()
    model.compile(optimizer="adam", loss="binary_crossentropy")
    tower_train.keras.fit(model, x, y, batch_size=B, epochs=1, verbose=0,
                          validation_split=0.25, **LAYOUT)
    said = [record.getMessage() for record in caplog.records if record.levelname == "WARNING"]
    assert [text for text in said if "get no gradient" in text] == [
        "model=test_keras_fit.Unused: 2 of 4 trainable variables get no gradient from the loss "
        "and will not change: unused/kernel, unused/bias"]
    for text in said:
        assert "tower_train" not in text and "<locals>" not in text and "CompiledLoss" not in text
        assert "test_step" not in text
    caplog.clear()
    x, _ = data("softmax", seed=8)
    model = own_loss_model(GuideLoss)
    model.compile(optimizer="adam")
    tower_train.keras.fit(model, x, x[:, :1], batch_size=B, epochs=1, verbose=0, **LAYOUT)
    assert not [record for record in caplog.records if "compute_loss" in record.getMessage()]


class ExtraTerm(keras.Model):
    """Keras's compiled loss (super().compute_loss, with the sample weights) plus a term of its
    own on the outputs, tracked as a metric of its own."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.penalty = keras.metrics.Mean(name="penalty")

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        penalty = 0.5 * keras.ops.mean(keras.ops.square(y_pred))
        self.penalty.update_state(penalty)
        return super().compute_loss(x, y, y_pred, sample_weight, training) + penalty


def own_loss_model(kind) -> keras.Model:
    inputs = keras.Input((5,))
    hidden = keras.layers.Dense(8, activation="tanh", kernel_regularizer=keras.regularizers.L2(0.01),
                                activity_regularizer=keras.regularizers.L2(0.01))(inputs)
    return kind(inputs, keras.layers.Dense(1)(hidden))


@pytest.mark.parametrize("kind", [GuideLoss, ExtraTerm])
def test_an_own_compute_loss_is_called_on_every_tower_and_trains_as_kerass_fit(kind):
    """A model whose class overrides compute_loss, with a weight and an activity regularizer:
    2 towers x 2 micro-steps end at the weights of Keras's fit at batch_size x accum to 1e-4
    (relative), the sample weights reaching super().compute_loss, and History's keys and values
    (the loss, the metric the compute_loss updates) are Keras's."""
    keras.utils.set_random_seed(14)
    initial = own_loss_model(kind).get_weights()
    x, _ = data("softmax", seed=8)
    y = (x[:, :1] * 2.0 - x[:, 1:2]).astype(np.float32)
    weighting = {} if kind is GuideLoss else dict(sample_weight=np.linspace(0.5, 1.5, EXAMPLES))

    def own_compiled():
        model = own_loss_model(kind)
        model.set_weights(initial)
        model.compile(optimizer=keras.optimizers.Adam(1e-2),
                      loss=None if kind is GuideLoss else "mse")
        return model

    reference = own_compiled()
    want = reference.fit(x, y, batch_size=B * K, epochs=EPOCHS, shuffle=False, verbose=0,
                         **weighting)
    model = own_compiled()
    history, said = fit_warnings(lambda: tower_train.keras.fit(
        model, x, y, batch_size=B, epochs=EPOCHS, shuffle=False, verbose=0, **weighting,
        **LAYOUT))
    assert np.abs(model.get_weights()[0] - initial[0]).max() > 1e-2  # it trained
    for got, expected in zip(model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-6)
    assert sorted(history.history) == sorted(want.history)
    for key, values in want.history.items():
        np.testing.assert_allclose(history.history[key], values, rtol=1e-4, err_msg=key)
    assert not [text for text in said if "compute_loss" in text]


def test_batchnorm_is_said_to_normalize_each_towers_share(caplog):
    x, y = data("binary")
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4),
                              keras.layers.BatchNormalization(name="norm"),
                              keras.layers.Dense(1, activation="sigmoid")])
    model.compile(optimizer="sgd", loss="binary_crossentropy")
    tower_train.keras.fit(model, x, y, batch_size=B, steps_per_epoch=1, verbose=0, **LAYOUT)
    warnings = [record.getMessage() for record in caplog.records if record.levelname == "WARNING"]
    assert any("norm normalizes each tower's micro-batch of batch_size / num_gpus examples"
               in warning for warning in warnings), warnings
    caplog.clear()  # one tower, one micro-step: the same as Keras's fit, so nothing is said
    tower_train.keras.fit(model, x, y, batch_size=B, steps_per_epoch=1, verbose=0, num_gpus=1)
    assert not [record for record in caplog.records if "normalizes" in record.getMessage()]


class Batches(keras.utils.PyDataset):
    """Keras's PyDataset of the arrays in batches of `size`."""

    def __init__(self, x, y, size):
        super().__init__()
        self.x, self.y, self.size = x, y, size

    def __len__(self):
        return len(self.y) // self.size

    def __getitem__(self, index):
        rows = slice(index * self.size, (index + 1) * self.size)
        return self.x[rows], self.y[rows]


def test_a_py_dataset_trains_as_keras_fit_on_its_batches():
    keras.utils.set_random_seed(10)
    initial = binary().get_weights()
    x, y = data("binary", seed=7)
    reference = compiled(binary, initial, "binary_crossentropy")
    reference.fit(Batches(x, y, B * K), epochs=EPOCHS, shuffle=False, verbose=0)
    model = compiled(binary, initial, "binary_crossentropy")
    tower_train.keras.fit(model, Batches(x, y, B), epochs=EPOCHS, shuffle=False, verbose=0, **LAYOUT)
    for got, expected in zip(model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(got, expected, atol=1e-4)


def test_a_batched_dataset_trains_as_keras_fit_on_its_batches(tmp_path):
    """Its elements are the micro-steps' batches (here of B), accum of them an update: Keras's
    fit on the same dataset batched by B x K, the validation a dataset too."""
    keras.utils.set_random_seed(7)
    initial = softmax().get_weights()
    x, y = data("softmax", seed=4)
    held_out = tf.data.Dataset.from_tensor_slices((x[:16], y[:16])).batch(4)
    reference = compiled(softmax, initial, "categorical_crossentropy", ["accuracy"])
    want = reference.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(B * K), epochs=EPOCHS,
                         validation_data=held_out, verbose=0)
    model = compiled(softmax, initial, "categorical_crossentropy", ["accuracy"])
    history = tower_train.keras.fit(model, tf.data.Dataset.from_tensor_slices((x, y)).batch(B),
                                    epochs=EPOCHS, validation_data=held_out, verbose=0, **LAYOUT)
    for got, expected in zip(model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(got, expected, atol=1e-4)
    assert sorted(history.history) == sorted(want.history)
    for key, values in want.history.items():
        np.testing.assert_allclose(history.history[key], values, rtol=1e-4, err_msg=key)


def test_a_dataset_that_reshuffles_every_epoch_trains_as_keras_fit_over_its_epochs():
    """A shuffle(..., reshuffle_each_iteration=True) before batch: Keras's fit iterates it anew
    every epoch, each in its own order, and so is it read here; 3 epochs end at Keras's weights,
    where training every epoch on the first epoch's order would not."""
    keras.utils.set_random_seed(10)
    initial = softmax().get_weights()
    x, y = data("softmax", seed=5)

    def reshuffled(batch_size):
        return tf.data.Dataset.from_tensor_slices((x, y)).shuffle(
            EXAMPLES, seed=11, reshuffle_each_iteration=True).batch(batch_size)

    reference = compiled(softmax, initial, "categorical_crossentropy")
    reference.fit(reshuffled(B * K), epochs=3, verbose=0)
    model = compiled(softmax, initial, "categorical_crossentropy")
    tower_train.keras.fit(model, reshuffled(B), epochs=3, verbose=0, **LAYOUT)
    for got, expected in zip(model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-6)


def fit_warnings(train) -> tuple[object, list[str]]:
    """What `train()` returns, and the texts of the Python warnings it gave, every one."""
    with warnings.catch_warnings(record=True) as given:
        warnings.simplefilter("always")
        result = train()
    return result, [str(warning.message) for warning in given]


@pytest.mark.parametrize("steps_per_epoch,epochs,lengths", [(10, 2, [4, 4]), (3, 3, [3, 1, 3])])
def test_steps_per_epoch_beyond_the_data_ends_the_epoch_there_with_kerass_warning(
        steps_per_epoch, epochs, lengths):
    """An epoch of steps_per_epoch that reaches the end of the data (4 updates of 16 of the 64
    examples) ends there with Keras's warning, and the next epoch starts the data again, as
    Keras's fit does: its updates, callbacks' calls, History and weights."""
    keras.utils.set_random_seed(12)
    initial = binary().get_weights()
    x, y = data("binary", seed=3)
    options = dict(epochs=epochs, steps_per_epoch=steps_per_epoch, shuffle=False, verbose=0)
    keras_recorder, recorder = Recorder(), Recorder()
    reference = compiled(binary, initial, "binary_crossentropy")
    want, keras_said = fit_warnings(lambda: reference.fit(
        x, y, batch_size=B * K, callbacks=[keras_recorder], **options))
    model = compiled(binary, initial, "binary_crossentropy")
    history, said = fit_warnings(lambda: tower_train.keras.fit(
        model, x, y, batch_size=B, callbacks=[recorder], **options, **LAYOUT))
    out_of_data = [text for text in keras_said if "ran out of data" in text]
    assert len(out_of_data) == sum(length < steps_per_epoch for length in lengths)
    assert [text for text in said if "ran out of data" in text] == out_of_data
    assert int(model.optimizer.iterations) == int(reference.optimizer.iterations) == sum(lengths)
    assert recorder.calls == keras_recorder.calls
    assert [call[1] for call in recorder.calls if call[0] == "batch_end"] == [
        batch for length in lengths for batch in range(length)]
    assert history.epoch == want.epoch == list(range(epochs))
    np.testing.assert_allclose(history.history["loss"], want.history["loss"], rtol=1e-4)
    for got, expected in zip(model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-6)


def test_a_finite_dataset_ends_each_epoch_at_its_end_as_in_kerass_fit():
    """No steps_per_epoch: an epoch is one pass of the dataset (6 micro-batches of 8: 3 updates
    of 16), 3 epochs of it, the updates, callbacks' calls and weights of Keras's fit on it
    batched by 16, and no warning."""
    keras.utils.set_random_seed(13)
    initial = softmax().get_weights()
    x, y = data("softmax", seed=6)
    x, y = x[:48], y[:48]
    keras_recorder, recorder = Recorder(), Recorder()
    reference = compiled(softmax, initial, "categorical_crossentropy")
    reference.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(B * K), epochs=3, verbose=0,
                  callbacks=[keras_recorder])
    model = compiled(softmax, initial, "categorical_crossentropy")
    _, said = fit_warnings(lambda: tower_train.keras.fit(
        model, tf.data.Dataset.from_tensor_slices((x, y)).batch(B), epochs=3, verbose=0,
        callbacks=[recorder], **LAYOUT))
    assert not [text for text in said if "ran out of data" in text]
    assert int(model.optimizer.iterations) == int(reference.optimizer.iterations) == 9
    assert recorder.calls == keras_recorder.calls
    for got, expected in zip(model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-6)


def test_checkpoints_early_stopping_and_csv_are_kerass(tmp_path):
    """ModelCheckpoint, EarlyStopping and CSVLogger see Keras's epochs: the same files and rows,
    the same last epoch, as on Keras's own fit."""
    keras.utils.set_random_seed(8)
    initial = binary().get_weights()
    x, y = data("binary", seed=5)

    def callbacks(directory):
        directory.mkdir()
        # Never better (mode="max" on a falling loss): stops after its second epoch.
        return [keras.callbacks.ModelCheckpoint(str(directory / "model_{epoch}.keras")),
                keras.callbacks.EarlyStopping(monitor="loss", mode="max", patience=1),
                keras.callbacks.CSVLogger(str(directory / "log.csv"))]

    options = dict(epochs=5, shuffle=False, verbose=0)
    want = compiled(binary, initial, "binary_crossentropy").fit(
        x, y, batch_size=B * K, callbacks=callbacks(tmp_path / "keras"), **options)
    model = compiled(binary, initial, "binary_crossentropy")
    history = tower_train.keras.fit(model, x, y, batch_size=B, callbacks=callbacks(tmp_path / "ours"),
                                    **options, **LAYOUT)
    assert history.epoch == want.epoch == [0, 1]
    assert sorted(p.name for p in (tmp_path / "ours").iterdir()) == sorted(
        p.name for p in (tmp_path / "keras").iterdir()) == ["log.csv", "model_1.keras", "model_2.keras"]
    rows = [(tmp_path / name / "log.csv").read_text().splitlines() for name in ("ours", "keras")]
    assert [row.split(",")[0] for row in rows[0]] == [row.split(",")[0] for row in rows[1]]
    saved = keras.saving.load_model(tmp_path / "ours" / "model_2.keras", compile=False)
    for got, expected in zip(saved.get_weights(), model.get_weights(), strict=True):
        np.testing.assert_array_equal(got, expected)


class StopAfter(keras.callbacks.Callback):
    """Stops the run after the batch numbered `batch` of the first epoch."""

    def __init__(self, batch: int):
        super().__init__()
        self.batch = batch

    def on_train_batch_end(self, batch, logs=None):
        if batch == self.batch:
            self.model.stop_training = True


def test_a_train_dir_keeps_checkpoints_and_a_rerun_resumes_there(tmp_path):
    keras.utils.set_random_seed(9)
    initial = softmax().get_weights()
    x, y = data("softmax", seed=6)
    options = dict(batch_size=B, epochs=EPOCHS, shuffle=False, verbose=0, **LAYOUT)
    straight = compiled(softmax, initial, "categorical_crossentropy")
    tower_train.keras.fit(straight, x, y, **options)
    model = compiled(softmax, initial, "categorical_crossentropy")
    stopped = tower_train.keras.fit(model, x, y, callbacks=[StopAfter(1)], train_dir=tmp_path,
                                    **options)
    # Stopped within epoch 0, which then ends, as Keras's fit ends it.
    assert stopped.epoch == [0] and int(model.optimizer.iterations) == 2
    assert (tmp_path / "ckpt-2.index").exists()
    resumed = tower_train.keras.fit(compiled(softmax, initial, "categorical_crossentropy"), x, y,
                                    train_dir=tmp_path, **options)
    assert resumed.epoch == [0, 1] and int(resumed.model.optimizer.iterations) == 8
    for got, expected in zip(resumed.model.get_weights(), straight.get_weights(), strict=True):
        np.testing.assert_allclose(got, expected, atol=1e-6)


def test_a_second_fit_continues_the_optimizers_state_as_kerass_does():
    keras.utils.set_random_seed(11)
    initial = softmax().get_weights()
    x, y = data("softmax", seed=8)
    reference = compiled(softmax, initial, "categorical_crossentropy")
    model = compiled(softmax, initial, "categorical_crossentropy")
    for _ in range(2):  # Adam's moments and iterations go on in the second call
        reference.fit(x, y, batch_size=B * K, shuffle=False, verbose=0)
        tower_train.keras.fit(model, x, y, batch_size=B, shuffle=False, verbose=0, **LAYOUT)
    assert int(model.optimizer.iterations) == int(reference.optimizer.iterations) == 8
    for got, expected in zip(model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(got, expected, atol=1e-4)


class InterruptAt(keras.callbacks.Callback):
    """Raises at the beginning of epoch `epoch`, as a killed job would end (Keras's
    BackupAndRestore example)."""

    def __init__(self, epoch: int):
        super().__init__()
        self.epoch = epoch

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.epoch:
            raise RuntimeError("interrupted")


def test_backup_and_restore_resumes_an_interrupted_run_as_kerass_does(tmp_path):
    """Interrupted at epoch 2 of 4, a rerun with the same BackupAndRestore trains epochs 2 and 3
    from the backed-up weights and optimizer state: the weights of Keras's fit doing the same."""
    keras.utils.set_random_seed(13)
    initial = softmax().get_weights()
    x, y = data("softmax", seed=10)
    options = dict(epochs=4, shuffle=False, verbose=0)

    def interrupted_then_resumed(train, backup, batch_size):
        model = compiled(softmax, initial, "categorical_crossentropy")
        with pytest.raises((RuntimeError, tower_train.UsageError), match="interrupted"):
            train(model, x, y, batch_size=batch_size, **options,
                  callbacks=[keras.callbacks.BackupAndRestore(str(backup)), InterruptAt(2)])
        model = compiled(softmax, initial, "categorical_crossentropy")
        history = train(model, x, y, batch_size=batch_size, **options,
                        callbacks=[keras.callbacks.BackupAndRestore(str(backup))])
        return model, history

    reference, want = interrupted_then_resumed(
        lambda model, *args, **kwargs: model.fit(*args, **kwargs), tmp_path / "keras", B * K)
    model, history = interrupted_then_resumed(
        lambda model, *args, **kwargs: tower_train.keras.fit(model, *args, **kwargs, **LAYOUT),
        tmp_path / "ours", B)
    assert history.epoch == want.epoch == [2, 3]
    assert int(model.optimizer.iterations) == int(reference.optimizer.iterations) == 16
    for got, expected in zip(model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(got, expected, atol=1e-4)
    assert not (tmp_path / "ours").exists()  # deleted at the end, as by Keras


def test_a_loaded_model_resumes_the_train_dir(tmp_path):
    """Interrupted at epoch 2 of 4 with a train_dir, then `keras.models.load_model` of the model
    saved there, as a new process gets it back: its compiled optimizer is built, where the
    train_dir's checkpoint holds it unbuilt, and the rerun resumes the checkpoint with the
    uninterrupted run's weights (it was refused as "written by another model")."""
    keras.utils.set_random_seed(13)
    initial = softmax().get_weights()
    x, y = data("softmax", seed=10)
    options = dict(batch_size=B, epochs=4, shuffle=False, verbose=0, **LAYOUT)
    uninterrupted = compiled(softmax, initial, "categorical_crossentropy")
    tower_train.keras.fit(uninterrupted, x, y, **options)
    model = compiled(softmax, initial, "categorical_crossentropy")
    with pytest.raises(tower_train.UsageError, match="interrupted"):
        tower_train.keras.fit(model, x, y, **options, train_dir=str(tmp_path / "run"),
                              callbacks=[InterruptAt(2)])
    model.save(tmp_path / "model.keras")
    model = keras.models.load_model(tmp_path / "model.keras")
    assert model.optimizer.built
    history = tower_train.keras.fit(model, x, y, **options, train_dir=str(tmp_path / "run"))
    assert history.epoch == [2, 3]
    assert int(model.optimizer.iterations) == 16
    for got, expected in zip(model.get_weights(), uninterrupted.get_weights(), strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)


def dropped() -> keras.Model:
    """The softmax network with a Dropout layer, its seed generator seeded alike every time:
    its masks follow the update's seeds (docs/models.md)."""
    keras.utils.set_random_seed(21)
    inputs = keras.Input((5,))
    hidden = keras.layers.Dropout(0.3)(keras.layers.Dense(8, activation="tanh")(inputs))
    return keras.Model(inputs, keras.layers.Dense(3, activation="softmax")(hidden))


@pytest.mark.parametrize("how", ["backup_and_restore", "initial_epoch, train_dir"])
def test_a_resumed_fit_ends_with_the_uninterrupted_runs_weights(tmp_path, how):
    """shuffle=True and Dropout, 4 epochs: interrupted at epoch 2 and run again with its
    BackupAndRestore (without a train_dir: the run starts at epoch 2's first update), or trained
    2 epochs and then on from initial_epoch=2 with a train_dir (the second resumes the first's
    checkpoint). Epochs 2 and 3 read the data in the uninterrupted run's order and draw its
    Dropout masks, and end with its weights (1e-6)."""
    initial = dropped().get_weights()
    x, y = data("softmax", seed=10)
    options = dict(batch_size=B, epochs=4, shuffle=True, verbose=0, **LAYOUT)
    if how.endswith("train_dir"):
        options["train_dir"] = str(tmp_path / "run")
    uninterrupted = compiled(dropped, initial, "categorical_crossentropy")
    tower_train.keras.fit(uninterrupted, x, y, **{**options, "train_dir": str(tmp_path / "whole")})
    model = compiled(dropped, initial, "categorical_crossentropy")
    if how.startswith("backup_and_restore"):
        backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))
        with pytest.raises(tower_train.UsageError, match="interrupted"):
            tower_train.keras.fit(model, x, y, **options, callbacks=[backup, InterruptAt(2)])
        model = compiled(dropped, initial, "categorical_crossentropy")
        history = tower_train.keras.fit(model, x, y, **options, callbacks=[backup])
    else:
        tower_train.keras.fit(model, x, y, **{**options, "epochs": 2})
        history = tower_train.keras.fit(model, x, y, **options, initial_epoch=2)
    assert history.epoch == [2, 3]
    assert int(model.optimizer.iterations) == int(uninterrupted.optimizer.iterations) == 16
    for got, expected in zip(model.get_weights(), uninterrupted.get_weights(), strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)


def test_a_nan_loss_stops_the_run_before_the_weights_take_it(caplog):
    """With TerminateOnNaN, Keras's fit applies the NaN update, then stops and returns; here the
    update is never applied (--nonfinite=stop): the run stops there as TerminateOnNaN asks, with
    one warning naming it, ends for the callbacks and returns the History, the model holding the
    weights of Keras's fit on the two updates before it."""
    keras.utils.set_random_seed(14)
    initial = binary().get_weights()
    x, y = data("binary", seed=11)
    x[2 * B * K] = np.nan  # in the third update
    model = compiled(binary, initial, "binary_crossentropy")
    ended = []
    history = tower_train.keras.fit(
        model, x, y, batch_size=B, shuffle=False, verbose=0, **LAYOUT,
        callbacks=[keras.callbacks.TerminateOnNaN(),
                   keras.callbacks.LambdaCallback(on_train_end=lambda logs: ended.append(logs))])
    reference = compiled(binary, initial, "binary_crossentropy")
    want = reference.fit(x[:2 * B * K], y[:2 * B * K], batch_size=B * K, shuffle=False, verbose=0)
    assert len(ended) == 1 and model.history is history
    assert history.epoch == [0]  # the epoch it stopped in ends, as in Keras's fit
    np.testing.assert_allclose(history.history["loss"], want.history["loss"], rtol=1e-4)
    assert np.abs(model.get_weights()[0] - initial[0]).max() > 1e-3  # the two updates applied
    for got, expected in zip(model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(got, expected, atol=1e-4)
    assert int(model.optimizer.iterations) == 2
    warnings = [record.getMessage() for record in caplog.records if record.levelname == "WARNING"]
    stops = [warning for warning in warnings if "TerminateOnNaN" in warning]
    assert len(stops) == 1 and stops[0].startswith(
        "update 3 has a non-finite loss or gradient (loss = nan) and was not applied; callback "
        "TerminateOnNaN stops the run there (--nonfinite=stop): stopped after update 2, saved "), warnings


def embedding_data():
    """Token ids [EXAMPLES, 6] of a vocabulary of 12 whose ids 7..11 never occur: each example's
    first four tokens from 1..6, repeated within and across examples, then two of padding 0."""
    rng = np.random.default_rng(21)
    x = np.zeros((EXAMPLES, 6), np.int32)
    x[:, :4] = rng.integers(1, 7, (EXAMPLES, 4))
    return x, rng.normal(size=(EXAMPLES, 1)).astype(np.float32)


def embedding_model() -> keras.Model:
    inputs = keras.Input((6,), dtype="int32")
    pooled = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(12, 4)(inputs))
    return keras.Model(inputs, keras.layers.Dense(1)(pooled))


def relative_difference(got, want) -> float:
    return float(np.abs(np.asarray(got) - np.asarray(want)).max() / np.abs(np.asarray(want)).max())


@pytest.mark.parametrize("optimizer,options", [("adam", {}), ("rmsprop", {}), ("adam", dict(clipnorm=0.01)),
                                               ("rmsprop", dict(global_clipnorm=0.01))])
def test_an_embedding_steps_as_in_kerass_fit_from_its_rows_occurrences(optimizer, options):
    """docs/keras.md's "Embeddings": Keras's fit hands the optimizer an Embedding's gradient as a
    row per occurrence of a token, and so does tower_train.keras.fit (sparse_steps, its default),
    the occurrences of every tower and micro-step of an update together: every weight and slot
    equals Keras's fit at batch_size x accum, the optimizer's clipping included. sparse_steps=False
    steps densely and differs (-s prints by how much)."""
    keras.utils.set_random_seed(11)
    initial = embedding_model().get_weights()
    x, y = embedding_data()

    def model():
        made = embedding_model()
        made.set_weights(initial)
        made.compile(optimizer=keras.optimizers.get({"class_name": optimizer,
                                                     "config": dict(learning_rate=1e-2, **options)}),
                     loss="mse")
        return made

    reference = model()
    reference.fit(x, y, batch_size=B * K, epochs=EPOCHS, shuffle=False, verbose=0)
    trained, dense = model(), model()
    tower_train.keras.fit(trained, x, y, batch_size=B, epochs=EPOCHS, shuffle=False, verbose=0, **LAYOUT)
    tower_train.keras.fit(dense, x, y, batch_size=B, epochs=EPOCHS, shuffle=False, verbose=0,
                          sparse_steps=False, **LAYOUT)
    for got, want in zip(trained.get_weights() + trained.optimizer.variables,
                         reference.get_weights() + reference.optimizer.variables, strict=True):
        assert relative_difference(got, want) <= 1e-4
    table = reference.get_weights()[0]
    assert np.abs(table - initial[0])[:7].min() > 0  # every row read moved: padding's, 0, too
    difference = relative_difference(dense.get_weights()[0], table)
    assert difference > 1e-2
    print(f"{optimizer} {options}: sparse_steps=False's embedding differs from Keras's fit by "
          f"{difference:.3g} relative (largest element / largest of Keras's)")


@pytest.mark.parametrize("ps_device,jit_compile", [("cpu", False), ("spread", True)])
def test_batchnorms_moving_statistics_move_once_per_update_as_in_kerass_fit(ps_device, jit_compile):
    """docs/keras.md's "BatchNorm": after 3 updates of N=2 towers x K=2 micro-steps on data
    centred at 3, BN's moving mean and variance are Keras's fit's at batch_size x accum (1e-4):
    moved once per update from the update's pooled moments (--bn_statistics=per_update, the
    default here). The layer before the BN is frozen, so that its inputs are Keras's whatever
    normalizing per micro-batch does to the weights after it. With per_micro_step they move at every tower's pass, N x K = 12 times where
    Keras's fit moves them 3: from the initial 0 the mean goes about
    (1 - 0.99^12) / (1 - 0.99^3) = 3.8 times as far."""
    x = data("binary")[0] + 3.0
    y = data("binary")[1]
    updates = 3

    def make():
        return keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, trainable=False),
                                 keras.layers.BatchNormalization(name="norm"),
                                 keras.layers.Dense(1, activation="sigmoid")])

    keras.utils.set_random_seed(12)
    initial = make().get_weights()
    reference = compiled(make, initial, "binary_crossentropy")
    reference.fit(x[:updates * B * K], y[:updates * B * K], batch_size=B * K, epochs=1,
                  shuffle=False, verbose=0)
    trained = {}
    for statistics in ("per_update", "per_micro_step"):
        model = compiled(make, initial, "binary_crossentropy")
        tower_train.keras.fit(model, x, y, batch_size=B, epochs=1, steps_per_epoch=updates,
                              shuffle=False, verbose=0, **LAYOUT, bn_statistics=statistics,
                              ps_device=ps_device, jit_compile=jit_compile)
        trained[statistics] = model.get_layer("norm")
    want = reference.get_layer("norm")
    for name in ("moving_mean", "moving_variance"):
        np.testing.assert_allclose(np.asarray(getattr(trained["per_update"], name)),
                                   np.asarray(getattr(want, name)), rtol=1e-4, err_msg=name)
    ratio = (np.abs(np.asarray(trained["per_micro_step"].moving_mean)).sum()
             / np.abs(np.asarray(want.moving_mean)).sum())
    print("per_micro_step: moving mean, distance from 0 here / in Keras's fit:", round(float(ratio), 3))
    momentum = 0.99
    assert ratio == pytest.approx((1 - momentum ** (N * K * updates)) / (1 - momentum ** updates),
                                  rel=0.1)


# The compiled optimizer's own features, each at a strength where ignoring it would show.
OPTIMIZER_FEATURES = {
    "clipnorm": (keras.optimizers.Adam, dict(clipnorm=0.05)),
    "global_clipnorm": (keras.optimizers.Adam, dict(global_clipnorm=0.05)),
    "clipvalue": (keras.optimizers.Adam, dict(clipvalue=1e-3)),
    "weight_decay": (keras.optimizers.AdamW, dict(weight_decay=0.5)),
    "use_ema": (keras.optimizers.Adam, dict(use_ema=True, ema_momentum=0.9)),
    "ema_overwrite_frequency": (keras.optimizers.Adam,
                                dict(use_ema=True, ema_momentum=0.5, ema_overwrite_frequency=3)),
}


@pytest.mark.parametrize("feature,mode", [*((feature, "tower") for feature in OPTIMIZER_FEATURES),
                                          ("clipnorm", "mirrored"), ("weight_decay", "mirrored"),
                                          ("use_ema", "mirrored")])
def test_the_compiled_optimizers_clipping_decay_and_average_apply_as_in_kerass_fit(feature, mode):
    """Keras's Optimizer.apply clips, decays and averages; the update does the same to its mean
    gradient, so the weights equal Keras's fit at batch_size x accum, and differ from an
    optimizer without the feature."""
    make_optimizer, settings = OPTIMIZER_FEATURES[feature]
    make, loss, _ = CASES["softmax"]
    keras.utils.set_random_seed(5)
    initial = make().get_weights()
    x, y = data("softmax")
    trained = {}
    for name, kwargs in (("keras", settings), ("tower_train", settings), ("without", {})):
        model = make()
        model.set_weights(initial)
        model.compile(optimizer=make_optimizer(1e-2, **kwargs), loss=loss)
        if name == "keras":
            model.fit(x, y, batch_size=B * K, epochs=EPOCHS, shuffle=False, verbose=0)
        else:
            tower_train.keras.fit(model, x, y, batch_size=B, epochs=EPOCHS, shuffle=False,
                                  verbose=0, mode=mode, **LAYOUT)
        trained[name] = model.get_weights()
    for got, expected in zip(trained["tower_train"], trained["keras"], strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-6)
    assert max(np.abs(a - b).max() for a, b in zip(trained["without"], trained["keras"])) > 1e-3


def test_tower_train_fit_applies_adamws_weight_decay(tmp_path):
    """tower_train.fit(optimizer=AdamW(...)) trains to Keras's fit with that AdamW, not Adam's
    weights; a name excluded from the decay (exclude_from_weight_decay) is not decayed."""
    make, loss, _ = CASES["softmax"]
    keras.utils.set_random_seed(6)
    initial = make().get_weights()
    x, y = data("softmax")

    def adamw():
        optimizer = keras.optimizers.AdamW(1e-2, weight_decay=0.5)
        optimizer.exclude_from_weight_decay(var_names=["bias"])
        return optimizer

    reference = make()
    reference.set_weights(initial)
    reference.compile(optimizer=adamw(), loss=loss)
    reference.fit(x, y, batch_size=B * K, epochs=EPOCHS, shuffle=False, verbose=0)
    results = {}
    for name, optimizer in (("adamw", adamw()), ("adam", keras.optimizers.Adam(1e-2))):
        model = make()
        model.set_weights(initial)
        result = tower_train.fit(model=model, loss=loss, optimizer=optimizer, data=(x, y),
                                 shuffle=False, batch_size=B // N, max_steps=EPOCHS * EXAMPLES // (B * K),
                                 ema_decay=0.0, train_dir=str(tmp_path / name), **LAYOUT)
        results[name] = result.model.get_weights()
    for got, expected in zip(results["adamw"], reference.get_weights(), strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-6)
    assert np.abs(results["adam"][0] - results["adamw"][0]).max() > 1e-3


def test_an_optimizer_feature_spread_cannot_apply_is_one_usage_error_line(tmp_path):
    make, loss, _ = CASES["softmax"]
    x, y = data("softmax")
    with pytest.raises(tower_train.UsageError) as refused:
        tower_train.fit(model=make(), loss=loss, optimizer=keras.optimizers.Adam(clipvalue=0.5),
                        data=(x, y), ps_device="spread", train_dir=tmp_path / "run", **LAYOUT)
    assert str(refused.value) == (
        "optimizer=Adam(clipvalue=0.5): --ps_device=spread steps each device's slices with a copy "
        "of the optimizer that applies none of these; use --ps_device=cpu or gpu (or --clip_norm, "
        "--ema_decay)")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("towers,accum,batch_size", [(1, 1, 32), (2, 2, 64)])
def test_training_metrics_come_from_the_updates_own_training_pass(monkeypatch, towers, accum,
                                                                  batch_size):
    """The compiled metrics are updated inside the compiled update from the towers' outputs in
    training mode: a BatchNorm model's training accuracy is Keras's at batch_size x accum (on
    one tower exactly; on several, each normalizes its own share of the micro-batch, so to
    0.05), and the model's compute_metrics runs only when the update's functions are traced,
    never once per update."""
    def batchnorm():
        inputs = keras.Input((5,))
        hidden = keras.layers.BatchNormalization()(keras.layers.Dense(16)(inputs))
        outputs = keras.layers.Dense(3, activation="softmax")(keras.layers.Activation("relu")(hidden))
        return keras.Model(inputs, outputs)

    keras.utils.set_random_seed(8)
    initial = batchnorm().get_weights()
    rng = np.random.default_rng(8)
    examples, epochs = 512, 4
    x = rng.normal(size=(examples, 5)).astype(np.float32) * 3.0 + 2.0
    y = (x[:, 0] > 2.0).astype(np.int32) + (x[:, 1] > 2.0).astype(np.int32)
    options = dict(epochs=epochs, shuffle=False, verbose=0)
    want = compiled(batchnorm, initial, "sparse_categorical_crossentropy", ["accuracy"]).fit(
        x, y, batch_size=batch_size * accum, **options)
    model = compiled(batchnorm, initial, "sparse_categorical_crossentropy", ["accuracy"])
    calls = []
    compute_metrics = model.compute_metrics
    monkeypatch.setattr(model, "compute_metrics",
                        lambda *args, **kwargs: calls.append(1) or compute_metrics(*args, **kwargs))
    counted = keras.callbacks.LambdaCallback(on_epoch_end=lambda *_: epoch_calls.append(len(calls)))
    epoch_calls = []
    history = tower_train.keras.fit(model, x, y, batch_size=batch_size, num_gpus=towers,
                                    accum=accum, callbacks=[counted], **options)
    np.testing.assert_allclose(history.history["accuracy"], want.history["accuracy"],
                               atol=1e-6 if towers == 1 else 0.05)
    assert want.history["accuracy"][-1] > 0.7  # a model that learned
    # Called while the first update traced its functions, and never again.
    assert epoch_calls[0] > 0 and epoch_calls == [epoch_calls[0]] * epochs


@pytest.mark.parametrize("mode", ["tower", "mirrored"])
def test_a_mixed_float16_model_trains_with_the_runs_loss_scale(mode):
    """The mixed precision guide's recipe: a model made under mixed_float16 (float32 outputs),
    which compile() gives a LossScaleOptimizer. The run scales the loss itself, once per update,
    and steps with the inner optimizer: the loss and weights follow Keras's fit at batch_size x
    accum to float16's rounding, and the model's LossScaleOptimizer gets the run's state."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        def guide():
            inputs = keras.Input((5,))
            hidden = keras.layers.Dense(16, activation="relu")(inputs)
            logits = keras.layers.Dense(3)(hidden)
            return keras.Model(inputs, keras.layers.Activation("softmax", dtype="float32")(logits))

        keras.utils.set_random_seed(9)
        initial = guide().get_weights()
        x, y = data("two_inputs")[0]["a"], data("two_inputs")[1]
        x = np.concatenate([x, x[:, :1]], axis=1)  # 5 features
        options = dict(epochs=EPOCHS, shuffle=False, verbose=0)
        reference = compiled(guide, initial, "sparse_categorical_crossentropy")
        assert isinstance(reference.optimizer, keras.optimizers.LossScaleOptimizer)
        want = reference.fit(x, y, batch_size=B * K, **options)
        model = compiled(guide, initial, "sparse_categorical_crossentropy")
        history = tower_train.keras.fit(model, x, y, batch_size=B, mode=mode, **options, **LAYOUT)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    np.testing.assert_allclose(history.history["loss"], want.history["loss"], rtol=2e-3)
    for got, expected in zip(model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(got, expected, atol=2e-3)
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    assert int(model.optimizer.inner_optimizer.iterations) == EPOCHS * EXAMPLES // (B * K)


def test_a_layers_constraint_applies_after_each_update_as_in_kerass_fit():
    """Keras's Optimizer.apply projects a variable with its constraint after the step: a
    NonNeg kernel stays non-negative, at Keras's weights."""
    def constrained():
        inputs = keras.Input((5,))
        hidden = keras.layers.Dense(8, activation="tanh", kernel_constraint="non_neg")(inputs)
        return keras.Model(inputs, keras.layers.Dense(3, activation="softmax")(hidden))

    keras.utils.set_random_seed(12)
    initial = constrained().get_weights()
    x, y = data("softmax", seed=6)
    reference = compiled(constrained, initial, "categorical_crossentropy")
    reference.fit(x, y, batch_size=B * K, epochs=EPOCHS, shuffle=False, verbose=0)
    model = compiled(constrained, initial, "categorical_crossentropy")
    tower_train.keras.fit(model, x, y, batch_size=B, epochs=EPOCHS, shuffle=False, verbose=0,
                          **LAYOUT)
    assert model.get_weights()[0].min() >= 0.0 and initial[0].min() < 0.0
    for got, expected in zip(model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-6)
