"""Kronecker factors per layer kind, and the gradient ⇄ matrix reshaping.

Pure tensor functions: no module, no hook, no process group. Each layer kind turns its
captured inputs into rows ``a`` (patches for Conv2d) and its output-gradients into rows
``r``; a factor is the scaled sum of row outer products (scales: :mod:`conventions`).
Factors and gradient matrices carry a leading ``groups`` dimension for grouped
convolutions (one block per group: K-FAC is block-diagonal over groups).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

from kfac_func.conv_gram import patch_gram, supports_row_gram
from kfac_func.conventions import Convention, a_scales, g_scales
from kfac_func.layers import LayerSpec

__all__ = [
    "Gram",
    "a_factor",
    "a_gram",
    "a_rows",
    "check_grads",
    "factor_from_grams",
    "g_factor",
    "g_gram",
    "g_rows",
    "grads_to_matrix",
    "matrix_to_grads",
    "rows_match",
    "rows_reproduce",
    "symmetrize",
]


def _bad(
    spec: LayerSpec, what: str, expected: str, shape: torch.Size | tuple[int, ...]
) -> ValueError:
    return ValueError(
        f"layer {spec.name!r} ({spec.kind}): {what} must have {expected}, got shape {tuple(shape)}"
    )


def _conv_padded(spec: LayerSpec, x: torch.Tensor) -> torch.Tensor:
    """The input ``(N, C, H, W)`` padded exactly as the convolution pads it."""
    if x.dim() not in (3, 4) or x.shape[-3] != spec.in_dim:
        raise _bad(spec, "input", f"shape (N, {spec.in_dim}, H, W)", x.shape)
    if x.dim() == 3:
        x = x.unsqueeze(0)
    if any(spec.padding):
        mode = "constant" if spec.padding_mode == "zeros" else spec.padding_mode
        x = F.pad(x, spec.padding, mode=mode)
    return x


def _conv_patches(spec: LayerSpec, x: torch.Tensor) -> torch.Tensor:
    """Patches ``(*batch_shape, N·L, Cg·kh·kw)`` exactly as the convolution sees them."""
    x = _conv_padded(spec, x)
    cols = F.unfold(x, spec.kernel_size, dilation=spec.dilation, stride=spec.stride)
    n, _, length = cols.shape
    g = spec.groups
    cols = cols.view(n, g, -1, length).permute(1, 0, 3, 2).reshape(g, n * length, -1)
    return cols[0] if g == 1 else cols


def a_rows(spec: LayerSpec, x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Input rows of one call, without the bias column, and rows per example from space.

    Linear: ``x`` of shape ``(..., in)`` → ``(prod(...), in)``, spatial 1.
    Conv2d: ``x`` of shape ``(N, C, H, W)`` → patches ``(*batch_shape, N·L, C/groups·kh·kw)``,
    spatial ``L = out_h·out_w``.
    """
    if spec.kind == "linear":
        if x.dim() == 0 or x.shape[-1] != spec.in_dim:
            raise _bad(spec, "input", f"last dimension {spec.in_dim}", x.shape)
        return x.reshape(-1, spec.in_dim), 1
    cols = _conv_patches(spec, x)
    n = x.shape[0] if x.dim() == 4 else 1
    return cols, cols.shape[-2] // n


def g_rows(spec: LayerSpec, r: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Output-gradient rows of one call and rows per example from space."""
    if spec.kind == "linear":
        if r.dim() == 0 or r.shape[-1] != spec.out_dim:
            raise _bad(spec, "output-gradient", f"last dimension {spec.out_dim}", r.shape)
        return r.reshape(-1, spec.out_dim), 1
    r = _conv_grad(spec, r)
    n, _, h, w = r.shape
    g = spec.groups
    rows = r.reshape(n, g, -1, h * w).permute(1, 0, 3, 2).reshape(g, n * h * w, -1)
    return (rows[0] if g == 1 else rows), h * w


def _conv_grad(spec: LayerSpec, r: torch.Tensor) -> torch.Tensor:
    """A Conv2d output-gradient as ``(N, C, h, w)``, its shape checked."""
    if r.dim() not in (3, 4) or r.shape[-3] != spec.out_dim:
        raise _bad(spec, "output-gradient", f"shape (N, {spec.out_dim}, h, w)", r.shape)
    return r.unsqueeze(0) if r.dim() == 3 else r


def _conv_grad_columns(spec: LayerSpec, r: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Conv2d output-gradient as columns ``(*batch_shape, Cg, N·h·w)``: the transpose of
    :func:`g_rows`, cheaper to build from ``(N, C, h, w)`` (whole ``h·w`` runs are copied)."""
    r = _conv_grad(spec, r)
    n, _, h, w = r.shape
    g = spec.groups
    cols = r.reshape(n, g, -1, h * w).permute(1, 2, 0, 3).reshape(g, -1, n * h * w)
    return (cols[0] if g == 1 else cols), h * w


def symmetrize(m: torch.Tensor) -> torch.Tensor:
    """``(M + Mᵀ) / 2`` over the last two dimensions.

    ``Mᵀ`` is made contiguous first (a blocked transposing copy) and ``M`` added to it:
    the same values as ``(M + M.mT) / 2`` (addition commutes exactly), 2–5× faster for
    large factors than an addition that reads one operand column by column.
    """
    return m.mT.contiguous().add_(m).mul_(0.5)


def _gram(rows: torch.Tensor, with_ones: bool) -> torch.Tensor:
    """``rowsᵀ rows``; with ``with_ones`` as if a column of ones were appended (no copy)."""
    xx = rows.mT @ rows
    if not with_ones:
        return xx
    s = rows.sum(dim=-2)
    n = torch.full((*s.shape[:-1], 1), rows.shape[-2], dtype=rows.dtype, device=rows.device)
    top = torch.cat([xx, s.unsqueeze(-1)], dim=-1)
    bottom = torch.cat([s, n], dim=-1).unsqueeze(-2)
    return torch.cat([top, bottom], dim=-2)


class Gram(NamedTuple):
    """Unscaled statistics of one call: ``Σ rowsᵀrows``, its row count, rows per example
    that stem from space. Factors are scaled sums of these (see :mod:`conventions`)."""

    gram: torch.Tensor
    rows: int
    spatial: int


def a_gram(spec: LayerSpec, x: torch.Tensor, dtype: torch.dtype = torch.float32) -> Gram:
    """Gram statistics of one call's input (bias column of ones included).

    Conv2d inputs with a unit vertical stride go through :func:`patch_gram` (the same
    matrix without materialising the patches); other layers through their rows.
    """
    if spec.kind == "conv2d" and supports_row_gram(spec.kernel_size, spec.stride):
        y = _conv_padded(spec, x.to(dtype))
        kh, kw = spec.kernel_size
        dil_h, dil_w = spec.dilation
        return Gram(
            *patch_gram(y, (kh, kw), (dil_h, dil_w), spec.stride[1], spec.groups, spec.has_bias)
        )
    rows, spatial = a_rows(spec, x.to(dtype))
    return Gram(_gram(rows, spec.has_bias), rows.shape[-2], spatial)


def g_gram(spec: LayerSpec, r: torch.Tensor, dtype: torch.dtype = torch.float32) -> Gram:
    """Gram statistics of one call's raw output-gradient."""
    if spec.kind == "conv2d":
        cols, spatial = _conv_grad_columns(spec, r.to(dtype))
        return Gram(cols @ cols.mT, cols.shape[-1], spatial)
    rows, spatial = g_rows(spec, r.to(dtype))
    return Gram(_gram(rows, False), rows.shape[-2], spatial)


def factor_from_grams(
    grams: Sequence[Gram],
    convention: Convention,
    *,
    batch_size: int | None = None,
    loss_scale: float | None = None,
) -> torch.Tensor:
    """A factor from the per-call Grams of one batch: A without ``batch_size``/``loss_scale``,
    G with them."""
    rows, spatial = [g.rows for g in grams], [g.spatial for g in grams]
    if batch_size is None or loss_scale is None:
        scales = a_scales(convention, rows, spatial)
    else:
        scales = g_scales(convention, rows, spatial, batch_size, loss_scale)
    # one temporary, accumulated in place (``sum`` would allocate a tensor per term)
    total = grams[0].gram * scales[0]
    for g, k in zip(grams[1:], scales[1:]):
        total.add_(g.gram, alpha=k)
    return symmetrize(total)


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
        convention: scaling convention (see :mod:`kfac_func.conventions`).
        dtype: accumulation dtype (inputs are cast before the product).

    Returns:
        Symmetric tensor of shape ``spec.factor_shapes[0]``.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from kfac_func.layers import register
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
        convention: scaling convention (see :mod:`kfac_func.conventions`).
        dtype: accumulation dtype.
        batch_size: number of examples ``N`` in the batch.
        loss_scale: ``c`` with loss ``= c · Σ_n ℓ_n`` (``1/N`` for a mean).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from kfac_func.layers import register
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


Rows = Sequence[tuple[torch.Tensor, torch.Tensor]]


def linear_rows(
    spec: LayerSpec, inputs: Sequence[torch.Tensor], output_grads: Sequence[torch.Tensor]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``[(input rows, output-gradient rows)]`` of a Linear layer's calls (no bias column)."""
    return [(a_rows(spec, x)[0], g_rows(spec, r)[0]) for x, r in zip(inputs, output_grads)]


_PROBES: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}


def _probe(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    key = (n, dtype, device)
    if key not in _PROBES:
        gen = torch.Generator().manual_seed(n)
        _PROBES[key] = torch.randn(n, generator=gen, dtype=torch.float64).to(dtype).to(device)
    return _PROBES[key]


def rows_reproduce(spec: LayerSpec, matrix: torch.Tensor, rows: Rows) -> bool:
    """Whether a Linear layer's gradient matrix is ``Σ gᵀ[a, 1]`` over the calls' rows.

    Tested on one fixed random vector ``u``: ``M u`` against ``Σ gᵀ (a u)``, within
    ``4·eps`` times the same products of absolute values (20 times the rounding measured
    on CPU; lower-precision products, e.g. TF32, fail it and take the dense path). Costs
    a few matrix-vector products; False whenever the gradient holds anything else
    (rows of other ranks, weight decay added to the loss, a modified ``.grad``).

    Example:
        >>> from torch import nn
        >>> from kfac_func.layers import register
        >>> spec = register(nn.Linear(3, 2))[""]
        >>> a, g = torch.randn(5, 3), torch.randn(5, 2)
        >>> m = torch.cat([g.T @ a, g.sum(0)[:, None]], dim=1)
        >>> rows_reproduce(spec, m, [(a, g)]), rows_reproduce(spec, m + 1e-3, [(a, g)])
        (True, False)
    """
    if spec.kind != "linear" or not rows:
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


def check_grads(spec: LayerSpec, weight_grad: torch.Tensor, bias_grad: torch.Tensor | None) -> None:
    """Raise a ValueError naming the layer unless the gradients have the layer's shapes."""
    if tuple(weight_grad.shape) != spec.weight_shape:
        raise _bad(spec, "weight gradient", f"shape {spec.weight_shape}", weight_grad.shape)
    if spec.has_bias:
        if bias_grad is None:
            raise ValueError(f"layer {spec.name!r}: missing gradient for {spec.bias!r}")
        if tuple(bias_grad.shape) != (spec.out_dim,):
            raise _bad(spec, "bias gradient", f"shape ({spec.out_dim},)", bias_grad.shape)


def grads_to_matrix(
    spec: LayerSpec, weight_grad: torch.Tensor, bias_grad: torch.Tensor | None = None
) -> torch.Tensor:
    """Gradient matrix ``(*batch_shape, g_dim, a_dim)``; the bias is the last column.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from kfac_func.layers import register
        >>> spec = register(nn.Linear(2, 1))[""]
        >>> grads_to_matrix(spec, torch.tensor([[1.0, 2.0]]), torch.tensor([3.0]))
        tensor([[1., 2., 3.]])
    """
    check_grads(spec, weight_grad, bias_grad)
    g = spec.groups
    m = weight_grad.reshape(*spec.batch_shape, spec.g_dim, -1)
    if bias_grad is not None and spec.has_bias:
        b = bias_grad.reshape(*spec.batch_shape, spec.g_dim, 1) if g > 1 else bias_grad[:, None]
        m = torch.cat([m, b.to(m.dtype)], dim=-1)
    return m


def matrix_to_grads(spec: LayerSpec, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Inverse of :func:`grads_to_matrix`: ``(weight_grad, bias_grad or None)``.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from kfac_func.layers import register
        >>> spec = register(nn.Linear(2, 1))[""]
        >>> matrix_to_grads(spec, torch.tensor([[1.0, 2.0, 3.0]]))
        (tensor([[1., 2.]]), tensor([3.]))
    """
    if spec.has_bias:
        w, b = m[..., :-1], m[..., -1].reshape(spec.out_dim)
    else:
        w, b = m, None
    return w.reshape(spec.weight_shape), b
