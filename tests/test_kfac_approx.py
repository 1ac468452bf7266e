"""``kfac_approx="expand"`` and ``"reduce"`` for weight-sharing layers (Eschenhagen et al.,
NeurIPS 2023), in float64:

- the paper's exact case for reduce: a deep linear network whose outputs are averaged over
  the shared positions before the loss, one example; K-FAC-reduce's ``G ⊗ A`` is then the
  dense Fisher (``torch.func.jacrev``), for a Linear on sequences and for a Conv2d;
- agreement with curvlinops (``KFACLinearOperator``, empirical Fisher) on a small
  transformer block of ``nn.Linear`` layers, expand and reduce: our A equals its input
  covariance and ``T ×`` our G its gradient covariance (curvlinops sums an example's ``T``
  per-token losses, we average them), 1e-10;
- the choice per layer, in the adapter and in checkpoints.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, jacrev

import kfac_func as kf

DT = torch.float64


class LinearSeq(nn.Module):
    """Two Linear layers on a sequence, outputs averaged over positions."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(3, 4).to(DT)
        self.fc2 = nn.Linear(4, 2).to(DT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.fc1(x)).mean(dim=1)


class ConvPool(nn.Module):
    """A Conv2d, spatial mean, then a Linear."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(2, 3, 2, padding=1).to(DT)
        self.fc = nn.Linear(3, 2).to(DT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.conv(x).mean(dim=(2, 3)))


def _dense_fisher(model: nn.Module, layer: str, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The example's empirical Fisher of ``[W | b]`` (row-major, bias last per row)."""
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        p = {**params, f"{layer}.weight": w, f"{layer}.bias": b}
        return 0.5 * (functional_call(model, p, (x,)) - t).pow(2).sum()

    dw, db = jacrev(loss, argnums=(0, 1))(params[f"{layer}.weight"], params[f"{layer}.bias"])
    m = torch.cat([dw.reshape(dw.shape[0], -1), db[:, None]], dim=1).reshape(-1)
    return torch.outer(m, m)


@pytest.mark.parametrize(
    ("make", "shape", "layers"),
    [(LinearSeq, (1, 5, 3), ("fc1", "fc2")), (ConvPool, (1, 2, 3, 4), ("conv",))],
    ids=["linear", "conv2d"],
)
def test_reduce_is_exact_for_a_deep_linear_network_with_averaged_outputs(
    make: type[nn.Module], shape: tuple[int, ...], layers: tuple[str, ...]
) -> None:
    model = make()
    g = torch.Generator().manual_seed(1)
    x, t = torch.randn(shape, generator=g, dtype=DT), torch.randn(1, 2, generator=g, dtype=DT)
    table = kf.register(model, kfac_approx="reduce")
    params = dict(model.named_parameters())
    _, grads, caps = kf.capture(
        model, params, x, lambda o: 0.5 * (o - t).pow(2).sum(), loss_reduction="sum"
    )
    state = kf.step.accumulate_factors(kf.init(table, factor_dtype=DT), caps)
    expand = kf.step.accumulate_factors(kf.init(kf.register(model), factor_dtype=DT), caps)
    for name in layers:
        ls = state.layers[name]
        dense = _dense_fisher(model, name, x, t)
        torch.testing.assert_close(
            torch.kron(ls.g_factor, ls.a_factor), dense, rtol=1e-10, atol=1e-13
        )
        other = expand.layers[name]
        assert not torch.allclose(torch.kron(other.g_factor, other.a_factor), dense)
    # and the preconditioned gradient solves the dense system
    lam = 0.1
    out, _ = kf.update(
        kf.init(table, factor_dtype=DT, inv_dtype=DT),
        grads,
        captures=caps,
        damping=lam,
        kl_clip=None,
    )
    name = layers[0]
    dense = _dense_fisher(model, name, x, t)
    w, b = grads[f"{name}.weight"], grads[f"{name}.bias"]
    m = torch.cat([w.reshape(w.shape[0], -1), b[:, None]], dim=1)
    want = torch.linalg.solve(dense + lam * torch.eye(m.numel(), dtype=DT), m.reshape(-1))
    got = torch.cat(
        [out[f"{name}.weight"].reshape(w.shape[0], -1), out[f"{name}.bias"][:, None]], 1
    )
    torch.testing.assert_close(got.reshape(-1), want, rtol=1e-10, atol=1e-12)


T, D, C = 4, 6, 5


class Block(nn.Module):
    """A pre-norm transformer block of nn.Linear layers (causal self-attention + MLP) and
    a head; outputs ``(N, C, T)`` as cross-entropy wants them."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.query, self.key, self.value = (nn.Linear(D, D) for _ in range(3))
        self.proj = nn.Linear(D, D)
        self.fc1, self.fc2 = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)
        self.head = nn.Linear(D, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.query(x), self.key(x), self.value(x)
        att = q @ k.transpose(-2, -1) / math.sqrt(D)
        mask = torch.ones(T, T, dtype=torch.bool).triu(1)
        att = att.masked_fill(mask, float("-inf")).softmax(dim=-1)
        x = x + self.proj(att @ v)
        x = x + self.fc2(F.gelu(self.fc1(x)))
        return self.head(x).transpose(1, 2)


@pytest.mark.parametrize("approx", ["expand", "reduce"])
def test_factors_equal_curvlinops(approx: str) -> None:
    curvlinops = pytest.importorskip("curvlinops")
    model = Block().to(DT)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, T, D, generator=g, dtype=DT)
    y = torch.randint(0, C, (3, T), generator=g)
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    op = curvlinops.KFACLinearOperator(
        model,
        nn.CrossEntropyLoss(),
        [p for _, p in model.named_parameters()],
        [(x, y)],
        fisher_type=curvlinops.kfac.FisherType.EMPIRICAL,
        kfac_approx=approx,
        separate_weight_and_bias=False,
        check_deterministic=False,
    )
    op.compute_kronecker_factors()
    table = kf.register(model, kfac_approx=approx)
    _, _, caps = kf.capture(
        model, dict(model.named_parameters()), x, lambda o: F.cross_entropy(o, y)
    )
    state = kf.step.accumulate_factors(kf.init(table, factor_dtype=DT), caps)
    for name in names:
        ls = state.layers[name]
        torch.testing.assert_close(ls.a_factor, op._input_covariances[name], rtol=1e-10, atol=1e-13)
        torch.testing.assert_close(
            T * ls.g_factor, op._gradient_covariances[name], rtol=1e-10, atol=1e-13
        )


def test_per_layer_choice_adapter_and_checkpoints() -> None:
    model = LinearSeq()
    table = kf.register(model, kfac_approx={"fc2": "reduce"})
    assert [table[n].block.reduced(table[n]) for n in ("fc1", "fc2")] == [False, True]
    assert "reduce" in str(table)
    with pytest.raises(ValueError, match="kfac_approx must be one of"):
        kf.register(model, kfac_approx="shrink")
    x = torch.randn(4, 5, 3, dtype=DT)
    t = torch.randn(4, 2, dtype=DT)
    pre = kf.KFACPreconditioner(
        model, settings=kf.Settings(kfac_approx="reduce", scaling="fisher"), inv_dtype=DT
    )
    F.mse_loss(model(x), t).backward()
    pre.step()
    state = kf.init(kf.register(model, kfac_approx="reduce"), factor_dtype=DT, inv_dtype=DT)
    _, grads, caps = kf.capture(
        model, dict(model.named_parameters()), x, lambda o: F.mse_loss(o, t)
    )
    _, state = kf.update(state, grads, captures=caps)
    for name in ("fc1", "fc2"):
        torch.testing.assert_close(pre.state.layers[name].g_factor, state.layers[name].g_factor)
    back = kf.state_from_dict(kf.state_to_dict(state), like=state)
    assert back.layers["fc1"].spec.option("kfac_approx") == "reduce"
    expand = kf.init(kf.register(model), factor_dtype=DT, inv_dtype=DT)
    with pytest.raises(kf.checkpoint.CheckpointMismatchError, match="options"):
        kf.state_from_dict(kf.state_to_dict(state), like=expand)
