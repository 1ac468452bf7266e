"""The row-unfolded patch Gram equals the im2col Gram (PyTorch's ``unfold``) in float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import kfac_func as kf
from kfac_func.blocks import a_gram, block_of
from kfac_func.blocks.patch_gram import patch_gram, supports_row_gram

DT = torch.float64


def unfold_gram(
    y: torch.Tensor,
    kernel: tuple[int, int],
    dilation: tuple[int, int],
    stride_w: int,
    groups: int,
    with_ones: bool,
) -> torch.Tensor:
    cols = F.unfold(y, kernel, dilation=dilation, stride=(1, stride_w))
    n, _, length = cols.shape
    rows = cols.view(n, groups, -1, length).permute(1, 0, 3, 2).reshape(groups, n * length, -1)
    if with_ones:
        rows = torch.cat([rows, rows.new_ones(groups, n * length, 1)], dim=-1)
    gram = rows.mT @ rows
    return gram[0] if groups == 1 else gram


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 3),
    cg=st.integers(1, 3),
    groups=st.integers(1, 2),
    kh=st.integers(2, 4),
    kw=st.integers(1, 3),
    dil=st.tuples(st.integers(1, 3), st.integers(1, 2)),
    stride_w=st.integers(1, 3),
    extra=st.tuples(st.integers(0, 6), st.integers(0, 5)),
    with_ones=st.booleans(),
)
def test_equals_unfold_gram(
    n: int,
    cg: int,
    groups: int,
    kh: int,
    kw: int,
    dil: tuple[int, int],
    stride_w: int,
    extra: tuple[int, int],
    with_ones: bool,
) -> None:
    # heights from one output row (no row shared by every kernel row) upwards
    hp = dil[0] * (kh - 1) + 1 + extra[0]
    wp = dil[1] * (kw - 1) + 1 + extra[1]
    y = torch.randn(n, cg * groups, hp, wp, dtype=DT)
    gram, positions, per_example = patch_gram(y, (kh, kw), dil, stride_w, groups, with_ones)
    want = unfold_gram(y, (kh, kw), dil, stride_w, groups, with_ones)
    assert gram.shape == want.shape
    torch.testing.assert_close(gram, want, rtol=1e-12, atol=1e-12)
    out_w = (wp - dil[1] * (kw - 1) - 1) // stride_w + 1
    assert (positions, per_example) == (n * (extra[0] + 1) * out_w, (extra[0] + 1) * out_w)


def test_too_small_input_is_refused() -> None:
    with pytest.raises(ValueError, match=r"smaller than the kernel \(3, 3\)"):
        patch_gram(torch.zeros(1, 2, 2, 5), (3, 3), (1, 1), 1, 1, False)


@pytest.mark.parametrize(
    ("kernel", "stride", "applies"),
    [
        ((3, 3), (1, 1), True),
        ((3, 3), (1, 2), True),
        ((3, 3), (2, 1), False),
        ((1, 3), (1, 1), False),
    ],
)
def test_supports_row_gram(kernel: tuple[int, int], stride: tuple[int, int], applies: bool) -> None:
    assert supports_row_gram(kernel, stride) is applies


@pytest.mark.parametrize(
    "conv",
    [
        nn.Conv2d(4, 6, 3, padding=1),
        nn.Conv2d(4, 6, (2, 3), padding="same", bias=False),
        nn.Conv2d(4, 6, 3, padding=2, dilation=2, groups=2, padding_mode="reflect"),
        nn.Conv2d(4, 4, 3, stride=(1, 2), padding=1, groups=4, padding_mode="circular"),
    ],
    ids=["same3x3", "even-same", "dilated-groups-reflect", "depthwise-circular"],
)
@pytest.mark.parametrize("unbatched", [False, True])
def test_a_gram_matches_patch_rows(conv: nn.Conv2d, unbatched: bool) -> None:
    """Through a layer spec: padding modes, groups and unbatched inputs as the rows see them."""
    spec = kf.register(nn.Sequential(conv.to(DT)))["0"]
    x = torch.randn(5, 4, 7, 6, dtype=DT)
    if unbatched:
        x = x[0]
    got = a_gram(spec, x, DT)
    rows, spatial = block_of("conv2d").a_rows(spec, x)  # type: ignore[attr-defined]
    if spec.has_bias:
        rows = torch.cat([rows, rows.new_ones(*rows.shape[:-1], 1)], dim=-1)
    torch.testing.assert_close(got.gram, rows.mT @ rows, rtol=1e-12, atol=1e-12)
    assert (got.rows, got.spatial) == (rows.shape[-2], spatial)
