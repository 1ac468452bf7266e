"""Parameters that a module's forward uses directly (:mod:`kfac_func.blocks.used_weights`),
in float64.

The toy mixer is Mamba's pattern: a depthwise ``conv`` applied as
``F.conv1d(u, conv.weight.squeeze(1).unsqueeze(1), conv.bias, padding=K-1, groups=C)``, a
``proj`` applied as ``proj.weight @ z`` with its bias added to the product apart, and
its own scale ``D`` as ``u * D.float()[None, :, None]`` (registered for this class as
for transformers' Mamba mixers). Its twin computes the same with the modules called (the
convolution itself, the Linear with its bias): the factors and the preconditioned
gradients of the two must be equal, and the product's ``A`` is the mean of ``[z, 1]``'s
outer products over its rows. With one position per example the scale's factor is its
exact Fisher diagonal, ``(1/N) Σₙ (∂ℓₙ/∂D)²``, from per-example gradients taken with
autograd. Other uses of the parameters are refused, naming the layer.
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
from kfac_func.blocks import used_weights
from kfac_func.blocks.mapped import class_path

DT = torch.float64
N, T, D, C, R, K, CLS = 4, 6, 5, 3, 2, 3, 4


class Mixer(nn.Module):
    """Uses ``conv``'s and ``proj``'s weights and its own ``D`` in its forward, never
    calling ``conv`` or ``proj``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(D, C + R, dtype=DT)
        self.conv = nn.Conv1d(C, C, K, groups=C, padding=K - 1, dtype=DT)
        self.proj = nn.Linear(R, C, dtype=DT)
        self.D = nn.Parameter(torch.randn(C, dtype=DT))
        self.out = nn.Linear(C, CLS, dtype=DT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u, z = self.inp(x).split([C, R], dim=-1)
        w = self.conv.weight.squeeze(1)  # as Mamba hands it to its convolution
        a = F.conv1d(u.mT, w.unsqueeze(1), self.conv.bias, padding=K - 1, groups=C)
        dt = self.proj.weight @ z.mT
        dt = F.softplus(dt + self.proj.bias[:, None])
        h = torch.tanh(a[..., : x.shape[1]]) * dt + u.mT * self.D.float()[None, :, None]
        return self.out(h.mT)


class Called(nn.Module):
    """The same map with the modules called (``D`` as the mixer uses it)."""

    def __init__(self, mixer: Mixer) -> None:
        super().__init__()
        self.inp, self.conv, self.proj, self.out = mixer.inp, mixer.conv, mixer.proj, mixer.out
        self.D = mixer.D

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u, z = self.inp(x).split([C, R], dim=-1)
        a = self.conv(u.mT)[..., : x.shape[1]]
        h = torch.tanh(a) * F.softplus(self.proj(z).mT) + u.mT * self.D.float()[None, :, None]
        return self.out(h.mT)


class Net(nn.Module):
    def __init__(self, mixer: nn.Module) -> None:
        super().__init__()
        self.mixer = mixer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mixer(x)


class Odd(Mixer):
    """The mixer with the uses of ``use(mixer, u, z)`` in place of its own."""

    def __init__(self, use: Callable[[Mixer, torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.use = use

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u, z = self.inp(x).split([C, R], dim=-1)
        # the uses the source shows: self.conv.weight, self.proj.weight @ z, self.proj.bias
        return self.out(self.use(self, u.mT, z.mT).mT)


@pytest.fixture(autouse=True)
def _scales(monkeypatch: pytest.MonkeyPatch) -> None:
    """``D`` of the toy mixers registered as transformers' Mamba mixers' is."""
    for cls in (Mixer, Odd):
        monkeypatch.setitem(used_weights.OWN_SCALES, class_path(cls), ("D",))


def _batch(t: int = T) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(N, t, D, generator=g, dtype=DT), torch.randint(0, CLS, (N, t), generator=g)


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, CLS), y.reshape(-1))


def _factors(model: nn.Module, t: int = T, **kw: Any) -> kf.KFACState:
    x, y = _batch(t)
    params = dict(model.named_parameters())
    _, _, caps = kf.capture(model, params, x, lambda o: _loss(o, y))
    return kf.step.accumulate_factors(kf.init(kf.register(model), factor_dtype=DT, **kw), caps)


def test_registered_through_the_module_that_uses_them() -> None:
    table = kf.register(Net(Mixer()))
    conv, proj, scale = table["mixer.conv"], table["mixer.proj"], table["mixer.D"]
    assert (conv.kind, conv.module, conv.bias) == ("conv1d", "mixer", "mixer.conv.bias")
    assert (proj.kind, proj.module, proj.bias) == ("linear", "mixer", "mixer.proj.bias")
    assert proj.factor_shapes == ((R + 1, R + 1), (C, C))
    assert (scale.kind, scale.module, scale.factor_shapes) == (
        "channel_scale",
        "mixer",
        ((C, 1), (C, 1, 1)),
    )
    assert table["mixer.inp"].module == "mixer.inp"  # called: its own hooks
    assert "mixer.D" not in kf.register(Net(Called(Mixer())))  # a class not named


def test_a_product_whose_bias_the_source_does_not_name_keeps_its_weight_alone() -> None:
    class Plain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(2, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.proj.weight @ x

    table = kf.register(Net(Plain()))
    assert table["mixer.proj"].bias is None and "bias to the other optimizer" in str(table)


@pytest.mark.parametrize("scaling", ["kfac-pytorch", "fisher"])
def test_factors_equal_those_of_the_modules_called(scaling: str) -> None:
    mixer = Mixer()
    used, called = (
        _factors(Net(mixer), scaling=scaling),
        _factors(Net(Called(mixer)), scaling=scaling),
    )
    for name in ("mixer.conv", "mixer.proj"):
        for side in ("a_factor", "g_factor"):
            got, want = getattr(used.layers[name], side), getattr(called.layers[name], side)
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-15, msg=f"{name} {side}")
    if scaling != "fisher":
        return
    # the product's A under "fisher": the mean of [z, 1] [z, 1]ᵀ over its N·T rows, z the
    # input's last R features
    x, _ = _batch()
    z = mixer.inp(x)[..., C:].detach().reshape(-1, R)
    z1 = torch.cat([z, torch.ones(len(z), 1, dtype=DT)], dim=1)
    torch.testing.assert_close(
        used.layers["mixer.proj"].a_factor, z1.T @ z1 / (N * T), rtol=1e-12, atol=0
    )


def test_a_channel_scale_at_one_position_is_its_exact_fisher_diagonal() -> None:
    mixer = Mixer()
    state = _factors(Net(mixer), t=1, scaling="fisher")
    x, y = _batch(1)
    per_example = []
    for n in range(N):  # the gradient of example n's own loss, by autograd
        (g,) = torch.autograd.grad(_loss(Net(mixer)(x[n : n + 1]), y[n : n + 1]), mixer.D)
        per_example.append(g)
    fisher = torch.stack(per_example).pow(2).mean(0)
    # the forward casts D to float32, so autograd's per-example gradients (the oracle's)
    # are rounded to float32 (relative 6e-8), K-FAC's rows are not
    g_factor = state.layers["mixer.D"].g_factor
    torch.testing.assert_close(g_factor.reshape(C), fisher, rtol=2e-7, atol=1e-15)


def test_preconditioned_gradients_equal_those_of_the_modules_called() -> None:
    x, y = _batch()
    grads = {}
    for which in ("used", "called"):
        mixer = Mixer()
        model = Net(mixer if which == "used" else Called(mixer))
        pre = kf.KFACPreconditioner(
            model, factor_dtype=DT, inv_dtype=DT, damping=0.01, kl_clip=None
        )  # no kl_clip: the used model's D adds a term
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            _loss(model(x), y).backward()
            pre.step()
        grads[which] = {n: p.grad.clone() for n, p in model.named_parameters()}
    for name in ("conv.weight", "conv.bias", "proj.weight", "proj.bias", "out.weight"):
        got, want = grads["used"][f"mixer.{name}"], grads["called"][f"mixer.{name}"]
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-14, msg=name)


def _conv(m: Mixer, u: torch.Tensor, **kw: Any) -> torch.Tensor:
    a = F.conv1d(u, m.conv.weight, m.conv.bias, **{"padding": K - 1, "groups": C, **kw})
    return a[..., : u.shape[-1]]


def _prod(m: Mixer, z: torch.Tensor) -> torch.Tensor:
    return m.proj.weight @ z + m.proj.bias[:, None]


def _mix(m: Mixer, a: torch.Tensor, dt: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return torch.tanh(a) * F.softplus(dt) + u * m.D[None, :, None]


REFUSED: dict[str, tuple[Callable[[Mixer, torch.Tensor, torch.Tensor], Any], str, str]] = {
    "conv_twice": (
        lambda m, u, z: _mix(m, _conv(m, u) + _conv(m, u), _prod(m, z), u),
        "mixer.conv",
        "2 times, not once",
    ),
    "conv_other_padding": (
        lambda m, u, z: _mix(m, _conv(m, u, padding=1), _prod(m, z), u),
        "mixer.conv",
        "otherwise (in conv1d)",
    ),
    "proj_times_weight": (
        lambda m, u, z: _mix(m, _conv(m, u), (m.proj.weight * 2) @ z + m.proj.bias[:, None], u),
        "mixer.proj",
        "uses its weight otherwise (in mul)",
    ),
    "proj_transposed": (
        lambda m, u, z: _mix(m, _conv(m, u), (z.mT @ m.proj.weight.T).mT, u),
        "mixer.proj",
        "otherwise",
    ),
    "bias_added_twice": (
        lambda m, u, z: _mix(m, _conv(m, u), _prod(m, z) + m.proj.bias[:, None], u),
        "mixer.proj",
        "uses its bias otherwise (in add)",
    ),
    "bias_not_added": (
        lambda m, u, z: _mix(m, _conv(m, u), m.proj.weight @ z, u),
        "mixer.proj",
        "added its bias to its product 0 times",
    ),
    "scale_added": (
        lambda m, u, z: torch.tanh(_conv(m, u)) * _prod(m, z) + (u + m.D[None, :, None]),
        "mixer.D",
        "uses its D otherwise (in add)",
    ),
    "scale_twice": (
        lambda m, u, z: _mix(m, _conv(m, u), _prod(m, z), u) + u * m.D[None, :, None],
        "mixer.D",
        "2 times, not once",
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


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_other_uses_are_refused_naming_the_layer(case: str) -> None:
    use, layer, why = REFUSED[case]
    x, y = _batch()
    model = Net(Odd(use))
    params = dict(model.named_parameters())
    with pytest.raises(ValueError, match=re.escape(why)) as err:
        kf.capture(model, params, x, lambda o: _loss(o, y))
    skip = "^" + re.escape(layer) + "$"
    assert f"layer '{layer}'" in str(err.value) and f"skip_layers=[{skip!r}]" in str(err.value)
    # the preconditioners leave it to the other optimizer, naming it, and keep the others
    model = Net(Odd(use))
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
    for other in {"mixer.conv", "mixer.proj", "mixer.D"} - {layer}:
        assert pre.state.layers[other].factor_updates == 2, other
