"""Minimal Megatron-style tensor-parallel linear layers over ``torch.distributed``.

Two layers split one ``nn.Linear`` over the ranks of a model-parallel process group:

- :class:`ColumnParallelLinear` splits the weight on the output dimension: rank ``i``
  holds rows ``i·out/p … (i+1)·out/p`` of the weight and the same slice of the bias. The
  input is the full (replicated) tensor; the output is the local slice, or, with
  ``gather_output=True``, the full output gathered from every rank.
- :class:`RowParallelLinear` splits the weight on the input dimension: rank ``i`` holds
  columns ``i·in/p … (i+1)·in/p``. The input is the local slice of the features
  (``input_is_parallel=True``, typically the output of a column-parallel layer) or the
  full input that the layer slices itself; the partial products are summed over the
  ranks (an all-reduce) and the full bias, held by every rank, is added after the sum.

The communication lives in one autograd function, run as four pairs of a forward and its
adjoint: copy (identity forward, all-reduce backward), reduce (all-reduce forward, identity
backward), scatter (take the local slice of the last dimension forward, all-gather
backward) and gather (all-gather forward, take the local slice backward). Without an initialised
process group (or with ``group`` of one rank) the layers are plain linears.

This module holds no K-FAC code; :mod:`kfac_func.parallel.preconditioner` recognises these layers
(and Megatron's or GPT-NeoX's layers of the same class names) by class name.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "copy_to_model_parallel_region",
    "gather_from_model_parallel_region",
    "reduce_from_model_parallel_region",
    "scatter_to_model_parallel_region",
]

Group = Any  # dist.ProcessGroup | None (None: the default group)


def _size(group: Group) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def _rank(group: Group) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    return dist.get_rank(group)


def _all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    if _size(group) == 1:
        return x
    out = x.clone()
    dist.all_reduce(out, group=group)
    return out


def _split_last(x: torch.Tensor, group: Group) -> torch.Tensor:
    n = _size(group)
    if n == 1:
        return x
    if x.shape[-1] % n:
        raise ValueError(f"last dimension {x.shape[-1]} does not split into {n} equal parts")
    return x.chunk(n, dim=-1)[_rank(group)].contiguous()


def _gather_last(x: torch.Tensor, group: Group) -> torch.Tensor:
    n = _size(group)
    if n == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def _same(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x


_Move = Callable[[torch.Tensor, Group], torch.Tensor]


class _Region(torch.autograd.Function):
    """``fwd(x, group)`` forward and ``bwd(grad, group)`` backward (its adjoint)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, fwd: _Move, bwd: _Move) -> torch.Tensor:
        ctx.group, ctx.bwd = group, bwd
        return fwd(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return ctx.bwd(grad, ctx.group), None, None, None


_region: Callable[[torch.Tensor, Group, _Move, _Move], torch.Tensor] = _Region.apply


def copy_to_model_parallel_region(x: torch.Tensor, group: Group = None) -> torch.Tensor:
    """Identity forward; the backward all-reduces the gradient over ``group``."""
    return _region(x, group, _same, _all_reduce)


def reduce_from_model_parallel_region(x: torch.Tensor, group: Group = None) -> torch.Tensor:
    """All-reduce (sum) over ``group`` forward; identity backward."""
    return _region(x, group, _all_reduce, _same)


def scatter_to_model_parallel_region(x: torch.Tensor, group: Group = None) -> torch.Tensor:
    """This rank's slice of the last dimension forward; all-gather backward."""
    return _region(x, group, _split_last, _gather_last)


def gather_from_model_parallel_region(x: torch.Tensor, group: Group = None) -> torch.Tensor:
    """All-gather along the last dimension forward; this rank's slice backward."""
    return _region(x, group, _gather_last, _split_last)


def _full_init(
    out_features: int, in_features: int, bias: bool, dtype: torch.dtype | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``nn.Linear``'s default initialisation of the full weight and bias (the RNG must be
    in the same state on every rank of the group, so that the shards fit together)."""
    w = torch.empty(out_features, in_features, dtype=dtype)
    nn.init.kaiming_uniform_(w, a=math.sqrt(5))
    b = None
    if bias:
        bound = 1 / math.sqrt(in_features) if in_features > 0 else 0.0
        b = torch.empty(out_features, dtype=dtype).uniform_(-bound, bound)
    return w, b


_L = TypeVar("_L", bound="_SplitLinear")


class _SplitLinear(nn.Module):
    """What the two layers share: the sizes of the full layer, this rank's part of its
    weight (split on dimension :attr:`split_dim`) and bias, drawn as ``nn.Linear`` draws
    the full layer or copied from one (:meth:`from_dense`)."""

    split_dim: ClassVar[int]  # 0: the outputs (column-parallel); 1: the inputs (row)
    flag: ClassVar[str]  # the layer's own flag, shown by extra_repr
    bias: nn.Parameter | None

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool,
        *,
        skip_bias_add: bool,
        group: Group,
        dtype: torch.dtype | None,
    ) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.skip_bias_add = skip_bias_add
        self.group = group
        what = ("output_size", "input_size")[self.split_dim]
        total, n = (output_size, input_size)[self.split_dim], _size(group)
        if total % n:
            raise ValueError(f"{what}={total} is not divisible by the model-parallel size {n}")
        w, b = self._part(*_full_init(output_size, input_size, bias, dtype))
        self.weight = nn.Parameter(w.clone())
        self.bias = nn.Parameter(b.clone()) if b is not None else None

    def _part(
        self, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This rank's part of the full layer's ``weight`` and ``bias`` (a column-parallel
        bias is split like the weight's rows; a row-parallel one is whole)."""
        n = weight.shape[self.split_dim] // _size(self.group)
        start = _rank(self.group) * n
        if bias is not None and self.split_dim == 0:
            bias = bias.narrow(0, start, n)
        return weight.narrow(self.split_dim, start, n), bias

    @classmethod
    def from_dense(cls: type[_L], linear: nn.Linear, **options: Any) -> _L:
        """This rank's part of ``linear`` (the same values, split as the class splits),
        built with the constructor's keyword ``options`` (``gather_output=`` or
        ``input_is_parallel=``, ``skip_bias_add=``, ``group=``).

        Example:
            >>> import torch
            >>> dense = torch.nn.Linear(4, 6)
            >>> part = ColumnParallelLinear.from_dense(dense, gather_output=False)
            >>> torch.equal(part.weight, dense.weight)  # one process: the whole layer
            True
        """
        layer = cls(
            linear.in_features,
            linear.out_features,
            linear.bias is not None,
            dtype=linear.weight.dtype,
            **options,
        )
        weight, bias = layer._part(linear.weight, linear.bias)
        with torch.no_grad():
            layer.weight.copy_(weight)
            if layer.bias is not None and bias is not None:
                layer.bias.copy_(bias)
        return layer

    def extra_repr(self) -> str:
        return (
            f"input_size={self.input_size}, output_size={self.output_size}, "
            f"per_partition={self.weight.shape[self.split_dim]}, "
            f"bias={self.bias is not None}, {self.flag}={getattr(self, self.flag)}"
        )


class ColumnParallelLinear(_SplitLinear):
    """``y = x Wᵀ + b`` with ``W`` split on the output dimension over ``group``.

    Args:
        input_size, output_size: features of the full layer.
        bias: whether the layer has a bias (split like the weight's rows).
        gather_output: return the full output (all-gathered) instead of this rank's slice.
        skip_bias_add: do not add the bias; return ``(output, bias)`` as Megatron does, for
            a caller that fuses the addition.
        group: the model-parallel process group (None: the default group).
        dtype: parameter dtype.

    Without ``skip_bias_add`` the layer returns the output tensor, so it composes in
    ``nn.Sequential``. The full weight is drawn as ``nn.Linear`` draws it and sliced, so
    every rank must be in the same RNG state; :meth:`from_dense` slices a given layer.

    Example:
        >>> import torch
        >>> layer = ColumnParallelLinear(4, 6)  # no process group: one part
        >>> layer(torch.randn(2, 4)).shape
        torch.Size([2, 6])
    """

    split_dim = 0
    flag = "gather_output"

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        *,
        gather_output: bool = True,
        skip_bias_add: bool = False,
        group: Group = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(
            input_size, output_size, bias, skip_bias_add=skip_bias_add, group=group, dtype=dtype
        )
        self.gather_output = gather_output
        self.output_size_per_partition = int(self.weight.shape[0])

    def forward(self, x: torch.Tensor) -> Any:
        x = copy_to_model_parallel_region(x, self.group)
        bias = None if self.skip_bias_add else self.bias
        out = F.linear(x, self.weight, bias)
        if self.gather_output:
            if self.skip_bias_add and self.bias is not None:
                raise ValueError("skip_bias_add with gather_output would return a split bias")
            out = gather_from_model_parallel_region(out, self.group)
        if self.skip_bias_add:
            return out, self.bias
        return out


class RowParallelLinear(_SplitLinear):
    """``y = Σ_ranks x_i W_iᵀ + b`` with ``W`` split on the input dimension over ``group``.

    Args:
        input_size, output_size: features of the full layer.
        bias: whether the layer has a bias (full size on every rank, added after the sum).
        input_is_parallel: the input is already this rank's slice of the features;
            otherwise the layer takes its slice of the full input.
        skip_bias_add: do not add the bias; return ``(output, bias)`` as Megatron does.
        group: the model-parallel process group (None: the default group).
        dtype: parameter dtype.

    Example:
        >>> import torch
        >>> layer = RowParallelLinear(6, 3)
        >>> layer(torch.randn(2, 6)).shape
        torch.Size([2, 3])
    """

    split_dim = 1
    flag = "input_is_parallel"

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        *,
        input_is_parallel: bool = False,
        skip_bias_add: bool = False,
        group: Group = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(
            input_size, output_size, bias, skip_bias_add=skip_bias_add, group=group, dtype=dtype
        )
        self.input_is_parallel = input_is_parallel
        self.input_size_per_partition = int(self.weight.shape[1])

    def forward(self, x: torch.Tensor) -> Any:
        if not self.input_is_parallel:
            x = scatter_to_model_parallel_region(x, self.group)
        out = reduce_from_model_parallel_region(F.linear(x, self.weight), self.group)
        if self.skip_bias_add:
            return out, self.bias
        return out + self.bias if self.bias is not None else out
