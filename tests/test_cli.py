"""tower_train.cli in this process: --help and --helpfull, and `command`'s one line and exit status
for each kind of error (the table of bad flags, run as real commands, is test_cli_errors.py's).
Each test leaves the global flags unparsed."""
import dataclasses
import signal

import pytest
from absl import flags

from tower_train import cli
from tower_train.config import TrainConfig
from tower_train.errors import Stopped, TrainingError, UsageError
from tower_train.user_code import TRACEBACK_VARIABLE, UserCodeError


@pytest.fixture(autouse=True)
def unparsed_flags():
    yield
    flags.FLAGS.unparse_flags()


def test_help_shows_the_usage_and_each_main_flag_with_its_help_and_default(capsys, tmp_path):
    # A --train_dir of the test's own: were --help ignored, a run would start there, not in /tmp.
    assert cli.main(["tower_train", "--help", f"--train_dir={tmp_path}"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    lines = out.splitlines()
    assert lines[0] == cli.USAGE.splitlines()[0]
    main = [f for f in dataclasses.fields(TrainConfig) if f.metadata["main"]]
    flag_lines = [line for line in lines if line.startswith("  --")]
    assert len(flag_lines) == len(main) + 1  # and --flagfile
    for line, field in zip(flag_lines, main):
        default = "" if field.default is None else f" (default: {flags.FLAGS[field.name].default_as_str})"
        assert line == f"  --{field.name}: {field.metadata['help']}{default}"
    assert flag_lines[-1].startswith("  --flagfile: ")
    assert any("(default: '1')" in line for line in flag_lines)  # --num_gpus, as absl writes it


def test_helpfull_lists_every_training_flag(capsys, tmp_path):
    assert cli.main(["tower_train", "--helpfull", f"--train_dir={tmp_path}", "--max_steps=1"]) == 0
    out = capsys.readouterr().out
    for field in dataclasses.fields(TrainConfig):
        negatable = "[no]" if flags.FLAGS[field.name].boolean else ""  # absl's --[no]augment, --[no]jit_compile
        assert f"--{negatable}{field.name}: " in out, field.name
    assert "Main flags" not in out
    assert list(tmp_path.iterdir()) == []


def raises(error: BaseException):
    def body() -> int:
        raise error
    return body


@pytest.mark.parametrize("error, status, line", [
    (UsageError("--accum=0: must be >= 1"), 2, "tower_train: error: --accum=0: must be >= 1"),
    (flags.Error("ERROR:: Unknown command line flag 'x'"), 2,
     "tower_train: error: Unknown command line flag 'x'"),  # absl's prefix said once, not twice
    (TrainingError("update 3 failed"), 1, "tower_train: update 3 failed"),
    (Stopped("stopped by SIGTERM at step 4, saved", signal.SIGTERM), 128 + signal.SIGTERM,
     "tower_train: stopped by SIGTERM at step 4, saved"),
    (KeyboardInterrupt(), 128 + signal.SIGINT, "tower_train: interrupted by SIGINT outside training; "
                                               "the checkpoints already written are intact"),
], ids=["UsageError", "absl", "TrainingError", "Stopped", "KeyboardInterrupt"])
def test_command_turns_each_error_into_one_line_on_stderr_and_its_exit_status(capsys, error, status, line):
    assert cli.command(raises(error)) == status
    out, err = capsys.readouterr()
    assert out == "" and err == line + "\n"


def test_command_returns_the_bodys_status_and_lets_other_errors_through(capsys):
    assert cli.command(lambda: 0) == 0
    with pytest.raises(ZeroDivisionError):
        cli.command(lambda: 1 // 0)
    assert capsys.readouterr() == ("", "")


def users_error() -> UserCodeError:
    try:
        {}["missing_key"]
    except KeyError as cause:
        error = UserCodeError("my_model.py:3: KeyError: 'missing_key'")
        error.__cause__ = cause
        return error


def test_an_error_in_user_code_is_one_line_and_its_traceback_only_when_asked(capsys, monkeypatch):
    monkeypatch.delenv(TRACEBACK_VARIABLE, raising=False)
    assert cli.command(raises(users_error())) == 2
    assert capsys.readouterr().err == "tower_train: error: my_model.py:3: KeyError: 'missing_key'\n"
    monkeypatch.setenv(TRACEBACK_VARIABLE, "1")
    assert cli.command(raises(users_error())) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "tower_train: error: my_model.py:3: KeyError: 'missing_key'"
    assert err[1] == "Traceback (most recent call last):" and err[-1] == "KeyError: 'missing_key'"


def test_the_log_keeps_tensorflows_errors_and_drops_its_info_and_warnings():
    """TensorFlow's Python warnings are about its internals (the benchmark's tf.function retracing
    warning, once per configuration after the fifth): none reaches the product's output, its
    errors do, and so does every line of the product's own."""
    import logging
    import os

    def record(level: int, path: str) -> logging.LogRecord:
        return logging.LogRecord("x", level, path, 1, "message", None, None)

    tensorflow_file = os.path.join("site-packages", "tensorflow", "python", "eager", "polymorphic_function.py")
    assert not cli._no_tensorflow_info(record(logging.INFO, tensorflow_file))
    assert not cli._no_tensorflow_info(record(logging.WARNING, tensorflow_file))
    assert cli._no_tensorflow_info(record(logging.ERROR, tensorflow_file))
    product_file = os.path.join("tower_train", "training", "controller.py")
    assert cli._no_tensorflow_info(record(logging.INFO, product_file))
    assert cli._no_tensorflow_info(record(logging.WARNING, product_file))
