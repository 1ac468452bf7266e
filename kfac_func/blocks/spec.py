"""The static description of a registered layer and the statistics of one call.

A :class:`LayerSpec` is hashable data (it becomes metadata of the state pytree and is
written into checkpoints); its ``kind`` names the :class:`~kfac_func.blocks.base.LayerBlock`
that knows everything specific to that kind of layer. :class:`Gram` is what a block
computes from one call; :func:`row_gram`, :func:`shape_error` and :func:`cast` are shared by
the blocks.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Generic, NamedTuple, TypeVar, overload

import torch

from kfac_func.blocks.registry import block_of

if TYPE_CHECKING:
    from kfac_func.blocks.base import LayerBlock

__all__ = [
    "CheckedCall",
    "Gram",
    "LayerSpec",
    "Rows",
    "cast",
    "diagonal_blocks",
    "row_gram",
    "shape_error",
    "token_counts",
    "with_ones",
]

T = TypeVar("T")


class _once(Generic[T]):
    """A property computed once per instance, then kept in the instance's ``__dict__``
    (which shadows this non-data descriptor from then on). Unlike
    ``functools.cached_property`` it takes no lock, which ``torch.compile`` cannot trace;
    under compilation the value is computed and not kept."""

    def __init__(self, fn: Callable[[Any], T]) -> None:
        self.fn, self.name = fn, fn.__name__

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> _once[T]: ...
    @overload
    def __get__(self, obj: object, owner: type | None = None) -> T: ...
    def __get__(self, obj: object | None, owner: type | None = None) -> T | _once[T]:
        if obj is None:
            return self
        value = self.fn(obj)
        if not torch.compiler.is_compiling():
            obj.__dict__[self.name] = value
        return value


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
        a_blocks: the A factor as this many diagonal blocks of equal width
            (:attr:`a_block_width`, the last one padded with zero rows and columns where
            the width does not divide ``a_dim``), stored stacked: ``(k, w, w)`` instead of
            ``(a_dim, a_dim)``, as Distributed Shampoo blocks a wide side. 1: the whole
            factor. Only the one-sided orthogonalized step takes blocked factors (its G
            is diagonal; see :func:`kfac_func.step.orthogonal.orthogonal_table`).

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
    a_blocks: int = 1

    def __post_init__(self) -> None:
        k = self.a_blocks
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"layer {self.name!r}: a_blocks must be a positive int, got {k!r}")
        if k > 1 and (self.diagonal[0] or not self.diagonal[1]):
            raise ValueError(
                f"layer {self.name!r}: a blocked A factor (a_blocks={k}) needs a dense A and a "
                f"diagonal G, got diagonal={self.diagonal}"
            )

    def option(self, key: str, default: Any = None) -> Any:
        """The value of one of :attr:`options` (``default`` when absent)."""
        return self._options.get(key, default)

    # Derived values a step reads many times per layer are computed once per spec (kept
    # in the instance's __dict__, outside the fields: equality, hashing and the
    # checkpoint's description of the spec see the fields alone).

    @_once
    def _options(self) -> dict[str, Any]:
        return dict(self.options)

    def with_options(self, **changes: Any) -> LayerSpec:
        """A copy with ``changes`` set in :attr:`options` (kept sorted by name).

        Example:
            >>> LayerSpec("fc", "linear", "fc.weight", None, 3, 2).with_options(eps=0.5).options
            (('eps', 0.5),)
        """
        return replace(self, options=tuple(sorted({**dict(self.options), **changes}.items())))

    @property
    def module(self) -> str:
        """The name of the module whose calls feed the layer: the layer's own name, or the
        module it is a part of (the ``q_proj`` of a ``MultiheadAttention``)."""
        return str(self.option("module", self.name))

    @_once
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
    def placeholder(self) -> tuple[bool, bool]:
        """Whether the A and the G factor are placeholders: the identity by construction
        (a norm's ``A = 1``), which every method applies as the identity, undamped. A
        placeholder side is also :attr:`diagonal`.

        Example:
            >>> from torch import nn
            >>> from kfac_func.blocks import register
            >>> register(nn.Sequential(nn.LayerNorm(3)))["0"].placeholder
            (True, False)
        """
        return (self.block.placeholder_a, False)

    @_once
    def a_dim(self) -> int:
        """Side of one A factor (inputs per group, times the kernel area, plus 1 for bias)."""
        return self.block.a_dim(self)

    @_once
    def g_dim(self) -> int:
        """Side of one G factor: outputs per group."""
        return self.block.g_dim(self)

    @property
    def batch_shape(self) -> tuple[int, ...]:
        """Leading shape of factors and gradient matrices: ``()`` or ``(groups,)``."""
        return () if self.groups == 1 else (self.groups,)

    @property
    def a_block_width(self) -> int:
        """Width of one block of a blocked A factor (:attr:`a_blocks`; ``a_dim`` when 1).

        Example:
            >>> LayerSpec("fc", "linear", "fc.weight", "fc.bias", 768, 3, diagonal=(False, True),
            ...           a_blocks=2).a_block_width  # 769 inputs with the bias's column
            385
        """
        return -(-self.a_dim // self.a_blocks)

    @property
    def factor_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Shapes of the A and G factors (one dimension less for a diagonal one, one more
        for a blocked A: ``(a_blocks, w, w)``)."""
        b, a, g = self.batch_shape, self.a_dim, self.g_dim
        if self.a_diagonal:
            a_shape: tuple[int, ...] = (*b, a)
        elif self.a_blocks > 1:
            w = self.a_block_width
            a_shape = (*b, self.a_blocks, w, w)
        else:
            a_shape = (*b, a, a)
        g_shape = (*b, g) if self.g_diagonal else (*b, g, g)
        return a_shape, g_shape

    @property
    def matrix_shape(self) -> tuple[int, ...]:
        """Shape of the gradient matrix (bias as the last column)."""
        return (*self.batch_shape, self.g_dim, self.a_dim)

    @_once
    def weight_shape(self) -> tuple[int, ...]:
        """Shape of the module's weight parameter."""
        return self.block.weight_shape(self)

    def param_names(self) -> tuple[str, ...]:
        return (self.weight,) if self.bias is None else (self.weight, self.bias)


class CheckedCall(NamedTuple):
    """One call of a module whose output differs from its kind's (see
    :meth:`~kfac_func.blocks.base.LayerBlock.mismatch_hint`): the layer's parameters, the
    call's input, the module's output in float64 and the difference allowed."""

    params: Mapping[str, torch.Tensor]
    x: torch.Tensor
    got: torch.Tensor
    tol: float


class Gram(NamedTuple):
    """Unscaled statistics of one call: ``Σ rowsᵀrows`` (only its diagonal ``Σ rows²`` when
    ``diagonal``), its row count, rows per example that stem from space. Factors are scaled
    sums of these (see :mod:`kfac_func.core.conventions`). ``groups``, for statistics
    stacked by a group that each row is routed to (a mixture's experts), holds the rows of
    each group: the factor is then each group's mean over its own rows."""

    gram: torch.Tensor
    rows: int
    spatial: int
    diagonal: bool = False
    groups: torch.Tensor | None = None


def cast(
    t: torch.Tensor, dtype: torch.dtype | None = None, device: torch.device | None = None
) -> torch.Tensor:
    """``t`` in ``dtype`` on ``device`` (None: as it is): itself when it is already (a
    small step's many casts that change nothing cost a dispatch each otherwise).

    Example:
        >>> t = torch.ones(2)
        >>> cast(t, torch.float32) is t, cast(t, torch.float64).dtype
        (True, torch.float64)
        >>> cast(t, device=torch.device("cpu")) is t
        True
    """
    if (dtype is None or t.dtype == dtype) and (device is None or t.device == device):
        return t
    return t.to(device=device, dtype=dtype)


def shape_error(
    spec: LayerSpec, what: str, expected: str, shape: torch.Size | tuple[int, ...]
) -> ValueError:
    """A ValueError naming the layer, its kind, the tensor, and the shapes."""
    return ValueError(
        f"layer {spec.name!r} ({spec.kind}): {what} must have {expected}, got shape {tuple(shape)}"
    )


def token_counts(
    spec: LayerSpec, ids: torch.Tensor, vocab: int, dtype: torch.dtype
) -> torch.Tensor:
    """How often each of ``vocab`` token ids occurs in ``ids``: an embedding's A statistic,
    in ``dtype`` widened to at least float32 (counts are integers, which 16 bits would
    round above 256).

    Raises:
        ValueError: an id is negative or not below ``vocab`` (naming the layer).

    Example:
        >>> spec = LayerSpec("emb", "embedding", "emb.weight", None, 4, 2)
        >>> token_counts(spec, torch.tensor([[0, 3, 3]]), 4, torch.bfloat16)
        tensor([1., 0., 0., 2.])
    """
    try:
        counts = torch.bincount(ids.reshape(-1), minlength=vocab)
    except RuntimeError as err:  # negative indices
        raise ValueError(f"layer {spec.name!r} ({spec.kind}): {err}") from None
    if counts.shape[0] != vocab:
        raise ValueError(
            f"layer {spec.name!r} ({spec.kind}): token index {counts.shape[0] - 1} is out "
            f"of range for {vocab} embeddings"
        )
    return counts.to(torch.promote_types(dtype, torch.float32))


def with_ones(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` with a trailing column of ones (the bias's input)."""
    ones = torch.ones(*rows.shape[:-1], 1, dtype=rows.dtype, device=rows.device)
    return torch.cat([rows, ones], dim=-1)


def diagonal_blocks(m: torch.Tensor, blocks: int) -> torch.Tensor:
    """The ``blocks`` diagonal blocks of the square matrices ``m`` (last two dimensions,
    side ``n``), each ``w = ceil(n / blocks)`` wide, stacked: ``(..., blocks, w, w)``; the
    last block is padded with zero rows and columns where ``w`` does not divide ``n``.

    Example:
        >>> diagonal_blocks(torch.arange(9.0).reshape(3, 3), 2)
        tensor([[[0., 1.],
                 [3., 4.]],
        <BLANKLINE>
                [[8., 0.],
                 [0., 0.]]])
    """
    n = m.shape[-1]
    w = -(-n // blocks)
    if w * blocks != n:
        m = torch.nn.functional.pad(m, (0, w * blocks - n, 0, w * blocks - n))
    split = m.reshape(*m.shape[:-2], blocks, w, blocks, w)
    return torch.diagonal(split, dim1=-4, dim2=-2).movedim(-1, -3).contiguous()


# the column blocks of gram_of, and the least work (rows · width²) and width it pays at;
# 16-bit operands on AMX tiles: a least work of its own (benchmarks/gram_blocks.py)
_GRAM_BLOCKS = 4
_BLOCKED_WORK = 64 * 2**20
_BLOCKED_WORK_AMX_16 = 768 * 2**20
_BLOCKED_WIDTH = 256


def gram_of(rows: torch.Tensor) -> torch.Tensor:
    """``rowsᵀ rows`` over the last two dimensions. On a CPU, for products of at least
    :func:`blocked_work` multiply-adds (``rows.shape[-2]`` at least half the width, the
    width at least ``_BLOCKED_WIDTH``), only its upper block triangle is multiplied, in
    four column blocks: a symmetric rank-k product (BLAS ``syrk``) made of general
    products, five eighths of the multiply-adds; each block below the diagonal is the
    transpose of its mirror. Each entry is the same dot product over the rows either way
    (``benchmarks/gram_blocks.py`` times both).

    Example:
        >>> rows = torch.arange(6.0).reshape(3, 2)
        >>> gram_of(rows)
        tensor([[20., 26.],
                [26., 35.]])
    """
    return _block_triangle(rows) if _in_blocks(rows) else rows.mT @ rows


def blocked_work(dtype: torch.dtype) -> int:
    """The least multiply-adds of a CPU Gram product of ``dtype`` that :func:`gram_of`
    splits into blocks. A 16-bit product on a CPU with AMX tiles runs at several times
    float32's rate and pays a fixed cost per call (packing its operands into tiles):
    blocks pay there only from twelve times float32's threshold.

    Example:
        >>> blocked_work(torch.float32) == 64 * 2**20
        True
    """
    return _BLOCKED_WORK_AMX_16 if dtype.itemsize == 2 and _amx_tiles() else _BLOCKED_WORK


@functools.cache
def _amx_tiles() -> bool:
    """Whether this CPU multiplies on AMX tiles (False where torch cannot say)."""
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(probe()) if probe is not None else False


def _in_blocks(rows: torch.Tensor) -> bool:
    """Whether :func:`gram_of` multiplies ``rows``' upper block triangle (its threshold)."""
    n, d = rows.shape[-2], rows.shape[-1]
    wide = d >= _BLOCKED_WIDTH and 2 * n >= d and n * d * d >= blocked_work(rows.dtype)
    return wide and rows.device.type == "cpu"


def _block_triangle(rows: torch.Tensor) -> torch.Tensor:
    """``rowsᵀ rows`` from its diagonal and upper blocks (:data:`_GRAM_BLOCKS` column
    blocks), the lower blocks their mirrors' transposes, whatever the size."""
    d = rows.shape[-1]
    out = rows.new_empty(*rows.shape[:-2], d, d)
    step = -(-d // _GRAM_BLOCKS)
    for lo in range(0, d, step):
        hi = min(lo + step, d)
        band = rows[..., lo:hi].mT @ rows[..., lo:]  # block row: this block and the right
        out[..., lo:hi, lo:] = band
        out[..., hi:, lo:hi] = band[..., hi - lo :].mT
    return out


def _column_blocks(rows: torch.Tensor, with_ones: bool, blocks: int) -> torch.Tensor:
    """``rows`` (with a column of ones appended under ``with_ones``, zero columns padding
    the last block) as ``blocks`` stacked column blocks, ``(..., blocks, n, w)``: a
    strided view where nothing is appended or padded in a dtype of at least 32 bits,
    else one contiguous copy (16-bit products of strided blocks ran a tenth slower)."""
    n, d = rows.shape[-2], rows.shape[-1]
    width = d + int(with_ones)
    w = -(-width // blocks)
    if w * blocks == d and rows.dtype.itemsize >= 4:
        return rows.reshape(*rows.shape[:-1], blocks, w).movedim(-2, -3)
    out = rows.new_empty(*rows.shape[:-2], blocks, n, w)
    for b, lo in enumerate(range(0, w * blocks, w)):
        block, hi = out[..., b, :, :], min(lo + w, d)
        if hi > lo:
            block[..., : hi - lo].copy_(rows[..., lo:hi])
        if hi < lo + w:  # the ones column and the padding
            block[..., max(hi - lo, 0) :].zero_()
            if with_ones and lo <= d < lo + w:
                block[..., d - lo].fill_(1)
    return out


def row_gram(
    rows: torch.Tensor, with_ones: bool, diagonal: bool = False, blocks: int = 1
) -> torch.Tensor:
    """``rowsᵀ rows`` in at least float32 (a 16-bit product's result widened); with
    ``with_ones`` as if a column of ones were appended (no copy); with ``diagonal`` only
    its diagonal ``Σ rows²``; with ``blocks > 1`` only its diagonal blocks
    (:func:`diagonal_blocks`' shape and padding), each from its own columns: ``blocks``
    times fewer products than the whole Gram.

    Example:
        >>> row_gram(torch.tensor([[1.0, 2.0], [3.0, 4.0]]), True, diagonal=True)
        tensor([10., 20.,  2.])
        >>> row_gram(torch.tensor([[1.0, 2.0], [3.0, 4.0]]), True, blocks=2)
        tensor([[[10., 14.],
                 [14., 20.]],
        <BLANKLINE>
                [[ 2.,  0.],
                 [ 0.,  0.]]])
        >>> row_gram(torch.ones(2, 1, dtype=torch.bfloat16), True).dtype
        torch.float32
    """
    wide = torch.promote_types(rows.dtype, torch.float32)
    if blocks > 1:
        return gram_of(_column_blocks(rows, with_ones, blocks)).to(wide)
    d, batch = rows.shape[-1], rows.shape[:-2]
    if diagonal:
        sq = (rows * rows).sum(dim=-2).to(wide)  # (a float32 sum of 16-bit rows ran 2x slower)
        if not with_ones:
            return sq
        out = sq.new_empty(*batch, d + 1)
        out[..., :d] = sq
        out[..., d] = rows.shape[-2]
        return out
    if not with_ones:
        return cast(gram_of(rows), wide)
    if rows.dtype.itemsize >= 4 and d < _BLOCKED_WIDTH:
        # narrow rows of 32 bits or more: the ones column appended, one product (the
        # assembly below costs a handful of small operations more than it saves here)
        return gram_of(torch.nn.functional.pad(rows, (0, 1), value=1.0))
    xx = gram_of(rows)
    # the Gram with the ones column's row and column, assembled (and widened) in place
    # (a 16-bit product would round the count above 256, and a copy of wide rows costs)
    out = torch.empty(*batch, d + 1, d + 1, dtype=wide, device=rows.device)
    out[..., :d, :d] = xx
    s = rows.sum(dim=-2)
    out[..., :d, d] = s
    out[..., d, :d] = s
    out[..., d, d] = rows.shape[-2]
    return out
