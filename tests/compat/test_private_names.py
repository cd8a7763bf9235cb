"""No private name of Lightning, torch or Triton outside lm_systems/compat: the project's sources are read (not
grepped) for imports of private modules or names, private attributes of objects that are not the code's own, and
private members of a framework class that a subclass of it overrides, calls or reads through ``self``."""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SOURCES = sorted(
    path
    for path in [
        REPO / "train.py",
        *(p for d in ("lm_systems", "strategies", "callbacks") for p in (REPO / d).rglob("*.py")),
    ]
    if "compat" not in path.relative_to(REPO).parts
)
FRAMEWORKS = ("lightning", "pytorch_lightning", "lightning_fabric", "lightning_utilities", "torch", "triton")
DOCUMENTED = {"os._exit"}
"""Standard-library names that begin with an underscore and are documented, public API."""


def private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def framework(module: str) -> bool:
    return module.split(".")[0] in FRAMEWORKS


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")


def private_imports(tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and framework(node.module):
            names = [alias.name for alias in node.names]
            if any(map(private, node.module.split("."))) or any(map(private, names)):
                found.append(f"line {node.lineno}: from {node.module} import {', '.join(names)}")
        elif isinstance(node, ast.Import):
            found += [
                f"line {node.lineno}: import {alias.name}"
                for alias in node.names
                if framework(alias.name) and any(map(private, alias.name.split(".")))
            ]
    return found


def own_private_names(tree: ast.AST) -> set[str]:
    """Private names this module defines itself: functions, classes, methods, module globals and attributes it
    assigns."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return {name for name in names if private(name)}


def framework_bases(cls: type) -> list[type]:
    return [base for base in cls.__mro__[1:] if framework(base.__module__)]


@functools.cache
def source_of(cls: type) -> str:
    try:
        return inspect.getsource(cls)
    except (OSError, TypeError):
        return ""


def defined_by(bases: list[type], name: str) -> bool:
    """Whether a framework base class has ``name``: as a class member, or as an attribute its methods assign."""
    return any(
        name in vars(base) or f"self.{name} =" in source_of(base) or f"self.{name}:" in source_of(base)
        for base in bases
    )


def private_members_of_framework_bases(path: Path, tree: ast.AST) -> list[str]:
    module = importlib.import_module(module_name(path))
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ClassDef) or not isinstance(getattr(module, node.name, None), type):
            continue
        bases = framework_bases(getattr(module, node.name))
        if not bases:
            continue
        for inner in ast.walk(node):
            if (
                isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef))
                and private(inner.name)
                and defined_by(bases, inner.name)
            ):
                found.append(f"line {inner.lineno}: {node.name} overrides {inner.name}")
            elif (
                isinstance(inner, ast.Attribute)
                and private(inner.attr)
                and (
                    isinstance(inner.value, ast.Name)
                    and inner.value.id in ("self", "cls")
                    or isinstance(inner.value, ast.Call)
                    and getattr(inner.value.func, "id", None) == "super"
                )
                and defined_by(bases, inner.attr)
            ):
                found.append(f"line {inner.lineno}: {node.name} uses {inner.attr}")
    return found


def private_attributes_of_others(tree: ast.AST) -> list[str]:
    """``x._name`` (or ``getattr(x, "_name")`` and its siblings) where ``x`` is not ``self``/``cls``/``super()`` and no
    code of this module defines ``_name``."""
    own = own_private_names(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and private(node.attr) and node.attr not in own:
            if ast.unparse(node) in DOCUMENTED:
                continue
            receiver = node.value
            if isinstance(receiver, ast.Name) and receiver.id in ("self", "cls"):
                continue
            if isinstance(receiver, ast.Call) and getattr(receiver.func, "id", None) == "super":
                continue
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in (
            "getattr",
            "hasattr",
            "setattr",
            "delattr",
        ):
            name = node.args[1] if len(node.args) >= 2 else None
            if not (isinstance(name, ast.Constant) and isinstance(name.value, str)):
                continue
            if private(name.value) and name.value not in own:
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


@pytest.mark.parametrize("path", SOURCES, ids=lambda path: str(path.relative_to(REPO)))
def test_no_private_framework_name_outside_compat(path):
    tree = ast.parse(path.read_text(), filename=str(path))
    found = [
        *private_imports(tree),
        *private_attributes_of_others(tree),
        *private_members_of_framework_bases(path, tree),
    ]
    assert not found, (
        f"{path.relative_to(REPO)} uses private names of Lightning, torch or Triton; put each behind "
        "an adapter in lm_systems/compat (with a test in tests/compat):\n  " + "\n  ".join(found)
    )
