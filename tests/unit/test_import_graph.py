"""The import graph of ``src/distgrad``: no cycles, and imports run one way through the layers
of docs/design.md.

What counts as an import: every ``import`` / ``from ... import`` statement anywhere in a module
-- at module level, inside functions and methods (function-local imports), and under
``if TYPE_CHECKING:``. A type-only import runs nothing, but it is still a dependency a reader
has to follow: a module that names another's types knows that module, so it counts like any
other. Where two modules truly need each other they are one module, or one of them knows the
other only through a small interface (a ``Protocol``, or a handler handed in by the one above).

An edge goes to the module an import names: ``from a.b import c`` is an edge to ``a.b.c`` when
that is a module, else to ``a.b``; relative imports are resolved. Parent packages are not
counted (Python initialises a package before its submodules; the private packages'
``__init__`` files import nothing, except the front doors below).

A package with a *front door* (:data:`FRONT_DOORS`) states in its ``__init__`` the surface the
other layers use; modules outside it import those names from the package itself, never from
the modules inside.
"""

from __future__ import annotations

import ast
import itertools
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"

#: The layers, lowest first (docs/design.md, "Layers"; the list at the top of
#: ``distgrad/__init__.py``). A module imports modules of its own layer or of lower ones only.
#: Inside ``_rpc`` each room is a layer: ``_core`` < ``_rrefs`` < ``_group`` < ``_api``.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("foundation", ("distgrad._errors", "distgrad._config", "distgrad._omp")),
    ("wire", ("distgrad._wire",)),
    ("devices", ("distgrad._devices",)),
    ("transport", ("distgrad._transport",)),
    ("rpc: agent core", ("distgrad._rpc._core",)),
    ("rpc: RRefs", ("distgrad._rpc._rrefs",)),
    ("rpc: group", ("distgrad._rpc._group",)),
    ("rpc: public functions", ("distgrad._rpc._api", "distgrad._rpc")),
    ("autograd", ("distgrad._autograd",)),
    (
        "optim, nn, profiler, observability",
        ("distgrad._optim", "distgrad._nn", "distgrad._profiler", "distgrad._observe"),
    ),
    ("testing tools (in-memory worlds)", ("distgrad._testing",)),
    (
        "public modules",
        (
            "distgrad.rpc",
            "distgrad.autograd",
            "distgrad.optim",
            "distgrad.nn",
            "distgrad.profiler",
            "distgrad.testing",
        ),
    ),
    (
        "cli and launchers",
        ("distgrad._cli", "distgrad._launcher", "distgrad._slurm", "distgrad._demo"),
    ),
    ("entry point", ("distgrad.__main__",)),
    ("the switch: distgrad stands in for torch's RPC", ("distgrad._patch",)),
    # the package's __init__ re-exports patch_torch / patched; nothing imports it by name
    ("the package", ("distgrad",)),
)


#: Packages whose ``__init__`` is the one way in from outside them.
FRONT_DOORS: tuple[str, ...] = ("distgrad._rpc._core",)


def modules(src: Path, package: str) -> dict[str, tuple[Path, bool]]:
    """Every module of ``package`` under ``src``: dotted name -> (file, is a package)."""
    found: dict[str, tuple[Path, bool]] = {}
    for path in sorted((src / package).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        found[".".join(parts)] = (path, is_package)
    return found


def _targets(
    node: ast.Import | ast.ImportFrom, name: str, is_package: bool, known: Mapping[str, object]
) -> Iterator[str]:
    if isinstance(node, ast.Import):
        for alias in node.names:
            yield alias.name
        return
    if node.level:
        base = name.split(".") if is_package else name.split(".")[:-1]
        if node.level > 1:
            base = base[: len(base) - (node.level - 1)]
        target = ".".join([*base, node.module] if node.module else base)
    else:
        target = node.module or ""
    for alias in node.names:
        candidate = f"{target}.{alias.name}"
        yield candidate if candidate in known else target


def import_graph(src: Path, package: str) -> dict[str, dict[str, int]]:
    """``{module: {imported module of the package: line of the first such import}}``."""
    known = modules(src, package)
    graph: dict[str, dict[str, int]] = {name: {} for name in known}
    for name, (path, is_package) in known.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for named in _targets(node, name, is_package, known):
                target = named
                while target not in known and "." in target:
                    target = target.rsplit(".", 1)[0]  # an attribute of a module, or a class
                if target in known and target != name:
                    graph[name].setdefault(target, node.lineno)
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) per strongly connected component of more than one
    module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        components.append(component)
    return [_cycle_in(graph, set(component)) for component in components]


def _cycle_in(graph: dict[str, dict[str, int]], component: set[str]) -> list[str]:
    """A shortest cycle through the first module of ``component`` (breadth-first)."""
    start = min(component)
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node]):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if child in component and child not in came_from:
                    came_from[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"no cycle through {start}")  # (a component always has one)


def describe(graph: dict[str, dict[str, int]], cycle: list[str]) -> str:
    hops = [f"{a} (line {graph[a][b]})" for a, b in itertools.pairwise(cycle)]
    return " -> ".join([*hops, cycle[-1]])


def layer_of(name: str) -> int:
    """The index in :data:`LAYERS` of the most specific entry naming ``name`` (``distgrad``
    itself names only the package's ``__init__``); -1 if none does."""
    best, best_len = -1, -1
    for rank, (_title, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            exact_only = prefix == "distgrad"
            if (name == prefix or (not exact_only and name.startswith(prefix + "."))) and len(
                prefix
            ) > best_len:
                best, best_len = rank, len(prefix)
    return best


def layer_violations(graph: dict[str, dict[str, int]]) -> list[str]:
    found = []
    for name, imported in sorted(graph.items()):
        for target, line in sorted(imported.items()):
            if layer_of(target) > layer_of(name):
                found.append(
                    f"{name} (layer {LAYERS[layer_of(name)][0]!r}) imports {target} "
                    f"(layer {LAYERS[layer_of(target)][0]!r}) at line {line}"
                )
    return found


def front_door_violations(
    graph: dict[str, dict[str, int]], doors: tuple[str, ...] = FRONT_DOORS
) -> list[str]:
    """Imports from outside a front-door package of a module inside it."""
    found = []
    for name, imported in sorted(graph.items()):
        for target, line in sorted(imported.items()):
            for door in doors:
                inside = name == door or name.startswith(door + ".")
                if not inside and target.startswith(door + "."):
                    found.append(f"{name} imports {target} at line {line}: import it from {door}")
    return found


GRAPH = import_graph(SRC, "distgrad")


def test_the_walk_sees_the_package() -> None:
    """The walk finds the package's modules and their imports (so an empty graph cannot pass
    the tests below by accident)."""
    assert len(GRAPH) > 90
    assert "distgrad._rpc._core._layer" in GRAPH["distgrad._rpc._core._agent"]
    # a function-local import (the demo imports the public RPC module inside a function)
    assert "distgrad.rpc" in GRAPH["distgrad._demo"]


def test_no_import_cycles() -> None:
    """No import cycle anywhere in src/distgrad: module-level, function-local and
    TYPE_CHECKING imports together."""
    found = cycles(GRAPH)
    assert not found, "import cycles:\n" + "\n".join(describe(GRAPH, c) for c in found)


def test_every_module_has_a_layer() -> None:
    """Every module of the package is placed in a layer (a new top-level module or package
    must be added to LAYERS, and to docs/design.md)."""
    unplaced = sorted(name for name in GRAPH if layer_of(name) < 0)
    assert not unplaced, f"modules in no layer of LAYERS: {unplaced}"


def test_imports_run_down_the_layers() -> None:
    """No module imports a module of a layer above its own (wire < transport < rpc core <
    RRefs < group < rpc functions < autograd < optim/nn/profiler < testing tools < public
    modules < cli < the switch < the package's __init__)."""
    found = layer_violations(GRAPH)
    assert not found, "imports against the layers:\n" + "\n".join(found)


def test_other_layers_enter_the_core_by_its_front_door() -> None:
    """Every module outside ``distgrad._rpc._core`` imports what it uses of the agent core
    from ``distgrad._rpc._core`` (whose ``__init__`` names that surface), not from the modules
    inside it."""
    found = front_door_violations(GRAPH)
    assert not found, "imports past a front door:\n" + "\n".join(found)
    # (and the walk sees the door used: the RRefs layer imports the agent through it)
    assert "distgrad._rpc._core" in GRAPH["distgrad._rpc._rrefs._rref"]


def test_the_core_front_door_names_what_it_exports() -> None:
    """The front door's ``__all__`` is exactly what it imports, and each name is there."""
    import distgrad._rpc._core as core

    tree = ast.parse((SRC / "distgrad/_rpc/_core/__init__.py").read_text())
    imported = {
        alias.asname or alias.name
        for node in tree.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    assert imported == set(core.__all__)
    assert all(hasattr(core, name) for name in core.__all__)


def test_a_front_door_violation_is_named() -> None:
    """The checker itself: a module outside a front-door package importing one of its inner
    modules is reported; the package's own modules and imports of the package are not."""
    graph = {
        "pkg.user": {"pkg.core._inner": 3, "pkg.core": 4},
        "pkg.core": {"pkg.core._inner": 1},
        "pkg.core._other": {"pkg.core._inner": 2},
    }
    (violation,) = front_door_violations(graph, ("pkg.core",))
    assert violation.startswith("pkg.user imports pkg.core._inner at line 3")


def _write(root: Path, files: dict[str, str]) -> None:
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


@pytest.mark.parametrize(
    ("b_text", "kind"),
    [
        ("def f():\n    from . import a\n", "function-local"),
        ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import X\n", "typing"),
        ("import pkg.sub.a\n", "absolute"),
    ],
)
def test_the_walk_finds_a_cycle_and_names_it(tmp_path: Path, b_text: str, kind: str) -> None:
    """The checker itself: a cycle closed by a function-local, a TYPE_CHECKING-only or an
    absolute import is found, and reported hop by hop with line numbers."""
    _write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/sub/__init__.py": "",
            "pkg/sub/a.py": "from .b import g\nX = 1\n",
            "pkg/sub/b.py": b_text,
            "pkg/sub/c.py": "from . import a\n",  # reaches the cycle, not part of it
        },
    )
    graph = import_graph(tmp_path, "pkg")
    found = cycles(graph)
    assert found == [["pkg.sub.a", "pkg.sub.b", "pkg.sub.a"]], kind
    assert describe(graph, found[0]).startswith("pkg.sub.a (line 1) -> pkg.sub.b (line ")


def test_a_layer_violation_is_named() -> None:
    """The checker itself: an import of a higher layer is reported with both layers."""
    graph = {"distgrad._wire._frames": {"distgrad._rpc._core._agent": 7}}
    (violation,) = layer_violations(graph)
    assert "'wire'" in violation and "'rpc: agent core'" in violation and "line 7" in violation
