"""tower_train/startup.py: every command goes through the one start-up, so each check runs in each
command it applies to. Each check is made to fail in turn, and each command must report it in
its one error line; nothing trains. And each command's --help and --helpfull show only the
flags it reads."""
import json
import subprocess
import sys
import textwrap

import pytest

from tower_train import flags as tt_flags
from test_cli_errors import ROOT

# A data set whose check says whether op determinism (the numerics) is on when it runs: the
# numerics come before the source's check.
PROBE_DATA = '''
import numpy as np
from tensorflow.python.framework import config as tf_config

import tower_train
from tower_train.data import DataError, register


class CheckedSource(tower_train.ArraySource):
    def check(self):
        raise DataError("probe: checked with op determinism "
                        + ("on" if tf_config.is_op_determinism_enabled() else "off"))


@register("probe")
def probe():
    x, y = np.zeros((8, 4), np.float32), np.arange(8) % 2
    return CheckedSource(x, y, eval_features=x, eval_labels=y)
'''

# Runs each (command, flags, patch) of argv[1] (JSON) in this one process, and prints each one's
# exit status and error line as JSON. A patch makes the devices or the memory check fail.
CHILD = textwrap.dedent('''
    import contextlib, io, json, sys
    from absl import flags
    from tower_train import devices
    from tower_train.data import source
    from tower_train.errors import UsageError

    def refuse(*args):
        raise UsageError("devices: refused by the test")

    PATCHES = {"devices": (devices, "plan_for_this_machine", refuse),
               "memory": (source, "available_memory_bytes", lambda: 1)}

    def main_of(command):
        if command == "train":
            from tower_train.cli import main
        elif command == "benchmark_memory_child":
            from tower_train.benchmark.memory import peak_memory_main as main
        else:
            main = __import__(f"tower_train.{command}", fromlist=["main"]).main
        return main

    results = []
    for command, argv, patch in json.loads(sys.argv[1]):
        if patch:
            module, name, value = PATCHES[patch]
            saved = getattr(module, name)
            setattr(module, name, value)
        stderr = io.StringIO()
        try:
            with contextlib.redirect_stderr(stderr):
                status = main_of(command)([command, *argv])
        finally:
            flags.FLAGS.unparse_flags()
            if patch:
                setattr(module, name, saved)
        errors = [line for line in stderr.getvalue().splitlines() if line.startswith("tower_train:")]
        results.append([status, errors])
    print(json.dumps(results))
''')

# Each command's flags where nothing fails (a GPU machine's commands would pick GPUs: the flags
# fix two CPU towers' worth, which every check is made to fail before).
BASE = {
    "train": ["--num_gpus=2", "--batch_size=8", "--max_steps=1"],
    "eval": ["--num_gpus=2", "--batch_size=8"],
    "compare": ["--num_gpus=2", "--batch_size=8", "--max_steps=3", "--modes=tower"],
    "normalization": ["--num_gpus=2", "--batch_size=8", "--updates=1"],
    "benchmark": ["--num_gpus=2", "--batch_size=8", "--configs=tower_pscpu_k1", "--rounds=1",
                  "--updates=1"],
    "benchmark_memory_child": ["--num_gpus=2", "--batch_size=8", "--configs=tower_pscpu_k1"],
}
TRAINING_BATCH = "--batch_size=8 x 2 tower(s): 16 examples of "
# check: (its flags, its patch, the error line each command says it in; None: does not apply).
CHECKS = {
    "directories": (["--train_dir={work}/a_file"], None, {
        "train": "--train_dir={work}/a_file: is a file, not a directory",
        "eval": "--train_dir={work}/a_file: is not a directory; no checkpoint to evaluate",
        "compare": "--train_dir={work}/a_file: is a file, not a directory"}),
    "data arguments": (["--dataset=no_such_set"], None, "--dataset=no_such_set: unknown"),
    "model name": (["--model=no_such_model"], None, "--model=no_such_model: unknown"),
    "devices": ([], "devices", "devices: refused by the test"),
    "numerics, then the source's check": (
        ["--dataset=probe", "--data_module=startup_probe_data", "--deterministic"], None,
        "probe: checked with op determinism on"),
    "memory": ([], "memory", {
        "train": TRAINING_BATCH, "eval": "--eval_batch_size=500: 500 examples of ",
        "compare": TRAINING_BATCH, "normalization": TRAINING_BATCH, "benchmark": TRAINING_BATCH,
        "benchmark_memory_child": TRAINING_BATCH}),
}
# Commands that define flags of the same name run in processes of their own.
PROCESSES = (("train", "eval", "compare", "normalization"), ("benchmark", "benchmark_memory_child"))


def expected(check: str, command: str) -> str | None:
    said = CHECKS[check][2]
    return said.get(command) if isinstance(said, dict) else said


@pytest.fixture(scope="module")
def reported(tmp_path_factory):
    """{(command, check): (exit status, error lines)} of each check that applies to a command."""
    work = tmp_path_factory.mktemp("startup")
    (work / "startup_probe_data.py").write_text(PROBE_DATA)
    (work / "a_file").write_text("")
    checkpoint_dir = work / "checkpoints"  # what eval checks before loading anything: the files
    checkpoint_dir.mkdir()
    (checkpoint_dir / "ckpt-1.index").write_text("")
    results = {}
    for commands in PROCESSES:
        runs = []
        for command in commands:
            for check, (flags, patch, _) in CHECKS.items():
                if expected(check, command) is None:
                    continue
                train_dir = checkpoint_dir if command == "eval" else work / f"{command}_{len(runs)}"
                argv = [*BASE[command], f"--train_dir={train_dir}",
                        *(flag.format(work=work) for flag in flags)]
                runs.append(((command, check), [command, argv, patch]))
        child = subprocess.run([sys.executable, "-c", CHILD, json.dumps([run for _, run in runs])],
                               capture_output=True, text=True, cwd=work, timeout=600)
        assert child.returncode == 0, child.stderr[-3000:]
        outcomes = json.loads(child.stdout.strip().splitlines()[-1])
        results.update({key: (status, errors) for (key, _), (status, errors) in zip(runs, outcomes)})
    return work, results


@pytest.mark.parametrize("command", list(BASE))
@pytest.mark.parametrize("check", list(CHECKS))
def test_each_check_runs_in_each_command_it_applies_to(reported, check, command):
    work, results = reported
    message = expected(check, command)
    if message is None:
        pytest.skip(f"{check}: not for {command}, which writes nothing there")
    status, errors = results[command, check]
    assert status == 2 and len(errors) == 1, errors
    assert message.format(work=work) in errors[0], errors[0]


def test_every_check_applies_to_every_command_but_the_directories():
    """What the table above shows, said once: only the commands that write to train_dir or read
    a checkpoint from it check it."""
    for check in CHECKS:
        applies = {command for command in BASE if expected(check, command) is not None}
        assert applies == ({"train", "eval", "compare"} if check == "directories" else set(BASE)), check


COMMANDS = {"eval": tt_flags.EVAL_OPTIONS, "compare": tt_flags.COMPARE_OPTIONS,
            "normalization": tt_flags.NORMALIZATION_OPTIONS, "benchmark": tt_flags.BENCHMARK_OPTIONS}


def command_help(command: str, which: str) -> str:
    result = subprocess.run([sys.executable, "-m", f"tower_train.{command}", which],
                            capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout


def flag_names(text: str) -> set[str]:
    """The flags a help text lists: its lines that start with --name (absl's --[no]name too)."""
    names = set()
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("--"):
            names.add(stripped[2:].split(":")[0].removeprefix("[no]"))
    return names


@pytest.mark.parametrize("command", list(COMMANDS))
def test_help_and_helpfull_list_only_the_training_flags_the_command_reads(command):
    reads = set(COMMANDS[command])
    training = set(tt_flags.TRAINING_FLAGS)
    shown = flag_names(command_help(command, "--help"))
    assert shown & training == reads & set(tt_flags.MAIN_FLAGS)
    every = flag_names(command_help(command, "--helpfull"))
    assert every & training == reads
    assert shown - training <= every  # the command's own flags, in both


def test_compares_train_dir_help_says_what_it_holds():
    text = " ".join(command_help("compare", "--helpfull").split())  # absl wraps the lines
    assert f"--train_dir: {tt_flags.COMPARE_TRAIN_DIR_HELP}" in text
    assert "resumes" not in text
