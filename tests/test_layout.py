"""The shape of src/: every module sits in a tier and imports only its own tier or lower
ones, and no module imports one that imports it back. Every import counts (at the top,
inside functions, and the type-only ones under TYPE_CHECKING), so that no module dodges
the rule by importing late. A module's imports are read from its source, not run."""

from __future__ import annotations

import ast
import graphlib
import os

import pytest

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
# lowest first (docs/architecture.md): shared code, what runs on a node, the control plane,
# the HTTP faces, the clients. The package itself (``import dsec``: the SDK's names) is
# above them all.
TIERS = ("shared", "node", "control", "faces", "client")


def _modules() -> dict[str, str]:
    found = {}
    for top, _, files in os.walk(os.path.join(SRC, "dsec")):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(top, f)
                name = os.path.relpath(path, SRC)[:-3].replace(os.sep, ".")
                found[name.removesuffix(".__init__")] = path
    return found


def _imports(path: str, modules: dict[str, str], name: str = "") -> set[str]:
    """The dsec modules ``path`` (module ``name``) imports: ``from a.b import c`` is a.b.c
    when that is a module, else a.b; a relative import counts from ``name``'s package."""
    out = set()
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(open(path).read(), path)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        for n in names:
            while n not in modules and "." in n:
                n = n.rsplit(".", 1)[0]
            if n in modules:
                out.add(n)
    return out


def _rank(module: str) -> int | None:
    """A module's tier, lowest 0; the package itself above every tier; None: in no tier."""
    parts = module.split(".")
    if len(parts) == 1:
        return len(TIERS)
    return TIERS.index(parts[1]) if parts[1] in TIERS else None


def _upward(modules: dict[str, str]) -> list[str]:
    """Every import of a module in a higher tier than the importer's."""
    found = []
    for name, path in sorted(modules.items()):
        for imported in sorted(_imports(path, modules, name)):
            a, b = _rank(name), _rank(imported)
            if a is not None and b is not None and b > a:
                found.append(f"{name} ({TIERS[a]}) imports {imported} ({TIERS[b] if b < len(TIERS) else 'dsec'})")
    return found


def test_src_has_no_import_circle() -> None:
    modules = _modules()
    assert len(modules) > 100, "src/dsec not found"
    graph = {name: _imports(path, modules, name) - {name} for name, path in modules.items()}
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
    graph = {n: _imports(p, modules, n) - {n} for n, p in modules.items()}
    with pytest.raises(graphlib.CycleError):
        graphlib.TopologicalSorter(graph).prepare()


def test_every_module_sits_in_a_tier() -> None:
    modules = _modules()
    assert len(modules) > 100, "src/dsec not found"
    outside = sorted(m for m in modules if _rank(m) is None)
    assert not outside, f"modules in no tier ({', '.join(TIERS)}): {outside}"
    assert {m.split(".")[1] for m in modules if m != "dsec"} == set(TIERS)


def test_imports_point_down() -> None:
    """A tier imports only itself and the tiers below it: shared < node < control < faces <
    client (the package itself, ``import dsec``, may import any)."""
    upward = _upward(_modules())
    assert not upward, "imports that point up a tier:\n" + "\n".join(upward)


def test_the_check_catches_an_upward_import(tmp_path: os.PathLike[str]) -> None:
    """The check above is not vacuous: a node module importing the control plane (type-only,
    under TYPE_CHECKING) and a shared one importing a node module late (relatively, in a
    function) are both reported; imports down a tier, or within one, are not."""
    src = {
        "dsec.node.edge": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                          "    from dsec.control.placement import Placement\nimport dsec.shared.wire\n",
        "dsec.node.disk": "def late() -> None:\n    from ..shared import wire\n",
        "dsec.shared.wire": "def late() -> None:\n    from ..node import disk\n",
        "dsec.control.placement": "from dsec.node import edge\nfrom dsec.control import other\n",
        "dsec.control.other": "",
    }
    modules = {}
    for name, text in src.items():
        path = os.path.join(tmp_path, name.replace(".", "_") + ".py")
        with open(path, "w") as f:
            f.write(text)
        modules[name] = path
    assert _upward(modules) == ["dsec.node.edge (node) imports dsec.control.placement (control)",
                                "dsec.shared.wire (shared) imports dsec.node.disk (node)"]
