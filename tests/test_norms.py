"""Norm layers with an elementwise affine (:mod:`kfac_func.blocks.scale_shift`) against the
exact per-unit Fisher blocks, in float64.

The oracle is the Jacobian of the vector of per-example losses with respect to the norm's
``(weight, bias)`` on the whole batch (``torch.func.jacrev``; batch statistics of
BatchNorm stay coupled as in the real forward): row ``n`` is example ``n``'s gradient. With
one row per example, unit ``u``'s exact empirical Fisher block is
``(1/N) Σ_n (dγ_nu, dβ_nu)(dγ_nu, dβ_nu)ᵀ``, which K-FAC's G must equal (A = 1), and the eigen
and the inverse method must solve ``(F_u + λI) x_u = (dγ_u, dβ_u)`` unit by unit.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, jacrev

import kfac_func as kf
import kfac_func.blocks

DT = torch.float64
N, D, C = 6, 5, 3


def _norms() -> dict[str, Callable[[], nn.Module]]:
    return {
        "layer_norm": lambda: nn.LayerNorm(D),
        "layer_norm_nobias": lambda: nn.LayerNorm(D, bias=False),
        "rms_norm": lambda: nn.RMSNorm(D),
        "rms_norm_eps": lambda: nn.RMSNorm(D, eps=1e-3),
        "group_norm": lambda: nn.GroupNorm(1, D),
        # no running statistics: the oracle differentiates the forward with torch.func
        "batch_norm": lambda: nn.BatchNorm1d(D, track_running_stats=False),
    }


def _model(make: Callable[[], nn.Module]) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, D), make(), nn.Tanh(), nn.Linear(D, C)).to(DT)
    with torch.no_grad():  # non-trivial scale and shift
        model[1].weight.uniform_(0.5, 1.5)
        if getattr(model[1], "bias", None) is not None:
            model[1].bias.uniform_(-0.5, 0.5)
    return model


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(N, 4, generator=g, dtype=DT), torch.randint(0, C, (N,), generator=g)


def _per_example_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``(N, units, 1 or 2)``: each example's gradient of (weight, bias) of the norm."""
    params = {k: v.detach() for k, v in model.named_parameters()}
    names = ["1.weight"] + (["1.bias"] if "1.bias" in params else [])

    def losses(*norm_params: torch.Tensor) -> torch.Tensor:
        p = {**params, **dict(zip(names, norm_params))}
        return F.cross_entropy(functional_call(model, p, (x,)), y, reduction="none")

    jac = jacrev(losses, argnums=tuple(range(len(names))))(*(params[n] for n in names))
    return torch.stack(list(jac), dim=-1)


@pytest.mark.parametrize("kind", sorted(_norms()))
@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_per_unit_blocks_are_the_exact_fisher(kind: str, method: str) -> None:
    model = _model(_norms()[kind])
    x, y = _data()
    table = kf.register(model)
    assert table["1"].kind == kind.removesuffix("_nobias").removesuffix("_eps")
    per_ex = _per_example_grads(model, x, y)  # (N, U, k)
    fisher = torch.einsum("nui,nuj->uij", per_ex, per_ex) / N
    params = dict(model.named_parameters())
    _, grads, caps = kf.capture(model, params, x, lambda o: F.cross_entropy(o, y))
    state = kf.init(table, compute_method=method, factor_dtype=DT, inv_dtype=DT)
    lam = 0.02
    out, state = kf.update(state, grads, captures=caps, damping=lam, kl_clip=None)
    ls = state.layers["1"]
    torch.testing.assert_close(ls.g_factor, fisher, rtol=1e-10, atol=1e-13)
    torch.testing.assert_close(ls.a_factor, torch.ones(D, 1, dtype=DT), rtol=0, atol=0)
    m = per_ex.mean(dim=0)  # the batch gradient (U, k)
    torch.testing.assert_close(m[:, 0], grads["1.weight"], rtol=1e-10, atol=1e-13)
    eye = torch.eye(m.shape[1], dtype=DT)
    want = torch.linalg.solve(fisher + lam * eye, m.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(out["1.weight"], want[:, 0], rtol=1e-10, atol=1e-13)
    if m.shape[1] == 2:
        torch.testing.assert_close(out["1.bias"], want[:, 1], rtol=1e-10, atol=1e-13)


def test_sequences_sum_over_positions_and_channel_norms_over_pixels() -> None:
    """With several rows per example (positions, pixels) the factor sums the rows' outer
    products ("expand"); checked against x̂ computed here with PyTorch's functional norms."""
    torch.manual_seed(0)
    ln = nn.LayerNorm(D).to(DT)
    spec = kf.register(nn.Sequential(ln))["0"]
    x = torch.randn(2, 3, D, dtype=DT)
    r = torch.randn(2, 3, D, dtype=DT)
    xhat = F.layer_norm(x, (D,), eps=ln.eps)
    v = torch.stack([xhat * r, r], dim=-1).reshape(-1, D, 2)
    a_grams, g_grams = kf.blocks.call_grams(spec, [x], [r], DT)
    torch.testing.assert_close(g_grams[0].gram, torch.einsum("nui,nuj->uij", v, v))
    assert g_grams[0].rows == 6 and a_grams[0].diagonal
    bn = nn.BatchNorm2d(C).to(DT)
    spec = kf.register(nn.Sequential(bn))["0"]
    x, r = torch.randn(4, C, 2, 3, dtype=DT), torch.randn(4, C, 2, 3, dtype=DT)
    xhat = F.batch_norm(x, None, None, training=True, eps=bn.eps)
    v = torch.stack([xhat * r, r], dim=-1).movedim(1, -2).reshape(-1, C, 2)
    _, g_grams = kf.blocks.call_grams(spec, [x], [r], DT)
    torch.testing.assert_close(g_grams[0].gram, torch.einsum("nui,nuj->uij", v, v))
    gn = nn.GroupNorm(3, 6).to(DT)
    spec = kf.register(nn.Sequential(gn))["0"]
    x, r = torch.randn(2, 6, 5, dtype=DT), torch.randn(2, 6, 5, dtype=DT)
    xhat = F.group_norm(x, 3, eps=gn.eps)
    v = torch.stack([xhat * r, r], dim=-1).movedim(1, -2).reshape(-1, 6, 2)
    _, g_grams = kf.blocks.call_grams(spec, [x], [r], DT)
    torch.testing.assert_close(g_grams[0].gram, torch.einsum("nui,nuj->uij", v, v))


@pytest.mark.parametrize("norm", ["layer_norm", "rms_norm"])
def test_statistics_with_16_bit_grams_are_float32_with_the_modules_eps(norm: str) -> None:
    """A norm's statistics are elementwise (no products to speed up): with bfloat16
    ``gram_dtype`` they are computed in float32 from the float32 call, not from bfloat16
    casts, and an ``eps`` of None is the machine epsilon of the module's input (float32),
    not of the statistics' dtype. Inputs of mean square 1e-4, where the two epsilons
    differ by 80 times the mean square; against float64 within float32 rounding."""
    torch.manual_seed(0)
    module = nn.LayerNorm(D) if norm == "layer_norm" else nn.RMSNorm(D)
    spec = kf.register(nn.Sequential(module))["0"]
    x, r = 1e-2 * torch.randn(4, 3, D), torch.randn(4, 3, D)
    _, (got,) = kf.blocks.call_grams(spec, [x], [r], torch.bfloat16)
    eps = module.eps if module.eps is not None else torch.finfo(torch.float32).eps
    x64, r64 = x.double(), r.double()
    if norm == "layer_norm":
        xhat = F.layer_norm(x64, (D,), eps=eps)
    else:
        xhat = F.rms_norm(x64, (D,), eps=eps)
    v = torch.stack([xhat * r64, r64], dim=-1).reshape(-1, D, 2)[
        ..., : 2 if norm == "layer_norm" else 1
    ]
    assert got.gram.dtype == torch.float32
    torch.testing.assert_close(
        got.gram.double(), torch.einsum("nui,nuj->uij", v, v), rtol=1e-5, atol=1e-6
    )


def test_adapter_equals_capture_and_update() -> None:
    model = nn.Sequential(nn.Linear(4, D), nn.LayerNorm(D), nn.Tanh(), nn.Linear(D, C)).to(DT)
    ref = _model(lambda: nn.LayerNorm(D))
    model.load_state_dict(ref.state_dict())
    x, y = _data()
    for in_hook in (True, False):
        pre = kf.KFACPreconditioner(
            model,
            settings=kf.Settings(scaling="fisher"),
            damping=0.01,
            update_factors_in_hook=in_hook,
            inv_dtype=DT,
        )
        state = kf.init(kf.register(ref), factor_dtype=DT, inv_dtype=DT)
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        pre.step()
        _, grads, caps = kf.capture(
            ref, dict(ref.named_parameters()), x, lambda o: F.cross_entropy(o, y)
        )
        out, state = kf.update(state, grads, captures=caps, damping=0.01)
        for name, p in model.named_parameters():
            assert p.grad is not None
            torch.testing.assert_close(p.grad, out[name], rtol=1e-12, atol=1e-15)
        pre.remove()


def test_bad_shapes_name_the_layer() -> None:
    spec = kf.register(nn.Sequential(nn.LayerNorm(4)))["0"]
    with pytest.raises(ValueError, match=r"layer '0' \(layer_norm\): input must have trailing"):
        kf.blocks.call_grams(spec, [torch.zeros(2, 5)], [torch.zeros(2, 5)])
    with pytest.raises(ValueError, match="captured inputs but"):
        kf.blocks.call_grams(spec, [torch.zeros(2, 4)], [])
    with pytest.raises(TypeError, match="joint_grams"):
        kf.core.a_factor(spec, [torch.zeros(2, 4)])
