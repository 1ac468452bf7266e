"""The scale-and-shift of a norm layer: ``y = x̂ ⊙ γ + β`` per unit, with ``x̂`` the
normalised input.

The gradient of unit ``u``'s ``(γ_u, β_u)`` from one row (a position) is
``(x̂_u g_u, g_u)``, with ``g`` the output-gradient: the exact Fisher block of the unit is
the 2×2 (1×1 without ``β``) Gram of those pairs. In K-FAC's terms each unit is a group
with ``g_dim = 2`` (``γ`` and ``β`` are the rows of its gradient matrix ``(units, 2, 1)``)
and ``a_dim = 1`` with ``A = 1`` (stored diagonal, a placeholder:
:attr:`~kfac_func.blocks.base.LayerBlock.placeholder_a`, applied as the identity by every
method, never damped): preconditioning solves each unit's ``(G_u + λI) x = (dγ_u, dβ_u)``
under the eigen and the inverse method alike, as the scale-and-shift blocks of kfac-jax
and the unit-wise blocks of ASDL do. The statistics need a call's input and
output-gradient together (:attr:`~kfac_func.blocks.base.LayerBlock.joint`). The kinds
(which units, how ``x̂`` is computed) are in :mod:`kfac_func.blocks.layer_norm` and
:mod:`kfac_func.blocks.channel_norm`.
"""

from __future__ import annotations

import math
from abc import abstractmethod
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from kfac_func.blocks.base import JointBlock
from kfac_func.blocks.spec import Gram, LayerSpec, shape_error

__all__ = ["ScaleShiftBlock", "unit_grams"]


class ScaleShiftBlock(JointBlock):
    """Norm layers with an elementwise affine: per-unit ``(scale, shift)`` Fisher blocks."""

    model_parallel = False
    placeholder_a = True

    def scale_shift_spec(self, name: str, module: nn.Module, **options: Any) -> LayerSpec | str:
        """The spec of a norm module whose ``weight`` (and ``bias``) hold one entry per unit."""
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor):
            return f"{type(module).__name__} without an elementwise affine has no parameters"
        prefix = f"{name}." if name else ""
        bias = getattr(module, "bias", None)
        bias_name = f"{prefix}bias" if isinstance(bias, torch.Tensor) else None
        return self.unit_spec(name, f"{prefix}weight", bias_name, weight.shape, **options)

    def unit_spec(
        self, name: str, weight: str, bias: str | None, shape: Sequence[int], **options: Any
    ) -> LayerSpec:
        """The layer ``name`` of the parameters ``weight`` (and ``bias``) of ``shape``, one
        unit per entry."""
        units = math.prod(shape)
        opts = {"shape": tuple(int(s) for s in shape), **options}
        return LayerSpec(
            name,
            self.kind,
            weight,
            bias,
            units,
            units,
            groups=units,
            diagonal=(True, False),
            options=tuple(sorted(opts.items())),
        )

    @abstractmethod
    def unit_rows(
        self, spec: LayerSpec, x: torch.Tensor, r: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x̂, g)`` of one call as ``(rows, units)`` matrices, computed in ``dtype``."""

    def a_dim(self, spec: LayerSpec) -> int:
        return 1

    def notes(self, spec: LayerSpec) -> list[str]:
        g = self.g_dim(spec)
        return [f"{spec.groups} units: {g}x{g} (scale{', shift' if spec.has_bias else ''}) blocks"]

    def g_dim(self, spec: LayerSpec) -> int:
        return 2 if spec.has_bias else 1

    def weight_shape(self, spec: LayerSpec) -> tuple[int, ...]:
        return tuple(spec.option("shape"))

    def joint_grams(
        self, spec: LayerSpec, x: torch.Tensor, r: torch.Tensor, dtype: torch.dtype
    ) -> tuple[Gram, Gram]:
        if x.shape != r.shape:
            raise shape_error(
                spec, "output-gradient", f"the input's shape {tuple(x.shape)}", r.shape
            )
        # elementwise statistics, no products: in at least float32 (a 16-bit ``dtype``
        # would only add casts) and at least the call's own precision
        wide = torch.promote_types(torch.promote_types(x.dtype, r.dtype), dtype)
        wide = torch.promote_types(wide, torch.float32)
        xhat, g = self.unit_rows(spec, x, r, wide)
        rows, units = g.shape
        if units != spec.groups:
            raise shape_error(spec, "input", f"{spec.groups} units", x.shape)
        gram = unit_grams(xhat * g, g if spec.has_bias else None)
        ones = torch.full((units, 1), float(rows), dtype=wide, device=g.device)
        return Gram(ones, rows, 1, True), Gram(gram, rows, 1)

    def check_grads(
        self, spec: LayerSpec, weight_grad: torch.Tensor, bias_grad: torch.Tensor | None
    ) -> None:
        shape = spec.weight_shape
        if tuple(weight_grad.shape) != shape:
            raise shape_error(spec, "weight gradient", f"shape {shape}", weight_grad.shape)
        if spec.has_bias:
            if bias_grad is None:
                raise ValueError(f"layer {spec.name!r}: missing gradient for {spec.bias!r}")
            if tuple(bias_grad.shape) != shape:
                raise shape_error(spec, "bias gradient", f"shape {shape}", bias_grad.shape)

    def to_matrix(
        self, spec: LayerSpec, weight_grad: torch.Tensor, bias_grad: torch.Tensor | None
    ) -> torch.Tensor:
        cols = [weight_grad.reshape(spec.groups)]
        if spec.has_bias and bias_grad is not None:
            cols.append(bias_grad.reshape(spec.groups).to(weight_grad.dtype))
        return torch.stack(cols, dim=-1).unsqueeze(-1)

    def from_matrix(
        self, spec: LayerSpec, m: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        shape = spec.weight_shape
        w = m[:, 0, 0].reshape(shape)
        return w, (m[:, 1, 0].reshape(shape) if spec.has_bias else None)


def unit_grams(a: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """Per unit ``u`` the Gram of its rows ``v = (a, b)`` over the rows ``n``:
    ``Σₙ vₙ vₙᵀ`` as a ``(units, 2, 2)`` stack (``(units, 1, 1)`` without ``b``), from three
    reductions over the rows instead of a batch of 2×2 products.

    Example:
        >>> unit_grams(torch.tensor([[1.0], [2.0]]), torch.tensor([[3.0], [4.0]]))
        tensor([[[ 5., 11.],
                 [11., 25.]]])
    """
    aa = (a * a).sum(dim=0)
    if b is None:
        return aa.reshape(-1, 1, 1)
    ab, bb = (a * b).sum(dim=0), (b * b).sum(dim=0)
    return torch.stack([torch.stack([aa, ab], dim=-1), torch.stack([ab, bb], dim=-1)], dim=-2)


def normalise(x: torch.Tensor, dims: tuple[int, ...], eps: float, center: bool) -> torch.Tensor:
    """``(x − mean) / sqrt(var + eps)`` over ``dims`` (biased variance), or without ``center``
    ``x / sqrt(mean(x²) + eps)`` (RMSNorm)."""
    if center:
        x = x - x.mean(dim=dims, keepdim=True)
    return x * torch.rsqrt(x.pow(2).mean(dim=dims, keepdim=True) + eps)


def resolved_eps(eps: float | None, dtype: torch.dtype) -> float:
    """A module's ``eps``; None (RMSNorm's default) is the machine epsilon of the input."""
    return torch.finfo(dtype).eps if eps is None else float(eps)
