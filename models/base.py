"""The base class of every network tower-train trains.

A network is a `keras.Model` that maps a batch of features to logits and owns
its loss: one loss per label and the regularization. It knows nothing of devices,
flags or optimizers; the trainer decides where it runs and how it is updated.

Subclass it like this (see docs/models.md, "Adding a model"):

    @register("tiny_mlp")
    class TinyMLP(TowerModel):
        def __init__(self, num_classes: int, **kwargs):
            super().__init__(num_classes, **kwargs)
            self.hidden = keras.layers.Dense(64, activation="relu")
            self.logits = keras.layers.Dense(num_classes)

        def call(self, images, training=False):
            return self.logits(self.hidden(keras.ops.reshape(images, (keras.ops.shape(images)[0], -1))))

        def regularization(self):
            return 1e-4 * l2_loss(self.hidden.kernel)
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Sequence

import keras
import tensorflow as tf


class TowerModel(keras.Model):
    """A network for tower-train.

    Subclasses build their layers in `__init__(self, num_classes, **kwargs)`
    (passing `**kwargs` on to this class) and implement `call(features,
    training)`: a batch of features as the data source delivers them (float32
    [B, 24, 24, 3] for the built-in image sets) -> logits [B, ..., num_classes],
    whose leading axes are the labels' shape. BatchNormalization layers come
    from `self.batch_norm()`, so that `--sync_bn` reaches them (see
    models/resnet20.py). Subclasses may override `per_example_loss` (one loss
    per label, the labels' shape) and `regularization` (a scalar). An update
    applies the gradient of

        sum(w * per_example_loss) / sum(w) over all its labels  +  regularization()

    so the regularization counts once per update, whatever the number of
    towers and micro-steps (see tower_train/step/towers.py). Keras weight regularizers
    (a layer's kernel_regularizer) count with it (`update_regularization`). Losses
    a call adds through Keras (`add_loss`, activity regularizers: `batch_losses`)
    are taken as means over the call's examples, and an update adds their mean
    over all its examples, as Keras's fit on the one big batch would.

    `call` runs its blocks (a stage, a residual block: a few layers each)
    through `self.run_block(block, x, training)`, because that is where
    `--recompute` (gradient checkpointing) acts: training then keeps only the
    blocks' outputs and recomputes each block's activations in the backward
    pass, one more forward pass for less memory. Where the boundaries lie
    decides what is saved, and only the model knows its structure, so the
    model declares them. The recomputation's updates of BN's moving
    statistics are dropped, so they move once per call, as without the flag.
    """

    def __init__(self, num_classes: int, sync_batch_norm: bool = False, recompute: bool = False,
                 **kwargs):
        super().__init__(**kwargs)
        self.num_classes = num_classes
        self.sync_batch_norm = sync_batch_norm
        self.recompute = recompute
        self._runs_blocks = False  # set by run_block, so the trainer can tell --recompute would do nothing
        # Whether a training call adds losses of the batch (`batch_losses`): set by the trainer
        # once it has traced one (tower_train/model_spec.py), so the modes know before they trace.
        self.adds_batch_losses = False
        # Per trainable variable: whether the loss's gradient reaches it as tf.IndexedSlices, a row
        # per occurrence (an Embedding's table, read by gather), untouched by the regularization and
        # the losses of the batch: set by the trainer's start-up trace (tower_train/model_spec.py),
        # for tower mode's sparse steps (step/towers.py). Empty: none.
        self.sparse_gradients: tuple[bool, ...] = ()
        self._weight_values: list[tf.Tensor] | None = None  # set inside using(weights=...)
        self._held_scope: keras.StatelessScope | None = None  # set inside using(statistics=...)

    @property
    def seed_states(self) -> list[keras.Variable]:
        """The state variables of the model's `keras.random.SeedGenerator`s (a Dropout layer's, or
        one a layer keeps for its `keras.random` calls), each once, in a fixed order: what
        `using(seeds=...)` replaces. Keras counts them among the variables, not the weights."""
        weights = {id(w) for w in self.weights}
        return list({id(v): v for v in self.variables if id(v) not in weights}.values())

    @property
    def state_variables(self) -> list[keras.Variable]:
        """The non-trainable variables other than the SeedGenerators' states: what a training call
        reads and may move besides the weights (BN's moving statistics, a frozen layer's weights),
        in the order of `non_trainable_variables`; what `using(statistics=...)` replaces."""
        seeds = {id(v) for v in self.seed_states}
        return [v for v in self.non_trainable_variables if id(v) not in seeds]

    @contextlib.contextmanager
    def using(self, weights: Sequence[tf.Tensor] | None = None,
              seeds: Sequence[tf.Tensor] | None = None,
              statistics: Sequence[tf.Tensor] | None = None) -> Iterator[dict[str, tf.Tensor]]:
        """Calls inside run the model with `weights` (one tensor per trainable variable, same
        order) in place of its trainable variables, and with `seeds` (one int64 [2] tensor per
        `seed_states`) in place of its SeedGenerators' states; the variables replaced are
        neither read nor moved. With neither, calls run as outside.

        Tower mode uses `weights` to run a tower on its own copy of the weights; every mode
        passes `seeds`, so that a tower pass's randomness is a function of its seeds alone
        (tower_train/step/towers.py). A draw advances its generator's state inside the scope only.
        The other non-trainable variables (BN's moving statistics: `state_variables`) stay the
        real ones: they are read as usual, and what the calls assign to them is written to them
        on exit, in the order of `non_trainable_variables`, so they move once per call, as
        outside. With `statistics` (one tensor per `state_variables`) the calls start from those
        values instead and no variable is read or written: the context's dict then holds, on
        exit, the value each moved one ended at, keyed by its index in `state_variables`, for
        the caller to write (an XLA-compiled tower cannot touch another device's variables).
        """
        moved: dict[str, tf.Tensor] = {}
        if weights is None and seeds is None and statistics is None:
            yield moved
            return
        replaced = [] if weights is None else list(zip(self.trainable_variables, weights, strict=True))
        seeded = [] if seeds is None else list(zip(self.seed_states, seeds, strict=True))
        held = [] if statistics is None else list(zip(self.state_variables, statistics, strict=True))
        self._weight_values = None if weights is None else list(weights)
        try:
            # collect_losses: else Keras drops what add_loss adds inside the scope.
            with keras.StatelessScope(state_mapping=replaced + seeded + held, initialize_variables=False,
                                      collect_losses=True) as scope:
                started = [scope.get_current_value(variable) for variable, _ in held]
                self._held_scope = scope if held else None
                yield moved
        finally:
            self._weight_values, self._held_scope = None, None
        for i, ((variable, _), start) in enumerate(zip(held, started, strict=True)):
            value = scope.get_current_value(variable)
            if value is not start:
                moved[str(i)] = value
        kept_apart = {id(variable) for variable, _ in seeded + held}
        _write_moved([v for v in self.non_trainable_variables if id(v) not in kept_apart], scope)

    def batch_norm(self, **layer_kwargs) -> keras.layers.BatchNormalization:
        """A BatchNormalization layer; build every BN layer of the model through this.

        `synchronized` follows `--sync_bn`: False (the default) normalizes each
        tower's (replica's) own shard; True, under a mirrored strategy,
        normalizes over the global micro-batch of all replicas, at the cost
        of all-reduces per BN layer per micro-step. `layer_kwargs` (momentum,
        epsilon, name, ...) go to the layer as given.
        """
        return keras.layers.BatchNormalization(synchronized=self.sync_batch_norm, **layer_kwargs)

    def run_block(self, block: Callable[..., tf.Tensor], x: tf.Tensor, training: bool = False) -> tf.Tensor:
        """`block(x, training=training)`: one block of `call`, a layer or a method of one tensor.

        With `recompute` and `training`, under `tf.recompute_grad`: the block's
        activations are not kept for the gradient but recomputed from `x`. The
        block must be a pure function of `x` and the weights (no randomness
        that differs between the two calls).
        """
        self._runs_blocks = True
        if not (self.recompute and training):
            return block(x, training=training)
        calls = 0
        if self._weight_values is None:
            def forward(inputs: tf.Tensor) -> tf.Tensor:
                # tf.recompute_grad calls this twice: the forward pass, then again inside the
                # gradient. The second call's writes (BN's moving statistics) are dropped, so they
                # move once, as without recompute; its reads of the weights are real, so the
                # gradient reaches them.
                nonlocal calls
                calls += 1
                if calls == 1:
                    return block(inputs, training=True)
                with keras.StatelessScope(initialize_variables=False):
                    return block(inputs, training=True)

            return tf.recompute_grad(forward)(x)

        # Inside using(weights=...): tf.recompute_grad passes gradients only to its arguments and to
        # the variables read, so the weight values the block reads must be arguments.
        variables = self.trainable_variables

        def forward_with(inputs: tf.Tensor, *values: tf.Tensor) -> tf.Tensor:
            # A scope of its own, so that the weights the block reads are these arguments. Its
            # statistics come from their variables, not from moves earlier in this pass that
            # using()'s scope still holds: only a BN layer called in two blocks of one pass
            # would notice.
            nonlocal calls
            calls += 1
            # Under using(statistics=...) no variable may be read (XLA): the values its scope holds.
            held = ([] if self._held_scope is None else
                    [(v, self._held_scope.get_current_value(v)) for v in self.non_trainable_variables
                     if self._held_scope.get_current_value(v) is not None])
            with keras.StatelessScope(state_mapping=list(zip(variables, values)) + held,
                                      initialize_variables=False) as scope:
                outputs = block(inputs, training=True)
            if calls == 1:  # into using()'s scope; the recomputation's writes are dropped
                _write_moved(self.non_trainable_variables, scope)
            return outputs

        return tf.recompute_grad(forward_with)(x, *self._weight_values)

    @property
    def runs_blocks(self) -> bool:
        """Whether `call` has run a block through `run_block` (after the model's first call)."""
        return self._runs_blocks

    @property
    def tracks_training_metrics(self) -> bool:
        """Whether `update_training_metrics` keeps anything (a Keras model's compiled metrics,
        under tower_train.keras.fit); the steps then hand it every tower pass's outputs."""
        return False

    def update_training_metrics(self, labels: Any, logits: tf.Tensor) -> None:
        """Adds one tower pass's labels and outputs (of the training call) to the training
        metrics the model keeps. Called inside the compiled update, once per tower and
        micro-step, so a metric's state sums over the update's G examples as Keras's train step
        at G would keep it."""

    def per_example_loss(self, labels: tf.Tensor, logits: tf.Tensor) -> tf.Tensor:
        """int labels [B, ...], logits [B, ..., C] -> loss [B, ...]; softmax cross-entropy unless
        overridden."""
        return tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=tf.cast(labels, tf.int32), logits=tf.cast(logits, tf.float32))

    def regularization(self) -> tf.Tensor:
        """A scalar added once per update to the weighted mean loss; none unless overridden."""
        return tf.constant(0.0)

    def update_regularization(self) -> tf.Tensor:
        """What an update adds once to its weighted mean loss: `regularization()` plus the
        penalty of every Keras weight regularizer of the model (a layer's kernel_regularizer or
        bias_regularizer), which depends on the weights alone, so Keras's own fit also counts it
        once per step, whatever the batch."""
        penalties = [tf.cast(variable.regularizer(variable), tf.float32)
                     for variable in self.trainable_weights
                     if getattr(variable, "regularizer", None) is not None]
        return tf.add_n([tf.cast(self.regularization(), tf.float32), *penalties])

    def batch_losses(self) -> list[tf.Tensor]:
        """The scalar losses the last call added through Keras (`add_loss`, a layer's
        activity_regularizer, in this model or a nested layer), read in that call's scope; not the
        weight regularizers' penalties (`update_regularization`). Each is taken as a mean over the
        call's examples, as Keras (3.14 on) divides an activity regularizer by the batch size."""
        # Not self.losses: it would also compute the weight regularizers' penalties, which inside a
        # stateless scope that does not map those weights (using(seeds=...) alone) cannot be read.
        return [loss for layer in self._flatten_layers() for loss in layer._get_own_losses()]

    def batch_loss(self) -> tf.Tensor:
        """The sum of `batch_losses()`, float32 (0 without any)."""
        return tf.add_n([tf.constant(0.0)] + [tf.cast(loss, tf.float32) for loss in self.batch_losses()])


def _write_moved(variables: Sequence[keras.Variable], scope: keras.StatelessScope) -> None:
    """Assigns to each of `variables` the value a call inside `scope` assigned to it, if any
    (into the enclosing stateless scope when there is one)."""
    for variable in variables:
        moved = scope.get_current_value(variable)
        if moved is not None:
            variable.assign(moved)


def l2_loss(weights: keras.Variable) -> tf.Tensor:
    """sum(w^2) / 2, the original's weight-decay term before its factor."""
    return tf.nn.l2_loss(tf.convert_to_tensor(weights))
