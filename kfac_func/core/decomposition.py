"""Decompositions of the Kronecker factors, with retries that never stop training.

Two methods, both batched over leading dimensions (grouped convolutions):

- ``eigen``: ``A = Qa diag(da) Qaᵀ``, ``G = Qg diag(dg) Qgᵀ`` with eigenvalues clamped at
  zero. Optionally ``1 / (dg daᵀ + λ)`` is precomputed at decomposition time (``dgda``),
  fixing λ until the next decomposition; ``refresh_eigh`` updates a previous eigenbasis
  with one warm-started QR iteration instead of a new ``eigh``.
- ``inverse``: the damped inverses ``(A + λI)⁻¹`` and ``(G + λI)⁻¹``.

How they are applied to a gradient is in :mod:`kfac_func.core.preconditioning`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from kfac_func.core.attempts import Outcome, all_finite, compute_dtype_of, robust
from kfac_func.core.pytree import register_dataclass

__all__ = [
    "COMPUTE_METHODS",
    "DECOMPOSITIONS",
    "EIGENBASIS_REFRESH",
    "EKFACDecomposition",
    "EigenDecomposition",
    "InverseDecomposition",
    "damped_inverse",
    "decomposition_from_fields",
    "divide_eigenvalues",
    "divide_scale",
    "eigenvalue_outer",
    "eigh_attempt",
    "eigh_factor",
    "inverse_attempt",
    "power_refresh",
    "refresh_eigh",
]

COMPUTE_METHODS = ("eigen", "inverse", "ekfac")
EIGENBASIS_REFRESH = ("eigh", "qr")


@dataclass(frozen=True)
class EigenDecomposition:
    """Eigenbases and clamped eigenvalues of A and G; ``dgda`` when precomputed.

    A diagonal factor has no eigenbasis to store: ``qa`` (``qg``) is None, standing for the
    identity, and ``da`` (``dg``) holds its clamped diagonal.
    """

    qa: torch.Tensor | None
    da: torch.Tensor
    qg: torch.Tensor | None
    dg: torch.Tensor
    dgda: torch.Tensor | None = None


@dataclass(frozen=True)
class InverseDecomposition:
    """Damped inverses ``(A + λI)⁻¹`` and ``(G + λI)⁻¹``; the inverse of a diagonal factor
    is the vector ``1 / (d + λ)``."""

    a_inv: torch.Tensor
    g_inv: torch.Tensor


@dataclass(frozen=True)
class EKFACDecomposition:
    """EKFAC: K-FAC's eigenbases (``None`` for a diagonal factor: the identity) and the
    corrected eigenvalues ``scale`` of shape ``(*batch, g_dim, a_dim)``, the running second
    moment of the per-example gradients in that basis (see :mod:`kfac_func.core.ekfac`)."""

    qa: torch.Tensor | None
    qg: torch.Tensor | None
    scale: torch.Tensor


register_dataclass(EigenDecomposition, data=("qa", "da", "qg", "dg", "dgda"))
register_dataclass(InverseDecomposition, data=("a_inv", "g_inv"))
register_dataclass(EKFACDecomposition, data=("qa", "qg", "scale"))

Decomposition = EigenDecomposition | InverseDecomposition | EKFACDecomposition

DECOMPOSITIONS: dict[
    str, type[EigenDecomposition] | type[InverseDecomposition] | type[EKFACDecomposition]
] = {"eigen": EigenDecomposition, "inverse": InverseDecomposition, "ekfac": EKFACDecomposition}
"""The decomposition class of each compute method (:data:`COMPUTE_METHODS`)."""


def decomposition_from_fields(
    cls: type[EigenDecomposition] | type[InverseDecomposition] | type[EKFACDecomposition],
    fields: Mapping[str, torch.Tensor],
) -> Decomposition:
    """``cls`` from the tensors it holds; the fields that are not given (the eigenbasis of a
    diagonal factor, an absent ``dgda``) are None.

    Example:
        >>> d = decomposition_from_fields(EigenDecomposition, {"da": torch.ones(2),
        ...                               "qg": torch.eye(1), "dg": torch.ones(1)})
        >>> d.qa is None, d.dgda is None
        (True, True)
    """
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(fields) - set(names))
    if unknown:
        raise ValueError(f"{cls.__name__} has no fields {unknown}")
    return cls(**{n: fields.get(n) for n in names})  # type: ignore[arg-type]


def eigh_factor(
    factor: torch.Tensor,
    *,
    dtype: torch.dtype,
    compute_dtype: torch.dtype | None = None,
    label: str | None = None,
    first: Outcome | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(eigenvectors, eigenvalues clamped at 0)`` of one symmetric factor, in ``dtype``:
    of its upper triangle (mirrored), for a factor symmetric only up to rounding; the
    eigenvectors column-major, as LAPACK returns them.

    eigh runs in ``compute_dtype`` (default: ``dtype`` promoted to float32); if it fails
    or returns NaN/Inf it is retried in float64, then in float64 on ``F + εI`` with ε
    growing from 1e-10 to 1e-6 times the mean diagonal (ε is subtracted from the
    eigenvalues again). Raises :class:`~kfac_func.core.attempts.DecompositionError` if
    every attempt fails.

    eigh runs on the factor's device. After an error of a GPU solver library (cuSOLVER's
    ``CUSOLVER_STATUS_INVALID_VALUE`` on large factors, see
    :func:`~kfac_func.core.attempts.solver_error`) the retries run on the CPU, and their
    success is reported with a ``RuntimeWarning`` that starts with ``label`` (the layer
    and factor).
    ``first``: the first attempt's outcome, made already (see
    :func:`~kfac_func.core.attempts.robust`).

    Example:
        >>> q, d = eigh_factor(torch.diag(torch.tensor([2.0, -1e-9])), dtype=torch.float32)
        >>> d
        tensor([0., 2.])
    """

    cdt = compute_dtype_of(dtype, compute_dtype)
    q, d = robust(factor, cdt, eigh_attempt, "eigh", dtype, label=label, first=first)
    return q, d.clamp_(min=0.0)  # our own temporary


def eigh_attempt(f: torch.Tensor, jitter: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One attempt of :func:`eigh_factor`: ``(eigenvectors, eigenvalues)`` of ``f + jitter·I``
    (the jitter subtracted from the eigenvalues again), unchecked and unclamped.

    Example:
        >>> eigh_attempt(torch.diag(torch.tensor([2.0, 1.0])), 0.0)[1]
        tensor([1., 2.])
    """
    if jitter:
        f = f + jitter * torch.eye(f.shape[-1], dtype=f.dtype, device=f.device)
    # f.mT: the same symmetric matrix, already in the column-major layout LAPACK works
    # in, so eigh skips its transposing copy of the input; the eigenvectors stay
    # column-major, as LAPACK returns them (a row-major copy is another transposing
    # pass, as costly as the first)
    d, q = torch.linalg.eigh(f.mT)
    return q, d - jitter if jitter else d


def refresh_eigh(
    factor: torch.Tensor,
    q: torch.Tensor,
    *,
    dtype: torch.dtype,
    compute_dtype: torch.dtype | None = None,
    label: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """An approximate :func:`eigh_factor` warm-started from the previous eigenvectors
    ``q``: one power iteration ``F q = Q R`` (QR, columns by decreasing norm). ``Q`` is
    the new basis (column signs chosen so that ``diag(R) ≥ 0``) and ``diag(R) = Qᵀ F q``
    estimates the eigenvalues.

    One product and one QR instead of an eigendecomposition; exact when ``q`` spans the
    eigenvectors of ``F``, and converging towards them over successive refreshes of a
    slowly changing factor (as the basis updates of SOAP and Shampoo). Falls back to
    :func:`eigh_factor` if the iteration fails or is not finite (``label`` is that
    fallback's).

    Example:
        >>> f = torch.diag(torch.tensor([3.0, 1.0]))
        >>> q, d = refresh_eigh(f, torch.eye(2), dtype=torch.float32)
        >>> d
        tensor([3., 1.])
    """
    try:
        qn, d = power_refresh(factor, q, dtype=dtype)
        if all_finite(qn) and all_finite(d):
            return qn, d
    except RuntimeError:
        pass
    return eigh_factor(factor, dtype=dtype, compute_dtype=compute_dtype, label=label)


def power_refresh(
    factor: torch.Tensor, q: torch.Tensor, *, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The power iteration of :func:`refresh_eigh`, without its checks and fallback:
    ``F q = Q R``, the columns by decreasing norm, ``Q``'s signs such that
    ``diag(R) ≥ 0``; returns ``(Q, diag(R))`` in ``dtype``, the eigenvalues clamped at 0.

    Example:
        >>> q, d = power_refresh(torch.diag(torch.tensor([3.0, 1.0])), torch.eye(2),
        ...                      dtype=torch.float32)
        >>> d
        tensor([3., 1.])
    """
    p = factor.to(q.dtype) @ q
    # largest columns first: QR then fits the (near-)null directions last, into the
    # complement of the others, instead of orthogonalising against their noise
    order = torch.linalg.vector_norm(p, dim=-2).argsort(dim=-1, descending=True)
    p = p.gather(-1, order.unsqueeze(-2).expand_as(p))
    qn, r = torch.linalg.qr(p)
    diag = r.diagonal(dim1=-2, dim2=-1)
    sign = torch.where(diag < 0, -1.0, 1.0).to(qn.dtype)
    qn, d = (qn * sign.unsqueeze(-2)).to(dtype), (diag * sign).to(dtype)
    return qn, d.clamp(min=0.0)  # column-major, as QR returns it (and eigh_factor's)


def eigenvalue_outer(dg: torch.Tensor, da: torch.Tensor, damping: float) -> torch.Tensor:
    """``1 / (outer(dg, da) + damping)`` (batched over leading dimensions; with
    ``damping == 0`` the cut-off of :func:`divide_eigenvalues`)."""
    if damping > 0:  # the same numbers as the division, in place on one temporary
        outer = torch.outer(dg, da) if dg.dim() == 1 else dg.unsqueeze(-1) * da.unsqueeze(-2)
        return outer.add_(damping).reciprocal_()
    return divide_eigenvalues(torch.ones((), dtype=dg.dtype, device=dg.device), dg, da, damping)


def divide_eigenvalues(
    v: torch.Tensor, dg: torch.Tensor, da: torch.Tensor, damping: float
) -> torch.Tensor:
    """``v / (outer(dg, da) + damping)``; with ``damping == 0``, the pseudo-inverse:
    entries whose eigenvalue product is at most ``eps · max(shape) · max(product)`` (as
    ``torch.linalg.pinv``'s default cut-off) are 0 instead of Inf/NaN."""
    return divide_scale(v, dg.unsqueeze(-1) * da.unsqueeze(-2), damping)


def divide_scale(v: torch.Tensor, scale: torch.Tensor, damping: float) -> torch.Tensor:
    """``v / (scale + damping)`` (eigenvalues of a Kronecker basis, ``(..., g, a)``), with
    the pseudo-inverse cut-off of :func:`divide_eigenvalues` when ``damping == 0``."""
    den = scale + damping
    if damping > 0:
        return v / den
    cutoff = den.amax(dim=(-2, -1), keepdim=True) * torch.finfo(den.dtype).eps * max(den.shape[-2:])
    zero = torch.zeros((), dtype=den.dtype, device=den.device)
    return torch.where(den > cutoff, v / den, zero)


def damped_inverse(
    factor: torch.Tensor,
    damping: float,
    *,
    dtype: torch.dtype,
    compute_dtype: torch.dtype | None = None,
    label: str | None = None,
    first: Outcome | None = None,
) -> torch.Tensor:
    """``(F + damping·I)⁻¹`` of one factor, in ``dtype``.

    Retried like :func:`eigh_factor` when the inversion fails or is not finite (here the
    jitter adds to the damping; after a GPU solver error on the CPU, with a warning that
    starts with ``label``). Raises :class:`~kfac_func.core.attempts.DecompositionError`
    if every attempt fails.
    ``first``: the first attempt's outcome, made already (see
    :func:`~kfac_func.core.attempts.robust`).

    Example:
        >>> damped_inverse(torch.zeros(2, 2), 0.0, dtype=torch.float32)  # singular: jittered
        tensor([[1.0000e+10, 0.0000e+00],
                [0.0000e+00, 1.0000e+10]])
    """

    cdt = compute_dtype_of(dtype, compute_dtype)
    attempt = functools.partial(inverse_attempt, damping)
    (inv,) = robust(factor, cdt, attempt, "inverse", dtype, label=label, first=first)
    # the inverse of the transpose is the transpose of the inverse: LAPACK returns it
    # column-major, so the row-major inverse is a view
    return inv.mT


def inverse_attempt(damping: float, f: torch.Tensor, jitter: float) -> tuple[torch.Tensor]:
    """One attempt of :func:`damped_inverse`: ``(f + (damping + jitter)·I)⁻¹``, unchecked,
    column-major (the inverse of the transpose; :func:`damped_inverse` returns its
    row-major view).

    Example:
        >>> inverse_attempt(1.0, torch.eye(2), 0.0)[0]
        tensor([[0.5000, 0.0000],
                [0.0000, 0.5000]])
    """
    eye = torch.eye(f.shape[-1], dtype=f.dtype, device=f.device)
    # the damped factor is symmetric: inverted as its transpose, a column-major view,
    # LAPACK skips its transposing copy of the input
    return (torch.linalg.inv((f + (damping + jitter) * eye).mT),)
