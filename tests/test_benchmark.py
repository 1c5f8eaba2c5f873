"""A smoke run of the benchmark command: its output is well-formed (no timing is asserted)."""
import json
import subprocess
import sys

from test_cli_errors import ROOT


def test_benchmark_prints_a_row_per_config_and_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    result = subprocess.run(
        [sys.executable, "-m", "tower_train.benchmark", "--num_gpus=2", "--batch_size=4",
         "--configs=plain_k1,tower_k1,tower_k8", "--updates=1", "--rounds=2",
         "--warmup_updates=1", f"--output_json={out}"],
        capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert result.returncode == 0, result.stderr
    rows = {line.split()[0]: line.split() for line in result.stdout.splitlines()[1:4]}
    assert set(rows) == {"plain_k1", "tower_k1", "tower_k8"}
    assert [rows[n][1] for n in ("plain_k1", "tower_k1", "tower_k8")] == ["8", "8", "64"]
    assert "tower_k1 / plain_k1 (same G, 2 towers)" in result.stdout
    assert "tower_k8 / tower_k1 (same micro-batch)" in result.stdout
    results = json.loads(out.read_text())["results"]
    assert [r["config"] for r in results] == ["plain_k1", "tower_k1", "tower_k8"]
    assert all(r["examples_per_sec"] > 0 and r["sec_per_update"] > 0 for r in results)


def test_benchmark_refuses_a_bad_config_name(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "tower_train.benchmark", "--configs=warp_k2"],
        capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "tower_train: error: --configs: 'warp_k2' is not MODE_kK with MODE in plain, tower, mirrored, central_storage and K >= 1"]
