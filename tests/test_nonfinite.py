"""A non-finite update is never applied, in any tower or replica, and --nonfinite decides what follows."""
import numpy as np
import pytest

from helpers import fed, host_batches, make_run, weights
from test_cli_errors import run_cli


def optimizer_state(run):
    return [np.asarray(v.numpy()) for v in run.state.optimizer.variables] + [run.state.step.numpy()]


@pytest.mark.parametrize("mode", ["tower", "mirrored"])
@pytest.mark.parametrize("bad_micro_step", [0, 1])
def test_a_nan_in_one_tower_skips_the_whole_update_everywhere(mode, bad_micro_step):
    layout = dict(mode=mode, num_gpus=2, accum=2, batch_size=4, optimizer="momentum", learning_rate=0.05)
    run, reference = make_run(**layout), make_run(**layout)
    good = host_batches(run)  # float images, which can hold a NaN
    first, second = next(good), next(good)
    poisoned = [first, second]
    images = poisoned[bad_micro_step][0].numpy()
    images[5, 0, 0, 0] = np.nan  # example 5 is in tower 1's shard only
    poisoned[bad_micro_step] = (images, *poisoned[bad_micro_step][1:])
    before_weights, before_state = weights(run.state.model), optimizer_state(run)

    # (the loss may be finite: max-pooling can drop a NaN, its gradient cannot)
    assert not run.inner.run_update(fed(run.inner, poisoned)).applied
    for got, want in zip(weights(run.state.model), before_weights):
        np.testing.assert_array_equal(got, want)
    for got, want in zip(optimizer_state(run), before_state):
        np.testing.assert_array_equal(got, want)
    # Nothing of the bad update lingers: the next good one equals a fresh run's first.
    applied = run.inner.run_update(fed(run.inner, [first, second])).applied
    reference.inner.run_update(fed(reference.inner, [first, second]))
    assert applied and run.state.step.numpy() == 1
    for got, want in zip(weights(run.state.model), weights(reference.state.model)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


DIVERGING = ["--optimizer=sgd", "--learning_rate=1e30", "--num_gpus=2", "--batch_size=8",
             "--checkpoint_every=1", "--log_every=1", "--max_steps=6"]


def test_stop_ends_the_run_naming_the_update_and_keeps_the_last_good_checkpoint(tmp_path):
    result = run_cli(*DIVERGING, f"--train_dir={tmp_path}")
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("tower_train: update 2 has a non-finite loss or gradient")
    assert "stopping (--nonfinite=stop)" in last and last.endswith(f"{tmp_path}/ckpt-1")
    assert "Traceback" not in result.stderr
    assert sorted(p.name for p in tmp_path.glob("ckpt-*.index")) == ["ckpt-1.index"]


def test_skip_counts_skipped_updates_and_stops_after_max_skipped_in_a_row(tmp_path):
    result = run_cli(*DIVERGING, "--nonfinite=skip", "--max_skipped=3", f"--train_dir={tmp_path}")
    assert result.returncode == 1
    assert "update 2 has a non-finite loss or gradient" in result.stderr
    assert "skipped (1 in a row, 1 in all)" in result.stderr
    assert "skipped (2 in a row, 2 in all)" in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert "3 updates in a row skipped reaches --max_skipped=3" in last
    assert sorted(p.name for p in tmp_path.glob("ckpt-*.index")) == ["ckpt-1.index"]
