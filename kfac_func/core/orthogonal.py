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

The powers are taken in the factors' eigenbases (:class:`EigenDecomposition`): ``Qa``,
``da`` and ``Qg``, ``dg``; a diagonal factor (a basis of None) is its own eigenbasis. Pure
tensor functions, batched over leading dimensions (grouped layers, stacked groups).
"""

from __future__ import annotations

import math

import torch

from kfac_func.core.decomposition import EigenDecomposition

__all__ = [
    "NS_COEFFICIENTS",
    "damped_power",
    "newton_schulz",
    "orthogonal_scale",
    "power_precondition",
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
        y = a * y + (b * gram + c * (gram @ gram)) @ y
    out: torch.Tensor = y.mT if tall else y
    return out


def orthogonal_scale(shape: torch.Size | tuple[int, ...]) -> float:
    """The factor that gives an orthogonalized ``(rows, cols)`` step the root-mean-square
    of AdamW's (``0.2 · sqrt(max(rows, cols))``, Muon's ``match_rms_adamw``), so that one
    learning rate serves it and AdamW's parameters.

    Example:
        >>> orthogonal_scale((64, 256))
        3.2
    """
    return 0.2 * math.sqrt(max(shape[-2], shape[-1]))


def damped_power(eigenvalues: torch.Tensor, power: float, damping: float) -> torch.Tensor:
    """``(d + δ · mean(d))^(-power)`` of a factor's eigenvalues ``d`` (clamped at 0; the
    mean over the last dimension), relative damping ``δ``. A factor that is all zeros
    (no statistics yet) gives ones.

    Example:
        >>> damped_power(torch.tensor([3.0, 1.0]), 1.0, 0.5)
        tensor([0.2500, 0.5000])
    """
    d = eigenvalues.clamp(min=0.0)
    mean = d.mean(-1, keepdim=True)
    shifted = d + damping * mean
    safe = torch.where(mean > 0, shifted, torch.ones_like(shifted))
    return safe.pow(-power)


def power_precondition(
    m: torch.Tensor,
    decomposition: EigenDecomposition,
    powers: tuple[float, float],
    damping: float,
) -> torch.Tensor:
    """``(G + λ_G I)^(-q) · M · (A + λ_A I)^(-p)`` for ``powers = (p, q)`` (A's, G's), the
    powers taken in the eigenbases of ``decomposition``; ``λ`` is ``damping`` times each
    factor's mean eigenvalue (:func:`damped_power`). A power of 0 leaves its side alone
    (its factor is not read). Computed in the decomposition's dtype, returned in ``m``'s.

    Example:
        >>> from kfac_func.core.layer_decomposition import eigen_decompose
        >>> a = torch.tensor([[4.0, 0.0], [0.0, 1.0]])
        >>> dec = eigen_decompose(a, torch.eye(3), 0.0)
        >>> power_precondition(torch.ones(3, 2), dec, (0.5, 0.0), 0.0)[0]
        tensor([0.5000, 1.0000])
    """
    d = decomposition
    p, q = powers
    v = m.to(d.da.dtype)
    if p != 0:
        scale = damped_power(d.da, p, damping).unsqueeze(-2)
        v = v * scale if d.qa is None else ((v @ d.qa) * scale) @ d.qa.mT
    if q != 0:
        scale = damped_power(d.dg, q, damping).unsqueeze(-1)
        v = v * scale if d.qg is None else d.qg @ (scale * (d.qg.mT @ v))
    return v.to(m.dtype)
