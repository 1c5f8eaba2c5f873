"""Bad input: one line naming the culprit, exit status 2, no traceback, nothing written."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_cli(*args, cwd=ROOT, env=None):
    """`python -m tower_train ARGS`; the environment's TF_CONFIG is passed on only if `env` gives one."""
    env = {**{k: v for k, v in os.environ.items() if k != "TF_CONFIG"}, "PYTHONPATH": ROOT,
           **(env or {})}
    return subprocess.run([sys.executable, "-m", "tower_train", *args], capture_output=True,
                          text=True, cwd=cwd, env=env, timeout=300)


# (flags, text the error must contain); {file} is a regular file, {missing} a path that does not exist.
CASES = [
    (["--accum=0"], "--accum=0"),
    (["--accum=-3"], "--accum=-3"),
    (["--num_gpus=-1"], "--num_gpus=-1"),
    (["--batch_size=0"], "--batch_size=0"),
    (["--max_steps=0"], "--max_steps=0"),
    (["--log_every=0"], "--log_every=0"),
    (["--checkpoint_every=-1"], "--checkpoint_every=-1"),
    (["--gpu_memory_mb=0"], "--gpu_memory_mb=0"),
    (["--seed=-1"], "--seed=-1"),
    (["--learning_rate=-0.1"], "--learning_rate"),
    (["--learning_rate=nan"], "--learning_rate"),
    (["--mode=bogus"], "allowed: tower"),
    (["--ps_device=tpu"], "allowed: auto, cpu, gpu, spread"),
    (["--optimizer=rmsprop"], "allowed: sgd, momentum, adam"),
    (["--dataset=imagenet"], "--dataset=imagenet: unknown; registered: cifar10, markov_text, synthetic"),
    (["--num_gpus=2", "--tower_split=3,x"], "--tower_split=3,x: must be whole numbers >= 1"),
    (["--num_gpus=2", "--tower_split=3,0"], "--tower_split=3,0: must be whole numbers >= 1"),
    (["--num_gpus=3", "--tower_split=3,1"], "--tower_split=3,1: 2 shares for 3 tower(s)"),
    (["--num_gpus=2", "--batch_size=5", "--tower_split=2,1"], "does not cut a micro-batch of 10 examples"),
    (["--num_gpus=2", "--mode=mirrored", "--tower_split=3,1"], "--tower_split=3,1: only with --mode=tower"),
    (["--learning_rate=inf"], "--learning_rate=inf: must be a finite number > 0"),
    (["--seed=4294967296"], "--seed=4294967296: must be a whole number <= 4294967295"),
    (["--clip_norm=nan"], "--clip_norm=nan: must be a number > 0"),
    (["--accum=abc"], "accum"),
    (["--no_such_flag=1"], "no_such_flag"),
    (["extra_positional"], "extra_positional"),
    (["--train_dir={file}"], "is a file"),
    (["--train_dir={file}/sub"], "is a file"),
    (["--dataset=cifar10"], "data_dir"),
    (["--dataset=cifar10", "--data_dir={missing}"], "{missing}"),
    (["--data_dir={missing}"], "--data_dir"),
    (["--model=no_such_net"], "cifar10_cnn"),
    (["--model_module=no_such_module_xyz"], "no_such_module_xyz"),
    (["--mode=mirrored", "--all_reduce=ring"], "--all_reduce=ring: not for --mode=mirrored"),
    (["--all_reduce=nccl"], "--all_reduce=nccl: not for --mode=tower"),
    (["--mode=mirrored", "--all_reduce=nccl"], "needs one physical GPU per tower"),
    (["--mode=central_storage", "--all_reduce=one_device"], "allowed: auto"),
    (["--collective_timeout=0"], "--collective_timeout=0"),
    (["--collective_timeout=3"], "--collective_timeout=3.0: must be seconds >= 10"),
    (["--mode=multi_worker"], "needs TF_CONFIG"),
    (["--mode=central_storage", "--model=resnet20"], "CentralStorageStrategy cannot update"),
    (["--sync_bn"], "--sync_bn: only with --mode=mirrored or multi_worker"),
    (["--mode=mirrored", "--sync_bn"], "--model=cifar10_cnn has no BatchNormalization layer"),
    (["--lr_schedule=step"], "allowed: constant, exponential, cosine"),
    (["--clip_norm=0"], "--clip_norm=0.0"),
    (["--ema_decay=1"], "--ema_decay=1.0"),
    (["--warmup_steps=-1"], "--warmup_steps=-1"),
    (["--export_dir={tmp}"], "exists and is not empty"),
    (["--export_dir={file}"], "is a file, not a directory"),
    (["--precision=fp8"], "--precision=fp8: unknown; allowed: fp32, bf16, fp16"),
    (["--mode=central_storage", "--num_gpus=2", "--jit_compile"],
     "--jit_compile: XLA cannot read the variables on /cpu:0 from towers on /cpu:1../cpu:2 "
     "(--mode=central_storage); use --mode=tower or --mode=mirrored"),
    (["--num_gpus=100000"], "--num_gpus=100000: no GPU found, and the CPU is split into at most 64 towers"),
    (["--num_gpus=2", "--batch_size=100000000"],
     "--batch_size=100000000 x 2 tower(s): 200,000,000 examples of 6,912 bytes"),
    (["--eval_batch_size=100000000"], "GiB of memory is available; lower it"),
    (["--export_dir={file}/sub"], "{file} is a file, so the directory cannot be made"),
    (["--export_dir=/proc/tower_train_export"], "cannot make a directory in /proc"),
    (["--train_dir=/proc/tower_train_run"], "cannot make a directory in /proc"),
    (["--train_dir="], "--train_dir is empty"),
    (["--stop_grace_period=0"], "--stop_grace_period=0.0: must be seconds > 0"),
    (["--stop_grace_period=nan"], "--stop_grace_period=nan: must be seconds > 0"),
    (["--stop_grace_period=inf"], "--stop_grace_period=inf: must be seconds > 0"),
    (["--eval_every=-1"], "--eval_every=-1"),
    (["--eval_batch_size=0"], "--eval_batch_size=0"),
    (["--max_skipped=0"], "--max_skipped=0"),
    (["--nonfinite=ignore"], "allowed: stop, skip"),
    (["--num_gpus=1", "--tower_split=2,2"], "--tower_split=2,2: 2 shares for 1 tower(s)"),
    (["--flagfile={missing}"], "{missing}"),
    (["--deterministic", "--jit_compile"], "--deterministic with --jit_compile: XLA has no deterministic"),
    (["--mode=mirrored", "--transfer_precision=bf16"], "--transfer_precision=bf16: only with --mode=tower"),
    (["--transfer_precision=fp16"], "--transfer_precision=fp16: only with --precision=fp16"),
]
TWO_WORKERS = '{"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}, "task": {"type": "worker", "index": %s}}'
# (flags, TF_CONFIG, text the error must contain)
TF_CONFIG_CASES = [
    (["--mode=multi_worker"], "{oops", "TF_CONFIG is not valid JSON"),
    (["--mode=multi_worker"], TWO_WORKERS % 2, "task.index=2: out of range"),
    (["--mode=multi_worker"], '{"cluster": {"worker": ["a:1"]}}', "'task' object"),
    (["--mode=multi_worker", "--num_gpus=2"], TWO_WORKERS % 0, "pass --num_gpus=1"),
]
CASES = [(args, expected, None) for args, expected in CASES] + [
    (args, expected, tf_config) for args, tf_config, expected in TF_CONFIG_CASES]
# Bad only on a machine without a GPU: with one, the command has a whole GPU for --all_reduce=nccl,
# and a multi_worker worker may run two GPU towers.
CPU_ONLY = [["--mode=mirrored", "--all_reduce=nccl"], ["--mode=multi_worker", "--num_gpus=2"],
            ["--num_gpus=100000"]]


@pytest.mark.parametrize("args,expected,tf_config", [
    pytest.param(a, e, t, id=" ".join(a) + (" TF_CONFIG" if t else ""),
                 marks=[pytest.mark.cpu_only] if a in CPU_ONLY else [])
    for a, e, t in CASES])
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, args, expected, tf_config):
    a_file = tmp_path / "a_file"
    a_file.write_text("precious")
    missing = tmp_path / "missing"
    train_dir = tmp_path / "train"
    fill = lambda s: s.format(file=a_file, missing=missing, tmp=tmp_path)
    args = [fill(a) for a in args]
    if not any(a.startswith("--train_dir") for a in args):
        args.append(f"--train_dir={train_dir}")

    result = run_cli(*args, env={"TF_CONFIG": tf_config} if tf_config else None)

    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("tower_train: error: ")
    assert fill(expected) in lines[0]
    assert "Traceback" not in result.stderr + result.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]
    assert a_file.read_text() == "precious"


@pytest.mark.parametrize("lock", ["a link", "a directory"])
def test_a_link_or_a_directory_as_the_lock_is_one_line_and_nothing_is_written_through_it(tmp_path, lock):
    # Before: through a link the lock truncated the file it named, and the run trained (exit 0);
    # a directory was an IsADirectoryError traceback.
    precious = tmp_path / "precious"
    precious.write_text("precious")
    train_dir = tmp_path / "train"
    train_dir.mkdir()
    if lock == "a link":
        (train_dir / "lock").symlink_to(precious)
    else:
        (train_dir / "lock").mkdir()

    result = run_cli(f"--train_dir={train_dir}", "--max_steps=1", "--batch_size=2")

    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    lines = result.stderr.strip().splitlines()
    assert lines == [f"tower_train: error: --train_dir={train_dir}: cannot lock {train_dir}/lock ("
                     + (f"it is a symbolic link, to {precious}, which the run does not follow"
                        if lock == "a link" else "it is a directory, not a file")
                     + f"; remove it, or add --train_dir={train_dir}_2)"], result.stderr
    assert precious.read_text() == "precious"
    assert sorted(p.name for p in train_dir.iterdir()) == ["lock"]


@pytest.mark.parametrize("flag", ["--train_dir={file}", "--export_dir={file}"])
def test_a_directory_that_cannot_be_written_is_refused_before_tensorflow_loads(tmp_path, flag):
    # Before, every command loaded TensorFlow (seconds) before it looked at its directories.
    a_file = tmp_path / "a_file"
    a_file.write_text("precious")
    argv = ["tower_train", f"--train_dir={tmp_path / 'train'}", flag.format(file=a_file)]  # the last wins
    code = (f"import sys\nfrom tower_train import cli\nstatus = cli.main({argv!r})\n"
            "print(status, 'tensorflow' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": ROOT}, timeout=300)

    assert result.stdout.split() == ["2", "False"], result.stderr
    assert "is a file" in result.stderr
    assert a_file.read_text() == "precious"
