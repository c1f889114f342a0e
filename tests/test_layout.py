"""The shape of src/: no import circle among dsec's modules, counting every import (at the
top, inside functions, and the type-only ones under TYPE_CHECKING), so that no module
dodges a circle by importing late. A module's imports are read from its source, not run."""

from __future__ import annotations

import ast
import graphlib
import os

import pytest

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")


def _modules() -> dict[str, str]:
    found = {}
    for top, _, files in os.walk(os.path.join(SRC, "dsec")):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(top, f)
                name = os.path.relpath(path, SRC)[:-3].replace(os.sep, ".")
                found[name.removesuffix(".__init__")] = path
    return found


def _imports(path: str, modules: dict[str, str]) -> set[str]:
    """The dsec modules ``path`` imports: ``from a.b import c`` is a.b.c when that is a
    module, else a.b."""
    out = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                     for a in node.names]
        for n in names:
            while n not in modules and "." in n:
                n = n.rsplit(".", 1)[0]
            if n in modules:
                out.add(n)
    return out


def test_src_has_no_import_circle() -> None:
    modules = _modules()
    assert len(modules) > 100, "src/dsec not found"
    graph = {name: _imports(path, modules) - {name} for name, path in modules.items()}
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as e:
        pytest.fail(f"an import circle: {' -> '.join(e.args[1])}")


def test_the_check_finds_a_circle(tmp_path: os.PathLike[str]) -> None:
    """The check above is not vacuous: two modules importing each other (one late, in a
    function) make a circle it reports."""
    a, b = os.path.join(tmp_path, "a.py"), os.path.join(tmp_path, "b.py")
    with open(a, "w") as f:
        f.write("import dsec.b\n")
    with open(b, "w") as f:
        f.write("def late() -> None:\n    from dsec import a\n")
    modules = {"dsec.a": a, "dsec.b": b}
    graph = {n: _imports(p, modules) - {n} for n, p in modules.items()}
    with pytest.raises(graphlib.CycleError):
        graphlib.TopologicalSorter(graph).prepare()
