"""Eigenbasis moments: Adam's per-coordinate step in K-FAC's eigenbasis.

SOAP (Vyas et al., 2024) runs Adam in the eigenbasis of Shampoo's factors; this is the
same idea in K-FAC's eigenbasis ``Qg ⊗ Qa``. A layer's gradient matrix ``M`` is projected,
``V = Qgᵀ M Qa``; the running second moment ``v ← β₂ v + (1 − β₂) V²`` (elementwise, the
first one ``(1 − β₂) V²``) and its bias correction ``v̂ = v / (1 − β₂ᵏ)`` after ``k``
gradients scale it, and the result is projected back:

    P = Qg [V / (sqrt(v̂) + ε)] Qaᵀ.

With ``β₁ > 0`` the gradient is first averaged as Adam's first moment, in the layer's own
coordinates (so it needs no carrying into a new basis): ``m ← β₁ m + (1 − β₁) M``,
``m̂ = m / (1 − β₁ᵏ)``, and ``P = Qg [(Qgᵀ m̂ Qa) / (sqrt(v̂) + ε)] Qaᵀ`` — SOAP's update with
K-FAC's bases; the optimizer that consumes ``P`` then takes no momentum of its own.

Where EKFAC divides by the second moment of *per-example* gradients plus damping (the
Fisher's diagonal in that basis, see :mod:`kfac_func.core.ekfac`), this divides by the root
of the second moment of the *batch* gradient, as Adam does. When the eigenbasis is
recomputed the moment is carried into the new one: with ``R = Q_newᵀ Q_old``,
``v ← (Rg ⊙ Rg) v (Ra ⊙ Ra)ᵀ``, the diagonal of the old moment's diagonal matrix in the
new basis (exact when the bases agree up to order and sign). A basis of None stands for
the identity (diagonal factors). Pure tensor functions, batched over leading dimensions.
"""

from __future__ import annotations

import torch

__all__ = [
    "adam_in_basis",
    "carry_moment",
    "carry_moments",
    "from_basis",
    "rotate_moment",
    "second_moment",
    "to_basis",
]


def to_basis(m: torch.Tensor, qa: torch.Tensor | None, qg: torch.Tensor | None) -> torch.Tensor:
    """``Qgᵀ M Qa`` (a missing basis: the identity).

    Example:
        >>> q = torch.tensor([[0.0, 1.0], [1.0, 0.0]])
        >>> to_basis(torch.tensor([[1.0, 2.0], [3.0, 4.0]]), None, q)
        tensor([[3., 4.],
                [1., 2.]])
    """
    v = m if qg is None else qg.mT @ m
    return v if qa is None else v @ qa


def from_basis(v: torch.Tensor, qa: torch.Tensor | None, qg: torch.Tensor | None) -> torch.Tensor:
    """``Qg V Qaᵀ``, the inverse of :func:`to_basis` for orthogonal bases.

    Example:
        >>> q = torch.linalg.qr(torch.randn(3, 3)).Q
        >>> m = torch.randn(2, 3)
        >>> torch.allclose(from_basis(to_basis(m, q, None), q, None), m, atol=1e-6)
        True
    """
    out = v if qg is None else qg @ v
    return out if qa is None else out @ qa.mT


def second_moment(moment: torch.Tensor | None, m: torch.Tensor, beta2: float) -> torch.Tensor:
    """The running average of the squares: ``β₂ · moment + (1 − β₂) · M²`` (``(1 − β₂) ·
    M²`` for the first).

    Example:
        >>> second_moment(None, torch.tensor([2.0]), 0.75)
        tensor([1.])
    """
    sq = m.pow(2).mul_(1 - beta2)
    return sq if moment is None else moment.mul(beta2).add_(sq.to(moment.dtype))


def adam_in_basis(
    m: torch.Tensor,
    qa: torch.Tensor | None,
    qg: torch.Tensor | None,
    moment: torch.Tensor | None,
    count: int,
    *,
    beta2: float,
    eps: float,
    first: torch.Tensor | None = None,
    beta1: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Precondition ``m`` with the running second moment in the eigenbasis.

    Args:
        m: the gradient matrix, ``(*batch, g_dim, a_dim)``, in the bases' dtype.
        qa, qg: the eigenbases (None: the identity).
        moment: the running second moment of the ``count`` previous gradients, or None.
        count: how many gradients ``moment`` holds (0 with None).
        beta2, eps: Adam's ``β₂`` and ``ε``.
        first: the running first moment, kept in the eigenbasis like ``moment``, when
            ``beta1 > 0``, or None.
        beta1: Adam's ``β₁``; 0 preconditions ``m`` itself.

    Returns:
        ``(P, new second moment, new first moment or None)``, the moments holding
        ``count + 1`` gradients.

    Example:
        >>> p, v, _ = adam_in_basis(torch.tensor([[2.0, -3.0]]), None, None, None, 0,
        ...                         beta2=0.9, eps=0.0)
        >>> p, v
        (tensor([[ 1., -1.]]), tensor([[0.4000, 0.9000]]))
    """
    projected = to_basis(m, qa, qg)
    new = second_moment(moment, projected, beta2)
    v_hat = new / (1 - beta2 ** (count + 1))
    new_first = None
    if beta1 > 0:  # the first moment is kept in the basis: no second projection
        step = projected.mul(1 - beta1)
        new_first = step if first is None else first.mul(beta1).add_(step.to(first.dtype))
        projected = new_first.to(projected.dtype) / (1 - beta1 ** (count + 1))
    scaled = projected / v_hat.sqrt().add_(eps).to(projected.dtype)
    return from_basis(scaled, qa, qg), new, new_first


def _overlap(new: torch.Tensor | None, old: torch.Tensor | None) -> torch.Tensor | None:
    """``Q_newᵀ Q_old``; None when both bases are the identity."""
    if new is None and old is None:
        return None
    if new is None:
        assert old is not None
        return old
    return new.mT if old is None else new.mT @ old.to(new.dtype)


def _sandwich(m: torch.Tensor, ra: torch.Tensor | None, rg: torch.Tensor | None) -> torch.Tensor:
    """``Rg M Raᵀ`` (a missing side: the identity)."""
    out = m if rg is None else rg.to(m.dtype) @ m
    return out if ra is None else out @ ra.to(m.dtype).mT


def rotate_moment(
    first: torch.Tensor,
    old: tuple[torch.Tensor | None, torch.Tensor | None],
    new: tuple[torch.Tensor | None, torch.Tensor | None],
) -> torch.Tensor:
    """A matrix kept in the bases ``old = (qa, qg)`` expressed in ``new = (qa, qg)``:
    ``Rg F Raᵀ`` with ``R = Q_newᵀ Q_old``, exact for orthogonal bases (the first moment,
    unlike the diagonal second moment, rotates without loss).

    Example:
        >>> swap = torch.tensor([[0.0, 1.0], [1.0, 0.0]])
        >>> rotate_moment(torch.tensor([[1.0, 2.0]]), (None, None), (swap, None))
        tensor([[2., 1.]])
    """
    return _sandwich(first, _overlap(new[0], old[0]), _overlap(new[1], old[1]))


def carry_moment(
    moment: torch.Tensor,
    old: tuple[torch.Tensor | None, torch.Tensor | None],
    new: tuple[torch.Tensor | None, torch.Tensor | None],
) -> torch.Tensor:
    """The moment kept in the bases ``old = (qa, qg)`` carried into ``new = (qa, qg)``:
    ``(Rg ⊙ Rg) v (Ra ⊙ Ra)ᵀ`` with ``R = Q_newᵀ Q_old``.

    Example:
        >>> swap = torch.tensor([[0.0, 1.0], [1.0, 0.0]])
        >>> carry_moment(torch.tensor([[1.0, 2.0]]), (None, None), (swap, None))
        tensor([[2., 1.]])
    """
    return carry_moments(moment, None, old, new)[0]


def carry_moments(
    moment: torch.Tensor,
    first: torch.Tensor | None,
    old: tuple[torch.Tensor | None, torch.Tensor | None],
    new: tuple[torch.Tensor | None, torch.Tensor | None],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`carry_moment` of the second moment and :func:`rotate_moment` of the first
    (None: none), from one product ``R = Q_newᵀ Q_old`` per side.

    Example:
        >>> swap = torch.tensor([[0.0, 1.0], [1.0, 0.0]])
        >>> carry_moments(torch.tensor([[1.0, 2.0]]), torch.tensor([[3.0, -4.0]]),
        ...               (None, None), (swap, None))
        (tensor([[2., 1.]]), tensor([[-4.,  3.]]))
    """
    ra, rg = _overlap(new[0], old[0]), _overlap(new[1], old[1])
    second = _sandwich(moment, None if ra is None else ra.pow(2), None if rg is None else rg.pow(2))
    return second, None if first is None else _sandwich(first, ra, rg)
