"""``nn.LayerNorm`` and ``nn.RMSNorm`` with an elementwise affine: one unit per entry of the
normalised shape, rows are every leading position (see
:mod:`kfac_func.blocks.scale_shift`).

``x̂`` is recomputed from the input as the module computes it: over the trailing
``len(normalized_shape)`` dimensions, centred with the biased variance for LayerNorm,
``x / sqrt(mean(x²) + eps)`` for RMSNorm (``eps=None``: the input dtype's machine epsilon).
"""

from __future__ import annotations

import torch
from torch import nn

from kfac_func.blocks.registry import register_block
from kfac_func.blocks.scale_shift import ScaleShiftBlock, normalise, resolved_eps
from kfac_func.blocks.spec import LayerSpec, shape_error

__all__ = ["LayerNormBlock", "RMSNormBlock"]


class _TrailingNorm(ScaleShiftBlock):
    center = True

    def spec(self, name: str, module: nn.Module) -> LayerSpec | str:
        eps = getattr(module, "eps", None)
        return self.scale_shift_spec(name, module, eps=None if eps is None else float(eps))

    def examples(self, spec: LayerSpec, x: torch.Tensor) -> int | None:
        """``N`` of an ``(N, ..., *normalized_shape)`` input; 1 for an unbatched
        ``normalized_shape`` one."""
        return int(x.shape[0]) if x.dim() > len(spec.weight_shape) else 1

    def unit_rows(
        self, spec: LayerSpec, x: torch.Tensor, r: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        shape = spec.weight_shape
        k = len(shape)
        if x.dim() < k or tuple(x.shape[-k:]) != shape:
            raise shape_error(spec, "input", f"trailing dimensions {shape}", x.shape)
        dims = tuple(range(x.dim() - k, x.dim()))
        eps = resolved_eps(spec.option("eps"), x.dtype)
        xhat = normalise(x, dims, eps, center=self.center)
        return xhat.reshape(-1, spec.groups), r.reshape(-1, spec.groups)


@register_block
class LayerNormBlock(_TrailingNorm):
    """``nn.LayerNorm(normalized_shape)`` with ``elementwise_affine`` (with or without bias).

    Example:
        >>> import torch
        >>> from kfac_func.blocks import register
        >>> spec = register(torch.nn.LayerNorm(4))[""]
        >>> spec.kind, spec.factor_shapes
        ('layer_norm', ((4, 1), (4, 2, 2)))
    """

    kind = "layer_norm"
    module_types = (nn.LayerNorm,)


@register_block
class RMSNormBlock(_TrailingNorm):
    """``nn.RMSNorm(normalized_shape)`` with ``elementwise_affine`` (a scale, no shift)."""

    kind = "rms_norm"
    module_types = (nn.RMSNorm,)
    center = False
