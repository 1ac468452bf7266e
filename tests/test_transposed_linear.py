"""Transposed linears (GPT-2's ``Conv1D``: ``y = x @ W + b``, ``W`` of shape ``(in, out)``):
registered by class name, and everything K-FAC computes for them equals what it computes
for the ``nn.Linear`` with weight ``Wᵀ``, transposed back."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import kfac_func as kf

DT = torch.float64


class Conv1D(nn.Module):
    """As Hugging Face transformers writes it (``transformers.pytorch_utils.Conv1D``)."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf, dtype=DT) * 0.3)
        self.bias = nn.Parameter(torch.randn(nf, dtype=DT) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size_out = (*x.size()[:-1], self.nf)
        x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return x.view(size_out)


def _pair() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    ours = nn.Sequential(Conv1D(6, 4), nn.Tanh(), Conv1D(3, 6))
    ref = nn.Sequential(nn.Linear(4, 6, dtype=DT), nn.Tanh(), nn.Linear(6, 3, dtype=DT))
    with torch.no_grad():
        for i in (0, 2):
            ref[i].weight.copy_(ours[i].weight.T)
            ref[i].bias.copy_(ours[i].bias)
    return ours, ref


def test_registered_by_class_name() -> None:
    table = kf.register(_pair()[0])
    assert [(s.kind, s.in_dim, s.out_dim) for s in table.values()] == [
        ("transposed_linear", 4, 6),
        ("transposed_linear", 6, 3),
    ]
    assert table["0"].weight_shape == (4, 6)


def test_update_and_adapter_equal_the_linear_layers_transposed() -> None:
    ours, ref = _pair()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(5, 7, 4, generator=g, dtype=DT), torch.randint(0, 3, (5, 7), generator=g)

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.reshape(-1, 3), y.reshape(-1))

    results = []
    for model in (ours, ref):
        state = kf.init(kf.register(model), factor_dtype=DT, inv_dtype=DT)
        _, grads, caps = kf.capture(model, dict(model.named_parameters()), x, loss_fn)
        out, state = kf.update(state, grads, captures=caps, damping=0.01)
        results.append((out, state))
    (o, s), (r, t) = results
    for i in ("0", "2"):
        # the two forwards round differently (addmm vs linear): equal to float64 rounding
        torch.testing.assert_close(s.layers[i].a_factor, t.layers[i].a_factor, rtol=1e-12, atol=0)
        torch.testing.assert_close(s.layers[i].g_factor, t.layers[i].g_factor, rtol=1e-12, atol=0)
        torch.testing.assert_close(o[f"{i}.weight"], r[f"{i}.weight"].T, rtol=1e-12, atol=1e-15)
        torch.testing.assert_close(o[f"{i}.bias"], r[f"{i}.bias"], rtol=1e-12, atol=1e-15)
    pres = [kf.KFACPreconditioner(m, damping=0.01) for m in (ours, ref)]
    for model, pre in zip((ours, ref), pres):
        loss_fn(model(x)).backward()
        pre.step()
    for i in (0, 2):
        gw, rw = ours[i].weight.grad, ref[i].weight.grad
        assert gw is not None and rw is not None
        torch.testing.assert_close(gw, rw.T, rtol=1e-10, atol=1e-14)
