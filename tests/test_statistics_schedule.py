"""The recommended recipe's statistics schedule: factor statistics every step while the run
is young, every other step once it is long (``GrowingInterval(first=1, ...)``), with the
factor decay that keeps the same memory per step (``DecayPerStep``).

The oracle is a running average written out here over the batch factors of the steps
that gather statistics, each batch factor read from a twin preconditioner that keeps only
its latest batch (``factor_decay=0``) and gathers every step; neither twin moves the
weights, so both see the same layer inputs and output gradients.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import kfac_func as kf

F64 = torch.float64
SCHEDULE = kf.step.GrowingInterval(first=1, until=4, most=2)  # every step to 4, then every 2


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).to(F64)


def _factors(
    factor_update_steps: object, factor_decay: object, steps: int
) -> list[dict[str, tuple[torch.Tensor, torch.Tensor, int]]]:
    """``(A, G, factor updates)`` of every layer after each of ``steps`` steps."""
    model = _model()
    pre = kf.KFACPreconditioner(
        model,
        factor_update_steps=factor_update_steps,
        inv_update_steps=1,
        factor_decay=factor_decay,
        damping=1e-2,
        kl_clip=None,
        settings=kf.Settings(scaling="fisher"),  # the first update takes the batch's factors
    )
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        x = torch.randn(7, 5, generator=g, dtype=F64)
        model.zero_grad()
        model(x).pow(2).sum().backward()
        pre.step()  # preconditions the gradients; no optimizer: the weights stay put
        out.append(
            {
                n: (ls.a_factor.clone(), ls.g_factor.clone(), ls.factor_updates)
                for n, ls in pre.state.layers.items()
            }
        )
    return out


def test_decay_per_step_keeps_the_memory_in_steps() -> None:
    decay = kf.step.DecayPerStep(0.9, SCHEDULE)
    assert [SCHEDULE(t) for t in range(8)] == [1, 1, 1, 1, 2, 2, 2, 2]
    assert [round(decay(t), 4) for t in (0, 3, 4, 7)] == [0.9, 0.9, 0.81, 0.81]
    assert kf.step.DecayPerStep(0.9, 3)(10) == pytest.approx(0.729)


def test_statistics_thin_on_the_schedule_with_the_decay_per_step() -> None:
    steps = 9
    decay = kf.step.DecayPerStep(0.9, SCHEDULE)
    got = _factors(SCHEDULE, decay, steps)
    latest = _factors(1, 0.0, steps)  # each step's batch factors
    gathered = [t for t in range(steps) if t % SCHEDULE(t) == 0]
    assert gathered == [0, 1, 2, 3, 4, 6, 8]
    for name in got[0]:
        a = g = None
        for t in range(steps):
            if t in gathered:
                ba, bg, _ = latest[t][name]
                d = decay(t)
                a = ba if a is None else d * a + (1 - d) * ba
                g = bg if g is None else d * g + (1 - d) * bg
            ga, gg, updates = got[t][name]
            assert updates == sum(1 for s in gathered if s <= t), (name, t)
            torch.testing.assert_close(ga, a, rtol=1e-12, atol=1e-14)
            torch.testing.assert_close(gg, g, rtol=1e-12, atol=1e-14)


def test_the_recommended_recipe_thins_its_statistics_from_step_256() -> None:
    recipe = kf.RECIPES["recommended"].kfac_kwargs
    every, decay = recipe["factor_update_steps"], recipe["factor_decay"]
    assert [every(t) for t in (0, 255, 256, 511, 512, 10_000)] == [1, 1, 2, 2, 4, 4]
    assert [decay(t) for t in (0, 255)] == [0.9, 0.9]
    assert decay(256) == pytest.approx(0.81)
    assert decay(512) == pytest.approx(0.9**4)
    # 756 of 2,000 steps gather statistics (1,128 at every other step from step 256)
    assert sum(t % every(t) == 0 for t in range(2000)) == 756
    # every step that decomposes has fresh statistics
    inv = recipe["inv_update_steps"]
    assert all(t % every(t) == 0 for t in range(5000) if t % inv(t) == 0)
