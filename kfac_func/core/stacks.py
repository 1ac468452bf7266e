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
    an earlier grouped step are): no copy then. Always a copy when compiling.

    Example:
        >>> slab = torch.zeros(3, 2)
        >>> stacked(slab.unbind(0))[0] is slab, stacked([torch.ones(2), torch.ones(2)])[1]
        (True, True)
    """
    first, base = xs[0], xs[0]._base
    if (
        base is not None
        and not torch.compiler.is_compiling()
        and base.dim() == first.dim() + 1
        and base.shape[0] == len(xs)
        and base.shape[1:] == first.shape
        and base.stride()[1:] == first.stride()
        and base.dtype == first.dtype
        and all(
            x._base is base and x.storage_offset() == base.storage_offset() + i * base.stride(0)
            for i, x in enumerate(xs)
        )
    ):
        return base, False
    return torch.stack(list(xs)), True
