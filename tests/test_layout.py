"""The house rules: imports point one way, the math knows no ranks, the adapters and the
distributed code own no math, and modules stay small.

Units are the packages of ``kfac_func`` (``blocks``, ``core``, ``step``, ``distributed``,
``checkpoint``, ``adapter``, ``parallel``) and the top-level modules ``state`` and
``captures``. Arrows (what a unit may import besides itself):

    blocks → core → state, captures → step → distributed → adapter → parallel
                                           ↘ checkpoint ↗
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "kfac_func"

# unit -> units it may import
ALLOWED: dict[str, set[str]] = {
    "blocks": set(),
    "core": {"blocks"},
    "state": {"blocks", "core"},
    "captures": {"blocks", "core"},
    "step": {"blocks", "captures", "core", "state"},
    "distributed": {"blocks", "captures", "core", "state", "step"},
    "checkpoint": {"blocks", "core", "distributed", "state"},
    # the adapter's state dicts carry the checkpoint unit's checksums
    "adapter": {"blocks", "captures", "checkpoint", "core", "distributed", "state", "step"},
    "parallel": {
        "adapter",
        "blocks",
        "captures",
        "checkpoint",
        "core",
        "distributed",
        "state",
        "step",
    },
}
# finer rules inside a unit: module -> kfac_func modules it may import (prefixes)
NARROW: dict[str, set[str]] = {
    # the plan is pure data: it reads layer shapes
    "distributed.plan": {"blocks"},
    # the communicator moves tensors as the plan says; it knows no K-FAC
    "distributed.communicator": {"distributed.plan"},
    "distributed.reducer": {"distributed.communicator"},
    # checkpoints of states read the plan, never the communicator or the KAISA step
    "checkpoint": {"blocks", "checkpoint", "core", "distributed.plan", "state"},
    # the Megatron-style layers and the model-parallel collectives know no K-FAC
    "parallel.layers": set(),
    "parallel.comm": set(),
}
# modules that must not know ranks (no torch.distributed)
NO_RANKS = [
    "blocks",
    "core",
    "state",
    "captures",
    "step",
    "distributed.plan",
    "checkpoint.checksums",
    "checkpoint.errors",
    "checkpoint.factor_manifest",
    "checkpoint.state_dict",
    "checkpoint.state_files",
    "checkpoint.state_format",
    "parallel.plan",
    "parallel.shards",
]
# modules that call the math but hold none of it (no matrix products, no linear algebra)
NO_MATH = ["adapter", "distributed", "checkpoint", "parallel"]
MAX_LINES = 500


def _module(path: Path) -> str:
    rel = path.relative_to(PKG).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    return ".".join(parts)


MODULES = {_module(p): p for p in sorted(PKG.rglob("*.py")) if _module(p)}


def _unit(module: str) -> str:
    return module.split(".")[0]


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def _package_imports(path: Path) -> set[str]:
    return {n[len("kfac_func.") :] for n in _imports(path) if n.startswith("kfac_func.")}


def _rule(module: str) -> tuple[str, set[str]] | None:
    """The narrowest rule that applies to ``module``."""
    keys = [k for k in NARROW if _under(module, k)]
    if keys:
        key = max(keys, key=len)
        return key, NARROW[key]
    return None


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_one_way(module: str) -> None:
    unit = _unit(module)
    used = _package_imports(MODULES[module])
    outside = {m for m in used if _unit(m) != unit}
    bad = sorted(m for m in outside if _unit(m) not in ALLOWED[unit])
    assert not bad, f"{module} ({unit}) imports {bad}; {unit} may import {sorted(ALLOWED[unit])}"
    rule = _rule(module)
    if rule is not None:
        key, allowed = rule
        bad = sorted(m for m in used if not any(_under(m, a) for a in allowed | {key}))
        assert not bad, f"{module} imports {bad}; {key} may import {sorted(allowed)}"


def _select(prefixes: list[str]) -> list[str]:
    return sorted(m for m in MODULES if any(_under(m, p) for p in prefixes))


@pytest.mark.parametrize("module", _select(NO_RANKS))
def test_math_knows_no_ranks(module: str) -> None:
    path = MODULES[module]
    assert not any("torch.distributed" in n for n in _imports(path))
    assert "torch.distributed" not in path.read_text()


class _MathFinder(ast.NodeVisitor):
    def __init__(self) -> None:
        self.found: list[str] = []

    def visit_BinOp(self, node: ast.BinOp) -> None:
        if isinstance(node.op, ast.MatMult):
            self.found.append(f"line {node.lineno}: matrix product")
        self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        dotted = ast.unparse(node)
        if dotted.startswith("torch.linalg") or node.attr in ("mm", "bmm", "matmul", "einsum"):
            self.found.append(f"line {node.lineno}: {dotted}")
        self.generic_visit(node)


@pytest.mark.parametrize("module", _select(NO_MATH))
def test_adapters_and_distribution_own_no_math(module: str) -> None:
    finder = _MathFinder()
    finder.visit(ast.parse(MODULES[module].read_text()))
    assert not finder.found, f"{module} does math itself: {finder.found}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_modules_stay_small(module: str) -> None:
    lines = len(MODULES[module].read_text().splitlines())
    assert lines <= MAX_LINES, f"{module} has {lines} lines (at most {MAX_LINES})"


def test_every_module_belongs_to_a_unit() -> None:
    assert {_unit(m) for m in MODULES} == set(ALLOWED)


def test_package_attributes_do_not_shadow_modules() -> None:
    """``import kfac_func.X as m`` gives a module for every submodule X: no public name of
    the package has the name of one of its modules."""
    import kfac_func

    top = {m.split(".")[0] for m in MODULES}
    assert not top & set(kfac_func.__all__)


def _kind_comparisons(tree: ast.AST) -> list[int]:
    """Lines that compare a ``.kind`` attribute with a string literal."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            kinds = any(isinstance(s, ast.Attribute) and s.attr == "kind" for s in sides)
            literal = any(isinstance(s, ast.Constant) and isinstance(s.value, str) for s in sides)
            if kinds and literal:
                lines.append(node.lineno)
    return lines


@pytest.mark.parametrize("module", sorted(m for m in MODULES if _unit(m) != "blocks"))
def test_only_blocks_know_layer_kinds(module: str) -> None:
    """Kind-specific behaviour lives in the kind's block: nothing else branches on it."""
    found = _kind_comparisons(ast.parse(MODULES[module].read_text()))
    assert not found, f"{module} compares a layer kind with a string on lines {found}"
