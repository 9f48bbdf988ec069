"""The import structure: no import cycles in kvstore/, clients/ and bench/,
no import from a layer above inside kvstore/, and every module placed in a layer.

Imports are read with ``ast``, not by importing: module-level imports,
imports inside functions, imports under ``if TYPE_CHECKING:`` and
``importlib.import_module("...")`` calls with a string literal all count
(a type-only import still ties the two modules together). Relative imports
are resolved against the importing module.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import REPO_ROOT

ROOT = REPO_ROOT
PACKAGE = ROOT / "kvstore"
# Where cycles are looked for: (folder that holds the top-level packages/modules, folder to scan).
SCANNED = ((ROOT, PACKAGE), (ROOT / "clients", ROOT / "clients"), (ROOT, ROOT / "bench"))

# Layers, top to bottom. A module may import modules of its own layer and of
# the layers below it, never one above. Keys are the top-level names under
# kvstore/ (a subpackage, with its __init__, or a module); "" is kvstore/__init__.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("cli", ("cli", "demo")),  # user-facing entry code
    ("replay/bench", ("replay", "bench", "launch")),  # what users run against daemons they start
    ("training", ("training",)),  # offline: the predictor's labels, training and evaluation
    ("server/datapath", ("server", "datapath")),
    ("cluster", ("cluster",)),
    ("placement", ("placement",)),  # the planner: decides from the predictor's scores
    ("predict/transport", ("predict", "transport")),
    ("node", ("node",)),
    ("pool", ("pool", "tiers")),  # a node's page memory, and the storage below it
    ("ops", ("ops",)),
    ("bottom", ("config", "errors", "units", "metrics", "framing", "rpc", "hostmem", "loops", "v1", "protogen", "security",
                "workloads", "tracing", "")),
]
RANK = {top: i for i, (_, tops) in enumerate(LAYERS) for top in tops}
LAYER_NAME = {top: name for name, tops in LAYERS for top in tops}


@dataclass(frozen=True)
class Import:
    importer: str  # dotted module name
    target: str  # dotted module name (a kvstore module)
    path: str  # importer's file, relative to the repo
    line: int
    how: str  # "module", "function", "TYPE_CHECKING", "import_module"

    def site(self) -> str:
        return f"{self.path}:{self.line} ({self.how})"


# ---- reading the package -------------------------------------------------------------
def module_name(path: Path, base: Path = ROOT) -> str:
    parts = list(path.relative_to(base).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def source_files() -> dict[str, Path]:
    """The modules of the kvstore package, by dotted name."""
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def scanned_files() -> dict[str, Path]:
    """Every module the cycle check reads: kvstore, the client packages, the developer scripts in bench/."""
    return {module_name(p, base): p for base, folder in SCANNED for p in sorted(folder.rglob("*.py"))}


def top_of(module: str) -> str:
    """The layer key of a kvstore module: its first name below ``kvstore``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


class _Collector(ast.NodeVisitor):
    """Every import in one module, with where and how it happens."""

    def __init__(self, module: str, is_package: bool, path: str, modules: set[str]) -> None:
        self.module, self.is_package, self.path, self.modules = module, is_package, path, modules
        self.found: list[Import] = []
        self._function = 0
        self._type_checking = 0
        self._import_module_names: set[str] = set()  # bound by `from importlib import import_module`

    def _how(self) -> str:
        if self._type_checking:
            return "TYPE_CHECKING"
        return "function" if self._function else "module"

    def _add(self, target: str, node: ast.AST, how: str | None = None) -> None:
        resolved = self._resolve(target)
        if resolved is not None and resolved != self.module:
            self.found.append(Import(self.module, resolved, self.path, node.lineno, how or self._how()))  # type: ignore[attr-defined]

    def _resolve(self, dotted: str) -> str | None:
        """The deepest scanned module that ``dotted`` names (a module, or a name in one)."""
        parts = dotted.split(".")
        for n in range(len(parts), 0, -1):
            candidate = ".".join(parts[:n])
            if candidate in self.modules:
                return candidate
        return None

    def _base(self, level: int) -> str:
        """The package a relative import of ``level`` dots starts from."""
        parts = self.module.split(".")
        if not self.is_package:
            parts = parts[:-1]
        return ".".join(parts[:len(parts) - (level - 1)] if level > 1 else parts)

    # functions: imports inside them run later, but still bind the modules
    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self._function += 1
        self.generic_visit(node)
        self._function -= 1

    visit_AsyncFunctionDef = visit_FunctionDef  # type: ignore[assignment]
    visit_Lambda = visit_FunctionDef  # type: ignore[assignment]

    def visit_If(self, node: ast.If) -> None:
        if _is_type_checking(node.test):
            self._type_checking += 1
            for child in node.body:
                self.visit(child)
            self._type_checking -= 1
            for child in node.orelse:
                self.visit(child)
        else:
            self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            base = self._base(node.level)
            package = f"{base}.{node.module}" if node.module else base
        else:
            package = node.module or ""
        if package == "importlib":
            for alias in node.names:
                if alias.name == "import_module":
                    self._import_module_names.add(alias.asname or alias.name)
        for alias in node.names:
            if alias.name == "*":
                self._add(package, node)
            else:  # a submodule if there is one, else a name in the package
                self._add(f"{package}.{alias.name}", node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        named = (isinstance(func, ast.Attribute) and func.attr == "import_module") or \
            (isinstance(func, ast.Name) and func.id in self._import_module_names)
        if named and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            target = node.args[0].value
            if target.startswith("."):
                anchor = node.args[1] if len(node.args) > 1 else next(
                    (k.value for k in node.keywords if k.arg == "package"), None)
                if isinstance(anchor, ast.Constant) and isinstance(anchor.value, str):
                    level = len(target) - len(target.lstrip("."))
                    base = anchor.value.rsplit(".", level - 1)[0] if level > 1 else anchor.value
                    target = f"{base}.{target.lstrip('.')}".rstrip(".")
            self._add(target, node, "import_module")
        self.generic_visit(node)


def all_imports(files: dict[str, Path] | None = None) -> list[Import]:
    files = source_files() if files is None else files
    modules = set(files)
    out: list[Import] = []
    for module, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        collector = _Collector(module, path.name == "__init__.py", str(path.relative_to(ROOT)), modules)
        collector.visit(tree)
        out.extend(collector.found)
    return out


# ---- cycles ---------------------------------------------------------------------------
def strongly_connected(graph: dict[str, set[str]]) -> Iterator[list[str]]:
    """Tarjan's algorithm (iterative): components with more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    yield sorted(component)


def shortest_cycle(graph: dict[str, set[str]], start: str, within: set[str]) -> list[str]:
    """A shortest path start -> ... -> start inside one component."""
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node] & within):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [*reversed(path), start]
                if child not in previous:
                    previous[child] = node
                    following.append(child)
        frontier = following
    return [start]


# ---- tests ----------------------------------------------------------------------------
def test_every_module_has_a_layer() -> None:
    unknown = sorted({top_of(m) for m in source_files()} - set(RANK))
    assert not unknown, (
        "modules under kvstore/ that the layer table does not place: "
        + ", ".join(f"kvstore/{t}" for t in unknown)
        + ". Add each to LAYERS in tests/unit/package/test_layers.py, in the layer where it belongs.")


def test_no_import_cycles() -> None:
    files = scanned_files()
    imports = all_imports(files)
    graph: dict[str, set[str]] = {m: set() for m in files}
    sites: dict[tuple[str, str], list[Import]] = {}
    for imp in imports:
        graph[imp.importer].add(imp.target)
        sites.setdefault((imp.importer, imp.target), []).append(imp)
    problems = []
    for component in strongly_connected(graph):
        cycle = shortest_cycle(graph, component[0], set(component))
        lines = [f"cycle among {len(component)} modules: {', '.join(component)}",
                 "  " + " -> ".join(cycle)]
        for a, b in zip(cycle, cycle[1:]):
            lines.append(f"    {a} -> {b}: " + "; ".join(dict.fromkeys(s.site() for s in sites[(a, b)])))
        problems.append("\n".join(lines))
    assert not problems, "import cycles:\n" + "\n".join(problems)


def test_no_import_from_a_layer_above() -> None:
    violations: dict[str, None] = {}  # one line per import statement, in order
    for imp in all_imports():
        src, dst = top_of(imp.importer), top_of(imp.target)
        if src not in RANK or dst not in RANK:
            continue  # reported by test_every_module_has_a_layer
        if RANK[dst] < RANK[src]:
            violations[f"{imp.site()}: {imp.importer} [{LAYER_NAME[src]}] imports {imp.target} "
                       f"[{LAYER_NAME[dst]}], a layer above it"] = None
    order = " -> ".join(name for name, _ in LAYERS)
    assert not violations, (f"{len(violations)} imports from a layer above (layers top to bottom: {order}):\n"
                            + "\n".join(sorted(violations)))


# ---- the checker itself ---------------------------------------------------------------
def test_the_checker_resolves_relative_and_dynamic_imports(tmp_path: Path) -> None:
    source = (
        "from typing import TYPE_CHECKING\n"
        "from . import b\n"
        "from .c import name\n"
        "from .. import d\n"
        "import importlib\n"
        "if TYPE_CHECKING:\n"
        "    from kvstore.p.e import Thing\n"
        "def f():\n"
        "    import kvstore.d\n"
        "    return importlib.import_module('kvstore.p.c')\n")
    modules = {"kvstore", "kvstore.p", "kvstore.p.a", "kvstore.p.b", "kvstore.p.c", "kvstore.d", "kvstore.p.e"}
    collector = _Collector("kvstore.p.a", False, "kvstore/p/a.py", modules)
    collector.visit(ast.parse(source))
    got = [(i.target, i.how) for i in collector.found]
    assert got == [("kvstore.p.b", "module"), ("kvstore.p.c", "module"), ("kvstore.d", "module"),
                   ("kvstore.p.e", "TYPE_CHECKING"), ("kvstore.d", "function"), ("kvstore.p.c", "import_module")]
    graph = {"x": {"y"}, "y": {"z"}, "z": {"x"}, "w": {"x"}}
    assert list(strongly_connected(graph)) == [["x", "y", "z"]]
    assert shortest_cycle(graph, "x", {"x", "y", "z"}) == ["x", "y", "z", "x"]
