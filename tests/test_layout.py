"""What docs/layout.md says of the code's shape, read from the files: no module of `tower_train`
(its `models/` included) is part of an import cycle, and every import follows the section "Which
layer imports which", so no arrow points back up. And every module path that README.md, docs/ and
the code's docstrings and comments name exists."""

from __future__ import annotations

import ast
import configparser
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
# Where each part of the installed package lives (setup.cfg's package_dir: models/ is tower_train.models).
SOURCES = {"": ROOT / "tower_train", "models": ROOT / "models"}

# "Which layer imports which": what each package imports outside itself. A name allows that module
# and, for a package, the modules in it.
PACKAGE_IMPORTS = {
    "workers": {"errors"},
    "data": {"errors", "user_code"},
    "models": {"errors", "user_code"},
    "step": {"data.source", "workers.cluster", "models.base", "config", "devices", "errors", "rules"},
    "training": {"step", "data.source", "workers", "models",
                 "config", "errors", "export", "model_spec", "numerics", "user_code"},
}
# The top level's shared modules: those the packages import, and what these import of the top
# level in turn. Of the packages they import only these two, the floor below step/ and training/.
SHARED = {"config", "devices", "errors", "export", "user_keras_model", "model_spec", "numerics", "rules", "user_code"}
SHARED_IMPORTS = {"data", "models"}


def package_modules() -> dict[str, pathlib.Path]:
    """Every module of tower_train by its dotted name under it ('data.catalog', 'models.base'; a
    package by its own name; '' for tower_train/__init__.py)."""
    modules = {}
    for prefix, folder in SOURCES.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            parts = (prefix,) * bool(prefix) + (parts[:-1] if parts[-1] == "__init__" else parts)
            modules[".".join(parts)] = path
    return modules


def imported_modules(path: pathlib.Path, modules) -> set[str]:
    """The tower_train modules that `path` imports anywhere in it, functions included."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tower_train"):
            base = node.module.removeprefix("tower_train").removeprefix(".")
            for alias in node.names:
                full = f"{base}.{alias.name}" if base else alias.name
                names.add(full if full in modules else base)
        elif isinstance(node, ast.Import):
            names |= {a.name.removeprefix("tower_train.") for a in node.names if a.name.startswith("tower_train.")}
    return names & modules.keys()


def import_graph() -> dict[str, set[str]]:
    modules = package_modules()
    return {name: imported_modules(path, modules) - {name} for name, path in modules.items()}


def package(module: str) -> str | None:
    """The package of PACKAGE_IMPORTS that `module` is in; None for the top level."""
    first = module.split(".")[0]
    return first if first in PACKAGE_IMPORTS else None


def allowed(module: str, names: set[str]) -> bool:
    return any(module == name or module.startswith(name + ".") for name in names)


def test_the_graph_holds_both_folders_and_function_level_imports():
    graph = import_graph()
    assert {"data.image_sets", "data.text_sets"} <= graph["data.catalog"]
    assert "data.source" in graph["data.image_sets"]
    assert {"models.base", "models.registry"} <= graph["models.cifar10_cnn"]
    assert "models.base" in graph["models.registry"]  # imported inside register()


def test_no_module_of_tower_train_or_its_models_is_part_of_an_import_cycle():
    graph = import_graph()

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(nxt == goal or (nxt not in seen and reaches(nxt, goal, seen | {nxt}))
                   for nxt in graph[start])

    assert [name for name in graph if reaches(name, name, {name})] == []


def test_each_package_imports_outside_itself_only_what_layout_md_allows_it():
    graph = import_graph()
    back_up = sorted((name, imported) for name, imports in graph.items() if package(name)
                     for imported in imports if package(imported) != package(name)
                     and not allowed(imported, PACKAGE_IMPORTS[package(name)]))
    assert back_up == []


def test_the_top_levels_shared_modules_import_no_package_above_them():
    graph = import_graph()
    shared, todo = set(), [imported for name, imports in graph.items() if package(name)
                           for imported in imports if package(imported) is None]
    while todo:
        name = todo.pop()
        if name not in shared:
            shared.add(name)
            todo += [imported for imported in graph[name] if package(imported) is None]
    assert shared == SHARED
    back_up = sorted((name, imported) for name in shared for imported in graph[name]
                     if package(imported) and not allowed(imported, SHARED_IMPORTS))
    assert back_up == []
    section = (ROOT / "docs" / "layout.md").read_text().split("## Which layer imports which")[1].split("\n## ")[0]
    assert [name for name in sorted(SHARED) if f"`{name}.py`" not in section] == []


# What names the code's files: README.md, docs/, and the code's docstrings and comments.
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
             *sorted(path for folder in ("tower_train", "models", "tests") for path in (ROOT / folder).rglob("*.py"))]
# A path from the repository's root (`tests/helpers.py`) or from tower_train/ (`step/modes.py`): a
# file or folder, or a module's path with a name it defines (`step/modes.build_mode`).
PATH = re.compile(r"(?<![\w./<>$-])((?:\.ci|docs|flags|models|tests|tower_train|data|step|training|workers|benchmark)"
                  r"(?:/\w[\w.*-]*)+)")
# A module's dotted name, perhaps with a name it defines: tower_train.data.register.
DOTTED = re.compile(r"(?<![\w./-])tower_train(?:\.\w+)+")
# A quoted `module.name` (`run_record.RunRecord`): checked where the name is a function or class
# the package defines, so that a renamed module (run_dir.RunRecord for run_record.RunRecord) is caught; objects that share such
# names (a Keras model's `model.fit`, `tf.train`) are not modules.
MODULE_NAME = re.compile(r"`([a-z_]\w*)\.(\w+)")
NOT_MODULES = {"tower_train", "tf", "np", "keras", "model", "self"}


def defined_names(path: pathlib.Path) -> set[str]:
    """The names a module defines at its top level (a dict's keys too: `__init__.py`'s lazy names)."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {name.id for target in targets for name in ast.walk(target) if isinstance(name, ast.Name)}
            if isinstance(node.value, ast.Dict):
                names |= {key.value for key in node.value.keys if isinstance(key, ast.Constant)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
    return names


def path_exists(named: str) -> bool:
    for base in (ROOT, ROOT / "tower_train"):
        if (base / named).exists() or ("*" in named and any(base.glob(named))):
            return True
        folder, _, last = named.rpartition("/")
        module, _, name = last.partition(".")
        for file in (base / folder / f"{module}.py", base / folder / module / "__init__.py"):
            if file.is_file() and (not name or name.split(".")[0] in defined_names(file)):
                return True
    return False


def dotted_name_exists(named: str, modules: dict[str, pathlib.Path]) -> bool:
    parts = named.removeprefix("tower_train").removeprefix(".").split(".")
    longest = max(n for n in range(len(parts) + 1) if ".".join(parts[:n]) in modules)
    return longest == len(parts) or parts[longest] in defined_names(modules[".".join(parts[:longest])])


def own_names(path: pathlib.Path) -> set[str]:
    """The functions and classes a module defines at its top level."""
    return {node.name for node in ast.parse(path.read_text()).body
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}


def module_name_exists(module: str, name: str, modules: dict[str, pathlib.Path], defined: set[str]) -> bool:
    return (module in NOT_MODULES or name not in defined
            or any(name in defined_names(path) for dotted, path in modules.items()
                   if dotted.split(".")[-1] == module))


def test_every_module_path_the_docs_and_docstrings_name_exists():
    modules = package_modules()
    defined = set().union(*(own_names(path) for path in modules.values()))
    missing = []
    for document in DOCUMENTS:
        for number, line in enumerate(document.read_text().splitlines(), 1):
            where = f"{document.relative_to(ROOT)}:{number}"
            missing += [(named, where) for named in PATH.findall(line) if not path_exists(named.rstrip("."))]
            missing += [(named, where) for named in DOTTED.findall(line) if not dotted_name_exists(named, modules)]
            missing += [(f"{module}.{name}", where) for module, name in MODULE_NAME.findall(line)
                        if not module_name_exists(module, name, modules, defined)]
    assert not missing, missing


def test_setup_cfg_installs_every_package_and_no_module_is_over_450_lines():
    listed = configparser.ConfigParser()
    listed.read(ROOT / "setup.cfg")
    packages = {name.strip() for name in listed["options"]["packages"].split(",")}
    modules = package_modules()
    on_disk = {"tower_train" + "." * bool(name) + name for name, path in modules.items() if path.name == "__init__.py"}
    assert packages == on_disk
    assert sorted(name for name, path in modules.items() if len(path.read_text().splitlines()) > 450) == []
