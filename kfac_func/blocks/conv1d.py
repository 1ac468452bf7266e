"""``nn.Conv1d``: the same geometry as Conv2d (stride, padding incl. ``'same'``/``'valid'`` and
every ``padding_mode``, dilation, groups, bias), computed as a Conv2d of height one.

A ``(N, C, L)`` input is a ``(N, C, 1, L)`` image under a ``1 × k`` kernel: the patches,
factors and gradient matrices are exactly those of that convolution
(:class:`~kfac_func.blocks.conv2d.Conv2dBlock`), and so is their exactness.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from kfac_func.blocks.base import LayerBlock
from kfac_func.blocks.conv2d import Conv2dBlock, conv_spec
from kfac_func.blocks.registry import register_block
from kfac_func.blocks.spec import Gram, LayerSpec, shape_error

__all__ = ["Conv1dBlock", "conv1d_padding"]

_AS_2D = Conv2dBlock()


def _one(v: int | tuple[int, ...]) -> int:
    return v if isinstance(v, int) else int(v[0])


def conv1d_padding(module: nn.Conv1d) -> tuple[int, int]:
    """Explicit ``(left, right)`` padding of a Conv1d, as PyTorch applies it (``'same'``:
    ``dilation · (kernel − 1)`` in total, the smaller half on the left).

    Example:
        >>> from torch import nn
        >>> conv1d_padding(nn.Conv1d(1, 1, 4, padding="same"))
        (1, 2)
    """
    if isinstance(module.padding, str):
        if module.padding == "valid":
            return (0, 0)
        if module.padding != "same":
            raise ValueError(f"unknown Conv1d padding {module.padding!r}")
        total = _one(module.dilation) * (_one(module.kernel_size) - 1)
        return (total // 2, total - total // 2)
    p = _one(module.padding)
    return (p, p)


@register_block
class Conv1dBlock(LayerBlock):
    """A 1-d convolution; the weight is ``(out, in/groups, k)``.

    Example:
        >>> import torch
        >>> from kfac_func.blocks import register
        >>> spec = register(torch.nn.Conv1d(2, 4, 3))[""]
        >>> spec.factor_shapes, spec.block.a_gram(spec, torch.ones(5, 2, 8), torch.float32).rows
        (((7, 7), (4, 4)), 30)
    """

    kind = "conv1d"
    orthogonalizable = True
    module_types = (nn.Conv1d,)
    reducible = True

    def spec(self, name: str, module: nn.Module) -> LayerSpec | str:
        assert isinstance(module, nn.Conv1d)
        return conv_spec(
            self.kind,
            name,
            module,
            kernel_size=(_one(module.kernel_size),),
            stride=(_one(module.stride),),
            dilation=(_one(module.dilation),),
            padding=conv1d_padding(module),
        )

    @staticmethod
    def as_2d(spec: LayerSpec) -> LayerSpec:
        """The Conv2d (height one) that computes the same as ``spec``."""
        return dataclasses.replace(
            spec,
            kernel_size=(1, *spec.kernel_size),
            stride=(1, *spec.stride),
            dilation=(1, *spec.dilation),
            padding=(*spec.padding, 0, 0),
        )

    def _image(self, spec: LayerSpec, t: torch.Tensor, what: str, channels: int) -> torch.Tensor:
        if t.dim() not in (2, 3) or t.shape[-2] != channels:
            raise shape_error(spec, what, f"shape (N, {channels}, L)", t.shape)
        return t.unsqueeze(-2)

    def a_rows(self, spec: LayerSpec, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Patches ``(*batch_shape, N·L_out, C/groups·k)`` and ``L_out``."""
        return _AS_2D.a_rows(self.as_2d(spec), self._image(spec, x, "input", spec.in_dim))

    def example_rows(
        self, spec: LayerSpec, x: torch.Tensor, r: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        x2 = self._image(spec, x, "input", spec.in_dim)
        r2 = self._image(spec, r, "output-gradient", spec.out_dim)
        return _AS_2D.example_rows(self.as_2d(spec), x2, r2)

    def examples(self, spec: LayerSpec, x: torch.Tensor) -> int | None:
        """``N`` of an ``(N, C, L)`` input; 1 for an unbatched ``(C, L)`` one."""
        return int(x.shape[0]) if x.dim() == 3 else 1

    def a_gram(self, spec: LayerSpec, x: torch.Tensor, dtype: torch.dtype) -> Gram:
        return _AS_2D.a_gram(self.as_2d(spec), self._image(spec, x, "input", spec.in_dim), dtype)

    def g_gram(self, spec: LayerSpec, r: torch.Tensor, dtype: torch.dtype) -> Gram:
        image = self._image(spec, r, "output-gradient", spec.out_dim)
        return _AS_2D.g_gram(self.as_2d(spec), image, dtype)
