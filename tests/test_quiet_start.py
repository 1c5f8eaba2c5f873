"""A script that imports tower_train before TensorFlow prints none of TensorFlow's C++ start-up
lines, as the command line does not; the user's own TF_CPP_MIN_LOG_LEVEL brings them back. The
lines go to the process's own stderr, once per process: hence a real process."""
import os
import re
import subprocess
import sys

from test_cli_errors import ROOT

# A tiny tower_train.fit, importing as README's scripts do: tower_train before keras loads TensorFlow.
SCRIPT = """
import tower_train
import keras
import numpy as np

tower_train.create_devices(num_gpus=2)
x = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
result = tower_train.fit(model=model, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                         data=(x, np.arange(64) % 3), num_gpus=2, accum=2, batch_size=8, max_steps=2,
                         train_dir={train_dir!r})
print("step", result.step)
"""
# TensorFlow's C++ lines: glog's prefix before absl is initialised (a zero date), absl's notice
# about that, and the ones the issue met by name.
NOISE = re.compile(r"^[IWEF]0000 00:00:|absl::InitializeLog|cpu_feature_guard|cuInit|loop_optimizer", re.M)


def run_script(tmp_path, level: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}  # conftest sets it
    if level is not None:
        env["TF_CPP_MIN_LOG_LEVEL"] = level
    return subprocess.run([sys.executable, "-c", SCRIPT.format(train_dir=str(tmp_path / "run"))],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)


def test_importing_tower_train_first_hides_tensorflows_cpp_lines_and_the_users_level_shows_them(tmp_path):
    quiet = run_script(tmp_path / "quiet", None)
    assert quiet.returncode == 0, quiet.stderr[-3000:]
    assert quiet.stdout.strip() == "step 2"
    assert NOISE.findall(quiet.stderr) == [], quiet.stderr[-3000:]
    loud = run_script(tmp_path / "loud", "0")  # docs: how to get them back
    assert loud.returncode == 0, loud.stderr[-3000:]
    assert NOISE.search(loud.stderr), loud.stderr[-3000:]
