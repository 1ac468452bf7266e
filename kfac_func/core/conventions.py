"""Scaling conventions of the Kronecker factors, written once.

K-FAC approximates the curvature block of a layer by ``G ⊗ A``. How ``A`` and ``G`` are
normalised decides what ``damping`` means, so the two conventions below are explicit and
every factor computed by :mod:`kfac_func.core.factors` takes its scale from here.

Notation, per forward call of the layer: ``rows`` is the number of rows the call
contributes (batch × sequence positions for Linear, batch × output pixels for Conv2d),
``S`` the rows per example that stem from spatial positions (``out_h·out_w`` for Conv2d,
1 for Linear), ``N`` the batch size, and ``c`` the loss scale: the user's loss is
``c · Σ_n ℓ_n`` (``c = 1/N`` for a mean-reduced loss, ``1`` for a sum). ``a`` are the layer
inputs (patches for Conv2d, with a column of ones for the bias), ``r`` the raw autograd
output-gradients of the user's loss, so ``r = c · g`` with ``g`` the per-example gradient.

``"fisher"`` (per-example Fisher / GGN, independent of the loss reduction):
    ``A = Σ aaᵀ / rows_total`` and ``G = Σ rrᵀ / (N c²) = (1/N) Σ_n Σ_rows g gᵀ``.
    For a single example and a Linear layer, ``G ⊗ A`` is exactly that example's Fisher
    block. Rows of weight-shared positions (sequence positions, conv pixels, several calls
    of one module) average in A and sum in G (the "expand" convention, equivalent to the
    KFC approximation for convolutions). The running average starts at the first batch
    factor (no prior). Decompositions run in ``inv_dtype`` (at least float32).

``"kfac-pytorch"`` (what kfac-pytorch 0.4.2 computes, so its tuned hyperparameters carry over):
    per call, ``A = Σ (a/S)(a/S)ᵀ / rows`` and ``G = Σ (r/S)(r/S)ᵀ / rows`` from the raw
    output-gradients (no batch-size correction); several calls of one module, and several
    micro-batches, are averaged as per-call covariances. The running average starts at the
    identity. Decompositions run in float32 and are stored in ``inv_dtype``.

Both conventions take the factors as their Gram products make them (symmetric up to
rounding, see :mod:`kfac_func.core.factors`), clamp eigenvalues at zero, damp the
eigen method as ``(G ⊗ A + λI)⁻¹`` and the inverse method as ``(G + λI)⁻¹ ⊗ (A + λI)⁻¹``,
except on a placeholder side (a norm layer's ``A = 1``, see
:attr:`kfac_func.blocks.LayerSpec.placeholder`), which both apply as the undamped identity.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

from kfac_func.blocks.spec import diagonal_blocks

Convention = Literal["fisher", "kfac-pytorch"]
CONVENTIONS: tuple[str, ...] = ("fisher", "kfac-pytorch")

__all__ = [
    "CONVENTIONS",
    "Convention",
    "a_scales",
    "check_convention",
    "convention_argument",
    "decomposition_dtype",
    "g_scales",
    "initial_factor",
    "micro_batch_weights",
]


def check_convention(convention: str) -> Convention:
    """Return ``convention`` if known, else raise a ValueError listing the known ones."""
    if convention not in CONVENTIONS:
        raise ValueError(f"convention must be one of {CONVENTIONS}, got {convention!r}")
    return convention  # type: ignore[return-value]


def convention_argument(convention: str | None, scaling: str | None, *, default: str) -> str:
    """The convention asked for by either of its two names: ``convention=`` (the
    functional API's) or ``scaling=`` (the preconditioners'), each function documenting
    one and taking the other as an alias; ``default`` when neither is given. Both given
    and different: a ValueError naming both. The value is not validated here.

    Example:
        >>> convention_argument(None, "kfac-pytorch", default="fisher")
        'kfac-pytorch'
        >>> convention_argument("fisher", "kfac-pytorch", default="fisher")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: convention='fisher' and scaling='kfac-pytorch' name the same setting ...
    """
    if convention is not None and scaling is not None and convention != scaling:
        raise ValueError(
            f"convention={convention!r} and scaling={scaling!r} name the same setting "
            "(scaling= is an alias of convention=): pass one of them"
        )
    for value in (convention, scaling):
        if value is not None:
            return value
    return default


def a_scales(convention: Convention, rows: Sequence[int], spatial: Sequence[int]) -> list[float]:
    """Per-call multipliers of ``Σ aaᵀ`` that make the A factor of one batch.

    Example:
        >>> a_scales("fisher", rows=[8, 8], spatial=[4, 4])
        [0.0625, 0.0625]
        >>> a_scales("kfac-pytorch", rows=[8], spatial=[4])
        [0.0078125]
    """
    if convention == "fisher":
        total = sum(rows)
        return [1.0 / total for _ in rows]
    k = len(rows)
    return [1.0 / (k * n * s * s) for n, s in zip(rows, spatial)]


def g_scales(
    convention: Convention,
    rows: Sequence[int],
    spatial: Sequence[int],
    batch_size: int,
    loss_scale: float,
) -> list[float]:
    """Per-call multipliers of ``Σ rrᵀ`` (raw output-gradients) that make the G factor.

    Example:
        >>> g_scales("fisher", rows=[4], spatial=[1], batch_size=4, loss_scale=0.25)
        [4.0]
    """
    if convention == "fisher":
        return [1.0 / (batch_size * loss_scale * loss_scale) for _ in rows]
    return a_scales(convention, rows, spatial)


def micro_batch_weights(convention: Convention, batch_sizes: Sequence[int]) -> list[float]:
    """Weights that combine per-micro-batch factors of one accumulation window.

    ``"fisher"`` weights by examples (the window's per-example average); ``"kfac-pytorch"``
    averages the micro-batch covariances equally. (``"fisher"``'s A is not combined so:
    it is the mean over all of the window's rows, see
    :func:`~kfac_func.core.factors.mean_over_rows`.)
    """
    if convention == "fisher":
        total = sum(batch_sizes)
        return [n / total for n in batch_sizes]
    return [1.0 / len(batch_sizes) for _ in batch_sizes]


def initial_factor(
    convention: Convention,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device | None,
    diagonal: bool = False,
    width: int | None = None,
) -> torch.Tensor:
    """The value a running-average factor holds before its first update.

    ``"kfac-pytorch"`` starts from the identity (the first update gives
    ``decay·I + (1−decay)·F``); ``"fisher"`` holds zeros that the first update replaces
    by the batch factor. A ``diagonal`` factor (the last dimension holds the diagonal)
    starts at ones. A blocked factor (``shape`` ``(..., k, w, w)``, a side ``width`` wide:
    see :attr:`~kfac_func.blocks.LayerSpec.a_blocks`) starts at the diagonal blocks of
    the identity, its padding at zero.

    Example:
        >>> initial_factor("kfac-pytorch", (2, 2, 2), torch.float32, None, width=3)[1]
        tensor([[1., 0.],
                [0., 0.]])
    """
    if convention == "fisher":
        return torch.zeros(shape, dtype=dtype, device=device)
    if diagonal:
        return torch.ones(shape, dtype=dtype, device=device)
    if width is not None:
        eye = diagonal_blocks(torch.eye(width, dtype=dtype, device=device), shape[-3])
        return eye.expand(shape).clone()
    eye = torch.eye(shape[-1], dtype=dtype, device=device)
    return eye.expand(shape).clone()


def decomposition_dtype(convention: Convention, inv_dtype: torch.dtype) -> torch.dtype:
    """Precision in which eigh / inverse run (the result is stored in ``inv_dtype``).

    Example:
        >>> [decomposition_dtype("fisher", t) for t in (torch.bfloat16, torch.float64)]
        [torch.float32, torch.float64]
    """
    if convention == "kfac-pytorch" or inv_dtype in _TO_FLOAT32:
        return torch.float32  # named without a dispatched call (it is made for every layer)
    return torch.promote_types(inv_dtype, torch.float32)


_TO_FLOAT32 = (torch.float16, torch.bfloat16, torch.float32)
