"""Learned positions shared by the batch (Hugging Face's ``position_ids`` of shape
``(1, T)``, nanoGPT's ``wpe(arange(T))``): the model broadcasts one ``(1, T, d)`` or
``(T, d)`` output against the batch, so the gradient reaching that output is the batch's
sum. The hooks expand such a call to the batch, so its factors are those of the same model
fed explicit ``(N, T)`` position ids — exactly, in the drop-in preconditioner and in
``kf.capture``, under both scalings; the model's outputs and gradients are unchanged.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from numerics import named
from torch import nn

import kfac_func as kf

F64 = torch.float64
V, T, D, N = 11, 5, 4, 3


class Positions(nn.Module):
    """``tok(ids) + pos(positions)`` then a head; ``layout`` says how positions are fed."""

    def __init__(self, layout: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tok, self.pos = nn.Embedding(V, D), nn.Embedding(T, D)
        self.head = nn.Linear(D, V)
        self.layout = layout

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = torch.arange(ids.shape[1])
        positions = {"1d": t, "broadcast": t[None], "explicit": t.expand(ids.shape[0], -1)}
        return self.head(torch.tanh(self.tok(ids) + self.pos(positions[self.layout])))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, V, (N, T), generator=g), torch.randint(0, V, (N, T), generator=g)


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, V), y.reshape(-1))


def _adapter_factors(layout: str, scaling: str) -> tuple[dict, dict]:
    model = Positions(layout).to(F64)
    pre = kf.KFACPreconditioner(
        model,
        settings=kf.Settings(scaling=scaling),
        factor_dtype=F64,
        inv_dtype=F64,
        damping=0.01,
        kl_clip=None,
    )
    x, y = _batch()
    _loss(model(x), y).backward()
    pre.step()
    factors = {n: (ls.a_factor, ls.g_factor) for n, ls in pre.state.layers.items()}
    return factors, {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("scaling", ["fisher", "kfac-pytorch"])
@pytest.mark.parametrize("layout", ["1d", "broadcast"])
def test_shared_positions_give_the_factors_of_explicit_ones(layout: str, scaling: str) -> None:
    want, want_grads = _adapter_factors("explicit", scaling)
    got, got_grads = _adapter_factors(layout, scaling)
    for name in want:
        for g, w in zip(got[name], want[name]):
            torch.testing.assert_close(g, w, rtol=1e-13, atol=1e-15, msg=named(name))
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("layout", ["1d", "broadcast"])
def test_capture_expands_shared_positions_as_the_adapter(layout: str) -> None:
    def factors(layout: str) -> dict:
        model = Positions(layout).to(F64)
        x, y = _batch()
        layers = kf.register(model)
        state = kf.init(layers, convention="fisher", factor_dtype=F64, inv_dtype=F64)
        params = dict(model.named_parameters())
        _, _, caps = kf.capture(model, params, x, lambda o: _loss(o, y), layers=layers)
        assert caps.batch_size == N
        state = kf.step.accumulate_factors(state, caps)
        return {n: (ls.a_factor, ls.g_factor) for n, ls in state.layers.items()}

    want, got = factors("explicit"), factors(layout)
    for name in want:
        for g, w in zip(got[name], want[name]):
            torch.testing.assert_close(g, w, rtol=1e-13, atol=1e-15, msg=named(name))


def test_outside_collection_the_output_keeps_its_shape() -> None:
    model = Positions("broadcast").to(F64)
    kf.KFACPreconditioner(model, factor_dtype=F64)
    seen = []
    model.pos.register_forward_hook(lambda m, a, out: seen.append(tuple(out.shape)))
    x, _ = _batch()
    with torch.no_grad():
        model(x)
    model.eval()
    model(x)
    assert seen == [(1, T, D), (1, T, D)]
