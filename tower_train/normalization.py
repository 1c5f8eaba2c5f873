"""python -m tower_train.normalization: how far a mean of per-shard means would be from the
update's weighted mean, for a model, a data set and a layout.

Run commands:
    python -m tower_train.normalization --flagfile=flags/sequence.flags
    python -m tower_train.normalization --model=tiny_transformer --dataset=markov_text --num_gpus=4 --accum=8

It takes the first --updates updates' examples of the training stream, cuts each into the
N x K shards the layout gives, and computes on a freshly initialised model (seeded by --seed),
for each update, the data loss and its gradient two ways:

* the rule tower-train applies: sum(w * loss) / sum(w) over the whole update;
* a mean of shard means: each shard's sum(w * loss) / sum(w), averaged over the N x K shards,
  which is what normalizing per micro-batch or per device does.

and prints the relative error of the second, |g_means - g| / |g| (global L2 norms), and the two
losses. With equal shards of equally weighted examples of one label each the two agree exactly; with padded
sequences of varying length they do not. Nothing is trained or written.
"""
from __future__ import annotations

import functools
import sys
from typing import TYPE_CHECKING

from absl import flags

from tower_train import flags as tt_flags
from tower_train import startup
from tower_train.cli import command, parse_config, run
from tower_train.errors import UsageError

if TYPE_CHECKING:
    from tower_train.startup import Started


@functools.cache
def updates_flag() -> flags.FlagHolder:
    """--updates, defined when the command first runs (the benchmark defines its own --updates)."""
    return flags.DEFINE_integer("updates", 3, "Updates whose examples are compared (>= 1).")


def compare_normalizations(run: Started, updates: int) -> list[tuple[float, float, float]]:
    """(weighted loss, mean-of-means loss, relative gradient error) for each of `updates` updates
    of `run`'s source, on its model freshly initialised."""
    import keras
    import tensorflow as tf

    from tower_train.model_spec import build_model
    from tower_train.step.towers import combine_gradients, labels_per_shard, split_batch, tower_loss_and_gradients

    config, source = run.config, run.source
    keras.utils.set_random_seed(config.seed)
    model = build_model(run.spec, source, config)
    sizes = config.tower_shard_sizes
    batches = iter(source.train_stream(seed=config.seed, start_position=0, micro_batch=sum(sizes)))
    results = []
    for _ in range(updates):
        shards = [shard for _ in range(config.accum) for shard in split_batch(next(batches), sizes)]
        sums = [tower_loss_and_gradients(model, *shard) for shard in shards]
        counts = [labels_per_shard(shard[1].shape, [shard[1].shape[0]])[0] for shard in shards]
        total = sum(float(result.weight_sum) for result in sums)
        if any(float(result.weight_sum) == 0 for result in sums):
            raise UsageError(f"update {len(results) + 1} has a shard whose labels all weigh 0: its "
                             "mean is undefined; use larger shards (--batch_size)")
        weighted = combine_gradients([result.gradients for result in sums], counts, total)
        # Shard i's gradient is of sum(w * loss) / c_i: times c_i / w_i it is of its mean.
        means = [tf.add_n([result.gradients[v] * (c / float(result.weight_sum) / len(shards))
                           for result, c in zip(sums, counts)])
                 for v in range(len(model.trainable_variables))]
        error = float(tf.linalg.global_norm([m - w for m, w in zip(means, weighted)])
                      / tf.linalg.global_norm(weighted))
        loss = sum(float(result.loss_sum) for result in sums) / total
        mean_loss = sum(float(result.loss_sum) / float(result.weight_sum) for result in sums) / len(shards)
        results.append((loss, mean_loss, error))
    return results


def _normalization(argv: list[str]) -> int:
    updates = updates_flag()
    config = parse_config(argv, __doc__ or "", ["updates"], tt_flags.NORMALIZATION_OPTIONS)
    if updates.value < 1:
        raise UsageError(f"--updates={updates.value}: must be a whole number >= 1")
    with startup.start(startup.NORMALIZATION, startup.options_of(config)) as run:
        results = compare_normalizations(run, updates.value)
    print(f"{config.model} on {config.dataset}: G = {config.global_batch} examples per update in "
          f"{config.num_towers} x {config.accum} shards of {'/'.join(map(str, config.tower_shard_sizes))}")
    for update, (loss, mean_loss, error) in enumerate(results, start=1):
        print(f"update {update}: loss {loss:.4f} (sum(w*loss)/sum(w)) vs {mean_loss:.4f} (mean of "
              f"shard means); gradient relative error of the mean of means {error:.4f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Runs `python -m tower_train.normalization`; returns the exit status."""
    return command(lambda: _normalization(sys.argv if argv is None else argv))


if __name__ == "__main__":
    run(main)

