"""Layers that read one input share its Gram in the hooks (an attention's query, key and
value projections, an MLP's gate and up projections): the factors are exactly those of
separate Grams, and a Gram is shared only for the same tensor, unchanged, with the same
statistics. Their equal A factors then share one eigendecomposition."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import kfac_func as kf
import kfac_func.adapter.recording as recording
import kfac_func.step.decompose as decompose
from kfac_func import KFACPreconditioner


class Projections(nn.Module):
    """Query, key and value of one input (the value without a bias: other statistics),
    then gate and up projections of another; ``copies`` hands each layer its own copy
    of the input, so that no Gram can be shared."""

    def __init__(self, copies: bool) -> None:
        super().__init__()
        self.copies = copies
        self.q, self.k = nn.Linear(6, 6), nn.Linear(6, 4)
        self.v = nn.Linear(6, 6, bias=False)
        self.gate, self.up = nn.Linear(6, 8), nn.Linear(6, 8)
        self.down = nn.Linear(8, 3)

    def _in(self, h: torch.Tensor) -> torch.Tensor:
        return h.clone() if self.copies else h

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(x)
        q, k, v = self.q(self._in(h)), self.k(self._in(h)), self.v(self._in(h))
        mixed = (q[..., :4] * k).sum(-1, keepdim=True) * v + h
        return self.down(torch.sigmoid(self.gate(self._in(mixed))) * self.up(self._in(mixed)))


@pytest.mark.parametrize("gram_dtype", [torch.float32, torch.bfloat16])
def test_shared_grams_give_exactly_the_factors_of_separate_ones(
    monkeypatch: pytest.MonkeyPatch, gram_dtype: torch.dtype
) -> None:
    counted: list[str] = []
    a_gram = recording.a_gram

    def counting(spec, x, dtype):  # type: ignore[no-untyped-def]
        counted.append(spec.name)
        return a_gram(spec, x, dtype)

    monkeypatch.setattr(recording, "a_gram", counting)
    torch.manual_seed(0)
    x = torch.randn(5, 7, 6)
    pres, calls = [], []
    for copies in (False, True):
        torch.manual_seed(1)
        model = Projections(copies)
        pre = KFACPreconditioner(model, settings=kf.Settings(gram_dtype=gram_dtype))
        counted.clear()
        for _ in range(2):  # two micro-batches: nothing is shared across them
            model(x).square().sum().backward()
        pre.step()
        pres.append(pre)
        calls.append(list(counted))
    shared, separate = calls
    assert separate == 2 * ["q", "k", "v", "gate", "up", "down"]
    assert shared == 2 * ["q", "v", "gate", "down"]  # k reads q's, up gate's
    for name, layer in pres[0].state.layers.items():
        other = pres[1].state.layers[name]
        assert torch.equal(layer.a_factor, other.a_factor), name
        assert torch.equal(layer.g_factor, other.g_factor), name


def test_a_changed_input_is_not_shared() -> None:
    model = Projections(copies=False)
    pre = KFACPreconditioner(model)
    micro = recording._MicroBatch()
    q, k = pre.layers["q"], pre.layers["k"]
    h = torch.randn(4, 6)
    first = pre._input_gram(q, micro, h)
    assert pre._input_gram(k, micro, h) is first
    h.mul_(2.0)  # in place: the tensor's version moves on
    again = pre._input_gram(k, micro, h)
    assert again is not first
    torch.testing.assert_close(again.gram[:6, :6], 4 * first.gram[:6, :6])
    # the same values in another tensor are computed anew
    assert pre._input_gram(q, micro, h.clone()) is not again


@pytest.mark.parametrize("batched", [False, True])
def test_equal_a_factors_share_one_eigendecomposition(
    monkeypatch: pytest.MonkeyPatch, batched: bool
) -> None:
    torch.manual_seed(0)
    model = Projections(copies=False)
    pre = KFACPreconditioner(model, damping=0.01, settings=kf.Settings(batched_eigh=batched))
    stacked: list[tuple[str, int]] = []
    batch = decompose.batched_eigenpairs

    def spy(layers, config, sides, **kw):  # type: ignore[no-untyped-def]
        stacked.extend(sides)
        return batch(layers, config, sides, **kw)

    monkeypatch.setattr(decompose, "batched_eigenpairs", spy)
    model(torch.randn(5, 7, 6)).square().sum().backward()
    pre.step()
    dec = {n: ls.decomposition for n, ls in pre.state.layers.items()}
    assert dec["k"].qa is dec["q"].qa and dec["up"].qa is dec["gate"].qa
    assert dec["v"].qa is not dec["q"].qa  # no bias: another A factor
    assert dec["q"].qg is not dec["k"].qg  # and each its own G
    if batched:  # the takers' A factors are not stacked for the batched eigh
        assert ("q", 0) in stacked and ("k", 0) not in stacked and ("up", 0) not in stacked
        assert ("k", 1) in stacked
    monkeypatch.setattr(decompose, "batched_eigenpairs", batch)
    # as each layer's own eigh: the same factors decomposed with nothing shared. Equal
    # factors at other addresses may decompose differently to rounding (LAPACK's blocking
    # follows the alignment), and nearly equal eigenvalues turn that into other vectors:
    # the decompositions compare as the matrices they make
    monkeypatch.setattr(decompose, "_same", lambda a, b: False)
    alone = dict(pre.state.layers)
    decompose.decompose_layers(alone, 0.01, pre.state.config, update_inverses=True, grouped=batched)
    for name in ("k", "up"):
        own, shared = alone[name].decomposition, dec[name]
        assert own.qa is not shared.qa
        torch.testing.assert_close(shared.da, own.da, rtol=1e-6, atol=0)
        for d in (shared, own):
            made = d.qa @ torch.diag(d.da) @ d.qa.T
            torch.testing.assert_close(made, pre.state.layers[name].a_factor, rtol=0, atol=1e-6)


@pytest.mark.parametrize("width", [5, 80])  # compared whole, and diagonals first
def test_factors_are_the_same_only_entry_for_entry(width: int) -> None:
    a = torch.randn(width, width)
    a = a @ a.T
    assert decompose._same(a, a.clone())
    off = a.clone()
    off[0, 1] += 1.0  # off the diagonal: only the whole comparison sees it
    assert not decompose._same(a, off)
    on = a.clone()
    on[1, 1] += 1.0
    assert not decompose._same(a, on)
    assert not decompose._same(a, a.double())
    assert not decompose._same(a, a[:-1, :-1])
