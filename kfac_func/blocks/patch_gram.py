"""The Gram of a convolution's input patches without materialising every patch.

A Conv2d's A factor is ``Σ_p patch_p patch_pᵀ`` over all output positions ``p``, each patch
holding ``C·kh·kw`` entries. Building the patch matrix (im2col) copies the input ``kh·kw``
times and its Gram costs ``(C·kh·kw)²`` multiply-adds per position. This module computes the
same matrix from patches that are unfolded along the width only:

- ``Z[h]`` holds, for every example and output column, the ``C·kw`` input values of padded
  row ``h`` under the kernel (a ``kw``-fold copy instead of ``kh·kw``);
- the block of kernel rows ``(i, i + d)`` is ``Σ_h Z[h]ᵀ Z[h + δ·d]`` over the rows ``h`` that
  kernel row ``i`` visits, so each product ``Z[h]ᵀ Z[h + δ·d]`` serves every kernel row ``i``
  at once: rows visited by all kernel rows go through one large product, the few rows near
  the top and bottom edges through one product each;
- blocks with ``d < 0`` are transposes of blocks with ``d > 0``.

That is ``kh`` products of ``(C·kw)²`` per position instead of ``(C·kh·kw)²``: about ``kh``
times fewer multiply-adds (3× for 3×3 kernels). The result equals the im2col Gram up to the
order of floating-point summation. Pure tensor functions: no module, no hook.
"""

from __future__ import annotations

import torch

__all__ = ["patch_gram", "supports_row_gram"]


def supports_row_gram(kernel_size: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Whether :func:`patch_gram` applies and saves work: unit vertical stride and a kernel
    taller than one row (a one-row kernel's patches are already unfolded rows)."""
    return len(kernel_size) == 2 and kernel_size[0] > 1 and stride[0] == 1


def patch_gram(
    y: torch.Tensor,
    kernel_size: tuple[int, int],
    dilation: tuple[int, int],
    stride_w: int,
    groups: int,
    with_ones: bool,
) -> tuple[torch.Tensor, int, int]:
    """``Σ_p patch_p patch_pᵀ`` of a stride-1 (vertically) convolution over padded input.

    Args:
        y: padded input ``(N, C, Hp, Wp)``.
        kernel_size, dilation: ``(kh, kw)`` and ``(δh, δw)``.
        stride_w: horizontal stride (the vertical stride must be 1).
        groups: convolution groups; one Gram per group.
        with_ones: append the patch sums and the position count, as if every patch had a
            trailing 1 (the bias column).

    Returns:
        ``(gram, positions, positions per example)``; ``gram`` has shape ``(D, D)`` for one
        group or ``(groups, D, D)``, ``D = C/groups·kh·kw (+1)``, entries ordered as
        :func:`torch.nn.functional.unfold` orders patch entries (channel, kernel row, column).

    Example:
        >>> import torch
        >>> import torch.nn.functional as F
        >>> y = torch.randn(2, 3, 6, 6, dtype=torch.float64)
        >>> gram, n, per = patch_gram(y, (3, 3), (1, 1), 1, 1, False)
        >>> rows = F.unfold(y, 3).transpose(1, 2).reshape(-1, 27)
        >>> torch.allclose(gram, rows.T @ rows), n, per
        (True, 32, 16)
    """
    n, c, hp, wp = y.shape
    kh, kw = kernel_size
    dh, dw = dilation
    cg = c // groups
    ho = hp - dh * (kh - 1)
    span_w = dw * (kw - 1) + 1
    wo = (wp - span_w) // stride_w + 1
    if ho <= 0 or wo <= 0:
        raise ValueError(f"input {tuple(y.shape)} is smaller than the kernel {kernel_size}")
    width = cg * kw
    # Z[g, (channel, kernel column), h, (example, output column)]: rows of one h are a
    # strided (width × N·wo) matrix, and a run of rows is one (width × rows·N·wo) matrix
    z = y.unfold(3, span_w, stride_w)[..., ::dw]  # N, C, Hp, Wo, kw
    z = z.reshape(n, groups, cg, hp, wo, kw).permute(1, 2, 5, 3, 0, 4)
    z = z.reshape(groups, width, hp, n * wo)
    blocks = y.new_empty(groups, kh, kh, width, width)  # [g, i1, i2, (c1, j1), (c2, j2)]
    for d in range(kh):
        shift = dh * d
        reach = kh - d  # kernel rows i with i + d inside the kernel
        # kernel row i visits rows [dh·i, dh·i + ho); rows visited by all of them: the core
        core_lo, core_hi = dh * (reach - 1), ho
        union_end = core_lo + ho
        core = None
        if core_lo < core_hi:
            left = z[:, :, core_lo:core_hi].reshape(groups, width, -1)
            right = z[:, :, core_lo + shift : core_hi + shift].reshape(groups, width, -1)
            core = left @ right.mT
        else:
            core_lo = core_hi = union_end
        edge = {
            h: z[:, :, h] @ z[:, :, h + shift].mT
            for h in range(union_end)
            if not core_lo <= h < core_hi
        }
        for i in range(reach):
            terms = [edge[h] for h in range(dh * i, dh * i + ho) if h in edge]
            if core is not None:
                terms.append(core)
            blk = blocks[:, i, i + d].copy_(terms[0])
            for term in terms[1:]:
                blk.add_(term)
            if d:
                blocks[:, i + d, i] = blk.mT
    d_full = cg * kh * kw
    size = d_full + int(with_ones)
    gram = y.new_empty(groups, size, size)
    inner = gram[:, :d_full, :d_full].view(groups, cg, kh, kw, cg, kh, kw)
    inner.copy_(blocks.view(groups, kh, kh, cg, kw, cg, kw).permute(0, 3, 1, 4, 5, 2, 6))
    positions = n * ho * wo
    if with_ones:  # the bias column: patch sums, and the number of patches
        row_sums = z.sum(dim=3)  # g, (c, j), Hp
        s = torch.stack([row_sums[..., dh * i : dh * i + ho].sum(dim=-1) for i in range(kh)], 1)
        s = s.view(groups, kh, cg, kw).permute(0, 2, 1, 3).reshape(groups, d_full)
        gram[:, :d_full, d_full] = s
        gram[:, d_full, :d_full] = s
        gram[:, d_full, d_full] = positions
    return (gram[0] if groups == 1 else gram), positions, ho * wo
