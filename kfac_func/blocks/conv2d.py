"""``nn.Conv2d``: any stride, padding (ints, tuples, ``'same'``, ``'valid'``, every
``padding_mode``), dilation, groups and bias.

Rows are the patches the convolution sees (``C/groups·kh·kw`` entries, ones appended for
the bias) and the output-gradients per output pixel; ``spatial`` is the number of output
pixels per example. A grouped convolution has one ``(A, G)`` pair per group. Inputs with a
unit vertical stride build ``A`` without materialising the patches
(:func:`kfac_func.blocks.patch_gram.patch_gram`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kfac_func.blocks.base import LayerBlock
from kfac_func.blocks.patch_gram import patch_gram, supports_row_gram
from kfac_func.blocks.registry import register_block
from kfac_func.blocks.spec import Gram, LayerSpec, row_gram, shape_error, with_ones

__all__ = ["Conv2dBlock", "conv_padding", "conv_spec"]


def _pair(v: int | tuple[int, ...]) -> tuple[int, int]:
    if isinstance(v, int):
        return (v, v)
    if len(v) != 2:
        raise ValueError(f"expected an int or a pair, got {v!r}")
    return (int(v[0]), int(v[1]))


def conv_padding(module: nn.Conv2d) -> tuple[int, int, int, int]:
    """Explicit ``(left, right, top, bottom)`` padding of a Conv2d, as PyTorch applies it.

    ``'same'`` pads ``dilation * (kernel - 1)`` in total per side pair, the smaller half
    first; ``'valid'`` pads nothing.

    Example:
        >>> from torch import nn
        >>> conv_padding(nn.Conv2d(1, 1, (2, 4), padding="same"))
        (1, 2, 0, 1)
    """
    kh, kw = _pair(module.kernel_size)
    dh, dw = _pair(module.dilation)
    if isinstance(module.padding, str):
        if module.padding == "valid":
            return (0, 0, 0, 0)
        if module.padding != "same":
            raise ValueError(f"unknown Conv2d padding {module.padding!r}")
        th, tw = dh * (kh - 1), dw * (kw - 1)
        return (tw // 2, tw - tw // 2, th // 2, th - th // 2)
    ph, pw = _pair(module.padding)
    return (pw, pw, ph, ph)


def _by_example(rows: torch.Tensor, spatial: int) -> torch.Tensor:
    """Rows ``(*batch_shape, N·L, k)`` as ``(*batch_shape, N, L, k)``: each example's
    ``L = spatial`` positions."""
    n = rows.shape[-2] // spatial
    return rows.reshape(*rows.shape[:-2], n, spatial, rows.shape[-1])


def conv_spec(
    kind: str,
    name: str,
    module: nn.Conv1d | nn.Conv2d,
    *,
    kernel_size: tuple[int, ...],
    stride: tuple[int, ...],
    dilation: tuple[int, ...],
    padding: tuple[int, ...],
) -> LayerSpec:
    """The spec of a convolution module with its geometry resolved."""
    prefix = f"{name}." if name else ""
    bias = f"{prefix}bias" if isinstance(module.bias, torch.Tensor) else None
    return LayerSpec(
        name,
        kind,
        f"{prefix}weight",
        bias,
        module.in_channels,
        module.out_channels,
        groups=module.groups,
        kernel_size=kernel_size,
        stride=stride,
        dilation=dilation,
        padding=padding,
        padding_mode=module.padding_mode,
    )


@register_block
class Conv2dBlock(LayerBlock):
    """A 2-d convolution; the weight is ``(out, in/groups, kh, kw)``.

    Example:
        >>> import torch
        >>> from kfac_func.blocks import register
        >>> spec = register(torch.nn.Conv2d(2, 4, 3, groups=2))[""]
        >>> spec.factor_shapes, spec.block.g_gram(spec, torch.ones(1, 4, 2, 2), torch.float32).rows
        (((2, 10, 10), (2, 2, 2)), 4)
    """

    kind = "conv2d"
    orthogonalizable = True
    module_types = (nn.Conv2d,)
    reducible = True

    def spec(self, name: str, module: nn.Module) -> LayerSpec | str:
        assert isinstance(module, nn.Conv2d)
        if module.transposed:  # pragma: no cover - ConvTranspose2d is not a Conv2d subclass
            return "transposed convolution is not supported"
        return conv_spec(
            self.kind,
            name,
            module,
            kernel_size=_pair(module.kernel_size),
            stride=_pair(module.stride),
            dilation=_pair(module.dilation),
            padding=conv_padding(module),
        )

    def padded(self, spec: LayerSpec, x: torch.Tensor) -> torch.Tensor:
        """The input ``(N, C, H, W)`` padded exactly as the convolution pads it."""
        if x.dim() not in (3, 4) or x.shape[-3] != spec.in_dim:
            raise shape_error(spec, "input", f"shape (N, {spec.in_dim}, H, W)", x.shape)
        if x.dim() == 3:
            x = x.unsqueeze(0)
        if any(spec.padding):
            mode = "constant" if spec.padding_mode == "zeros" else spec.padding_mode
            x = F.pad(x, spec.padding, mode=mode)
        return x

    def a_rows(self, spec: LayerSpec, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Patches ``(*batch_shape, N·L, C/groups·kh·kw)`` exactly as the convolution sees
        them, without the bias column, and ``L = out_h·out_w``."""
        cols = F.unfold(
            self.padded(spec, x), spec.kernel_size, dilation=spec.dilation, stride=spec.stride
        )
        n, _, length = cols.shape
        g = spec.groups
        cols = cols.view(n, g, -1, length).permute(1, 0, 3, 2).reshape(g, n * length, -1)
        cols = cols[0] if g == 1 else cols
        return cols, cols.shape[-2] // (x.shape[0] if x.dim() == 4 else 1)

    def example_rows(
        self, spec: LayerSpec, x: torch.Tensor, r: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        a, g = _by_example(*self.a_rows(spec, x)), _by_example(*self.g_rows(spec, r))
        return (with_ones(a) if spec.has_bias else a), g

    def _grad(self, spec: LayerSpec, r: torch.Tensor) -> torch.Tensor:
        """An output-gradient as ``(N, C, h, w)``, its shape checked."""
        if r.dim() not in (3, 4) or r.shape[-3] != spec.out_dim:
            raise shape_error(spec, "output-gradient", f"shape (N, {spec.out_dim}, h, w)", r.shape)
        return r.unsqueeze(0) if r.dim() == 3 else r

    def g_rows(self, spec: LayerSpec, r: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Output-gradient rows ``(*batch_shape, N·h·w, C/groups)`` and ``h·w``."""
        r = self._grad(spec, r)
        n, _, h, w = r.shape
        g = spec.groups
        rows = r.reshape(n, g, -1, h * w).permute(1, 0, 3, 2).reshape(g, n * h * w, -1)
        return (rows[0] if g == 1 else rows), h * w

    def examples(self, spec: LayerSpec, x: torch.Tensor) -> int | None:
        """``N`` of an ``(N, C, H, W)`` input; 1 for an unbatched ``(C, H, W)`` one."""
        return int(x.shape[0]) if x.dim() == 4 else 1

    def a_gram(self, spec: LayerSpec, x: torch.Tensor, dtype: torch.dtype) -> Gram:
        if self.reduced(spec):  # the mean patch of each example
            rows = _by_example(*self.a_rows(spec, x.to(dtype))).mean(dim=-2)
            d = spec.a_diagonal
            return Gram(row_gram(rows, spec.has_bias, d, spec.a_blocks), rows.shape[-2], 1, d)
        if not spec.a_diagonal and supports_row_gram(spec.kernel_size, spec.stride):
            y = self.padded(spec, x.to(dtype))
            kh, kw = spec.kernel_size
            dil_h, dil_w = spec.dilation
            return Gram(
                *patch_gram(y, (kh, kw), (dil_h, dil_w), spec.stride[1], spec.groups, spec.has_bias)
            )
        rows, spatial = self.a_rows(spec, x.to(dtype))
        d = spec.a_diagonal
        return Gram(row_gram(rows, spec.has_bias, d, spec.a_blocks), rows.shape[-2], spatial, d)

    def g_gram(self, spec: LayerSpec, r: torch.Tensor, dtype: torch.dtype) -> Gram:
        # columns (*batch_shape, C/groups, N·h·w), the transpose of g_rows: cheaper to build
        # from (N, C, h, w), whole h·w runs are copied
        r = self._grad(spec, r.to(dtype))
        if self.reduced(spec):  # the summed output-gradient of each example
            r = r.sum(dim=(2, 3), keepdim=True)
        n, _, h, w = r.shape
        g = spec.groups
        cols = r.reshape(n, g, -1, h * w).permute(1, 2, 0, 3).reshape(g, -1, n * h * w)
        cols = cols[0] if g == 1 else cols
        if spec.g_diagonal:
            return Gram((cols * cols).sum(dim=-1), cols.shape[-1], h * w, True)
        return Gram(cols @ cols.mT, cols.shape[-1], h * w)
