"""Layer registration: which modules K-FAC preconditions, and the static facts about each.

`register(model)` walks a model and returns a :class:`LayerTable`, a ``{name: LayerSpec}``
mapping that prints as a table. A :class:`LayerSpec` is pure, hashable data (it becomes
static metadata of the state pytree), so it holds names and shapes, never a module.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["SUPPORTED_KINDS", "LayerSpec", "LayerTable", "register"]

SUPPORTED_KINDS = ("linear", "conv2d")

# Subclasses of nn.Linear whose forward is never called (MultiheadAttention reads
# `out_proj.weight` directly), so hooks would capture nothing.
_NEVER_CALLED = ("NonDynamicallyQuantizableLinear",)


@dataclass(frozen=True)
class LayerSpec:
    """Static description of one preconditioned layer.

    The gradient of the layer is handled as a matrix of shape ``(groups, g_dim, a_dim)``
    (``groups`` is dropped when it is 1): rows are output features / channels of a group,
    columns are input features / patch entries of the group, plus one column for the bias.

    Attributes:
        name: module name as in ``model.named_modules()``.
        kind: ``"linear"`` or ``"conv2d"``.
        weight: full parameter name of the weight (key in ``named_parameters()``).
        bias: full parameter name of the bias, or ``None``.
        in_dim: input features (Linear) or input channels (Conv2d).
        out_dim: output features (Linear) or output channels (Conv2d).
        groups: convolution groups (1 for Linear). Factors are per group: a grouped
            convolution has block-diagonal K-FAC factors, one ``(A, G)`` pair per group,
            stored stacked along a leading dimension.
        kernel_size, stride, dilation: Conv2d geometry (empty for Linear).
        padding: explicit ``(left, right, top, bottom)`` padding, with ``'same'`` and
            ``'valid'`` resolved exactly as PyTorch resolves them.
        padding_mode: Conv2d ``padding_mode`` (``"zeros"``, ``"reflect"``, ...).

    Example:
        >>> from torch import nn
        >>> spec = register(nn.Sequential(nn.Linear(3, 2)))["0"]
        >>> spec.a_dim, spec.g_dim, spec.factor_shapes
        (4, 2, ((4, 4), (2, 2)))
    """

    name: str
    kind: str
    weight: str
    bias: str | None
    in_dim: int
    out_dim: int
    groups: int = 1
    kernel_size: tuple[int, ...] = ()
    stride: tuple[int, ...] = ()
    dilation: tuple[int, ...] = ()
    padding: tuple[int, ...] = ()
    padding_mode: str = "zeros"

    @property
    def has_bias(self) -> bool:
        return self.bias is not None

    @property
    def a_dim(self) -> int:
        """Side of one A factor: inputs per group (times kernel area), plus 1 for bias."""
        per_group = self.in_dim // self.groups
        for k in self.kernel_size:
            per_group *= k
        return per_group + int(self.has_bias)

    @property
    def g_dim(self) -> int:
        """Side of one G factor: outputs per group."""
        return self.out_dim // self.groups

    @property
    def batch_shape(self) -> tuple[int, ...]:
        """Leading shape of factors and gradient matrices: ``()`` or ``(groups,)``."""
        return () if self.groups == 1 else (self.groups,)

    @property
    def factor_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Shapes of the A and G factors."""
        b = self.batch_shape
        return (*b, self.a_dim, self.a_dim), (*b, self.g_dim, self.g_dim)

    @property
    def matrix_shape(self) -> tuple[int, ...]:
        """Shape of the gradient matrix (bias as the last column)."""
        return (*self.batch_shape, self.g_dim, self.a_dim)

    @property
    def weight_shape(self) -> tuple[int, ...]:
        """Shape of the module's weight parameter."""
        if self.kind == "linear":
            return (self.out_dim, self.in_dim)
        return (self.out_dim, self.in_dim // self.groups, *self.kernel_size)

    def param_names(self) -> tuple[str, ...]:
        return (self.weight,) if self.bias is None else (self.weight, self.bias)


class LayerTable(dict[str, LayerSpec]):
    """``{name: LayerSpec}`` of registered layers, plus the modules that were skipped.

    ``str(table)`` renders one row per module with parameters: name, kind, A and G
    shapes, or why it was skipped.
    """

    def __init__(self, specs: Iterable[LayerSpec] = (), skipped: dict[str, str] | None = None):
        super().__init__((s.name, s) for s in specs)
        self.skipped: dict[str, str] = dict(skipped or {})

    def __str__(self) -> str:
        rows = [("name", "kind", "A", "G", "note")]
        for spec in self.values():
            a, g = spec.factor_shapes
            note = f"{spec.groups} groups" if spec.groups > 1 else ""
            rows.append((spec.name, spec.kind, _fmt_shape(a), _fmt_shape(g), note))
        for name, why in self.skipped.items():
            rows.append((name, "-", "-", "-", f"skipped: {why}"))
        widths = [max(len(r[i]) for r in rows) for i in range(5)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"LayerTable({len(self)} layers, {len(self.skipped)} skipped)"


def _fmt_shape(shape: tuple[int, ...]) -> str:
    return "x".join(str(s) for s in shape)


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


def _spec_for(name: str, module: nn.Module) -> LayerSpec | str:
    """A LayerSpec, or the reason the module is not supported."""
    prefix = f"{name}." if name else ""
    bias = getattr(module, "bias", None)
    bias_name = f"{prefix}bias" if isinstance(bias, torch.Tensor) else None
    if type(module).__name__ in _NEVER_CALLED:
        return f"{type(module).__name__} is used without calling its forward"
    if isinstance(module, nn.Linear):
        return LayerSpec(
            name, "linear", f"{prefix}weight", bias_name, module.in_features, module.out_features
        )
    if isinstance(module, nn.Conv2d):
        if module.transposed:  # pragma: no cover - ConvTranspose2d is not a Conv2d subclass
            return "transposed convolution is not supported"
        return LayerSpec(
            name,
            "conv2d",
            f"{prefix}weight",
            bias_name,
            module.in_channels,
            module.out_channels,
            groups=module.groups,
            kernel_size=_pair(module.kernel_size),
            stride=_pair(module.stride),
            dilation=_pair(module.dilation),
            padding=conv_padding(module),
            padding_mode=module.padding_mode,
        )
    return f"unsupported kind {type(module).__name__}"


def register(model: nn.Module, skip_layers: Iterable[str] | str | None = None) -> LayerTable:
    """Find the layers of ``model`` that K-FAC preconditions.

    Supported: ``nn.Linear`` (inputs of any rank; leading dimensions become rows) and
    ``nn.Conv2d`` (any stride, padding incl. ``'same'``/``'valid'``/non-zero modes,
    dilation, groups, bias). Every other module that owns parameters is listed in
    ``table.skipped`` with the reason, never an error.

    Args:
        model: the model to scan.
        skip_layers: regular expressions searched (``re.search``) in each module's
            qualified name and its class name. A matching module is skipped together with
            all of its children.

    Returns:
        A :class:`LayerTable` mapping module names to :class:`LayerSpec`.

    Example:
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
        >>> table = register(model, skip_layers=["Embedding"])
        >>> list(table)
        ['1', '3']
        >>> print(table)  # doctest: +NORMALIZE_WHITESPACE
        name  kind    A    G    note
        ----  ------  ---  ---  ----------------------------------------
        1     linear  5x5  4x4
        3     linear  5x5  2x2
        0     -       -    -    skipped: matched skip_layers 'Embedding'
    """
    if isinstance(skip_layers, str):
        skip_layers = [skip_layers]
    patterns = [(p, re.compile(p)) for p in (skip_layers or [])]
    specs: list[LayerSpec] = []
    skipped: dict[str, str] = {}
    skipped_prefixes: list[str] = []

    for name, module in model.named_modules():
        if any(name == p or name.startswith(p + ".") for p in skipped_prefixes):
            continue
        cls = type(module).__name__
        hit = next((p for p, rx in patterns if rx.search(name) or rx.search(cls)), None)
        if hit is not None:
            skipped_prefixes.append(name)
            if any(True for _ in module.parameters()):
                skipped[name] = f"matched skip_layers {hit!r}"
            continue
        own_params = list(module.parameters(recurse=False))
        if not own_params:
            continue
        result = _spec_for(name, module)
        if isinstance(result, str):
            skipped[name] = result
        elif not module.get_parameter("weight").requires_grad:
            skipped[name] = "weight does not require grad"
        else:
            specs.append(result)
    return LayerTable(specs, skipped)
