"""``kf.capture`` on models whose output is not a tensor: transformers' ``ModelOutput``
holding a ``DynamicCache``, dataclasses and dicts with non-tensor leaves. The loss function
gets the output as the model returned it; gradients equal plain autograd's and captures the
preconditioner's."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import pytest
import torch
from numerics import named
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.cache_utils import DynamicCache

import kfac_func as kf

F64 = torch.float64


def _gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=16, vocab_size=50)
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0  # runs compare
    return GPT2LMHeadModel(config).to(F64)  # training mode: the preconditioner records


def _register(model: nn.Module) -> kf.LayerTable:
    with warnings.catch_warnings():  # the tied embedding and head are skipped, with a warning
        warnings.simplefilter("ignore", UserWarning)
        return kf.register(model)


def test_gpt2_with_its_cache_grads_equal_autograd_and_captures_the_adapter() -> None:
    model = _gpt2()
    x = torch.randint(0, 50, (3, 8), generator=torch.Generator().manual_seed(1))
    kwargs = {"input_ids": x, "labels": x}
    seen: list[Any] = []

    def loss_fn(out: Any) -> torch.Tensor:
        seen.append(out)
        return out.loss

    layers = _register(model)
    params = dict(model.named_parameters())
    loss, grads, caps = kf.capture(model, params, (), loss_fn, kwargs=kwargs, layers=layers)
    assert type(seen[0]) is type(model(**kwargs))  # the output object, cache included
    assert isinstance(seen[0].past_key_values, DynamicCache)
    assert seen[0].logits.shape == (3, 8, 50)

    model.zero_grad()
    want = model(**kwargs).loss
    want.backward()
    torch.testing.assert_close(loss, want.detach(), rtol=1e-12, atol=0)
    assert sorted(grads) == sorted(params)
    for name, p in params.items():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-10, atol=1e-14, msg=named(name))

    # the factors of these captures equal those of the preconditioner's hooks
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        pre = kf.KFACPreconditioner(model, factor_dtype=F64, inv_dtype=F64, factor_decay=0.5)
    assert list(pre.layers) == list(layers) and len(layers) == 15  # the tied head included
    model.zero_grad()
    model(input_ids=x, labels=x).loss.backward()  # called by keyword, as users do
    pre.step()
    pre.remove()
    state = kf.init(layers, convention="kfac-pytorch", factor_dtype=F64, inv_dtype=F64)
    _, state = kf.update(state, grads, captures=caps, factor_decay=0.5)
    for name in layers:
        got, want_layer = state.layers[name], pre.state.layers[name]
        for what in ("a_factor", "g_factor"):
            torch.testing.assert_close(
                getattr(got, what), getattr(want_layer, what), rtol=1e-10, atol=1e-14
            )


@dataclasses.dataclass(frozen=True)
class Out:
    logits: torch.Tensor
    extras: dict[str, Any]
    note: str
    counts: torch.Tensor  # integer: not differentiated


@dataclasses.dataclass
class Inner:
    hidden: torch.Tensor
    tag: str


class Net(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.fc1 = nn.Linear(4, 5, dtype=F64)
        self.fc2 = nn.Linear(5, 3, dtype=F64)

    def forward(self, x: torch.Tensor) -> Any:
        h = torch.tanh(self.fc1(x))
        y = self.fc2(h)
        if self.kind == "dict":
            return {"logits": y, "hidden": h, "name": "net", "none": None}
        inner = Inner(h, "inner")
        return Out(y, {"inner": inner, "n": 3}, "net", torch.tensor([1, 2]))


@pytest.mark.parametrize("kind", ["dataclass", "dict"])
def test_dataclass_and_dict_outputs_grads_equal_autograd(kind: str) -> None:
    model = Net(kind)
    g = torch.Generator().manual_seed(2)
    x, t = torch.randn(6, 4, generator=g, dtype=F64), torch.randn(6, 3, generator=g, dtype=F64)

    def loss_fn(out: Any) -> torch.Tensor:
        if kind == "dict":
            assert out["name"] == "net" and out["none"] is None
            return ((out["logits"] - t) ** 2).mean() + out["hidden"].square().mean()
        assert isinstance(out, Out) and out.note == "net" and out.extras["n"] == 3
        assert isinstance(out.extras["inner"], Inner) and out.extras["inner"].tag == "inner"
        assert out.counts.tolist() == [1, 2]
        return ((out.logits - t) ** 2).mean() + out.extras["inner"].hidden.square().mean()

    params = dict(model.named_parameters())
    loss, grads, caps = kf.capture(model, params, x, loss_fn)
    want = loss_fn(model(x))
    want_grads = torch.autograd.grad(want, list(params.values()))
    torch.testing.assert_close(loss, want.detach(), rtol=1e-14, atol=0)
    for name, w in zip(params, want_grads):
        torch.testing.assert_close(grads[name], w, rtol=1e-12, atol=1e-15, msg=named(name))
    assert caps.layers["fc2"].inputs[0].shape == (6, 5)
    # fc2's output-gradient is d loss / d logits
    y = model.fc2(torch.tanh(model.fc1(x)))
    torch.testing.assert_close(caps.layers["fc2"].output_grads[0], 2 * (y - t) / y.numel())


def test_non_scalar_loss_is_a_clear_error() -> None:
    model = nn.Sequential(nn.Linear(3, 2))
    params = dict(model.named_parameters())
    x = torch.randn(4, 3)
    with pytest.raises(ValueError, match=r"loss_fn must return a scalar tensor .* shape \(4,\)"):
        kf.capture(model, params, x, lambda out: out.sum(-1))
    with pytest.raises(TypeError, match="loss_fn must return a scalar tensor, got float"):
        kf.capture(model, params, x, lambda out: 1.0)
