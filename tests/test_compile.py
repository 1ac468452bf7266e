"""``torch.compile(fullgraph=True)`` of the precondition-only step (``sync_free=True``) and
of ``precondition_grads``: one graph (``fullgraph=True`` raises at any graph break), the
same results as eager up to the rounding of the compiled kernels.

The first compilation in a process takes 10-20 s on this CPU: these tests are slow.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from numerics import named
from torch import nn

import kfac_func as kf

pytestmark = pytest.mark.slow

NAN = float("nan")


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)
    )


def _state() -> tuple[kf.KFACState, dict[str, torch.Tensor]]:
    model = _mlp()
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 6, generator=gen), torch.randint(0, 3, (32,), generator=gen)
    params = dict(model.named_parameters())
    _, grads, caps = kf.capture(model, params, x, lambda out: F.cross_entropy(out, y))
    _, state = kf.update(kf.init(kf.register(model)), grads, captures=caps, damping=1e-2)
    return state, grads


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-8, equal_nan=True, msg=named(k))


def test_compiled_precondition_only_update_equals_eager() -> None:
    state, grads = _state()

    def step(s: kf.KFACState, g: dict[str, torch.Tensor]) -> Any:
        return kf.update(
            s,
            g,
            damping=1e-2,
            kl_clip=1e-3,
            update_factors=False,
            update_inverses=False,
            sync_free=True,
        )

    compiled = torch.compile(step, fullgraph=True)
    bad = dict(grads)
    bad["2.bias"] = torch.full_like(grads["2.bias"], NAN)
    for g in (grads, bad):  # the same guards: one compilation
        got, got_state = compiled(state, g)
        want, want_state = step(state, g)
        _close(got, want)
        assert got_state.step == want_state.step == state.step + 1
        for name, ls in want_state.layers.items():
            assert torch.equal(got_state.layers[name].grad_skips, ls.grad_skips), name  # type: ignore[arg-type]
    assert not torch.equal(got["0.weight"], grads["0.weight"])
    torch.testing.assert_close(got["2.weight"], bad["2.weight"], rtol=0, atol=0)


def test_compiled_precondition_grads_equals_eager() -> None:
    state, grads = _state()

    def fn(s: kf.KFACState, g: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return kf.step.precondition_grads(s, g, damping=1e-2, kl_clip=1e-3, sync_free=True)

    _close(torch.compile(fn, fullgraph=True)(state, grads), fn(state, grads))


def test_adapter_compile_equals_eager() -> None:
    gen = torch.Generator().manual_seed(2)
    x, y = torch.randn(32, 6, generator=gen), torch.randint(0, 3, (32,), generator=gen)
    runs = []
    for compile in (False, True):
        model = _mlp()
        pre = kf.KFACPreconditioner(
            model,
            factor_update_steps=2,
            inv_update_steps=2,
            settings=kf.Settings(sync_free=True, compile=compile),
        )
        grads = []
        for i in range(3):  # step 1 only preconditions (compiled)
            F.cross_entropy(model(x * (1 + 0.1 * i)), y).backward()
            pre.step()
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()})  # type: ignore[union-attr]
            model.zero_grad()
        runs.append(grads)
    for eager, compiled in zip(*runs):
        _close(compiled, eager)


@pytest.mark.slow
def test_adapter_compile_follows_hyperparameter_schedules() -> None:
    """A learning rate and a damping that change every step: the compiled precondition-only
    steps are handed the values of their step (a changed value is symbolic in the compiled
    graph, where the checks on the host cannot run) and equal eager ones."""

    def run(compile: bool) -> list[list[torch.Tensor]]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        pre = kf.KFACPreconditioner(
            model, settings=kf.Settings(compile=compile, sync_free=True),
            lr=lambda k: 0.1 / (k + 1), damping=lambda k: 0.01 * (1 + k),
            factor_update_steps=3, inv_update_steps=3,
        )  # fmt: skip
        out = []
        for i in range(7):
            model.zero_grad()
            x = torch.randn(16, 4, generator=torch.Generator().manual_seed(i))
            model(x).pow(2).mean().backward()
            pre.step()
            out.append([p.grad.clone() for p in model.parameters()])
        return out

    for eager, compiled in zip(run(False), run(True)):
        for e, c in zip(eager, compiled):
            torch.testing.assert_close(c, e, rtol=1e-5, atol=1e-6)
