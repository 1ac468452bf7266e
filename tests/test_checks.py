"""First-call checks of modules a kind recognises by themselves
(:func:`kfac_func.blocks.checks.check_hooks`): subclasses of ``nn.Linear`` and the norms
are registered under their kind only while their output is what the kind computes from
the input the hooks see, and subclasses of ``nn.Embedding`` that override ``forward``
only while their forward makes one lookup of their weight
(:mod:`kfac_func.blocks.recorded_embedding`). Hand-written subclasses: positions that
return rows of the weight by position whatever the ids (Whisper's), a linear that
overrides ``forward``, subclasses that do not override it (registered as before), and a
norm that scales by ``1 + weight`` (Gemma's) mapped without saying so.
"""

from __future__ import annotations

import gc
import warnings
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kfac_func as kf
from kfac_func.blocks.checks import checked_modules

DT = torch.float64
V, T, D = 11, 6, 4


class SlicedPositions(nn.Embedding):
    """Whisper's learned positions: called on the attention mask, returns the weight's
    first rows (one per position) whatever the ids, with no lookup."""

    def __init__(self, positions: int, d: int) -> None:
        super().__init__(positions, d, dtype=DT)

    def forward(self, mask: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return self.weight[: mask.shape[1]]


class DoubledLinear(nn.Linear):
    """A linear whose forward uses twice its weight."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, 2 * self.weight, self.bias)


class PlainLinear(nn.Linear):
    """A subclass that adds an attribute and keeps ``nn.Linear``'s forward."""

    note = "mine"


class SameLinear(nn.Linear):
    """A subclass that overrides forward and computes what ``nn.Linear`` computes."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.T + self.bias


class Model(nn.Module):
    def __init__(self, head: type[nn.Linear] = nn.Linear) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tokens = nn.Embedding(V, D, dtype=DT)
        self.positions = SlicedPositions(T, D)
        self.mid = head(D, D, dtype=DT)
        self.out = nn.Linear(D, V, dtype=DT)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.tokens(ids) + self.positions(mask)
        return self.out(torch.tanh(self.mid(h)))


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (3, T), generator=g), torch.ones(3, T, dtype=torch.long)


def _loss(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(ids, mask).reshape(-1, V), ids.roll(-1, 1).reshape(-1))


def test_only_modules_whose_class_is_not_the_kinds_are_checked() -> None:
    model = Model(PlainLinear)
    table = kf.register(model)
    assert [(c.module, c.spec.kind) for c in checked_modules(table)] == [("mid", "linear")]
    assert table["positions"].kind == "recorded_embedding"  # checked at every call instead


def test_sliced_positions_are_left_to_the_other_optimizer() -> None:
    """The forward slices the weight: there is no lookup whose ids A could count.
    Registered on isinstance alone, A would count the mask's ones (row 1) while rows 0..T
    receive the gradient."""
    model = Model()
    opt = kf.KFAC(model, lr=0.01, damping=0.01)
    ids, mask = _batch()
    with pytest.warns(kf.FallbackWarning) as caught:
        loss = _loss(model, ids, mask)
    message = str(caught[0].message)
    assert "'positions'" in message and "SlicedPositions overrides forward" in message
    assert "uses the weight otherwise" in message
    loss.backward()
    raw = model.positions.weight.grad.clone()
    before = model.positions.weight.detach().clone()
    opt.step()
    pre = opt.preconditioner
    assert "positions" not in pre.layers and "positions" in pre.demoted
    assert "overrides forward" in pre.layers.skipped["positions"]
    assert opt.others_optimizer is not None
    assert opt.others_optimizer.param_groups[0]["params"] == [model.positions.weight]
    assert all(
        p is not model.positions.weight for p in opt.kfac_optimizer.param_groups[0]["params"]
    )
    assert "positions" not in pre.state.layers
    # AdamW's first step on the raw gradient, lr · g / (|g| + eps) (the recommended
    # recipe's weight_decay is 0)
    want = before - 0.01 * raw / (raw.abs() + 1e-8)
    torch.testing.assert_close(model.positions.weight.detach(), want, rtol=0, atol=1e-12)
    opt.zero_grad()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # refused once: no warning at the next steps
        for seed in (1, 2):
            _loss(model, *_batch(seed)).backward()
            opt.step()
            opt.zero_grad()
    assert pre.steps == 3


def test_a_preconditioner_passes_the_refused_layers_gradient_unchanged() -> None:
    model = Model(DoubledLinear)
    pre = kf.KFACPreconditioner(model, damping=0.01)
    with pytest.warns(kf.FallbackWarning) as caught:
        _loss(model, *_batch()).backward()
    messages = " ".join(str(w.message) for w in caught)
    assert "DoubledLinear overrides forward" in messages and "x @ weight.T + bias" in messages
    raw = {n: p.grad.clone() for n, p in model.named_parameters()}
    pre.step()
    assert sorted(pre.layers) == ["out", "tokens"]
    for name in ("mid.weight", "mid.bias", "positions.weight"):
        assert torch.equal(dict(model.named_parameters())[name].grad, raw[name]), name
    assert not torch.equal(model.out.weight.grad, raw["out.weight"])  # preconditioned
    _, rest = pre.layers.split_parameters(model)
    assert {id(p) for p in rest} == {
        id(model.mid.weight),
        id(model.mid.bias),
        id(model.positions.weight),
    }


def test_the_capture_refuses_with_an_error_naming_the_module() -> None:
    model = Model()
    ids, mask = _batch()
    params = dict(model.named_parameters())
    with pytest.raises(ValueError, match=r"'positions' \(.*SlicedPositions\).*skip_layers"):
        kf.capture(model, params, (ids, mask), lambda o: o.sum())
    table = kf.register(model, skip_layers=["^positions$"])
    _, _, caps = kf.capture(model, params, (ids, mask), lambda o: o.sum(), layers=table)
    assert "positions" not in caps.layers


@pytest.mark.parametrize("cls", [PlainLinear, SameLinear])
def test_subclasses_computing_the_kinds_output_are_preconditioned_as_the_kinds_class(
    cls: type[nn.Linear],
) -> None:
    """A subclass that keeps the forward, or overrides it with the same computation, is
    registered, checked silently, and gets the factors and preconditioned gradients of
    ``nn.Linear`` itself."""
    twin, model = Model(nn.Linear), Model(cls)
    assert kf.register(model)["mid"].kind == "linear"
    pres = [
        kf.KFACPreconditioner(m, damping=0.01, skip_layers=["^positions$"]) for m in (twin, model)
    ]
    ids, mask = _batch()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for m, pre in zip((twin, model), pres):
            _loss(m, ids, mask).backward()
            pre.step()
    assert list(pres[1].layers) == list(pres[0].layers)
    for name, ls in pres[0].state.layers.items():
        other = pres[1].state.layers[name]
        torch.testing.assert_close(other.a_factor, ls.a_factor, rtol=1e-12, atol=0)
        torch.testing.assert_close(other.g_factor, ls.g_factor, rtol=1e-12, atol=0)
    torch.testing.assert_close(model.mid.weight.grad, twin.mid.weight.grad, rtol=1e-12, atol=0)


class OnePlusNorm(nn.Module):
    """Gemma's RMS norm: ``x / rms(x) · (1 + weight)``, the weight starting at zero."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.eps = 1e-6
        self.weight = nn.Parameter(torch.zeros(d, dtype=DT))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x * (1.0 + self.weight)


def test_a_one_plus_weight_norm_mapped_as_rms_norm_is_told_what_it_computes() -> None:
    net = nn.Sequential(nn.Linear(3, D, dtype=DT), OnePlusNorm(D))
    pre = kf.KFACPreconditioner(net, settings=kf.Settings(kinds={OnePlusNorm: "rms_norm"}))
    with pytest.raises(ValueError) as err:
        net(torch.randn(2, 3, dtype=DT))
    message = str(err.value)
    assert "largest entry of the module's output" in message  # not the kind's 0 alone
    assert "x / rms(x) * (1 + weight)" in message
    assert "kinds={OnePlusNorm: ('rms_norm', {'eps': 1e-06, 'offset': 1.0})}" in message
    assert "by kinds=" in message and "something else" not in message
    pre.remove()


def test_a_one_plus_weight_norm_with_offset_equals_rms_norm_of_one_plus_weight() -> None:
    """The factors of ``x̂ · (1 + w)`` are those of ``x̂ · w`` (the gradient of w is
    ``x̂ ⊙ g`` either way): an ``nn.RMSNorm`` whose weight is ``1 + w`` is the oracle."""
    torch.manual_seed(0)
    norm = OnePlusNorm(D)
    with torch.no_grad():
        norm.weight.normal_()
    net = nn.Sequential(nn.Linear(3, D, dtype=DT), norm, nn.Linear(D, 2, dtype=DT))
    ref = nn.Sequential(
        nn.Linear(3, D, dtype=DT), nn.RMSNorm(D, eps=1e-6, dtype=DT), nn.Linear(D, 2, dtype=DT)
    )
    ref.load_state_dict({**net.state_dict(), "1.weight": 1.0 + norm.weight.detach()})
    kinds = {OnePlusNorm: ("rms_norm", {"offset": 1.0})}
    pres = [
        kf.KFACPreconditioner(net, settings=kf.Settings(kinds=kinds), factor_dtype=DT),
        kf.KFACPreconditioner(ref, factor_dtype=DT),
    ]
    x = torch.randn(5, 3, dtype=DT)
    for m, pre in zip((net, ref), pres):
        m(x).pow(2).mean().backward()
        pre.step()
    torch.testing.assert_close(net(x), ref(x), rtol=1e-12, atol=1e-12)
    for side in ("a_factor", "g_factor"):
        got, want = (getattr(p.state.layers["1"], side) for p in pres)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(net[1].weight.grad, ref[1].weight.grad, rtol=1e-10, atol=1e-14)


def test_a_subclass_of_an_unchecked_kind_that_overrides_forward_is_skipped() -> None:
    """Kinds without an output of their own (convolutions) cannot check a forward: a
    subclass that overrides it is skipped at registration, one that keeps it registered."""

    class Mine(nn.Conv2d):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x).relu()

    class Kept(nn.Conv2d):
        pass

    table = kf.register(nn.Sequential(Mine(1, 2, 3), Kept(2, 2, 3)))
    assert list(table) == ["1"]
    assert "Mine overrides the forward of Conv2d" in table.skipped["0"]


def test_the_check_hooks_hold_the_preconditioner_weakly() -> None:
    model = Model(PlainLinear)
    pre = kf.KFACPreconditioner(model, damping=0.01, skip_layers=["^positions$"])
    _loss(model, *_batch()).backward()
    pre.step()
    ref = weakref.ref(pre)
    del pre
    gc.collect()
    assert ref() is None
    _loss(model, *_batch(1)).backward()  # the model trains on without it


def test_an_unknown_norm_whose_weight_starts_at_zero_is_hinted_the_offset() -> None:
    class ZeroRMSNorm(OnePlusNorm):  # not a known class: skipped, with the hint
        pass

    table = kf.register(nn.Sequential(nn.Linear(3, D), ZeroRMSNorm(D)))
    assert "kinds={ZeroRMSNorm: ('rms_norm', {'offset': 1.0})}" in table.skipped["1"]
