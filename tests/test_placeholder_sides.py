"""Layers with a placeholder or a diagonal factor side, under every method and every step
path, against dense float64 oracles built here.

Kinds: the norms (``A = 1``, a placeholder: the unit blocks live wholly in G), Embedding
(A diagonal: token frequencies) and Linear with a side wider than ``max_factor_dim`` (A or
G kept diagonal). The oracle takes each example's gradient from ``torch.func.jacrev`` of
the per-example losses, and the factors from the layer's inputs and output-gradients
recorded with plain autograd (``"fisher"``: ``A = (1/N) Σ a aᵀ``, ``G = (1/N) Σ g gᵀ``; a
norm's G is its exact per-unit Fisher block), diagonal sides replaced by their diagonal.
It then forms the dense curvature of each group and solves:

- ``eigen``: ``(G ⊗ A + λI) x = m``;
- ``inverse``: ``x = ((G + λI)⁻¹ ⊗ (A + λI)⁻¹) m``, with the placeholder ``A = 1`` applied
  as the identity (not damped), so that a norm solves ``(F_u + λI) x = m`` as under eigen;
- ``ekfac``: ``x = Q [(Qᵀ m) / (s + λ)]`` with ``Q = Qg ⊗ Qa`` (the identity on a diagonal
  or placeholder side) and ``s = (1/N) Σ_n (Qᵀ vec ∇W_n)²``; an embedding has no
  per-example rows and keeps K-FAC's eigenvalues ``s = diag(Qᵀ (G ⊗ A) Q)`` (as documented).

Paths: :func:`kfac_func.update`, :func:`kfac_func.distributed.update_distributed` on one
process, and :class:`kfac_func.KFACPreconditioner`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, jacrev

import kfac_func as kf

DT = torch.float64
D, C, V = 5, 3, 7
LAM = 0.01


@dataclass(frozen=True)
class Case:
    make: Callable[[], nn.Module]
    layer: str  # the module checked
    kind: str  # "norm", "linear" or "embedding"
    tokens: bool = False  # integer inputs
    max_factor_dim: int | None = None
    min_batch: int = 1


def _norm_model(norm: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, D), norm(), nn.Tanh(), nn.Linear(D, C)).to(DT)
        with torch.no_grad():
            model[1].weight.uniform_(0.5, 1.5)
            if getattr(model[1], "bias", None) is not None:
                model[1].bias.uniform_(-0.5, 0.5)
        return model

    return make


def _embedding_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(V, 4), nn.Tanh(), nn.Linear(4, C)).to(DT)


def _wide_model() -> nn.Module:
    torch.manual_seed(0)  # max_factor_dim=6: layer 0 has G diagonal (8), layer 2 A (9)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, C)).to(DT)


CASES = {
    "layer_norm": Case(_norm_model(lambda: nn.LayerNorm(D)), "1", "norm"),
    "layer_norm_nobias": Case(_norm_model(lambda: nn.LayerNorm(D, bias=False)), "1", "norm"),
    "rms_norm": Case(_norm_model(lambda: nn.RMSNorm(D)), "1", "norm"),
    "group_norm": Case(_norm_model(lambda: nn.GroupNorm(1, D)), "1", "norm"),
    "batch_norm": Case(
        _norm_model(lambda: nn.BatchNorm1d(D, track_running_stats=False)), "1", "norm", min_batch=2
    ),
    "embedding": Case(_embedding_model, "0", "embedding", tokens=True),
    "linear_diagonal_g": Case(_wide_model, "0", "linear", max_factor_dim=6),
    "linear_diagonal_a": Case(_wide_model, "2", "linear", max_factor_dim=6),
}


def _batch(case: Case, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, V, (n,), generator=g) if case.tokens else torch.randn(n, 4, generator=g)
    return (x if case.tokens else x.to(DT)), torch.randint(0, C, (n,), generator=g)


def _to_matrix(case: Case, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """A layer's (weight, bias) as the ``(groups, g_dim, a_dim)`` matrix K-FAC sees."""
    if case.kind == "norm":
        cols = [w] if b is None else [w, b]
        return torch.stack(cols, dim=-1).unsqueeze(-1)
    if case.kind == "embedding":
        return w.T.unsqueeze(0)
    return torch.cat([w, b[:, None]], dim=1).unsqueeze(0)  # type: ignore[index]


def _per_example(case: Case, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``(N, groups, g_dim, a_dim)``: each example's gradient of the layer's parameters."""
    params = {k: v.detach() for k, v in model.named_parameters()}
    names = [n for n in (f"{case.layer}.weight", f"{case.layer}.bias") if n in params]

    def losses(*own: torch.Tensor) -> torch.Tensor:
        p = {**params, **dict(zip(names, own))}
        return F.cross_entropy(functional_call(model, p, (x,)), y, reduction="none")

    jac = jacrev(losses, argnums=tuple(range(len(names))))(*(params[n] for n in names))
    b = jac[1] if len(jac) > 1 else [None] * len(x)
    return torch.stack([_to_matrix(case, jac[0][n], b[n]) for n in range(len(x))])


def _factors(
    case: Case, model: nn.Module, x: torch.Tensor, y: torch.Tensor, per_ex: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense ``(groups, a, a)`` and ``(groups, g, g)`` factors of the "fisher" convention."""
    n = len(x)
    if case.kind == "norm":
        vec = per_ex.squeeze(-1)  # (N, U, k)
        g_fac = torch.einsum("nui,nuj->uij", vec, vec) / n
        return torch.ones(vec.shape[1], 1, 1, dtype=DT), g_fac
    module = dict(model.named_modules())[case.layer]
    seen: dict[str, torch.Tensor] = {}

    def hook(_m: nn.Module, inp: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
        out.retain_grad()
        seen["a"], seen["y"] = inp[0], out

    handle = module.register_forward_hook(hook)
    F.cross_entropy(model(x), y, reduction="sum").backward()
    handle.remove()
    model.zero_grad()
    gy = seen["y"].grad
    assert gy is not None
    if case.kind == "embedding":
        a = F.one_hot(seen["a"], V).to(DT)
    else:
        a = torch.cat([seen["a"], torch.ones(n, 1, dtype=DT)], dim=1)
    a_fac, g_fac = a.T @ a / n, gy.T @ gy / n
    diag_a = case.kind == "embedding" or a_fac.shape[0] > (case.max_factor_dim or 1 << 30)
    diag_g = g_fac.shape[0] > (case.max_factor_dim or 1 << 30)
    a_fac = torch.diag(torch.diagonal(a_fac)) if diag_a else a_fac
    g_fac = torch.diag(torch.diagonal(g_fac)) if diag_g else g_fac
    return a_fac.unsqueeze(0), g_fac.unsqueeze(0)


def _basis(case: Case, f: torch.Tensor, side: str) -> torch.Tensor:
    """The eigenbasis K-FAC keeps for one side: the identity for a diagonal or placeholder
    side, else the eigenvectors."""
    off = f - torch.diag_embed(torch.diagonal(f, dim1=-2, dim2=-1))
    if (case.kind == "norm" and side == "A") or not bool(off.any()):
        return torch.eye(f.shape[-1], dtype=DT)
    return torch.linalg.eigh(f)[1].contiguous()


def _oracle(case: Case, method: str, n: int) -> torch.Tensor:
    """The preconditioned ``(groups, g_dim, a_dim)`` gradient of the layer."""
    model = case.make()
    x, y = _batch(case, n)
    per_ex = _per_example(case, model, x, y)
    a_fac, g_fac = _factors(case, model, x, y, per_ex)
    m = per_ex.mean(dim=0)
    out = []
    for u in range(m.shape[0]):
        a, g, mu = a_fac[u], g_fac[u], m[u].reshape(-1)
        eye_a, eye_g = torch.eye(a.shape[0], dtype=DT), torch.eye(g.shape[0], dtype=DT)
        if method == "eigen":
            x_u = torch.linalg.solve(torch.kron(g, a) + LAM * torch.eye(mu.numel(), dtype=DT), mu)
        elif method == "inverse":
            lam_a = 0.0 if case.kind == "norm" else LAM  # the placeholder A = 1 is not damped
            inv = torch.kron(torch.linalg.inv(g + LAM * eye_g), torch.linalg.inv(a + lam_a * eye_a))
            x_u = inv @ mu
        else:
            q = torch.kron(_basis(case, g, "G"), _basis(case, a, "A"))
            if case.kind == "embedding":  # no per-example rows: K-FAC's eigenvalues
                s = torch.diagonal(q.T @ torch.kron(g, a) @ q)
            else:
                s = ((per_ex[:, u].reshape(n, -1) @ q) ** 2).mean(dim=0)
            x_u = q @ ((q.T @ mu) / (s + LAM))
        out.append(x_u.reshape(m.shape[1:]))
    return torch.stack(out)


def _layer_out(case: Case, out: dict[str, torch.Tensor]) -> torch.Tensor:
    return _to_matrix(case, out[f"{case.layer}.weight"], out.get(f"{case.layer}.bias"))


def _functional(case: Case, method: str, n: int, distributed: bool) -> torch.Tensor:
    model = case.make()
    x, y = _batch(case, n)
    table = kf.register(model, max_factor_dim=case.max_factor_dim)
    state = kf.init(table, compute_method=method, factor_dtype=DT, inv_dtype=DT)
    _, grads, caps = kf.capture(
        model, dict(model.named_parameters()), x, lambda o: F.cross_entropy(o, y)
    )
    kw = {"captures": caps, "damping": LAM, "factor_decay": 0.95, "kl_clip": None}
    if distributed:
        plan = kf.distributed.make_plan(table, 1)
        out, _ = kf.distributed.update_distributed(
            state, grads, plan=plan, comm=kf.distributed.Communicator(plan), **kw
        )
    else:
        out, _ = kf.update(state, grads, **kw)
    return _layer_out(case, out)


def _adapter(case: Case, method: str, n: int) -> torch.Tensor:
    model = case.make()
    x, y = _batch(case, n)
    pre = kf.KFACPreconditioner(
        model,
        settings=kf.Settings(scaling="fisher", max_factor_dim=case.max_factor_dim),
        compute_method=method,
        damping=LAM,
        kl_clip=None,
        factor_dtype=DT,
        inv_dtype=DT,
    )
    F.cross_entropy(model(x), y).backward()
    pre.step()
    grads = {k: p.grad for k, p in model.named_parameters() if p.grad is not None}
    pre.remove()
    return _layer_out(case, grads)


PATHS = ["update", "distributed", "adapter"]


CHECKS = [(name, n) for name, case in sorted(CASES.items()) for n in (1, 8) if n >= case.min_batch]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("method", ["eigen", "inverse", "ekfac"])
@pytest.mark.parametrize(("name", "n"), CHECKS)
def test_preconditioned_gradient_equals_the_dense_oracle(
    name: str, n: int, method: str, path: str
) -> None:
    case = CASES[name]
    want = _oracle(case, method, n)
    if path == "adapter":
        got = _adapter(case, method, n)
    else:
        got = _functional(case, method, n, distributed=path == "distributed")
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("name", [k for k, c in CASES.items() if c.kind == "norm"])
def test_norms_solve_the_unit_blocks_under_the_kfac_pytorch_scaling(name: str) -> None:
    """Under ``"kfac-pytorch"`` (factors from the identity), a norm's inverse method solves
    ``(G_u + λI) x = m_u`` with the state's own G, as its eigen method does (to float32
    rounding: this scaling decomposes in float32; the old inverse was 1% off)."""
    case = CASES[name]
    model = case.make()
    x, y = _batch(case, 8)
    _, grads, caps = kf.capture(
        model, dict(model.named_parameters()), x, lambda o: F.cross_entropy(o, y)
    )
    outs = {}
    for method in ("eigen", "inverse"):
        state = kf.init(
            kf.register(model),
            compute_method=method,
            convention="kfac-pytorch",
            factor_dtype=DT,
            inv_dtype=DT,
        )
        out, state = kf.update(state, grads, captures=caps, damping=LAM, kl_clip=None)
        outs[method] = _layer_out(case, out)
        g_fac = state.layers[case.layer].g_factor
        m = _layer_out(case, grads)
        eye = torch.eye(g_fac.shape[-1], dtype=DT)
        want = torch.linalg.solve(g_fac + LAM * eye, m)
        torch.testing.assert_close(outs[method], want, rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(outs["eigen"], outs["inverse"], rtol=1e-5, atol=1e-8)


def test_placeholder_sides_are_declared_by_the_norm_kinds_only() -> None:
    specs = {
        **kf.register(CASES["layer_norm"].make()),
        **{f"e{k}": s for k, s in kf.register(_embedding_model()).items()},
        **{f"w{k}": s for k, s in kf.register(_wide_model(), max_factor_dim=6).items()},
    }
    assert {k: s.placeholder for k, s in specs.items()} == {
        "0": (False, False),
        "1": (True, False),
        "3": (False, False),
        "e0": (False, False),
        "e2": (False, False),
        "w0": (False, False),
        "w2": (False, False),
    }
