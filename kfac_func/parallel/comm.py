"""Collectives of model-parallel K-FAC over the data- and model-parallel groups. No K-FAC math.

:class:`ParallelCommunicator` moves tensors for :mod:`kfac_func.parallel.preconditioner`:

- within this rank's model-parallel group: :meth:`~ParallelCommunicator.gather_shards`
  (shards of inputs, output-gradients or gradients, joined along a dimension on one rank)
  and :meth:`~ParallelCommunicator.scatter_shards` (the reverse: one rank splits full
  tensors and every rank receives its part; tensors that are not split are broadcast);
- within this rank's data-parallel group: :meth:`~ParallelCommunicator.reduce_data`
  (sums to one rank) and :meth:`~ParallelCommunicator.broadcast_data`;
- over all ranks: :meth:`~ParallelCommunicator.all_reduce_world` and
  :meth:`~ParallelCommunicator.all_gather_object`.

Each call packs its tensors into one flat buffer (one collective per call). Group
positions (``dst``, ``src``) are ranks *within* the group. Without a process group every
group has one rank and every call is local.

Three functions with the names and arguments of kfac-pytorch's ``kfac.gpt_neox.mpu``, for
code written against it: :func:`gather_from_model_parallel_region` (a gather of the
model-parallel shards to one rank, ``dst`` a global rank; not Megatron's all-gather of
the same name, which is :func:`kfac_func.parallel.layers.gather_from_model_parallel_region`),
:func:`split_tensor_along_dim` and :func:`get_group_with_rank`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "ParallelCommunicator",
    "gather_from_model_parallel_region",
    "get_group_with_rank",
    "split_tensor_along_dim",
]

Group = Any  # dist.ProcessGroup | None


def _flat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) != 1:
        raise ValueError(f"one collective cannot carry mixed dtypes {sorted(map(str, dtypes))}")
    return torch.cat([t.reshape(-1) for t in tensors])


def _unflat(buf: torch.Tensor, shapes: Sequence[torch.Size]) -> list[torch.Tensor]:
    out, offset = [], 0
    for shape in shapes:
        n = math.prod(shape)
        out.append(buf[offset : offset + n].reshape(shape).clone())
        offset += n
    return out


def get_group_with_rank(rank: int, groups: Sequence[Sequence[int]]) -> list[int]:
    """The first of ``groups`` (lists of global ranks) that holds ``rank``.

    DeepSpeed's topologies list a parallel axis's groups this way
    (``topology.get_axis_comm_lists("model")``). A ValueError names the rank when no
    group holds it.

    Example:
        >>> get_group_with_rank(4, [[0, 1, 2, 3], [2, 3, 4]])
        [2, 3, 4]
        >>> get_group_with_rank(-1, [[0], [1]])
        Traceback (most recent call last):
        ...
        ValueError: Rank -1 was not in any of the groups [[0], [1]].
    """
    for group in groups:
        if rank in group:
            return list(group)
    raise ValueError(f"Rank {rank} was not in any of the groups {[list(g) for g in groups]}.")


def split_tensor_along_dim(
    tensor: torch.Tensor,
    num_partitions: int,
    dim: int,
    contiguous_split_chunks: bool = False,
) -> tuple[torch.Tensor, ...]:
    """``tensor`` cut into ``num_partitions`` equal parts along ``dim`` (views, unless
    ``contiguous_split_chunks``), in model-parallel rank order.

    A ValueError names the dimension and its size when it does not divide evenly (where
    ``torch.chunk`` would return parts of unequal sizes).

    Example:
        >>> parts = split_tensor_along_dim(torch.arange(12).reshape(2, 6), 3, dim=-1)
        >>> [tuple(p.shape) for p in parts], parts[1].tolist()
        ([(2, 2), (2, 2), (2, 2)], [[2, 3], [8, 9]])
        >>> split_tensor_along_dim(torch.zeros(2, 11), 2, dim=-1)
        Traceback (most recent call last):
        ...
        ValueError: Tensor dim -1 (size=11) is not divisible into 2 parts.
    """
    if (
        isinstance(num_partitions, bool)
        or not isinstance(num_partitions, int)
        or num_partitions < 1
    ):
        raise ValueError(f"num_partitions must be a positive int, got {num_partitions!r}")
    size = tensor.shape[dim]
    if size % num_partitions:
        raise ValueError(
            f"Tensor dim {dim} (size={size}) is not divisible into {num_partitions} parts."
        )
    parts = torch.split(tensor, size // num_partitions, dim=dim)
    if contiguous_split_chunks:
        return tuple(p.contiguous() for p in parts)
    return tuple(parts)


def gather_from_model_parallel_region(
    tensor: torch.Tensor,
    dst: int,
    model_parallel_group: Group,
    fp32_allreduce: bool = False,
    dim: int = -1,
) -> torch.Tensor | None:
    """The shards of the model-parallel ranks joined along ``dim`` on the global rank
    ``dst``; None on the group's other ranks.

    Every rank of ``model_parallel_group`` calls it with a tensor of the same shape and
    dtype; the shards are joined in group order (rank ``i``'s shard is the ``i``-th part,
    as :func:`split_tensor_along_dim` cuts them). ``model_parallel_group`` None (or a
    group of one rank) means no model parallelism: ``tensor`` itself comes back.
    ``fp32_allreduce`` sends a bfloat16 tensor as float32 and returns bfloat16 (as
    Megatron's option of that name). A ``dst`` outside the group is a ValueError on every
    rank (before any communication). No autograd: this is kfac-pytorch's gather to one
    rank, not Megatron's differentiable all-gather.

    Example:
        >>> gather_from_model_parallel_region(torch.ones(2, 3), dst=0, model_parallel_group=None)
        tensor([[1., 1., 1.],
                [1., 1., 1.]])
    """
    if model_parallel_group is None or not (dist.is_available() and dist.is_initialized()):
        return tensor
    ranks = dist.get_process_group_ranks(model_parallel_group)
    if len(ranks) == 1:
        return tensor
    if dst not in ranks:
        raise ValueError(
            f"dst={dst} is not a rank of the model-parallel group {ranks} "
            f"(rank {dist.get_rank()}); dst is a global rank"
        )
    dtype = tensor.dtype
    sent = tensor.float() if fp32_allreduce and dtype == torch.bfloat16 else tensor
    sent = sent.contiguous()
    mine = dist.get_rank() == dst
    parts = [torch.empty_like(sent) for _ in ranks] if mine else None
    dist.gather(sent, parts, dst=dst, group=model_parallel_group)
    if parts is None:
        return None
    return torch.cat(parts, dim=dim).to(dtype)


class ParallelCommunicator:
    """This rank's data-parallel and model-parallel groups, and a group of every rank.

    All ranks must construct it at the same point (it creates the all-ranks group once).
    A group given as None means no such parallelism (a group of this rank alone).

    Example:
        >>> comm = ParallelCommunicator()  # no process group: groups of one
        >>> comm.gather_shards([torch.ones(2, 3)], dims=[0], dst=0)[0].shape
        torch.Size([2, 3])
    """

    def __init__(self, data_parallel_group: Group = None, model_parallel_group: Group = None):
        self.active = dist.is_available() and dist.is_initialized()
        self.dp_group = data_parallel_group
        self.mp_group = model_parallel_group
        self.world_group: Group = None
        if self.active:
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
            if self.world_size > 1:
                # K-FAC's world-wide collectives get a group of their own
                self.world_group = dist.new_group(list(range(self.world_size)))
        else:
            self.rank, self.world_size = 0, 1
        self.dp_ranks = self._ranks(data_parallel_group)
        self.mp_ranks = self._ranks(model_parallel_group)
        self.dp_size, self.mp_size = len(self.dp_ranks), len(self.mp_ranks)
        self.dp_rank = self.dp_ranks.index(self.rank)
        self.mp_rank = self.mp_ranks.index(self.rank)

    def _ranks(self, group: Group) -> tuple[int, ...]:
        """Global ranks of ``group`` in group order; None: this rank alone."""
        if group is None or not self.active:
            return (self.rank,)
        return tuple(dist.get_process_group_ranks(group))

    # --- model-parallel group --------------------------------------------------

    def gather_shards(
        self, tensors: Sequence[torch.Tensor], *, dims: Sequence[int], dst: int
    ) -> list[torch.Tensor] | None:
        """Join each tensor's shards of the model-parallel ranks along ``dims[i]`` on ``dst``.

        Every rank passes tensors of the same shapes; ``dst`` (a position in the group)
        gets the joined tensors in group order, the others None.
        """
        if self.mp_size == 1:
            return [t.clone() for t in tensors] if self.mp_rank == dst else None
        buf = _flat(tensors)
        parts = (
            [torch.empty_like(buf) for _ in range(self.mp_size)] if self.mp_rank == dst else None
        )
        dist.gather(buf, parts, dst=self.mp_ranks[dst], group=self.mp_group)
        if parts is None:
            return None
        shapes = [t.shape for t in tensors]
        per_rank = [_unflat(p, shapes) for p in parts]
        return [torch.cat([pieces[i] for pieces in per_rank], dim=d) for i, d in enumerate(dims)]

    def scatter_shards(
        self,
        full: Sequence[torch.Tensor] | None,
        like: Sequence[torch.Tensor],
        *,
        dims: Sequence[int | None],
        src: int,
    ) -> list[torch.Tensor]:
        """Every model-parallel rank receives its part of ``src``'s ``full`` tensors.

        ``dims[i]`` is the dimension tensor ``i`` is split along (equal parts, in group
        order), or None for a tensor every rank receives whole. ``like`` are this rank's
        tensors of the received shapes and dtype (on ``src``, ``full`` must be given).
        """
        if self.mp_rank == src:
            if full is None:
                raise ValueError("the source rank must give the full tensors")
            split = [
                None if d is None else split_tensor_along_dim(t, self.mp_size, d)
                for t, d in zip(full, dims)
            ]
            parts_per_rank = [
                [t if p is None else p[r] for t, p in zip(full, split)] for r in range(self.mp_size)
            ]
            if self.mp_size == 1:
                return [p.clone() for p in parts_per_rank[0]]
            bufs = [_flat(parts) for parts in parts_per_rank]
            out = torch.empty_like(bufs[0])
            dist.scatter(out, bufs, src=self.mp_ranks[src], group=self.mp_group)
        else:
            out = torch.empty(
                sum(t.numel() for t in like), dtype=like[0].dtype, device=like[0].device
            )
            dist.scatter(out, None, src=self.mp_ranks[src], group=self.mp_group)
        return _unflat(out, [t.shape for t in like])

    # --- data-parallel group ---------------------------------------------------

    def reduce_data(self, tensors: Sequence[torch.Tensor], *, dst: int) -> list[torch.Tensor]:
        """Sums over the data-parallel ranks on ``dst``; other ranks get their inputs back."""
        return self._over_data(dist.reduce, tensors, dst, root_receives=True)

    def broadcast_data(self, tensors: Sequence[torch.Tensor], *, src: int) -> list[torch.Tensor]:
        """``src``'s tensors on every data-parallel rank (others pass buffers of the shapes)."""
        return self._over_data(dist.broadcast, tensors, src, root_receives=False)

    def _over_data(
        self, op: Any, tensors: Sequence[torch.Tensor], root: int, *, root_receives: bool
    ) -> list[torch.Tensor]:
        """``op`` (``dist.reduce`` or ``dist.broadcast``) of the packed ``tensors`` over the
        data-parallel group, rooted at its position ``root``: the receiving ranks (``root``
        if ``root_receives``, else the others) get the results, the rest their inputs."""
        if self.dp_size == 1:
            return list(tensors)
        buf = _flat(tensors)
        op(buf, self.dp_ranks[root], group=self.dp_group)
        if (self.dp_rank == root) != root_receives:
            return list(tensors)
        return _unflat(buf, [t.shape for t in tensors])

    # --- every rank ------------------------------------------------------------

    def all_reduce_world(self, t: torch.Tensor) -> torch.Tensor:
        """Sum of ``t`` over every rank."""
        if self.world_size == 1:
            return t
        out = t.clone()
        dist.all_reduce(out, group=self.world_group)
        return out

    def all_gather_object(self, obj: Any) -> list[Any]:
        """``obj`` of every rank, in rank order."""
        if self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.world_group)
        return out
