"""The package's import graph (an AST walk of every module, function-level imports included;
``if TYPE_CHECKING:`` blocks are not imports): no cycles, and the platform-neutral layer below
the platforms, passes and checkpoints."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "dsv4"


def module_names(root: Path = SRC, package: str = PACKAGE) -> dict[str, Path]:
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules ``name`` imports at run time, anywhere in its body. ``from a.b
    import c`` is an import of ``a.b.c`` where that is a module, else of ``a.b``. (A package's
    ``__init__`` that a submodule import runs first is not an edge: a package importing its own
    submodules is how packages are built.)"""
    is_pkg = path.name == "__init__.py"
    found: set[str] = set()

    def add(target: str) -> None:
        if target in modules and target != name:
            found.add(target)

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = name.split(".") if is_pkg else name.split(".")[:-1]
                up = here[:len(here) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                add(full if full in modules else base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return found


def import_graph(root: Path = SRC, package: str = PACKAGE) -> dict[str, set[str]]:
    modules = module_names(root, package)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), and self-imports."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph.get(v, ()):
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def test_the_package_has_no_import_cycle():
    found = cycles(import_graph())
    assert found == [], "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


NEUTRAL_LAYER_MUST_NOT_IMPORT = ("dsv4.platforms", "dsv4.passes", "dsv4.checkpoint",
                                 "dsv4.integrations", "dsv4.bench", "dsv4.testing",
                                 "dsv4.tinylm", "dsv4.cli")


def test_the_neutral_layer_imports_no_platform_pass_or_checkpoint():
    """``dsv4.attention`` (and what it imports, transitively) reaches no platform, pass,
    checkpoint or tool module: construction goes through the registry, the passes through the
    pipeline."""
    graph = import_graph()
    seen, todo = set(), ["dsv4.attention"]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(graph.get(m, ()))
    bad = sorted(m for m in seen if m.startswith(NEUTRAL_LAYER_MUST_NOT_IMPORT))
    assert bad == []


@pytest.mark.parametrize("edges,want", [
    ({"a": {"b"}, "b": {"a"}}, [["a", "b"]]),
    ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
    ({"a": {"a"}}, [["a"]]),
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
])
def test_the_cycle_finder_finds_cycles(edges, want):
    assert cycles(edges) == want


def test_the_walk_sees_function_level_imports_and_skips_type_checking(tmp_path):
    pkg = tmp_path / "pk"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\n"
                              "if TYPE_CHECKING:\n    from pk.b import X\n"
                              "def f():\n    from pk import c\n")
    (pkg / "b.py").write_text("from . import a\n")
    (pkg / "c.py").write_text("import pk.b\n")
    graph = import_graph(tmp_path, "pk")
    assert graph["pk.a"] == {"pk.c"}  # the function-level one; not the TYPE_CHECKING one
    assert graph["pk.b"] == {"pk.a"} and graph["pk.c"] == {"pk.b"}
    assert cycles(graph) == [["pk.a", "pk.b", "pk.c"]]
