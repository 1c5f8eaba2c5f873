"""What tower-train does on a real GPU: marked `gpu`, skipped where none is visible (CI). Each runs
a command in a child process, since this test process hides its GPUs (tests/conftest.py); the
child is the installed product, run from a scratch directory. docs/gpu.md ("The GPU tests") says
how to run them on a GPU machine."""
import json
import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu
HERE = os.path.dirname(os.path.abspath(__file__))
SPLIT = ["--num_gpus=2", "--gpu_memory_mb=4000"]  # GPU 0 as two logical GPUs, if it is the only one


def run(tmp_path, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=tmp_path,
                            timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_the_towers_and_the_one_device_baselines_compute_on_the_gpus_and_print_no_tensorflow_warning(tmp_path):
    out = tmp_path / "bench.json"
    result = run(tmp_path, "-m", "tower_train.benchmark", *SPLIT, "--batch_size=64", "--updates=2", "--rounds=1",
                 "--configs=plain_k1,keras_fit_k1,tower_pscpu_k1,tower_psspread_k1,mirrored_k1",
                 f"--output_json={out}")
    devices = {r["config"]: r["compute_devices"] for r in json.loads(out.read_text())["results"]}
    assert devices == {"plain_k1": ["/gpu:0"], "keras_fit_k1": ["/gpu:0"], "tower_pscpu_k1": ["/gpu:0", "/gpu:1"],
                       "tower_psspread_k1": ["/gpu:0", "/gpu:1"], "mirrored_k1": ["/gpu:0", "/gpu:1"]}
    assert "TF32 on" in result.stderr
    # The product's own lines only: none of TensorFlow's Python warnings, nor of its C++ (file.cc:N]).
    # (Under --jit_compile, XLA's GPU autotuner writes "Delay kernel timed out" lines through absl's
    # C++ logging, which TF_CPP_MIN_LOG_LEVEL does not reach: docs/gpu.md.)
    lines = result.stderr.splitlines()
    assert not [line for line in lines if "WARNING" in line or re.search(r"\.(cc|h):\d+\]", line)], lines


def test_xla_in_tower_mode_gives_the_update_without_it(tmp_path):
    probe = json.loads(run(tmp_path, os.path.join(HERE, "gpu_probe.py"), "xla").stdout.splitlines()[-1])
    assert probe["towers"] == ["/gpu:0", "/gpu:1"]
    assert probe["relative_error"]["cpu"] < 1e-4 and probe["relative_error"]["spread"] < 1e-4, probe


def test_notf32_brings_the_gpus_first_gradient_to_the_cpus_to_float32_rounding(tmp_path):
    """TF32 rounds the inputs of matmuls and convolutions to 10 bits of mantissa: about 1e-3 of
    the gradient. Without it, a dense network's gradient on the GPU is the CPU's to 1e-5; a
    convolutional one's stays further off (7.8e-5 to 9.2e-5 in four runs, where two CPU float32
    implementations agree to 9e-7: `gpu_probe.py cpu_float32`, docs/gpu.md), but far closer
    than with TF32."""
    probe = json.loads(run(tmp_path, os.path.join(HERE, "gpu_probe.py"), "tf32").stdout.splitlines()[-1])
    print(probe)
    assert probe["dense"]["tf32_off"] < 1e-5 < probe["dense"]["tf32_on"], probe
    assert probe["cnn"]["tf32_off"] < probe["cnn"]["tf32_on"] / 10, probe


def test_the_memory_report_reads_positive_activations_from_each_gpus_peak(tmp_path):
    out = tmp_path / "memory.json"
    run(tmp_path, "-m", "tower_train.benchmark", *SPLIT, "--measure=memory", "--updates=2",
        "--configs=tower_pscpu_k1_b64,tower_pscpu_k2_b64", f"--output_json={out}")
    results = json.loads(out.read_text())["results"]
    for r in results:
        assert set(r["gpu_peak_mb"]) == {"GPU:0", "GPU:1"}, r
        assert r["activations_mb"] > 0, r
