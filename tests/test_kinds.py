"""``register(..., kinds=...)``: module classes of a model's own (nanoGPT's ``LayerNorm``,
transformers' ``LlamaRMSNorm``) mapped to a registered kind give the factors of the torch
module of that kind on the same weights; wrong mappings fail with the module's name; skip
messages name the class with its module path and hint at ``kinds=``."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from numerics import named
from settings_keywords import with_settings
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm

import kfac_func as kf

F64 = torch.float64


class LayerNorm(nn.Module):
    """nanoGPT's (model.py): LayerNorm with an optional bias, no ``eps`` attribute."""

    def __init__(self, ndim: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(input, self.weight.shape, self.weight, self.bias, 1e-5)


class OwnRMSNorm(LlamaRMSNorm):
    """A model's own subclass of a known class: not known itself (its forward may differ)."""


class MyRMSNorm(nn.Module):
    """An RMS norm (no centring), with an ``eps`` attribute."""

    def __init__(self, ndim: int) -> None:
        super().__init__()
        self.eps = 1e-6
        self.weight = nn.Parameter(torch.ones(ndim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _net(norm: nn.Module, dtype: torch.dtype) -> nn.Sequential:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), norm, nn.Linear(6, 3)).to(dtype)
    with torch.no_grad():
        for p in net[1].parameters():
            p.copy_(torch.randn_like(p))
    return net


def _twin(net: nn.Sequential, norm: nn.Module) -> nn.Sequential:
    """``net`` with its norm replaced by ``norm``, carrying the same weights."""
    twin = nn.Sequential(net[0], norm.to(net[0].weight.dtype), net[2])
    with torch.no_grad():
        for name, p in net[1].named_parameters():
            twin[1].get_parameter(name).copy_(p)
    return twin


def _factors(
    net: nn.Module, x: torch.Tensor, loss_fn: Any, layers: kf.LayerTable
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The factors after one ``kf.capture`` + ``kf.update`` (float64 factors)."""
    state = kf.init(layers, factor_dtype=F64)
    _, grads, caps = kf.capture(net, dict(net.named_parameters()), x, loss_fn, layers=layers)
    _, state = kf.update(state, grads, captures=caps, damping=0.1, update_inverses=False)
    return {n: (s.a_factor, s.g_factor) for n, s in state.layers.items()}


def _adapter_factors(
    net: nn.Module, x: torch.Tensor, loss_fn: Any, **kwargs: Any
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    pre = kf.KFACPreconditioner(net, factor_dtype=F64, **with_settings(**kwargs))
    loss_fn(net(x)).backward()
    pre.step()
    out = {n: (s.a_factor, s.g_factor) for n, s in pre.state.layers.items()}
    pre.remove()
    return out


@pytest.mark.parametrize("bias", [True, False])
def test_nanogpt_layer_norm_mapped_equals_nn_layer_norm(bias: bool) -> None:
    net = _net(LayerNorm(6, bias), F64)
    ref = _twin(net, nn.LayerNorm(6, bias=bias))
    x, y = torch.randn(5, 7, 4, dtype=F64), torch.randint(0, 3, (5, 7))

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.reshape(-1, 3), y.reshape(-1))

    layers = kf.register(net, kinds={LayerNorm: "layer_norm"})
    assert layers["1"].kind == "layer_norm" and layers["1"].option("eps") == 1e-5
    assert layers["1"].has_bias == bias
    want = _factors(ref, x, loss_fn, kf.register(ref))
    got = _factors(net, x, loss_fn, layers)
    assert list(got) == list(want) == ["0", "1", "2"]
    for name in want:
        for g, w in zip(got[name], want[name]):
            assert torch.equal(g, w), name
    # the adapter, given the same mapping, gives the factors it gives the torch module
    adapter = _adapter_factors(net, x, loss_fn, kinds={LayerNorm: "layer_norm"})
    adapter_ref = _adapter_factors(ref, x, loss_fn)
    assert list(adapter) == list(adapter_ref) == ["0", "1", "2"]
    for name in adapter:
        for g, w in zip(adapter[name], adapter_ref[name]):
            assert torch.equal(g, w), name


def test_llama_rms_norm_mapped_equals_nn_rms_norm() -> None:
    # LlamaRMSNorm computes in float32 whatever its input: the nets are float32; with a
    # loss linear in the output the norm's output-gradient does not depend on its forward
    net = _net(LlamaRMSNorm(6, eps=1e-6), torch.float32)
    ref = _twin(net, nn.RMSNorm(6, eps=1e-6))
    x = torch.randn(5, 7, 4)
    c = torch.randn(5, 7, 3)

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return (out * c).sum() / 5

    assert kf.register(net)["1"].kind == "rms_norm"  # a known class: no kinds= needed
    assert "1" not in kf.register(nn.Sequential(nn.Linear(4, 6), OwnRMSNorm(6)))
    layers = kf.register(net, kinds={LlamaRMSNorm: "rms_norm"})
    assert layers["1"].kind == "rms_norm" and layers["1"].option("eps") == 1e-6
    want = _factors(ref, x, loss_fn, kf.register(ref))
    got = _factors(net, x, loss_fn, layers)
    assert list(got) == list(want)
    for g, w in zip(got["1"], want["1"]):
        assert torch.equal(g, w)
    for name in ("0", "2"):  # the norm's forward and backward round differently
        for g, w in zip(got[name], want[name]):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7)


def test_eps_given_in_kinds_overrides_the_default() -> None:
    class LN(nn.Module):  # nanoGPT-like with another eps
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(6, dtype=F64))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.layer_norm(x, (6,), self.weight, None, 0.5)

    net = _net(LN(), F64)
    x = torch.randn(5, 4, dtype=F64)
    with pytest.raises(ValueError, match=r"module '1' \(.*LN\) is mapped to kind 'layer_norm'"):
        kf.capture(
            net,
            dict(net.named_parameters()),
            x,
            lambda o: o.sum(),
            layers=kf.register(net, kinds={LN: "layer_norm"}),
        )
    layers = kf.register(net, kinds={LN: ("layer_norm", {"eps": 0.5})})
    ref = _twin(net, nn.LayerNorm(6, eps=0.5, bias=False))
    got = _factors(net, x, lambda o: o.square().sum(), layers)
    want = _factors(ref, x, lambda o: o.square().sum(), kf.register(ref))
    for g, w in zip(got["1"], want["1"]):
        assert torch.equal(g, w)


def test_wrong_mapping_raises_naming_the_module() -> None:
    net = _net(MyRMSNorm(6), F64)
    x = torch.randn(5, 4, dtype=F64)
    layers = kf.register(net, kinds={MyRMSNorm: "layer_norm"})  # parameters fit
    pattern = (
        rf"module '1' \({MyRMSNorm.__module__}.MyRMSNorm\) is mapped to kind 'layer_norm' "
        r"by kinds=, but on its first call its output differs .* by up to \d"
    )
    with pytest.raises(ValueError, match=pattern):
        kf.capture(net, dict(net.named_parameters()), x, lambda o: o.sum(), layers=layers)
    pre = kf.KFACPreconditioner(net, settings=kf.Settings(kinds={MyRMSNorm: "layer_norm"}))
    with pytest.raises(ValueError, match=pattern):
        net(x)
    pre.remove()
    # mapped to what it computes, it passes
    ok = kf.register(net, kinds={MyRMSNorm: "rms_norm"})
    kf.capture(net, dict(net.named_parameters()), x, lambda o: o.sum(), layers=ok)


def test_mapped_linear_forward_that_differs_raises() -> None:
    class Dense(nn.Module):  # weight (out, in), but the forward adds a constant
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(3, 4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ self.weight.T + 0.1

    model = nn.Sequential(Dense())
    layers = kf.register(model, kinds={Dense: "linear"})
    assert (layers["0"].in_dim, layers["0"].out_dim, layers["0"].bias) == (4, 3, None)
    with pytest.raises(ValueError, match=r"module '0' \(.*Dense\).*'linear'.*by up to 0.1"):
        kf.capture(
            model,
            dict(model.named_parameters()),
            torch.randn(2, 4),
            lambda o: o.sum(),
            layers=layers,
        )


@pytest.mark.parametrize(
    ("kinds", "error", "message"),
    [
        ({LayerNorm: "attention"}, ValueError, r"kind 'attention' cannot be given .*'layer_norm'"),
        ({LayerNorm: "no_such"}, ValueError, r"unknown layer kind 'no_such'"),
        ({LayerNorm: ("layer_norm", {"epsilon": 1})}, ValueError, r"options \['eps', 'offset'\]"),
        ({LayerNorm: ("layer_norm", {"eps": -1.0})}, ValueError, r"eps must be a number >= 0"),
        ({LayerNorm: "linear"}, ValueError, r"module '1' .* its weight has shape \(6,\), not 2-d"),
        ({LayerNorm: 3}, TypeError, r"expected a kind name or \(kind"),
        ({"LayerNorm": "layer_norm"}, TypeError, r"keys must be nn.Module classes"),
    ],
)
def test_bad_kinds(kinds: Any, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        kf.register(_net(LayerNorm(6, True), F64), kinds=kinds)


def test_parameters_checked_at_registration() -> None:
    class Odd(nn.Module):
        def __init__(self, extra: bool) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(6))
            self.bias = nn.Parameter(torch.zeros(5 if not extra else 6))
            if extra:
                self.gain = nn.Parameter(torch.ones(1))

    with pytest.raises(ValueError, match=r"module '1' .*Odd.* bias has shape \(5,\)"):
        kf.register(_net(Odd(False), F64), kinds={Odd: "layer_norm"})
    with pytest.raises(ValueError, match=r"module '1' .*Odd.* has \['bias', 'gain', 'weight'\]"):
        kf.register(_net(Odd(True), F64), kinds={Odd: "layer_norm"})


def test_skip_messages_name_the_class_and_hint_at_kinds() -> None:
    table = kf.register(nn.Sequential(nn.Linear(2, 6), LayerNorm(6, True), OwnRMSNorm(6)))
    assert table.skipped["1"] == (
        f"unsupported kind {LayerNorm.__module__}.LayerNorm; if it computes a layer norm, "
        "map it with kinds={LayerNorm: 'layer_norm'}"
    )
    assert table.skipped["2"] == (
        f"unsupported kind {__name__}.OwnRMSNorm; if it "
        "computes an RMS norm, map it with kinds={OwnRMSNorm: 'rms_norm'}"
    )
    lstm = kf.register(nn.Sequential(nn.LSTM(2, 3)))
    assert lstm.skipped["0"] == "unsupported kind torch.nn.modules.rnn.LSTM"


def test_no_layers_error_names_the_class() -> None:
    with pytest.raises(ValueError, match=r"no layer of ReLU .*\n\(ReLU has no parameters\)$"):
        kf.KFACPreconditioner(nn.ReLU())
    with pytest.raises(ValueError) as err:
        kf.KFACPreconditioner(nn.LSTM(2, 3))
    assert "(the LSTM itself)  -     -  -  skipped: unsupported kind torch.nn.modules.rnn.LSTM" in (
        str(err.value)
    )


def test_register_parallel_takes_kinds() -> None:
    from kfac_func.parallel.plan import register_parallel

    class Dense(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(3, 4))
            self.bias = nn.Parameter(torch.randn(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.linear(x, self.weight, self.bias)

    model = nn.Sequential(Dense(), LayerNorm(3, True))
    table, splits = register_parallel(model, kinds={Dense: "linear", LayerNorm: "layer_norm"})
    assert list(table) == ["0"] and splits == {"0": None}
    assert table["0"].option("mapped") == f"{Dense.__module__}.{Dense.__qualname__}"
    assert table.skipped["1"] == "layer_norm: not supported by the model-parallel preconditioner"


class Block(nn.Module):
    """nanoGPT's transformer block (model.py): its LayerNorm, attention and MLP."""

    def __init__(self, d: int, heads: int, bias: bool) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1 = LayerNorm(d, bias)
        self.c_attn = nn.Linear(d, 3 * d, bias=bias)
        self.c_proj = nn.Linear(d, d, bias=bias)
        self.ln_2 = LayerNorm(d, bias)
        self.c_fc = nn.Linear(d, 4 * d, bias=bias)
        self.mlp_proj = nn.Linear(4 * d, d, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


@pytest.mark.parametrize("bias", [True, False])
def test_nanogpt_block_every_parameter_preconditioned_under_the_adapter(bias: bool) -> None:
    torch.manual_seed(0)
    model = Block(8, 2, bias)
    table = kf.register(model, kinds={LayerNorm: "layer_norm"})
    assert not table.skipped and table.split_parameters(model)[1] == []
    pre = kf.KFACPreconditioner(model, settings=kf.Settings(kinds={LayerNorm: "layer_norm"}))
    x = torch.randn(3, 5, 8)
    for _ in range(2):
        model.zero_grad()
        model(x).square().mean().backward()
        raw = model.ln_1.weight.grad.clone()
        pre.step()
        assert not torch.equal(model.ln_1.weight.grad, raw)  # preconditioned
    assert pre.steps == 2


def test_known_transformers_norms_are_rms_norms_without_kinds() -> None:
    import importlib

    from kfac_func.blocks.checks import checking
    from kfac_func.blocks.mapped import KNOWN_KINDS

    assert KNOWN_KINDS
    for path, known in KNOWN_KINDS.items():
        kind, options = (known, {}) if isinstance(known, str) else known
        module_name, cls_name = path.rsplit(".", 1)
        try:
            cls = getattr(importlib.import_module(module_name), cls_name)
        except (ImportError, AttributeError):
            continue  # another transformers version: the class is not there
        norm = cls(6)
        with torch.no_grad():
            norm.weight.normal_()
        net = nn.Sequential(nn.Linear(4, 6), norm, nn.Linear(6, 3))
        layers = kf.register(net)
        assert layers["1"].kind == kind, path
        assert layers["1"].option("offset") == options.get("offset"), path
        ref = nn.RMSNorm(6, eps=layers["1"].option("eps"))
        with torch.no_grad():  # Gemma's scale by 1 + weight
            ref.weight.copy_(norm.weight + options.get("offset", 0.0))
        x = torch.randn(5, 6)
        torch.testing.assert_close(norm(x), ref(x), rtol=1e-6, atol=1e-6, msg=named(path))
        with checking(net, layers):  # the first call computes what the kind computes
            net(torch.randn(5, 4))
