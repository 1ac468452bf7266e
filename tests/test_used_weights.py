"""Layers whose parent's forward uses their weight directly
(:mod:`kfac_func.blocks.used_weights`), in float64.

The toy mixer is Mamba's pattern: a depthwise ``conv`` applied as
``F.conv1d(u, conv.weight.squeeze(1).unsqueeze(1), conv.bias, padding=K-1, groups=C)`` and
a ``proj`` applied as ``proj.weight @ z`` with its bias added apart. Its twin computes the
same with the modules called (the convolution itself, and a bias-less Linear for the
product): the factors and the preconditioned gradients of the two must be equal, and the
product's ``A`` is the mean of ``z zᵀ`` over its rows (no ones: its bias is left to the
other optimizer). Other uses of the weight are refused, naming the layer.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kfac_func as kf

DT = torch.float64
N, T, D, C, R, K, CLS = 4, 6, 5, 3, 2, 3, 4


class Mixer(nn.Module):
    """Uses ``conv``'s and ``proj``'s weights in its forward, never calling them."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(D, C + R, dtype=DT)
        self.conv = nn.Conv1d(C, C, K, groups=C, padding=K - 1, dtype=DT)
        self.proj = nn.Linear(R, C, dtype=DT)
        self.out = nn.Linear(C, CLS, dtype=DT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u, z = self.inp(x).split([C, R], dim=-1)
        w = self.conv.weight.squeeze(1)  # as Mamba hands it to its convolution
        u = F.conv1d(u.mT, w.unsqueeze(1), self.conv.bias, padding=K - 1, groups=C)[..., :T]
        dt = self.proj.weight @ z.mT
        dt = F.softplus(dt + self.proj.bias[:, None])
        return self.out((torch.tanh(u) * dt).mT)


class Called(nn.Module):
    """The same map with the modules called (``proj_w`` a bias-less Linear)."""

    def __init__(self, mixer: Mixer) -> None:
        super().__init__()
        self.inp, self.conv, self.out = mixer.inp, mixer.conv, mixer.out
        self.proj_w = nn.Linear(R, C, bias=False, dtype=DT)
        self.proj_b = nn.Parameter(mixer.proj.bias.detach().clone())
        with torch.no_grad():
            self.proj_w.weight.copy_(mixer.proj.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u, z = self.inp(x).split([C, R], dim=-1)
        u = self.conv(u.mT)[..., :T]
        dt = F.softplus(self.proj_w(z).mT + self.proj_b[:, None])
        return self.out((torch.tanh(u) * dt).mT)


class Net(nn.Module):
    def __init__(self, mixer: nn.Module) -> None:
        super().__init__()
        self.mixer = mixer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mixer(x)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(N, T, D, generator=g, dtype=DT), torch.randint(0, CLS, (N, T), generator=g)


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, CLS), y.reshape(-1))


def _factors(model: nn.Module, **kw: Any) -> kf.KFACState:
    x, y = _batch()
    params = dict(model.named_parameters())
    _, _, caps = kf.capture(model, params, x, lambda o: _loss(o, y))
    return kf.step.accumulate_factors(kf.init(kf.register(model), factor_dtype=DT, **kw), caps)


def test_registered_through_the_parent_the_product_without_its_bias() -> None:
    table = kf.register(Net(Mixer()))
    conv, proj = table["mixer.conv"], table["mixer.proj"]
    assert (conv.kind, conv.module, conv.bias) == ("conv1d", "mixer", "mixer.conv.bias")
    assert (proj.kind, proj.module, proj.bias) == ("linear", "mixer", None)
    assert proj.factor_shapes == ((R, R), (C, C))
    assert "bias to the other optimizer" in str(table)
    assert table["mixer.inp"].module == "mixer.inp"  # called: its own hooks


@pytest.mark.parametrize("scaling", ["kfac-pytorch", "fisher"])
def test_factors_equal_those_of_the_modules_called(scaling: str) -> None:
    mixer = Mixer()
    used, called = (
        _factors(Net(mixer), scaling=scaling),
        _factors(Net(Called(mixer)), scaling=scaling),
    )
    for mine, twin in (("mixer.conv", "mixer.conv"), ("mixer.proj", "mixer.proj_w")):
        for side in ("a_factor", "g_factor"):
            got, want = getattr(used.layers[mine], side), getattr(called.layers[twin], side)
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-15, msg=f"{mine} {side}")
    if scaling != "fisher":
        return
    # the product's A under "fisher": the mean of z zᵀ over its N·T rows, z the input's
    # last R features
    x, _ = _batch()
    z = mixer.inp(x)[..., C:].detach().reshape(-1, R)
    torch.testing.assert_close(
        used.layers["mixer.proj"].a_factor, z.T @ z / (N * T), rtol=1e-12, atol=0
    )


def test_preconditioned_gradients_equal_those_of_the_modules_called() -> None:
    x, y = _batch()
    grads = {}
    for which in ("used", "called"):
        mixer = Mixer()
        model = Net(mixer if which == "used" else Called(mixer))
        pre = kf.KFACPreconditioner(model, factor_dtype=DT, inv_dtype=DT, damping=0.01)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            _loss(model(x), y).backward()
            pre.step()
        grads[which] = {n: p.grad.clone() for n, p in model.named_parameters()}
    for mine, twin in (
        ("mixer.conv.weight", "mixer.conv.weight"),
        ("mixer.conv.bias", "mixer.conv.bias"),
        ("mixer.proj.weight", "mixer.proj_w.weight"),
        ("mixer.proj.bias", "mixer.proj_b"),  # not preconditioned in either
        ("mixer.out.weight", "mixer.out.weight"),
    ):
        torch.testing.assert_close(
            grads["used"][mine], grads["called"][twin], rtol=1e-10, atol=1e-14
        )


def _conv(m: Mixer, u: torch.Tensor, **kw: Any) -> torch.Tensor:
    return F.conv1d(u, m.conv.weight, m.conv.bias, **{"padding": K - 1, "groups": C, **kw})


REFUSED: dict[str, tuple[Callable[[Mixer, torch.Tensor, torch.Tensor], Any], str, str]] = {
    "twice": (
        lambda m, u, z: (_conv(m, u) + _conv(m, u), m.proj.weight @ z),
        "mixer.conv",
        "2 times, not once",
    ),
    "other_padding": (
        lambda m, u, z: (_conv(m, u, padding=1), m.proj.weight @ z),
        "mixer.conv",
        "otherwise (in conv1d)",
    ),
    "times_weight": (
        lambda m, u, z: (_conv(m, u), (m.proj.weight * 2) @ z),
        "mixer.proj",
        "uses its weight otherwise (in mul)",
    ),
    "transposed": (
        lambda m, u, z: (_conv(m, u), (z.mT @ m.proj.weight.T).mT),
        "mixer.proj",
        "otherwise",
    ),
}


def test_a_convolution_that_pads_otherwise_than_with_zeros_is_refused() -> None:
    """A child convolution with ``padding_mode="reflect"`` pads before its convolution:
    ``F.conv1d`` with its padding computes another map."""
    model = Net(Mixer())
    model.mixer.conv.padding_mode = "reflect"
    x, y = _batch()
    with pytest.raises(ValueError, match=r"layer 'mixer\.conv'.*otherwise \(in conv1d\)"):
        kf.capture(model, dict(model.named_parameters()), x, lambda o: _loss(o, y))


def _odd(forward: Callable[[Mixer, torch.Tensor, torch.Tensor], Any]) -> nn.Module:
    class Odd(Mixer):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            u, z = self.inp(x).split([C, R], dim=-1)
            # the uses the source shows: self.conv.weight, self.proj.weight @ z
            a, b = forward(self, u.mT, z.mT)
            return self.out(
                (a[..., :T] + b[..., : a.shape[-1]][..., :T] + self.proj.bias[:, None]).mT
            )

    return Net(Odd())


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_other_uses_of_the_weight_are_refused_naming_the_layer(case: str) -> None:
    forward, layer, why = REFUSED[case]
    x, y = _batch()
    model = _odd(forward)
    params = dict(model.named_parameters())
    with pytest.raises(ValueError, match=re.escape(why)) as err:
        kf.capture(model, params, x, lambda o: _loss(o, y))
    skip = "^" + re.escape(layer) + "$"
    assert f"layer '{layer}'" in str(err.value) and f"skip_layers=[{skip!r}]" in str(err.value)
    # the preconditioners leave it to the other optimizer, naming it, and keep the other
    model = _odd(forward)
    opt = kf.KFAC(model, lr=1e-3, damping=0.01)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            opt.zero_grad()
            _loss(model(x), y).backward()
            opt.step()
    assert any(layer in str(w.message) and why in str(w.message) for w in caught)
    pre = opt.preconditioner
    assert layer not in pre.layers and why in pre.layers.skipped[layer]
    other = ({"mixer.conv", "mixer.proj"} - {layer}).pop()
    assert other in pre.layers and pre.state.layers[other].factor_updates == 2
