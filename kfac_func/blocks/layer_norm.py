"""``nn.LayerNorm`` and ``nn.RMSNorm`` with an elementwise affine: one unit per entry of the
normalised shape, rows are every leading position (see
:mod:`kfac_func.blocks.scale_shift`).

``x̂`` is recomputed from the input as the module computes it: over the trailing
``len(normalized_shape)`` dimensions, centred with the biased variance for LayerNorm,
``x / sqrt(mean(x²) + eps)`` for RMSNorm (``eps=None``: the input dtype's machine epsilon).

A mapped norm may scale by ``offset + weight`` (option ``offset``; Gemma's RMS norms compute
``x̂ · (1 + weight)``): the gradient of ``weight`` is the same ``x̂ ⊙ g``, so the factors are
the kind's; only the output its first call is checked against changes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kfac_func.blocks.mapped import mapped_params, mapping_error
from kfac_func.blocks.registry import register_block
from kfac_func.blocks.scale_shift import ScaleShiftBlock, normalise, resolved_eps
from kfac_func.blocks.spec import CheckedCall, LayerSpec, shape_error

__all__ = ["LayerNormBlock", "RMSNormBlock"]


class _TrailingNorm(ScaleShiftBlock):
    center = True
    mappable = True
    mapped_options = ("eps", "offset")
    default_eps: float | None = 1e-5
    """The ``eps`` of a mapped module that has no ``eps`` (nor ``variance_epsilon``)
    attribute and is given none in ``kinds=``: the default of the kind's torch module."""

    def spec(self, name: str, module: nn.Module) -> LayerSpec | str:
        eps = getattr(module, "eps", None)
        return self.scale_shift_spec(name, module, eps=None if eps is None else float(eps))

    def examples(self, spec: LayerSpec, x: torch.Tensor) -> int | None:
        """``N`` of an ``(N, ..., *normalized_shape)`` input; 1 for an unbatched
        ``normalized_shape`` one."""
        return int(x.shape[0]) if x.dim() > len(spec.weight_shape) else 1

    def rows_only(self, spec: LayerSpec, x: torch.Tensor) -> bool:
        """An ``(R, *normalized_shape)`` input: examples or flattened positions alike."""
        return x.dim() == len(spec.weight_shape) + 1

    def mapped_spec(self, name: str, module: nn.Module, options: Mapping[str, Any]) -> LayerSpec:
        """A norm of a class of the user's: ``weight`` (the normalised shape) and an optional
        ``bias`` of the same shape; ``eps`` from ``options``, else the module's ``eps`` or
        ``variance_epsilon`` attribute, else :attr:`default_eps`."""
        weight, bias = mapped_params(name, module, self.kind)
        if bias is not None and bias.shape != weight.shape:
            raise mapping_error(
                name,
                module,
                self.kind,
                f"its bias has shape {tuple(bias.shape)} and its weight {tuple(weight.shape)}"
                " (the kind needs one entry of each per normalised element)",
            )
        if weight.dim() == 0:
            raise mapping_error(name, module, self.kind, "its weight is a scalar")
        if "eps" in options:
            eps = options["eps"]
        else:
            attr = next((a for a in ("eps", "variance_epsilon") if hasattr(module, a)), None)
            eps = getattr(module, attr) if attr else self.default_eps
        if eps is not None and (
            isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0
        ):
            raise mapping_error(name, module, self.kind, f"eps must be a number >= 0, got {eps!r}")
        extra: dict[str, Any] = {}
        if options.get("offset") is not None:
            offset = options["offset"]
            if isinstance(offset, bool) or not isinstance(offset, (int, float)):
                raise mapping_error(
                    name, module, self.kind, f"offset must be a number, got {offset!r}"
                )
            extra["offset"] = float(offset)
        spec = self.scale_shift_spec(name, module, eps=None if eps is None else float(eps), **extra)
        assert not isinstance(spec, str)
        return spec

    def output(
        self, spec: LayerSpec, params: Mapping[str, torch.Tensor], x: torch.Tensor
    ) -> torch.Tensor:
        shape = spec.weight_shape
        k = len(shape)
        if x.dim() < k or tuple(x.shape[-k:]) != shape:
            raise shape_error(spec, "input", f"trailing dimensions {shape}", x.shape)
        dims = tuple(range(x.dim() - k, x.dim()))
        y = normalise(x, dims, resolved_eps(spec.option("eps"), x.dtype), center=self.center)
        y = y * (params["weight"] + float(spec.option("offset", 0.0)))
        return y + params["bias"] if "bias" in params else y

    def formula(self, spec: LayerSpec) -> str:
        norm = "(x - mean(x)) / std(x)" if self.center else "x / rms(x)"
        offset = spec.option("offset")
        scale = "weight" if not offset else f"({offset:g} + weight)"
        return f"{norm} * {scale}" + (" + bias" if spec.has_bias else "")

    def mismatch_hint(self, spec: LayerSpec, call: CheckedCall) -> str | None:
        """A norm that scales by ``1 + weight`` (Gemma's) is named with the mapping that
        tells the kind so."""
        if spec.option("offset") is None:
            shifted = spec.with_options(offset=1.0)
            if (
                float((self.output(shifted, call.params, call.x) - call.got).abs().max())
                <= call.tol
            ):
                eps = spec.option("eps")
                return (
                    f"the module computes {self.formula(shifted)}: map its class with "
                    f"kinds={{cls: ({self.kind!r}, {{'eps': {eps!r}, 'offset': 1.0}})}}"
                )
        return super().mismatch_hint(spec, call)

    def unit_rows(
        self, spec: LayerSpec, x: torch.Tensor, r: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        shape = spec.weight_shape
        k = len(shape)
        if x.dim() < k or tuple(x.shape[-k:]) != shape:
            raise shape_error(spec, "input", f"trailing dimensions {shape}", x.shape)
        eps = resolved_eps(spec.option("eps"), x.dtype)  # the module's: its input's dtype
        norm = F.layer_norm if self.center else F.rms_norm  # one fused pass each
        xhat = norm(x.to(dtype), shape, eps=eps)
        return xhat.reshape(-1, spec.groups), r.to(dtype).reshape(-1, spec.groups)


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
    default_eps = None
