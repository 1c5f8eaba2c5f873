"""The benchmark's reports in this process, on results made by hand: timing.format_report (and
moved_mb), traffic_report.format_traffic_report, ops.format_ops_report,
memory.format_memory_report, and the command's --link_gbps check. Every figure expected here is
worked out by hand in the test."""
import json
import re

import pytest

from tower_train.benchmark import _link_speeds
from tower_train.benchmark.memory import format_memory_report
from tower_train.benchmark.names import parse_config_name
from tower_train.benchmark.ops import format_ops_report
from tower_train.benchmark.timing import Measurement, devices_text, format_report, moved_mb
from tower_train.benchmark.traffic_report import format_traffic_report
from tower_train.errors import UsageError

TOWERS, BATCH = 2, 4
NONE_MOVED = {"weights": 0, "gradients": 0, "statistics": 0, "input": 0, "other": 0}


def measured(config: str, global_batch: int, examples_per_sec: float, jitter: float, sec_per_update: float,
             labels_per_example: int = 1, bytes_per_update: dict | None = None,
             input_examples_per_sec: float | None = None, compute_devices: list[str] | None = None) -> Measurement:
    return Measurement(config, global_batch, examples_per_sec, jitter, sec_per_update, labels_per_example,
                       bytes_per_update, input_examples_per_sec, None, None,
                       compute_devices or [f"/cpu:{i}" for i in range(1, TOWERS + 1)], [sec_per_update])


def moved(copied: dict, collective: dict | None = None) -> dict:
    """A Traffic.as_dict() of these category bytes (the per-device ones do not enter the time report)."""
    return {"copied": {**NONE_MOVED, **copied}, "collective": {**NONE_MOVED, **(collective or {})},
            "sent": {}, "received": {}, "collective_in": {}}


def test_moved_mb_adds_the_copied_and_the_collective_bytes_of_a_category():
    bytes_per_update = moved({"gradients": 1_234_567, "weights": 4_000_000}, {"gradients": 5_000_000})
    assert moved_mb(bytes_per_update, "gradients") == "6.23"  # (1,234,567 + 5,000,000) / 10^6
    assert moved_mb(bytes_per_update, "weights") == "4.00"
    assert moved_mb(bytes_per_update, "statistics") == "0.00"
    assert moved_mb(None, "gradients") == "-"  # one device: nothing moves


def test_the_time_report_prints_each_row_compares_time_per_example_and_rates_the_input():
    results = [
        measured("plain_k1", 8, 160.0, 3.25, 0.05, compute_devices=["/cpu:1"]),
        measured("tower_pscpu_k1", 8, 200.0, 0.5, 0.04,
                 bytes_per_update=moved({"weights": 4_273_192, "gradients": 4_273_208, "input": 27_680})),
        measured("tower_pscpu_k8", 64, 250.0, 12.0, 0.256,
                 bytes_per_update=moved({"weights": 4_273_192, "gradients": 4_273_208, "statistics": 6_000})),
        measured("mirrored_k8", 64, 125.0, 1.0, 0.512,
                 bytes_per_update=moved({"gradients": 1_000}, {"gradients": 8_546_400})),
        measured("tower_pscpu_k8_data", 64, 200.0, 2.0, 0.32, input_examples_per_sec=2500.0,
                 bytes_per_update=moved({"weights": 4_273_192, "gradients": 4_273_208})),
    ]
    lines = format_report(results, TOWERS, BATCH).splitlines()
    assert lines[0].split() == ["config", "G", "examples/sec", "sec/update", "weights", "MB", "grads", "MB",
                                "stats", "MB", "computes", "on"]
    # config, G, examples/sec +/- jitter, sec/update, MB of weights, gradients and statistics, devices
    assert [line.split() for line in lines[1:6]] == [
        ["plain_k1", "8", "160.0", "+/-", "3.2", "0.0500", "-", "-", "-", "/cpu:1"],  # 3.25 rounds to even
        ["tower_pscpu_k1", "8", "200.0", "+/-", "0.5", "0.0400", "4.27", "4.27", "0.00", "/cpu:1..2"],
        ["tower_pscpu_k8", "64", "250.0", "+/-", "12.0", "0.2560", "4.27", "4.27", "0.01", "/cpu:1..2"],
        ["mirrored_k8", "64", "125.0", "+/-", "1.0", "0.5120", "0.00", "8.55", "0.00", "/cpu:1..2"],  # 8,547,400 B
        ["tower_pscpu_k8_data", "64", "200.0", "+/-", "2.0", "0.3200", "4.27", "4.27", "0.00", "/cpu:1..2"]]
    # Seconds per example: plain_k1 0.05/8 = 0.00625, tower_pscpu_k1 0.04/8 = 0.005,
    # tower_pscpu_k8 0.256/64 = 0.004, mirrored_k8 0.512/64 = 0.008, tower_pscpu_k8_data 0.32/64 = 0.005:
    # the pairs of the suite that were both run, in the suite's order.
    compared = re.findall(r"^time per example, (\S+) / (\S+): (\S+)", "\n".join(lines), re.M)
    assert compared == [("tower_pscpu_k1", "plain_k1", "0.800"), ("tower_pscpu_k8", "mirrored_k8", "0.500"),
                        ("tower_pscpu_k8", "tower_pscpu_k1", "0.800"),
                        ("tower_pscpu_k8_data", "tower_pscpu_k8", "1.250")]
    assert "time per example, tower_pscpu_k1 / plain_k1: 0.800  (towers vs one device, same G; goal <= 1.05)" in lines
    # Only the configuration fed by a pipeline has its input timed alone: 2500 / 200 = 12.5 times.
    alone = [line for line in lines if line.startswith("input alone")]
    assert alone == ["input alone, tower_pscpu_k8_data: 2500 examples/sec, 12.5x what its training consumes "
                     "(goal >= 10)"]
    assert lines[-2] == f"{TOWERS} tower(s), {BATCH} examples per tower per micro-step unless _bB says"
    assert "tokens/sec" not in "\n".join(lines)  # one label per example: no tokens column


def test_the_time_report_counts_tokens_when_a_configuration_has_labels_per_position():
    results = [measured("tower_pscpu_k2", 16, 125.5, 1.5, 0.1275, labels_per_example=48),
               measured("plain_k2", 16, 200.0, 4.0, 0.08)]
    lines = format_report(results, TOWERS, BATCH).splitlines()
    assert lines[0].split()[-3] == "tokens/sec"
    rows = [line.split() for line in lines[1:3]]
    assert [row[-2] for row in rows] == ["6024", "200"]  # 125.5 x 48 labels; 200 x 1
    assert [len(row) for row in rows] == [11, 11]
    assert lines[-2].endswith("; tokens/sec counts every label position, padding included")


def test_devices_are_written_as_a_range_when_they_are_consecutive_devices_of_one_kind():
    assert devices_text(["/gpu:0", "/gpu:1", "/gpu:2", "/gpu:3"]) == "/gpu:0..3"
    assert devices_text(["/cpu:1"]) == "/cpu:1"
    assert devices_text(["/cpu:1", "/cpu:3"]) == "/cpu:1,/cpu:3"  # a gap
    assert devices_text(["/cpu:0", "/gpu:0"]) == "/cpu:0,/gpu:0"  # two kinds
    assert devices_text([]) == "-"


def test_the_traffic_report_prints_megabytes_and_the_busiest_devices_time_on_each_link():
    towers = {"copied": {**NONE_MOVED, "weights": 4_273_192, "gradients": 4_273_208, "input": 27_680, "other": 8},
              "collective": dict(NONE_MOVED),
              "sent": {"/cpu:0": 4_300_872, "/cpu:1": 2_136_604, "/cpu:2": 2_136_604},
              "received": {"/cpu:0": 4_273_216, "/cpu:1": 2_150_436, "/cpu:2": 2_150_436},
              "collective_in": {}}
    # Three replicas, 3 MB entering each one's all-reduce: a ring sends and receives
    # 2 x (3 - 1) / 3 x 3 MB = 4 MB per replica, and /cpu:1 also receives 0.5 MB of input.
    replicas = {"copied": {**NONE_MOVED, "input": 500_000},
                "collective": {**NONE_MOVED, "gradients": 9_000_000},
                "sent": {"/cpu:0": 500_000}, "received": {"/cpu:1": 500_000},
                "collective_in": {"/cpu:1": 3_000_000, "/cpu:2": 3_000_000, "/cpu:3": 3_000_000}}
    results = [
        {"config": "tower_pscpu_k1", "global_batch": 8, "bytes_per_update": towers,
         "busiest_device_bytes": 4_300_872, "state_bytes_per_device": {"/cpu:0": 17_092_792}},
        {"config": "mirrored_k1", "global_batch": 12, "bytes_per_update": replicas,
         "busiest_device_bytes": 4_500_000,
         "state_bytes_per_device": {"/cpu:1": 21_366_000, "/cpu:2": 21_366_000, "/cpu:3": 21_366_000}},
        {"config": "plain_k1", "global_batch": 8, "bytes_per_update": None, "busiest_device_bytes": None,
         "state_bytes_per_device": None}]
    lines = format_traffic_report(results, [8, 2.5]).splitlines()
    assert lines[0].split()[:11] == ["config", "G", "weights", "gradients", "statistics", "input", "other",
                                     "collective", "busiest", "state", "max"]
    assert "ms @8Gb/s" in lines[0] and "ms @2.5Gb/s" in lines[0]
    # MB: the five categories copied, all collective bytes, the busiest device's, the fullest device's
    # state; then ms per update: the busiest device's bytes x 8 bits at the link's speed.
    # 4,300,872 B x 8 / 8e9 b/s = 4.30 ms; / 2.5e9 b/s = 13.76 ms.
    # 4,500,000 B x 8 / 8e9 b/s = 4.50 ms; / 2.5e9 b/s = 14.40 ms.
    assert [line.split() for line in lines[1:4]] == [
        ["tower_pscpu_k1", "8", "4.27", "4.27", "0.00", "0.03", "0.00", "0.00", "4.30", "17.09", "4.30", "13.76"],
        ["mirrored_k1", "12", "0.00", "0.00", "0.00", "0.50", "0.00", "9.00", "4.50", "21.37", "4.50", "14.40"],
        ["plain_k1", "8", "one", "device:", "nothing", "crosses"]]
    # No link speeds: no time columns.
    unlinked = format_traffic_report(results[:1], []).splitlines()
    assert "ms @" not in unlinked[0]
    assert unlinked[1].split() == ["tower_pscpu_k1", "8", "4.27", "4.27", "0.00", "0.03", "0.00", "0.00", "4.30",
                                   "17.09"]


def test_the_ops_report_sums_busy_time_without_idle_and_names_the_top_six_op_types():
    results = [
        {"config": "tower_pscpu_k1_data", "wall_us_per_example": 123.27,
         "op_us_per_example": {"Conv2D": 50.0, "MatMul": 20.0, "Dataset": 10.0, "IDLE": 1000.0, "Relu": 5.0,
                               "AddV2": 3.0, "Mul": 2.0, "Sum": 1.0, "Cast": 0.4}},
        {"config": "tower_pscpu_k1", "wall_us_per_example": 40.0,
         "op_us_per_example": {"Conv2D": 30.0, "IDLE": 5.0, "MatMul": 6.0}}]
    lines = format_ops_report(results).splitlines()
    assert lines[0].split()[:7] == ["config", "wall", "us/ex", "ops", "us/ex", "input", "top"]
    # Busy: 50 + 20 + 10 + 5 + 3 + 2 + 1 + 0.4 = 91.4 us (IDLE left out); the pipeline's share
    # 10 / 91.4 = 10.94 %; the six largest but IDLE, largest first.
    assert lines[1].split(None, 4) == ["tower_pscpu_k1_data", "123.3", "91.4", "10.9%",
                                       "Conv2D 50, MatMul 20, Dataset 10, Relu 5, AddV2 3, Mul 2"]
    assert lines[2].split(None, 4) == ["tower_pscpu_k1", "40.0", "36.0", "0.0%", "Conv2D 30, MatMul 6"]


def memory_result(config: str, global_batch: int, accum: int, batch: int, before: float, peak: float,
                  floor_added: float, activations: float, gpu_peak_mb: dict | None = None) -> dict:
    return {"config": config, "global_batch": global_batch, "accum": accum, "batch_per_tower": batch,
            "rss_before_mb": before, "peak_rss_mb": peak, "floor_added_mb": floor_added,
            "gpu_peak_mb": gpu_peak_mb or {}, "activations_mb": activations}


def test_the_memory_report_takes_the_floor_off_and_compares_activations_with_the_first_row():
    results = [memory_result("tower_pscpu_k1_b32", 64, 1, 32, 512.4, 812.6, 100.2, 200.2),
               memory_result("tower_pscpu_k2_b16", 64, 2, 16, 510.0, 660.0, 50.0, 100.0,
                             {"GPU:0": 1234.4, "GPU:1": 99.6})]
    lines = format_memory_report(results).splitlines()
    assert lines[0].split() == ["config", "G", "K", "B", "host", "RSS", "before", "host", "peak", "added",
                                "activations", "vs", "row", "1", "(MB)"]
    # added = peak - before: 300.2 and 150; the second row's activations are 100 / 200.2 = 0.50 of the first's.
    assert [line.split() for line in lines[1:3]] == [
        ["tower_pscpu_k1_b32", "64", "1", "32", "512", "813", "300", "200", "1.00"],
        ["tower_pscpu_k2_b16", "64", "2", "16", "510", "660", "150", "100", "0.50",
         "GPU:0", "peak", "1234", "MB", "GPU:1", "peak", "100", "MB"]]
    assert lines[3].startswith("activations: the busiest GPU's peak")


def test_the_memory_report_has_no_ratio_when_the_first_row_adds_no_activations():
    # The first row is a floor itself: its updates add exactly its floor's 80 MB.
    results = [memory_result("tower_pscpu_k1_b1", 2, 1, 1, 500.0, 580.0, 80.0, 0.0),
               memory_result("tower_pscpu_k1_b4", 8, 1, 4, 500.0, 700.0, 80.0, 120.0)]
    lines = format_memory_report(results).splitlines()
    assert [row.split()[7:] for row in lines[1:3]] == [["0", "-"], ["120", "-"]]
    assert lines[3].startswith("activations: the host's peak RSS")


def gpu_memory(peak: dict, before: dict) -> dict:
    return {"gpu_peak_mb": peak, "gpu_before_mb": before}


def test_on_gpus_the_activations_are_the_busiest_gpus_peak_above_its_floors_not_the_hosts_rss(monkeypatch):
    """measure_memory's figures from its subprocesses' JSON lines (faked here): with GPUs, a
    configuration's activations are, per GPU, (peak - before) less its floor's, the largest of
    them; the host's RSS, which fell here, does not enter."""
    from tower_train.benchmark import memory

    lines = {
        "tower_pscpu_k1_b1": {"rss_before_mb": 900.0, "peak_rss_mb": 905.0,
                              **gpu_memory({"GPU:0": 50.0, "GPU:1": 52.0}, {"GPU:0": 40.0, "GPU:1": 40.0})},
        "tower_pscpu_k1_b32": {"rss_before_mb": 910.0, "peak_rss_mb": 900.0,
                               **gpu_memory({"GPU:0": 121.0, "GPU:1": 101.0}, {"GPU:0": 40.0, "GPU:1": 41.0})},
    }

    class Child:
        def __init__(self, argv, **kwargs):
            name = next(a for a in argv if a.startswith("--configs=")).split("=")[1]
            self.returncode, self.stderr = 0, ""
            self.stdout = json.dumps({"config": name, **lines[name]}) + "\n"

    monkeypatch.setattr(memory.subprocess, "run", Child)
    [result] = memory.measure_memory([parse_config_name("tower_pscpu_k1_b32", 32)], ["benchmark"])
    # GPU:0: (121 - 40) - (50 - 40) = 71; GPU:1: (101 - 41) - (52 - 40) = 48.
    assert result["activations_mb"] == 71.0
    assert result["floor_added_mb"] == 5.0


def test_link_speeds_are_positive_numbers_or_refused_in_one_line():
    assert _link_speeds(["256", "2.5", "1e2"]) == [256.0, 2.5, 100.0]
    assert _link_speeds([]) == []
    for values in (["fast"], ["0"], ["-8"], ["nan"], ["100", ""]):
        with pytest.raises(UsageError) as refused:
            _link_speeds(values)
        assert str(refused.value) == (f"--link_gbps={','.join(values)}: must be numbers > 0 (gigabits per "
                                      "second), comma-separated")
