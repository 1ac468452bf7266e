"""``nn.Conv1d`` (:mod:`kfac_func.blocks.conv1d`) against an explicit patch extractor, in
float64.

The oracle reads input position ``i·stride + u·dilation − pad_left`` for output position
``i`` and kernel offset ``u``, with each ``padding_mode``'s index mapping, in plain Python
loops (no ``F.unfold``, no library code); it is first checked against ``F.conv1d``.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad

import kfac_func as kf
from kfac_func.blocks.conv1d import conv1d_padding

DT = torch.float64
L = 9
N = 2


@dataclass(frozen=True)
class Case:
    kernel: int
    stride: int = 1
    padding: int | str = 0
    dilation: int = 1
    groups: int = 1
    bias: bool = True
    mode: str = "zeros"
    cin: int = 4
    cout: int = 6

    def module(self) -> nn.Conv1d:
        torch.manual_seed(0)
        return nn.Conv1d(
            self.cin,
            self.cout,
            self.kernel,
            stride=self.stride,
            padding=self.padding,
            dilation=self.dilation,
            groups=self.groups,
            bias=self.bias,
            padding_mode=self.mode,
        ).to(DT)


CASES = [
    Case(3),
    Case(1, bias=False),
    Case(3, stride=2, padding=1),
    Case(2, padding="same"),
    Case(4, padding="same", dilation=2),
    Case(3, padding="valid", dilation=3),
    Case(3, padding=2, mode="reflect"),
    Case(3, padding=1, mode="replicate", stride=2),
    Case(2, padding=2, mode="circular", groups=2),
    Case(3, groups=2, bias=False, stride=3),
    Case(3, groups=4, cin=4, cout=8, padding="same", mode="reflect"),
]


def _source(i: int, n: int, mode: str) -> int | None:
    """The input index read at padded position ``i`` (None: a zero)."""
    if 0 <= i < n:
        return i
    if mode == "zeros":
        return None
    if mode == "reflect":
        return -i if i < 0 else 2 * (n - 1) - i
    if mode == "replicate":
        return min(max(i, 0), n - 1)
    return i % n  # circular


def patches(case: Case, x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(groups, N·L_out, C/groups·k)`` patches and ``L_out``, by loops."""
    mod = case.module()
    left, right = conv1d_padding(mod)
    n, c, length = x.shape
    span = case.dilation * (case.kernel - 1) + 1
    out_len = (length + left + right - span) // case.stride + 1
    cg = c // case.groups
    rows = torch.zeros(case.groups, n * out_len, cg * case.kernel, dtype=DT)
    for b in range(n):
        for i in range(out_len):
            for g in range(case.groups):
                for ch in range(cg):
                    for u in range(case.kernel):
                        src = _source(i * case.stride + u * case.dilation - left, length, case.mode)
                        if src is not None:
                            rows[g, b * out_len + i, ch * case.kernel + u] = x[b, g * cg + ch, src]
    return rows, out_len


def _x(case: Case, seed: int = 1) -> torch.Tensor:
    return torch.randn(N, case.cin, L, generator=torch.Generator().manual_seed(seed), dtype=DT)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_extractor_reproduces_conv1d(case: Case) -> None:
    mod, x = case.module(), _x(case)
    rows, out_len = patches(case, x)
    w = mod.weight.reshape(case.groups, case.cout // case.groups, -1)
    y = torch.einsum("gpk,gok->gpo", rows, w)  # (groups, N·L_out, out/groups)
    y = y.reshape(case.groups, N, out_len, -1).permute(1, 0, 3, 2).reshape(N, case.cout, out_len)
    if mod.bias is not None:
        y = y + mod.bias[:, None]
    torch.testing.assert_close(y, mod(x), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_factors_and_gradient_matrix_match_the_extractor(case: Case) -> None:
    mod, x = case.module(), _x(case)
    spec = kf.register(nn.Sequential(mod))["0"]
    rows, out_len = patches(case, x)
    if case.bias:
        rows = torch.cat([rows, torch.ones(*rows.shape[:-1], 1, dtype=DT)], dim=-1)
    a_oracle = rows.mT @ rows / rows.shape[1]
    a = kf.core.a_factor(spec, [x], dtype=DT)
    torch.testing.assert_close(
        a, a_oracle if case.groups > 1 else a_oracle[0], rtol=1e-12, atol=1e-12
    )
    r = torch.randn(N, case.cout, out_len, generator=torch.Generator().manual_seed(2), dtype=DT)
    gr = (
        r.reshape(N, case.groups, -1, out_len)
        .permute(1, 0, 3, 2)
        .reshape(case.groups, -1, case.cout // case.groups)
    )
    g_oracle = gr.mT @ gr / (N * 0.5**2)
    g = kf.core.g_factor(spec, [r], dtype=DT, batch_size=N, loss_scale=0.5)
    torch.testing.assert_close(
        g, g_oracle if case.groups > 1 else g_oracle[0], rtol=1e-12, atol=1e-12
    )
    # the gradient matrix is Σ gᵀ[a, 1] over positions (r is the output-gradient)
    y = mod(x)
    (dw, *db) = torch.autograd.grad(y, [mod.weight, *([mod.bias] if case.bias else [])], r)
    m = kf.blocks.grads_to_matrix(spec, dw, db[0] if db else None)
    m_oracle = gr.mT @ rows
    torch.testing.assert_close(
        m, m_oracle if case.groups > 1 else m_oracle[0], rtol=1e-12, atol=1e-12
    )
    w2, b2 = kf.blocks.matrix_to_grads(spec, m)
    assert torch.equal(w2, dw) and (b2 is None) == (not case.bias)


@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_one_output_position_is_exact_against_the_dense_fisher(method: str) -> None:
    """One example whose convolution has one output position: its Fisher block is exactly
    ``G ⊗ A``, and the eigen method solves ``(F + λI) x = vec(M)``."""
    torch.manual_seed(0)
    conv = nn.Conv1d(3, 2, 4, dilation=2).to(DT)  # span 7 over length 7: one position
    model = nn.Sequential(conv, nn.Flatten(), nn.Tanh(), nn.Linear(2, 3).to(DT))
    x = torch.randn(1, 3, 7, dtype=DT)
    y = torch.tensor([2])
    params = dict(model.named_parameters())
    lam = 0.05

    def loss_of(w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        out = functional_call(model, {**params, "0.weight": w, "0.bias": b}, (x,))
        return F.cross_entropy(out, y)

    dw, db = grad(loss_of, argnums=(0, 1))(params["0.weight"].detach(), params["0.bias"].detach())
    m = torch.cat([dw.reshape(2, -1), db[:, None]], dim=1).reshape(-1)
    fisher = torch.outer(m, m)
    _, grads, caps = kf.capture(model, params, x, lambda o: F.cross_entropy(o, y))
    state = kf.init(kf.register(model), compute_method=method, factor_dtype=DT, inv_dtype=DT)
    out, state = kf.update(state, grads, captures=caps, damping=lam, kl_clip=None)
    ls = state.layers["0"]
    torch.testing.assert_close(torch.kron(ls.g_factor, ls.a_factor), fisher, rtol=1e-10, atol=1e-14)
    if method == "eigen":
        want = torch.linalg.solve(fisher + lam * torch.eye(m.numel(), dtype=DT), m)
    else:
        g_inv = torch.linalg.inv(ls.g_factor + lam * torch.eye(2, dtype=DT))
        a_inv = torch.linalg.inv(ls.a_factor + lam * torch.eye(13, dtype=DT))
        want = torch.kron(g_inv, a_inv) @ m
    got = torch.cat([out["0.weight"].reshape(2, -1), out["0.bias"][:, None]], dim=1)
    torch.testing.assert_close(got.reshape(-1), want, rtol=1e-10, atol=1e-12)


def test_unbatched_input_and_bad_shapes() -> None:
    case = Case(3, padding=1)
    spec = kf.register(nn.Sequential(case.module()))["0"]
    x = _x(case)
    torch.testing.assert_close(
        kf.core.a_factor(spec, [x[:1]], dtype=DT), kf.core.a_factor(spec, [x[0]], dtype=DT)
    )
    with pytest.raises(
        ValueError, match=r"layer '0' \(conv1d\): input must have shape \(N, 4, L\)"
    ):
        kf.core.a_factor(spec, [torch.zeros(2, 3, 5)])
    with pytest.raises(ValueError, match=r"output-gradient must have shape \(N, 6, L\)"):
        kf.core.g_factor(spec, [torch.zeros(2, 5, 5)], batch_size=2, loss_scale=0.5)


def test_table_and_adapter() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv1d(2, 4, 3, padding="same"), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 8, 3)
    )
    table = kf.register(model)
    assert [s.kind for s in table.values()] == ["conv1d", "linear"]
    assert table["0"].factor_shapes == ((7, 7), (4, 4))
    pre = kf.KFACPreconditioner(model, damping=0.1)
    x, y = torch.randn(5, 2, 8), torch.randint(0, 3, (5,))
    F.cross_entropy(model(x), y).backward()
    before = model[0].weight.grad.clone()  # type: ignore[union-attr]
    pre.step()
    assert not torch.equal(before, model[0].weight.grad)  # type: ignore[arg-type]
