"""The path of a step on one process: the stages of ``kfac_func.step`` and nothing of
``kfac_func.distributed``.

A profiler hook records every function of ``kfac_func`` that a step calls (after a first
step, so that nothing is built lazily on the way); the modules entered are compared with
what a one-process step needs: the adapter's hooks and step, the blocks, the core math
and the stages of ``kfac_func.step``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

import pytest
import torch
from settings_keywords import with_settings
from torch import nn

import kfac_func as kf

PACKAGE = "kfac_func/"


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 4))


def _entered(step: Callable[[], None]) -> dict[str, set[str]]:
    """``{module path under kfac_func/: the functions called}`` while ``step`` runs."""
    seen: dict[str, set[str]] = {}

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event != "call":
            return
        path = frame.f_code.co_filename.replace("\\", "/")
        if PACKAGE in path:
            module = path.rsplit(PACKAGE, 1)[1]
            seen.setdefault(module, set()).add(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        step()
    finally:
        sys.setprofile(None)
    return seen


def _stepper(model: nn.Module, opt: Any, before: Callable[[], None]) -> Callable[[], None]:
    """A training step of ``model`` (``before`` runs between backward and ``opt.step()``),
    taken once so that the traced step is not the first."""
    gen = torch.Generator().manual_seed(1)

    def step() -> None:
        x = torch.randn(32, 8, generator=gen)
        y = torch.randint(0, 4, (32,), generator=gen)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        before()
        opt.step()

    step()
    return step


def _adapter_step(**kwargs: Any) -> Callable[[], None]:
    model = _model()
    pre = kf.KFACPreconditioner(
        model, factor_update_steps=1, inv_update_steps=1, **with_settings(**kwargs)
    )
    return _stepper(model, torch.optim.SGD(model.parameters(), lr=0.1), pre.step)


def _face_step() -> Callable[[], None]:
    model = _model()
    return _stepper(model, kf.KFAC(model, lr=1e-3), lambda: None)


@pytest.mark.parametrize(
    "make",
    [
        lambda: _adapter_step(),
        lambda: _adapter_step(eigenbasis_moments=True, scaling="fisher", kl_clip=None),
        lambda: _adapter_step(grouped=False),
        lambda: _adapter_step(sync_free=True),
        _face_step,
    ],
    ids=["adapter", "adapter-moments", "adapter-per-layer", "adapter-sync-free", "face"],
)
def test_one_process_step_never_enters_distributed(make: Callable[[], Callable[[], None]]) -> None:
    step = make()
    entered = _entered(step)
    inside = {m: sorted(f) for m, f in entered.items() if m.startswith("distributed/")}
    assert not inside, inside
    # the step's stages ran: statistics, fold, decomposition, preconditioning
    assert {"step/update.py", "step/accumulate.py", "step/decompose.py", "step/grouped.py"} <= set(
        entered
    ), sorted(entered)
