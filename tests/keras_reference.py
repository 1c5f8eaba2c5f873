"""The small Keras problem that tests/test_keras_models.py and tests/test_tf_dataset.py both
train: its arrays, a Sequential and a functional model with an L2 penalty, Keras's own `fit` on it
as the reference, and the comparison of weights with it."""
import keras
import numpy as np

CLASSES, FEATURES, EXAMPLES = 3, 6, 72
G, UPDATES = 24, 6  # 2 epochs of 3 updates
LR = 0.3
# fit's options for the reference's optimizer: SGD at a constant rate, no warm-up and no scaling
# (the rate is exactly LR), no moving average, UPDATES updates.
SGD_OPTIONS = dict(optimizer="sgd", learning_rate=LR, lr_schedule="constant", warmup_steps=0,
                   scale_lr=False, max_steps=UPDATES, ema_decay=0.0)


def arrays(n=EXAMPLES, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, FEATURES)).astype(np.float32), rng.integers(0, CLASSES, n)


def sequential() -> keras.Sequential:
    # An L2 penalty large enough that counting it N or K times, or not at all, would show.
    return keras.Sequential([keras.Input((FEATURES,)),
                             keras.layers.Dense(8, activation="tanh",
                                                kernel_regularizer=keras.regularizers.L2(0.05)),
                             keras.layers.Dense(CLASSES)])


def functional() -> keras.Model:
    inputs = keras.Input((FEATURES,))
    hidden = keras.layers.Dense(8, activation="relu", kernel_regularizer=keras.regularizers.L2(0.05))(inputs)
    return keras.Model(inputs, keras.layers.Dense(CLASSES, activation="softmax")(hidden))


def with_weights(make, weights):
    model = make()
    model.set_weights(weights)
    return model


def keras_fit(make, initial, loss):
    """Keras's own fit from `initial`: one SGD step per batch of G, in order, over UPDATES."""
    x, y = arrays()
    reference = with_weights(make, initial)
    reference.compile(keras.optimizers.SGD(LR), loss)
    reference.fit(x, y, batch_size=G, shuffle=False, epochs=UPDATES * G // EXAMPLES, verbose=0)
    return reference.get_weights()


def assert_same_weights(got, want):
    """Two lists of weights equal to float32 rounding, one by one."""
    for got_one, want_one in zip(got, want, strict=True):
        np.testing.assert_allclose(got_one, want_one, rtol=1e-5, atol=1e-6)
