"""The import graph keeps the layers: lower parts never import higher ones, and modules form no cycle.

The parts, lowest first (docs/architecture.md draws them)::

    traces < policies < sim < realexec < reports < cli

A module may import its own part and any part below it, never one above: traces knows nothing
of engines, the engine core nothing of the simulator, the simulator nothing of the real
executor, and no part of the reports or the command line. ``reports`` reads what runs write, so
it may import the readers and formats below it (``sim.run.outputs``, ``sim.studies.sweep``,
``realexec.validation``); ``kvsim.cli`` (folder ``sim/cli/``) is the program above everything.
Inside ``sim`` the rooms are ordered too: the top-level helpers (``toml_io``) < ``perf`` <
``run`` < ``studies``. ``sim.parallel`` and ``sim.cluster`` hold no code yet and so no rank:
their first module with an import fails :func:`test_every_module_has_a_layer` until it is
placed in :data:`LAYERS`, a choice for whoever writes it.

Every import counts for the layers: at module level, inside functions (a lazy import is still
a dependency) and under ``if TYPE_CHECKING``. The cycle check counts the imports that run when
a module is imported (module level, outside ``TYPE_CHECKING``): a function-level import or a
type-only one breaks no import order, and the layer rule already bounds where it may point.
"""

from __future__ import annotations

import ast
import re
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]

# Lowest first; a module belongs to the longest prefix that names it.
LAYERS: tuple[str, ...] = (
    "kvsim.traces",
    "kvsim.policies",
    "kvsim.sim",  # sim's top-level helpers (toml_io)
    "kvsim.sim.perf",
    "kvsim.sim.parallel",
    "kvsim.sim.run",
    "kvsim.sim.cluster",
    "kvsim.sim.studies",
    "kvsim.realexec",
    "kvsim.reports",
    "kvsim.cli",
)
# Rooms that exist but hold no code to rank yet (docs/architecture.md: where new things go).
UNRANKED: tuple[str, ...] = ()


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the kvsim module (or package) imported
    line: int
    runs_on_import: bool  # module level and not under TYPE_CHECKING


def package_dirs(root: Path = ROOT) -> dict[str, Path]:
    """kvsim's packages and their folders, as pyproject's package-dir installs them."""
    with open(root / "pyproject.toml", "rb") as f:
        mapping = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    return {package: root / folder for package, folder in mapping.items()}


def module_files(packages: Mapping[str, Path]) -> dict[str, Path]:
    """Every module of every package: ``kvsim.sim.run.config`` -> its file (``__init__`` as the package)."""
    modules = {}
    for package, folder in packages.items():
        for path in sorted(folder.glob("*.py")):
            modules[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(module: str, path: Path, known: Iterable[str]) -> list[Import]:
    """The kvsim imports of one module, each resolved to the module it names where one exists.

    ``from kvsim.realexec import calibration`` imports the module ``kvsim.realexec.calibration``;
    ``from kvsim.sim.run.config import RunConfig`` the module ``kvsim.sim.run.config``.
    """
    known = set(known)
    is_package = path.stem == "__init__"
    found: list[Import] = []

    def add(target: str, node: ast.AST, runs: bool) -> None:
        if target == "kvsim" or target.startswith("kvsim."):
            found.append(Import(module, target, node.lineno, runs))

    def visit(node: ast.AST, runs: bool) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node, runs)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                anchor = module.split(".") if is_package else module.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base, node, runs)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            for child in ast.iter_child_nodes(node):
                visit(child, False)
            return
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, False)
            for child in node.orelse:
                visit(child, runs)
            return
        for child in ast.iter_child_nodes(node):
            visit(child, runs)

    visit(ast.parse(path.read_text(), filename=str(path)), True)
    return found


def layer_of(module: str, layers: Iterable[str] = LAYERS) -> int | None:
    """The rank of the longest layer prefix naming ``module`` (None: in no layer)."""
    best: tuple[int, int] | None = None  # (prefix length, rank)
    for rank, prefix in enumerate(layers):
        if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > best[0]):
            best = (len(prefix), rank)
    return None if best is None else best[1]


def upward_imports(imports: Iterable[Import], layers: tuple[str, ...] = LAYERS) -> list[str]:
    """Each import from a lower layer to a higher one, as ``file line: source -> target``."""
    bad = []
    for imp in imports:
        source, target = layer_of(imp.source, layers), layer_of(imp.target, layers)
        if source is not None and target is not None and target > source:
            bad.append(f"{imp.source}:{imp.line} imports {imp.target} ({layers[source]} < {layers[target]})")
    return bad


def find_cycle(graph: Mapping[str, Iterable[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path that returns to its start, or None when it is acyclic."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


@pytest.fixture(scope="module")
def modules() -> dict[str, Path]:
    return module_files(package_dirs())


@pytest.fixture(scope="module")
def all_imports(modules: dict[str, Path]) -> list[Import]:
    return [imp for name, path in modules.items() for imp in imports_of(name, path, modules)]


def test_the_graph_is_read(modules: dict[str, Path], all_imports: list[Import]):
    """The scan sees what is there: the moved modules, lazy imports, type-only imports."""
    assert {"kvsim.cli.main", "kvsim.sim.run.simulator", "kvsim.sim.perf.cost_model", "kvsim.traces"} <= set(modules)
    edges = {(imp.source, imp.target, imp.runs_on_import) for imp in all_imports}
    assert ("kvsim.sim.run.config", "kvsim.traces", True) in edges  # ``from kvsim import traces``
    assert ("kvsim.sim.studies.sweep", "kvsim.sim.run.runner", False) in edges  # inside a function
    assert ("kvsim.policies.view", "kvsim.policies.engine", False) in edges  # under TYPE_CHECKING


def test_every_package_folder_is_installed():
    """A new room (a folder with ``__init__.py``) under a part is in pyproject's package-dir."""
    installed = {path.resolve() for path in package_dirs().values()}
    folders = {init.parent.resolve() for part in ("traces", "policies", "sim", "realexec", "reports")
               for init in (ROOT / part).rglob("__init__.py")}
    assert folders - installed == set()


def test_every_module_has_a_layer(all_imports: list[Import], modules: dict[str, Path]):
    unplaced = sorted({name for name in modules if layer_of(name) is None})
    assert unplaced == [], f"not in tests/test_layers.py's LAYERS: {unplaced}"
    holding_code = sorted({imp.source for imp in all_imports if imp.source.startswith(UNRANKED)})
    assert holding_code == [], f"{holding_code}: a room with code needs its place in LAYERS"


def test_no_import_points_up_the_layers(all_imports: list[Import]):
    assert upward_imports(all_imports) == []


def test_no_module_imports_the_command_line_by_its_folder(all_imports: list[Import]):
    """sim/cli/ is ``kvsim.cli``; an editable install also resolves it as ``kvsim.sim.cli``, a second copy."""
    assert [f"{i.source}:{i.line}" for i in all_imports if i.target.startswith("kvsim.sim.cli")] == []


def test_the_modules_import_no_cycle(all_imports: list[Import]):
    graph: dict[str, set[str]] = {}
    for imp in all_imports:
        if imp.runs_on_import:
            graph.setdefault(imp.source, set()).add(imp.target)
    assert find_cycle(graph) is None


def test_the_torch_commands_are_those_that_import_torch(modules: dict[str, Path], all_imports: list[Import]):
    """``kvsim.cli.main.TORCH_COMMANDS`` (one OpenBLAS thread for the others) matches what each command imports."""
    from kvsim.cli.main import SUBCOMMANDS, TORCH_COMMANDS

    graph: dict[str, set[str]] = {}
    for imp in all_imports:
        if imp.runs_on_import:
            graph.setdefault(imp.source, set()).add(imp.target)

    def imports_torch(module: str) -> bool:
        seen, todo = set(), [module]
        while todo:
            name = todo.pop()
            if name in seen or name not in modules:
                continue
            seen.add(name)
            tree = ast.parse(modules[name].read_text())
            for node in tree.body:  # module level only: what ``kvsim <command>`` loads
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                    [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
                if any(n == "torch" or n.startswith("torch.") for n in names):
                    return True
            todo.extend(graph.get(name, ()))
            todo.extend(name.rsplit(".", k)[0] for k in range(1, name.count(".")))  # parents run first
        return False

    assert {name for name, (target, _) in SUBCOMMANDS.items() if imports_torch(target.split(":")[0])} == TORCH_COMMANDS


# The checker itself can fail: planted violations in fake graphs.


def test_the_checker_flags_an_import_up_the_layers():
    planted = [
        Import("kvsim.traces.cli", "kvsim.sim.errors", 19, True),  # the arrow traces/cli.py had
        Import("kvsim.sim.fidelity_cli", "kvsim.reports.page", 97, False),  # a lazy one counts too
        Import("kvsim.sim.run.config", "kvsim.sim.perf.memory", 3, True),  # down: fine
        Import("kvsim.sim.perf.cost_model", "kvsim.sim.run.simulator", 5, True),  # up between rooms
        Import("kvsim.cli.main", "kvsim.realexec.doctor", 1, False),  # the program sees all
    ]
    bad = upward_imports(planted)
    assert [line.split(" imports ")[0] for line in bad] == [
        "kvsim.traces.cli:19", "kvsim.sim.fidelity_cli:97", "kvsim.sim.perf.cost_model:5",
    ]
    assert layer_of("kvsim.sim.studies.sweep") > layer_of("kvsim.sim.run.runner") > layer_of("kvsim.sim.toml_io")
    assert layer_of("kvsim.simulator") is None  # a prefix is a package, not a string


def test_the_checker_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"x": {"x"}}) == ["x", "x"]


def test_the_scan_reads_lazy_relative_and_type_only_imports(tmp_path: Path):
    source = tmp_path / "mod.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "from kvsim import traces\n"
        "from . import sibling\n"
        "if TYPE_CHECKING:\n"
        "    from kvsim.policies.engine import EngineCore\n"
        "def f():\n"
        "    import kvsim.reports.page\n"
    )
    known = {"kvsim.traces", "kvsim.sim.run.sibling", "kvsim.policies.engine", "kvsim.reports.page"}
    found = {(i.target, i.runs_on_import) for i in imports_of("kvsim.sim.run.mod", source, known)}
    assert found == {("kvsim.traces", True), ("kvsim.sim.run.sibling", True),
                     ("kvsim.policies.engine", False), ("kvsim.reports.page", False)}


def test_the_architecture_doc_names_files_that_exist():
    """docs/architecture.md's map and its "where new things go" point at real files and folders."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    named = set(re.findall(r"`((?:traces|policies|sim|realexec|reports|examples|tests)/[\w/.]*)`", text))
    assert len(named) > 20
    assert sorted(p for p in named if not (ROOT / p).exists()) == []
