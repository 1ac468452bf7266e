"""Decompositions of the Kronecker factors and preconditioning of a gradient matrix.

Two methods, both batched over leading dimensions (grouped convolutions):

- ``eigen``: ``A = Qa diag(da) Qaᵀ``, ``G = Qg diag(dg) Qgᵀ`` with eigenvalues clamped at
  zero; the preconditioned gradient solves ``(G ⊗ A + λI) x = vec(M)`` exactly:
  ``x = Qg [(Qgᵀ M Qa) / (dg daᵀ + λ)] Qaᵀ``. Optionally ``1 / (dg daᵀ + λ)`` is
  precomputed at decomposition time (``dgda``), fixing λ until the next decomposition.
- ``inverse``: ``x = (G + λI)⁻¹ M (A + λI)⁻¹``.

With row-major flattening, ``vec(G M A) = (G ⊗ A) vec(M)`` for symmetric ``A``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kfac_func._pytree import register_dataclass

__all__ = [
    "COMPUTE_METHODS",
    "EigenDecomposition",
    "InverseDecomposition",
    "damped_inverse",
    "eigen_decompose",
    "eigenvalue_outer",
    "eigh_factor",
    "inverse_decompose",
    "kl_clip_scale",
    "precondition",
]

COMPUTE_METHODS = ("eigen", "inverse")


@dataclass(frozen=True)
class EigenDecomposition:
    """Eigenbases and clamped eigenvalues of A and G; ``dgda`` when precomputed."""

    qa: torch.Tensor
    da: torch.Tensor
    qg: torch.Tensor
    dg: torch.Tensor
    dgda: torch.Tensor | None = None


@dataclass(frozen=True)
class InverseDecomposition:
    """Damped inverses ``(A + λI)⁻¹`` and ``(G + λI)⁻¹``."""

    a_inv: torch.Tensor
    g_inv: torch.Tensor


register_dataclass(EigenDecomposition, data=("qa", "da", "qg", "dg", "dgda"))
register_dataclass(InverseDecomposition, data=("a_inv", "g_inv"))

Decomposition = EigenDecomposition | InverseDecomposition


def eigh_factor(
    factor: torch.Tensor, *, dtype: torch.dtype, compute_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(eigenvectors, eigenvalues clamped at 0)`` of one symmetric factor, in ``dtype``.

    Example:
        >>> q, d = eigh_factor(torch.diag(torch.tensor([2.0, -1e-9])), dtype=torch.float32)
        >>> d
        tensor([0., 2.])
    """
    cdt = compute_dtype or torch.promote_types(dtype, torch.float32)
    d, q = torch.linalg.eigh(factor.to(cdt))
    # eigh returns column-major eigenvectors; a row-major copy makes later products take
    # the same BLAS path on every rank, whether the tensor was computed or received
    return q.to(dtype).contiguous(), d.clamp(min=0.0).to(dtype)


def eigenvalue_outer(dg: torch.Tensor, da: torch.Tensor, damping: float) -> torch.Tensor:
    """``1 / (outer(dg, da) + damping)`` (batched over leading dimensions)."""
    return 1.0 / (dg.unsqueeze(-1) * da.unsqueeze(-2) + damping)


def damped_inverse(
    factor: torch.Tensor,
    damping: float,
    *,
    dtype: torch.dtype,
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``(F + damping·I)⁻¹`` of one factor, in ``dtype``."""
    cdt = compute_dtype or torch.promote_types(dtype, torch.float32)
    f = factor.to(cdt)
    eye = torch.eye(f.shape[-1], dtype=cdt, device=f.device)
    inv: torch.Tensor = torch.linalg.inv(f + damping * eye)
    return inv.to(dtype).contiguous()  # row-major, as in eigh_factor


def eigen_decompose(
    a: torch.Tensor,
    g: torch.Tensor,
    damping: float,
    *,
    dtype: torch.dtype = torch.float32,
    compute_dtype: torch.dtype | None = None,
    outer_product: bool = False,
) -> EigenDecomposition:
    """Eigendecompose both factors.

    Args:
        a, g: symmetric factors (optionally batched).
        damping: λ, used only when ``outer_product`` precomputes ``1/(dg daᵀ + λ)``.
        dtype: storage dtype of the result (``inv_dtype``).
        compute_dtype: dtype eigh runs in (default: ``dtype`` promoted to float32).
        outer_product: precompute ``dgda = 1 / (outer(dg, da) + λ)``.

    Example:
        >>> import torch
        >>> eig = eigen_decompose(torch.eye(3), 2 * torch.eye(2), 0.0)
        >>> eig.da, eig.dg
        (tensor([1., 1., 1.]), tensor([2., 2.]))
    """
    qa, da = eigh_factor(a, dtype=dtype, compute_dtype=compute_dtype)
    qg, dg = eigh_factor(g, dtype=dtype, compute_dtype=compute_dtype)
    dgda = eigenvalue_outer(dg, da, damping) if outer_product else None
    return EigenDecomposition(qa, da, qg, dg, dgda)


def inverse_decompose(
    a: torch.Tensor,
    g: torch.Tensor,
    damping: float,
    *,
    dtype: torch.dtype = torch.float32,
    compute_dtype: torch.dtype | None = None,
) -> InverseDecomposition:
    """Damped inverses of both factors.

    Example:
        >>> import torch
        >>> inv = inverse_decompose(torch.eye(2), torch.eye(2), 1.0)
        >>> inv.a_inv
        tensor([[0.5000, 0.0000],
                [0.0000, 0.5000]])
    """
    return InverseDecomposition(
        damped_inverse(a, damping, dtype=dtype, compute_dtype=compute_dtype),
        damped_inverse(g, damping, dtype=dtype, compute_dtype=compute_dtype),
    )


def precondition(
    matrix: torch.Tensor, decomposition: Decomposition, damping: float
) -> torch.Tensor:
    """Apply the damped inverse Kronecker curvature to a gradient matrix.

    Computes in the decomposition's dtype and returns the matrix's dtype. ``damping`` is
    ignored when the eigen decomposition holds a precomputed ``dgda`` and by the inverse
    method (whose damping is inside the stored inverses).

    Example:
        >>> import torch
        >>> eig = eigen_decompose(torch.eye(2), torch.eye(2), 0.0)
        >>> precondition(torch.ones(2, 2), eig, damping=1.0)
        tensor([[0.5000, 0.5000],
                [0.5000, 0.5000]])
    """
    d = decomposition
    if isinstance(d, InverseDecomposition):
        m = matrix.to(d.a_inv.dtype)
        return (d.g_inv @ m @ d.a_inv).to(matrix.dtype)
    m = matrix.to(d.qa.dtype)
    v = d.qg.mT @ m @ d.qa
    if d.dgda is not None:
        v = v * d.dgda
    else:
        v = v / (d.dg.unsqueeze(-1) * d.da.unsqueeze(-2) + damping)
    return (d.qg @ v @ d.qa.mT).to(matrix.dtype)


def kl_clip_scale(
    pairs: list[tuple[torch.Tensor, torch.Tensor]], kl_clip: float, lr: float
) -> torch.Tensor:
    """``min(1, sqrt(kl_clip / |lr² · Σ P ⊙ grad|))`` over (preconditioned, raw) pairs.

    Returns a 0-d tensor (1 when the sum is zero), so no device sync is forced.

    Example:
        >>> import torch
        >>> kl_clip_scale([(torch.tensor([2.0]), torch.tensor([2.0]))], kl_clip=1.0, lr=1.0)
        tensor(0.5000)
    """
    if not pairs:
        return torch.tensor(1.0)
    dtype = pairs[0][0].dtype
    vg = torch.stack(
        [torch.dot(p.reshape(-1), g.reshape(-1).to(p.dtype)).double() for p, g in pairs]
    )
    vg = vg.sum() * (lr * lr)
    return torch.clamp(torch.sqrt(kl_clip / vg.abs()), max=1.0).to(dtype)
