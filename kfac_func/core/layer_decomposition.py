"""The decomposition of one layer: both of its factors, dense or diagonal.

:func:`eigen_decompose` and :func:`inverse_decompose` decompose a layer's A and G with the
per-factor functions of :mod:`kfac_func.core.decomposition` (with their retries), or, for a
diagonal factor (a vector: embeddings, sides wider than ``max_factor_dim``), in ``O(n)``:
its eigenbasis is the identity and its inverse ``1 / (d + λ)``.

A *placeholder* side (a norm layer's ``A = 1``, which stands for no factor at all) is the
identity by construction: both methods apply it as the identity, undamped, so the layer's
preconditioning is ``(G + λI)⁻¹`` under the inverse method as under the eigen method
(the generic inverse ``(G + λI)⁻¹ ⊗ (A + λI)⁻¹`` would divide it by ``1 + λ``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from kfac_func.core.attempts import (
    DecompositionError,
    all_finite,
    compute_dtype_of,
    first_attempts,
    outcome_of,
)
from kfac_func.core.decomposition import (
    EigenDecomposition,
    EKFACDecomposition,
    InverseDecomposition,
    damped_inverse,
    eigenvalue_outer,
    eigh_attempt,
    eigh_factor,
    inverse_attempt,
    refresh_eigh,
)

# (eigenvectors, eigenvalues) of one factor
Eigenpair = tuple[torch.Tensor, torch.Tensor]

__all__ = [
    "damped_reciprocal",
    "decomposition_shapes",
    "diagonal_eigenvalues",
    "diagonal_inverse",
    "eigen_decompose",
    "eigh_side",
    "inverse_decompose",
    "inverse_side",
    "placeholder_side",
    "precompute_outer",
]


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
    return damped_reciprocal(factor, damping, dtype=dtype, compute_dtype=compute_dtype)


def damped_reciprocal(
    factor: torch.Tensor,
    damping: float,
    *,
    dtype: torch.dtype,
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """:func:`diagonal_inverse` without its check of the factor.

    Example:
        >>> damped_reciprocal(torch.tensor([1.0, 3.0]), 1.0, dtype=torch.float32)
        tensor([0.5000, 0.2500])
    """
    den = factor.to(compute_dtype_of(dtype, compute_dtype)) + damping
    if damping > 0:
        return (1.0 / den).to(dtype)
    cutoff = den.amax(dim=-1, keepdim=True) * torch.finfo(den.dtype).eps * den.shape[-1]
    zero = torch.zeros((), dtype=den.dtype, device=den.device)
    return torch.where(den > cutoff, 1.0 / den, zero).to(dtype)


def placeholder_side(factor: torch.Tensor, *, dtype: torch.dtype) -> torch.Tensor:
    """The decomposition of a placeholder side: ones of the factor's (diagonal) shape, in
    ``dtype``, whatever the stored factor holds (its eigenvalues and its inverse alike).

    Example:
        >>> placeholder_side(torch.full((3, 1), 0.999), dtype=torch.float64)
        tensor([[1.],
                [1.],
                [1.]], dtype=torch.float64)
    """
    return torch.ones(factor.shape, dtype=dtype, device=factor.device)


def eigh_side(
    factor: torch.Tensor,
    previous: torch.Tensor | None,
    *,
    diagonal: bool,
    placeholder: bool = False,
    dtype: torch.dtype,
    compute_dtype: torch.dtype | None = None,
    label: str | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """``(eigenvectors or None, eigenvalues)`` of one factor: :func:`diagonal_eigenvalues`
    for a diagonal one, else ``refresh_eigh`` from ``previous`` when given, else
    ``eigh_factor`` (warnings starting with ``label``); a
    ``placeholder`` side is ``(None, ones)`` (:func:`placeholder_side`)."""
    if placeholder:
        return None, placeholder_side(factor, dtype=dtype)
    if diagonal:
        return None, diagonal_eigenvalues(factor, dtype=dtype)
    kw: dict[str, Any] = {"compute_dtype": compute_dtype, "label": label}
    if previous is not None:
        return refresh_eigh(factor, previous, dtype=dtype, **kw)
    return eigh_factor(factor, dtype=dtype, **kw)


def inverse_side(
    factor: torch.Tensor,
    damping: float,
    *,
    diagonal: bool,
    placeholder: bool = False,
    dtype: torch.dtype,
    compute_dtype: torch.dtype | None = None,
    label: str | None = None,
) -> torch.Tensor:
    """The damped inverse of one factor: :func:`diagonal_inverse` for a diagonal one, else
    :func:`damped_inverse` (warnings starting with ``label``); a ``placeholder`` side is
    the undamped identity, ones (:func:`placeholder_side`)."""
    if placeholder:
        return placeholder_side(factor, dtype=dtype)
    if diagonal:
        return diagonal_inverse(factor, damping, dtype=dtype, compute_dtype=compute_dtype)
    return damped_inverse(factor, damping, dtype=dtype, compute_dtype=compute_dtype, label=label)


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


def eigen_decompose(
    a: torch.Tensor,
    g: torch.Tensor,
    damping: float,
    *,
    dtype: torch.dtype = torch.float32,
    compute_dtype: torch.dtype | None = None,
    outer_product: bool = False,
    warm_start: EigenDecomposition | EKFACDecomposition | None = None,
    diagonal: tuple[bool, bool] = (False, False),
    eigenpairs: tuple[Eigenpair | None, Eigenpair | None] = (None, None),
    name: str | None = None,
    placeholder: tuple[bool, bool] = (False, False),
    dgda: torch.Tensor | None = None,
) -> EigenDecomposition:
    """Eigendecompose both factors (two dense factors decomposed from scratch are checked
    together: :func:`~kfac_func.core.attempts.first_attempts`).

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
        eigenpairs: ``(eigenvectors, eigenvalues)`` of A and of G already computed (by
            :func:`~kfac_func.step.decompose_groups.batched_eigenpairs`), used instead of
            decomposing that factor; None: decompose it here.
        name: the layer, named in warnings.
        placeholder: whether A and G are placeholders (the identity by construction, see
            :func:`placeholder_side`); a placeholder side is also ``diagonal``.
        dgda: ``1/(dg daᵀ + λ)`` of ``eigenpairs`` already computed (for several layers
            at once), used instead of computing it when ``outer_product`` asks for it.

    Example:
        >>> import torch
        >>> eig = eigen_decompose(torch.eye(3), 2 * torch.eye(2), 0.0)
        >>> eig.da, eig.dg
        (tensor([1., 1., 1.]), tensor([2., 2.]))
    """
    w = warm_start
    kw: dict[str, Any] = {"dtype": dtype, "compute_dtype": compute_dtype}
    pa, pg = (w.qa, w.qg) if w is not None else (None, None)
    ea, eg = eigenpairs
    pla, plg = placeholder
    fresh = w is None and ea is None and eg is None
    if fresh and _both_dense(diagonal, placeholder):
        cdt = compute_dtype_of(dtype, compute_dtype)
        (fa, fg), ok = first_attempts((a, g), eigh_attempt, cdt, dtype)
        if ok:
            ea, eg = ((q, d.clamp_(min=0.0)) for q, d in map(outcome_of, (fa, fg)))
        else:  # each side's retries, from its first attempt
            ea, eg = (
                _named(f, name, eigh_factor, x, dtype=dtype, compute_dtype=compute_dtype, first=o)
                for f, x, o in zip("AG", (a, g), (fa, fg))
            )
    qa, da = ea or _named("A", name, eigh_side, a, pa, diagonal=diagonal[0], placeholder=pla, **kw)
    qg, dg = eg or _named("G", name, eigh_side, g, pg, diagonal=diagonal[1], placeholder=plg, **kw)
    if not precompute_outer(outer_product, diagonal):
        dgda = None
    elif dgda is None:
        dgda = eigenvalue_outer(dg, da, damping)
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
    name: str | None = None,
    placeholder: tuple[bool, bool] = (False, False),
) -> InverseDecomposition:
    """Damped inverses of both factors (vectors for the ``diagonal`` ones; ones, undamped,
    for a ``placeholder`` side; two dense ones checked together, see
    :func:`~kfac_func.core.attempts.first_attempts`); ``name`` (the layer) is named in
    warnings.

    Example:
        >>> import torch
        >>> inv = inverse_decompose(torch.eye(2), torch.eye(2), 1.0)
        >>> inv.a_inv
        tensor([[0.5000, 0.0000],
                [0.0000, 0.5000]])
    """
    kw: dict[str, Any] = {"dtype": dtype, "compute_dtype": compute_dtype}
    if _both_dense(diagonal, placeholder):
        cdt = compute_dtype_of(dtype, compute_dtype)
        attempt = functools.partial(inverse_attempt, damping)
        (fa, fg), ok = first_attempts((a, g), attempt, cdt, dtype)
        if ok:  # column-major inverses: their row-major views, as damped_inverse's
            return InverseDecomposition(outcome_of(fa)[0].mT, outcome_of(fg)[0].mT)
        inverses = [
            _named(f, name, damped_inverse, x, damping, first=first, **kw)
            for f, x, first in zip("AG", (a, g), (fa, fg))
        ]
        return InverseDecomposition(*inverses)
    sides = [
        _named(f, name, inverse_side, x, damping, diagonal=d, placeholder=p, **kw)
        for f, x, d, p in zip("AG", (a, g), diagonal, placeholder)
    ]
    return InverseDecomposition(*sides)


def _both_dense(diagonal: tuple[bool, bool], placeholder: tuple[bool, bool]) -> bool:
    """Whether both sides are dense factors, decomposed by the same function: then their
    first attempts are checked together (:func:`~kfac_func.core.attempts.first_attempts`)."""
    return not (any(diagonal) or any(placeholder))


R = TypeVar("R")


def _named(factor: str, name: str | None, fn: Callable[..., R], *args: Any, **kwargs: Any) -> R:
    """``fn(*args, **kwargs, label=...)``, with ``factor`` ("A" or "G") named in its errors;
    the label names it in warnings: ``"layer 'fc', the A factor"``."""
    label = f"the {factor} factor" if name is None else f"layer {name!r}, the {factor} factor"
    try:
        return fn(*args, **kwargs, label=label)
    except DecompositionError as err:
        raise DecompositionError(f"the {factor} factor: {err}") from None
