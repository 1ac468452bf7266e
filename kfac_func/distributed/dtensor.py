"""DTensor gradients and captures (FSDP2, HSDP, tensor parallelism): layouts and movement.

No K-FAC math here: this module says where each rank's shard of a DTensor lies in the
whole tensor (:func:`layout_of`), gathers a layer's whole gradients onto the ranks that
precondition it (:func:`gather_whole`) and sends every rank its part of the result back
(:func:`scatter_parts`); it also turns a hook's captured DTensor input or sharded
output-gradient into the whole tensor (:func:`whole_input`, :func:`whole_output_grad`).

Supported placements of a gradient: ``Shard(d)`` and ``Replicate()`` on any mesh
dimension (``torch.chunk`` sizes, as DTensor and FSDP2 use them), and FSDP2's
``_StridedShard(d)`` over the shards of a later mesh dimension of the same tensor dimension
(FSDP over tensor parallelism). ``Partial`` placements (gradients not yet reduced) and
local shapes that differ from those sizes (custom uneven layouts) are refused with an error
that names the layer and the placement.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from kfac_func.blocks import LayerSpec
from kfac_func.distributed.communicator import Communicator

try:  # torch.distributed.tensor is part of torch >= 2.4
    from torch.distributed.tensor import DTensor, Shard
except ImportError:  # pragma: no cover - an older torch: no DTensor gradients to handle
    DTensor = None  # type: ignore[assignment,misc]
    Shard = None  # type: ignore[assignment,misc]

__all__ = [
    "Layout",
    "check_packed_parameters",
    "describe_parameters",
    "gather_whole",
    "has_dtensors",
    "is_dtensor",
    "layout_of",
    "scatter_parts",
    "whole_input",
    "whole_output_grad",
]

Box = tuple[tuple[int, int], ...]


def is_dtensor(t: object) -> bool:
    """Whether ``t`` is a DTensor (a parameter or gradient of FSDP2 or tensor parallelism)."""
    return DTensor is not None and isinstance(t, DTensor)


def has_dtensors(tensors: Mapping[str, Any]) -> bool:
    """Whether any value of ``tensors`` is a DTensor."""
    return any(is_dtensor(t) for t in tensors.values())


@dataclass(frozen=True)
class Layout:
    """Where each rank's local part of a tensor lies in the whole tensor.

    Attributes:
        shape: the whole tensor's shape.
        boxes: ``{global rank: ((start, stop) per tensor dimension)}``; a replicated
            (plain) tensor gives every rank the whole box.
        sharded: whether the parts differ between ranks (False: every rank holds, or
            gathers within its own mesh, the whole tensor).
        own: for a DTensor on a mesh of some of the ranks (as FSDP's mesh of the
            data-parallel ranks under tensor parallelism), this rank's part: the whole
            is gathered within that mesh and travels as a replicated tensor.
    """

    shape: tuple[int, ...]
    boxes: dict[int, Box]
    sharded: bool
    own: Box | None = None

    def numel(self, rank: int) -> int:
        """Elements of ``rank``'s part."""
        return math.prod(b - a for a, b in self.boxes[rank])

    def largest(self) -> int:
        """Elements of the largest part (the padded size of one rank's piece)."""
        return max(self.numel(r) for r in self.boxes)

    def part(self, whole: torch.Tensor, rank: int) -> torch.Tensor:
        """``rank``'s part of the whole tensor (a view)."""
        return whole[tuple(slice(a, b) for a, b in self.boxes[rank])]


def _placement_error(name: str, pname: str, placements: Sequence[Any], why: str) -> ValueError:
    return ValueError(
        f"layer {name!r}: the gradient of {pname!r} has placements {tuple(placements)}, "
        f"which K-FAC does not support: {why}"
    )


def layout_of(t: torch.Tensor, world_size: int, *, name: str, pname: str) -> Layout:
    """The :class:`Layout` of a gradient (a DTensor, or a plain tensor every rank holds).

    Raises a ValueError naming the layer, the parameter and the placement for a ``Partial``
    placement, a mesh that does not hold every rank, a strided shard that is not FSDP2's
    over tensor parallelism, or a local shape that is not ``torch.chunk``'s (an uneven
    custom layout).
    """
    if not is_dtensor(t):
        whole = tuple((0, n) for n in t.shape)
        return Layout(tuple(t.shape), {r: whole for r in range(world_size)}, False)
    dt = _any(t)
    mesh, placements = dt.device_mesh, tuple(dt.placements)
    shape = tuple(int(n) for n in t.shape)
    ranks = mesh.mesh
    sizes = tuple(int(s) for s in ranks.shape)
    strided = [i for i, p in enumerate(placements) if type(p).__name__ == "_StridedShard"]
    for i, p in enumerate(placements):
        if p.is_partial():
            raise _placement_error(name, pname, placements, "partial sums (reduce them first)")
        if not (p.is_shard() or p.is_replicate() or i in strided):
            raise _placement_error(name, pname, placements, f"unknown placement {p!r}")
    for i in strided:
        p = placements[i]
        later = [
            sizes[j]
            for j in range(i + 1, len(placements))
            if j not in strided
            and placements[j].is_shard()
            and _dim(placements[j], shape) == _dim(p, shape)
        ]
        if int(p.split_factor) != math.prod(later) or not later:
            raise _placement_error(
                name,
                pname,
                placements,
                f"a strided shard of split factor {p.split_factor} over later shards of "
                f"sizes {later} (only FSDP2 over tensor parallelism is supported)",
            )
    # strided shards split the parts of the later mesh dimensions: apply those first
    order = [i for i in range(len(placements)) if i not in strided] + strided
    boxes: dict[int, Box] = {}
    for coord in itertools.product(*(range(s) for s in sizes)):
        box = [[0, n] for n in shape]
        for i in order:
            p = placements[i]
            if p.is_replicate():
                continue
            d = _dim(p, shape)
            lo, hi = box[d]
            chunk = -(-(hi - lo) // sizes[i])
            start = min(coord[i] * chunk, hi - lo)
            box[d] = [lo + start, lo + min(start + chunk, hi - lo)]
        boxes[int(ranks[coord])] = tuple((a, b) for a, b in box)
    whole = tuple((0, n) for n in shape)
    layout = Layout(shape, boxes, any(b != whole for b in boxes.values()))
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank not in boxes:  # pragma: no cover - a DTensor's mesh holds its own rank
        raise _placement_error(name, pname, placements, f"rank {rank} is not in its mesh")
    if sorted(boxes) != list(range(world_size)):  # a mesh of some of the ranks
        everyone = {r: whole for r in range(world_size)}
        layout = Layout(shape, everyone, False, own=boxes[rank] if layout.sharded else None)
    expected = tuple(b - a for a, b in boxes[rank])
    local = tuple(dt.to_local().shape)
    if local != expected:
        raise _placement_error(
            name,
            pname,
            placements,
            f"rank {rank} holds a local shard of shape {local}, while torch.chunk's layout "
            f"of {shape} gives {expected} (an uneven custom layout)",
        )
    return layout


def _dim(p: Any, shape: tuple[int, ...]) -> int:
    return int(p.dim) % len(shape)


def _local(t: torch.Tensor) -> torch.Tensor:
    return _any(t).to_local() if is_dtensor(t) else t


def _pack(pieces: Sequence[torch.Tensor], sizes: Sequence[int]) -> torch.Tensor:
    """Flatten and pad each piece to ``sizes[i]`` elements, then join them."""
    flat = []
    for t, n in zip(pieces, sizes):
        f = t.reshape(-1)
        if f.numel() < n:
            f = torch.cat([f, f.new_zeros(n - f.numel())])
        flat.append(f)
    return torch.cat(flat)


def gather_whole(
    grads: Sequence[torch.Tensor],
    layouts: Sequence[Layout],
    workers: Sequence[int],
    comm: Communicator,
) -> list[torch.Tensor] | None:
    """The whole tensors of ``grads`` (one layer's parameters) on each rank of
    ``workers``; None elsewhere. Every rank calls it with its local shards.

    One all-gather when every rank is a worker, else one gather to each worker (the
    pieces padded to the largest part, as gloo gathers equal sizes). Plain (replicated)
    tensors do not travel: each worker uses its own.
    """
    rank, n = comm.rank, comm.world_size
    wanted = rank in workers
    grads = [_within_mesh(g, lay, comm) for g, lay in zip(grads, layouts)]
    moved = [i for i, lay in enumerate(layouts) if lay.sharded and n > 1]
    received: torch.Tensor | None = None
    if moved:
        sizes = [layouts[i].largest() for i in moved]
        buf = _pack([_local(grads[i]) for i in moved], sizes)
        group = comm.world_group
        nbytes = buf.numel() * buf.element_size()
        if len(workers) == n:
            parts = [torch.empty_like(buf) for _ in range(n)]
            dist.all_gather(parts, buf, group=group)
            comm.bytes["gradient shards (all-gather)"] += (n - 1) * nbytes
            comm.calls["gradient shards (all-gather)"] += 1
            received = torch.stack(parts) if wanted else None
        else:
            for dst in workers:
                parts_or_none = [torch.empty_like(buf) for _ in range(n)] if rank == dst else None
                dist.gather(buf, parts_or_none, dst=dst, group=group)
                comm.bytes["gradient shards (gather)"] += (n - 1) * nbytes // n
                comm.calls["gradient shards (gather)"] += 1
                if parts_or_none is not None:
                    received = torch.stack(parts_or_none)
    if not wanted:
        return None
    out = []
    offsets = dict(zip(moved, itertools.accumulate([0, *[layouts[i].largest() for i in moved]])))
    for i, (g, lay) in enumerate(zip(grads, layouts)):
        if i not in offsets or received is None:
            out.append(
                _local(g).clone() if not lay.sharded else _local(g).reshape(lay.shape).clone()
            )
            continue
        whole = torch.empty(lay.shape, dtype=g.dtype, device=_local(g).device)
        start = offsets[i]
        for r, box in lay.boxes.items():
            size = lay.numel(r)
            if size:
                whole[tuple(slice(a, b) for a, b in box)] = received[
                    r, start : start + size
                ].reshape([b - a for a, b in box])
        out.append(whole)
    return out


def _within_mesh(g: torch.Tensor, lay: Layout, comm: Communicator) -> torch.Tensor:
    """A gradient on a mesh of some of the ranks, gathered within that mesh (a collective
    of the mesh's ranks); other gradients as they are."""
    if lay.own is None:
        return g
    local, d = _local(g), _any(g)
    m = d.device_mesh.size()
    kind = "gradient shards (mesh all-gather)"
    comm.bytes[kind] += (m - 1) * local.numel() * local.element_size()
    comm.calls[kind] += 1
    return _full(d)


def _any(t: object) -> Any:
    """A DTensor, typed for its own attributes."""
    return t


def scatter_parts(
    whole: Sequence[torch.Tensor] | None,
    grads: Sequence[torch.Tensor],
    layouts: Sequence[Layout],
    src: int,
    ranks: tuple[int, ...],
    comm: Communicator,
) -> list[torch.Tensor]:
    """This rank's parts of ``src``'s ``whole`` tensors, for every rank of ``ranks``.

    ``src`` (a member of ``ranks``) gives the whole tensors, the others None; every rank
    of ``ranks`` calls it with its own ``grads`` (their local shards give the received
    shapes and dtypes). Returns this rank's new local tensors (plain tensors in the order
    of ``grads``). One scatter over ``ranks``, local slicing when ``ranks`` is this rank.
    """
    rank = comm.rank
    if len(ranks) == 1:
        assert whole is not None and rank == src
        return [lay.part(w, rank).clone() for w, lay in zip(whole, layouts)]
    sizes = [lay.largest() for lay in layouts]
    group = comm.group(ranks)
    out = torch.empty(sum(sizes), dtype=_local(grads[0]).dtype, device=_local(grads[0]).device)
    pieces = None
    if rank == src:
        assert whole is not None
        pieces = [_pack([lay.part(w, r) for w, lay in zip(whole, layouts)], sizes) for r in ranks]
    dist.scatter(out, pieces, src=src, group=group)
    n = len(ranks)
    comm.bytes["gradient shards (scatter)"] += (n - 1) * out.numel() * out.element_size() // n
    comm.calls["gradient shards (scatter)"] += 1
    mine, offset = [], 0
    for lay, size in zip(layouts, sizes):
        shape = [b - a for a, b in lay.boxes[rank]]
        mine.append(out[offset : offset + math.prod(shape)].reshape(shape).clone())
        offset += size
    return mine


def as_gradient(new_local: torch.Tensor, like: torch.Tensor, layout: Layout) -> torch.Tensor:
    """``new_local`` as a gradient of ``like``'s kind: a DTensor with ``like``'s mesh,
    placements, shape and strides, or the plain tensor."""
    if not is_dtensor(like):
        return new_local
    if layout.own is not None:  # the whole of a tensor on a mesh of some of the ranks
        new_local = new_local[tuple(slice(a, b) for a, b in layout.own)].clone()
    return DTensor.from_local(  # type: ignore[union-attr]
        new_local.to(like.dtype),
        _any(like).device_mesh,
        _any(like).placements,
        run_check=False,
        shape=like.shape,
        stride=like.stride(),
    )


def _full(t: Any) -> torch.Tensor:
    """The whole plain tensor of the DTensor ``t`` (a collective of its mesh), no autograd."""
    with torch.no_grad():
        whole: torch.Tensor = t.full_tensor()
        wait = getattr(whole, "wait", None)  # an asynchronous collective's tensor
        return wait() if callable(wait) and not isinstance(whole, torch.nn.Parameter) else whole


def whole_input(x: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """A hook's captured input as a whole plain tensor, and the mesh it was a DTensor on
    (None for a plain input). Tensor parallelism hands a layer's forward hook a DTensor
    (replicated for a column-parallel layer, sharded along the features for a
    row-parallel one); its shards are gathered over that mesh (a collective of the mesh's
    ranks, who all run the same hooks)."""
    if not is_dtensor(x):
        return x, None
    return _full(x), _any(x).device_mesh


def whole_output_grad(spec: LayerSpec, gy: torch.Tensor, mesh: Any) -> torch.Tensor:
    """A captured output-gradient as the whole plain tensor: a DTensor's shards or, for a
    column-parallel layer (tensor parallelism over ``mesh``, the mesh its input came on),
    the local shard of the features, gathered over the mesh. Other sizes are an error
    that names the layer."""
    with torch.no_grad():
        if is_dtensor(gy):
            return _full(gy)
        full = spec.out_dim
        size = int(gy.shape[-1]) if gy.dim() else 0
        if mesh is None or size == full or not spec.block.tensor_parallel:
            return gy
        parts = mesh.size()
        if mesh.ndim != 1 or size * parts != full:
            raise ValueError(
                f"layer {spec.name!r} (tensor-parallel over {parts} ranks): captured "
                f"output-gradient has last dimension {size}, expected {full} (whole) or "
                f"{full // max(parts, 1)} (an even shard)"
            )
        sharded = DTensor.from_local(  # type: ignore[union-attr]
            gy.contiguous(),
            mesh,
            [Shard(gy.dim() - 1)],
            run_check=False,  # type: ignore[misc]
        )
        return _full(sharded)


def describe_parameters(model: torch.nn.Module, layers: Mapping[str, LayerSpec]) -> str:
    """A rank-independent text of the meshes and placements of the registered layers'
    parameters (for the ranks' agreement check); empty when none is a DTensor."""
    lines = []
    for pname in [p for spec in layers.values() for p in spec.param_names()]:
        p = _any(model.get_parameter(pname))
        if is_dtensor(p):
            mesh = p.device_mesh
            lines.append(
                f"{pname}: mesh {tuple(mesh.shape)} {mesh.mesh_dim_names}, "
                f"placements {tuple(p.placements)}"
            )
    return "; ".join(lines)


def check_packed_parameters(model: torch.nn.Module, layers: Mapping[str, LayerSpec]) -> None:
    """Refuse DTensor parameters of layers that own rows of a packed parameter (the q, k
    and v projections of ``nn.MultiheadAttention``) unless FSDP2 shards them (``Shard(0)``
    / ``Replicate()`` of ``fully_shard`` on the module or a parent) or they are replicated.

    Tensor parallelism of such a parameter is not meaningful here: the module reads its
    packed weights itself (``F.multi_head_attention_forward``), so torch's parallel styles
    do not apply to it (``ColwiseParallel`` takes ``nn.Linear`` / ``nn.Embedding``) and a
    weight distributed by hand would split the q, k and v rows, and the heads, in no way
    the forward knows. The ValueError names the layer, the parameter and its placements.

    Example:
        >>> from torch import nn
        >>> from kfac_func.blocks import register
        >>> model = nn.MultiheadAttention(4, 2)
        >>> check_packed_parameters(model, register(model))  # plain parameters pass
    """
    if DTensor is None:  # pragma: no cover - an older torch: no DTensor parameters
        return
    fsdp_roots: list[str] | None = None
    for spec in layers.values():
        for pname, rows in (
            (spec.weight, spec.option("rows")),
            (spec.bias, spec.option("bias_rows")),
        ):
            if pname is None or rows is None:
                continue
            p = _any(model.get_parameter(pname))
            if not is_dtensor(p):
                continue
            placements = tuple(p.placements)
            if all(q.is_replicate() for q in placements):
                continue
            if fsdp_roots is None:
                fsdp_roots = _fsdp_modules(model)
            module = pname.rpartition(".")[0]
            managed = any(r == "" or module == r or module.startswith(r + ".") for r in fsdp_roots)
            plain = all(
                q.is_replicate() or (type(q) is Shard and _dim(q, tuple(p.shape)) == 0)
                for q in placements
            )
            if not (managed and plain):
                raise ValueError(
                    f"layer {spec.name!r} ({spec.kind}): the packed parameter {pname!r} is a "
                    f"DTensor with placements {placements}; K-FAC takes it sharded by FSDP2 "
                    "(fully_shard on the module or a parent: Shard(0), or Replicate() x "
                    "Shard(0) for HSDP) or replicated, not tensor-parallel: the module reads "
                    "its packed q, k and v weights itself, so their shards have no layout "
                    "its forward or K-FAC's factors could follow"
                )


def _fsdp_modules(model: torch.nn.Module) -> list[str]:
    """Names of the modules ``fully_shard`` was applied to."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return []
    return [name for name, m in model.named_modules() if isinstance(m, FSDPModule)]
