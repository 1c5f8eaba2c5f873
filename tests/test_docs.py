"""Figures the docs copy from a command stay what the command prints.

The bytes per update that `python -m tower_train.benchmark --measure=traffic` prints are counted
from traced graphs, not timed, so they are exact: every table of docs/*.md under such a command
is checked cell by cell against the command run again (a row named `config, `--flags`` adds
those flags), and the prose figures quoted from those tables, README's included, against the
tables. Figures that are timed or measured (speeds, memory peaks) cannot be compared this way:
each stands in one place with its command and commit."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from test_benchmark import benchmark
from test_cli_errors import ROOT
from tower_train.benchmark.names import default_configs

DOCS = sorted((Path(ROOT) / "docs").glob("*.md"))
COMMAND = "python -m tower_train.benchmark"
# Flags that choose what is printed, not what is counted: a group's runs merge them.
CHOSEN = ("--configs", "--link_gbps")


def squeeze(column: str) -> str:
    """A column's name without spaces: the docs' 'ms @ 256 Gb/s' is the report's 'ms @256Gb/s'."""
    return re.sub(r"\s+", "", column)


def traffic_tables() -> list[dict]:
    """Each table of docs/*.md whose nearest command block above it runs the traffic benchmark:
    where it is, that command's flags, and its rows as {column: cell}."""
    found = []
    for path in DOCS:
        lines = path.read_text().splitlines()
        command, number = None, 0
        while number < len(lines):
            line = lines[number]
            if line.startswith("```sh"):
                end = lines.index("```", number + 1)
                runs = [line for line in lines[number + 1:end] if line.startswith(COMMAND)]
                command = shlex.split(runs[-1], comments=True)[3:] if runs else None
                number = end
            elif line.startswith("| config |") and command and "--measure=traffic" in command:
                header = [squeeze(c) for c in line.strip("|").split("|")]
                rows = []
                for row in lines[number + 2:]:
                    if not row.startswith("|"):
                        break
                    rows.append(dict(zip(header, (c.strip() for c in row.strip("|").split("|")), strict=True)))
                found.append({"where": f"{path.name}:{number + 1}", "command": command, "rows": rows})
            number += 1
    return found


def flag(flags: list[str], name: str) -> str | None:
    return next((f.split("=", 1)[1] for f in flags if f.startswith(name + "=")), None)


def row_run(table: dict, row: dict) -> tuple[str, tuple[str, ...]]:
    """A row's configuration and the flags of the run that prints it: the table's command's, and
    those the row's name adds ('tower_pscpu_k8, `--precision=bf16`')."""
    match = re.fullmatch(r"(\w+)(?:, `([^`]*)`)?(?: \(.*\))?", row["config"])
    assert match, f"{table['where']}: a row named {row['config']!r}"
    flags = [f for f in table["command"] if not f.startswith(CHOSEN)] + shlex.split(match[2] or "")
    return match[1], tuple(sorted(flags))


def runs(tables: list[dict]) -> dict[tuple[str, ...], dict]:
    """One run per set of counted flags, for all the configurations and link speeds that the
    tables' rows want of it."""
    wanted: dict[tuple[str, ...], dict] = {}
    for table in tables:
        for row in table["rows"]:
            config, flags = row_run(table, row)
            run = wanted.setdefault(flags, {"configs": [], "links": set()})
            run["configs"] += [config] * (config not in run["configs"])
            run["links"] |= set(filter(None, (flag(table["command"], "--link_gbps") or "").split(",")))
    return wanted


TABLES = traffic_tables()
RUNS = runs(TABLES)


def printed_rows(stdout: str) -> dict[str, dict[str, str]]:
    """The report's rows by configuration, each {column: printed figure}."""
    head, *lines = stdout.splitlines()
    header = [squeeze(c) for c in re.findall(r"state max|ms @\S+|\S+", head.replace("(MB per update)", ""))]
    return {line.split()[0]: dict(zip(header, line.split())) for line in lines if len(line.split()) == len(header)}


def test_the_docs_traffic_tables_are_found_with_their_commands():
    assert [t["where"].split(":")[0] for t in TABLES].count("which-mode.md") == 2
    for table in TABLES:
        # A table lists every configuration its command prints, in each variant of its rows.
        command_configs = (flag(table["command"], "--configs") or ",".join(
            default_configs("traffic", int(flag(table["command"], "--batch_size") or 128)))).split(",")
        variants: dict[tuple[str, ...], list[str]] = {}
        for row in table["rows"]:
            config, flags = row_run(table, row)
            variants.setdefault(flags, []).append(config)
        for configs in variants.values():
            assert sorted(configs) == sorted(command_configs), table["where"]


@pytest.mark.parametrize("flags", [pytest.param(flags, id=" ".join(flags), marks=[pytest.mark.bf16] * any(
    "bf16" in f for f in flags)) for flags in RUNS])
def test_each_traffic_figure_in_the_docs_is_what_its_command_prints(flags):
    wanted = RUNS[flags]
    links = sorted(wanted["links"], key=float)
    result = benchmark(*flags, f"--configs={','.join(wanted['configs'])}",
                       *[f"--link_gbps={','.join(links)}"] * bool(links))
    assert result.returncode == 0, result.stderr[-3000:]
    printed = printed_rows(result.stdout)
    stale = []
    for table in TABLES:
        for row in table["rows"]:
            config, row_flags = row_run(table, row)
            if row_flags != flags:
                continue
            for column, cell in row.items():
                if column != "config" and float(cell) != float(printed[config][column]):
                    stale.append(f"{table['where']} {row['config']} {column}: {cell}, printed {printed[config][column]}")
    assert not stale, "\n".join(stale)


def table_figure(config: str, column: str) -> float:
    """which-mode.md's first table's figure (checked against its command above)."""
    first = next(t for t in TABLES if t["where"].startswith("which-mode.md"))
    (row,) = [r for r in first["rows"] if r["config"] == config]
    return float(row[squeeze(column)])


# Prose that quotes the tables: (page, the sentence with its figures as groups, what each group
# is), matched with the page's lines joined by single spaces.
QUOTED = [
    ("README.md", r"the busiest device moves ([\d.]+) MB per update instead of ([\d.]+) MB",
     [("tower_psspread_k8", "busiest"), ("tower_pscpu_k8", "busiest")]),
    ("docs/which-mode.md", r"moves ([\d.]+) MB per update at K = 8, against ([\d.]+) MB through the host",
     [("tower_psspread_k8", "busiest"), ("tower_pscpu_k8", "busiest")]),
    ("docs/which-mode.md", r"The input \(([\d.]+) MB of uint8 shards at K = 8\)", [("tower_pscpu_k8", "input")]),
    ("docs/which-mode.md", r"That is ([\d.]+) against ([\d.]+) ms per update at 256 Gb/s",
     [("tower_pscpu_k8_permicro", "ms @ 256 Gb/s"), ("tower_pscpu_k8", "ms @ 256 Gb/s")]),
    ("docs/which-mode.md", r"([\d.]+) ms per update at 256 Gb/s in the table",
     [("tower_psspread_k8", "ms @ 256 Gb/s")]),
    ("docs/which-mode.md", r"\(`central_storage_k8`, ([\d.]+) ms at 100 Gb/s\)",
     [("central_storage_k8", "ms @ 100 Gb/s")]),
    ("docs/performance.md", r"with `cpu` \(([\d.]+) against ([\d.]+) MB;",
     [("tower_psspread_k8", "busiest"), ("tower_pscpu_k8", "busiest")]),
]


@pytest.mark.parametrize("page,sentence,figures", QUOTED, ids=[f"{q[0]}: {q[2][0][0]}" for q in QUOTED])
def test_the_prose_quotes_the_traffic_tables(page, sentence, figures):
    match = re.search(sentence, " ".join((Path(ROOT) / page).read_text().split()))  # lines joined
    assert match, f"{page} no longer says {sentence!r}: quote the table again, or change this test"
    for quoted, (config, column) in zip(match.groups(), figures, strict=True):
        assert float(quoted) == round(table_figure(config, column), len(quoted.partition(".")[2])), (
            page, config, column)


# README's modes table: each mode's row quotes its K = 8 configuration's weights and gradients.
README_MODES = {"`tower` (default)": "tower_pscpu_k8", "`tower --ps_device=spread`": "tower_psspread_k8",
                "`mirrored`": "mirrored_k8", "`central_storage`": "central_storage_k8"}


def test_readmes_modes_table_quotes_which_modes_weights_and_gradients():
    lines = (Path(ROOT) / "README.md").read_text().splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("| Mode |"))
    column = [c.strip() for c in lines[header].strip("|").split("|")].index("MB per update: weights + gradients")
    quoted = {}
    for line in lines[header + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0] in README_MODES:
            quoted[README_MODES[cells[0]]] = cells[column]
    assert set(quoted) == set(README_MODES.values())
    for config, cell in quoted.items():
        weights, gradients = (float(f) for f in re.match(r"([\d.]+) \+ ([\d.]+)", cell).groups())
        assert (weights, gradients) == (round(table_figure(config, "weights"), 1),
                                        round(table_figure(config, "gradients"), 1)), config
