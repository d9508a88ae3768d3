"""The import graph of the ``dynatrain`` namespace: no cycles, and the command line is a leaf.

Every module is parsed with :mod:`ast`, never imported, from where pyproject.toml's
``[tool.setuptools.package-dir]`` puts it (``vps/`` is ``dynatrain.vps``, and so on). An import
inside a function counts (a lazy import is still a dependency); one under ``if TYPE_CHECKING:``
does not. ``from pkg import name`` counts as importing ``pkg.name`` when that is a module.
Importing ``a.b.c`` is an edge to ``a.b.c`` only: the packages Python initialises on the way
are not counted, or every module would depend on its own package's ``__init__``.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NAMESPACE = "dynatrain"
CLI = "dynatrain.cli"
CLI_IMPORTERS = {"dynatrain.__main__"}
"""The only modules outside ``dynatrain.cli`` allowed to import it."""


def package_dirs(root: Path = ROOT) -> dict[str, Path]:
    """Package name -> directory, from pyproject.toml's package-dir table."""
    table = tomllib.loads((root / "pyproject.toml").read_text())
    return {name: root / d for name, d in table["tool"]["setuptools"]["package-dir"].items()}


def module_files(dirs: dict[str, Path]) -> dict[str, Path]:
    """Module name -> source file for every ``.py`` file under the mapped directories."""
    modules: dict[str, Path] = {}
    for package, directory in dirs.items():
        for path in sorted(directory.rglob("*.py")):
            rel = path.relative_to(directory).with_suffix("").parts
            if "__pycache__" in rel:
                continue
            parts = rel[:-1] if rel[-1] == "__init__" else rel
            modules.setdefault(".".join((package, *parts)), path)
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


class _Imports(ast.NodeVisitor):
    """Every module an ``import`` or ``from ... import`` statement names, at any depth."""

    def __init__(self, module: str, is_package: bool, known: set[str]):
        self.package = module if is_package else module.rpartition(".")[0]
        self.known = known
        self.found: set[str] = set()

    def _add(self, name: str) -> None:
        # The module itself if it is one of ours, else the deepest of our modules it lies in
        # (``from dynatrain.vps.layout import X`` where X is a class: dynatrain.vps.layout).
        while name and name not in self.known:
            name = name.rpartition(".")[0]
        if name:
            self.found.add(name)

    def visit_If(self, node: ast.If) -> None:
        if _is_type_checking(node.test):
            for child in node.orelse:
                self.visit(child)
        else:
            self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            base = self.package.split(".")
            base = base[:len(base) - (node.level - 1)]
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = node.module or ""
        for alias in node.names:
            sub = f"{source}.{alias.name}"
            self._add(sub if sub in self.known else source)


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the ``dynatrain`` modules it imports (itself excluded)."""
    known = set(modules)
    graph = {}
    for name, path in modules.items():
        visitor = _Imports(name, path.name == "__init__.py", known)
        visitor.visit(ast.parse(path.read_text(), filename=str(path)))
        graph[name] = {m for m in visitor.found if m != name and m.startswith(NAMESPACE)}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as ``[a, b, ..., a]``, or None: depth-first search, grey nodes on the stack."""
    state: dict[str, int] = {}          # 1: on the current path, 2: done
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

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per tangle: per set of modules that all reach one another (Tarjan's SCCs)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    tangles: list[set[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            tangle = set()
            while not tangle or node not in tangle:
                tangle.add(stack.pop())
            if len(tangle) > 1:
                tangles.append(tangle)

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return sorted(find_cycle({m: graph[m] & t for m in t}) for t in tangles)


# -- the package --------------------------------------------------------------------------------
def _graph() -> dict[str, set[str]]:
    return import_graph(module_files(package_dirs()))


def test_every_layer_is_found():
    graph = _graph()
    for module in ("dynatrain.cli.app", "dynatrain.bench.switch", "dynatrain.vps.planner",
                   "dynatrain.agent.worker", "dynatrain.operator.handlers"):
        assert module in graph, module
    assert "dynatrain.cli.errors" in graph["dynatrain.cli.plan"]


def test_no_import_cycles():
    cycles = find_cycles(_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_nothing_outside_the_cli_imports_it():
    bad = sorted(f"{m} imports {t}" for m, targets in _graph().items() for t in targets
                 if not (m == CLI or m.startswith(CLI + ".")) and m not in CLI_IMPORTERS
                 and (t == CLI or t.startswith(CLI + ".")))
    assert not bad, "the command line must stay a leaf:\n" + "\n".join(bad)


# -- the checker itself, on a package made up for it ------------------------------------------
def _write(root: Path, files: dict[str, str]) -> dict[str, Path]:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return module_files({"dynatrain": root / "dynatrain", "dynatrain.vps": root / "vps"})


def test_checker_finds_a_lazy_relative_cycle_and_ignores_type_checking(tmp_path):
    modules = _write(tmp_path, {
        "dynatrain/__init__.py": "",
        "dynatrain/a.py": "def f():\n    from .b import g\n",
        "dynatrain/b.py": "from dynatrain.vps import c\n",
        "vps/__init__.py": "",
        "vps/c.py": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                     "    from dynatrain import b\n"),
    })
    graph = import_graph(modules)
    assert graph["dynatrain.a"] == {"dynatrain.b"}
    assert graph["dynatrain.b"] == {"dynatrain.vps.c"}
    assert graph["dynatrain.vps.c"] == set()
    assert find_cycles(graph) == []
    (tmp_path / "vps" / "c.py").write_text("import dynatrain.a\n")
    assert find_cycles(import_graph(modules)) == [
        ["dynatrain.a", "dynatrain.b", "dynatrain.vps.c", "dynatrain.a"]]
