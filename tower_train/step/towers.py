"""The three pieces of the tower pattern, kept apart as in tensorpack.

1. `tower_loss_and_gradients` (and `tower_function`, which binds the model):
   what one tower computes, knowing nothing of devices.
2. `run_on_towers`: the placement, which calls a tower function once per device.
3. `combine_gradients`: the pure cross-tower reduction.

The gradient math, written down once. An update consumes G examples across
N towers, K micro-steps and all workers; each example has labels of any shape
and a weight per label (1 unless the data says otherwise, 0 for padding). The
update applies the gradient of

    L = sum over the update of w * loss / W  +  regularization,   W = sum over the update of w

exactly: a weighted mean over every label of the update, not a mean of
per-shard means, plus the regularization once. A tower returns the SUMS
sum(w * loss) and sum(w) of its shard with the gradient of sum(w * loss) / c,
c being the number of labels in its shard (a constant that keeps the gradient
at the scale of a mean, which float16 needs); the sums travel to the one
reduction of the update, which multiplies each tower's gradient sum by c / W,
and then adds the gradient of the regularization. With unit weights and equal
shards, c / W = 1 / (N x K): the mean of the tower gradients.

Losses a model's call adds through Keras (`add_loss`, activity regularizers:
`TowerModel.batch_losses`) are means over the call's b examples, so an update
adds their mean over its G examples, sum over shards of b x a / G, as Keras's
fit on one batch of G would (an activity regularizer's sum over G examples,
divided by G). A tower returns their sum a over its shard's call and the
gradient of that, kept apart from the weighted gradient, since W is known only
at the end of the update and G is known from the start.

A model's randomness (Dropout's masks, `keras.random` draws from a layer's
`SeedGenerator`) is a pure function of the generators' seeds, the update, the
micro-step and the tower: each tower's pass gives every generator the state
`pass_seeds` computes from those, so a resumed run draws what an uninterrupted
one drew, and no generator's variable moves.
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Sequence, TypeVar

import numpy as np
import tensorflow as tf

from tower_train.data.source import Preprocess, RawInput
from tower_train.errors import UsageError
from tower_train.models.base import TowerModel
from tower_train.step.pooled_moments import moving_layers, recorded_moments
from tower_train.step.update_rule import LossScale

T = TypeVar("T")


class TowerResult(NamedTuple):
    """What one tower pass returns (`tower_loss_and_gradients`)."""

    loss_sum: tf.Tensor  # float32 scalar: sum(w * loss) over the shard
    weight_sum: tf.Tensor  # float32 scalar: sum(w) over the shard
    gradients: list[tf.Tensor]  # of S x sum(w * loss) / c, one per trainable variable
    batch_loss: tf.Tensor  # float32 scalar a: the sum of the call's batch losses (0 without any)
    # Of S x a, one per trainable variable; None for a model that adds no batch loss.
    batch_gradients: list[tf.Tensor] | None
    # For a pass given the values of `model.state_variables` (statistics=...): the value each one it
    # moved ended at, keyed by its index there, for the caller to write; else None.
    moved_statistics: dict[str, tf.Tensor] | None = None
    # The model's outputs of the pass, in training mode: what its training metrics read
    # (`TowerModel.update_training_metrics`); None where the sums stand for several passes.
    outputs: tf.Tensor | None = None
    # For each variable a pass was asked to step sparsely (sparse=...): the gradient in `gradients`
    # as its occurrences, `sparse_occurrences`; those of several passes concatenated in a sum.
    slices: tuple[tf.IndexedSlices, ...] = ()
    # For the BN layers a pass was asked to record (moments=...): their batch moments' sums
    # (`pooled_moments.recorded_moments`); those of several passes added up in a sum.
    moments: tuple[tf.Tensor, ...] = ()


def tower_loss_and_gradients(
    model: TowerModel, features: tf.Tensor, labels: tf.Tensor, weights: tf.Tensor,
    loss_scale: tf.Tensor | None = None, weight_copies: Sequence[tf.Variable] | None = None,
    seeds: tf.Tensor | None = None, statistics: Sequence[tf.Tensor] | None = None,
    sparse: Sequence[int] = (), moments: Sequence[object] = (),
) -> TowerResult:
    """One tower's forward and backward pass.

    Args:
      model: the network; its variables may live on another device.
      features: this tower's shard, [b, ...], as the model takes it.
      labels: int [b, ...] (the label shape of the data), or the targets of a Keras loss (a
        tensor or a nest of them).
      weights: float32, one per label: the labels' shape, or the loss's for targets.
      loss_scale: float32 scalar S (float16 training) or None (S = 1).
      weight_copies: None to read `model.trainable_variables`; or one variable or tensor per
        trainable variable holding its current value, which the pass reads instead (tower mode's
        copy of the weights on the tower's device). A value may come in the compute dtype where
        `read_in_compute_dtype` says the pass reads that weight in it: it is cast back here, and
        the pass rounds it to the very same value. BN's moving statistics move the same either way.
      seeds: None to let the model's SeedGenerators run as Keras runs them (their variables
        move); or int64 [S, 2], the states this pass gives them (`pass_seeds`).
      statistics: None to read and move `model.state_variables` (BN's moving statistics) as
        Keras does; or one tensor per such variable, its current value: the pass then touches no
        variable and returns the values it moved (`TowerResult.moved_statistics`).
      sparse: indices into `model.trainable_variables` whose gradient also comes as its
        occurrences (`TowerResult.slices`): the update steps them as Keras's fit does.
      moments: BatchNormalization layers of the model whose batch moments the pass records
        (`TowerResult.moments`): the update moves their statistics from them
        (`pooled_moments`).

    Returns:
      A `TowerResult`: the float32 scalars sum(w * loss) and sum(w) over the shard, and the
      gradient of S x sum(w * loss) / c, c = the number of labels in the shard, for each of
      `model.trainable_variables` (same order and shapes); the sum a of the losses the call added
      through Keras (`model.batch_losses`), and, when `model.adds_batch_losses`, the gradient of
      S x a (a second backward pass, from the same tape).
    """
    if weight_copies is None:
        sources = model.trainable_variables
    else:
        sources = [tf.cast(tf.convert_to_tensor(copy), v.dtype)
                   for copy, v in zip(weight_copies, model.trainable_variables, strict=True)]
    with tf.GradientTape(persistent=model.adds_batch_losses) as tape:
        if weight_copies is not None:
            tape.watch(sources)
        with model.using(weights=None if weight_copies is None else sources,
                         seeds=None if seeds is None else tf.unstack(seeds), statistics=statistics) as moved:
            with recorded_moments(moments) as moment_sums:
                logits = model(features, training=True)
            losses = tf.cast(model.per_example_loss(labels, logits), tf.float32)
            batch_loss = model.batch_loss()
            if model.batch_losses() and not model.adds_batch_losses:  # they would be left out
                raise UsageError(f"{type(model).__name__}: a training call added losses through Keras "
                                 "(add_loss, activity_regularizer) that its start-up trace did not; "
                                 "add them in every training call")
        weighted_loss_sum = tf.reduce_sum(losses * weights)
        objective = weighted_loss_sum / tf.cast(tf.size(weights), tf.float32)
        batch_objective = batch_loss
        if loss_scale is not None:
            objective, batch_objective = objective * loss_scale, batch_objective * loss_scale
    raw_gradients = tape.gradient(objective, sources)
    gradients = dense(raw_gradients, model.trainable_variables)
    slices = tuple(sparse_occurrences(raw_gradients[j], gradients[j]) for j in sparse)
    batch_gradients = None
    if model.adds_batch_losses:
        batch_gradients = dense(tape.gradient(batch_objective, sources), model.trainable_variables)
    return TowerResult(weighted_loss_sum, tf.reduce_sum(weights), gradients, batch_loss, batch_gradients,
                       None if statistics is None else moved, logits, slices, tuple(moment_sums))


def dense(gradients: Sequence[tf.Tensor | tf.IndexedSlices | None], variables) -> list[tf.Tensor]:
    """Gradients as dense tensors, as the accumulators hold them: an embedding's IndexedSlices
    made dense, and zeros for a variable the loss does not reach."""
    return [tf.zeros(v.shape, v.dtype) if g is None else tf.convert_to_tensor(g)
            for g, v in zip(gradients, variables, strict=True)]


def sparse_occurrences(gradient: tf.Tensor | tf.IndexedSlices | None, dense_gradient: tf.Tensor) -> tf.IndexedSlices:
    """A variable's gradient as Keras's fit hands it to the optimizer when it reads the variable
    by gather (an Embedding's table): a row per occurrence of an index, duplicates not summed,
    indices int64. A dense gradient (`dense_gradient`, where a pass reads the table otherwise
    than the start-up trace did) is one occurrence of every row: stepped as densely as Keras's."""
    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(gradient.values, tf.cast(gradient.indices, tf.int64),
                                tf.shape(dense_gradient, out_type=tf.int64))
    rows = tf.range(tf.shape(dense_gradient, out_type=tf.int64)[0])
    return tf.IndexedSlices(dense_gradient, rows, tf.shape(dense_gradient, out_type=tf.int64))


def combine_slices(tower_slices: Sequence[Sequence[tf.IndexedSlices]], tower_label_counts: Sequence[float],
                   total_weight: tf.Tensor) -> list[tf.IndexedSlices]:
    """`combine_gradients` of the sparse variables' occurrences, on the current device: each
    tower's scaled by c_i / W as its dense sum is, all towers' concatenated, so that the update's
    slices are those Keras's fit takes from one batch of G (in another order of the occurrences)."""
    return [tf.IndexedSlices(tf.concat([s.values * (count / total_weight)
                                        for s, count in zip(slices, tower_label_counts, strict=True)], 0),
                             tf.concat([s.indices for s in slices], 0), slices[0].dense_shape)
            for slices in zip(*tower_slices, strict=True)]


def read_in_compute_dtype(model: TowerModel) -> list[bool]:
    """For each of `model.trainable_variables`: whether a tower pass reads it only in the model's
    compute dtype, so that sending it in that dtype changes nothing. Keras casts a float variable
    when it is read inside the call of a layer that computes in a 16-bit dtype, unless the layer
    or the variable opts out of autocasting (BatchNormalization, LayerNormalization and Embedding
    do); this takes each variable to be read by the layer that made it. All False in float32."""
    compute_dtype = model.compute_dtype
    if compute_dtype == "float32":
        return [False] * len(model.trainable_variables)
    autocast = set()
    # Keras keeps a layer's own variables, and a variable's autocast flag, in private attributes.
    for layer in model._flatten_layers():  # the model itself and every nested layer
        if layer.autocast and layer.compute_dtype == compute_dtype:
            autocast.update(id(v) for v in layer._trainable_variables
                            if v._autocast and v.dtype == "float32")
    return [id(v) in autocast for v in model.trainable_variables]


def prepared(features, prepare: Preprocess | None):
    """A shard's features as the model takes them, on the current device (the tower's): a
    `RawInput` (the training stream's) preprocessed for training by `prepare` (the source's
    `model_input`), from each example's own seed, so the result does not depend on where it
    runs or how the batch was cut; anything else as it is."""
    if not isinstance(features, RawInput):
        return features
    if prepare is None:
        raise ValueError("a RawInput batch needs the source's model_input to prepare it")
    return prepare(features.features, features.seeds, True)


def tower_function(
    model: TowerModel, loss_scale: LossScale | None = None, jit_compile: bool = False,
    prepare: Preprocess | None = None, sparse: Sequence[int] = (), moments: Sequence[object] = (),
) -> Callable[..., TowerResult]:
    """`tower_loss_and_gradients` of `model` (its `sparse` variables' occurrences too) as a
    function of (features, labels, weights[, weight_copies[, seeds]]), reading the current loss
    scale at every call; with `jit_compile`,
    compiled by XLA for the device it is called on (which must hold the model's variables: XLA
    cannot read another device's; `compiled_towers` reads none). Features that come as
    a `RawInput` are preprocessed by `prepare` first, on that device, outside XLA (`prepared`)."""
    def tower_pass(features: tf.Tensor, labels: tf.Tensor, weights: tf.Tensor,
                   weight_copies: Sequence[tf.Variable] | None = None,
                   seeds: tf.Tensor | None = None) -> TowerResult:
        return tower_loss_and_gradients(
            model, features, labels, weights,
            None if loss_scale is None else loss_scale.value.read_value(), weight_copies, seeds,
            sparse=sparse, moments=moments)

    run_pass = _compiled_pass(tower_pass) if jit_compile else tower_pass

    def tower(features, *arguments) -> TowerResult:
        return run_pass(prepared(features, prepare), *arguments)

    return tower


def _compiled_pass(tower_pass: Callable[..., TowerResult]) -> Callable[..., TowerResult]:
    """`tower_pass` compiled by XLA, traced under a name scope of its own whatever scope calls it.
    Its trace is a graph of its own, and a graph's root scope refuses names that do not start
    with a letter, a digit or a dot, such as the "__basic_block" Keras opens for resnet20's
    `_BasicBlock` layers (a tower off the parameter device traced it at the root). The uncompiled
    passes run under their tower's scope (`run_on_towers`)."""
    def scoped(*arguments) -> TowerResult:
        with tf.name_scope("tower_pass"):
            return tower_pass(*arguments)

    return tf.function(scoped, jit_compile=True, autograph=False)


def compiled_towers(model: TowerModel, loss_scale: LossScale | None = None,
                    prepare: Preprocess | None = None, sparse: Sequence[int] = (),
                    moments: Sequence[object] = ()) -> Callable[[Sequence[str], Sequence[tuple]], list[TowerResult]]:
    """`tower_loss_and_gradients` of `model` (its `sparse` variables' occurrences too) compiled
    by XLA for each tower's device, as a function of (devices, shards) like `run_on_towers`, each
    shard (features, labels, weights, weight_copies[, seeds]), for towers whose variables live
    elsewhere (tower mode). XLA cannot read another device's variables, so a compiled pass reads
    none: the weights come as `weight_copies` (a tower's copy, or the parameter device's values),
    the loss scale and `model.state_variables` are read outside it, and the values it moved are
    written back after it. A `RawInput` is preprocessed by `prepare` on that device, outside the
    compiled pass (`prepared`).

    The statistics move tower by tower in program order, as the uncompiled passes move them, yet
    the compiled passes do not wait for each other: each starts from the values the micro-step
    started with (s_0), and since a BN layer's moving mean and variance move linearly, a pass that
    moved one from s_0 to r_i = s_0 m + x_i (1 - m) moves it, after the towers before it, to
    s_i = s_(i-1) m + (r_i - s_0 m) (`_moving_average_momenta`). If the first pass moves any other
    variable, each pass reads what the one before it wrote, and the passes run one after another.
    """
    def compiled_pass(features, labels, weights, weight_values, statistics, seeds, scale) -> TowerResult:
        return tower_loss_and_gradients(model, features, labels, weights, scale, weight_values, seeds,
                                        statistics, sparse, moments)

    compiled = _compiled_pass(compiled_pass)

    def towers(devices: Sequence[str], shards: Sequence[tuple]) -> list[TowerResult]:
        state = model.state_variables
        momenta = _moving_average_momenta(model)
        start = [tf.convert_to_tensor(v) for v in state]  # each read where its variable lives
        passes = 0  # the towers traced so far
        overlapping = True  # whether every pass so far started from `start` and moved linear averages only

        def tower(features: tf.Tensor, labels: tf.Tensor, weights: tf.Tensor,
                  weight_copies: Sequence[tf.Variable | tf.Tensor], seeds: tf.Tensor | None = None) -> TowerResult:
            nonlocal passes, overlapping
            statistics = start if overlapping else [tf.convert_to_tensor(v) for v in state]
            result = compiled(prepared(features, prepare), labels, weights,
                              [tf.convert_to_tensor(c) for c in weight_copies], statistics, seeds,
                              None if loss_scale is None else loss_scale.value.read_value())
            for index, moved in result.moved_statistics.items():
                variable = state[int(index)]
                if overlapping and passes:  # moved from s_0, not from what the towers before left
                    momentum = momenta[int(index)]
                    with tf.device(variable.value.device):
                        moved = tf.convert_to_tensor(variable) * momentum + (moved - start[int(index)] * momentum)
                variable.assign(moved)
            overlapping = overlapping and all(int(index) in momenta for index in result.moved_statistics)
            passes += 1
            return result._replace(moved_statistics=None)

        return run_on_towers(tower, devices, shards)

    return towers


def _moving_average_momenta(model: TowerModel) -> dict[int, float]:
    """{index in `model.state_variables`: momentum} of the moving means and variances of the
    BatchNormalization layers a training call moves (`moving_layers`), which it moves as
    s m + x (1 - m), x its batch's moment."""
    index = {id(variable): i for i, variable in enumerate(model.state_variables)}
    return {index[id(variable)]: layer.momentum for layer in moving_layers(model)
            for variable in (layer.moving_mean, layer.moving_variance) if id(variable) in index}


def seed_generator_states(model: TowerModel) -> tf.Tensor | None:
    """The current states of the model's SeedGenerators (`TowerModel.seed_states`), int64
    [S, 2], as a constant; None for a model without any. Read once, when a mode's step is built:
    a generator's state holds its seed (from --seed, unless the model gave it one) and never
    moves in training, so this is the same in a fresh run and a resumed one."""
    states = model.seed_states
    if not states:
        return None
    return tf.constant(np.stack([np.asarray(tf.convert_to_tensor(v)) for v in states]), tf.int64)


def pass_seeds(generator_states: tf.Tensor, update: tf.Tensor, micro_step: tf.Tensor,
               tower: tf.Tensor | int) -> tf.Tensor:
    """The states one tower pass gives the model's SeedGenerators: int64 [S, 2].

    Args:
      generator_states: int64 [S, 2], `seed_generator_states`.
      update: int scalar, the updates applied before this one (the step counter).
      micro_step: int scalar, 0..K-1 within the update.
      tower: int scalar, the tower (in the strategy modes the global replica id; replica i takes
        the shard tower i would).

    Returns:
      Row s: (update, micro_step, tower) folded into generator s's state, then hashed to a new
      [2] state, so that a generator's successive draws in a pass ([a, b], [a, b + 1], ...) do
      not meet another pass's.
    """
    rows = []
    for state in tf.unstack(generator_states):
        for value in (update, micro_step, tower):
            state = tf.random.experimental.stateless_fold_in(state, tf.cast(value, tf.int64))
        rows.append(tf.random.stateless_uniform([2], seed=state, minval=None, maxval=None, dtype=tf.int64))
    return tf.stack(rows)


def regularization_gradients(model: TowerModel,
                             weights: Sequence[tf.Tensor] | None = None) -> tuple[tf.Tensor, list[tf.Tensor]]:
    """The model's regularization (with its Keras weight regularizers) and its gradient for each
    trainable variable (zeros where it does not depend on one): added once per update, never
    per tower or micro-step. `weights`: one tensor per trainable variable to compute both at,
    instead of the variables."""
    sources = model.trainable_variables if weights is None else list(weights)
    with tf.GradientTape() as tape:
        if weights is not None:
            tape.watch(sources)
        with model.using(weights=weights):
            regularization = model.update_regularization()
    gradients = tape.gradient(regularization, sources)
    return regularization, dense(gradients, model.trainable_variables)


def run_on_towers(
    tower_fn: Callable[..., T], devices: Sequence[str], shards: Sequence[tuple]
) -> list[T]:
    """Calls `tower_fn(*shards[i])` on `devices[i]`, under name scope `tower_i`.

    Inside one tf.function the calls are independent ops on different
    devices, so the runtime runs the towers concurrently.
    """
    results = []
    for i, (device, shard) in enumerate(zip(devices, shards, strict=True)):
        with tf.device(device), tf.name_scope(f"tower_{i}"):
            results.append(tower_fn(*shard))
    return results


def combine_gradients(
    tower_gradient_sums: Sequence[Sequence[tf.Tensor]], tower_label_counts: Sequence[float],
    total_weight: tf.Tensor,
) -> list[tf.Tensor]:
    """The gradient of the update's weighted mean loss, on the current device.

    Args:
      tower_gradient_sums: N sequences of V tensors; tower_gradient_sums[i][v] has the shape of
        variable v and is tower i's gradient of sum(w * loss) / c_i, summed over the update's
        micro-steps.
      tower_label_counts: N numbers; c_i, the labels in one shard of tower i.
      total_weight: float32 scalar W > 0, the sum of the weights over the whole update.

    Returns:
      V tensors; element v has the shape of variable v and equals
      sum_i tower_gradient_sums[i][v] x c_i / W.
    """
    return [tf.add_n([g * (count / total_weight) for g, count in zip(grads, tower_label_counts, strict=True)])
            for grads in zip(*tower_gradient_sums, strict=True)]


def split_batch(batch: tuple[tf.Tensor, ...], shard_sizes: Sequence[int]) -> list[tuple[tf.Tensor, ...]]:
    """A global micro-batch (features, labels, weights), each [M, ...] (features and labels may
    be nests of such tensors), as consecutive shards of shard_sizes[i] examples (summing to M)."""
    return list(zip(*(_split_nest(part, shard_sizes) for part in batch), strict=True))


def _split_nest(nest, shard_sizes: Sequence[int]) -> list:
    pieces = [tf.split(leaf, list(shard_sizes)) for leaf in tf.nest.flatten(nest)]
    return [tf.nest.pack_sequence_as(nest, [leaf_pieces[i] for leaf_pieces in pieces])
            for i in range(len(shard_sizes))]


def labels_per_shard(weights_shape: Sequence[int], shard_sizes: Sequence[int]) -> list[float]:
    """c_i: the labels in shard i of a global micro-batch whose weights, one per label, have the
    (static) shape `weights_shape`."""
    per_example = tf.TensorShape(weights_shape[1:]).num_elements()
    return [size * per_example for size in shard_sizes]
