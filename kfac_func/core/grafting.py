"""Grafting (as Distributed Shampoo does): K-FAC's direction with another optimizer's step
length, layer by layer.

A layer's preconditioned gradient ``P`` is rescaled to the norm of what the grafted
optimizer would step with for that layer: the gradient ``M`` itself (``"sgd"``), or Adam's
``M / (sqrt(v̂) + eps)`` with ``v`` the running average of ``M²`` (``β₂``) and
``v̂ = v / (1 − β₂ᵗ)`` (``"adam"``). The learning rate, momentum and schedule of the
optimizer that consumes the gradients then act on K-FAC's direction as they would on that
optimizer's own. Pure tensor functions.
"""

from __future__ import annotations

import torch

__all__ = ["GRAFTING", "graft_moment", "graft_scale"]

GRAFTING = ("sgd", "adam")


def graft_moment(moment: torch.Tensor | None, m: torch.Tensor, beta2: float) -> torch.Tensor:
    """``β₂ · moment + (1 − β₂) · M²`` (``(1 − β₂) · M²`` for the first).

    Example:
        >>> graft_moment(None, torch.tensor([2.0]), 0.75)
        tensor([1.])
    """
    sq = m.pow(2).mul_(1 - beta2)
    return sq if moment is None else moment.mul(beta2).add_(sq.to(moment.dtype))


def graft_scale(
    p: torch.Tensor,
    m: torch.Tensor,
    mode: str,
    *,
    moment: torch.Tensor | None = None,
    step: int = 1,
    beta2: float = 0.999,
    eps: float = 1e-8,
) -> torch.Tensor:
    """The factor that gives the preconditioned ``p`` the norm of the grafted step (a 0-d
    tensor; 1 where ``p`` is zero).

    Example:
        >>> p, m = torch.tensor([3.0, 4.0]), torch.tensor([0.6, 0.8])
        >>> graft_scale(p, m, "sgd")
        tensor(0.2000)
    """
    if mode == "sgd":
        target = torch.linalg.vector_norm(m)
    elif mode == "adam":
        if moment is None:
            raise ValueError("Adam grafting needs the running second moment of the gradient")
        v_hat = moment / (1 - beta2**step)
        target = torch.linalg.vector_norm(m / (v_hat.sqrt() + eps))
    else:
        raise ValueError(f"grafting must be one of {GRAFTING} or None, got {mode!r}")
    norm = torch.linalg.vector_norm(p)
    one = torch.ones((), dtype=norm.dtype, device=norm.device)
    return torch.where(norm > 0, target.to(norm.dtype) / norm, one)
