"""The package's modules import each other in one direction: no import circle among ``pipesched.*``.

Every import counts, at module level or inside a function (a function-level import hides a circle; it
does not remove it). An import of a package counts as an import of its ``__init__``; the implicit
import of a module's parent packages does not.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO

ROOTS = {
    "pipesched": REPO / "pipesched",
    "pipesched.optimizer": REPO / "optimizer",
    "pipesched.runtime": REPO / "runtime",
    "pipesched.api": REPO / "api",
}


def package_modules() -> dict[str, Path]:
    """Every module of the installed package, by dotted name."""
    modules: dict[str, Path] = {}
    for prefix, root in ROOTS.items():
        for path in root.rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join([prefix, *parts])] = path
    return modules


def import_graph() -> dict[str, set[str]]:
    """Module → the package modules it imports."""
    modules = package_modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = name.split(".") if is_package else name.split(".")[:-1]
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join([*anchor, *([base] if base else [])])
                for alias in node.names:
                    submodule = f"{base}.{alias.name}"
                    targets.append(submodule if submodule in modules else base)
            for target in targets:
                if target in modules and target != name:
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph[node]):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_graph_sees_the_package() -> None:
    graph = import_graph()
    assert "pipesched.optimizer.solve" in graph["pipesched"]
    assert "pipesched.optimizer.problem" in graph["pipesched.optimizer.solve"]


def test_no_import_circle_among_the_package_modules() -> None:
    assert cycles(import_graph()) == []


def test_a_circle_is_caught() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def room_of(module: str) -> str:
    """The room a module lives in: ``pipesched.<package>.<subfolder or top module>``; a package's ``__init__`` is a
    room of its own (``pipesched``, ``pipesched.optimizer`` …)."""
    parts = module.split(".")
    return ".".join(parts[:3])


def room_graph() -> dict[str, set[str]]:
    """Room → the other rooms its modules import (module edges lifted to rooms, edges inside a room dropped)."""
    rooms: dict[str, set[str]] = {}
    for module, targets in import_graph().items():
        room = room_of(module)
        rooms.setdefault(room, set()).update(room_of(t) for t in targets if room_of(t) != room)
    return rooms
