"""Orthogonalized steps preconditioned by K-FAC's factors (Muon's step on K-FAC's curvature).

Muon (Jordan et al., 2024) replaces a weight matrix's momentum ``U`` by the nearest
semi-orthogonal matrix, ``U Vᵀ`` of its SVD, approximated by a few Newton–Schulz
iterations. Here the momentum is first preconditioned by powers of the layer's damped
Kronecker factors,

    P = (G + λ_G I)^(-q) · U · (A + λ_A I)^(-p),

with ``λ`` relative to each factor's mean eigenvalue (``λ_A = δ · tr(A) / n``: the
orthogonalized step does not depend on the factors' overall scale, and neither does the
damping), and then orthogonalized. ``q = 0`` is the one-sided step (the input side only,
the gradient times a power of the input covariance, as "Newton–Muon" with ``p = 1``);
``p = q = 1/4`` the two-sided one (Shampoo's powers under the orthogonalization).

The powers are computed from the factors' eigendecompositions (:class:`EigenDecomposition`:
``Qa diag((da + λ)^(-p)) Qaᵀ``; a diagonal factor, a basis of None, is its own eigenbasis)
when the factors are decomposed, and kept as matrices (:class:`FactorPowers`), so that a
step applies each side with one product, in the iteration's dtype. Pure tensor functions,
batched over leading dimensions (grouped layers, stacked groups).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kfac_func.core.decomposition import EigenDecomposition
from kfac_func.core.preconditioning import (
    column_blocks,
    left_product,
    merge_column_blocks,
    right_product,
)
from kfac_func.core.pytree import register_dataclass

__all__ = [
    "NS_COEFFICIENTS",
    "FactorPowers",
    "apply_powers",
    "blocked_step",
    "damped_power",
    "factor_powers",
    "newton_schulz",
    "orthogonal_scale",
]

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
"""``(a, b, c)`` of Muon's quintic iteration ``X ← a X + b (X Xᵀ) X + c (X Xᵀ)² X``: chosen
to drive small singular values up fast: after 5 steps from a Frobenius-normalized matrix,
every singular value above 0.3 % of the norm lies in [0.68, 1.21] instead of at exactly 1
(smaller ones are raised less)."""


def newton_schulz(x: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """The approximate orthogonalization of ``x`` (its last two dimensions) by ``steps``
    quintic Newton–Schulz iterations, in ``x``'s dtype.

    ``x`` is divided by its Frobenius norm (plus ``eps``), so that every singular value is
    at most 1, then iterated with :data:`NS_COEFFICIENTS` on its wide orientation (``X Xᵀ``
    the smaller Gram). The result is ``U f(S) Vᵀ`` for the SVD ``x = U S Vᵀ``, with ``f``
    the iteration's scalar polynomial applied to ``S / (‖x‖_F + eps)``: near ``U Vᵀ``,
    within the error :data:`NS_COEFFICIENTS` states.

    Example:
        >>> x = torch.tensor([[3.0, 0.0], [0.0, 0.5]], dtype=torch.float64)
        >>> s = torch.linalg.svdvals(newton_schulz(x))
        >>> bool(((s > 0.6) & (s < 1.25)).all())
        True
    """
    a, b, c = NS_COEFFICIENTS
    tall = x.shape[-2] > x.shape[-1]
    y = x.mT if tall else x
    norm = torch.linalg.matrix_norm(y, keepdim=True)
    y = y / (norm + eps)
    for _ in range(steps):
        gram = y @ y.mT
        # b·gram + c·gram², then a·y + (...)·y: two fused multiply-adds, no extra passes
        y = _fused(y, _fused(gram, gram, gram, b, c), y, a)
    out: torch.Tensor = y.mT if tall else y
    return out


def _fused(
    acc: torch.Tensor, x: torch.Tensor, y: torch.Tensor, beta: float, alpha: float = 1.0
) -> torch.Tensor:
    """``beta · acc + alpha · (x @ y)`` in one call (``addmm``, or ``baddbmm`` over the
    leading dimensions flattened)."""
    if x.dim() == 2:
        return torch.addmm(acc, x, y, beta=beta, alpha=alpha)
    lead = x.shape[:-2]
    out = torch.baddbmm(
        acc.reshape(-1, *acc.shape[-2:]),
        x.reshape(-1, *x.shape[-2:]),
        y.reshape(-1, *y.shape[-2:]),
        beta=beta,
        alpha=alpha,
    )
    return out.reshape(*lead, *out.shape[-2:])


def orthogonal_scale(shape: torch.Size | tuple[int, ...]) -> float:
    """The factor that gives an orthogonalized ``(rows, cols)`` step the root-mean-square
    of AdamW's (``0.2 · sqrt(max(rows, cols))``, Muon's ``match_rms_adamw``), so that one
    learning rate serves it and AdamW's parameters.

    Example:
        >>> orthogonal_scale((64, 256))
        3.2
    """
    return 0.2 * math.sqrt(max(shape[-2], shape[-1]))


def damped_power(
    eigenvalues: torch.Tensor, power: float, damping: float, width: int | None = None
) -> torch.Tensor:
    """``(d + δ · mean(d))^(-power)`` of a factor's eigenvalues ``d`` (clamped at 0; the
    mean over the last dimension), relative damping ``δ``. A factor that is all zeros
    (no statistics yet) gives ones. With ``width``, ``d`` holds the eigenvalues of a
    blocked factor's blocks (``(..., k, w)``, see
    :attr:`kfac_func.blocks.LayerSpec.a_blocks`): the mean is over all of them, a sum over
    the last two dimensions divided by the side's ``width`` (its padding, whose
    eigenvalues are 0, not counted), so that ``λ`` is the whole factor's, ``δ·tr(A)/n``.

    Example:
        >>> damped_power(torch.tensor([3.0, 1.0]), 1.0, 0.5)
        tensor([0.2500, 0.5000])
        >>> damped_power(torch.tensor([[3.0], [1.0]]), 1.0, 0.5, width=2)
        tensor([[0.2500],
                [0.5000]])
    """
    d = eigenvalues.clamp(min=0.0)
    mean = d.mean(-1, keepdim=True) if width is None else d.sum((-2, -1), keepdim=True) / width
    shifted = d + damping * mean
    safe = torch.where(mean > 0, shifted, torch.ones_like(shifted))
    return safe.pow(-power)


@dataclass(frozen=True)
class FactorPowers:
    """One layer's damped factor powers, ``(A + λ_A I)^(-p)`` and ``(G + λ_G I)^(-q)``
    (:func:`factor_powers`): matrices, a diagonal factor's as the vector of its diagonal,
    None for a power of 0 (that side is left alone)."""

    a: torch.Tensor | None
    g: torch.Tensor | None


register_dataclass(FactorPowers, data=("a", "g"))


def factor_powers(
    decomposition: EigenDecomposition,
    powers: tuple[float, float],
    damping: float,
    a_width: int | None = None,
) -> FactorPowers:
    """The :class:`FactorPowers` of ``powers = (p, q)`` (A's, G's) from the eigenbases of
    ``decomposition``; ``λ`` is ``damping`` times each factor's mean eigenvalue
    (:func:`damped_power`). In the decomposition's dtype. ``a_width``: A is blocked (its
    eigenpairs are its blocks', see :attr:`kfac_func.blocks.LayerSpec.a_blocks`) and
    this wide; its power is blocked too, and :func:`apply_powers` applies it block by
    block.

    Example:
        >>> from kfac_func.core.layer_decomposition import eigen_decompose
        >>> dec = eigen_decompose(torch.tensor([[4.0, 0.0], [0.0, 1.0]]), torch.eye(3), 0.0)
        >>> f = factor_powers(dec, (0.5, 0.0), 0.0)
        >>> f.a, f.g
        (tensor([[0.5000, 0.0000],
                [0.0000, 1.0000]]), None)
    """

    def side(
        q: torch.Tensor | None, d: torch.Tensor, power: float, width: int | None = None
    ) -> torch.Tensor | None:
        if power == 0:
            return None
        scale = damped_power(d, power, damping, width)
        return scale if q is None else (q * scale.unsqueeze(-2)) @ q.mT

    d = decomposition
    return FactorPowers(side(d.qa, d.da, powers[0], a_width), side(d.qg, d.dg, powers[1]))


def apply_powers(m: torch.Tensor, powers: FactorPowers) -> torch.Tensor:
    """``P_G · M · P_A`` for the :class:`FactorPowers` ``powers`` (a vector scales the rows
    or columns; a blocked ``P_A`` multiplies its blocks' columns, see
    :func:`~kfac_func.core.preconditioning.right_product`; a side of None is left
    alone), in ``m``'s dtype.

    Example:
        >>> f = FactorPowers(torch.tensor([2.0, 3.0]), None)
        >>> apply_powers(torch.ones(1, 2), f)
        tensor([[2., 3.]])
    """
    v = m if powers.a is None else right_product(m, powers.a.to(m.dtype))
    return v if powers.g is None else left_product(powers.g.to(m.dtype), v)


def blocked_step(u: torch.Tensor, power: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """The orthogonalized step of ``u`` (``(..., rows, n)``) whose A power is blocked
    (``(..., k, w, w)``, see :attr:`kfac_func.blocks.LayerSpec.a_blocks`), block by block
    as Distributed Shampoo steps a blocked parameter: each block of ``w`` columns of ``u``
    (the last padded with zero columns) times its block of the power, orthogonalized
    (:func:`newton_schulz`) and scaled (:func:`orthogonal_scale` of ``(rows, w)``) on its
    own, in ``u``'s dtype. Its Newton–Schulz work is ``rows · n · w`` where the whole
    matrix's is ``rows · n · min(rows, n)``.

    Example:
        >>> g = torch.Generator().manual_seed(0)
        >>> u = torch.randn(4, 6, dtype=torch.float64, generator=g)
        >>> out = blocked_step(u, torch.eye(3, dtype=torch.float64).expand(2, 3, 3))
        >>> s = [torch.linalg.svdvals(b) / orthogonal_scale((4, 3)) for b in out.split(3, 1)]
        >>> [bool(((v > 0.68) & (v < 1.21)).all()) for v in s]  # each block near-orthogonal
        [True, True]
    """
    k, w = power.shape[-3], power.shape[-1]
    split = column_blocks(u, k, w) @ power.to(u.dtype)
    out = newton_schulz(split, steps) * orthogonal_scale((u.shape[-2], w))
    return merge_column_blocks(out, u.shape[-1])
