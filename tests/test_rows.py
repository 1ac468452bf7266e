"""Preconditioning a Linear layer from its rows: ``M = Σ gᵀ[a, 1]`` is never formed in
the products, and the result must be the dense preconditioning's (float64 oracle built
from the factors with ``torch.kron``), whenever — and only when — the gradient really is
the rows' product."""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kfac_func as kf
from kfac_func.blocks import layer_rows
from kfac_func.core.factors import rows_reproduce

DT = torch.float64
# the module that calls precondition_rows
kf_precondition = importlib.import_module("kfac_func.step.layer_step")


def _wide(bias: bool = True, calls: int = 1) -> tuple[nn.Module, Any, Any, kf.Captures]:
    """A layer much wider than the batch (so rows are cheaper), called ``calls`` times."""
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(24, 20, bias=bias)
            self.head = nn.Linear(20, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = x
            for _ in range(calls):
                h = torch.tanh(self.fc(h[..., :24] if h.shape[-1] >= 24 else F.pad(h, (0, 4))))
            return self.head(h)

    model = Net().double()
    x, y = torch.randn(4, 24, dtype=DT), torch.randint(0, 3, (4,))
    _, grads, caps = kf.capture(
        model, dict(model.named_parameters()), x, lambda o: F.cross_entropy(o, y)
    )
    return model, x, grads, caps


def _dense(ls: kf.state.LayerState, m: torch.Tensor, damping: float, method: str) -> torch.Tensor:
    a, g = ls.a_factor, ls.g_factor
    if method == "eigen":
        k = torch.kron(g, a) + damping * torch.eye(a.shape[0] * g.shape[0], dtype=DT)
        return torch.linalg.solve(k, m.reshape(-1)).reshape(m.shape)
    ga = torch.linalg.inv(g + damping * torch.eye(g.shape[0], dtype=DT))
    aa = torch.linalg.inv(a + damping * torch.eye(a.shape[0], dtype=DT))
    return ga @ m @ aa


def _count_rows_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    seen: list[str] = []
    real = kf_precondition.precondition_rows

    def counting(*args: Any, **kwargs: Any) -> torch.Tensor:
        seen.append("rows")
        return real(*args, **kwargs)

    monkeypatch.setattr(kf_precondition, "precondition_rows", counting)
    return seen


@pytest.mark.parametrize("calls", [1, 2])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(
    ("method", "outer"), [("eigen", True), ("eigen", False), ("inverse", False)]
)
def test_rows_path_equals_dense_oracle(
    monkeypatch: pytest.MonkeyPatch, method: str, outer: bool, bias: bool, calls: int
) -> None:
    model, _, grads, caps = _wide(bias, calls)
    seen = _count_rows_calls(monkeypatch)
    state = kf.init(
        kf.register(model),
        compute_method=method,
        compute_eigenvalue_outer_product=outer,
        factor_dtype=DT,
        inv_dtype=DT,
    )
    damping = 0.05
    out, new = kf.update(state, grads, captures=caps, damping=damping, kl_clip=None)
    assert seen == ["rows"]  # fc (4·calls rows ≪ 20, 25); the 3-wide head stays dense
    ls = new.layers["fc"]
    m = kf.blocks.grads_to_matrix(ls.spec, grads["fc.weight"], grads["fc.bias"] if bias else None)
    expected = _dense(ls, m, damping, method)
    got = kf.blocks.grads_to_matrix(ls.spec, out["fc.weight"], out["fc.bias"] if bias else None)
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-12)


def test_gradient_that_is_not_the_rows_product_takes_the_dense_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Weight decay added to the gradient (or any other change) is detected: the result
    is the dense preconditioning of the gradient actually given."""
    model, _, grads, caps = _wide()
    seen = _count_rows_calls(monkeypatch)
    state = kf.init(kf.register(model), factor_dtype=DT, inv_dtype=DT)
    decayed = dict(grads)
    decayed["fc.weight"] = grads["fc.weight"] + 1e-4 * model.fc.weight.detach()
    out, new = kf.update(state, decayed, captures=caps, damping=0.05, kl_clip=None)
    assert seen == []
    ls = new.layers["fc"]
    m = kf.blocks.grads_to_matrix(ls.spec, decayed["fc.weight"], decayed["fc.bias"])
    got = kf.blocks.grads_to_matrix(ls.spec, out["fc.weight"], out["fc.bias"])
    torch.testing.assert_close(got, _dense(ls, m, 0.05, "eigen"), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rows_reproduce_tolerates_rounding_only(dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    spec = kf.register(nn.Linear(300, 200))[""]
    a, g = torch.randn(64, 300, dtype=dtype), torch.randn(64, 200, dtype=dtype)
    m = torch.cat([g.T @ a, g.sum(0)[:, None]], dim=1)
    rows = layer_rows(spec, [a], [g])
    assert rows_reproduce(spec, m, rows)
    # the same sum in two halves rounds differently and is still accepted
    assert rows_reproduce(spec, m, layer_rows(spec, [a[:32], a[32:]], [g[:32], g[32:]]))
    bumped = m.clone()
    bumped[5, 7] += 1e-3 * float(m.abs().max())
    assert not rows_reproduce(spec, bumped, rows)
    assert not rows_reproduce(spec, m, layer_rows(spec, [a[:63]], [g[:63]]))


def test_adapter_uses_rows_on_one_rank_and_matches_the_dense_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The adapter keeps the rows of Linear calls every step (not only on factor steps);
    the step equals the dense path's to rounding."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 4))
    results = []
    for use_rows in (True, False):
        model = nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 4))
        model.load_state_dict(base.state_dict())
        pre = kf.KFACPreconditioner(model, factor_update_steps=2, inv_update_steps=4)
        if not use_rows:
            monkeypatch.setattr(pre, "_keeps_rows", lambda spec: False)
        seen = _count_rows_calls(monkeypatch)
        g = torch.Generator().manual_seed(3)
        outs = []
        for _ in range(5):
            model.zero_grad()
            x, y = torch.randn(8, 64, generator=g), torch.randint(0, 4, (8,), generator=g)
            F.cross_entropy(model(x), y).backward()
            pre.step()
            outs.append(model[0].weight.grad.clone())
        results.append((outs, len(seen)))
        monkeypatch.undo()
    (with_rows, n_rows), (dense, n_dense) = results
    assert n_rows == 5 and n_dense == 0
    for a, b in zip(with_rows, dense):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
