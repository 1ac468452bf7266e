"""Transposed linears as GPT-2-family code writes them: ``y = x @ W + b`` with ``W`` of
shape ``(in, out)`` (the ``Conv1D`` of Hugging Face transformers), recognised by class name.

The statistics are those of :class:`~kfac_func.blocks.linear.LinearBlock` (inputs of any
rank, leading dimensions become rows); only the weight's orientation differs, so the
gradient matrix is ``[dWᵀ | db]``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from kfac_func.blocks.linear import LinearBlock
from kfac_func.blocks.registry import register_block
from kfac_func.blocks.spec import LayerSpec

__all__ = ["TRANSPOSED_LINEAR_CLASSES", "TransposedLinearBlock"]

TRANSPOSED_LINEAR_CLASSES = ("Conv1D",)
"""Class names of modules computing ``x @ weight + bias`` with ``weight`` of shape
``(in, out)``."""


@register_block
class TransposedLinearBlock(LinearBlock):
    """``y = x W + b`` with ``W`` of shape ``(in, out)``.

    Example:
        >>> import torch
        >>> from kfac_func.blocks import grads_to_matrix, register
        >>> class Conv1D(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.weight = torch.nn.Parameter(torch.zeros(3, 2))
        ...         self.bias = torch.nn.Parameter(torch.zeros(2))
        >>> spec = register(Conv1D())[""]
        >>> spec.kind, spec.in_dim, spec.out_dim, spec.weight_shape
        ('transposed_linear', 3, 2, (3, 2))
        >>> grads_to_matrix(spec, torch.ones(3, 2), torch.zeros(2)).shape
        torch.Size([2, 4])
    """

    kind = "transposed_linear"
    module_types: tuple[type[nn.Module], ...] = ()
    # the row check reads the gradient in Linear's orientation; this kind takes the dense path
    has_rows = False
    tensor_parallel = False

    def matches(self, module: nn.Module) -> bool:
        names = {c.__name__ for c in type(module).__mro__}
        return bool(names & set(TRANSPOSED_LINEAR_CLASSES))

    def spec(self, name: str, module: nn.Module) -> LayerSpec | str:
        weight = module.get_parameter("weight")
        if weight.dim() != 2:
            return f"{type(module).__name__} with a {weight.dim()}-d weight is not supported"
        prefix = f"{name}." if name else ""
        bias = getattr(module, "bias", None)
        bias_name = f"{prefix}bias" if isinstance(bias, torch.Tensor) else None
        d_in, d_out = weight.shape
        return LayerSpec(name, self.kind, f"{prefix}weight", bias_name, int(d_in), int(d_out))

    def formula(self, spec: LayerSpec) -> str:
        return "x @ weight + bias" if spec.has_bias else "x @ weight"

    def _dims(self, name: str, module: nn.Module, weight: torch.Tensor) -> tuple[int, int]:
        d_in, d_out = super()._dims(name, module, weight)
        return d_out, d_in  # the weight is (in, out)

    def output(
        self, spec: LayerSpec, params: Mapping[str, torch.Tensor], x: torch.Tensor
    ) -> torch.Tensor:
        self.a_rows(spec, x)
        y = x @ params["weight"]
        return y + params["bias"] if "bias" in params else y

    def weight_shape(self, spec: LayerSpec) -> tuple[int, ...]:
        return (spec.in_dim, spec.out_dim)

    def to_matrix(
        self, spec: LayerSpec, weight_grad: torch.Tensor, bias_grad: torch.Tensor | None
    ) -> torch.Tensor:
        return super().to_matrix(spec, weight_grad.mT, bias_grad)

    def from_matrix(
        self, spec: LayerSpec, m: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        w, b = (m[..., :-1], m[..., -1]) if spec.has_bias else (m, None)
        return w.mT, b
