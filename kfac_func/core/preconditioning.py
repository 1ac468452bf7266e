"""Preconditioning a gradient matrix with a decomposition, and the kl_clip scale.

- ``eigen``: the preconditioned gradient solves ``(G ⊗ A + λI) x = vec(M)`` exactly:
  ``x = Qg [(Qgᵀ M Qa) / (dg daᵀ + λ)] Qaᵀ`` (or with the precomputed ``dgda``).
- ``inverse``: ``x = (G + λI)⁻¹ M (A + λI)⁻¹``.

With row-major flattening, ``vec(G M A) = (G ⊗ A) vec(M)`` for symmetric ``A``. All
functions are batched over leading dimensions (grouped convolutions).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kfac_func.blocks.spec import cast
from kfac_func.core.decomposition import (
    Decomposition,
    EigenDecomposition,
    EKFACDecomposition,
    InverseDecomposition,
    divide_eigenvalues,
    divide_scale,
)

__all__ = [
    "kl_clip_scale",
    "kl_clip_scale_of_terms",
    "kl_clip_scale_of_vector",
    "kl_clip_term",
    "left_product",
    "precondition",
    "precondition_rows",
    "right_product",
]


def precondition(
    matrix: torch.Tensor, decomposition: Decomposition, damping: float
) -> torch.Tensor:
    """Apply the damped inverse Kronecker curvature to a gradient matrix.

    Computes in the decomposition's dtype and returns the matrix's dtype. ``damping`` is
    ignored when the eigen decomposition holds a precomputed ``dgda`` and by the inverse
    method (whose damping is inside the stored inverses). Diagonal factors (an eigenbasis
    of None, an inverse that is a vector) scale the rows or columns of the matrix.

    Example:
        >>> import torch
        >>> from kfac_func.core.layer_decomposition import eigen_decompose
        >>> eig = eigen_decompose(torch.eye(2), torch.eye(2), 0.0)
        >>> precondition(torch.ones(2, 2), eig, damping=1.0)
        tensor([[0.5000, 0.5000],
                [0.5000, 0.5000]])
    """
    d = decomposition
    if isinstance(d, InverseDecomposition):
        m = cast(matrix, d.a_inv.dtype)
        if d.g_inv.dim() == m.dim() and d.a_inv.dim() == m.dim():
            return cast(d.g_inv @ m @ d.a_inv, matrix.dtype)
        return cast(right_product(left_product(d.g_inv, m), d.a_inv), matrix.dtype)
    m = cast(matrix, d.scale.dtype if isinstance(d, EKFACDecomposition) else d.da.dtype)
    if d.qa is not None and d.qg is not None:
        return cast(_back_project(d.qg.mT @ m @ d.qa, d, damping), matrix.dtype)
    v = m if d.qg is None else d.qg.mT @ m
    v = v if d.qa is None else v @ d.qa
    return cast(_back_project(v, d, damping), matrix.dtype)


def left_product(g: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``G M`` for a dense ``G`` or a diagonal one (one dimension less than ``M``, its
    diagonal: it scales the rows).

    Example:
        >>> left_product(torch.tensor([2.0, 3.0]), torch.ones(2, 1))
        tensor([[2.],
                [3.]])
    """
    return g.unsqueeze(-1) * m if g.dim() < m.dim() else g @ m


def right_product(m: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """``M A`` for a dense ``A``, a diagonal one (its diagonal: it scales the columns) or
    a block-diagonal one (its ``k`` diagonal blocks ``(..., k, w, w)``, one dimension more
    than ``M``: each block multiplies its ``w`` columns of ``M``, the last block's padding
    beyond ``M``'s columns dropped; see :attr:`kfac_func.blocks.LayerSpec.a_blocks`).

    Example:
        >>> right_product(torch.ones(1, 2), torch.tensor([2.0, 3.0]))
        tensor([[2., 3.]])
        >>> right_product(torch.ones(1, 3), 2 * torch.eye(2).expand(2, 2, 2))
        tensor([[2., 2., 2.]])
    """
    if a.dim() > m.dim():
        return _block_product(m, a)
    return m * a.unsqueeze(-2) if a.dim() < m.dim() else m @ a


def _block_product(m: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """``M · blockdiag(blocks)`` for ``blocks`` ``(..., k, w, w)`` (see :func:`right_product`)."""
    split = column_blocks(m, blocks.shape[-3], blocks.shape[-1])
    return merge_column_blocks(split @ blocks, m.shape[-1])


def column_blocks(m: torch.Tensor, k: int, w: int) -> torch.Tensor:
    """The columns of ``m`` (``(..., rows, n)``) as ``k`` blocks of ``w`` (the last padded
    with zero columns to ``k·w``), stacked: ``(..., k, rows, w)``.

    Example:
        >>> column_blocks(torch.arange(3.0).reshape(1, 3), 2, 2)
        tensor([[[0., 1.]],
        <BLANKLINE>
                [[2., 0.]]])
    """
    n = m.shape[-1]
    if k * w != n:
        m = torch.nn.functional.pad(m, (0, k * w - n))
    return m.reshape(*m.shape[:-1], k, w).movedim(-2, -3)


def merge_column_blocks(blocks: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of :func:`column_blocks`: ``(..., k, rows, w)`` back to ``(..., rows, n)``,
    the padding dropped.

    Example:
        >>> merge_column_blocks(column_blocks(torch.arange(3.0).reshape(1, 3), 2, 2), 3)
        tensor([[0., 1., 2.]])
    """
    k, w = blocks.shape[-3], blocks.shape[-1]
    out = blocks.movedim(-3, -2).reshape(*blocks.shape[:-3], blocks.shape[-2], k * w)
    return out[..., :n] if k * w != n else out


def _back_project(
    v: torch.Tensor, d: EigenDecomposition | EKFACDecomposition, damping: float
) -> torch.Tensor:
    """``Qg [v / (dg daᵀ + λ)] Qaᵀ`` for ``v`` in the eigenbasis (a missing basis: the
    identity); EKFAC divides by ``scale + λ`` instead."""
    if isinstance(d, EKFACDecomposition):
        v = divide_scale(v, d.scale, damping)
    elif d.dgda is not None:
        v = v * d.dgda
    else:
        v = divide_eigenvalues(v, d.dg, d.da, damping)
    if d.qa is not None and d.qg is not None:
        return d.qg @ v @ d.qa.mT
    v = v if d.qg is None else d.qg @ v
    return v if d.qa is None else v @ d.qa.mT


def _right(a: torch.Tensor, f: torch.Tensor, bias: bool) -> torch.Tensor:
    """``[a, 1] @ f`` without building ``[a, 1]``."""
    if not bias:
        return a @ f
    return torch.addmm(f[-1:], a, f[:-1])


def precondition_rows(
    rows: Sequence[tuple[torch.Tensor, torch.Tensor]],
    decomposition: Decomposition,
    damping: float,
    *,
    bias: bool,
    dtype: torch.dtype,
) -> torch.Tensor:
    """:func:`precondition` of ``M = Σ gᵀ[a, 1]`` given the rows ``(a, g)`` instead of ``M``.

    For a Linear layer whose gradient is that sum (check with
    :func:`kfac_func.core.factors.rows_reproduce`), the products with ``M`` become products
    with the ``n``-row factors: the inverse method costs ``n(d_out² + d_in² + d_out·d_in)``
    instead of ``2·d_out·d_in(d_out + d_in)``, the eigen method saves the projection into
    the eigenbasis (the back-projection stays two dense products). ``bias``: ``A`` has a
    trailing ones column. Returns ``dtype``. Dense factors only (diagonal factors take
    :func:`precondition`).

    Example:
        >>> from kfac_func.core.layer_decomposition import eigen_decompose
        >>> a, g = torch.randn(4, 3), torch.randn(4, 2)
        >>> eig = eigen_decompose(torch.eye(3), torch.eye(2), 0.0)
        >>> p = precondition_rows([(a, g)], eig, 1.0, bias=False, dtype=torch.float32)
        >>> torch.allclose(p, precondition(g.T @ a, eig, 1.0))
        True
    """
    d = decomposition
    left, right = (d.g_inv, d.a_inv) if isinstance(d, InverseDecomposition) else (d.qg, d.qa)
    if left is None or right is None or left.dim() != 2 or right.dim() != 2:
        raise ValueError("precondition_rows needs the dense factors of an ungrouped layer")
    fwd: torch.Tensor | None = None
    for a, g in rows:
        term = (g.to(left.dtype) @ left).mT @ _right(a.to(right.dtype), right, bias)
        fwd = term if fwd is None else fwd + term
    assert fwd is not None, "no rows"
    if isinstance(d, InverseDecomposition):
        return fwd.to(dtype)
    return _back_project(fwd, d, damping).to(dtype)


def kl_clip_term(preconditioned: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """One layer's term ``Σ P ⊙ grad`` of the kl_clip sum: the dot product, a 0-d tensor
    in ``P``'s dtype (:func:`kl_clip_scale_of_terms` turns the terms of all layers into
    the scale, summing them in float64).

    Example:
        >>> kl_clip_term(torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0]))
        tensor(11.)
    """
    p = preconditioned.reshape(-1)
    return torch.dot(p, cast(grad.reshape(-1), p.dtype))


def kl_clip_scale_of_terms(
    terms: Sequence[torch.Tensor], kl_clip: float, lr: float, *, dtype: torch.dtype
) -> torch.Tensor:
    """``min(1, sqrt(kl_clip / |lr² · Σ terms|))`` in ``dtype`` (1 without terms), the
    terms summed in the order given.

    Example:
        >>> kl_clip_scale_of_terms([torch.tensor(4.0)], kl_clip=1.0, lr=1.0, dtype=torch.float32)
        tensor(0.5000)
    """
    if not terms:
        return torch.tensor(1.0)
    return kl_clip_scale_of_vector(torch.stack(list(terms)), kl_clip, lr, dtype=dtype)


def kl_clip_scale_of_vector(
    terms: torch.Tensor, kl_clip: float, lr: float, *, dtype: torch.dtype
) -> torch.Tensor:
    """:func:`kl_clip_scale_of_terms` of the terms held in one vector, summed in its
    order in float64 (the same number as the list of its entries gives).

    Example:
        >>> kl_clip_scale_of_vector(torch.tensor([1.0, 3.0]), kl_clip=1.0, lr=1.0,
        ...                         dtype=torch.float32)
        tensor(0.5000)
    """
    vg = cast(terms, torch.float64).sum() * (lr * lr)
    return torch.clamp(torch.sqrt(kl_clip / vg.abs()), max=1.0).to(dtype)


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
    terms = [kl_clip_term(p, g) for p, g in pairs]
    return kl_clip_scale_of_terms(terms, kl_clip, lr, dtype=pairs[0][0].dtype)
