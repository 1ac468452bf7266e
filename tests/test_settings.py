"""``kf.Settings``: kfac-pytorch's signature stays small, the rest is one value.

``KFACPreconditioner`` names kfac-pytorch 0.4.2's arguments with their defaults and takes
everything else as ``settings=kf.Settings(...)``. A setting given as a keyword of its own
still works for one release: it warns, naming itself and its replacement, and the
preconditioner is the one the settings value builds. Given both ways it is refused. The
optimizer face and its recipes use the settings value, so that ``kf.KFAC(model)`` warns
about nothing.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import warnings
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kfac_func as kf
from kfac_func.adapter.settings import PARALLEL_SETTINGS, SETTINGS
from kfac_func.parallel.layers import ColumnParallelLinear
from kfac_func.parallel.preconditioner import ParallelKFACPreconditioner

KFAC_PYTORCH = {
    "model": inspect.Parameter.empty,
    "factor_update_steps": 1,
    "inv_update_steps": 1,
    "damping": 0.001,
    "factor_decay": 0.95,
    "kl_clip": 0.001,
    "lr": 0.1,
    "accumulation_steps": 1,
    "allreduce_bucket_cap_mb": 25.0,
    "assignment_strategy": "COMPUTE",
    "colocate_factors": True,
    "compute_method": "EIGEN",
    "compute_eigenvalue_outer_product": True,
    "grad_worker_fraction": "COMM_OPT",
    "symmetry_aware": False,
    "grad_scaler": None,
    "factor_dtype": None,
    "inv_dtype": torch.float32,
    "skip_layers": None,
    "update_factors_in_hook": True,
    "loglevel": logging.DEBUG,
}
"""kfac-pytorch 0.4.2's ``KFACPreconditioner`` arguments and defaults (enum members by
name)."""


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))


def _grads(pre: kf.KFACPreconditioner, model: nn.Module, steps: int = 3) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        x, y = torch.randn(16, 5, generator=gen), torch.randint(0, 3, (16,), generator=gen)
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        pre.step()
        out += [p.grad.clone() for p in model.parameters() if p.grad is not None]
    return out


def test_the_signature_is_kfac_pytorchs_and_the_settings() -> None:
    params = inspect.signature(kf.KFACPreconditioner).parameters
    assert len(params) <= 25, list(params)
    for name, default in KFAC_PYTORCH.items():
        got = params[name].default
        assert getattr(got, "name", got) == default, name
    assert set(params) - set(KFAC_PYTORCH) == {"settings"}
    assert params["settings"].default is None


def test_every_setting_is_documented_field_by_field() -> None:
    doc = inspect.getdoc(kf.Settings) or ""
    for name in SETTINGS:
        assert f"\n    {name}" in doc.split("Attributes:")[1] or f", {name}:" in doc, name


@pytest.mark.parametrize(
    "given",
    [
        {"scaling": "fisher"},
        {"eigenbasis_moments": True, "moment_beta2": 0.95, "moment_beta1": 0.5},
        {"moment_eps": 1e-6, "grouped": False},
        {"sync_free": True, "batched_eigh": True},
    ],
    ids=lambda g: "+".join(g),
)
def test_an_old_keyword_warns_and_builds_what_the_settings_value_builds(
    given: dict[str, Any],
) -> None:
    model, twin = _model(), _model()
    for name in given:
        with pytest.warns(DeprecationWarning, match=rf"\({name}=\.\.\.\) is deprecated") as w:
            kf.KFACPreconditioner(_model(), **{name: given[name]})
        assert f"settings=kf.Settings({name}=...)" in str(w[0].message)
        assert w[0].filename == __file__  # attributed to the caller
    with pytest.warns(DeprecationWarning):
        old = kf.KFACPreconditioner(model, damping=0.01, kl_clip=None, **given)
    new = kf.KFACPreconditioner(twin, damping=0.01, kl_clip=None, settings=kf.Settings(**given))
    assert old.settings == new.settings
    assert all(getattr(old, k) == getattr(new, k) for k in given)
    for a, b in zip(_grads(old, model), _grads(new, twin), strict=True):
        assert torch.equal(a, b)


def test_a_setting_given_both_ways_is_refused() -> None:
    with pytest.raises(ValueError, match=r"\['scaling'\] given both as keywords and in settings="):
        kf.KFACPreconditioner(
            _model(), scaling="fisher", settings=kf.Settings(scaling="fisher", grouped=False)
        )
    with warnings.catch_warnings():  # other settings in each place: one value
        warnings.simplefilter("ignore", DeprecationWarning)
        pre = kf.KFACPreconditioner(_model(), grouped=False, settings=kf.Settings(scaling="fisher"))
    assert pre.settings == kf.Settings(scaling="fisher", grouped=False)
    with pytest.raises(TypeError, match=r"settings must be a kfac_func\.Settings"):
        kf.KFACPreconditioner(_model(), settings={"scaling": "fisher"})  # type: ignore[arg-type]


def test_the_face_and_every_recipe_warn_about_nothing() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for recipe in kf.RECIPES:
            opt = kf.KFAC(_model(), recipe=recipe)
            assert opt.preconditioner.settings.scaling == (
                "kfac-pytorch" if recipe == "kfac-pytorch" else "fisher"
            )
        # the face reads the settings' own keywords as overrides of its recipe
        opt = kf.KFAC(_model(), eigenbasis_refresh="qr", grouped=False)
    settings = opt.preconditioner.settings
    assert settings.eigenbasis_refresh == "qr" and not settings.grouped
    assert settings.eigenbasis_moments and settings.scaling == "fisher"  # the recipe's
    assert settings.orthogonal == kf.RECIPES["recommended"].settings.orthogonal._replace(
        dtype=settings.orthogonal.dtype
    )
    mine = kf.Settings(scaling="kfac-pytorch")
    assert kf.KFAC(_model(), settings=mine).preconditioner.settings.scaling == "kfac-pytorch"
    with pytest.raises(ValueError, match=r"\['grouped'\] given both"):
        kf.KFAC(_model(), settings=kf.Settings(grouped=False), grouped=True)


def test_the_parallel_preconditioners_take_their_settings_only() -> None:
    model = nn.Sequential(ColumnParallelLinear(4, 6), nn.Linear(6, 2))
    pre = ParallelKFACPreconditioner(model, settings=kf.Settings(scaling="fisher"))
    assert pre.scaling == "fisher" and "scaling" in PARALLEL_SETTINGS
    with pytest.raises(ValueError, match=r"does not take the settings \['eigenbasis_moments'\]"):
        ParallelKFACPreconditioner(model, settings=kf.Settings(eigenbasis_moments=True))
    with pytest.raises(TypeError, match="unexpected keyword argument 'eigenbasis_moments'"):
        ParallelKFACPreconditioner(model, eigenbasis_moments=True)


def test_settings_are_checked_when_made() -> None:
    with pytest.raises(ValueError, match="pass sync_free=True as well"):
        kf.Settings(compile=True)
    with pytest.raises(TypeError, match="grouped must be a bool"):
        kf.Settings(grouped=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="moment_beta2"):
        kf.Settings(eigenbasis_moments=True, moment_beta2=1.0)
    with pytest.raises(TypeError, match=r"adaptive must be a kfac_func\.adapter\.AdaptiveStepper"):
        kf.Settings(adaptive=object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="collective_timeout must be a positive"):
        kf.Settings(collective_timeout=30)  # type: ignore[arg-type]
    assert kf.Settings(collective_timeout=timedelta(seconds=30)).named() == {"collective_timeout"}
    with pytest.raises(dataclasses.FrozenInstanceError):
        kf.Settings().grouped = False  # type: ignore[misc]
