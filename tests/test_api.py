"""tower_train.fit's bad input: a UsageError of one line that names the culprit, raised before
anything is written; errors in the user's own model code name its file and line; the log lines a
script gets."""
import inspect
import logging
import os
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import tower_train
from tower_train import api, startup
from tower_train.config import TrainConfig
from test_cli_errors import run_cli


class FiveLogits(tower_train.TowerModel):
    """Logits [B, 5]: too few for labels up to 9."""

    def __init__(self, num_classes: int = 5, **kwargs):
        super().__init__(num_classes, **kwargs)
        self.logits = keras.layers.Dense(num_classes)

    def call(self, features, training=False):
        return self.logits(keras.layers.Flatten()(features))


class VectorRegularization(FiveLogits):
    def regularization(self):
        return tf.ones([3])


class BrokenInit(tower_train.TowerModel):
    def __init__(self, num_classes: int = 10, **kwargs):
        super().__init__(num_classes, **kwargs)
        raise RuntimeError("no weights today")


class NoWeights(tower_train.TowerModel):
    def __init__(self, num_classes: int = 10, **kwargs):
        super().__init__(num_classes, **kwargs)

    def call(self, features, training=False):
        return tf.zeros([tf.shape(features)[0], self.num_classes])


class TupleOutput(FiveLogits):
    def call(self, features, training=False):
        return super().call(features), features


class DictOutput(FiveLogits):
    def call(self, features, training=False):
        return {"logits": super().call(features)}


class BroadcastingLoss(FiveLogits):
    """A loss [B, 1] for labels [B]: against weights [B] it would broadcast to [B, B]."""

    def per_example_loss(self, labels, logits):
        return super().per_example_loss(labels, logits)[:, None]


class IntegerLogits(FiveLogits):
    def call(self, features, training=False):
        return tf.cast(super().call(features), tf.int32)


class BranchBuiltInTraining(FiveLogits):
    """Its `extra` layer is first called, so built, in training: after the optimizer is made."""

    def __init__(self, num_classes: int = 5, **kwargs):
        super().__init__(num_classes, **kwargs)
        self.extra = keras.layers.Dense(num_classes)

    def call(self, features, training=False):
        return super().call(features) + (self.extra(features) if training else 0.0)


class AddsLossInRecomputedBlock(FiveLogits):
    def call(self, features, training=False):
        return self.run_block(self._block, features, training)

    def _block(self, features, training=False):
        logits = self.logits(features)
        if training:
            self.add_loss(tf.reduce_mean(logits ** 2))
        return logits


def arrays(classes=10, n=16):
    rng = np.random.default_rng(0)
    return tower_train.ArraySource(rng.normal(size=(n, 4)).astype(np.float32),
                                   np.arange(n) % classes)


CASES = [
    (dict(accum=0), "--accum=0: must be a whole number >= 1"),
    (dict(learning_rate=float("inf")), "--learning_rate=inf: must be a finite number > 0"),
    (dict(seed=2**32), "--seed=4294967296: must be a whole number <= 4294967295"),
    (dict(no_such_option=1), "fit(): unknown option 'no_such_option'"),
    (dict(epochs=3), "fit(): epochs= is Keras's Model.fit argument, not an option of tower_train.fit "
                     "(max_steps counts updates); tower_train.keras.fit(model, ...) takes"),
    (dict(optimizer=keras.optimizers.SGD(0.5), learning_rate=0.1),
     "learning_rate=: is for --optimizer's rate; optimizer=SGD has its own"),
    (dict(optimizer=5), "optimizer=5: expected one of sgd, momentum, adam or a keras.optimizers.Optimizer"),
    (dict(optimizer=keras.optimizers.Adam(gradient_accumulation_steps=2)),
     "optimizer=Adam(gradient_accumulation_steps=2): the run accumulates micro-steps itself"),
    (dict(class_weight={0: 2.0}), "class_weight= is Keras's Model.fit argument, not an option of "
                                  "tower_train.fit (data=(x, y, w) weighs each label)"),
    (dict(model=42), "model=42: expected a registered name, a tower_train.TowerModel subclass"),
    (dict(model=dict), "model=builtins.dict: is not a subclass of tower_train.TowerModel"),
    (dict(model="no_such_net"), "--model=no_such_net: unknown; registered: "),
    (dict(data=[1, 2]), "data=list: expected a tower_train.ArraySource"),
    (dict(data="no_such_data"), "--dataset=no_such_data: unknown; registered: "),
    (dict(model=FiveLogits, data=arrays()),
     "model=test_api.FiveLogits: its logits are [1, 5] for labels [1] in 0..9 of arrays; they must be [1, C >= 10]"),
    (dict(model=VectorRegularization, data=arrays(classes=5)),
     "model=test_api.VectorRegularization: regularization() returned shape [3]; it must be a scalar"),
    (dict(model=BrokenInit, data=arrays()),
     "model=test_api.BrokenInit: " + __file__ + ":"),
    (dict(model=FiveLogits, data=arrays(classes=5), augment=True),
     "augment: is for a named --dataset; data=arrays was given as a source"),
    (dict(mode="central_storage", model="resnet20"), "--mode=central_storage: --model=resnet20 has moving statistics"),
    # Options of the wrong Python type.
    (dict(accum="8"), "accum='8': must be a whole number, not a str"),
    (dict(batch_size=2.5), "batch_size=2.5: must be a whole number, not a float"),
    (dict(learning_rate="fast"), "learning_rate='fast': must be a number, not a str"),
    (dict(deterministic=1), "deterministic=1: must be True or False, not a int"),
    (dict(export_dir=3), "export_dir=3: must be a path, not a int"),
    # The model.
    (dict(model=FiveLogits(), data=arrays(classes=5)),
     "model=test_api.FiveLogits instance: pass the class (model=test_api.FiveLogits) or a zero-argument callable"),
    (dict(model=NoWeights, data=arrays()), "model=test_api.NoWeights: has no trainable variables"),
    (dict(model=TupleOutput, data=arrays(classes=5)),
     "model=test_api.TupleOutput, called on float32 [1, 4]: returned a tuple; call() must return one tensor"),
    (dict(model=DictOutput, data=arrays(classes=5)), "returned a dict; call() must return one tensor"),
    # Training that would be silently wrong.
    (dict(model=BroadcastingLoss, data=arrays(classes=5)),
     "model=test_api.BroadcastingLoss: per_example_loss returned shape [1, 1] for labels [1]; it must "
     "return one loss per label, the labels' shape exactly"),
    (dict(model=IntegerLogits, data=arrays(classes=5)),
     "model=test_api.IntegerLogits: none of its 2 trainable variables gets a gradient from the loss"),
    (dict(model=BranchBuiltInTraining, data=arrays(classes=5)),
     "model=test_api.BranchBuiltInTraining: makes variables in training that its first call "
     "(training=False) did not make (kernel)"),
    (dict(model=AddsLossInRecomputedBlock, data=arrays(classes=5), recompute=True),
     "--recompute: model=test_api.AddsLossInRecomputedBlock adds losses of the batch through Keras "
     "(add_loss, activity_regularizer), which a recomputed block would drop"),
]


@pytest.mark.parametrize("arguments,message", CASES, ids=[m[:40] for _, m in CASES])
def test_bad_input_to_fit_is_one_usage_error_line_and_writes_nothing(tmp_path, arguments, message):
    train_dir = tmp_path / "run"
    with pytest.raises(tower_train.UsageError) as error:
        tower_train.fit(train_dir=str(train_dir), num_gpus=2, max_steps=1, **arguments)
    assert message in str(error.value) and "\n" not in str(error.value), error.value
    assert not train_dir.exists()


def test_registered_names_go_into_the_config_and_objects_come_back_as_given():
    options = {"train_dir": "/unused", "batch_size": 4}
    config, model, data = startup.config_and_objects("tiny_transformer", "markov_text", options)
    assert (config.model, config.dataset, config.batch_size, model, data) == (
        "tiny_transformer", "markov_text", 4, None, None)
    source = arrays()
    config, model, data = startup.config_and_objects(FiveLogits, source, {"train_dir": "/unused"})
    assert (config.model, config.dataset, model, data) == ("cifar10_cnn", "synthetic", FiveLogits, source)


X, Y = np.zeros((4, 3), np.float32), np.arange(4)
DATA_CASES = [
    (dict(data=tf.data.Dataset.range(3)), "data=_RangeDataset: expected a tower_train.ArraySource, "
     "TFRecordSource, DatasetSource or another tower_train.data.source.Source, or numpy arrays (x, y) or "
     "(x, y, w) (or leave it out and name --dataset) (wrap a tf.data pipeline as "
     "DatasetSource(train=lambda: ...))"),
    (dict(data=arrays(), data_dir="/data"),
     "data_dir: is for a named --dataset; data=arrays was given as a source (augment in its preprocess)"),
    (dict(data=(X, Y), data_module="my_data"),
     "data_module: is for a named --dataset; data=arrays was given as a source (augment in its preprocess)"),
    (dict(data=(X,)), "data=: expected a tuple (x, y) or (x, y, w) of numpy arrays, got tuple of 1"),
    (dict(data=(X, Y), eval_data=[X, Y]), "eval_data=: expected a tuple (x, y) or (x, y, w) of numpy "
                                           "arrays, got list"),
    (dict(data=(X, Y), shuffle=1), "shuffle=1: must be True or False"),
    (dict(data=None, eval_data=(X, Y)), "eval_data=: is for data=(x, y) or (x, y, w) numpy arrays; "
     "data=None (a --dataset) is not (a source has its own held-out set and shuffling: "
     "ArraySource(eval_features=..., shuffle=...))"),
]


@pytest.mark.parametrize("arguments,message", DATA_CASES, ids=[m[:40] for _, m in DATA_CASES])
def test_bad_data_arguments_are_one_usage_error_line(arguments, message):
    """`array_source` then `check_data`, as fit calls them, before anything is loaded."""
    options = dict(arguments)
    data, eval_data, shuffle = (options.pop(key, None) for key in ("data", "eval_data", "shuffle"))
    config = TrainConfig(train_dir="/unused", **options)
    with pytest.raises(tower_train.UsageError) as error:
        startup.check_data(config, startup.array_source(data, eval_data, shuffle, None))
    assert str(error.value) == message


def test_a_train_dir_of_another_run_is_refused_naming_a_fresh_one(tmp_path):
    run = tmp_path / "run"
    options = dict(model=FiveLogits, data=arrays(classes=5), train_dir=str(run), num_gpus=2,
                   batch_size=4, max_steps=1)
    assert tower_train.fit(**options).step == 1
    (tmp_path / "run_2").mkdir()  # taken: the suggestion skips it
    before = sorted(os.listdir(run))
    with pytest.raises(tower_train.UsageError) as error:
        tower_train.fit(**{**options, "seed": 1, "max_steps": 2})
    assert "holds another run: seed 0 there, 1 here" in str(error.value)
    assert str(error.value).endswith(f"or add --train_dir={tmp_path / 'run_3'}")
    assert sorted(os.listdir(run)) == before


def test_an_error_in_a_models_own_code_is_one_line_unless_a_traceback_is_asked_for(tmp_path):
    (tmp_path / "broken_models.py").write_text(
        "from tower_train.models import TowerModel, register\n\n\n"
        "@register('broken')\n"
        "class Broken(TowerModel):\n"
        "    def call(self, images, training=False):\n"
        "        return images[:, 99999]\n")
    args = ["--model_module=broken_models", "--model=broken", f"--train_dir={tmp_path / 'run'}"]
    result = run_cli(*args, cwd=tmp_path)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith(f"tower_train: error: --model=broken, called on float32 [1, 24, 24, 3]: "
                               f"{tmp_path / 'broken_models.py'}:7: ")
    shown = run_cli(*args, cwd=tmp_path, env={"TOWER_TRAIN_TRACEBACK": "1"})
    assert shown.returncode == 2 and "Traceback (most recent call last)" in shown.stderr
    assert not (tmp_path / "run").exists()


class CallsNumpy(FiveLogits):
    def call(self, features, training=False):
        scale = float(features.numpy().std())  # eager only
        return super().call(features) * scale


class BranchesOnATensor(FiveLogits):
    def call(self, features, training=False):
        if tf.reduce_sum(features) > 0:  # a Python if on a tensor: eager only
            return super().call(features)
        return -super().call(features)


class BranchesInItsLoss(FiveLogits):
    def per_example_loss(self, labels, logits):
        if tf.reduce_sum(logits) > 0:  # a Python if on a tensor: eager only, as in Keras's fit
            return super().per_example_loss(labels, logits)
        return super().per_example_loss(labels, -logits)


class FailsInTraining(FiveLogits):
    def call(self, features, training=False):
        if training:
            raise NotImplementedError("dropout is not written yet")
        return super().call(features)


def line_of(cls, text):
    source, first = inspect.getsourcelines(cls)
    return first + next(i for i, line in enumerate(source) if text in line)


TRACING = [(CallsNumpy, "features.numpy()", "AttributeError: 'SymbolicTensor' object has no attribute 'numpy'"),
           (BranchesOnATensor, "if tf.reduce_sum", "OperatorNotAllowedInGraphError: Using a symbolic `tf.Tensor` as a Python `bool`"),
           (BranchesInItsLoss, "if tf.reduce_sum", "OperatorNotAllowedInGraphError: Using a symbolic `tf.Tensor` as a Python `bool`"),
           (FailsInTraining, "raise NotImplementedError", "NotImplementedError: dropout is not written yet")]


@pytest.mark.parametrize("mode", ["tower", "mirrored"])
@pytest.mark.parametrize("model,line,reason", TRACING, ids=[m.__name__ for m, _, _ in TRACING])
def test_an_error_while_tracing_the_models_training_call_is_one_line_naming_its_file_and_line(
        tmp_path, mode, model, line, reason):
    """The first call (training=False) runs eagerly and passes; the towers trace `call` with
    training=True, and the loss, as written (no AutoGraph, as in Keras's fit), which is checked
    when the model is built."""
    train_dir = tmp_path / "run"
    with pytest.raises(tower_train.UsageError) as error:
        tower_train.fit(model=model, data=arrays(classes=5), train_dir=train_dir, mode=mode,
                        num_gpus=2, batch_size=4, max_steps=1)
    assert str(error.value) == (f"model=test_api.{model.__name__}, traced for training on float32 "
                                f"[1, 4]: {__file__}:{line_of(model, line)}: " + str(error.value).split(
                                    f"{line_of(model, line)}: ", 1)[1]), error.value
    assert reason in str(error.value) and "\n" not in str(error.value), error.value
    assert not train_dir.exists()


class UnusedLayer(FiveLogits):
    def __init__(self, num_classes: int = 5, **kwargs):
        super().__init__(num_classes, **kwargs)
        self.unused = keras.layers.Dense(3, name="unused")
        self.unused.build((None, 4))


def test_variables_that_get_no_gradient_are_named_at_the_start_and_a_pathlib_train_dir_is_taken(
        tmp_path, caplog):
    result = tower_train.fit(model=UnusedLayer, data=arrays(classes=5), train_dir=tmp_path / "run",
                             num_gpus=2, batch_size=4, max_steps=1)
    assert result.step == 1 and (tmp_path / "run" / "tower_train_run.json").exists()
    warnings = [r.getMessage() for r in caplog.records if "no gradient" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].startswith(
        "model=test_api.UnusedLayer: 2 of 4 trainable variables get no gradient from the loss and "
        "will not change: "), warnings
    assert [name.split("/")[-2:] for name in warnings[0].split(": ")[-1].split(", ")] == [
        ["unused", "kernel"], ["unused", "bias"]]


def test_a_dangling_symlink_as_train_dir_is_one_line(tmp_path):
    (tmp_path / "run").symlink_to(tmp_path / "gone")
    with pytest.raises(tower_train.UsageError) as error:
        tower_train.fit(model=FiveLogits, data=arrays(classes=5), train_dir=tmp_path / "run")
    assert str(error.value) == (f"--train_dir={tmp_path / 'run'}: is a symbolic link to "
                                f"{tmp_path / 'gone'}, which does not exist; make that directory or "
                                "name another train_dir")
    assert not (tmp_path / "gone").exists()


def test_fit_options_of_a_wrong_type_are_one_line(tmp_path):
    with pytest.raises(tower_train.UsageError) as error:
        tower_train.fit(model=FiveLogits, data=arrays(classes=5), train_dir=tmp_path / "run", num_gpus=2.5)
    assert str(error.value) == "num_gpus=2.5: must be a whole number, not a float"


def test_a_tracing_error_in_a_model_module_given_as_a_path_is_one_line_from_the_command_line(tmp_path):
    (tmp_path / "eager_models.py").write_text(
        "from tower_train.models import TowerModel, register\n"
        "import keras\n\n\n"
        "@register('eager_only')\n"
        "class EagerOnly(TowerModel):\n"
        "    def __init__(self, num_classes, **kwargs):\n"
        "        super().__init__(num_classes, **kwargs)\n"
        "        self.logits = keras.layers.Dense(num_classes)\n\n"
        "    def call(self, images, training=False):\n"
        "        return self.logits(images[:, 0, 0]) * float(images.numpy().max())\n")
    args = ["--model_module=./eager_models.py", "--model=eager_only", f"--train_dir={tmp_path / 'run'}"]
    result = run_cli(*args, cwd=tmp_path)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0] == (f"tower_train: error: --model=eager_only, traced for training on float32 "
                        f"[1, 24, 24, 3]: {tmp_path / 'eager_models.py'}:12: AttributeError: "
                        "'SymbolicTensor' object has no attribute 'numpy'")
    assert not (tmp_path / "run").exists()


def test_a_script_whose_stderr_is_no_terminal_gets_a_progress_line_every_log_every_and_the_resume(
        tmp_path, caplog, monkeypatch):
    """absl's logger at WARNING, as a script leaves it (and TensorFlow after saving a SavedModel),
    would drop fit's INFO lines; stderr a file, so no live line. fit logs them anyway, through
    absl's logger as the command line does, and leaves its level as it was."""
    from absl import logging as absl_logging

    absl = absl_logging.get_absl_logger()
    level = absl.level
    absl.setLevel(logging.WARNING)
    options = dict(model=FiveLogits, data=arrays(classes=5), num_gpus=2, batch_size=4,
                   log_every=2, train_dir=tmp_path / "run")
    lines = []
    try:
        with (tmp_path / "stderr").open("w") as stderr:
            monkeypatch.setattr(sys, "stderr", stderr)
            for max_steps in (3, 5):
                caplog.clear()
                tower_train.fit(max_steps=max_steps, **options)
                lines.append([r.getMessage() for r in caplog.records
                              if r.name == "absl" and r.levelno == logging.INFO])
                assert absl.level == logging.WARNING
            monkeypatch.undo()
    finally:
        absl.setLevel(level)
    steps = [[line.split(",")[0] for line in run if line.startswith("step ") and "loss = " in line]
             for run in lines]
    # Each process's first update (untimed), then every log_every and the last (max_steps).
    assert steps == [["step 1", "step 2", "step 3"], ["step 4", "step 5"]], lines
    assert f"resumed from {tmp_path / 'run' / 'ckpt-3'} at step 3" in lines[1]
    assert not any(line.startswith("resumed from") for line in lines[0])
    assert any(line.startswith("done: step 5") for line in lines[1])


def test_fit_on_fewer_towers_than_create_devices_made_says_so_naming_num_gpus(
        tmp_path, caplog, monkeypatch):
    """create_devices(num_gpus=2), then fit without num_gpus: one tower trains, and one warning
    line says so and names the option; a fit with num_gpus=2 says nothing."""
    monkeypatch.setattr(api, "_created_num_gpus", None)  # this process's earlier calls aside
    tower_train.create_devices(num_gpus=2)
    for num_gpus, said in ((None, True), (2, False)):
        caplog.clear()
        layout = {} if num_gpus is None else {"num_gpus": num_gpus}
        result = tower_train.fit(model=FiveLogits, data=arrays(classes=5), batch_size=4,
                                 max_steps=1, train_dir=tmp_path / f"run{num_gpus}", **layout)
        assert result.step == 1
        warnings = [r.getMessage() for r in caplog.records if "create_devices" in r.getMessage()]
        assert warnings == ([
            "fit: trains on num_gpus=1, where create_devices made the devices for num_gpus=2; "
            "pass num_gpus=2 to fit to train on them"] if said else [])


def test_tensorflows_own_info_lines_stay_dropped_where_fit_shows_its_own(caplog):
    """log_shown raises absl's logger to INFO for the run's lines; TensorFlow's INFO lines (its
    "Sharding callback duration" at every checkpoint) stay below the script's level, the
    script's own INFO lines through absl are shown as the run's are."""
    from absl import logging as absl_logging

    absl = absl_logging.get_absl_logger()
    level = absl.level
    absl.setLevel(logging.WARNING)
    tensorflows = os.path.join(os.path.dirname(tf.__file__), "python", "checkpoint",
                               "functional_saver.py")
    try:
        with api.log_shown():
            caplog.clear()
            absl.handle(absl.makeRecord("absl", logging.INFO, tensorflows, 440,
                                        "Sharding callback duration: %s microseconds", (7,), None))
            absl.handle(absl.makeRecord("absl", logging.WARNING, tensorflows, 1, "TF's warning",
                                        (), None))
            absl_logging.info("the script's own line")
        assert absl.level == logging.WARNING and not absl.filters
    finally:
        absl.setLevel(level)
    assert [r.getMessage() for r in caplog.records if r.name == "absl"] == [
        "TF's warning", "the script's own line"]


def test_the_import_paths_the_docs_have_shown_users_keep_working():
    """The modules moved into packages (tower_train/data, step, training, workers); what README
    and docs/ gave users to import still names the same objects."""
    import tower_train.data
    from tower_train.data.array_source import ArraySource
    from tower_train.data.source import Source, register
    from tower_train.data.tf_dataset import DatasetSource
    from tower_train.data.tfrecord import TFRecordSource
    from tower_train.data.tfrecord_writer import write_examples
    from tower_train.tfrecord_source import TFRecordSource as old_path_source
    from tower_train.tfrecord_source import write_examples as old_path_writer

    assert (old_path_source, old_path_writer) == (TFRecordSource, write_examples)
    assert (tower_train.data.register, tower_train.data.Source, tower_train.data.ArraySource,
            tower_train.data.write_examples) == (register, Source, ArraySource, write_examples)
    assert (tower_train.ArraySource, tower_train.Source, tower_train.DatasetSource,
            tower_train.TFRecordSource) == (ArraySource, Source, DatasetSource, TFRecordSource)
    assert tower_train.keras.fit.__module__ == "tower_train.keras.model_fit"  # the package tower_train/keras/
