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
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from kfac_func.core.pytree import register_dataclass

__all__ = [
    "COMPUTE_METHODS",
    "EIGENBASIS_REFRESH",
    "DecompositionError",
    "EigenDecomposition",
    "InverseDecomposition",
    "all_finite",
    "condition_estimate",
    "damped_inverse",
    "decomposition_from_fields",
    "decomposition_shapes",
    "diagonal_eigenvalues",
    "diagonal_inverse",
    "divide_eigenvalues",
    "eigen_decompose",
    "eigenvalue_outer",
    "eigh_factor",
    "eigh_or_refresh",
    "eigh_side",
    "inverse_decompose",
    "inverse_side",
    "precompute_outer",
    "refresh_eigh",
]

COMPUTE_METHODS = ("eigen", "inverse")
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


register_dataclass(EigenDecomposition, data=("qa", "da", "qg", "dg", "dgda"))
register_dataclass(InverseDecomposition, data=("a_inv", "g_inv"))

Decomposition = EigenDecomposition | InverseDecomposition


def decomposition_from_fields(
    cls: type[EigenDecomposition] | type[InverseDecomposition], fields: Mapping[str, torch.Tensor]
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


def all_finite(t: torch.Tensor) -> bool:
    """Whether every entry is finite: a finite sum proves it without the temporaries of
    ``isfinite``; only a sum that overflowed is checked entry by entry.

    Example:
        >>> all_finite(torch.tensor([1.0, 2.0])), all_finite(torch.tensor([1.0, float("nan")]))
        (True, False)
    """
    if t.numel() == 0:
        return True
    if bool(torch.isfinite(t.sum())):
        return True
    return bool(torch.isfinite(t).all())


class DecompositionError(ArithmeticError):
    """A factor could not be decomposed, not even in float64 with added jitter.

    The message says what was tried and gives the factor's condition estimate."""


# relative jitters (times the mean |diagonal| of the factor) of the float64 retries
_JITTERS = (0.0, 1e-10, 1e-6)


def condition_estimate(factor: torch.Tensor) -> float:
    """Largest ratio of extreme singular values over the batch (inf if singular, nan if
    the factor is not finite); from the diagonal if the SVD itself fails.

    Example:
        >>> condition_estimate(torch.diag(torch.tensor([4.0, 0.5])))
        8.0
    """
    f = factor.detach().to(torch.float64)
    if not all_finite(f):
        return math.nan
    try:
        s = torch.linalg.svdvals(f)
        hi, lo = s[..., 0], s[..., -1]
    except RuntimeError:
        diag = f.diagonal(dim1=-2, dim2=-1).abs()
        hi, lo = diag.amax(-1), diag.amin(-1)
    with torch.no_grad():
        ratio = torch.where(lo > 0, hi / lo.clamp(min=1e-300), torch.full_like(hi, math.inf))
    return float(ratio.max())


def _robust(
    factor: torch.Tensor,
    compute_dtype: torch.dtype,
    attempt: Callable[[torch.Tensor, float], tuple[torch.Tensor, ...]],
    what: str,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, ...]:
    """``attempt(factor in some dtype, jitter)`` in ``compute_dtype``, then in float64,
    then in float64 with growing jitter, until its results are finite in ``dtype`` (the
    storage dtype: a float64 result may overflow float32). Returns them in ``dtype``."""
    if not all_finite(factor):
        raise DecompositionError(f"{what}: the factor holds NaN/Inf")
    scale = float(factor.detach().diagonal(dim1=-2, dim2=-1).abs().double().mean())
    scale = scale if scale > 0 else 1.0
    plan = [(compute_dtype, 0.0)] if compute_dtype != torch.float64 else []
    plan += [(torch.float64, rel * scale) for rel in _JITTERS]
    tried = []
    for dt, jitter in plan:
        where = f"{str(dt).removeprefix('torch.')}" + (f" + {jitter:.2g}·I" if jitter else "")
        try:
            out = tuple(t.to(dtype) for t in attempt(factor.to(dt), jitter))
        except RuntimeError as err:  # torch.linalg.LinAlgError and kin
            tried.append(f"{where}: {str(err).splitlines()[0][:120]}")
            continue
        if all(all_finite(t) for t in out):
            return out
        tried.append(f"{where}: non-finite result in {str(dtype).removeprefix('torch.')}")
    raise DecompositionError(
        f"{what} failed ({'; '.join(tried)}); condition estimate {condition_estimate(factor):.3g}"
    )


def eigh_factor(
    factor: torch.Tensor, *, dtype: torch.dtype, compute_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(eigenvectors, eigenvalues clamped at 0)`` of one symmetric factor, in ``dtype``.

    eigh runs in ``compute_dtype`` (default: ``dtype`` promoted to float32); if it fails
    or returns NaN/Inf it is retried in float64, then in float64 on ``F + εI`` with ε
    growing from 1e-10 to 1e-6 times the mean diagonal (ε is subtracted from the
    eigenvalues again). Raises :class:`DecompositionError` if every attempt fails.

    Example:
        >>> q, d = eigh_factor(torch.diag(torch.tensor([2.0, -1e-9])), dtype=torch.float32)
        >>> d
        tensor([0., 2.])
    """

    def attempt(f: torch.Tensor, jitter: float) -> tuple[torch.Tensor, torch.Tensor]:
        if jitter:
            f = f + jitter * torch.eye(f.shape[-1], dtype=f.dtype, device=f.device)
        d, q = torch.linalg.eigh(f)
        return q, d - jitter if jitter else d

    cdt = compute_dtype or torch.promote_types(dtype, torch.float32)
    q, d = _robust(factor, cdt, attempt, "eigh", dtype)
    # eigh returns column-major eigenvectors; a row-major copy makes later products take
    # the same BLAS path on every rank, whether the tensor was computed or received
    return q.contiguous(), d.clamp(min=0.0)


def refresh_eigh(
    factor: torch.Tensor,
    q: torch.Tensor,
    *,
    dtype: torch.dtype,
    compute_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """An approximate :func:`eigh_factor` warm-started from the previous eigenvectors
    ``q``: one power iteration ``F q = Q R`` (QR, columns by decreasing norm). ``Q`` is
    the new basis (column signs chosen so that ``diag(R) ≥ 0``) and ``diag(R) = Qᵀ F q``
    estimates the eigenvalues.

    One product and one QR instead of an eigendecomposition; exact when ``q`` spans the
    eigenvectors of ``F``, and converging towards them over successive refreshes of a
    slowly changing factor (as the basis updates of SOAP and Shampoo). Falls back to
    :func:`eigh_factor` if the iteration fails or is not finite.

    Example:
        >>> f = torch.diag(torch.tensor([3.0, 1.0]))
        >>> q, d = refresh_eigh(f, torch.eye(2), dtype=torch.float32)
        >>> d
        tensor([3., 1.])
    """
    try:
        p = factor.to(q.dtype) @ q
        # largest columns first: QR then fits the (near-)null directions last, into the
        # complement of the others, instead of orthogonalising against their noise
        order = torch.linalg.vector_norm(p, dim=-2).argsort(dim=-1, descending=True)
        p = p.gather(-1, order.unsqueeze(-2).expand_as(p))
        qn, r = torch.linalg.qr(p)
        diag = r.diagonal(dim1=-2, dim2=-1)
        sign = torch.where(diag < 0, -1.0, 1.0).to(qn.dtype)
        qn, d = (qn * sign.unsqueeze(-2)).to(dtype), (diag * sign).to(dtype)
        if all_finite(qn) and all_finite(d):
            return qn.contiguous(), d.clamp(min=0.0)
    except RuntimeError:
        pass
    return eigh_factor(factor, dtype=dtype, compute_dtype=compute_dtype)


def eigh_or_refresh(
    factor: torch.Tensor,
    previous: torch.Tensor | None,
    *,
    dtype: torch.dtype,
    compute_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`refresh_eigh` from ``previous`` eigenvectors when given, else
    :func:`eigh_factor`."""
    if previous is not None:
        return refresh_eigh(factor, previous, dtype=dtype, compute_dtype=compute_dtype)
    return eigh_factor(factor, dtype=dtype, compute_dtype=compute_dtype)


def diagonal_eigenvalues(factor: torch.Tensor, *, dtype: torch.dtype) -> torch.Tensor:
    """The eigenvalues of a diagonal factor (its entries; its eigenbasis is the identity),
    clamped at 0, in ``dtype``.

    Example:
        >>> diagonal_eigenvalues(torch.tensor([2.0, -1e-9]), dtype=torch.float64)
        tensor([2., 0.], dtype=torch.float64)
    """
    if not all_finite(factor):
        raise DecompositionError("eigh: the factor holds NaN/Inf")
    return factor.to(dtype).clamp(min=0.0)


def diagonal_inverse(
    factor: torch.Tensor,
    damping: float,
    *,
    dtype: torch.dtype,
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``1 / (d + damping)`` of a diagonal factor ``d``, in ``dtype``; with ``damping == 0``
    the pseudo-inverse (entries at most ``eps · n · max(d)`` give 0, as
    :func:`divide_eigenvalues`).

    Example:
        >>> diagonal_inverse(torch.tensor([1.0, 0.0]), 0.0, dtype=torch.float32)
        tensor([1., 0.])
    """
    if not all_finite(factor):
        raise DecompositionError("inverse: the factor holds NaN/Inf")
    den = factor.to(compute_dtype or torch.promote_types(dtype, torch.float32)) + damping
    if damping > 0:
        return (1.0 / den).to(dtype)
    cutoff = den.amax(dim=-1, keepdim=True) * torch.finfo(den.dtype).eps * den.shape[-1]
    zero = torch.zeros((), dtype=den.dtype, device=den.device)
    return torch.where(den > cutoff, 1.0 / den, zero).to(dtype)


def eigh_side(
    factor: torch.Tensor,
    previous: torch.Tensor | None,
    *,
    diagonal: bool,
    dtype: torch.dtype,
    compute_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """``(eigenvectors or None, eigenvalues)`` of one factor: :func:`diagonal_eigenvalues`
    for a diagonal one, else :func:`eigh_or_refresh` (warm-started from ``previous``)."""
    if diagonal:
        return None, diagonal_eigenvalues(factor, dtype=dtype)
    return eigh_or_refresh(factor, previous, dtype=dtype, compute_dtype=compute_dtype)


def inverse_side(
    factor: torch.Tensor,
    damping: float,
    *,
    diagonal: bool,
    dtype: torch.dtype,
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The damped inverse of one factor: :func:`diagonal_inverse` for a diagonal one, else
    :func:`damped_inverse`."""
    if diagonal:
        return diagonal_inverse(factor, damping, dtype=dtype, compute_dtype=compute_dtype)
    return damped_inverse(factor, damping, dtype=dtype, compute_dtype=compute_dtype)


def decomposition_shapes(
    factor_shape: tuple[int, ...] | torch.Size, *, diagonal: bool, eigen: bool
) -> list[tuple[int, ...]]:
    """Shapes of the tensors that decompose one factor: eigenvectors and eigenvalues
    (eigenvalues only for a diagonal factor), or the inverse (the factor's shape).

    Example:
        >>> decomposition_shapes((3, 3), diagonal=False, eigen=True)
        [(3, 3), (3,)]
        >>> decomposition_shapes((2, 5), diagonal=True, eigen=True)
        [(2, 5)]
    """
    shape = tuple(int(s) for s in factor_shape)
    if not eigen or diagonal:
        return [shape]
    return [shape, shape[:-1]]


def eigenvalue_outer(dg: torch.Tensor, da: torch.Tensor, damping: float) -> torch.Tensor:
    """``1 / (outer(dg, da) + damping)`` (batched over leading dimensions)."""
    return divide_eigenvalues(torch.ones((), dtype=dg.dtype, device=dg.device), dg, da, damping)


def divide_eigenvalues(
    v: torch.Tensor, dg: torch.Tensor, da: torch.Tensor, damping: float
) -> torch.Tensor:
    """``v / (outer(dg, da) + damping)``; with ``damping == 0``, the pseudo-inverse:
    entries whose eigenvalue product is at most ``eps · max(shape) · max(product)`` (as
    ``torch.linalg.pinv``'s default cut-off) are 0 instead of Inf/NaN."""
    den = dg.unsqueeze(-1) * da.unsqueeze(-2) + damping
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
) -> torch.Tensor:
    """``(F + damping·I)⁻¹`` of one factor, in ``dtype``.

    Retried like :func:`eigh_factor` when the inversion fails or is not finite (here the
    jitter adds to the damping). Raises :class:`DecompositionError` if every attempt fails.

    Example:
        >>> damped_inverse(torch.zeros(2, 2), 0.0, dtype=torch.float32)  # singular: jittered
        tensor([[1.0000e+10, 0.0000e+00],
                [0.0000e+00, 1.0000e+10]])
    """

    def attempt(f: torch.Tensor, jitter: float) -> tuple[torch.Tensor]:
        eye = torch.eye(f.shape[-1], dtype=f.dtype, device=f.device)
        return (torch.linalg.inv(f + (damping + jitter) * eye),)

    cdt = compute_dtype or torch.promote_types(dtype, torch.float32)
    (inv,) = _robust(factor, cdt, attempt, "inverse", dtype)
    return inv.contiguous()  # row-major, as in eigh_factor


def eigen_decompose(
    a: torch.Tensor,
    g: torch.Tensor,
    damping: float,
    *,
    dtype: torch.dtype = torch.float32,
    compute_dtype: torch.dtype | None = None,
    outer_product: bool = False,
    warm_start: EigenDecomposition | None = None,
    diagonal: tuple[bool, bool] = (False, False),
) -> EigenDecomposition:
    """Eigendecompose both factors.

    Args:
        a, g: symmetric factors (optionally batched), or their diagonals (``diagonal``).
        diagonal: whether ``a`` and ``g`` are diagonal factors (vectors).
        damping: λ, used only when ``outer_product`` precomputes ``1/(dg daᵀ + λ)``.
        dtype: storage dtype of the result (``inv_dtype``).
        compute_dtype: dtype eigh runs in (default: ``dtype`` promoted to float32).
        outer_product: precompute ``dgda = 1 / (outer(dg, da) + λ)`` (not with a diagonal
            factor, see :func:`precompute_outer`).
        warm_start: a previous decomposition to refresh with :func:`refresh_eigh`
            instead of decomposing from scratch.

    Example:
        >>> import torch
        >>> eig = eigen_decompose(torch.eye(3), 2 * torch.eye(2), 0.0)
        >>> eig.da, eig.dg
        (tensor([1., 1., 1.]), tensor([2., 2.]))
    """
    w = warm_start
    kw: dict[str, Any] = {"dtype": dtype, "compute_dtype": compute_dtype}
    pa, pg = (w.qa, w.qg) if w is not None else (None, None)
    qa, da = _named("A", eigh_side, a, pa, diagonal=diagonal[0], **kw)
    qg, dg = _named("G", eigh_side, g, pg, diagonal=diagonal[1], **kw)
    dgda = eigenvalue_outer(dg, da, damping) if precompute_outer(outer_product, diagonal) else None
    return EigenDecomposition(qa, da, qg, dg, dgda)


def precompute_outer(outer_product: bool, diagonal: tuple[bool, bool]) -> bool:
    """Whether ``dgda`` is precomputed: when asked for, and never for a layer with a
    diagonal factor, whose ``dgda`` (as large as the gradient, ``V·d`` for an embedding)
    would break its ``O(V + d²)`` memory; there ``1/(dg daᵀ + λ)`` is formed when used."""
    return outer_product and not any(diagonal)


def inverse_decompose(
    a: torch.Tensor,
    g: torch.Tensor,
    damping: float,
    *,
    dtype: torch.dtype = torch.float32,
    compute_dtype: torch.dtype | None = None,
    diagonal: tuple[bool, bool] = (False, False),
) -> InverseDecomposition:
    """Damped inverses of both factors (vectors for the ``diagonal`` ones).

    Example:
        >>> import torch
        >>> inv = inverse_decompose(torch.eye(2), torch.eye(2), 1.0)
        >>> inv.a_inv
        tensor([[0.5000, 0.0000],
                [0.0000, 0.5000]])
    """
    kw: dict[str, Any] = {"dtype": dtype, "compute_dtype": compute_dtype}
    return InverseDecomposition(
        _named("A", inverse_side, a, damping, diagonal=diagonal[0], **kw),
        _named("G", inverse_side, g, damping, diagonal=diagonal[1], **kw),
    )


R = TypeVar("R")


def _named(factor: str, fn: Callable[..., R], *args: Any, **kwargs: Any) -> R:
    """``fn(*args, **kwargs)``, with ``factor`` ("A" or "G") named in its errors."""
    try:
        return fn(*args, **kwargs)
    except DecompositionError as err:
        raise DecompositionError(f"the {factor} factor: {err}") from None
