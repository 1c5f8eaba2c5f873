"""--precision and --jit_compile: the same update, computed in another dtype or compiled by XLA.

fp16's dynamic loss scale is part of the update, not of the micro-step: every
micro-step's loss is multiplied by the scale, the accumulated gradient is divided
by it once, an overflow anywhere skips the whole update on every tower and
replica, and the scale moves once per update.
"""
import math
import re

import numpy as np
import pytest

from helpers import make_run, synthetic_batches, weights
from test_cli_errors import run_cli
from tower_train.update_rule import LossScale

SGD = dict(optimizer="sgd", learning_rate=0.1, ema_decay=0.0, batch_size=4)


def first_update_delta(**layout) -> tuple[list[np.ndarray], object]:
    """The change of every weight in the first update of a run, and the run."""
    run = make_run(**layout)
    before = weights(run.state.model)
    assert run.inner.run_update(synthetic_batches(run)).applied
    return [after - start for after, start in zip(weights(run.state.model), before)], run


def relative_error(got: list[np.ndarray], want: list[np.ndarray]) -> float:
    """|got - want| / |want| over all weights together (global norms)."""
    difference = np.sqrt(sum(np.sum((g - w) ** 2) for g, w in zip(got, want, strict=True)))
    return float(difference / np.sqrt(sum(np.sum(w ** 2) for w in want)))


@pytest.mark.parametrize("precision, compute_dtype, tolerance", [("bf16", "bfloat16", 0.05),
                                                                  ("fp16", "float16", 0.01)])
def test_low_precision_towers_apply_the_float32_update_to_float32_weights(
        precision, compute_dtype, tolerance):
    layout = dict(num_gpus=2, accum=3, **SGD)
    want, _ = first_update_delta(**layout)
    got, run = first_update_delta(precision=precision, **layout)
    assert run.state.model.compute_dtype == compute_dtype
    assert {v.dtype for v in run.state.model.trainable_variables} == {"float32"}
    # bfloat16 keeps 8 bits of mantissa, float16 11: each update is the float32 one to that precision.
    assert relative_error(got, want) < tolerance
    assert min(np.abs(delta).max() for delta in got) > 0  # every weight moved


def test_fp16_loss_scale_moves_once_per_update_not_per_micro_step(monkeypatch):
    monkeypatch.setattr(LossScale, "GROWTH_UPDATES", 2)
    run = make_run(precision="fp16", num_gpus=2, accum=3, **SGD)
    batches = synthetic_batches(run)
    scale = run.state.loss_scale
    scale.value.assign(2.0 ** 8)  # low enough that this model's float16 gradients do not overflow
    assert run.inner.run_update(batches).applied
    assert (scale.value.numpy(), scale.good_updates.numpy()) == (2.0 ** 8, 1)
    assert run.inner.run_update(batches).applied
    # 2 updates of 3 micro-steps: doubled once. Counting micro-steps would have doubled it 3 times.
    assert (scale.value.numpy(), scale.good_updates.numpy()) == (2.0 ** 9, 0)


def optimizer_state(run) -> list[np.ndarray]:
    return [np.asarray(v.numpy()) for v in run.state.optimizer.variables] + [run.state.step.numpy()]


@pytest.mark.parametrize("mode", ["tower", "mirrored"])
def test_fp16_overflow_skips_the_update_everywhere_and_halves_the_scale(mode):
    layout = dict(mode=mode, num_gpus=2, accum=2, precision="fp16", **{**SGD, "optimizer": "momentum"})
    run, reference = make_run(**layout), make_run(**layout)
    stream = synthetic_batches(run)
    batches = [next(stream), next(stream)]
    scale = run.state.loss_scale
    # The scaled loss stays finite in float32, but its gradient overflows float16 in the towers.
    scale.value.assign(2.0 ** 60)
    before_weights, before_state = weights(run.state.model), optimizer_state(run)

    result = run.inner.run_update(iter(batches))

    assert not result.applied and np.isfinite(result.loss)
    assert scale.value.numpy() == 2.0 ** 59 and scale.good_updates.numpy() == 0
    for got, want in zip(weights(run.state.model) + optimizer_state(run), before_weights + before_state):
        np.testing.assert_array_equal(got, want)
    # Nothing of the skipped update lingers in the accumulators: at the usual scale the same
    # batches now give a fresh run's first update.
    scale.value.assign(LossScale.INITIAL)
    assert run.inner.run_update(iter(batches)).applied
    assert reference.inner.run_update(iter(batches)).applied
    for got, want in zip(weights(run.state.model), weights(reference.state.model)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("layout", [dict(mode="mirrored", num_gpus=2),
                                    dict(mode="tower", num_gpus=1, ps_device="gpu")],
                         ids=["mirrored", "tower-on-its-parameter-device"])
def test_jit_compile_gives_the_same_update(layout):
    layout = dict(accum=2, **layout, **SGD)
    want, _ = first_update_delta(**layout)
    got, _ = first_update_delta(jit_compile=True, **layout)
    assert relative_error(got, want) < 1e-4


def test_the_cli_trains_in_fp16_and_logs_the_loss_scale(tmp_path):
    result = run_cli("--precision=fp16", "--num_gpus=2", "--accum=2", "--batch_size=8", "--max_steps=2",
                     "--log_every=1", f"--train_dir={tmp_path}")
    assert result.returncode == 0, result.stderr
    scales = [float(s) for s in re.findall(r"step \d+, loss = [\d.]+, loss scale (\d+) \(", result.stderr)]
    # One progress line per update, each with the scale: 32768 halved by any overflow so far.
    assert len(scales) == 2 and all(s <= LossScale.INITIAL and math.log2(s).is_integer() for s in scales)
    assert "held-out precision @ 1" in result.stderr.strip().splitlines()[-1]
