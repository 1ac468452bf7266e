"""``nn.Embedding`` (:mod:`kfac_func.blocks.embedding`) against oracles built with
``torch.func``, in float64.

Notation: ``y = W[x]`` with ``W`` of shape ``(V, d)``; K-FAC's gradient matrix is
``M = dWᵀ`` (``d × V``), flattened row-major. For one example with one token ``v``,
``dWᵀ = g e_vᵀ`` with ``g = ∂ℓ/∂y``, so the example's Fisher is exactly
``(g gᵀ) ⊗ diag(e_v)``: K-FAC is exact there.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

import kfac_func as kf

DT = torch.float64
V, D, C = 7, 3, 4  # vocabulary, width, classes


class Net(nn.Module):
    def __init__(self, padding_idx: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(V, D, padding_idx=padding_idx, dtype=DT)
        self.out = nn.Linear(D, C, dtype=DT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.emb(x)))


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, C), y.reshape(-1))


def _per_token_output_grads(model: Net, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``∂ℓ_n/∂y_t`` of every example's own loss (a mean over its tokens), per token,
    from a re-written forward differentiated with torch.func (not the library)."""
    params = dict(model.named_parameters())

    def example_loss(e: torch.Tensor, yn: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(e)
        out = F.linear(h, params["out.weight"], params["out.bias"])
        return F.cross_entropy(out, yn)

    emb = params["emb.weight"][x]  # (N, T, d)
    return vmap(grad(example_loss))(emb, y)  # (N, T, d)


def test_factors_equal_token_counts_and_output_gradient_gram() -> None:
    model = Net()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, V, (5, 6), generator=g), torch.randint(0, C, (5, 6), generator=g)
    _, _, caps = kf.capture(model, dict(model.named_parameters()), x, lambda o: _loss(o, y))
    state = kf.step.accumulate_factors(kf.init(kf.register(model), factor_dtype=DT), caps)
    ls = state.layers["emb"]
    n, t = x.shape
    counts = torch.zeros(V, dtype=DT)
    for v in x.reshape(-1).tolist():
        counts[v] += 1
    torch.testing.assert_close(ls.a_factor, counts / (n * t), rtol=1e-12, atol=1e-14)
    # "fisher": G = (1/N) Σ_n Σ_t g gᵀ, g the gradient of example n's own loss (the mean
    # over its tokens: the batch loss is the mean over examples of those)
    rows = _per_token_output_grads(model, x, y).reshape(-1, D)
    torch.testing.assert_close(ls.g_factor, rows.T @ rows / n, rtol=1e-10, atol=1e-14)
    assert ls.a_factor.shape == (V,) and ls.g_factor.shape == (D, D)


@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_one_token_is_exact_against_the_dense_fisher(method: str) -> None:
    """Batch 1, one token: the preconditioned gradient solves (F + λI) x = vec(M) with F
    the example's dense Fisher of the embedding (eigen: exactly; inverse: with the damped
    inverses of the factors)."""
    model = Net()
    x, y = torch.tensor([[3]]), torch.tensor([[1]])
    params = dict(model.named_parameters())
    lam = 0.1

    def loss_of_w(w: torch.Tensor) -> torch.Tensor:
        return _loss(functional_call(model, {**params, "emb.weight": w}, (x,)), y)

    dw = grad(loss_of_w)(params["emb.weight"].detach())
    m = dw.T.reshape(-1)  # vec(M), M = dWᵀ
    fisher = torch.outer(m, m)  # the empirical Fisher of one example
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


def test_padding_row_gets_no_update() -> None:
    model = Net(padding_idx=0)
    x, y = torch.tensor([[0, 2, 0, 5]]), torch.tensor([[1, 2, 3, 0]])
    pre = kf.KFACPreconditioner(model, damping=0.1, lr=0.1, kl_clip=None)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    before = model.emb.weight.detach().clone()
    for _ in range(3):
        opt.zero_grad()
        _loss(model(x), y).backward()
        pre.step()
        assert model.emb.weight.grad is not None
        assert torch.count_nonzero(model.emb.weight.grad[0]) == 0
        opt.step()
    assert torch.equal(model.emb.weight[0], before[0])
    assert not torch.equal(model.emb.weight[2], before[2])


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"sparse": True}, "sparse"),
        ({"max_norm": 1.0}, "max_norm"),
        ({"scale_grad_by_freq": True}, "scale_grad_by_freq"),
    ],
)
def test_unsupported_options_are_skipped_with_the_reason(
    kwargs: dict[str, object], reason: str
) -> None:
    table = kf.register(nn.Sequential(nn.Embedding(5, 2, **kwargs)))  # type: ignore[arg-type]
    assert list(table) == []
    assert reason in table.skipped["0"]
    assert reason in str(table)


def test_out_of_range_and_float_inputs_name_the_layer() -> None:
    spec = kf.register(nn.Sequential(nn.Embedding(5, 2)))["0"]
    with pytest.raises(ValueError, match=r"layer '0' \(embedding\).*out of range"):
        kf.core.a_factor(spec, [torch.tensor([1, 7])])
    with pytest.raises(ValueError, match=r"layer '0' \(embedding\).*integer token indices"):
        kf.core.a_factor(spec, [torch.tensor([1.0])])


def test_large_vocabulary_memory_is_order_v_plus_d_squared() -> None:
    """V = 50,000, d = 512: factors and decomposition hold O(V + d²) numbers (measured as
    the bytes of every tensor in the state), never a V × V or V × d matrix."""
    vocab, d = 50_000, 512
    model = nn.Sequential(nn.Embedding(vocab, d))
    state = kf.init(kf.register(model))
    x = torch.randint(0, vocab, (4, 16))
    _, grads, caps = kf.capture(model, dict(model.named_parameters()), x, lambda o: o.sum())
    _, state = kf.update(state, grads, captures=caps, damping=1e-3)
    ls = state.layers["0"]
    tensors = [ls.a_factor, ls.g_factor, *vars(ls.decomposition).values()]
    held = sum(t.numel() for t in tensors if t is not None)
    # A, da: V each; G, qg: d² each; dg: d (no qa, no dgda)
    assert held == 2 * vocab + 2 * d * d + d
    assert held < 3 * (vocab + d * d)
