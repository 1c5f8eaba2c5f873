"""`tower_train.DatasetSource` (tower_train/data/tf_dataset.py): a tf.data pipeline trains a Keras model
to the weights of Keras's own `fit` on the same examples, in two layouts of one G; resumes bit for
bit; its stream is cut the same way by any batch, a resume and the workers' shards; and bad input
is one UsageError line with nothing written."""
import inspect

import keras
import numpy as np
import pytest
import tensorflow as tf

import tower_train
from tower_train.data.tf_dataset import DatasetSource
from test_cli_errors import run_cli
from keras_reference import (CLASSES, EXAMPLES, FEATURES, SGD_OPTIONS, UPDATES, arrays, assert_same_weights,
                             functional, keras_fit, sequential, with_weights)


def in_order() -> tf.data.Dataset:
    return tf.data.Dataset.from_tensor_slices(arrays())


def shuffled() -> tf.data.Dataset:
    """Every epoch another order (reshuffle_each_iteration), fixed by the shuffle's own seed."""
    return tf.data.Dataset.from_tensor_slices(arrays()).shuffle(EXAMPLES, seed=7)


def tower_fit(model, loss, train_dir, layout, train=in_order, **options):
    towers, batch, accum = layout
    return tower_train.fit(model=model, loss=loss, data=tower_train.DatasetSource(train=train),
                           num_gpus=towers, batch_size=batch, accum=accum, train_dir=train_dir,
                           **{**SGD_OPTIONS, **options})


@pytest.mark.parametrize("layout", [(2, 6, 2), (1, 6, 4)], ids=["2x6x2", "1x6x4"])
def test_a_pipeline_trains_a_sequential_to_the_weights_of_kerass_own_fit_in_any_layout(tmp_path, layout):
    keras.utils.set_random_seed(1)
    initial = sequential().get_weights()
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    expected = keras_fit(sequential, initial, loss)
    model = with_weights(sequential, initial)
    assert tower_fit(model, loss, tmp_path / "run", layout).step == UPDATES
    assert_same_weights(model.get_weights(), expected)
    assert np.abs(model.get_weights()[0] - initial[0]).max() > 1e-2  # it trained


def test_a_pipeline_trains_a_functional_model_to_the_weights_of_kerass_own_fit(tmp_path):
    keras.utils.set_random_seed(2)
    initial = functional().get_weights()
    expected = keras_fit(functional, initial, "sparse_categorical_crossentropy")
    model = with_weights(functional, initial)
    tower_fit(model, "sparse_categorical_crossentropy", tmp_path / "run", (3, 4, 2))
    assert_same_weights(model.get_weights(), expected)


def test_a_shuffled_pipeline_resumes_bit_for_bit(tmp_path):
    """2 updates, then a resume to 4 (into the second epoch, in another order): 4 straight."""
    keras.utils.set_random_seed(4)
    initial = sequential().get_weights()
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    options = dict(layout=(2, 6, 2), train=shuffled, deterministic=True, max_steps=4)
    straight = tower_fit(with_weights(sequential, initial), loss, tmp_path / "straight", **options)
    tower_fit(with_weights(sequential, initial), loss, tmp_path / "resumed", **{**options, "max_steps": 2})
    resumed = tower_fit(sequential(), loss, tmp_path / "resumed", **options)
    assert resumed.step == 4 and resumed.history["step"] == [4]
    for got, want in zip(resumed.model.get_weights(), straight.model.get_weights(), strict=True):
        np.testing.assert_array_equal(got, want)


def test_a_batched_pipeline_trains_as_its_examples_unbatched_and_resumes_bit_for_bit(tmp_path):
    """Batches of 10 (the last of each epoch 2), shuffled each epoch, and batches of 5 held out,
    against the same pipelines unbatched; then 2 updates and a resume to 4 from the batched one."""
    keras.utils.set_random_seed(5)
    initial = sequential().get_weights()
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    held_out = lambda: tf.data.Dataset.from_tensor_slices(arrays(10, seed=1))  # noqa: E731

    def fit(train, eval, train_dir, **options):  # noqa: A002
        return tower_train.fit(model=with_weights(sequential, initial), loss=loss,
                               data=tower_train.DatasetSource(train=train, eval=eval),
                               num_gpus=2, batch_size=6, accum=2, train_dir=train_dir,
                               **{**SGD_OPTIONS, "deterministic": True, "max_steps": 4, **options})

    examples = fit(shuffled, held_out, tmp_path / "examples")
    batched = fit(lambda: shuffled().batch(10), lambda: held_out().batch(5), tmp_path / "batched")
    assert batched.step == 4 and batched.eval_examples == examples.eval_examples == 10
    assert batched.eval_loss == examples.eval_loss
    for got, want in zip(batched.model.get_weights(), examples.model.get_weights(), strict=True):
        np.testing.assert_array_equal(got, want)
    assert np.abs(batched.model.get_weights()[0] - initial[0]).max() > 1e-2  # it trained
    fit(lambda: shuffled().batch(10), None, tmp_path / "resumed", max_steps=2)
    resumed = fit(lambda: shuffled().batch(10), None, tmp_path / "resumed")
    assert resumed.step == 4
    for got, want in zip(resumed.model.get_weights(), examples.model.get_weights(), strict=True):
        np.testing.assert_array_equal(got, want)


def stream(source, batches, **arguments):
    """The labels of the first `batches` batches of a training stream, and its features."""
    taken = list(source.train_stream(seed=3, **arguments).take(batches).as_numpy_iterator())
    return (np.concatenate([labels for _, labels, _ in taken]),
            np.concatenate([features for features, _, _ in taken]))


def test_the_stream_is_the_pipelines_order_cut_the_same_by_any_batch_resume_or_shard():
    source = tower_train.DatasetSource(train=shuffled)
    labels, features = stream(source, 12, start_position=0, micro_batch=12)  # 2 epochs
    # The pipeline's passes one after the other, as Dataset.repeat makes them: epoch 1 is the
    # second pass, another permutation of the examples.
    passes = np.stack([f for f, _ in shuffled().repeat(2).as_numpy_iterator()])
    np.testing.assert_array_equal(features, passes)
    assert not np.array_equal(features[:EXAMPLES], features[EXAMPLES:])
    assert sorted(map(tuple, features[EXAMPLES:])) == sorted(map(tuple, arrays()[0]))
    # Another micro-batch, and a resume inside the first and the second epoch, read the same stream.
    np.testing.assert_array_equal(stream(source, 16, start_position=0, micro_batch=9)[0], labels[:144])
    for start in (30, 100):
        np.testing.assert_array_equal(stream(source, 4, start_position=start, micro_batch=8)[0],
                                      labels[start:start + 32])
    # Two workers' shards of micro-batch 4, interleaved, are the one-process stream of 8.
    shards = [stream(source, 5, start_position=30, micro_batch=4, shard_index=i, num_shards=2)[0]
              for i in range(2)]
    interleaved = np.stack([s.reshape(5, 4) for s in shards], axis=1).reshape(-1)
    np.testing.assert_array_equal(interleaved, labels[30:70])
    assert (source.num_classes, source.train_size) == (CLASSES, EXAMPLES)


def test_held_out_examples_are_read_once_in_order_count_toward_the_classes_and_are_checked():
    held_x = np.arange(10 * FEATURES, dtype=np.float32).reshape(10, FEATURES)
    held_y = np.array([0, 1, 2, 3, 4, 0, 1, 2, 3, 4])  # 3 and 4 only here: train's labels are 0..2
    held_w = np.array([0, 1, 2, 0, 1, 2, 0, 1, 2, 5])  # integers, handed over as float32

    def held_out():
        return tf.data.Dataset.from_tensor_slices((held_x, held_y, held_w))

    source = DatasetSource(train=in_order, eval=held_out)
    assert arrays()[1].max() == CLASSES - 1
    assert (source.num_classes, source.train_size) == (5, EXAMPLES)
    batches = list(source.eval_batches(4).as_numpy_iterator())
    assert [len(labels) for _, labels, _ in batches] == [4, 4, 2]
    features, labels, weights = (np.concatenate(part) for part in zip(*batches))
    np.testing.assert_array_equal(features, held_x)
    assert labels.dtype == np.int32 and labels.tolist() == held_y.tolist()
    assert weights.dtype == np.float32 and weights.tolist() == held_w.tolist()
    assert list(DatasetSource(train=in_order).eval_batches(4).as_numpy_iterator()) == []  # no eval=
    # Told 3 classes, it finds label 3 as it reads.
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"dataset: eval\(\) has a label outside 0\.\.2"):
        list(DatasetSource(train=in_order, eval=held_out, num_classes=3).eval_batches(4).as_numpy_iterator())


def infinite():
    return in_order().repeat()


def labelled(labels, *rest):
    return lambda: tf.data.Dataset.from_tensor_slices((arrays()[0], labels, *rest))


_, LABELS = arrays()
TRAIN = "DatasetSource(train=test_tf_dataset."
LABELLED = f"{TRAIN}labelled.<locals>.<lambda>)"
BAD = [
    (dict(train=lambda: tf.data.Dataset.from_tensor_slices({"x": arrays()[0], "y": LABELS})),
     f"{TRAIN}<lambda>): train() yields a dict (x, y): expected (features, labels) or "
     "(features, labels, weights) tensors"),
    (dict(train=labelled(LABELS, LABELS, LABELS)),
     f"{LABELLED}: train() yields a tuple of 4 (float32 [6], int64 [], int64 [], int64 [])"),
    (dict(train=labelled(LABELS.astype(np.float32))),
     f"{LABELLED}: train()'s labels are float32 []: class labels must be integers"),
    (dict(train=labelled(LABELS, np.ones((EXAMPLES, 2), np.float32))),
     f"{LABELLED}: train()'s weights are float32 [2]: they must be numbers of the labels' shape []"),
    (dict(train="train.tfrecord"), "DatasetSource(train='train.tfrecord'): must be a zero-argument "
                                   "callable returning a tf.data.Dataset"),
    (dict(train=lambda: in_order().batch(8).map(lambda x, y: (tf.reduce_sum(x), tf.reduce_max(y)))),
     f"{TRAIN}<lambda>): train() returns a batched dataset (BatchDataset: .batch, .padded_batch, "
     ".ragged_batch or a bucketing) that cannot be unbatched into examples"),
    (dict(train=lambda: arrays()), f"{TRAIN}<lambda>): train() returned tuple, not a tf.data.Dataset"),
    (dict(train=lambda: in_order().shuffle(EXAMPLES)),
     f"{TRAIN}<lambda>): train() is not deterministic: two calls gave different examples among "
     "the first 16 (a shuffle without a seed?"),
    (dict(train=infinite), f"{TRAIN}infinite): train() is infinite, so its labels cannot be "
                           "counted: give DatasetSource(num_classes=...)"),
]


@pytest.mark.parametrize("arguments,message", BAD, ids=[m[m.index("): ") + 3:][:40] for _, m in BAD])
def test_bad_pipelines_are_one_usage_error_line_naming_them_and_write_nothing(tmp_path, arguments, message):
    train_dir = tmp_path / "run"
    with pytest.raises(tower_train.UsageError) as error:
        tower_train.fit(model=sequential(), loss="sparse_categorical_crossentropy",
                        data=tower_train.DatasetSource(**arguments), train_dir=train_dir,
                        num_gpus=2, batch_size=4, max_steps=1)
    assert message in str(error.value) and "\n" not in str(error.value), error.value
    assert not train_dir.exists()


def failing_at_40() -> tf.data.Dataset:
    """arrays()'s examples in order, through a py_function that raises on example 40 (the first
    of update 6 at G = 8)."""
    features, labels = arrays()

    def check(index):
        if int(index) == 40:
            raise RuntimeError(f"example {int(index)} is unreadable")
        return index

    checked = tf.data.Dataset.range(EXAMPLES).map(lambda i: tf.ensure_shape(tf.py_function(check, [i], tf.int64), []))
    return checked.map(lambda i: (tf.gather(features, i), tf.gather(labels, i)))


# At K = 4 the update reads its micro-batches inside one call after the first (TowerStep.run_update).
@pytest.mark.parametrize("accum", [1, 4])
def test_a_pipeline_that_raises_mid_run_is_one_training_error_naming_it_with_the_checkpoints_kept(tmp_path, accum):
    train_dir = tmp_path / "run"
    with pytest.raises(tower_train.TrainingError) as error:
        tower_train.fit(model=sequential(), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                        data=tower_train.DatasetSource(train=failing_at_40, num_classes=CLASSES),
                        train_dir=train_dir, num_gpus=2, batch_size=4 // accum, accum=accum, max_steps=8,
                        checkpoint_every=1)
    assert str(error.value) == ("update 6 failed in the input pipeline: RuntimeError: example 40 is unreadable; "
                                f"the last good checkpoint is {train_dir / 'ckpt-5'}")
    assert int(tf.train.load_variable(str(train_dir / "ckpt-5"), "step/.ATTRIBUTES/VARIABLE_VALUE")) == 5


FAILING_MODULE = f"""
import keras
import numpy as np
import tensorflow as tf

import tower_train
from tower_train.models import register

EXAMPLES, FEATURES, CLASSES = {EXAMPLES}, {FEATURES}, {CLASSES}

{inspect.getsource(arrays)}
{inspect.getsource(failing_at_40)}

@tower_train.data.source.register("test_failing_at_40")
def failing():
    return tower_train.DatasetSource(train=failing_at_40, num_classes=CLASSES, name="failing")


@register("test_dense", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
def dense():
    return keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(CLASSES)])
"""


def test_a_pipeline_that_raises_mid_run_is_one_line_and_exit_1_from_the_command_line(tmp_path):
    (tmp_path / "failing_data.py").write_text(FAILING_MODULE)
    train_dir = tmp_path / "run"
    done = run_cli("--data_module=failing_data", "--dataset=test_failing_at_40", "--model_module=failing_data",
                   "--model=test_dense", "--num_gpus=2", "--batch_size=4", "--max_steps=8", "--checkpoint_every=1",
                   f"--train_dir={train_dir}", cwd=tmp_path)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1] == (
        "tower_train: update 6 failed in the input pipeline: RuntimeError: example 40 is unreadable; "
        f"the last good checkpoint is {train_dir / 'ckpt-5'}")
    assert (train_dir / "ckpt-5.index").exists()
