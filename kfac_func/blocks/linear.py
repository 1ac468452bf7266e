"""``nn.Linear``: inputs of any rank, leading dimensions become rows.

``A`` is the Gram of the input rows ``a`` (a column of ones appended for the bias), ``G``
that of the output-gradient rows; every position of a sequence is a row of its own (the
"expand" convention). The gradient ``[W | b]`` is ``Σ gᵀ[a, 1]`` over the rows, which the
low-rank preconditioning path uses (:attr:`LinearBlock.has_rows`).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kfac_func.blocks.base import LayerBlock
from kfac_func.blocks.mapped import mapped_params, mapping_error
from kfac_func.blocks.registry import register_block
from kfac_func.blocks.spec import Gram, LayerSpec, cast, row_gram, shape_error, with_ones

__all__ = ["LinearBlock"]

# Subclasses of nn.Linear whose forward is never called (MultiheadAttention reads
# `out_proj.weight` directly), so hooks would capture nothing.
_NEVER_CALLED = ("NonDynamicallyQuantizableLinear",)


@register_block
class LinearBlock(LayerBlock):
    """``y = x Wᵀ + b`` with ``W`` of shape ``(out, in)``.

    Example:
        >>> import torch
        >>> from kfac_func.blocks import register
        >>> spec = register(torch.nn.Linear(3, 2))[""]
        >>> spec.block.a_gram(spec, torch.ones(5, 3), torch.float32).gram[-1]
        tensor([5., 5., 5., 5.])
    """

    kind = "linear"
    orthogonalizable = True
    module_types: tuple[type[nn.Module], ...] = (nn.Linear,)
    has_rows = True
    tensor_parallel = True
    reducible = True

    def rows_only(self, spec: LayerSpec, x: torch.Tensor) -> bool:
        """An ``(R, in)`` input: examples or flattened positions alike."""
        return x.dim() == 2

    def spec(self, name: str, module: nn.Module) -> LayerSpec | str:
        if type(module).__name__ in _NEVER_CALLED:
            return f"{type(module).__name__} is used without calling its forward"
        assert isinstance(module, nn.Linear)
        prefix = f"{name}." if name else ""
        bias = f"{prefix}bias" if isinstance(module.bias, torch.Tensor) else None
        return LayerSpec(
            name, self.kind, f"{prefix}weight", bias, module.in_features, module.out_features
        )

    mappable = True

    def mapped_spec(self, name: str, module: nn.Module, options: Mapping[str, Any]) -> LayerSpec:
        """A linear of a class of the user's: ``weight`` ``(out, in)``, optional ``bias``
        ``(out,)``, computing ``x @ weight.T + bias``."""
        weight, bias = mapped_params(name, module, self.kind)
        d_out, d_in = self._dims(name, module, weight)
        if bias is not None and tuple(bias.shape) != (d_out,):
            raise mapping_error(
                name, module, self.kind, f"its bias has shape {tuple(bias.shape)}, not ({d_out},)"
            )
        prefix = f"{name}." if name else ""
        bias_name = f"{prefix}bias" if bias is not None else None
        return LayerSpec(name, self.kind, f"{prefix}weight", bias_name, d_in, d_out)

    def formula(self, spec: LayerSpec) -> str:
        return "x @ weight.T + bias" if spec.has_bias else "x @ weight.T"

    def _dims(self, name: str, module: nn.Module, weight: torch.Tensor) -> tuple[int, int]:
        """``(out, in)`` of a mapped module's 2-d weight."""
        if weight.dim() != 2:
            raise mapping_error(
                name, module, self.kind, f"its weight has shape {tuple(weight.shape)}, not 2-d"
            )
        return int(weight.shape[0]), int(weight.shape[1])

    def output(
        self, spec: LayerSpec, params: Mapping[str, torch.Tensor], x: torch.Tensor
    ) -> torch.Tensor:
        self.a_rows(spec, x)  # the input's shape, checked
        return F.linear(x, params["weight"], params.get("bias"))

    def a_rows(self, spec: LayerSpec, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Input rows ``(prod(...), in)`` of ``x`` of shape ``(..., in)``; spatial 1."""
        if x.dim() == 0 or x.shape[-1] != spec.in_dim:
            raise shape_error(spec, "input", f"last dimension {spec.in_dim}", x.shape)
        return (x if x.dim() == 2 else x.reshape(-1, spec.in_dim)), 1

    def g_rows(self, spec: LayerSpec, r: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Output-gradient rows ``(prod(...), out)``; spatial 1."""
        if r.dim() == 0 or r.shape[-1] != spec.out_dim:
            raise shape_error(spec, "output-gradient", f"last dimension {spec.out_dim}", r.shape)
        return (r if r.dim() == 2 else r.reshape(-1, spec.out_dim)), 1

    def a_gram(self, spec: LayerSpec, x: torch.Tensor, dtype: torch.dtype) -> Gram:
        rows, spatial = self.a_rows(spec, cast(x, dtype))
        if self.reduced(spec) and x.dim() > 2:  # the mean input of each example
            rows = rows.reshape(x.shape[0], -1, rows.shape[-1]).mean(dim=1)
        d = spec.a_diagonal
        return Gram(row_gram(rows, spec.has_bias, d, spec.a_blocks), rows.shape[-2], spatial, d)

    def a_gram_key(self, spec: LayerSpec) -> Hashable | None:
        if (
            type(self).a_gram is not LinearBlock.a_gram
            or type(self).a_rows is not LinearBlock.a_rows
        ):
            return None  # a kind of its own, which may read its input otherwise
        return (
            type(self),
            spec.in_dim,
            spec.has_bias,
            spec.a_diagonal,
            spec.a_blocks,
            self.reduced(spec),
        )

    def g_gram(self, spec: LayerSpec, r: torch.Tensor, dtype: torch.dtype) -> Gram:
        rows, spatial = self.g_rows(spec, cast(r, dtype))
        if self.reduced(spec) and r.dim() > 2:  # the summed output-gradient of each example
            rows = rows.reshape(r.shape[0], -1, rows.shape[-1]).sum(dim=1)
        d = spec.g_diagonal
        return Gram(row_gram(rows, False, d), rows.shape[-2], spatial, d)

    def example_rows(
        self, spec: LayerSpec, x: torch.Tensor, r: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        n = x.shape[0] if x.dim() > 1 else 1  # leading dimension: examples; the rest: positions
        a = self.a_rows(spec, x)[0].reshape(n, -1, spec.in_dim)
        g = self.g_rows(spec, r)[0].reshape(n, -1, spec.out_dim)
        return (with_ones(a) if spec.has_bias else a), g

    def rows(
        self, spec: LayerSpec, inputs: Sequence[torch.Tensor], output_grads: Sequence[torch.Tensor]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [
            (self.a_rows(spec, x)[0], self.g_rows(spec, r)[0]) for x, r in zip(inputs, output_grads)
        ]
