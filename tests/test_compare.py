"""The compare command: the modes agree with tower mode, and its output is well-formed."""
import statistics
import subprocess
import sys

import pytest

from test_cli_errors import ROOT
from tower_train import compare, startup

MODES = ["tower", "mirrored", "central_storage"]


def test_every_mode_trains_like_tower_mode_and_logs_to_its_own_run(tmp_path):
    options = dict(num_gpus=2, accum=2, batch_size=8, max_steps=3, optimizer="sgd",
                   learning_rate=0.1, train_dir=str(tmp_path))
    with startup.start(startup.COMPARE, options) as run:
        config = run.config
        runs = compare.compare_modes(run, MODES)
    global_batch = 8 * 2 * 2
    compare.write_summaries(runs, config.train_dir, global_batch, warmup_updates=1)
    rows = {r.mode: r for r in compare.summarize(runs, global_batch, warmup_updates=1)}

    tower = runs["tower"]
    assert len(tower.losses) == 3
    for mode in ("mirrored", "central_storage"):
        assert runs[mode].losses == pytest.approx(tower.losses, rel=1e-5)
        assert compare.relative_weight_diff(runs[mode].weights, tower.weights) < 1e-5
        assert rows[mode].max_rel_weight_diff < 1e-5
    # Recomputed from each mode's update times: the median rate of the updates after the
    # warm-up one, and the ratio of that rate to tower mode's.
    rate = {m: statistics.median(global_batch / s for s in runs[m].seconds[1:]) for m in MODES}
    for mode in MODES:
        assert len(runs[mode].seconds) == 3
        assert rows[mode].examples_per_sec == pytest.approx(rate[mode], rel=1e-9)
        assert rows[mode].ratio_to_tower == pytest.approx(rate[mode] / rate["tower"], rel=1e-9)
        assert rows[mode].max_loss_diff == max(abs(a - b) for a, b in zip(runs[mode].losses, tower.losses))
    for mode in MODES:
        assert rows[mode].examples_per_sec > 0
        assert list((tmp_path / mode).glob("events.out.tfevents.*")), mode


def test_the_command_prints_a_row_per_mode_and_writes_the_plot(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "tower_train.compare", "--num_gpus=2", "--batch_size=4",
         "--accum=2", "--max_steps=3", f"--train_dir={tmp_path}"],
        capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert result.returncode == 0, result.stderr
    rows = {line.split()[0]: line.split() for line in result.stdout.splitlines()
            if line.split() and line.split()[0] in MODES}
    assert list(rows) == MODES
    # mode, median, '+/-', jitter, ratio, |dloss|, rel dw
    assert all(float(row[4]) > 0 for row in rows.values())
    # "vs tower" is the row's examples/sec over tower mode's, up to the printed rounding: the
    # ratio to 0.005, and the two rates (0.05 each) it is recomputed from here.
    tower_rate = float(rows["tower"][1])
    for mode, row in rows.items():
        ratio = float(row[1]) / tower_rate
        rounding = 0.005 + 0.05 * (1 + ratio) / (tower_rate - 0.05) + 1e-9
        assert float(row[4]) == pytest.approx(ratio, abs=rounding), mode
    # Every mode applies tower mode's updates: losses and weights agree up to float rounding.
    for mode in ("mirrored", "central_storage"):
        assert float(rows[mode][5]) < 1e-4 and float(rows[mode][6]) < 1e-4, rows[mode]
    assert "global batch G = 16, 3 updates per mode" in result.stdout
    png = tmp_path / "compare.png"
    assert f"plot: {png}" in result.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_multi_worker_is_refused_with_one_line():
    result = subprocess.run(
        [sys.executable, "-m", "tower_train.compare", "--modes=multi_worker"],
        capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tower_train: error: --modes: multi_worker")
    assert "python -m tower_train --mode=multi_worker" in lines[0]


def test_a_link_where_the_command_writes_is_refused_and_what_it_names_is_untouched(tmp_path):
    """compare writes TensorBoard runs and its plot in --train_dir: it takes the train_dir's lock
    as a run does, which refuses a link among its entries."""
    precious = tmp_path / "precious"
    precious.write_text("precious")
    train_dir = tmp_path / "run"
    train_dir.mkdir()
    (train_dir / "compare.png").symlink_to(precious)
    result = subprocess.run(
        [sys.executable, "-m", "tower_train.compare", "--num_gpus=2", "--batch_size=4",
         "--max_steps=3", f"--train_dir={train_dir}"],
        capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"tower_train: error: --train_dir={train_dir}: {train_dir}/compare.png is a symbolic link "
        f"(to {precious}); a run follows no link where it writes, so nothing it points at is "
        f"written: remove it, or add --train_dir={train_dir}_2"]
    assert precious.read_text() == "precious"
