"""Kronecker factors from the Gram statistics of the layer kinds, and the row check.

Pure tensor functions: no module, no hook, no process group. Each layer kind
(:mod:`kfac_func.blocks`) turns one call's inputs and output-gradients into Gram
statistics; a factor is the scaled sum of them (scales: :mod:`kfac_func.core.conventions`).
A Gram ``XᵀX`` is symmetric up to the rounding of its product (often exactly: where the
BLAS library sums ``(i, j)`` and ``(j, i)`` in one order), and the factors are not
symmetrised again: that was a transposing pass per factor and step for values the
decompositions do not need (``eigh`` reads one triangle, see
:func:`~kfac_func.core.decomposition.eigh_factor`; an inverse is as exact either way).
Factors carry a leading ``groups`` dimension for grouped convolutions (one block per
group: K-FAC is block-diagonal over groups).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kfac_func.blocks import Gram, LayerSpec, Rows, a_gram, g_gram
from kfac_func.core.conventions import Convention, a_scales, g_scales
from kfac_func.core.stacks import per_row

__all__ = [
    "a_factor",
    "factor_from_grams",
    "g_factor",
    "group_means",
    "mean_over_rows",
    "rows_match",
    "rows_reproduce",
]


def factor_from_grams(
    grams: Sequence[Gram],
    convention: Convention,
    *,
    batch_size: int | None = None,
    loss_scale: float | None = None,
) -> torch.Tensor:
    """A factor from the per-call Grams of one batch: A without ``batch_size``/``loss_scale``,
    G with them. Diagonal Grams make a diagonal factor (a vector).
    Grams that carry ``groups`` make each group's mean (:func:`mean_over_rows`)."""
    if grams[0].groups is not None:
        return mean_over_rows(grams)[0]
    rows, spatial = [g.rows for g in grams], [g.spatial for g in grams]
    if batch_size is None or loss_scale is None:
        scales = a_scales(convention, rows, spatial)
    else:
        scales = g_scales(convention, rows, spatial, batch_size, loss_scale)
    # one temporary, accumulated in place (``sum`` would allocate a tensor per term)
    total = grams[0].gram * scales[0]
    for g, k in zip(grams[1:], scales[1:]):
        total.add_(g.gram, alpha=k)
    return total


def mean_over_rows(grams: Sequence[Gram]) -> tuple[torch.Tensor, float | torch.Tensor]:
    """``Σ Gram / Σ rows``: the mean of ``rowᵀrow`` over every row of ``grams`` (the calls
    of one micro-batch or of several), and the rows it averages, its weight when it is
    pooled with other such means. For Grams that carry ``groups`` (statistics stacked by
    the group each row was routed to) the mean is each group's over its own rows (0 for a
    group that got none) and the rows are a tensor, one entry per group.

    The ``"fisher"`` convention's A factor (:func:`~kfac_func.core.conventions.a_scales`):
    pooling such means weighted by their rows is the mean over all the rows, whatever
    share of them each micro-batch or rank holds.

    Example:
        >>> import torch
        >>> from kfac_func.blocks import Gram
        >>> mean_over_rows([Gram(torch.eye(2), 4, 1), Gram(3 * torch.eye(2), 4, 1)])
        (tensor([[0.5000, 0.0000],
                [0.0000, 0.5000]]), 8.0)
        >>> per_expert = Gram(torch.stack([torch.eye(1), 6 * torch.eye(1), torch.zeros(1, 1)]),
        ...                   5, 1, groups=torch.tensor([2.0, 3.0, 0.0]))
        >>> mean_over_rows([per_expert])[0].flatten()
        tensor([0.5000, 2.0000, 0.0000])
    """
    first = grams[0]
    if first.groups is None:
        n = sum(g.rows for g in grams)
        total = first.gram * (1.0 / n)  # as a_scales("fisher") scales each call
        for g in grams[1:]:
            total.add_(g.gram, alpha=1.0 / n)
        return total, float(n)
    rows = first.groups.to(first.gram.dtype)
    total = first.gram.clone()
    for g in grams[1:]:
        assert g.groups is not None
        total.add_(g.gram)
        rows = rows + g.groups.to(rows.dtype)
    total = group_means(total, rows)
    return total, rows


def group_means(sums: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``sums`` (stacked by group on the leading dimension) divided by each group's
    ``rows``; 0 for a group without rows.

    Example:
        >>> group_means(torch.tensor([[4.0], [9.0]]), torch.tensor([2.0, 0.0]))
        tensor([[2.],
                [0.]])
    """
    inverse = torch.where(rows > 0, rows.reciprocal(), 0.0)
    return sums * per_row(inverse, sums)


def a_factor(
    spec: LayerSpec,
    inputs: Sequence[torch.Tensor],
    convention: Convention = "fisher",
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """A factor of one batch from the inputs of every call of the layer.

    Args:
        spec: the layer.
        inputs: the layer's input for each call in the forward pass.
        convention: scaling convention (see :mod:`kfac_func.core.conventions`).
        dtype: accumulation dtype (inputs are cast before the product).

    Returns:
        Symmetric tensor of shape ``spec.factor_shapes[0]``.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from kfac_func.blocks import register
        >>> spec = register(nn.Linear(2, 3))[""]
        >>> a_factor(spec, [torch.tensor([[1.0, 2.0]])])
        tensor([[1., 2., 1.],
                [2., 4., 2.],
                [1., 2., 1.]])
    """
    if not inputs:
        raise ValueError(f"layer {spec.name!r}: no captured inputs")
    return factor_from_grams([a_gram(spec, x, dtype) for x in inputs], convention)


def g_factor(
    spec: LayerSpec,
    output_grads: Sequence[torch.Tensor],
    convention: Convention = "fisher",
    dtype: torch.dtype = torch.float32,
    *,
    batch_size: int,
    loss_scale: float,
) -> torch.Tensor:
    """G factor of one batch from the raw output-gradients of every call of the layer.

    Args:
        spec: the layer.
        output_grads: gradient of the loss w.r.t. the layer's output, per call.
        convention: scaling convention (see :mod:`kfac_func.core.conventions`).
        dtype: accumulation dtype.
        batch_size: number of examples ``N`` in the batch.
        loss_scale: ``c`` with loss ``= c · Σ_n ℓ_n`` (``1/N`` for a mean).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from kfac_func.blocks import register
        >>> spec = register(nn.Linear(2, 2))[""]
        >>> r = torch.tensor([[0.5, 0.0], [0.0, 0.5]])  # mean loss over 2 examples
        >>> g_factor(spec, [r], batch_size=2, loss_scale=0.5)
        tensor([[0.5000, 0.0000],
                [0.0000, 0.5000]])
    """
    if not output_grads:
        raise ValueError(f"layer {spec.name!r}: no captured output-gradients")
    grams = [g_gram(spec, r, dtype) for r in output_grads]
    return factor_from_grams(grams, convention, batch_size=batch_size, loss_scale=loss_scale)


_PROBES: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}


def _probe(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    key = (n, dtype, device)
    if key not in _PROBES:
        gen = torch.Generator().manual_seed(n)
        _PROBES[key] = torch.randn(n, generator=gen, dtype=torch.float64).to(dtype).to(device)
    return _PROBES[key]


def rows_reproduce(spec: LayerSpec, matrix: torch.Tensor, rows: Rows) -> bool:
    """Whether a layer's gradient matrix is ``Σ gᵀ[a, 1]`` over the calls' rows.

    Tested on one fixed random vector ``u``: ``M u`` against ``Σ gᵀ (a u)``, within
    ``4·eps`` times the same products of absolute values (20 times the rounding measured
    on CPU; lower-precision products, e.g. TF32, fail it and take the dense path). Costs
    a few matrix-vector products; False whenever the gradient holds anything else
    (rows of other ranks, weight decay added to the loss, a modified ``.grad``).

    Example:
        >>> from torch import nn
        >>> from kfac_func.blocks import register
        >>> spec = register(nn.Linear(3, 2))[""]
        >>> a, g = torch.randn(5, 3), torch.randn(5, 2)
        >>> m = torch.cat([g.T @ a, g.sum(0)[:, None]], dim=1)
        >>> rows_reproduce(spec, m, [(a, g)]), rows_reproduce(spec, m + 1e-3, [(a, g)])
        (True, False)
    """
    if not spec.block.has_rows or not rows:
        return False
    w, b = (matrix[..., :-1], matrix[..., -1]) if spec.has_bias else (matrix, None)
    return bool(rows_match(spec, w, b, rows))


def rows_match(
    spec: LayerSpec, weight_grad: torch.Tensor, bias_grad: torch.Tensor | None, rows: Rows
) -> torch.Tensor:
    """:func:`rows_reproduce` of ``[weight_grad | bias_grad]`` as a 0-d bool tensor on the
    gradient's device: no host synchronisation, so that many layers' checks can be read
    at once."""
    dtype, device = weight_grad.dtype, weight_grad.device
    u = _probe(spec.a_dim, dtype, device)
    uw, ub = (u[:-1], u[-1]) if spec.has_bias else (u, None)
    rhs = torch.zeros(spec.g_dim, dtype=dtype, device=device)
    bound = torch.zeros_like(rhs)
    for a, g in rows:
        au = a.to(dtype) @ uw
        if ub is not None:
            au = au + ub
        g = g.to(dtype)
        rhs = rhs + g.mT @ au
        bound = bound + g.abs().mT @ au.abs()
    # measured: the rounding of M (n-term sums) and of M u stays near 0.2·eps times the
    # same products of absolute values, for n up to 4096 and widths up to 1024
    mu = weight_grad @ uw
    bound = bound + weight_grad.abs() @ uw.abs()
    if bias_grad is not None and ub is not None:
        b = bias_grad.to(dtype)
        mu = mu + b * ub
        bound = bound + b.abs() * ub.abs()
    tol = 4 * torch.finfo(dtype).eps * torch.linalg.vector_norm(bound)
    close: torch.Tensor = torch.linalg.vector_norm(mu - rhs) <= tol
    return close
