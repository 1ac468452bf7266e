"""The preconditioning stage of :func:`kfac_func.distributed.update_distributed` for DTensor
gradients.

FSDP2 (``fully_shard``, also HSDP on a 2-D mesh) and tensor parallelism
(``parallelize_module``) leave each rank a shard of every gradient, already averaged over
the data-parallel ranks. Under a KAISA :class:`~kfac_func.distributed.plan.Plan`, each
layer's shards are gathered onto its grad workers, who precondition the whole gradient
matrix as on one process; every rank then receives its part of the result from the grad
worker of its receiver group (its own result under ``COMM_OPT``) and gets it as a new
DTensor of the same mesh and placements. The kl_clip sum is taken over every layer: each
layer's term comes from its first grad worker, and one all-reduce gives every rank the
same scale. The math is the step's own (:mod:`kfac_func.step.grouped`); the
movement is :mod:`kfac_func.distributed.dtensor`'s.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from kfac_func.blocks import LayerSpec, matrix_to_grads
from kfac_func.core.preconditioning import kl_clip_scale_of_terms, kl_clip_term
from kfac_func.distributed.communicator import Communicator
from kfac_func.distributed.dtensor import (
    Layout,
    as_gradient,
    gather_whole,
    layout_of,
    scatter_parts,
)
from kfac_func.distributed.plan import DistributedStrategy, Plan
from kfac_func.state import KFACState, LayerState
from kfac_func.step.checks import layer_matrix
from kfac_func.step.grouped import preconditioned_layers
from kfac_func.step.hyper import Hyper, clip_and_rate
from kfac_func.step.layer_step import StageSettings

__all__ = ["owned_rows", "precondition_sharded", "release_unowned", "sharded_layouts"]


def release_unowned(state: KFACState, plan: Plan, rank: int, enable: bool = True) -> KFACState:
    """Under ``MEM_OPT`` on several ranks, ``state`` with the factors of the layers that
    ``rank`` does not own replaced by placeholders that hold no memory (a zero expanded to
    the factor's shape): only the owner reduces, folds and decomposes a layer's factors, and
    a rank's K-FAC memory falls as ``1/world``. Other plans (or ``enable=False``) return
    ``state`` as it is.

    Example:
        >>> import kfac_func as kf
        >>> from torch import nn
        >>> layers = kf.register(nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 2)))
        >>> mem_opt = kf.distributed.DistributedStrategy.MEM_OPT
        >>> plan = kf.distributed.make_plan(layers, 2, grad_worker_fraction=mem_opt)
        >>> state = release_unowned(kf.init(layers), plan, rank=0)
        >>> sorted(n for n, ls in state.layers.items() if 0 in ls.a_factor.stride())
        ['1']
    """
    if not enable or plan.strategy is not DistributedStrategy.MEM_OPT or plan.world_size == 1:
        return state
    layers = dict(state.layers)
    for name, ls in state.layers.items():
        if plan.layers[name].a_owner != rank:
            a, g = ls.a_factor, ls.g_factor
            layers[name] = ls.replace(
                a_factor=a.new_zeros(()).expand(a.shape),
                g_factor=g.new_zeros(()).expand(g.shape),
                decomposition=None,
            )
    return state.replace(layers=layers)


def sharded_layouts(
    layers: Mapping[str, LayerState],
    grads: Mapping[str, torch.Tensor],
    names: Sequence[str],
    comm: Communicator,
) -> dict[str, Layout]:
    """``{parameter: Layout}`` of every registered layer's gradients, checked on every rank.

    A rank that refuses a placement (see :func:`kfac_func.distributed.dtensor.layout_of`)
    raises its error; the others raise a ValueError naming that rank, so that no rank
    waits in a collective the refusing rank never joins. A sharded parameter that several
    layers share is refused too, unless each of them owns rows of it (the q, k and v
    projections of attention's packed ``in_proj_weight``, see :func:`owned_rows`).
    """
    layouts: dict[str, Layout] = {}
    error: Exception | None = None
    users: dict[str, str] = {}
    try:
        for name in names:
            spec = layers[name].spec
            for pname in spec.param_names():
                if pname not in grads:
                    raise ValueError(f"layer {name!r}: no gradient for {pname!r} in grads")
                if pname in users:
                    first = layers[users[pname]].spec
                    packed = owned_rows(first, pname) and owned_rows(spec, pname)
                    if (layouts[pname].sharded or layouts[pname].own) and not packed:
                        raise ValueError(
                            f"layers {users[pname]!r} and {name!r} share the sharded parameter "
                            f"{pname!r}; K-FAC preconditions a sharded parameter of one layer, "
                            "or rows of it per layer (attention's packed projections)"
                        )
                    continue
                users[pname] = name
                layouts[pname] = layout_of(grads[pname], comm.world_size, name=name, pname=pname)
    except ValueError as err:
        error = err
    if comm.active and comm.world_size > 1:
        flags = torch.zeros(comm.world_size, dtype=torch.int64)
        flags[comm.rank] = int(error is not None)
        dist.all_reduce(flags, group=comm.world_group)
        bad = [r for r, f in enumerate(flags.tolist()) if f]
        if bad and error is None:
            raise ValueError(
                f"rank(s) {bad} refused the placements of the gradients (see their errors); "
                f"rank {comm.rank} stops too"
            )
    if error is not None:
        raise error
    return layouts


def owned_rows(spec: LayerSpec, pname: str) -> tuple[int, int] | None:
    """The rows ``(start, stop)`` of parameter ``pname`` that the layer owns (the
    ``rows`` / ``bias_rows`` options of the q, k and v parts of a packed attention
    weight), or None when the layer owns the whole parameter.

    Example:
        >>> from torch import nn
        >>> from kfac_func.blocks import register
        >>> k = register(nn.MultiheadAttention(4, 2))["k_proj"]
        >>> owned_rows(k, "in_proj_weight"), owned_rows(k, "in_proj_bias")
        ((4, 8), (4, 8))
    """
    rows = spec.option("rows") if pname == spec.weight else spec.option("bias_rows")
    return None if rows is None else (int(rows[0]), int(rows[1]))


def _merge_rows(
    merged: dict[str, torch.Tensor],
    pname: str,
    part: torch.Tensor,
    rows: tuple[int, int] | None,
    box: tuple[tuple[int, int], ...],
) -> torch.Tensor:
    """This rank's part of ``pname`` with the rows one layer owns taken from ``part`` (the
    part it received for that layer; the first layer's part gives the rest), kept in
    ``merged`` for the next layer that owns rows of it."""
    if rows is None:
        return part
    if pname not in merged:
        merged[pname] = part
        return part
    out = merged[pname]
    lo, hi = box[0] if box else (0, 0)
    start, stop = max(rows[0], lo) - lo, min(rows[1], hi) - lo
    if stop > start:
        out[start:stop] = part[start:stop]
    return out


def precondition_sharded(
    layers: Mapping[str, LayerState],
    grads: Mapping[str, torch.Tensor],
    layouts: Mapping[str, Layout],
    names: Sequence[str],
    plan: Plan,
    comm: Communicator,
    settings: StageSettings,
    kl_clip: Hyper | None,
    lr: Hyper,
    changes: dict[str, dict[str, object]],
) -> dict[str, torch.Tensor]:
    """The preconditioned gradients (DTensors like ``grads``'); see the module docstring.

    ``layers`` hold this step's decompositions (on the grad workers), ``layouts`` come
    from :func:`sharded_layouts`, ``settings`` are the step's stage settings; the new
    running moments of the layers a rank preconditions go into ``changes``.
    """
    rank = comm.rank
    clip, rate = clip_and_rate(kl_clip, lr, settings.step)
    whole: dict[str, list[torch.Tensor]] = {}
    for name in names:
        ps = layers[name].spec.param_names()
        got = gather_whole(
            [grads[p] for p in ps],
            [layouts[p] for p in ps],
            plan.layers[name].grad_workers,
            comm,
        )
        if got is not None:
            whole[name] = got
    full = {p: t for name, ts in whole.items() for p, t in zip(layers[name].spec.param_names(), ts)}
    mine = [name for name in whole if layers[name].decomposition is not None]
    owned = preconditioned_layers(
        {n: layers[n] for n in whole}, full, mine, settings, changes=changes
    )  # the finite layers only, warned about or raised as on one process
    done = {name: (p, layer_matrix(layers[name], full)) for name, (p, _) in owned.items()}
    scale = None
    if clip is not None:
        terms = torch.zeros(len(names), dtype=torch.float64)
        for i, name in enumerate(names):
            if name in done and rank == plan.layers[name].grad_workers[0]:
                terms[i] = kl_clip_term(*done[name]).cpu()
        if comm.active and comm.world_size > 1:
            dist.all_reduce(terms, group=comm.world_group)
        scale = kl_clip_scale_of_terms(list(terms.unbind()), clip, rate, dtype=torch.float64)
    out = dict(grads)
    merged: dict[str, torch.Tensor] = {}  # parts of parameters whose rows layers share
    for name in names:
        spec = layers[name].spec
        ps = spec.param_names()
        new = whole.get(name)
        if name in done and new is not None:
            p = done[name][0]
            if scale is not None:
                p = p * scale.to(device=p.device, dtype=p.dtype)
            w, b = matrix_to_grads(spec, p)
            raw = dict(zip(ps, new))
            written = dict(raw)  # a layer that owns rows writes them into a copy
            spec.block.write_grads(spec, written, raw, w, b)
            new = [written[q] for q in ps]
        src = plan.src_of(name, rank)
        parts = scatter_parts(
            new if rank == src else None,
            [grads[p] for p in ps],
            [layouts[p] for p in ps],
            src,
            plan.receiver_group_of(rank),
            comm,
        )
        for pname, part in zip(ps, parts):
            box = layouts[pname].boxes[rank]
            part = _merge_rows(merged, pname, part, owned_rows(spec, pname), box)
            out[pname] = as_gradient(part, grads[pname], layouts[pname])
    return out
