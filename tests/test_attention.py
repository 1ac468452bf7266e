"""``nn.MultiheadAttention`` (:mod:`kfac_func.blocks.attention`): its q, k, v and output
projections as Linear layers, checked in float64 against attention written out here.

The oracle re-states the attention forward with explicit projections (``x @ Wᵀ + b``,
heads, softmax, output projection) and differentiates it with autograd, so the inputs and
output-gradients of every projection are known without the library; K-FAC's factors must
be the expand-convention Grams of those rows, and, with one query position and one example
(one row per q and output projection), ``G ⊗ A`` is the layer's exact Fisher.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kfac_func as kf

DT = torch.float64
E, H = 6, 2


def _mha(kdim: int | None = None, bias: bool = True) -> nn.MultiheadAttention:
    torch.manual_seed(0)
    return nn.MultiheadAttention(E, H, bias=bias, kdim=kdim, vdim=kdim, batch_first=True).to(DT)


def _weights(m: nn.MultiheadAttention) -> dict[str, torch.Tensor]:
    if m._qkv_same_embed_dim:
        wq, wk, wv = m.in_proj_weight.chunk(3)
    else:
        wq, wk, wv = m.q_proj_weight, m.k_proj_weight, m.v_proj_weight
    zeros = torch.zeros(3 * E, dtype=DT)
    bq, bk, bv = (m.in_proj_bias if m.in_proj_bias is not None else zeros).chunk(3)
    bo = m.out_proj.bias if m.out_proj.bias is not None else torch.zeros(E, dtype=DT)
    return {
        "q": wq,
        "k": wk,
        "v": wv,
        "bq": bq,
        "bk": bk,
        "bv": bv,
        "o": m.out_proj.weight,
        "bo": bo,
    }


def _oracle(
    m: nn.MultiheadAttention, xq: torch.Tensor, xkv: torch.Tensor, t: torch.Tensor
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{part: (input rows, output-gradient rows)}`` of the loss ``mean((out − t)²)/2``."""
    w = {k: v.detach() for k, v in _weights(m).items()}
    q = (xq @ w["q"].T + w["bq"]).requires_grad_()
    k = (xkv @ w["k"].T + w["bk"]).requires_grad_()
    v = (xkv @ w["v"].T + w["bv"]).requires_grad_()
    n, lq, _ = q.shape
    heads = lambda y: y.reshape(n, y.shape[1], H, E // H).transpose(1, 2)  # noqa: E731
    att = torch.softmax(heads(q) @ heads(k).transpose(-2, -1) / math.sqrt(E // H), dim=-1)
    o = (att @ heads(v)).transpose(1, 2).reshape(n, lq, E)
    o_in = o.detach().requires_grad_()
    out = (o_in @ w["o"].T + w["bo"]).requires_grad_()
    loss = 0.5 * F.mse_loss(out, t, reduction="sum") / n
    (g_out,) = torch.autograd.grad(loss, out)
    (g_o,) = torch.autograd.grad((o_in @ w["o"].T + w["bo"]), o_in, g_out)
    gq, gk, gv = torch.autograd.grad(o, (q, k, v), g_o)
    return {"q": (xq, gq), "k": (xkv, gk), "v": (xkv, gv), "out": (o.detach(), g_out)}


class Cross(nn.Module):
    """Cross-attention: queries from one sequence, keys and values from another."""

    def __init__(self, attn: nn.MultiheadAttention) -> None:
        super().__init__()
        self.attn = attn

    def forward(self, xq: torch.Tensor, xkv: torch.Tensor) -> torch.Tensor:
        return self.attn(xq, xkv, xkv, need_weights=False)[0]


class Self_(nn.Module):
    def __init__(self, attn: nn.MultiheadAttention) -> None:
        super().__init__()
        self.attn = attn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x, x, x, need_weights=False)[0]


def _gram(rows: torch.Tensor, ones: bool) -> torch.Tensor:
    r = rows.reshape(-1, rows.shape[-1])
    if ones:
        r = torch.cat([r, torch.ones(r.shape[0], 1, dtype=DT)], dim=1)
    return r.T @ r


@pytest.mark.parametrize("case", ["self", "cross", "kdim", "nobias"])
def test_factors_are_the_grams_of_the_projections(case: str) -> None:
    attn = _mha(kdim=4 if case == "kdim" else None, bias=case != "nobias")
    g = torch.Generator().manual_seed(1)
    n, lq, lk = 3, 4, 5
    xq = torch.randn(n, lq, E, generator=g, dtype=DT)
    xkv = xq if case in ("self", "nobias") else torch.randn(n, lk, attn.kdim, generator=g, dtype=DT)
    t = torch.randn(n, lq, E, generator=g, dtype=DT)
    model = Self_(attn) if xkv is xq else Cross(attn)
    args = (xq,) if xkv is xq else (xq, xkv)
    table = kf.register(model)
    assert list(table) == ["attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.out_proj"]
    assert table.skipped == {}
    params = dict(model.named_parameters())
    _, _, caps = kf.capture(
        model, params, args, lambda out: 0.5 * F.mse_loss(out, t, reduction="sum") / n
    )
    state = kf.step.accumulate_factors(kf.init(table, factor_dtype=DT), caps)
    oracle = _oracle(attn, xq, xkv, t)
    bias = case != "nobias"
    for part, (a, gr) in oracle.items():
        ls = state.layers[f"attn.{part}_proj"]
        rows = a.numel() // a.shape[-1]
        torch.testing.assert_close(ls.a_factor, _gram(a, bias) / rows, rtol=1e-10, atol=1e-13)
        # "fisher": G = Σ_rows g gᵀ / (N c²) with c = 1/N (mean over examples)
        torch.testing.assert_close(ls.g_factor, _gram(gr, False) * n, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_one_query_row_is_exact_and_writes_the_packed_rows(method: str) -> None:
    """One example, one query, two keys: the q and output projections have one row each,
    so their ``G ⊗ A`` is the exact Fisher; every part's preconditioned gradient lands in its
    rows of ``in_proj_weight`` / ``in_proj_bias``."""
    attn = _mha()
    model = Cross(attn)
    g = torch.Generator().manual_seed(2)
    xq, xkv = (
        torch.randn(1, 1, E, generator=g, dtype=DT),
        torch.randn(1, 2, E, generator=g, dtype=DT),
    )
    t = torch.randn(1, 1, E, generator=g, dtype=DT)
    params = dict(model.named_parameters())
    _, grads, caps = kf.capture(
        model, params, (xq, xkv), lambda out: 0.5 * F.mse_loss(out, t, reduction="sum")
    )
    lam = 0.05
    state = kf.init(kf.register(model), compute_method=method, factor_dtype=DT, inv_dtype=DT)
    out, state = kf.update(state, grads, captures=caps, damping=lam, kl_clip=None)
    oracle = _oracle(attn, xq, xkv, t)
    for part in ("q", "out"):
        a, gr = oracle[part]
        m = gr.reshape(-1, 1) @ torch.cat([a.reshape(1, -1), torch.ones(1, 1, dtype=DT)], dim=1)
        vec = m.reshape(-1)
        fisher = torch.outer(vec, vec)
        ls = state.layers[f"attn.{part}_proj"]
        torch.testing.assert_close(
            torch.kron(ls.g_factor, ls.a_factor), fisher, rtol=1e-10, atol=1e-14
        )
    for i, part in enumerate("qkv"):
        ls = state.layers[f"attn.{part}_proj"]
        w = grads["attn.in_proj_weight"][i * E : (i + 1) * E]
        b = grads["attn.in_proj_bias"][i * E : (i + 1) * E]
        m = torch.cat([w, b[:, None]], dim=1)
        a_, g_ = ls.a_factor, ls.g_factor
        eye_a, eye_g = torch.eye(E + 1, dtype=DT), torch.eye(E, dtype=DT)
        if method == "eigen":
            want = torch.linalg.solve(
                torch.kron(g_, a_) + lam * torch.eye(m.numel(), dtype=DT), m.reshape(-1)
            )
            want = want.reshape(m.shape)
        else:
            want = torch.linalg.inv(g_ + lam * eye_g) @ m @ torch.linalg.inv(a_ + lam * eye_a)
        torch.testing.assert_close(
            out["attn.in_proj_weight"][i * E : (i + 1) * E], want[:, :-1], rtol=1e-10, atol=1e-13
        )
        torch.testing.assert_close(
            out["attn.in_proj_bias"][i * E : (i + 1) * E], want[:, -1], rtol=1e-10, atol=1e-13
        )
    assert not torch.equal(out["attn.in_proj_weight"], grads["attn.in_proj_weight"])


def test_encoder_layer_adapter_equals_capture_and_update() -> None:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(E, H, 12, dropout=0.0, batch_first=True).to(DT)
    ref = nn.TransformerEncoderLayer(E, H, 12, dropout=0.0, batch_first=True).to(DT)
    ref.load_state_dict(layer.state_dict())
    table = kf.register(layer)
    assert len(table) == 8 and not table.skipped  # q, k, v, out, two linears, two norms
    g = torch.Generator().manual_seed(3)
    pre = kf.KFACPreconditioner(
        layer, settings=kf.Settings(scaling="fisher"), inv_dtype=DT, damping=0.01
    )
    state = kf.init(kf.register(ref), factor_dtype=DT, inv_dtype=DT)
    for _ in range(2):
        x, t = (
            torch.randn(3, 5, E, generator=g, dtype=DT),
            torch.randn(3, 5, E, generator=g, dtype=DT),
        )
        layer.zero_grad()
        F.mse_loss(layer(x), t).backward()
        pre.step()
        _, grads, caps = kf.capture(
            ref, dict(ref.named_parameters()), x, lambda o, t=t: F.mse_loss(o, t)
        )
        out, state = kf.update(state, grads, captures=caps, damping=0.01)
        for name, p in layer.named_parameters():
            assert p.grad is not None
            torch.testing.assert_close(p.grad, out[name], rtol=1e-11, atol=1e-14)
        with torch.no_grad():
            for (_, p), (_, q) in zip(layer.named_parameters(), ref.named_parameters()):
                p -= 0.1 * p.grad  # type: ignore[operator]
                q -= 0.1 * out[_]
    for name, ls in pre.state.layers.items():
        torch.testing.assert_close(ls.g_factor, state.layers[name].g_factor, rtol=1e-11, atol=1e-14)


def test_eval_mode_capture_and_failing_forward_restore_everything() -> None:
    attn = _mha()
    model = Self_(attn).eval()
    x = torch.randn(2, 3, E, dtype=DT)
    fast = torch.backends.mha.get_fastpath_enabled()
    _, _, caps = kf.capture(model, dict(model.named_parameters()), x, lambda o: o.sum())
    assert len(caps.layers["attn.q_proj"].inputs) == 1
    assert torch.backends.mha.get_fastpath_enabled() == fast
    linear = F.linear
    with pytest.raises((AssertionError, RuntimeError)):
        kf.capture(
            model,
            dict(model.named_parameters()),
            torch.randn(2, 3, E + 1, dtype=DT),
            lambda o: o.sum(),
        )
    assert F.linear is linear
    pre = kf.KFACPreconditioner(model.train())
    with pytest.raises(AssertionError):
        model(torch.randn(2, 3, E + 1, dtype=DT))
    assert F.linear is linear
    pre.remove()


def test_model_parallel_registration_skips_attention() -> None:
    table, _ = kf.parallel.register_parallel(nn.Sequential(nn.Linear(E, E), Self_(_mha())))
    assert list(table) == ["0"]
    assert "not supported by the model-parallel preconditioner" in table.skipped["1.attn"]
