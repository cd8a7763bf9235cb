"""Imports run one way between the packages: this test reads every import (inside functions too) of lm_systems/,
strategies/ and callbacks/ and fails on a package importing one built on top of it, or on a cycle between folders
(lm_systems' own modules each count as one)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("lm_systems", "strategies", "callbacks")
FORBIDDEN = {
    "lm_systems": {"strategies", "callbacks"},  # train.py hands them in
    "strategies": {"callbacks"},
    "callbacks": {"strategies"},
}


def folder_of(module: str) -> str:
    """The node a dotted module counts as: its package folder (``lm_systems.parallel.bucketed`` →
    ``lm_systems.parallel``, ``strategies.zero1`` → ``strategies``), except in lm_systems' own folder, whose modules
    are layers of their own (``lm_systems.cli`` at the top, ``lm_systems.errors`` at the bottom) and count singly;
    a module outside the three packages keeps its top-level name."""
    parts = module.split(".")
    for depth in range(len(parts), 0, -1):
        path = REPO.joinpath(*parts[:depth])
        if path.is_dir() and (path / "__init__.py").exists():
            if depth == 1 and parts[0] == "lm_systems" and len(parts) > 1 and (path / f"{parts[1]}.py").exists():
                return ".".join(parts[:2])
            return ".".join(parts[:depth])
    return parts[0]


def imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, as absolute dotted names."""
    package = ".".join(path.relative_to(REPO).with_suffix("").parts[:-1])
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)  # `from pkg import submodule`
    return found


def folder_graph() -> dict[str, set[str]]:
    """Package folder → the other package folders of this project its modules import."""
    graph: dict[str, set[str]] = {}
    for top in PACKAGES:
        for path in (REPO / top).rglob("*.py"):
            here = folder_of(".".join(path.relative_to(REPO).with_suffix("").parts))
            edges = graph.setdefault(here, set())
            for module in imported_modules(path):
                there = folder_of(module)
                if there.split(".")[0] in PACKAGES and there != here:
                    edges.add(there)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as the folders along it, or None."""
    state: dict[str, str] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node], _ = "open", path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node], _ = "done", path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


@pytest.mark.parametrize("package", PACKAGES)
def test_no_package_imports_one_built_on_top_of_it(package):
    above = {
        there
        for here, edges in folder_graph().items()
        if here.split(".")[0] == package
        for there in edges
        if there.split(".")[0] in FORBIDDEN[package]
    }
    assert not above, f"{package} imports {sorted(above)}: hand them in from train.py instead"


def test_no_import_cycle_between_folders():
    cycle = find_cycle(folder_graph())
    assert cycle is None, f"an import cycle between folders: {' → '.join(cycle)}"


def test_the_cycle_finder_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
