"""Stacks of equal-shaped tensors that are reused rather than copied again.

The grouped step (:mod:`kfac_func.step.grouped`) stacks the tensors of the layers of a
group and hands each layer a view of the result; :func:`stacked` recognises such views
and gives back the stack they came from, so that the next step does not copy them again.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["per_row", "stacked"]


def per_row(flags: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``flags`` (one value per row of ``like``, its leading dimension) shaped to
    broadcast over ``like``.

    Example:
        >>> per_row(torch.tensor([1.0, 2.0]), torch.zeros(2, 3, 4)).shape
        torch.Size([2, 1, 1])
    """
    return flags.reshape(-1, *([1] * (like.dim() - 1)))


def stacked(xs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, bool]:
    """``(torch.stack(xs), True)``; or ``(base, False)`` where ``xs`` are already the
    consecutive views ``base[0], base[1], ...`` of one tensor (as the unbound results of
    an earlier grouped step are): no copy then. Always a copy when compiling. Matrices
    held column-major (as LAPACK returns eigenvectors) are stacked column-major, so that
    products on the stack take the same path as on each matrix.

    Example:
        >>> slab = torch.zeros(3, 2)
        >>> stacked(slab.unbind(0))[0] is slab, stacked([torch.ones(2), torch.ones(2)])[1]
        (True, True)
        >>> stacked([torch.ones(2, 3).mT, torch.zeros(2, 3).mT])[0].stride()
        (6, 1, 3)
    """
    base = xs[0]._base
    if base is not None and not torch.compiler.is_compiling():
        if _views_of(xs, base, base):
            return base, False
        if base.dim() >= 3 and _views_of(xs, base.mT, base):  # a column-major stack
            return base.mT, False
    stack = torch.stack(list(xs))
    if all(_column_major(x) for x in xs):  # a few operations whatever the count
        return stack.mT.contiguous().mT, True
    return stack, True


def _column_major(x: torch.Tensor) -> bool:
    """Whether ``x`` is a stack of column-major matrices (read from its strides, without
    an operation)."""
    if x.dim() < 2 or x.is_contiguous():
        return False
    n, m = x.shape[-2], x.shape[-1]
    expected, size = [1, n], n * m
    for d in range(x.dim() - 3, -1, -1):
        expected.insert(0, size)
        size *= x.shape[d]
    return list(x.stride()) == expected


def _views_of(xs: Sequence[torch.Tensor], whole: torch.Tensor, base: torch.Tensor) -> bool:
    """Whether ``xs`` are ``whole[0], whole[1], ...`` (``whole``: ``base`` or its
    transpose, ``base`` the tensor they are views of)."""
    first = xs[0]
    return (
        whole.dim() == first.dim() + 1
        and whole.shape[0] == len(xs)
        and whole.shape[1:] == first.shape
        and whole.stride()[1:] == first.stride()
        and whole.dtype == first.dtype
        and all(
            x._base is base and x.storage_offset() == whole.storage_offset() + i * whole.stride(0)
            for i, x in enumerate(xs)
        )
    )
