"""Products with the Hessian of the loss with respect to the network's outputs.

The exact curvature of the adaptive step's quadratic model is the Gauss–Newton matrix
``C = Jᵀ H J``, ``J`` the Jacobian of the outputs with respect to the parameters and ``H``
the Hessian of the loss with respect to the outputs. The step computes ``J v`` by
forward-mode differentiation; this module gives ``H (J v)``:

- :func:`cross_entropy_hvp`: ``F.cross_entropy`` of logits with the classes on the last
  dimension, ``H = diag(p) − ppᵀ`` per row (``p`` the softmax), divided by the number of
  rows for a mean (over batch and positions);
- :func:`mse_hvp`: ``F.mse_loss``, ``H = 2I``, divided by the number of elements for a mean;
- :func:`loss_hvp`: any ``outputs -> scalar`` loss, by forward-over-reverse
  differentiation (one Hessian-vector product, never the Hessian).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch

__all__ = ["OutputLoss", "cross_entropy_hvp", "loss_hvp", "mse_hvp", "output_hvp"]

Reduction = Literal["mean", "sum"]
OutputLoss = Literal["cross_entropy", "mse"] | Callable[[torch.Tensor], torch.Tensor]
"""The loss as a function of the outputs: a known kind, or ``outputs -> scalar``."""


def _check(outputs: torch.Tensor, tangent: torch.Tensor, reduction: str) -> None:
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    if not isinstance(outputs, torch.Tensor) or not isinstance(tangent, torch.Tensor):
        raise TypeError("outputs and tangent must be tensors")
    if outputs.shape != tangent.shape:
        raise ValueError(
            f"tangent has shape {tuple(tangent.shape)}, outputs {tuple(outputs.shape)}"
        )


def cross_entropy_hvp(
    outputs: torch.Tensor, tangent: torch.Tensor, *, reduction: Reduction = "mean"
) -> torch.Tensor:
    """``H v`` for ``F.cross_entropy`` of the logits ``outputs`` (classes on the last dimension).

    Per row ``H v = p ⊙ v − p (pᵀ v)`` with ``p = softmax(outputs)``, divided by the number
    of rows (all dimensions but the last) for ``reduction="mean"``. The targets do not
    enter. The result has at least float32 precision.

    Example:
        >>> import torch
        >>> cross_entropy_hvp(torch.zeros(1, 2), torch.tensor([[1.0, -1.0]]))
        tensor([[ 0.5000, -0.5000]])
    """
    _check(outputs, tangent, reduction)
    dtype = torch.promote_types(outputs.dtype, torch.float32)
    p = torch.softmax(outputs.to(dtype), dim=-1)
    v = tangent.to(dtype)
    hv = p * v - p * (p * v).sum(dim=-1, keepdim=True)
    if reduction == "mean":
        hv = hv / max(outputs.numel() // max(outputs.shape[-1], 1), 1)
    return hv


def mse_hvp(
    outputs: torch.Tensor, tangent: torch.Tensor, *, reduction: Reduction = "mean"
) -> torch.Tensor:
    """``H v`` for ``F.mse_loss(outputs, targets, reduction=...)``: ``2v``, divided by the
    number of elements for ``reduction="mean"``.

    Example:
        >>> import torch
        >>> mse_hvp(torch.zeros(2, 2), torch.ones(2, 2))
        tensor([[0.5000, 0.5000],
                [0.5000, 0.5000]])
    """
    _check(outputs, tangent, reduction)
    dtype = torch.promote_types(outputs.dtype, torch.float32)
    scale = 2.0 / max(outputs.numel(), 1) if reduction == "mean" else 2.0
    return scale * tangent.to(dtype)


def loss_hvp(
    loss_fn: Callable[[torch.Tensor], torch.Tensor],
    outputs: torch.Tensor,
    tangent: torch.Tensor,
) -> torch.Tensor:
    """``H v`` for an arbitrary ``loss_fn: outputs -> scalar`` (close over the targets), by
    a forward-mode derivative of its gradient at ``outputs``.

    Example:
        >>> import torch
        >>> loss_fn = lambda y: (y ** 3).sum() / 3
        >>> loss_hvp(loss_fn, torch.tensor([1.0, 2.0]), torch.tensor([1.0, 1.0]))
        tensor([2., 4.])
    """
    _check(outputs, tangent, "sum")
    _, hv = torch.func.jvp(  # type: ignore[misc]
        torch.func.grad(loss_fn), (outputs.detach(),), (tangent,)
    )
    result: torch.Tensor = hv
    return result


def output_hvp(
    loss: OutputLoss,
    outputs: torch.Tensor,
    tangent: torch.Tensor,
    *,
    reduction: Reduction = "mean",
) -> torch.Tensor:
    """``H v`` for ``loss``: ``"cross_entropy"``, ``"mse"`` (with ``reduction``) or a callable
    ``outputs -> scalar`` (its own reduction; ``reduction`` is not used).

    Example:
        >>> import torch
        >>> output_hvp("mse", torch.zeros(4), torch.ones(4), reduction="sum")
        tensor([2., 2., 2., 2.])
    """
    if callable(loss):
        return loss_hvp(loss, outputs, tangent)
    if loss == "cross_entropy":
        return cross_entropy_hvp(outputs, tangent, reduction=reduction)
    if loss == "mse":
        return mse_hvp(outputs, tangent, reduction=reduction)
    raise ValueError(f"loss must be 'cross_entropy', 'mse' or a callable, got {loss!r}")
