"""keras-io examples run as scripts with their one `model.fit` call changed to
`tower_train.keras.fit` (issue 34), and README's MNIST convnet script run as written: each exits 0
with the History keys Keras's own fit gives. Apart from test_keras_fit.py, whose Keras fits it shares
nothing with, so that pytest-xdist's loadfile can give the two files to two workers."""
import re
import subprocess
import sys


def test_the_readme_keras_io_script_runs_with_its_one_changed_call(tmp_path):
    """keras-io's MNIST convnet as README.md gives it: exits 0, its History keyed as Keras's."""
    from test_models import python_block

    script = python_block("README.md", "## Keras users: `tower_train.keras.fit`")
    assert "tower_train.keras.fit(model, x_train, y_train, batch_size=batch_size" in script
    (tmp_path / "mnist_convnet.py").write_text(script)
    result = subprocess.run([sys.executable, "mnist_convnet.py"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "History: ['accuracy', 'loss', 'val_accuracy', 'val_loss']" in result.stdout, result.stdout
    assert "Epoch 2/2" in result.stdout and "Test accuracy:" in result.stdout
    assert list(tmp_path.iterdir()) == [tmp_path / "mnist_convnet.py"]  # no checkpoints left



# keras-io examples as their scripts, their data sets replaced by random arrays of the same shapes
# per example (fewer examples, smaller layers, fewer epochs), each run with Keras's own fit and,
# with one changed call, as a script on two towers: the same History keys. (The MNIST convnet is
# README.md's script, run above.)

TRANSFORMER_CLASSIFIER = """
import keras
import numpy as np
from keras import layers, ops


class TransformerBlock(layers.Layer):
    def __init__(self, embed_dim, num_heads, ff_dim, rate=0.1):
        super().__init__()
        self.att = layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.ffn = keras.Sequential(
            [layers.Dense(ff_dim, activation="relu"), layers.Dense(embed_dim)]
        )
        self.layernorm1 = layers.LayerNormalization(epsilon=1e-6)
        self.layernorm2 = layers.LayerNormalization(epsilon=1e-6)
        self.dropout1 = layers.Dropout(rate)
        self.dropout2 = layers.Dropout(rate)

    def call(self, inputs):
        attn_output = self.att(inputs, inputs)
        attn_output = self.dropout1(attn_output)
        out1 = self.layernorm1(inputs + attn_output)
        ffn_output = self.ffn(out1)
        ffn_output = self.dropout2(ffn_output)
        return self.layernorm2(out1 + ffn_output)


class TokenAndPositionEmbedding(layers.Layer):
    def __init__(self, maxlen, vocab_size, embed_dim):
        super().__init__()
        self.token_emb = layers.Embedding(input_dim=vocab_size, output_dim=embed_dim)
        self.pos_emb = layers.Embedding(input_dim=maxlen, output_dim=embed_dim)

    def call(self, x):
        maxlen = ops.shape(x)[-1]
        positions = ops.arange(start=0, stop=maxlen, step=1)
        positions = self.pos_emb(positions)
        x = self.token_emb(x)
        return x + positions


vocab_size = 200  # keras-io: 20000
maxlen = 20  # keras-io: 200
rng = np.random.default_rng(0)  # keras-io: keras.datasets.imdb.load_data, padded
x_train, y_train = rng.integers(0, vocab_size, (64, maxlen)), rng.integers(0, 2, 64)
x_val, y_val = x_train[:16], y_train[:16]

embed_dim = 8  # keras-io: 32
num_heads = 2
ff_dim = 8  # keras-io: 32

inputs = layers.Input(shape=(maxlen,))
embedding_layer = TokenAndPositionEmbedding(maxlen, vocab_size, embed_dim)
x = embedding_layer(inputs)
transformer_block = TransformerBlock(embed_dim, num_heads, ff_dim)
x = transformer_block(x)
x = layers.GlobalAveragePooling1D()(x)
x = layers.Dropout(0.1)(x)
x = layers.Dense(20, activation="relu")(x)
x = layers.Dropout(0.1)(x)
outputs = layers.Dense(2, activation="softmax")(x)

model = keras.Model(inputs=inputs, outputs=outputs)
model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
history = model.fit(
    x_train, y_train, batch_size=16, epochs=2, validation_data=(x_val, y_val)
)
print("History:", sorted(history.history))
"""

IMBALANCED_CLASSIFICATION = """
import keras
import numpy as np

rng = np.random.default_rng(1)  # keras-io: creditcard.csv's 29 feature columns
all_features = rng.normal(size=(96, 29)).astype("float32")
all_targets = (rng.random(96) < 0.1).astype("uint8")[:, None]

num_val_samples = int(len(all_features) * 0.2)
train_features = all_features[:-num_val_samples]
train_targets = all_targets[:-num_val_samples]
val_features = all_features[-num_val_samples:]
val_targets = all_targets[-num_val_samples:]

counts = np.bincount(train_targets[:, 0])
weight_for_0 = 1.0 / counts[0]
weight_for_1 = 1.0 / counts[1]

mean = np.mean(train_features, axis=0)
train_features -= mean
val_features -= mean
std = np.std(train_features, axis=0)
train_features /= std
val_features /= std

model = keras.Sequential(
    [
        keras.Input(shape=train_features.shape[1:]),
        keras.layers.Dense(16, activation="relu"),  # keras-io: 256 units
        keras.layers.Dense(16, activation="relu"),
        keras.layers.Dropout(0.3),
        keras.layers.Dense(16, activation="relu"),
        keras.layers.Dropout(0.3),
        keras.layers.Dense(1, activation="sigmoid"),
    ]
)

metrics = [
    keras.metrics.FalseNegatives(name="fn"),
    keras.metrics.FalsePositives(name="fp"),
    keras.metrics.TrueNegatives(name="tn"),
    keras.metrics.TruePositives(name="tp"),
    keras.metrics.Precision(name="precision"),
    keras.metrics.Recall(name="recall"),
]

model.compile(
    optimizer=keras.optimizers.Adam(1e-2), loss="binary_crossentropy", metrics=metrics
)

callbacks = [keras.callbacks.ModelCheckpoint("fraud_model_at_epoch_{epoch}.keras")]
class_weight = {0: weight_for_0, 1: weight_for_1}

history = model.fit(
    train_features,
    train_targets,
    batch_size=32,  # keras-io: 2048
    epochs=2,  # keras-io: 30
    verbose=2,
    callbacks=callbacks,
    validation_data=(val_features, val_targets),
    class_weight=class_weight,
)
print("History:", sorted(history.history))
"""

TIMESERIES_CLASSIFICATION = """
import keras
import numpy as np

rng = np.random.default_rng(2)  # keras-io: FordA's series of 500 steps, labels -1 and 1
x_train = rng.normal(size=(80, 50)).astype("float32")
y_train = rng.choice([-1, 1], 80)

x_train = x_train.reshape((x_train.shape[0], x_train.shape[1], 1))
num_classes = len(np.unique(y_train))
idx = rng.permutation(len(x_train))
x_train = x_train[idx]
y_train = y_train[idx]
y_train[y_train == -1] = 0


def make_model(input_shape):
    input_layer = keras.layers.Input(input_shape)

    conv1 = keras.layers.Conv1D(filters=8, kernel_size=3, padding="same")(input_layer)
    conv1 = keras.layers.BatchNormalization()(conv1)
    conv1 = keras.layers.ReLU()(conv1)

    conv2 = keras.layers.Conv1D(filters=8, kernel_size=3, padding="same")(conv1)
    conv2 = keras.layers.BatchNormalization()(conv2)
    conv2 = keras.layers.ReLU()(conv2)

    conv3 = keras.layers.Conv1D(filters=8, kernel_size=3, padding="same")(conv2)
    conv3 = keras.layers.BatchNormalization()(conv3)
    conv3 = keras.layers.ReLU()(conv3)

    gap = keras.layers.GlobalAveragePooling1D()(conv3)

    output_layer = keras.layers.Dense(num_classes, activation="softmax")(gap)

    return keras.models.Model(inputs=input_layer, outputs=output_layer)


model = make_model(input_shape=x_train.shape[1:])

epochs = 3  # keras-io: 500
batch_size = 16  # keras-io: 32

callbacks = [
    keras.callbacks.ModelCheckpoint(
        "best_model.keras", save_best_only=True, monitor="val_loss"
    ),
    keras.callbacks.ReduceLROnPlateau(
        monitor="val_loss", factor=0.5, patience=1, min_lr=0.0001
    ),
    keras.callbacks.EarlyStopping(monitor="val_loss", patience=5, verbose=1),
]
model.compile(
    optimizer="adam",
    loss="sparse_categorical_crossentropy",
    metrics=["sparse_categorical_accuracy"],
)
history = model.fit(
    x_train,
    y_train,
    batch_size=batch_size,
    epochs=epochs,
    callbacks=callbacks,
    validation_split=0.2,
    verbose=1,
)
print("History:", sorted(history.history))
"""

STRUCTURED_DATA_CLASSIFICATION = """
import keras
import numpy as np
import tensorflow as tf
from keras.utils import FeatureSpace

rng = np.random.default_rng(3)  # keras-io: heart.csv's 13 named columns and its target
n = 96
columns = {name: rng.integers(0, 4, n) for name in ("sex", "cp", "fbs", "restecg", "exang", "ca")}
columns.update({name: rng.normal(size=n).astype("float32")
                for name in ("age", "trestbps", "chol", "thalach", "oldpeak", "slope")})
columns["thal"] = rng.choice(["fixed", "normal", "reversible"], n)
target = rng.integers(0, 2, n)

train_ds = tf.data.Dataset.from_tensor_slices((columns, target))
val_ds = tf.data.Dataset.from_tensor_slices(
    ({name: values[:32] for name, values in columns.items()}, target[:32])
)
train_ds = train_ds.batch(32)
val_ds = val_ds.batch(32)

feature_space = FeatureSpace(
    features={
        "sex": FeatureSpace.integer_categorical(num_oov_indices=0),
        "cp": FeatureSpace.integer_categorical(num_oov_indices=0),
        "fbs": FeatureSpace.integer_categorical(num_oov_indices=0),
        "restecg": FeatureSpace.integer_categorical(num_oov_indices=0),
        "exang": FeatureSpace.integer_categorical(num_oov_indices=0),
        "ca": FeatureSpace.integer_categorical(num_oov_indices=0),
        "thal": FeatureSpace.string_categorical(num_oov_indices=0),
        "age": FeatureSpace.float_discretized(num_bins=3),  # keras-io: 30
        "trestbps": FeatureSpace.float_normalized(),
        "chol": FeatureSpace.float_normalized(),
        "thalach": FeatureSpace.float_normalized(),
        "oldpeak": FeatureSpace.float_normalized(),
        "slope": FeatureSpace.float_normalized(),
    },
    crosses=[FeatureSpace.cross(feature_names=("sex", "age"), crossing_dim=8)],
    output_mode="concat",
)
train_ds_with_no_labels = train_ds.map(lambda x, _: x)
feature_space.adapt(train_ds_with_no_labels)

preprocessed_train_ds = train_ds.map(
    lambda x, y: (feature_space(x), y), num_parallel_calls=tf.data.AUTOTUNE
)
preprocessed_train_ds = preprocessed_train_ds.prefetch(tf.data.AUTOTUNE)
preprocessed_val_ds = val_ds.map(
    lambda x, y: (feature_space(x), y), num_parallel_calls=tf.data.AUTOTUNE
)
preprocessed_val_ds = preprocessed_val_ds.prefetch(tf.data.AUTOTUNE)

encoded_features = feature_space.get_encoded_features()
x = keras.layers.Dense(32, activation="relu")(encoded_features)
x = keras.layers.Dropout(0.5)(x)
predictions = keras.layers.Dense(1, activation="sigmoid")(x)

training_model = keras.Model(inputs=encoded_features, outputs=predictions)
training_model.compile(optimizer="adam", loss="binary_crossentropy", metrics=["accuracy"])
history = training_model.fit(
    preprocessed_train_ds,
    epochs=2,  # keras-io: 20
    validation_data=preprocessed_val_ds,
    verbose=2,
)
print("History:", sorted(history.history))
"""

KERAS_IO_EXAMPLES = {"transformer_classifier": TRANSFORMER_CLASSIFIER,
                     "imbalanced_classification": IMBALANCED_CLASSIFICATION,
                     "timeseries_classification": TIMESERIES_CLASSIFICATION,
                     "structured_data_classification": STRUCTURED_DATA_CLASSIFICATION}


def with_one_changed_call(script: str) -> str:
    """The script as issue 34 runs it: tower_train imported and two towers' devices created at its
    top, its one `model.fit(ARGS)` made `tower_train.keras.fit(model, ARGS, num_gpus=2, accum=2)`;
    nothing else changed."""
    assert script.count(".fit(") == 1, script
    call = re.search(r"(\w+)\.fit\(", script)
    end, depth = call.end(), 1  # just past the call's closing parenthesis
    while depth:
        depth += {"(": 1, ")": -1}.get(script[end], 0)
        end += 1
    arguments = script[call.end():end - 1].strip().rstrip(",")
    return ("import tower_train\ntower_train.create_devices(num_gpus=2)\n" + script[:call.start()]
            + f"tower_train.keras.fit({call.group(1)}, {arguments}, num_gpus=2, accum=2)"
            + script[end:])


# One child runs the four scripts in turn, each as __main__ (a child each would import
# TensorFlow four times); create_devices finds the devices the first script made.
RUN_SCRIPTS = """
import runpy, sys
for path in sys.argv[1:]:
    print("== running", path, flush=True)
    runpy.run_path(path, run_name="__main__")
"""


def test_keras_io_examples_run_as_scripts_with_one_changed_call(tmp_path, monkeypatch):
    """Each example, run by Keras's own fit here, and with its one changed call as a script on
    two towers that exits 0: the same History keys (as each script prints them)."""
    want = {}
    for name, script in KERAS_IO_EXAMPLES.items():
        (tmp_path / "keras" / name).mkdir(parents=True)
        monkeypatch.chdir(tmp_path / "keras" / name)  # the files its callbacks write
        namespace = {"__name__": "__main__"}
        exec(compile(script, f"{name}.py", "exec"), namespace)
        want[name] = sorted(namespace["history"].history)
    monkeypatch.chdir(tmp_path)
    paths = []
    for name, script in KERAS_IO_EXAMPLES.items():
        paths.append(f"{name}.py")
        (tmp_path / paths[-1]).write_text(with_one_changed_call(script))
    assert "tower_train.keras.fit(training_model, preprocessed_train_ds," in (
        tmp_path / "structured_data_classification.py").read_text()
    result = subprocess.run([sys.executable, "-c", RUN_SCRIPTS, *paths], cwd=tmp_path,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    printed = dict(re.findall(r"== running (\w+)\.py\n.*?History: (\[.*?\])\n", result.stdout,
                              re.S))
    assert printed == {name: str(keys) for name, keys in want.items()}, result.stdout[-3000:]
    assert all("val_loss" in keys for keys in want.values())
