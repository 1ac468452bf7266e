"""``factor_rows``: a Linear layer's factor statistics from a subsample of its positions.

The oracle is the definition, computed here densely in float64: the Gram of every ``k``-th
position (from the turning offset on), with the bias column, times ``positions / kept``,
and the full row count.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kfac_func as kf
from kfac_func.blocks import a_gram, g_gram, thinned_gram
from kfac_func.blocks.spec import thin_positions

DT = torch.float64


def _dense_gram(rows: torch.Tensor, bias: bool) -> torch.Tensor:
    if bias:
        rows = torch.cat([rows, torch.ones(rows.shape[0], 1, dtype=rows.dtype)], dim=1)
    return rows.T @ rows


@pytest.mark.parametrize(("positions", "budget", "every"), [(16, 32, 4), (10, 30, 4), (7, 8, 7)])
@pytest.mark.parametrize("offset", [0, 1, 5])
def test_thinned_gram_is_the_scaled_gram_of_every_kth_position(
    positions: int, budget: int, every: int, offset: int
) -> None:
    torch.manual_seed(0)
    spec = kf.register(nn.Linear(5, 3))[""]
    x = torch.randn(8, positions, 5, dtype=DT)
    gy = torch.randn(8, positions, 3, dtype=DT)
    start = offset % every
    kept = list(range(start, positions, every))
    scale = positions / len(kept)
    for t, which, bias in ((x, "a", True), (gy, "g", False)):
        out = thinned_gram(spec, t, which, DT, budget=budget, offset=offset)
        want = scale * _dense_gram(t[:, kept].reshape(-1, t.shape[-1]), bias)
        torch.testing.assert_close(out.gram, want, rtol=1e-12, atol=1e-12)
        assert out.rows == 8 * positions
        assert 8 * len(kept) <= max(budget, 8)  # within the budget (one position at least)


def test_within_budget_or_without_positions_everything_is_used() -> None:
    spec = kf.register(nn.Linear(4, 2))[""]
    x = torch.randn(6, 5, 4, dtype=DT)
    whole = a_gram(spec, x, DT)
    assert torch.equal(thinned_gram(spec, x, "a", DT, budget=30).gram, whole.gram)
    assert torch.equal(thinned_gram(spec, x, "a", DT, budget=None).gram, whole.gram)
    flat = torch.randn(100, 4, dtype=DT)  # no positions: examples are never dropped
    assert thin_positions(flat, 10, 0) == (flat, 1.0)
    thinned = thinned_gram(spec, flat, "a", DT, budget=10)
    assert torch.equal(thinned.gram, a_gram(spec, flat, DT).gram)
    gy = torch.randn(6, 5, 2, dtype=DT)
    assert torch.equal(thinned_gram(spec, gy, "g", DT, budget=30).gram, g_gram(spec, gy, DT).gram)


def _sequence_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 4)).to(DT)


def _factors(factor_rows: int | None, x: torch.Tensor, y: torch.Tensor) -> dict[str, tuple]:
    model = _sequence_model()
    pre = kf.KFACPreconditioner(
        model, scaling="fisher", factor_decay=0.5, kl_clip=None, factor_rows=factor_rows
    )
    F.cross_entropy(model(x).reshape(-1, 4), y.reshape(-1)).backward()
    pre.step()
    return {n: (ls.a_factor, ls.g_factor) for n, ls in pre.state.layers.items()}


def test_identical_positions_give_the_exact_factors() -> None:
    """When every position of a sequence is the same, any subsample is exact."""
    torch.manual_seed(1)
    x = torch.randn(8, 1, 6, dtype=DT).expand(8, 12, 6).contiguous()
    y = torch.randint(0, 4, (8, 1)).expand(8, 12).contiguous()
    whole, thinned = _factors(None, x, y), _factors(24, x, y)
    for name in whole:
        for w, t in zip(whole[name], thinned[name]):
            torch.testing.assert_close(t, w, rtol=1e-12, atol=1e-14)


def test_thinned_factors_estimate_the_whole() -> None:
    torch.manual_seed(2)
    x = torch.randn(16, 32, 6, dtype=DT)
    y = torch.randint(0, 4, (16, 32))
    whole, thinned = _factors(None, x, y), _factors(256, x, y)  # every 2nd position
    for name in whole:
        for w, t in zip(whole[name], thinned[name]):
            assert not torch.equal(t, w)
            assert (t - w).norm() < 0.15 * w.norm()


def test_the_offset_turns_with_the_factor_updates(monkeypatch: pytest.MonkeyPatch) -> None:
    import kfac_func.adapter.recording as recording

    seen: list[int] = []
    original = recording.thinned_gram

    def spy(spec, t, which, dtype, budget, offset):  # type: ignore[no-untyped-def]
        if spec.name == "0" and which == "a":
            seen.append(offset)
        return original(spec, t, which, dtype, budget, offset)

    monkeypatch.setattr(recording, "thinned_gram", spy)
    model = _sequence_model()
    pre = kf.KFACPreconditioner(model, scaling="fisher", factor_update_steps=2, factor_rows=16)
    for _ in range(8):
        model.zero_grad()
        model(torch.randn(4, 16, 6, dtype=DT)).pow(2).mean().backward()
        pre.step()
    assert seen == [0, 1, 2, 3]  # four factor updates, each from the next offset


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_bad_factor_rows_is_named(bad: object) -> None:
    with pytest.raises(ValueError, match="factor_rows"):
        kf.KFACPreconditioner(_sequence_model(), factor_rows=bad)  # type: ignore[arg-type]


def test_factor_rows_needs_statistics_in_the_hooks() -> None:
    with pytest.raises(ValueError, match="update_factors_in_hook"):
        kf.KFACPreconditioner(_sequence_model(), factor_rows=8, update_factors_in_hook=False)


def test_gpt2_conv1d_is_thinned_as_a_linear() -> None:
    """A transposed linear (GPT-2's ``Conv1D``, ``x @ W + b``) has Linear's statistics, so
    its positions thin alike: the same Grams as the Linear of the transposed weight."""

    class Conv1D(nn.Module):
        def __init__(self, d_in: int, d_out: int) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(d_in, d_out, dtype=DT))
            self.bias = nn.Parameter(torch.zeros(d_out, dtype=DT))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ self.weight + self.bias

    torch.manual_seed(3)
    conv = kf.register(Conv1D(5, 3))[""]
    linear = kf.register(nn.Linear(5, 3))[""]
    assert conv.kind == "transposed_linear" and conv.block.thinnable(conv)
    x, gy = torch.randn(4, 16, 5, dtype=DT), torch.randn(4, 16, 3, dtype=DT)
    for t, which in ((x, "a"), (gy, "g")):
        got = thinned_gram(conv, t, which, DT, budget=16, offset=1)
        want = thinned_gram(linear, t, which, DT, budget=16, offset=1)
        assert torch.equal(got.gram, want.gram) and got.rows == want.rows == 64
        assert not torch.equal(got.gram, thinned_gram(conv, t, which, DT).gram)
