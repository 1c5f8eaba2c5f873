"""README.md's quick run, as a new user meets it: the command of its first block runs, and its
output has the lines the README shows, in order ("..." stands for what varies: timestamps,
speeds, seconds). The losses are deterministic on a CPU, so a change that moves the training
fails here until the README is re-measured."""
import re
import shlex
from pathlib import Path

from test_cli_errors import ROOT, run_cli

QUICK_RUN = "**A quick run first**"


def quick_run() -> tuple[list[str], list[str]]:
    """The quick run's command (its arguments after `python -m tower_train`) and the lines of the
    output block that follows it."""
    section = (Path(ROOT) / "README.md").read_text().split(QUICK_RUN, 1)[1]
    command, output = re.findall(r"```(?:sh)?\n(.*?)```", section, re.S)[:2]
    arguments = shlex.split(command.split("python -m tower_train", 1)[1])
    return arguments, output.strip().splitlines()


def test_the_quick_run_prints_the_lines_the_readme_shows(tmp_path):
    arguments, shown = quick_run()
    assert arguments == ["--flagfile=flags/quick.flags"]
    result = run_cli(*arguments, f"--train_dir={tmp_path / 'quick'}")  # its own train_dir, fresh
    assert result.returncode == 0, result.stderr[-3000:]
    printed = result.stderr.splitlines()
    at = 0
    for line in shown:
        pattern = re.compile(".*".join(map(re.escape, line.split("..."))) + "$")
        while at < len(printed) and not pattern.match(printed[at]):
            at += 1
        assert at < len(printed), f"README's line not printed (in order): {line}\n{result.stderr[-3000:]}"
        at += 1
