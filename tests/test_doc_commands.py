"""Every command block of README.md and docs/*.md runs as written and exits as documented.

The blocks run in the order a reader meets them: README first, then the pages in the order of
README's Documentation list. Each runs with bash in one working directory for the whole run, a
copy of the repository's top level (linked, not copied), with this venv's bin first on PATH, as
README has a reader run them: from the repository root with the venv active. A block is a fenced
block tagged `sh` or `bash`; the HTML comment on the line above it may say what it does instead
(docs/layout.md, "Commands in the docs"):

- `<!-- doc-commands: skip (REASON) -->`: not run, for the reason given (over a minute here, a
  GPU, a second machine, the network);
- `<!-- doc-commands: exit N -->`: run, and it must exit with N (an error example);
- `<!-- doc-commands: file NAME -->` above a `python` block: the script a later command runs,
  saved as NAME in the working directory (added to its end when NAME was saved before).

A block without a comment runs and must exit 0. No block may print a Python traceback. The /tmp
directories that the run's blocks, saved scripts and flag files name are the docs' own train_dirs:
those that did not exist before are removed after the run, and a lock keeps two test runs on one
machine from sharing them."""
from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SHELL = ("sh", "bash")
MARKER = re.compile(r"\s*<!-- doc-commands: (.*?) -->\s*")  # a line of its own
MARKER_FORMS = re.compile(r"skip \(.+\)|exit \d+|file [\w.-]+\.py")
# An untagged block that starts like this is a command that was not tagged `sh`.
COMMAND_START = re.compile(r"(python3?|pip|git|kubectl|srun|\$) ")
TIMEOUT_S = 300  # a hang's bound, not a speed check: blocks under a minute took up to 106 s on 2 busy cores


@dataclass(frozen=True)
class Block:
    where: str  # file:line of the opening fence
    tag: str
    text: str
    marker: str | None

    @property
    def skipped(self) -> bool:
        return (self.marker or "").startswith("skip")

    @property
    def exit_code(self) -> int:
        return int(self.marker.split()[1]) if (self.marker or "").startswith("exit") else 0


def pages() -> list[Path]:
    """README, then docs/*.md in the order README's Documentation list links them."""
    index = (ROOT / "README.md").read_text().split("\n## Documentation\n", 1)[1]
    linked = re.findall(r"^- \[[^]]*\]\((docs/[\w-]+\.md)\)", index, re.M)
    return [ROOT / "README.md"] + [ROOT / name for name in linked]


def blocks(path: Path) -> list[Block]:
    """A page's fenced blocks (indented ones in lists too), each with the marker above it."""
    lines = path.read_text().splitlines()
    found, number = [], 0
    while number < len(lines):
        fence = re.match(r"\s*```(\S*)\s*$", lines[number])
        if not fence:
            number += 1
            continue
        end = next(i for i in range(number + 1, len(lines)) if lines[i].strip() == "```")
        indent = len(lines[number]) - len(lines[number].lstrip())
        marker = MARKER.fullmatch(lines[number - 1]) if number else None
        found.append(Block(f"{os.path.relpath(path, ROOT)}:{number + 1}", fence[1],
                           "\n".join(line[indent:] for line in lines[number + 1:end]) + "\n",
                           marker[1] if marker else None))
        number = end + 1
    return found


BLOCKS = [block for page in pages() for block in blocks(page)]
COMMANDS = [block for block in BLOCKS if block.tag in SHELL]
RUN = [block for block in COMMANDS if not block.skipped]


def test_a_pages_blocks_are_read_with_the_marker_above_each(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("Text.\n\n```sh\necho one\n```\n\n- A list:\n\n  <!-- doc-commands: exit 2 -->\n"
                    "  ```sh\n  false ||\n    exit 2\n  ```\n<!-- doc-commands: skip (needs a GPU) -->\n"
                    "```sh\nnvidia-smi\n```\n```\noutput\n```\n")
    read = [(b.where.rsplit(":")[1], b.tag, b.text, b.marker, b.exit_code, b.skipped) for b in blocks(page)]
    assert read == [("3", "sh", "echo one\n", None, 0, False),
                    ("10", "sh", "false ||\n  exit 2\n", "exit 2", 2, False),
                    ("15", "sh", "nvidia-smi\n", "skip (needs a GPU)", 0, True),
                    ("18", "", "output\n", None, 0, False)]


def test_every_docs_page_is_in_readmes_documentation_list():
    listed = {path.name for path in pages()[1:]}
    assert listed == {path.name for path in (ROOT / "docs").glob("*.md")}


def test_the_markers_are_well_formed_and_where_they_apply():
    wrong = [f"{b.where}: {b.marker!r}" for b in BLOCKS if b.marker is not None and not (
        MARKER_FORMS.fullmatch(b.marker) and (b.tag == "python") == b.marker.startswith("file"))]
    assert not wrong, ("a marker is `skip (REASON)` or `exit N` above a sh block, `file NAME.py` above "
                       "a python one:\n" + "\n".join(wrong))
    stray = []
    for path in pages():
        lines = path.read_text().splitlines() + [""]
        stray += [f"{path.relative_to(ROOT)}:{i + 1}" for i, line in enumerate(lines[:-1])
                  if MARKER.fullmatch(line) and not lines[i + 1].lstrip().startswith("```")]
    assert not stray, "a marker not directly above a block:\n" + "\n".join(stray)


def test_every_command_block_is_tagged_sh():
    untagged = [b.where for b in BLOCKS if b.tag == "" and COMMAND_START.match(b.text)]
    assert not untagged, ("tag these command blocks ```sh, so that they run or say why not:\n"
                          + "\n".join(untagged))


def named_tmp_paths(texts: list[str]) -> set[Path]:
    """The /tmp paths (top level) that texts name, and those of the flag files they read."""
    flagfiles = [ROOT / f for text in texts for f in re.findall(r"--flagfile=(\S+)", text)]
    words = " ".join(texts + [f.read_text() for f in flagfiles if f.is_file()])
    return {Path("/tmp", name) for name in re.findall(r"/tmp/([\w.-]+)", words)}


@contextlib.contextmanager
def reading(run: list[Block]):
    """The working directory, with the docs' scripts saved in it, and its environment; the /tmp
    paths that the run names, removed afterwards where the run made them."""
    lock = open(Path(tempfile.gettempdir()) / "tower_train_doc_commands.lock", "w")
    fcntl.flock(lock, fcntl.LOCK_EX)
    saved = [b for b in BLOCKS if (b.marker or "").startswith("file")]
    named = named_tmp_paths([b.text for b in run + saved])
    existed = {path for path in named if path.exists()}
    try:
        with tempfile.TemporaryDirectory(prefix="doc_commands_") as work:
            for entry in ROOT.iterdir():
                if not entry.name.startswith("."):
                    (Path(work) / entry.name).symlink_to(entry)
            for block in saved:
                with open(Path(work) / block.marker.split()[1], "a") as script:
                    script.write(block.text)
            env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
            env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
            env["VIRTUAL_ENV"] = str(Path(sys.executable).parent.parent)
            yield {"cwd": work, "env": env}
    finally:
        for path in named - existed:
            shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
        lock.close()


@pytest.fixture(scope="module")
def reader():
    with reading(RUN) as directory_and_env:
        yield directory_and_env


def run_block(block: Block, cwd: str, env: dict) -> tuple[int | None, str, float]:
    """The block run by bash: its exit status (None after TIMEOUT_S), stderr and seconds."""
    start = time.monotonic()
    process = subprocess.Popen(["bash", "-e", "-c", block.text], cwd=cwd, env=env, text=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        _, stderr = process.communicate(timeout=TIMEOUT_S)
        return process.returncode, stderr, time.monotonic() - start
    except subprocess.TimeoutExpired:
        # The block's whole process group (launch's workers too); SIGTERM first, which the
        # commands answer by stopping cleanly, removing their temporary files.
        os.killpg(process.pid, signal.SIGTERM)
        try:
            _, stderr = process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            _, stderr = process.communicate()
        return None, stderr, time.monotonic() - start


@pytest.mark.parametrize("block", RUN, ids=[b.where for b in RUN])
def test_the_command_block_exits_as_documented(block, reader):
    status, stderr, seconds = run_block(block, reader["cwd"], reader["env"])
    said = (f"{block.where} ({seconds:.0f} s):\n{block.text}"
            f"-> {'no exit within %d s' % TIMEOUT_S if status is None else f'exit {status}'}, "
            f"documented {block.exit_code}; mark it `<!-- doc-commands: skip (REASON) -->` if it "
            f"cannot run here\n{stderr[-3000:]}")
    assert status == block.exit_code, said
    assert "Traceback (most recent call last)" not in stderr, said
