"""The top-level namespace in tiers: ``kfac_func`` holds what a training loop needs (the
optimizer face, the drop-in preconditioner, the functional loop, checkpoints, and the errors
and warnings these raise); the rest is in the subpackages. A name that left the top level
still resolves there for one release, with a ``DeprecationWarning`` naming its new place,
and is the very object its subpackage exports.
"""

from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys
import warnings
from types import ModuleType

import pytest

import kfac_func as kf

#: the top tier: what ``kf.`` offers without a warning
TOP = {
    "KFAC",
    "RECIPES",
    "Recipe",
    "Orthogonal",
    "KFACPreconditioner",
    "Settings",
    "ComputeMethod",
    "register",
    "LayerTable",
    "init",
    "KFACState",
    "KFACConfig",
    "capture",
    "Captures",
    "update",
    "decompose",
    "StepOptions",
    "save_state",
    "load_state",
    "state_to_dict",
    "state_from_dict",
    "save_dcp",
    "load_dcp",
    "CheckpointError",
    "NonFiniteError",
    "MissingStatisticsWarning",
    "FallbackWarning",
    "BatchSizeError",
    "DecompositionError",
    "__version__",
}

SUBPACKAGES = ("adapter", "blocks", "checkpoint", "core", "distributed", "parallel", "step")


def test_the_top_level_is_the_top_tier() -> None:
    assert set(kf.__all__) == TOP
    assert len(kf.__all__) == len(set(kf.__all__)) <= 30


def test_top_tier_names_do_not_warn() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in kf.__all__:
            getattr(kf, name)
        for sub in SUBPACKAGES:
            getattr(kf, sub)


def test_importing_the_package_warns_nothing() -> None:
    result = subprocess.run(
        [sys.executable, "-W", "error::DeprecationWarning", "-c", "import kfac_func"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("name", sorted(kf.MOVED))
def test_a_moved_name_resolves_with_a_warning_naming_its_place(name: str) -> None:
    module = importlib.import_module(kf.MOVED[name])
    assert name not in kf.__all__
    with pytest.warns(DeprecationWarning, match=rf"moved to {kf.MOVED[name]}\.{name};") as got:
        old = getattr(kf, name)
    assert len(got) == 1 and got[0].filename == __file__  # attributed to the caller
    assert old is getattr(module, name)


@pytest.mark.parametrize("name", sorted(kf.MOVED))
def test_a_moved_name_imports_from_its_new_place(name: str) -> None:
    module_name = kf.MOVED[name]
    namespace: dict[str, object] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        exec(f"from {module_name} import {name}", namespace)
    assert namespace[name] is getattr(importlib.import_module(module_name), name)
    module = importlib.import_module(module_name)
    assert name in getattr(module, "__all__", ())


def test_from_imports_of_moved_names_still_work() -> None:
    with pytest.warns(DeprecationWarning, match=r"kfac_func\.make_plan moved to"):
        from kfac_func import make_plan
    assert make_plan is kf.distributed.make_plan


def test_the_table_covers_what_left_and_nothing_else() -> None:
    assert not set(kf.MOVED) & TOP
    assert set(kf.MOVED) <= set(dir(kf))
    for module_name in set(kf.MOVED.values()):
        assert module_name.startswith("kfac_func.")
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        kf.no_such_name  # noqa: B018


@pytest.mark.parametrize("sub", SUBPACKAGES)
def test_subpackage_names_do_not_shadow_their_modules(sub: str) -> None:
    """``import kfac_func.SUB.X as m`` gives the module X: no name a subpackage exports is
    the name of one of its modules (``decompose`` and ``update`` stay at the top level)."""
    package = importlib.import_module(f"kfac_func.{sub}")
    modules = {m.name for m in pkgutil.iter_modules(package.__path__)}
    assert not modules & set(package.__all__)
    for name in modules:
        assert isinstance(getattr(package, name, ModuleType("unloaded")), ModuleType), name
