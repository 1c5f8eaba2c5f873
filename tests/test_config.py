"""tower_train.config in this process: TrainConfig's own checks (bounds, types and their
normalization, combinations) that the CLI's and fit's tables of bad input do not already hold,
its derived sizes, its defaults against docs/flags.md, and dataclasses.replace re-checking."""
import dataclasses
import math
import os
import re

import numpy as np
import pytest

from tower_train.config import TrainConfig, check_directories
from tower_train.errors import UsageError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (options, the whole message): each one line that names the option and what it may be. The bounds
# and types here are the ones tests/test_cli_errors.py and tests/test_api.py do not try.
BAD = [
    (dict(clip_norm=math.inf), "--clip_norm=inf: must be a number > 0 (or unset: no clipping)"),
    (dict(clip_norm=-0.5), "--clip_norm=-0.5: must be a number > 0 (or unset: no clipping)"),
    (dict(ema_decay=-0.5), "--ema_decay=-0.5: must be in [0, 1); 0 keeps no average"),
    (dict(ema_decay=math.nan), "--ema_decay=nan: must be in [0, 1); 0 keeps no average"),
    (dict(collective_timeout=math.inf), "--collective_timeout=inf: must be seconds >= 10"),
    (dict(collective_timeout=math.nan), "--collective_timeout=nan: must be seconds >= 10"),
    (dict(learning_rate=0.0), "--learning_rate=0.0: must be a finite number > 0"),
    (dict(num_gpus=2, tower_split=""),
     "--tower_split=: must be whole numbers >= 1 separated by commas, one per tower"),
    (dict(num_gpus=2, tower_split="2,,2"),
     "--tower_split=2,,2: must be whole numbers >= 1 separated by commas, one per tower"),
    (dict(num_gpus=0, tower_split="1,1"),
     "--tower_split=1,1: 2 shares for 1 tower(s) (--num_gpus=0); give one per tower"),
    (dict(transfer_precision="fp8"), "--transfer_precision=fp8: unknown; allowed: fp32, bf16, fp16"),
    (dict(mode="mirrored", transfer_precision="bf16"),
     "--transfer_precision=bf16: only with --mode=tower (a strategy's all-reduce would also sum in "
     "it), not --mode=mirrored"),
    (dict(precision="bf16", transfer_precision="fp16"),
     "--transfer_precision=fp16: only with --precision=fp16, whose loss scale keeps the gradient "
     "sums in float16's range (not --precision=bf16); use bf16"),
    (dict(mode="mirrored", ps_device="spread"),
     "--ps_device=spread: only with --mode=tower (a strategy places the variables itself), not --mode=mirrored"),
    (dict(ps_device="spread", tower_weights="per_micro_step"),
     "--tower_weights=per_micro_step: --ps_device=spread sends each tower the weights once per update, "
     "from every slice's device; use per_update"),
    # Python values of the wrong type, as fit() may be given them.
    (dict(accum=True), "accum=True: must be a whole number, not a bool"),
    (dict(clip_norm=True), "clip_norm=True: must be a number, not a bool"),
    (dict(batch_size=None), "batch_size=None: must be a whole number, not a NoneType"),
    (dict(max_steps=math.inf), "max_steps=inf: must be a whole number, not a float"),
    (dict(seed=np.float64(3.0)), "seed=np.float64(3.0): must be a whole number, not a float64"),
    (dict(augment="yes"), "augment='yes': must be True or False, not a str"),
    (dict(mode=3), "mode=3: must be a string, not a int"),
    (dict(train_dir=None), "train_dir=None: must be a path, not a NoneType"),
    (dict(deterministic=np.int64(1)), "deterministic=np.int64(1): must be True or False, not a int64"),
    (dict(learning_rate=10 ** 400), "learning_rate: a whole number of 401 digits is beyond a float's range"),
    (dict(clip_norm=2 ** 1024 - 1), "clip_norm: a whole number of 309 digits is beyond a float's range"),
]


@pytest.mark.parametrize("options, message", BAD, ids=[m.split(":")[0] for _, m in BAD])
def test_a_bad_value_is_one_usage_error_line_naming_the_option(options, message):
    with pytest.raises(UsageError) as error:
        TrainConfig(**options)
    assert str(error.value) == message


def test_values_at_the_edges_of_what_is_allowed_pass():
    config = TrainConfig(seed=2**32 - 1, collective_timeout=10, learning_rate=1e-30, ema_decay=0.0,
                         num_gpus=0, clip_norm=1e-9, warmup_steps=0, eval_every=0,
                         mode="multi_worker", cluster="slurm", all_reduce="ring")
    assert (config.seed, config.collective_timeout, config.num_towers) == (2**32 - 1, 10.0, 1)
    assert TrainConfig(num_gpus=0, tower_split="7").tower_shard_sizes == (128,)  # one share, one tower


def test_numpy_numbers_and_paths_are_stored_as_plain_python_values(tmp_path):
    config = TrainConfig(accum=np.int64(3), learning_rate=np.float32(0.5), clip_norm=2,
                         collective_timeout=np.int32(60), deterministic=np.bool_(True),
                         train_dir=tmp_path / "run")
    names = ("accum", "learning_rate", "clip_norm", "collective_timeout", "deterministic", "train_dir")
    stored = {name: getattr(config, name) for name in names}
    assert stored == dict(accum=3, learning_rate=0.5, clip_norm=2.0, collective_timeout=60.0,
                          deterministic=True, train_dir=str(tmp_path / "run"))
    assert [type(v) for v in stored.values()] == [int, float, float, float, bool, str]


@pytest.mark.parametrize("options, towers, shards, global_batch", [
    (dict(), 1, (128,), 128),
    (dict(num_gpus=0, accum=3, batch_size=5), 1, (5,), 15),
    (dict(num_gpus=4, accum=8, batch_size=16), 4, (16, 16, 16, 16), 512),
    (dict(num_gpus=2, batch_size=4, tower_split="3,1"), 2, (6, 2), 8),  # 8 examples cut 3 : 1
    (dict(num_gpus=3, accum=2, batch_size=4, tower_split="1,1,2"), 3, (3, 3, 6), 24),
])
def test_the_towers_their_shards_and_the_global_batch(options, towers, shards, global_batch):
    config = TrainConfig(**options)
    assert (config.num_towers, config.tower_shard_sizes, config.global_batch) == (
        towers, shards, global_batch)
    assert sum(config.tower_shard_sizes) * config.accum == config.global_batch


def test_replace_checks_the_new_config_again_and_keeps_the_old_one():
    config = TrainConfig(num_gpus=2, batch_size=4, tower_split="3,1")
    with pytest.raises(UsageError) as error:
        dataclasses.replace(config, accum=0)
    assert str(error.value) == "--accum=0: must be a whole number >= 1"
    # A change that only the combination makes wrong.
    with pytest.raises(UsageError) as error:
        dataclasses.replace(config, mode="mirrored")
    assert str(error.value).startswith("--tower_split=3,1: only with --mode=tower")
    with pytest.raises(UsageError) as error:
        dataclasses.replace(config, batch_size=5)
    assert str(error.value).startswith("--tower_split=3,1: does not cut a micro-batch of 10 examples")

    bigger = dataclasses.replace(config, accum=np.int64(4))
    assert type(bigger.accum) is int and bigger.global_batch == 32 and bigger.tower_shard_sizes == (6, 2)
    assert config.accum == 1 and config.global_batch == 8
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.accum = 0


def test_a_config_reads_no_file_and_its_directories_are_checked_once_writing_nothing(tmp_path):
    (tmp_path / "kept").write_text("precious")
    config = TrainConfig(train_dir=tmp_path / "run", export_dir=tmp_path / "export")
    check_directories(config)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept"]
    (tmp_path / "export").mkdir()
    (tmp_path / "export" / "saved_model.pb").write_text("an earlier export")
    taken = dataclasses.replace(config, accum=2)  # no probe of the export_dir here
    with pytest.raises(UsageError, match="--export_dir=.*: exists and is not empty"):
        check_directories(taken)


def documented_flags() -> list[tuple[str, str, bool]]:
    """(name, default, main) of each row of docs/flags.md's table of the training flags."""
    with open(os.path.join(ROOT, "docs", "flags.md")) as f:
        page = f.read()
    table = page.split("## The training flags", 1)[1].split("\n\n")[2]
    rows = re.findall(r"^\| `--(?:\[no\])?(\w+)` \| ([^|]+) \| (main)? ?\|", table, re.MULTILINE)
    assert len(rows) == len(table.strip().splitlines()) - 2, table  # every row but the header's
    count = re.search(r"All (\d+) fields of `TrainConfig`", page)
    assert count and int(count.group(1)) == len(rows)
    return [(name, default.strip(), main == "main") for name, default, main in rows]


def documented_value(text: str, like: object) -> object:
    """A default as docs/flags.md writes it (`120`, none, off), as the field's type."""
    if text in ("none", "off", "on"):
        return {"none": None, "off": False, "on": True}[text]
    return text if like is None else type(like)(text.strip("`"))


def test_docs_flags_table_lists_every_option_in_order_with_its_default_and_main_mark():
    fields = dataclasses.fields(TrainConfig)
    documented = documented_flags()
    assert [name for name, _, _ in documented] == [f.name for f in fields]
    for (name, default, main), field in zip(documented, fields, strict=True):
        assert documented_value(default, field.default) == field.default, name
        assert main == field.metadata["main"], name
    TrainConfig()  # the defaults are a valid config
