"""Scaled embeddings (:mod:`kfac_func.blocks.scaled_embedding`) against oracles built with
``torch.func``, in float64.

Notation: ``y = s · W[x]`` with ``W`` of shape ``(V, d)`` (Gemma's word embeddings, ``s =
sqrt(d)``); K-FAC's gradient matrix is ``M = dWᵀ`` (``d × V``). For one example with one
token ``v``, ``dWᵀ = s g e_vᵀ`` with ``g = ∂ℓ/∂y``, so the example's Fisher is exactly
``(s² g gᵀ) ⊗ diag(e_v)``: K-FAC is exact there, and G is ``s²`` times the Gram of the
module's output-gradients.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

import kfac_func as kf

DT = torch.float64
V, D, C = 7, 4, 3  # vocabulary, width, classes
S = D**0.5


class ScaledEmbedding(nn.Embedding):
    """Gemma's word embedding: the lookup times ``embed_scale``."""

    def __init__(self, v: int, d: int, scale: float) -> None:
        super().__init__(v, d, dtype=DT)
        self.embed_scale = scale

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * self.embed_scale


class Net(nn.Module):
    def __init__(self, scale: float = S) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = ScaledEmbedding(V, D, scale)
        self.out = nn.Linear(D, C, dtype=DT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.emb(x)))


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, C), y.reshape(-1))


def _per_token_output_grads(model: Net, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``∂ℓ_n/∂y_t`` of every example's own loss per token, ``y = s · W[x]`` the scaled
    embedding's output, from a forward re-written here and differentiated with torch.func."""
    params = dict(model.named_parameters())

    def example_loss(e: torch.Tensor, yn: torch.Tensor) -> torch.Tensor:
        out = F.linear(torch.tanh(e), params["out.weight"], params["out.bias"])
        return F.cross_entropy(out, yn)

    emb = S * params["emb.weight"][x]
    return vmap(grad(example_loss))(emb, y)


def test_registered_as_a_scaled_embedding() -> None:
    spec = kf.register(Net())["emb"]
    assert spec.kind == "scaled_embedding" and spec.option("scale") == S
    assert spec.factor_shapes == ((V,), (D, D))


def test_on_the_meta_device_gemmas_number_beside_the_buffer_gives_the_scale() -> None:
    """A model built on the meta device (before FSDP2 or a checkpoint fills it) has an
    ``embed_scale`` buffer without a value; Gemma 3 keeps the number beside it
    (``scalar_embed_scale``). Before, the embedding was not recognised there, and a tied
    head was skipped with it."""

    class GemmaLike(nn.Embedding):  # Gemma3TextScaledWordEmbedding's attributes
        def __init__(self) -> None:
            super().__init__(V, D)
            self.scalar_embed_scale = S
            self.embed_scale = nn.Buffer(torch.tensor(S), persistent=False)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return super().forward(ids) * self.embed_scale.to(self.weight.dtype)

    with torch.device("meta"):
        model = nn.Sequential(GemmaLike(), nn.Linear(D, V, bias=False))
    model[1].weight = model[0].weight  # tied, as Gemma's head
    table = kf.register(model)
    assert list(table) == ["1"] and not table.skipped
    assert table["1"].kind == "tied" and table["1"].option("embedding_scale") == S


def test_factors_are_token_counts_and_the_scaled_output_gradient_gram() -> None:
    model = Net()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, V, (5, 6), generator=g), torch.randint(0, C, (5, 6), generator=g)
    _, _, caps = kf.capture(model, dict(model.named_parameters()), x, lambda o: _loss(o, y))
    state = kf.step.accumulate_factors(kf.init(kf.register(model), factor_dtype=DT), caps)
    ls = state.layers["emb"]
    n, t = x.shape
    counts = torch.bincount(x.reshape(-1), minlength=V).to(DT)
    torch.testing.assert_close(ls.a_factor, counts / (n * t), rtol=1e-12, atol=1e-14)
    rows = _per_token_output_grads(model, x, y).reshape(-1, D)
    want = S**2 * rows.T @ rows / n  # the Gram of the gradients s·g that reach W's rows
    torch.testing.assert_close(ls.g_factor, want, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_one_token_is_exact_against_the_dense_fisher(method: str) -> None:
    """Batch 1, one token: the factors' Kronecker product is the example's dense Fisher
    of ``W``, and the preconditioned gradient solves ``(F + λI) x = vec(M)`` (eigen)."""
    model = Net()
    x, y = torch.tensor([[3]]), torch.tensor([[1]])
    params = dict(model.named_parameters())
    lam = 0.1

    def loss_of_w(w: torch.Tensor) -> torch.Tensor:
        return _loss(functional_call(model, {**params, "emb.weight": w}, (x,)), y)

    dw = grad(loss_of_w)(params["emb.weight"].detach())
    m = dw.T.reshape(-1)  # vec(M), M = dWᵀ
    fisher = torch.outer(m, m)
    _, grads, caps = kf.capture(model, params, x, lambda o: _loss(o, y))
    state = kf.init(kf.register(model), compute_method=method, factor_dtype=DT, inv_dtype=DT)
    out, state = kf.update(state, grads, captures=caps, damping=lam, kl_clip=None)
    ls = state.layers["emb"]
    a = torch.diag(ls.a_factor)
    torch.testing.assert_close(torch.kron(ls.g_factor, a), fisher, rtol=1e-10, atol=1e-14)
    if method == "eigen":
        want = torch.linalg.solve(fisher + lam * torch.eye(V * D, dtype=DT), m)
    else:
        g_inv = torch.linalg.inv(ls.g_factor + lam * torch.eye(D, dtype=DT))
        a_inv = torch.linalg.inv(a + lam * torch.eye(V, dtype=DT))
        want = torch.kron(g_inv, a_inv) @ m
    torch.testing.assert_close(out["emb.weight"].T.reshape(-1), want, rtol=1e-10, atol=1e-12)


def test_the_adapter_equals_the_capture() -> None:
    model, ref = Net(), Net()
    g = torch.Generator().manual_seed(2)
    x, y = torch.randint(0, V, (4, 5), generator=g), torch.randint(0, C, (4, 5), generator=g)
    pre = kf.KFACPreconditioner(
        model, factor_dtype=DT, inv_dtype=DT, settings=kf.Settings(scaling="fisher")
    )
    _loss(model(x), y).backward()
    pre.step()
    _, _, caps = kf.capture(ref, dict(ref.named_parameters()), x, lambda o: _loss(o, y))
    state = kf.step.accumulate_factors(kf.init(kf.register(ref), factor_dtype=DT), caps)
    for side in ("a_factor", "g_factor"):
        got, want = getattr(pre.state.layers["emb"], side), getattr(state.layers["emb"], side)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


def test_a_tied_head_takes_the_scaled_embedding_use() -> None:
    """A scaled embedding tied to the head: the embedding use's rows are the gradients that
    reach ``W`` (``s`` times the output-gradients), so that with the head's they add up to
    the shared weight's gradient, and the use's G is their Gram."""

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.emb = ScaledEmbedding(V, D, S)
            self.head = nn.Linear(D, V, bias=False, dtype=DT)
            self.head.weight = self.emb.weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(torch.tanh(self.emb(x)))

    model = Tied()
    table = kf.register(model)
    spec = table["head"]
    assert spec.kind == "tied" and spec.option("embedding_scale") == S
    g = torch.Generator().manual_seed(3)
    x, y = torch.randint(0, V, (3, 5), generator=g), torch.randint(0, V, (3, 5), generator=g)

    def loss(o: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(o.reshape(-1, V), y.reshape(-1))

    params = dict(model.named_parameters())
    _, grads, caps = kf.capture(model, params, x, loss, layers=table)
    layer = caps.layers["head"]
    total = torch.zeros(V, D, dtype=DT)
    for xi, ri in zip(layer.inputs, layer.output_grads):
        rows = spec.block.example_rows(spec, xi, ri)
        assert rows is not None
        left, right = rows  # (N, T, ·): the use's gradient is Σ rightᵀ left (head orientation)
        total += torch.einsum("ntv,ntd->vd", right, left)
        if spec.block.is_embedding_call(xi, ri):
            _, g_use = spec.block.joint_grams(spec, xi, ri, DT)
            flat = left.reshape(-1, D)
            torch.testing.assert_close(g_use.gram, flat.T @ flat, rtol=1e-12, atol=1e-14)
            flat_r = ri.reshape(-1, D)
            want = S**2 * flat_r.T @ flat_r
            torch.testing.assert_close(g_use.gram, want, rtol=1e-12, atol=0)
    torch.testing.assert_close(total, grads["emb.weight"], rtol=1e-10, atol=1e-13)


def test_an_embed_scale_the_forward_does_not_apply_is_refused() -> None:
    """A plain nn.Embedding given an ``embed_scale`` attribute would be read as scaled: its
    first call says it is not, and it is left to the other optimizer."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(V, D, dtype=DT), nn.Linear(D, C, dtype=DT))
    model[0].embed_scale = 3.0
    assert kf.register(model)["0"].kind == "scaled_embedding"
    opt = kf.KFAC(model, lr=0.1)
    x = torch.randint(0, V, (2, 5))
    with pytest.warns(kf.FallbackWarning, match=r"'0' \(torch.nn.modules.sparse.Embedding\)"):
        model(x).sum().backward()
    opt.step()
    assert list(opt.preconditioner.layers) == ["1"]
    assert opt.others_optimizer is not None
    assert opt.others_optimizer.param_groups[0]["params"] == [model[0].weight]
