"""Smoke runs of the benchmark command: its output is well-formed (no timing is asserted)."""
import json
import subprocess
import sys

import pytest

from test_cli_errors import ROOT
from tower_train.benchmark import comparisons, default_configs, parse_config_name
from tower_train.errors import UsageError

TINY = ["--num_gpus=2", "--batch_size=4", "--updates=1", "--warmup_updates=1"]


def benchmark(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tower_train.benchmark", *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)


def test_every_kind_runs_and_the_report_and_json_are_well_formed(tmp_path):
    out = tmp_path / "bench.json"
    names = ["plain_k1", "tower_pscpu_k1", "tower_psgpu_k1", "mirrored_k2", "central_storage_k1",
             "keras_fit_k2", "tower_pscpu_k2_b2_data"]
    result = benchmark(*TINY, f"--configs={','.join(names)}", "--rounds=2", f"--output_json={out}")
    assert result.returncode == 0, result.stderr
    rows = {line.split()[0]: line.split() for line in result.stdout.splitlines()[1:1 + len(names)]}
    assert list(rows) == names
    # G = B x 2 towers x K
    assert [int(rows[n][1]) for n in names] == [8, 8, 8, 16, 8, 16, 8]
    assert "time per example, tower_pscpu_k1 / plain_k1: " in result.stdout
    written = json.loads(out.read_text())
    assert written["measure"] == "time" and written["towers"] == 2
    assert [r["config"] for r in written["results"]] == names
    assert all(r["examples_per_sec"] > 0 and r["sec_per_update"] > 0 for r in written["results"])


def test_memory_runs_each_configuration_in_its_own_process(tmp_path):
    out = tmp_path / "memory.json"
    result = benchmark(*TINY, "--measure=memory", "--configs=tower_pscpu_k1_b4,tower_pscpu_k2_b2",
                       f"--output_json={out}")
    assert result.returncode == 0, result.stderr
    results = json.loads(out.read_text())["results"]
    assert [(r["config"], r["global_batch"], r["accum"]) for r in results] == [
        ("tower_pscpu_k1_b4", 8, 1), ("tower_pscpu_k2_b2", 8, 2)]
    # Two processes: each reports its own resident memory, and the updates add to it.
    assert all(r["peak_rss_mb"] >= r["rss_before_mb"] > 100 for r in results)
    # Each against its floor, measured in processes of their own: tower_pscpu_k1_b1, _k2_b1.
    assert all(r["floor_added_mb"] >= 0 for r in results)
    assert "activations" in result.stdout.splitlines()[0]
    assert results[0]["gpu_peak_mb"] == {}  # no GPU here
    assert result.stdout.splitlines()[1].split()[0] == "tower_pscpu_k1_b4"


def test_config_names_parse_and_bad_ones_are_refused():
    assert parse_config_name("tower_pscpu_k8_b32_data", 128) == parse_config_name(
        "tower_pscpu_k8_b32_data", 1)
    bench = parse_config_name("keras_fit_k8", 32)
    assert (bench.kind, bench.accum, bench.batch_size, bench.from_pipeline) == ("keras_fit", 8, 32, False)
    bench = parse_config_name("central_storage_k1_b256", 32)
    assert (bench.kind, bench.accum, bench.batch_size) == ("central_storage", 1, 256)
    for bad in ("warp_k2", "tower_k1", "plain_k0", "plain_k1_b0", "plain", "mirrored_k2_data_b4"):
        with pytest.raises(UsageError, match=f"--configs: '{bad}' is not KIND_kK"):
            parse_config_name(bad, 32)


def test_the_default_suites():
    time_suite = default_configs("time", 32)
    assert len(time_suite) == 14 and "keras_fit_k8" in time_suite
    # every goal of the suite has both of its configurations
    assert len(comparisons(time_suite, 32)) == 13
    memory_suite = [parse_config_name(n, 32) for n in default_configs("memory", 32)]
    assert {b.batch_size * b.accum for b in memory_suite} == {256}  # one G
    assert [b.accum for b in memory_suite] == [1, 2, 4, 8]


def test_benchmark_refuses_bad_flags_in_one_line():
    for args, line in [
            (["--configs=warp_k2"], "tower_train: error: --configs: 'warp_k2' is not KIND_kK[_bB][_data] "
                                    "with KIND in plain, tower_pscpu, tower_psgpu, mirrored, "
                                    "central_storage, keras_fit, K >= 1 and B >= 1"),
            (["--measure=speed"], "tower_train: error: --measure=speed: unknown; allowed: time, memory")]:
        result = benchmark(*args)
        assert result.returncode == 2
        assert result.stderr.strip().splitlines() == [line]
