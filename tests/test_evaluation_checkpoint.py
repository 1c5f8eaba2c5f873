"""training/evaluation/checkpoint.py in this process, on the tiny checkpoints of test_checkpoints.py: the checkpoint
to evaluate found from the files whatever the index says, and a train_dir of another model refused
by its run record before any tensor is read."""
import pytest

from tower_train.training.evaluation import checkpoint as eval_checkpoint
from tower_train.errors import UsageError
from tower_train.training.run_record import RUN_FILE
from test_checkpoints import train


@pytest.mark.parametrize("index", ["deleted", "emptied"])
def test_evaluation_finds_the_newest_checkpoint_from_the_files(tmp_path, index):
    train(tmp_path, 3)
    if index == "deleted":
        (tmp_path / "checkpoint").unlink()
    else:
        (tmp_path / "checkpoint").write_text("")
    eval_checkpoint.check_named_checkpoint(None, str(tmp_path), "mlp")
    assert eval_checkpoint.find_checkpoint(None, str(tmp_path)).path == str(tmp_path / "ckpt-3")


def test_a_train_dir_of_another_model_is_refused_by_its_run_record(tmp_path):
    train(tmp_path, 1)  # the record names --model=mlp
    with pytest.raises(UsageError) as refused:
        eval_checkpoint.check_named_checkpoint(None, str(tmp_path), "my_models.Net")
    assert str(refused.value) == (f"--train_dir={tmp_path}: its checkpoints are of --model=mlp (says "
                                  f"{tmp_path / RUN_FILE}), not model=my_models.Net; pass --model=mlp")
