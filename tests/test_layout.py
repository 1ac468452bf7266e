"""The house rules: the math knows no ranks, and imports point one way."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "kfac_func"

# module -> package modules it may import (capture → math → state → update)
ALLOWED = {
    "_pytree": set(),
    "layers": set(),
    "conventions": set(),
    "conv_gram": set(),
    "factors": {"conv_gram", "conventions", "layers"},
    "decomposition": {"_pytree"},
    "state": {"_pytree", "conventions", "decomposition", "layers"},
    "capture": {"_pytree", "layers"},
    "update": {"capture", "conventions", "decomposition", "factors", "layers", "state"},
    # plan → distributed → kaisa (the distributed step composes the stages of update)
    "plan": {"layers"},
    "distributed": {"plan"},
    "kaisa": {
        "capture",
        "conventions",
        "decomposition",
        "distributed",
        "factors",
        "plan",
        "state",
        "update",
    },
    "adapter": {
        "decomposition",
        "distributed",
        "factors",
        "kaisa",
        "layers",
        "plan",
        "state",
        "update",
    },
    "scheduler": set(),
    # checkpoints of states (reads kfac_func.__version__ lazily)
    "serialization": {"decomposition", "layers", "state"},
    # sharded factor checkpoints: written by plan owners, committed after a collective
    "factor_files": {"decomposition", "layers", "plan", "serialization", "state"},
    # model parallelism: Megatron-style layers (no K-FAC), the per-stage plan (pure data),
    # the pure pieces of sharded layers, the collectives (no math), and the preconditioners
    "tensor_parallel": set(),
    "parallel_plan": {"layers", "plan"},
    "parallel_math": {"layers"},
    "parallel_comm": set(),
    "parallel_kfac": {
        "adapter",
        "decomposition",
        "factor_files",
        "factors",
        "layers",
        "parallel_comm",
        "parallel_math",
        "parallel_plan",
        "plan",
        "state",
        "update",
    },
    "gpt_neox": {"adapter", "parallel_kfac", "plan"},
}
MATH = [
    "layers",
    "conventions",
    "factors",
    "decomposition",
    "state",
    "capture",
    "update",
    "plan",
    "serialization",
    "parallel_plan",
    "parallel_math",
]


def _imports(module: str) -> set[str]:
    tree = ast.parse((PKG / f"{module}.py").read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


@pytest.mark.parametrize("module", sorted(ALLOWED))
def test_imports_point_one_way(module: str) -> None:
    used = {n.split(".")[1] for n in _imports(module) if n.startswith("kfac_func.")}
    assert used <= ALLOWED[module], f"{module} imports {sorted(used - ALLOWED[module])}"


@pytest.mark.parametrize("module", MATH)
def test_math_knows_no_ranks(module: str) -> None:
    assert not any("torch.distributed" in n for n in _imports(module))
    assert "torch.distributed" not in (PKG / f"{module}.py").read_text()


def test_every_module_is_covered() -> None:
    modules = {p.stem for p in PKG.glob("*.py")} - {"__init__"}
    assert modules == set(ALLOWED)
