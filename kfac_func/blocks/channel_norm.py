"""``nn.GroupNorm`` and ``nn.BatchNorm1d/2d/3d`` with an affine, and a module's own
per-channel scale (``y = x · s``: Mamba's ``D``): one unit per channel (dimension 1 of the
input), rows are every example and position (see :mod:`kfac_func.blocks.scale_shift`).

``x̂`` is recomputed from the input: GroupNorm normalises each group of channels of one
example, BatchNorm each channel over the batch and positions with the batch statistics
(what it uses in training mode, when K-FAC collects statistics; in evaluation mode
BatchNorm uses its running statistics, which a capture taken then does not see).
"""

from __future__ import annotations

import torch
from torch import nn

from kfac_func.blocks.registry import register_block
from kfac_func.blocks.scale_shift import ScaleShiftBlock, normalise
from kfac_func.blocks.spec import LayerSpec, shape_error

__all__ = ["BatchNormBlock", "ChannelScaleBlock", "GroupNormBlock"]


def _channel_rows(spec: LayerSpec, t: torch.Tensor) -> torch.Tensor:
    return t.movedim(1, -1).reshape(-1, spec.groups)


def _check(spec: LayerSpec, x: torch.Tensor) -> None:
    if x.dim() < 2 or x.shape[1] != spec.groups:
        raise shape_error(spec, "input", f"shape (N, {spec.groups}, ...)", x.shape)


@register_block
class GroupNormBlock(ScaleShiftBlock):
    """``nn.GroupNorm(num_groups, num_channels)`` with ``affine``.

    Example:
        >>> import torch
        >>> from kfac_func.blocks import register
        >>> register(torch.nn.GroupNorm(2, 6))[""].factor_shapes
        ((6, 1), (6, 2, 2))
    """

    kind = "group_norm"
    module_types = (nn.GroupNorm,)

    def spec(self, name: str, module: nn.Module) -> LayerSpec | str:
        assert isinstance(module, nn.GroupNorm)
        return self.scale_shift_spec(
            name, module, eps=float(module.eps), num_groups=int(module.num_groups)
        )

    def unit_rows(
        self, spec: LayerSpec, x: torch.Tensor, r: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        _check(spec, x)
        x, r = x.to(dtype), r.to(dtype)
        n, groups = x.shape[0], spec.option("num_groups")
        xhat = normalise(x.reshape(n, groups, -1), (2,), spec.option("eps"), center=True)
        return _channel_rows(spec, xhat.reshape(x.shape)), _channel_rows(spec, r)


@register_block
class BatchNormBlock(ScaleShiftBlock):
    """``nn.BatchNorm1d/2d/3d`` (any ``_BatchNorm``) with ``affine``."""

    kind = "batch_norm"
    module_types = (nn.modules.batchnorm._BatchNorm,)

    def spec(self, name: str, module: nn.Module) -> LayerSpec | str:
        assert isinstance(module, nn.modules.batchnorm._BatchNorm)
        return self.scale_shift_spec(name, module, eps=float(module.eps))

    def unit_rows(
        self, spec: LayerSpec, x: torch.Tensor, r: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        _check(spec, x)
        x, r = x.to(dtype), r.to(dtype)
        dims = (0, *range(2, x.dim()))
        xhat = normalise(x, dims, spec.option("eps"), center=True)
        return _channel_rows(spec, xhat), _channel_rows(spec, r)


@register_block
class ChannelScaleBlock(ScaleShiftBlock):
    """A one-dimensional parameter ``s`` of ``C`` entries that its module's forward uses as
    a per-channel scale, ``y = x · s`` (Mamba's skip connection ``x · D``): the scale rows
    of a norm whose normalised input is ``x`` itself. Registered for the parameters
    :data:`~kfac_func.blocks.used_weights.OWN_SCALES` names, never by a module's class;
    the call is the product found in the module's forward
    (:class:`~kfac_func.blocks.used_weights.WeightUseTap`), channels on dimension 1.

    Example:
        >>> import torch
        >>> spec = ChannelScaleBlock().own_spec("mixer", "D", torch.ones(3))
        >>> spec.kind, spec.module, spec.factor_shapes
        ('channel_scale', 'mixer', ((3, 1), (3, 1, 1)))
    """

    kind = "channel_scale"
    module_types: tuple[type[nn.Module], ...] = ()

    def matches(self, module: nn.Module) -> bool:
        return False

    def spec(self, name: str, module: nn.Module) -> LayerSpec | str:
        return "a channel scale is a parameter of a module, not a module"

    def own_spec(self, module: str, attr: str, scale: torch.Tensor) -> LayerSpec:
        """The layer of ``module``'s parameter ``attr`` (``scale``, one entry per channel)."""
        prefix = f"{module}." if module else ""
        return self.unit_spec(
            f"{prefix}{attr}", f"{prefix}{attr}", None, (scale.numel(),), module=module,
            used_by_parent=True,
        )  # fmt: skip

    def notes(self, spec: LayerSpec) -> list[str]:
        return [*super().notes(spec), f"a scale in the forward of {spec.module!r}"]

    def unit_rows(
        self, spec: LayerSpec, x: torch.Tensor, r: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        _check(spec, x)
        x, r = x.to(dtype), r.to(dtype)
        return _channel_rows(spec, x), _channel_rows(spec, r)
