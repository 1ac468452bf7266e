"""The layer-kind protocol: what K-FAC needs to know about one kind of layer.

A :class:`LayerSpec` is the static, hashable description of one registered layer (it
becomes metadata of the state pytree and is written into checkpoints). Its ``kind`` names
a :class:`LayerBlock`, a stateless object that knows everything specific to that kind:

- which modules it handles and the spec of one (:meth:`LayerBlock.spec`);
- the side of each Kronecker factor and the shape of the weight;
- the Gram statistics of one call's inputs and output-gradients
  (:meth:`LayerBlock.a_gram`, :meth:`LayerBlock.g_gram`), from which the conventions of
  :mod:`kfac_func.core.conventions` make the factors;
- the gradient as a matrix ``(*batch_shape, g_dim, a_dim)`` and back;
- optionally the rows of each call for the low-rank preconditioning path
  (:attr:`LayerBlock.has_rows`) and whether Megatron-style tensor parallelism may split
  its features (:attr:`LayerBlock.tensor_parallel`).

Blocks register themselves by kind with :func:`register_block`; every module of
:mod:`kfac_func.blocks` is imported when the package is, so adding a kind is one new module
there. Pure tensor functions: no hook, no process group.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple, TypeVar

import torch
from torch import nn

__all__ = [
    "Gram",
    "LayerBlock",
    "LayerSpec",
    "Rows",
    "block_of",
    "blocks",
    "register_block",
    "row_gram",
    "shape_error",
]

Rows = Sequence[tuple[torch.Tensor, torch.Tensor]]
"""``[(input rows, output-gradient rows)]`` of a layer's calls (no bias column)."""


@dataclass(frozen=True)
class LayerSpec:
    """Static description of one preconditioned layer.

    The gradient of the layer is handled as a matrix of shape ``(groups, g_dim, a_dim)``
    (``groups`` is dropped when it is 1): rows are output features / channels of a group,
    columns are input features / patch entries of the group, plus one column for the bias.

    Attributes:
        name: module name as in ``model.named_modules()``.
        kind: the :class:`LayerBlock` that handles the layer (``"linear"``, ``"conv2d"``).
        weight: full parameter name of the weight (key in ``named_parameters()``).
        bias: full parameter name of the bias, or ``None``.
        in_dim: input features (Linear) or input channels (Conv2d).
        out_dim: output features (Linear) or output channels (Conv2d).
        groups: convolution groups (1 for Linear). Factors are per group: a grouped
            convolution has block-diagonal K-FAC factors, one ``(A, G)`` pair per group,
            stored stacked along a leading dimension.
        kernel_size, stride, dilation: convolution geometry (empty for Linear).
        padding: explicit ``(left, right, top, bottom)`` padding, with ``'same'`` and
            ``'valid'`` resolved exactly as PyTorch resolves them.
        padding_mode: convolution ``padding_mode`` (``"zeros"``, ``"reflect"``, ...).
        diagonal: whether the A and the G factor keep only their diagonal (a vector of
            ``a_dim`` / ``g_dim`` entries instead of a square matrix): inputs that are
            one-hot (Embedding) have a diagonal A, and a side wider than
            ``register(..., max_factor_dim=...)`` is kept diagonal to bound memory.
        options: settings only one kind needs, as ``(name, value)`` pairs of numbers,
            strings or tuples (a norm's ``eps`` and normalised shape); read them with
            :meth:`option`. New kinds put their settings here rather than in new fields.

    Example:
        >>> from torch import nn
        >>> from kfac_func.blocks import register
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
    diagonal: tuple[bool, bool] = (False, False)
    options: tuple[tuple[str, Any], ...] = ()

    def option(self, key: str, default: Any = None) -> Any:
        """The value of one of :attr:`options` (``default`` when absent)."""
        return dict(self.options).get(key, default)

    @property
    def module(self) -> str:
        """The name of the module whose calls feed the layer: the layer's own name, or the
        module it is a part of (the ``q_proj`` of a ``MultiheadAttention``)."""
        return str(self.option("module", self.name))

    @property
    def block(self) -> LayerBlock:
        """The :class:`LayerBlock` registered for ``kind``."""
        return block_of(self.kind)

    @property
    def has_bias(self) -> bool:
        return self.bias is not None

    @property
    def a_diagonal(self) -> bool:
        """Whether the A factor is stored as its diagonal."""
        return self.diagonal[0]

    @property
    def g_diagonal(self) -> bool:
        """Whether the G factor is stored as its diagonal."""
        return self.diagonal[1]

    @property
    def a_dim(self) -> int:
        """Side of one A factor (inputs per group, times the kernel area, plus 1 for bias)."""
        return self.block.a_dim(self)

    @property
    def g_dim(self) -> int:
        """Side of one G factor: outputs per group."""
        return self.block.g_dim(self)

    @property
    def batch_shape(self) -> tuple[int, ...]:
        """Leading shape of factors and gradient matrices: ``()`` or ``(groups,)``."""
        return () if self.groups == 1 else (self.groups,)

    @property
    def factor_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Shapes of the A and G factors (one dimension less for a diagonal one)."""
        b, a, g = self.batch_shape, self.a_dim, self.g_dim
        a_shape = (*b, a) if self.a_diagonal else (*b, a, a)
        g_shape = (*b, g) if self.g_diagonal else (*b, g, g)
        return a_shape, g_shape

    @property
    def matrix_shape(self) -> tuple[int, ...]:
        """Shape of the gradient matrix (bias as the last column)."""
        return (*self.batch_shape, self.g_dim, self.a_dim)

    @property
    def weight_shape(self) -> tuple[int, ...]:
        """Shape of the module's weight parameter."""
        return self.block.weight_shape(self)

    def param_names(self) -> tuple[str, ...]:
        return (self.weight,) if self.bias is None else (self.weight, self.bias)


class Gram(NamedTuple):
    """Unscaled statistics of one call: ``Σ rowsᵀrows`` (only its diagonal ``Σ rows²`` when
    ``diagonal``), its row count, rows per example that stem from space. Factors are scaled
    sums of these (see :mod:`kfac_func.core.conventions`)."""

    gram: torch.Tensor
    rows: int
    spatial: int
    diagonal: bool = False


def shape_error(
    spec: LayerSpec, what: str, expected: str, shape: torch.Size | tuple[int, ...]
) -> ValueError:
    """A ValueError naming the layer, its kind, the tensor, and the shapes."""
    return ValueError(
        f"layer {spec.name!r} ({spec.kind}): {what} must have {expected}, got shape {tuple(shape)}"
    )


def row_gram(rows: torch.Tensor, with_ones: bool, diagonal: bool = False) -> torch.Tensor:
    """``rowsᵀ rows``; with ``with_ones`` as if a column of ones were appended (no copy);
    with ``diagonal`` only its diagonal ``Σ rows²``.

    Example:
        >>> row_gram(torch.tensor([[1.0, 2.0], [3.0, 4.0]]), True, diagonal=True)
        tensor([10., 20.,  2.])
    """
    if diagonal:
        sq = (rows * rows).sum(dim=-2)
        if not with_ones:
            return sq
        n = torch.full((*sq.shape[:-1], 1), rows.shape[-2], dtype=rows.dtype, device=rows.device)
        return torch.cat([sq, n], dim=-1)
    xx = rows.mT @ rows
    if not with_ones:
        return xx
    s = rows.sum(dim=-2)
    n = torch.full((*s.shape[:-1], 1), rows.shape[-2], dtype=rows.dtype, device=rows.device)
    top = torch.cat([xx, s.unsqueeze(-1)], dim=-1)
    bottom = torch.cat([s, n], dim=-1).unsqueeze(-2)
    return torch.cat([top, bottom], dim=-2)


class LayerBlock(ABC):
    """Everything K-FAC needs to know about one kind of layer (stateless; one instance per
    kind, registered with :func:`register_block`).

    Subclasses set :attr:`kind` and :attr:`module_types` and implement :meth:`spec`,
    :meth:`weight_shape`, :meth:`a_gram` and :meth:`g_gram`; the rest has defaults that
    fit layers whose weight is ``(out, in_per_group, *kernel)`` with an optional bias.
    """

    kind: ClassVar[str]
    """The name stored in :attr:`LayerSpec.kind` (and in checkpoints)."""

    module_types: tuple[type[nn.Module], ...] = ()
    """Module classes (and their subclasses) this kind handles."""

    has_rows: ClassVar[bool] = False
    """Whether :meth:`rows` exists: the gradient is ``Σ gᵀ[a, 1]`` over the calls' rows, so
    preconditioning may use the rows instead of the gradient matrix."""

    tensor_parallel: ClassVar[bool] = False
    """Whether inputs and output-gradients hold the features on their last dimension, so
    that Megatron-style column/row parallelism may split them there."""

    taps: ClassVar[bool] = False
    """Whether the layer's calls happen inside its module's forward, reported by
    :meth:`tap` (attention projections), instead of being the module's own calls."""

    reducible: ClassVar[bool] = False
    """Whether the kind offers ``kfac_approx="reduce"`` (Eschenhagen et al., 2023): the
    inputs averaged and the output-gradients summed over the positions that share the
    weight, one row per example (see :meth:`reduced`)."""

    model_parallel: ClassVar[bool] = True
    """Whether the model-parallel preconditioner supports the kind."""

    joint: ClassVar[bool] = False
    """Whether the statistics of a call need its input and its output-gradient together
    (:meth:`joint_grams`; norms: the scale's gradient is the normalised input times the
    output-gradient) instead of one from each (:meth:`a_gram`, :meth:`g_gram`)."""

    # --- registration --------------------------------------------------------------

    def matches(self, module: nn.Module) -> bool:
        """Whether this kind handles ``module``."""
        return isinstance(module, self.module_types)

    @abstractmethod
    def spec(self, name: str, module: nn.Module) -> LayerSpec | str:
        """The spec of ``module`` (registered as ``name``), or why it cannot be handled."""

    def specs(self, name: str, module: nn.Module) -> list[LayerSpec] | str:
        """Every layer ``module`` holds (one, but for modules made of several layers whose
        children are then not registered on their own), or why it cannot be handled."""
        spec = self.spec(name, module)
        return spec if isinstance(spec, str) else [spec]

    def tap(
        self,
        module: nn.Module,
        specs: Sequence[LayerSpec],
        site: Callable[[LayerSpec, torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> AbstractContextManager[None]:
        """While entered (around ``module``'s forward), report each call of the layers in
        ``specs`` as ``site(spec, input, output)``, whose result replaces the output (only
        if :attr:`taps`)."""
        raise NotImplementedError(f"layer kind {self.kind!r} has no taps")

    def capturing(self) -> AbstractContextManager[None]:
        """A context the capture of this kind's layers runs in (for kinds whose modules
        have fused fast paths that would hide the calls from :meth:`tap`)."""
        return contextlib.nullcontext()

    # --- shapes --------------------------------------------------------------------

    def a_dim(self, spec: LayerSpec) -> int:
        """Side of one A factor: inputs per group times the kernel area, plus the bias."""
        per_group = spec.in_dim // spec.groups
        for k in spec.kernel_size:
            per_group *= k
        return per_group + int(spec.has_bias)

    def g_dim(self, spec: LayerSpec) -> int:
        """Side of one G factor: outputs per group."""
        return spec.out_dim // spec.groups

    @abstractmethod
    def weight_shape(self, spec: LayerSpec) -> tuple[int, ...]:
        """Shape of the weight parameter."""

    def notes(self, spec: LayerSpec) -> list[str]:
        """What the layer table says about the layer besides its factor shapes."""
        notes = [f"{spec.groups} groups"] if spec.groups > 1 else []
        notes += [f"diagonal {w}" for w, d in zip("AG", spec.diagonal) if d]
        return notes + (["reduce"] if self.reduced(spec) else [])

    def reduced(self, spec: LayerSpec) -> bool:
        """Whether the layer uses ``kfac_approx="reduce"``."""
        return self.reducible and spec.option("kfac_approx") == "reduce"

    # --- statistics ----------------------------------------------------------------

    @abstractmethod
    def a_gram(self, spec: LayerSpec, x: torch.Tensor, dtype: torch.dtype) -> Gram:
        """Gram statistics of one call's input, bias column of ones included."""

    @abstractmethod
    def g_gram(self, spec: LayerSpec, r: torch.Tensor, dtype: torch.dtype) -> Gram:
        """Gram statistics of one call's raw output-gradient."""

    def joint_grams(
        self, spec: LayerSpec, x: torch.Tensor, r: torch.Tensor, dtype: torch.dtype
    ) -> tuple[Gram, Gram]:
        """The A and G statistics of one call from its input and raw output-gradient
        (only if :attr:`joint`)."""
        raise NotImplementedError(f"layer kind {self.kind!r} has separate statistics")

    def rows(
        self, spec: LayerSpec, inputs: Sequence[torch.Tensor], output_grads: Sequence[torch.Tensor]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``[(input rows, output-gradient rows)]`` of the calls (only if :attr:`has_rows`)."""
        raise NotImplementedError(f"layer kind {self.kind!r} has no rows")

    # --- gradient <-> matrix ---------------------------------------------------------

    def param_grads(
        self, spec: LayerSpec, grads: Mapping[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layer's ``(weight, bias)`` gradients from ``{param name: grad}``; errors name
        the layer, the missing keys and the shapes."""
        missing = [p for p in spec.param_names() if p not in grads]
        if missing:
            raise ValueError(f"layer {spec.name!r}: no gradient for {missing} in grads")
        w, b = grads[spec.weight], grads[spec.bias] if spec.bias else None
        self.check_grads(spec, w, b)
        return w, b

    def write_grads(
        self,
        spec: LayerSpec,
        out: MutableMapping[str, torch.Tensor],
        grads: Mapping[str, torch.Tensor],
        weight_grad: torch.Tensor,
        bias_grad: torch.Tensor | None,
    ) -> None:
        """Put the layer's new gradients into ``out`` (a copy of ``grads``), in the dtypes
        of ``grads``."""
        out[spec.weight] = weight_grad.to(grads[spec.weight].dtype)
        if spec.bias is not None and bias_grad is not None:
            out[spec.bias] = bias_grad.to(grads[spec.bias].dtype)

    def check_grads(
        self, spec: LayerSpec, weight_grad: torch.Tensor, bias_grad: torch.Tensor | None
    ) -> None:
        """Raise a ValueError naming the layer unless the gradients have its shapes."""
        if tuple(weight_grad.shape) != spec.weight_shape:
            raise shape_error(
                spec, "weight gradient", f"shape {spec.weight_shape}", weight_grad.shape
            )
        if spec.has_bias:
            if bias_grad is None:
                raise ValueError(f"layer {spec.name!r}: missing gradient for {spec.bias!r}")
            if tuple(bias_grad.shape) != (spec.out_dim,):
                raise shape_error(
                    spec, "bias gradient", f"shape ({spec.out_dim},)", bias_grad.shape
                )

    def to_matrix(
        self, spec: LayerSpec, weight_grad: torch.Tensor, bias_grad: torch.Tensor | None
    ) -> torch.Tensor:
        """The gradient matrix ``(*batch_shape, g_dim, a_dim)``; the bias is the last column."""
        m = weight_grad.reshape(*spec.batch_shape, spec.g_dim, -1)
        if bias_grad is not None and spec.has_bias:
            if spec.groups > 1:
                b = bias_grad.reshape(*spec.batch_shape, spec.g_dim, 1)
            else:
                b = bias_grad[:, None]
            m = torch.cat([m, b.to(m.dtype)], dim=-1)
        return m

    def from_matrix(
        self, spec: LayerSpec, m: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Inverse of :meth:`to_matrix`: ``(weight_grad, bias_grad or None)``."""
        if spec.has_bias:
            w, b = m[..., :-1], m[..., -1].reshape(spec.out_dim)
        else:
            w, b = m, None
        return w.reshape(spec.weight_shape), b


_BLOCKS: dict[str, LayerBlock] = {}

B = TypeVar("B", bound=type[LayerBlock])


def register_block(cls: B) -> B:
    """Class decorator: register one instance of ``cls`` under ``cls.kind``.

    Example:
        >>> {"linear", "conv2d", "embedding"} <= {b.kind for b in blocks()}
        True
    """
    kind = cls.kind
    if kind in _BLOCKS and type(_BLOCKS[kind]) is not cls:
        raise ValueError(f"layer kind {kind!r} is registered already ({type(_BLOCKS[kind])})")
    _BLOCKS[kind] = cls()
    return cls


def block_of(kind: str) -> LayerBlock:
    """The block registered for ``kind``; a ValueError lists the known kinds otherwise."""
    try:
        return _BLOCKS[kind]
    except KeyError:
        raise ValueError(f"unknown layer kind {kind!r}; registered: {sorted(_BLOCKS)}") from None


def blocks() -> tuple[LayerBlock, ...]:
    """Every registered block, in registration order."""
    return tuple(_BLOCKS.values())
