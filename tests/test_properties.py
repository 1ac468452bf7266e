"""Property tests: random shapes, batch sizes, dtypes and hyperparameters."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import kfac_func as kf


@settings(max_examples=25, deadline=None)
@given(
    d_in=st.integers(1, 5),
    d_out=st.integers(1, 5),
    n=st.integers(1, 6),
    bias=st.booleans(),
    damping=st.floats(1e-6, 10.0),
    convention=st.sampled_from(["fisher", "kfac-pytorch"]),
    method=st.sampled_from(["eigen", "inverse"]),
    seed=st.integers(0, 2**16),
)
def test_linear_update_matches_dense_formula(
    d_in: int,
    d_out: int,
    n: int,
    bias: bool,
    damping: float,
    convention: str,
    method: str,
    seed: int,
) -> None:
    torch.manual_seed(seed)
    model = nn.Linear(d_in, d_out, bias=bias).double()
    x = torch.randn(n, d_in, dtype=torch.float64)
    _, grads, caps = kf.capture(model, dict(model.named_parameters()), x, lambda o: o.tanh().sum())
    state = kf.init(
        kf.register(model),
        convention=convention,  # type: ignore[arg-type]
        compute_method=method,
        factor_dtype=torch.float64,
        inv_dtype=torch.float64,
    )
    out, new = kf.update(state, grads, captures=caps, damping=damping, kl_clip=None)
    ls = new.layers[""]
    spec = ls.spec
    vec = kf.blocks.grads_to_matrix(spec, grads["weight"], grads.get("bias")).reshape(-1)
    got = kf.blocks.grads_to_matrix(spec, out["weight"], out.get("bias")).reshape(-1)
    eye_a = torch.eye(spec.a_dim, dtype=torch.float64)
    eye_g = torch.eye(spec.g_dim, dtype=torch.float64)
    if method == "eigen":
        dense = torch.kron(ls.g_factor, ls.a_factor) + damping * torch.eye(
            vec.numel(), dtype=torch.float64
        )
        expected = torch.linalg.solve(dense, vec)
    else:
        inv = torch.kron(
            torch.linalg.inv(ls.g_factor + damping * eye_g),
            torch.linalg.inv(ls.a_factor + damping * eye_a),
        )
        expected = inv @ vec
    assert torch.isfinite(got).all()
    scale = expected.abs().max().clamp(min=1.0)
    if convention == "fisher":  # float64 end to end: its unit roundoff times the condition
        # number of the damped Kronecker product, κ(A + λI)·κ(G + λI)
        cond = float(torch.linalg.cond(ls.a_factor + damping * eye_a)) * float(
            torch.linalg.cond(ls.g_factor + damping * eye_g)
        )
        tol = 1e-7 + 64 * 2.0**-53 * cond
    else:  # decompositions in float32 by convention: eps32 times the condition number
        norm = max(float(ls.a_factor.norm()), 1.0) * max(float(ls.g_factor.norm()), 1.0)
        tol = 1e-6 * (1.0 + norm / damping)
    assert (got - expected).abs().max() / scale < tol


@settings(max_examples=15, deadline=None)
@given(
    n=st.integers(1, 3),
    c=st.integers(1, 4),
    k=st.integers(1, 3),
    stride=st.integers(1, 2),
    dilation=st.integers(1, 2),
    padding=st.sampled_from([0, 1, "same", "valid"]),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
    kl_clip=st.sampled_from([None, 1e-3, 10.0]),
    seed=st.integers(0, 2**16),
)
def test_conv_update_returns_finite_gradients(
    n: int,
    c: int,
    k: int,
    stride: int,
    dilation: int,
    padding: object,
    dtype: torch.dtype,
    kl_clip: float | None,
    seed: int,
) -> None:
    if padding == "same":
        stride = 1
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Conv2d(c, 2 * c, k, stride, padding, dilation, groups=c), nn.Flatten())
    model = model.to(dtype)
    x = torch.randn(n, c, 7, 7, dtype=dtype)
    _, grads, caps = kf.capture(
        model, dict(model.named_parameters()), x, lambda o: o.float().pow(2).mean()
    )
    state = kf.init(kf.register(model))
    out, new = kf.update(state, grads, captures=caps, kl_clip=kl_clip)
    assert new.layers["0"].factor_updates == 1
    for name, g in out.items():
        assert g.shape == grads[name].shape and g.dtype == grads[name].dtype
        assert torch.isfinite(g).all()
