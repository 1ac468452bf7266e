"""The kl_clip pieces of model-parallel K-FAC against the formula, restated here.

``kl_clip_terms`` sums, in order and in float64, each pair's dot product ``Σ P ⊙ grad``
taken in ``P``'s dtype; ``kl_clip_from_terms`` turns the total into
``min(1, sqrt(kl_clip / |lr² · total|))`` (1 for a zero total). Both are compared bit for
bit with a plain-Python restatement in float64, on random float32 and float64 inputs,
and the terms also with the exact float64 sum (to the precision of the dtype).
"""

from __future__ import annotations

import math

import pytest
import torch

from kfac_func.parallel.shards import kl_clip_from_terms, kl_clip_terms

SHAPES = [(3, 5), (7,), (2, 4), (1, 1)]


def _pairs(dtype: torch.dtype, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    pairs = []
    for i, shape in enumerate(SHAPES):
        p = torch.randn(shape, generator=g, dtype=dtype)
        # a raw gradient in another dtype is cast to P's dtype first
        raw_dtype = torch.float64 if i % 2 else dtype
        pairs.append((p, torch.randn(shape, generator=g, dtype=raw_dtype)))
    return pairs


def _terms(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Σ over pairs, added in order in float64, of the dot product in P's dtype."""
    total = 0.0
    for p, g in pairs:
        total += float(torch.dot(p.reshape(-1), g.reshape(-1).to(p.dtype)))
    return total


def _scale(total: float, kl_clip: float, lr: float) -> float:
    """min(1, sqrt(kl_clip / |lr² · total|)) in float64; 1 for a zero total.

    The quotient is written as torch evaluates ``number / tensor``: the number times the
    tensor's reciprocal (a true division may differ in the last bit).
    """
    vg = total * (lr * lr)
    return 1.0 if vg == 0.0 else min(1.0, math.sqrt(kl_clip * (1.0 / abs(vg))))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("seed", range(4))
def test_kl_clip_terms_is_the_ordered_float64_sum(dtype: torch.dtype, seed: int) -> None:
    pairs = _pairs(dtype, seed)
    total = kl_clip_terms(pairs)
    assert total.dtype == torch.float64 and total.shape == () and total.device.type == "cpu"
    assert total.item() == _terms(pairs)
    exact = sum(float((p.double() * g.to(p.dtype).double()).sum()) for p, g in pairs)
    rel = 1e-5 if dtype == torch.float32 else 1e-12
    assert total.item() == pytest.approx(exact, rel=rel, abs=rel)


def test_kl_clip_terms_of_nothing_is_zero() -> None:
    total = kl_clip_terms([])
    assert total.dtype == torch.float64 and total.item() == 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("seed", range(4))
def test_kl_clip_from_terms_is_the_formula(dtype: torch.dtype, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    kl_clip, lr = 10 ** float(torch.empty(2).uniform_(-4, 0, generator=g)[0]), 0.3 + seed / 7
    for total in [
        torch.randn((), generator=g, dtype=dtype) * 10 ** (seed - 2),
        kl_clip_terms(_pairs(dtype, seed)).to(dtype),
        torch.zeros((), dtype=dtype),
    ]:
        scale = kl_clip_from_terms(total, kl_clip, lr)
        assert scale.dtype == torch.float64 and scale.shape == ()
        assert scale.item() == _scale(float(total), kl_clip, lr)
        if float(total) != 0.0:
            quotient = kl_clip / abs(float(total) * lr * lr)
            assert scale.item() == pytest.approx(min(1.0, math.sqrt(quotient)), rel=1e-15)


def test_kl_clip_from_terms_small_total_is_one() -> None:
    assert kl_clip_from_terms(torch.tensor(1e-9, dtype=torch.float64), 1.0, 0.1).item() == 1.0
