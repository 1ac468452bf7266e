"""``loss_divisor``: a loss divided by ``k`` accumulated micro-batches (as DeepSpeed divides
it) gives the same ``"fisher"`` factors as the whole window's mean loss, in ``capture`` and
in the adapter; without it G is ``k²`` times too small."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kfac_func as kf

DT = torch.float64
K = 3


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).to(DT)


def _window() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(4 * K, 4, generator=g, dtype=DT), torch.randint(0, 3, (4 * K,), generator=g)


def _factors(state: kf.KFACState) -> list[torch.Tensor]:
    return [t for ls in state.layers.values() for t in (ls.a_factor, ls.g_factor)]


def test_capture_with_loss_divisor_matches_the_whole_window() -> None:
    model = _model()
    params = dict(model.named_parameters())
    x, y = _window()
    init = kf.init(kf.register(model), factor_dtype=DT)
    _, _, whole = kf.capture(model, params, x, lambda o: F.cross_entropy(o, y))
    want = kf.step.accumulate_factors(init, whole)
    for divisor, scale in ((K, 1.0), (1, K * K)):
        micro = []
        for xs, ys in zip(x.chunk(K), y.chunk(K)):
            _, _, caps = kf.capture(
                model, params, xs, lambda o, ys=ys: F.cross_entropy(o, ys) / K, loss_divisor=divisor
            )
            micro.append(caps)
        got = kf.step.accumulate_factors(init, micro)
        for (a, b), i in zip(zip(_factors(got), _factors(want)), range(4)):
            expect = b / scale if i % 2 else b  # G only
            torch.testing.assert_close(a, expect, rtol=1e-12, atol=1e-15)


def test_adapter_with_loss_divisor_matches_the_whole_window() -> None:
    x, y = _window()
    whole, accum = _model(), _model()
    pre_whole = kf.KFACPreconditioner(whole, settings=kf.Settings(scaling="fisher"), inv_dtype=DT)
    pre_accum = kf.KFACPreconditioner(
        accum,
        settings=kf.Settings(scaling="fisher", loss_divisor=K),
        inv_dtype=DT,
        accumulation_steps=K,
    )
    F.cross_entropy(whole(x), y).backward()
    pre_whole.step()
    for xs, ys in zip(x.chunk(K), y.chunk(K)):
        (F.cross_entropy(accum(xs), ys) / K).backward()
    pre_accum.step()
    for a, b in zip(_factors(pre_accum.state), _factors(pre_whole.state)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-15)
    for p, q in zip(accum.parameters(), whole.parameters()):
        assert p.grad is not None and q.grad is not None
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), True, "2"])
def test_bad_loss_divisor_is_refused(bad: object) -> None:
    model = _model()
    x, _ = _window()
    with pytest.raises(ValueError, match="loss_divisor must be a positive number"):
        kf.capture(model, dict(model.named_parameters()), x, lambda o: o.sum(), loss_divisor=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="loss_divisor must be a positive number"):
        kf.KFACPreconditioner(model, settings=kf.Settings(loss_divisor=bad))  # type: ignore[arg-type]
