"""Smoke runs of the benchmark command: its output is well-formed (no timing is asserted)."""
import json
import re
import subprocess
import sys

import pytest

from test_cli_errors import ROOT
from tower_train import startup
from tower_train.benchmark import trainable_configs
from tower_train.benchmark.options import bench_flags
from tower_train.benchmark.names import comparisons, default_configs, parse_config_name
from tower_train.errors import UsageError

TOWERS, BATCH = 2, 4
TINY = [f"--num_gpus={TOWERS}", f"--batch_size={BATCH}", "--updates=1", "--warmup_updates=1"]
# For the smoke run of every kind, whose checks are of the report's form and of G, K and B, not of
# a network: tracing cifar10_cnn for each of its ten configurations was most of its time.
POOLED_MODEL = '''
import keras
from tower_train.models import TowerModel, register


@register("pooled")
class Pooled(TowerModel):
    def __init__(self, num_classes, **kwargs):
        super().__init__(num_classes, **kwargs)
        self.pool = keras.layers.GlobalAveragePooling2D()
        self.logits = keras.layers.Dense(num_classes)

    def call(self, images, training=False):
        return self.logits(self.pool(images))
'''


def pooled_model(directory) -> list[str]:
    """The flags that train POOLED_MODEL, its module written in `directory`."""
    (directory / "pooled_model.py").write_text(POOLED_MODEL)
    return [f"--model_module={directory / 'pooled_model.py'}", "--model=pooled"]


def benchmark(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tower_train.benchmark", *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)


def k_and_b(name: str) -> tuple[int, int]:
    """K and B of a configuration name, read here: _kK, and _bB or else --batch_size."""
    match = re.search(r"_k(\d+)(?:_b(\d+))?(?:_permicro)?(?:_data|_tfrecord|_dataset)?$", name)
    return int(match[1]), int(match[2] or BATCH)


def megabytes(moved: dict | None, category: str) -> str:
    """What the report prints for a category: MB along edges and into collectives, '-' for none."""
    if moved is None:
        return "-"
    return f"{(moved['copied'][category] + moved['collective'][category]) / 1e6:.2f}"


def test_every_kind_runs_and_the_report_and_json_are_well_formed(tmp_path):
    out = tmp_path / "bench.json"
    names = ["plain_k1", "tower_pscpu_k1", "tower_psgpu_k1", "tower_psspread_k2", "mirrored_k2", "central_storage_k1",
             "keras_fit_k2", "tower_pscpu_k2_b2_data", "tower_pscpu_k2_b2_tfrecord",
             "tower_pscpu_k2_b2_dataset"]
    # An odd number of rounds: the median rate is then the rate of the median time.
    result = benchmark(*TINY, *pooled_model(tmp_path), f"--configs={','.join(names)}", "--rounds=3",
                       f"--output_json={out}")
    assert result.returncode == 0, result.stderr
    rows = {line.split()[0]: line.split() for line in result.stdout.splitlines()[1:1 + len(names)]}
    assert list(rows) == names
    written = json.loads(out.read_text())
    assert written["measure"] == "time" and written["towers"] == TOWERS
    assert [r["config"] for r in written["results"]] == names
    assert all(r["examples_per_sec"] > 0 and r["sec_per_update"] > 0 for r in written["results"])
    for r in written["results"]:
        # Each round's time, in order; the figure is their median.
        assert len(r["sec_per_update_by_round"]) == 3
        assert r["sec_per_update"] == sorted(r["sec_per_update_by_round"])[1]
        k, b = k_and_b(r["config"])
        row = rows[r["config"]]  # config, G, median, '+/-', jitter, sec/update, MB: weights, grads, stats
        assert int(row[1]) == r["global_batch"] == b * TOWERS * k, row  # G = B x towers x K
        assert r["examples_per_sec"] == pytest.approx(r["global_batch"] / r["sec_per_update"], rel=1e-9)
        assert float(row[2]) == pytest.approx(r["examples_per_sec"], abs=0.05 + 1e-9), row
        assert float(row[5]) == pytest.approx(r["sec_per_update"], abs=0.00005 + 1e-12), row
        moved = r["bytes_per_update"]
        assert (moved is None) == r["config"].startswith(("plain", "keras_fit")), r  # one device: none
        assert row[6:9] == [megabytes(moved, c) for c in ("weights", "gradients", "statistics")], row
        if moved is not None:
            assert moved["copied"]["gradients"] > 0, r
    # Each comparison is the time per example (sec/update / G) of A over B's.
    by_name = {r["config"]: r for r in written["results"]}
    compared = re.findall(r"^time per example, (\S+) / (\S+): (\S+)", result.stdout, re.M)
    assert ("tower_pscpu_k1", "plain_k1") in [(a, b) for a, b, _ in compared]
    for a, b, ratio in compared:
        per_example = {n: by_name[n]["sec_per_update"] / by_name[n]["global_batch"] for n in (a, b)}
        assert float(ratio) == pytest.approx(per_example[a] / per_example[b], abs=0.0005 + 1e-9), (a, b)
    # A pipeline is also timed alone; a batch held in memory has none to time.
    alone = dict(re.findall(r"^input alone, (\S+): (\d+) examples/sec", result.stdout, re.M))
    assert sorted(alone) == sorted(n for n in names if n.endswith(("_data", "_tfrecord", "_dataset")))
    for name, rate in alone.items():
        assert int(rate) == round(by_name[name]["input_examples_per_sec"]), name
    assert all(by_name[n]["input_examples_per_sec"] is None for n in names if n not in alone)


@pytest.mark.cpu_only
def test_memory_runs_each_configuration_in_its_own_process(tmp_path):
    out = tmp_path / "memory.json"
    # The last two are the floors of the first two (one example per tower), so they are run once,
    # and their own figures are in the report too.
    names = ["tower_pscpu_k1_b4", "tower_pscpu_k2_b2", "tower_pscpu_k1_b1", "tower_pscpu_k2_b1"]
    result = benchmark(*TINY, "--measure=memory", f"--configs={','.join(names)}", f"--output_json={out}")
    assert result.returncode == 0, result.stderr
    results = json.loads(out.read_text())["results"]
    assert [r["config"] for r in results] == names
    for r in results:
        k, b = k_and_b(r["config"])
        assert (r["accum"], r["batch_per_tower"], r["global_batch"]) == (k, b, b * TOWERS * k), r
    # Separate processes: each reports its own resident memory, and the updates add to it.
    assert all(r["peak_rss_mb"] >= r["rss_before_mb"] > 100 for r in results)
    # Each against its floor, the same K at one example per tower, measured in a process of its own:
    # what that process's updates added.
    by_name = {r["config"]: r for r in results}
    for r in results:
        floor = by_name[re.sub(r"_b\d+$", "_b1", r["config"])]
        assert r["floor_added_mb"] == floor["peak_rss_mb"] - floor["rss_before_mb"], r["config"]
    assert all(r["gpu_peak_mb"] == {} for r in results)  # cpu_only: no GPU
    lines = result.stdout.splitlines()
    assert "activations" in lines[0]
    # config, G, K, B, RSS before, peak RSS, added, activations, vs row 1: the JSON's figures, rounded.
    rows = [line.split() for line in lines[1:1 + len(names)]]
    assert [row[0] for row in rows] == names
    activations = [r["peak_rss_mb"] - r["rss_before_mb"] - r["floor_added_mb"] for r in results]
    assert activations == [r["activations_mb"] for r in results]  # no GPU: from the host's RSS
    for row, r, act in zip(rows, results, activations):
        assert [int(v) for v in row[1:4]] == [r["global_batch"], r["accum"], r["batch_per_tower"]], row
        printed = [float(v) for v in row[4:8]]
        figures = [r["rss_before_mb"], r["peak_rss_mb"], r["peak_rss_mb"] - r["rss_before_mb"], act]
        assert printed == pytest.approx(figures, abs=0.5 + 1e-9), row
        if activations[0] > 0:
            assert float(row[8]) == pytest.approx(act / activations[0], abs=0.005 + 1e-9), row
        else:
            assert row[8] == "-", row
    assert activations[2] == activations[3] == 0  # a floor adds nothing above itself


def test_config_names_parse_and_bad_ones_are_refused():
    assert parse_config_name("tower_pscpu_k8_b32_data", 128) == parse_config_name(
        "tower_pscpu_k8_b32_data", 1)
    bench = parse_config_name("keras_fit_k8", 32)
    assert (bench.kind, bench.accum, bench.batch_size, bench.input) == ("keras_fit", 8, 32, "memory")
    assert parse_config_name("tower_pscpu_k8_tfrecord", 32).input == "tfrecord"
    assert parse_config_name("tower_pscpu_k8_dataset", 32).input == "dataset"
    skewed = parse_config_name("tower_pscpu_k4_b8_s1-3_data", 32)
    assert (skewed.tower_split, skewed.batch_size, skewed.input) == ("1,3", 8, "data")
    with pytest.raises(UsageError, match="_sSHARES .* tower kinds only"):
        parse_config_name("mirrored_k2_s1-3", 32)
    assert parse_config_name("tower_psgpu_k8_b4_permicro_data", 32).weights_per_micro_step
    assert not parse_config_name("tower_psgpu_k8", 32).weights_per_micro_step
    for kind in ("mirrored", "tower_psspread"):  # spread sends the weights once per update
        with pytest.raises(UsageError, match="_permicro .* is for tower_pscpu and tower_psgpu only"):
            parse_config_name(f"{kind}_k2_permicro", 32)
    bench = parse_config_name("central_storage_k1_b256", 32)
    assert (bench.kind, bench.accum, bench.batch_size) == ("central_storage", 1, 256)
    for bad in ("warp_k2", "tower_k1", "plain_k0", "plain_k1_b0", "plain", "mirrored_k2_data_b4"):
        with pytest.raises(UsageError, match=f"--configs: '{bad}' is not KIND_kK"):
            parse_config_name(bad, 32)


def test_the_default_suites():
    time_suite = default_configs("time", 32)
    benches = {name: parse_config_name(name, 32) for name in time_suite}  # every name parses
    assert len(benches) == len(time_suite)  # none twice
    # Every configuration the suite spends time on is in a comparison of the report, and each
    # comparison holds what its note says.
    pairs = comparisons(time_suite, 32)
    assert {name for a, b, _ in pairs for name in (a, b)} == set(time_suite)
    for a, b, note in pairs:
        g = {n: benches[n].batch_size * benches[n].accum for n in (a, b)}
        if "same G" in note:
            assert g[a] == g[b], (a, b, note)
        if "same micro-batch" in note:
            assert benches[a].batch_size == benches[b].batch_size, (a, b, note)
        if "input pipeline vs in memory" in note:
            assert (benches[a].input, benches[b].input) == ("data", "memory"), (a, b, note)
            assert g[a] == g[b], (a, b, note)
        if "TFRecord files vs in memory" in note:
            assert (benches[a].input, benches[b].input) == ("tfrecord", "memory"), (a, b, note)
            assert g[a] == g[b], (a, b, note)
        if "tf.data pipeline vs in memory" in note:
            assert (benches[a].input, benches[b].input) == ("dataset", "memory"), (a, b, note)
            assert g[a] == g[b], (a, b, note)
    traffic_suite = [parse_config_name(n, 32) for n in default_configs("traffic", 32)]
    assert {b.kind for b in traffic_suite} == {"tower_pscpu", "tower_psgpu", "tower_psspread", "mirrored",
                                               "central_storage"}
    assert {b.accum for b in traffic_suite} == {1, 8} and any(b.weights_per_micro_step for b in traffic_suite)
    memory_suite = [parse_config_name(n, 32) for n in default_configs("memory", 32)]
    assert {b.batch_size * b.accum for b in memory_suite} == {8 * 32}  # one G, 8 x --batch_size per tower
    # The report compares each row's activations with row 1's: K rises from 1, each K once.
    accums = [b.accum for b in memory_suite]
    assert accums[0] == 1 and accums == sorted(set(accums)) and len(accums) > 1


def test_benchmark_refuses_bad_flags_in_one_line():
    for args, line in [
            (["--configs=warp_k2"], "tower_train: error: --configs: 'warp_k2' is not "
                                    "KIND_kK[_bB][_sA-B...][_permicro][_data|_tfrecord|_dataset] "
                                    "with KIND in plain, tower_pscpu, tower_psgpu, tower_psspread, "
                                    "mirrored, central_storage, keras_fit, K >= 1 and B >= 1"),
            (["--measure=speed"], "tower_train: error: --measure=speed: unknown; allowed: time, memory, traffic, ops, keras"),
            (["--measure=traffic", "--link_gbps=fast"],
             "tower_train: error: --link_gbps=fast: must be numbers > 0 (gigabits per second), comma-separated"),
            (["--link_gbps=100"], "tower_train: error: --link_gbps: only with --measure=traffic"),
            (["--slow_tower_ms=5", "--jit_compile"],
             "tower_train: error: --slow_tower_ms: not with --jit_compile (XLA cannot compile the slowed "
             "tower's sleep)")]:
        result = benchmark(*args)
        assert result.returncode == 2
        assert result.stderr.strip().splitlines() == [line]
    # Found once the model is built, after the device line, and before anything is measured.
    result = benchmark("--model=resnet20", "--configs=tower_pscpu_k1,central_storage_k1,central_storage_k8")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[1:] == [
        "tower_train: error: --configs: central_storage_k1, central_storage_k8: --mode=central_storage: "
        "--model=resnet20 has moving statistics (BatchNormalization) or random state (Dropout), which "
        "CentralStorageStrategy cannot update from its replicas; leave them out"]


def test_a_default_suite_leaves_out_the_modes_that_cannot_train_the_model_saying_why(caplog):
    # Before: the suite measured every other configuration of --model=resnet20 for minutes, then
    # ended at central_storage_k1 with that mode's error, printing nothing it had measured.
    suite = [parse_config_name(name, 2) for name in default_configs("traffic", 2)]
    options = {"num_gpus": 2, "batch_size": 2, "train_dir": "unused"}
    with startup.start(startup.BENCHMARK, {**options, "model": "resnet20"}) as run:
        kept = trainable_configs(suite, run, given=False)
    assert [b.name for b in kept] == [b.name for b in suite if b.kind != "central_storage"]
    assert ("the benchmark leaves out central_storage_k1, central_storage_k8: --mode=central_storage: "
            "--model=resnet20 has moving statistics") in caplog.text
    with startup.start(startup.BENCHMARK, {**options, "model": "cifar10_cnn"}) as run:
        assert trainable_configs(suite, run, given=True) == suite  # no BN, no Dropout: all of it trains


def test_a_slowed_first_tower_waits_per_example_of_its_share_in_each_configuration():
    """Tower 0 waits 20 ms per example: with an even split of 4 + 4 at least 80 ms per micro-step,
    with 1 + 7 at least 20 ms. Only these floors are asserted, which a busy machine cannot break:
    that the skewed split is faster is a timing, which docs/performance.md measures with the
    benchmark ("Uneven towers")."""
    result = benchmark("--num_gpus=2", "--batch_size=4", "--updates=2", "--warmup_updates=1",
                       "--rounds=1", "--slow_tower_ms=20", "--configs=tower_pscpu_k2,tower_pscpu_k2_s1-7")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {line.split()[0]: line.split() for line in result.stdout.splitlines()[1:3]}
    even, skewed = float(rows["tower_pscpu_k2"][5]), float(rows["tower_pscpu_k2_s1-7"][5])  # sec/update
    assert even > 2 * 0.080  # two micro-steps of at least 80 ms each
    assert skewed > 2 * 0.020  # two micro-steps of at least 20 ms each


def test_traffic_counts_bytes_per_update_and_predicts_link_time(tmp_path):
    out = tmp_path / "traffic.json"
    names = ["tower_pscpu_k1", "tower_pscpu_k3", "tower_pscpu_k3_permicro", "tower_psspread_k3", "mirrored_k3",
             "plain_k1"]
    result = benchmark(f"--num_gpus={TOWERS}", f"--batch_size={BATCH}", "--measure=traffic",
                       f"--configs={','.join(names)}", "--link_gbps=8,80", f"--output_json={out}")
    assert result.returncode == 0, result.stderr[-3000:]
    written = {r["config"]: r for r in json.loads(out.read_text())["results"]}
    results = {name: r["bytes_per_update"] for name, r in written.items()}
    assert list(results) == names and results["plain_k1"] is None
    # cifar10_cnn's trainable weights, P bytes: each tower gets them once per update at any K, or
    # once per micro-step with _permicro; the strategy's replicas hold their own.
    p = results["tower_pscpu_k1"]["copied"]["weights"] // TOWERS
    assert p == 4 * 1_068_298  # 1,068,298 float32 weights ("1.07 M parameters", docs/models.md)
    assert results["tower_pscpu_k3"]["copied"]["weights"] == TOWERS * p
    assert results["tower_pscpu_k3_permicro"]["copied"]["weights"] == 3 * TOWERS * p
    for name in ("tower_pscpu_k1", "tower_pscpu_k3", "tower_pscpu_k3_permicro"):
        assert results[name]["copied"]["gradients"] == TOWERS * (p + 8), name  # sums once per update
    # Spread: each tower receives the weights and sends the gradient rows it does not own, and 14
    # bytes of scalars per tower (tests/test_spread.py has them), so it moves less than the host.
    # The regularization's value (4 bytes) comes to the host from tower 0's copy of the weights.
    assert results["tower_psspread_k3"]["copied"]["weights"] == (TOWERS - 1) * p + 4
    assert results["tower_psspread_k3"]["copied"]["gradients"] == (TOWERS - 1) * p + TOWERS * 14
    assert written["tower_psspread_k3"]["busiest_device_bytes"] < written["tower_pscpu_k3"]["busiest_device_bytes"]
    rows = {line.split()[0]: line.split() for line in result.stdout.splitlines()[1:1 + len(names)]}
    assert rows["plain_k1"][2:] == ["one", "device:", "nothing", "crosses"]
    for name in names[:-1]:
        moved = results[name]
        # The parameter device (the host, here also where the batches come from) is the busiest:
        # it sends the weights and the shards, and receives the gradients.
        busiest = max(max(moved["sent"].values()), max(moved["received"].values()))
        assert written[name]["busiest_device_bytes"] == busiest, name
        assert float(rows[name][-4]) == pytest.approx(busiest / 1e6, abs=0.005 + 1e-9), name
        for column, gbps in ((-2, 8), (-1, 80)):
            assert float(rows[name][column]) == pytest.approx(busiest * 8 / (gbps * 1e9) * 1e3, abs=0.005 + 1e-9)
    # What each device holds, from P: the weights, Adam's two slots and the moving average, and
    # three int64 counters (step, examples_seen, the optimizer's iterations) where the variables
    # live; at K > 1 each tower adds its sums (gradients, and the float32 loss and weight sums)
    # and, reading the weights once per update, its copy of them; a mirrored replica holds all
    # of that itself.
    held = {name: sorted(written[name]["state_bytes_per_device"].values()) for name in names[:-1]}
    assert held["tower_pscpu_k1"] == [4 * p + 24]
    assert held["tower_pscpu_k3"] == [2 * p + 8] * TOWERS + [4 * p + 24]
    assert held["tower_pscpu_k3_permicro"] == [p + 8] * TOWERS + [4 * p + 24]  # no copies kept
    assert held["mirrored_k3"] == [5 * p + 32] * TOWERS
    # Spread: the host keeps the checkpoint's copy; each tower its sums and copy, and its slices'
    # weights, two slots and average (4 x its share of P, the shares adding up to P).
    host, *towers = sorted(written["tower_psspread_k3"]["state_bytes_per_device"].items())
    assert host[0].endswith("CPU:0") and host[1] == 4 * p + 24
    assert sum(b - (2 * p + 8) for _, b in towers) == 4 * p
    widest_row = 5 * 64 * 64 * 4  # conv2's kernel, [5, 5, 64, 64], is cut along its first axis
    assert max(b for _, b in towers) <= 2 * p + 8 + 4 * (p / TOWERS + widest_row)
    assert written["plain_k1"]["state_bytes_per_device"] is None


def test_ops_profiles_each_configuration_and_finds_the_input_pipeline(tmp_path):
    out = tmp_path / "ops.json"
    result = benchmark(*TINY, "--measure=ops", "--configs=tower_pscpu_k1,tower_pscpu_k1_data",
                       f"--output_json={out}")
    assert result.returncode == 0, result.stderr[-3000:]
    results = {r["config"]: r["op_us_per_example"] for r in json.loads(out.read_text())["results"]}
    assert list(results) == ["tower_pscpu_k1", "tower_pscpu_k1_data"]
    for ops in results.values():
        assert ops and all(v >= 0 for v in ops.values())
        assert any("Conv2D" in op_type for op_type in ops)  # cifar10_cnn's convolutions ran
    # The pipeline's tf.data ops are found. (How their time compares with the in-memory batch's
    # iterator is a timing, which shared cores can turn around: no test asserts it.)
    assert results["tower_pscpu_k1_data"].get("Dataset", 0) > 0
    rows = [line.split() for line in result.stdout.splitlines()[1:3]]
    assert [row[0] for row in rows] == list(results)


@pytest.mark.bf16
def test_tower_only_flags_reach_the_tower_kinds_and_leave_the_strategy_kinds_alone(tmp_path):
    out = tmp_path / "traffic.json"
    result = benchmark(f"--num_gpus={TOWERS}", f"--batch_size={BATCH}", "--measure=traffic",
                       "--configs=tower_pscpu_k1,tower_psspread_k1,mirrored_k1", "--precision=bf16",
                       "--transfer_precision=bf16", f"--output_json={out}")
    assert result.returncode == 0, result.stderr[-3000:]
    results = {r["config"]: r["bytes_per_update"] for r in json.loads(out.read_text())["results"]}
    p = 1_068_298  # cifar10_cnn's weights, each in 2 bytes both ways under bf16 transfers
    assert results["tower_pscpu_k1"]["copied"]["weights"] == TOWERS * 2 * p
    assert results["tower_pscpu_k1"]["copied"]["gradients"] == TOWERS * (2 * p + 8), results
    assert results["tower_psspread_k1"]["copied"]["weights"] == (TOWERS - 1) * 2 * p + 4  # + the penalty
    # (At K = 1, W sent back to each owner is computed from the input alone: it counts as input.)
    assert results["tower_psspread_k1"]["copied"]["gradients"] == (TOWERS - 1) * 2 * p + TOWERS * 10, results
    assert results["mirrored_k1"]["copied"]["gradients"] >= TOWERS * 4 * p  # float32, as ever


def test_the_benchmarks_own_flags_are_the_ones_performance_md_tables_with_their_defaults():
    text = open(f"{ROOT}/docs/performance.md").read()
    documented = dict(re.findall(r"^\| `--(\w+)` \| ([^|]+?) \| [A-Z`]", text, re.M))
    holders = bench_flags()
    assert bench_flags() is holders  # defined once: absl refuses a flag defined twice
    assert set(documented) == set(holders)
    for name, holder in holders.items():
        if holder.default in (None, []):
            assert documented[name] in ("none", "the suite for `--measure`"), name
        elif isinstance(holder.default, str):
            assert documented[name] == f"`{holder.default}`", name
        else:
            assert float(documented[name].strip("`")) == holder.default, name
