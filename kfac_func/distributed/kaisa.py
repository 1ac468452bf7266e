"""`update_distributed`: the K-FAC step of :func:`kfac_func.update`, executed under a plan.

Composition only: the stages of :mod:`kfac_func.step` and the factor decompositions do
the math, :class:`kfac_func.distributed.communicator.Communicator` moves tensors, the
:class:`kfac_func.distributed.plan.Plan` says who does what. Per step:

1. every rank computes its local batch factors; they are averaged over ranks (weighted
   like micro-batches, see :func:`kfac_func.core.conventions.micro_batch_weights`) by a
   bucketed asynchronous all-reduce, or, under ``MEM_OPT`` where only the owner needs
   them, by a reduce to the owner (half the bytes);
2. the owners decompose their factors and broadcast the results to the layer's grad
   workers (``COMM_OPT``, ``HYBRID_OPT``);
3. grad workers precondition; under ``MEM_OPT``/``HYBRID_OPT`` they broadcast the result
   (with a flag saying whether it was preconditioned) to their receiver group;
4. every rank applies the same kl_clip scale to the same tensors.

Gradients must already be averaged over data-parallel ranks (as DDP does). Each rank
keeps a full :class:`KFACState`; under ``MEM_OPT`` a rank's factors are current only for
the layers it owns, and decompositions live only on grad workers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from kfac_func.blocks import Rows
from kfac_func.captures import Captures
from kfac_func.core.conventions import decomposition_dtype
from kfac_func.core.decomposition import (
    Decomposition,
    DecompositionError,
    EigenDecomposition,
    InverseDecomposition,
    eigenvalue_outer,
)
from kfac_func.core.ekfac import from_eigen
from kfac_func.core.layer_decomposition import (
    decomposition_shapes,
    eigh_side,
    inverse_side,
    precompute_outer,
)
from kfac_func.core.tied_factors import stacked_like
from kfac_func.distributed.communicator import Communicator, Pending
from kfac_func.distributed.dtensor import has_dtensors
from kfac_func.distributed.ekfac import reduce_scales
from kfac_func.distributed.plan import DistributedStrategy, Plan
from kfac_func.distributed.reducer import OrderedReducer
from kfac_func.distributed.sharded import precondition_sharded, sharded_layouts
from kfac_func.state import KFACState, LayerState
from kfac_func.step.accumulate import fold_checked, layer_batch_factors
from kfac_func.step.autocast import without_autocast
from kfac_func.step.basis import BasisMoments, carry_moments, moment_bases
from kfac_func.step.checks import check_grads_mapping, layer_matrix
from kfac_func.step.decompose import (
    batched_eigenpairs,
    check_eigh_device,
    decomposition_failed,
    needs_decomposition,
    warm_start,
)
from kfac_func.step.grouped import preconditioned_layers
from kfac_func.step.hyper import Hyper, NonFinite, as_list, check_hyper, resolve
from kfac_func.step.precondition import (
    Grafting,
    apply_preconditioned,
    captured_rows,
)
from kfac_func.step.sync_free import (
    apply_selected,
    check_sync_free,
    leave_sync_free,
    report_layers,
)

__all__ = [
    "local_batch_factors",
    "offer_factors",
    "start_factor_reduction",
    "update_distributed",
]


def _check_plan(state: KFACState, plan: Plan) -> list[str]:
    """The layers in the plan's (name) order, which every rank shares whatever the order
    of its state: reductions are issued and the kl_clip sum is taken in this order."""
    if set(state.layers) != set(plan.layers):
        missing = sorted(set(state.layers) - set(plan.layers))
        extra = sorted(set(plan.layers) - set(state.layers))
        raise ValueError(
            f"plan and state disagree on layers: not in plan {missing}, not in state {extra}"
        )
    return list(plan.layers)


BatchFactors = Mapping[str, tuple[torch.Tensor, torch.Tensor, float]]


def local_batch_factors(
    state: KFACState, captures: Captures | Sequence[Captures]
) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
    """``{layer: (A, G, weight)}`` of this rank's captures (layers not called are absent)."""
    micro = as_list(captures)
    out = {}
    for name, ls in state.layers.items():
        batch = layer_batch_factors(ls.spec, micro, state.config)
        if batch is not None:
            out[name] = batch
    return out


def start_factor_reduction(state: KFACState, plan: Plan, comm: Communicator) -> OrderedReducer:
    """An in-order reduction of every layer's ``[w·A, w·G, w]`` (layers in plan order).

    Offer a layer with :func:`offer_factors` as soon as its window is complete (the
    adapter does so from autograd hooks, overlapping communication with the backward
    pass); :func:`update_distributed` offers the rest and folds the sums. Under
    ``MEM_OPT`` each layer is reduced to its owner only.
    """
    dst = None
    if plan.strategy is DistributedStrategy.MEM_OPT:
        dst = {name: plan.layers[name].a_owner for name in plan.layers}
    order = _check_plan(state, plan)
    return OrderedReducer(comm, order, symmetric=[True, True, False], dst=dst)


def offer_factors(
    reducer: OrderedReducer,
    ls: LayerState,
    batch: tuple[torch.Tensor, torch.Tensor, float] | None,
) -> None:
    """Offer one layer's local batch factors (None: not called here, contributes nothing)."""
    symmetric = [not ls.spec.a_diagonal, not ls.spec.g_diagonal, False]
    if batch is None:
        zero = torch.zeros(1, dtype=ls.a_factor.dtype, device=ls.a_factor.device)
        if ls.spec.block.stacked_uses:  # a tied layer's batch factors stack its uses
            za, zg = stacked_like(ls.a_factor, ls.g_factor)
        else:
            za, zg = torch.zeros_like(ls.a_factor), torch.zeros_like(ls.g_factor)
        zeros = [za, zg, zero]
        reducer.ready(ls.spec.name, zeros, symmetric)
        return
    a, g, w = batch
    weight = torch.full((1,), w, dtype=a.dtype, device=a.device)
    reducer.ready(ls.spec.name, [w * a, w * g, weight], symmetric)


def _reduce_factors(
    state: KFACState,
    names: list[str],
    local: BatchFactors,
    plan: Plan,
    comm: Communicator,
    decay: float,
    nonfinite: NonFinite,
    reducer: OrderedReducer | None,
) -> dict[str, LayerState]:
    cfg = state.config
    layers = dict(state.layers)
    if comm.world_size == 1:  # nothing to average: fold the local factors as update() does
        for name, (a, g, _) in local.items():
            layers[name] = fold_checked(state.layers[name], a, g, decay, cfg, nonfinite)
        return layers
    reducer = reducer or start_factor_reduction(state, plan, comm)
    for name in names:
        if not reducer.offered(name):
            offer_factors(reducer, state.layers[name], local.get(name))
    sums = reducer.finish(lambda name: [])  # every layer was offered above
    to_owner = plan.strategy is DistributedStrategy.MEM_OPT
    for name in names:
        if to_owner and comm.rank != plan.layers[name].a_owner:
            continue  # only the owner receives (and needs) the sums
        wa, wg, total = sums[name]
        w = float(total[0])
        if w != 0.0:
            layers[name] = fold_checked(state.layers[name], wa / w, wg / w, decay, cfg, nonfinite)
    return layers


def _decompose(
    state: KFACState,
    layers: dict[str, LayerState],
    names: list[str],
    plan: Plan,
    comm: Communicator,
    damping: float,
    update_inverses: bool,
    batched_eigh: bool = False,
    eigh_device: torch.device | None = None,
) -> tuple[dict[str, LayerState], set[str]]:
    """The layers with the decompositions of this step, and the names of those that got a
    new one on this rank (``batched_eigh``: the factors this rank owns, together)."""
    cfg = state.config
    cdt = decomposition_dtype(cfg.convention, cfg.inv_dtype)
    eigen = cfg.compute_method in ("eigen", "ekfac")
    outer = cfg.compute_method == "eigen" and cfg.compute_eigenvalue_outer_product
    rank = comm.rank
    todo: list[tuple[str, Pending, Pending, str | None]] = []
    owned = [  # (layer, 0 for A or 1 for G) this rank decomposes, with batched_eigh
        (n, side)
        for n in (names if batched_eigh else ())
        for side, owner in enumerate((plan.layers[n].a_owner, plan.layers[n].g_owner))
        if owner == rank and needs_decomposition(layers[n], cfg, update_inverses=update_inverses)
    ]
    pairs = batched_eigenpairs(layers, cfg, owned, eigh_device=eigh_device)
    for name in names:
        lp, ls = plan.layers[name], layers[name]
        if rank not in lp.grad_workers or not needs_decomposition(
            ls, cfg, update_inverses=update_inverses
        ):
            continue
        parts, failure = [], None
        warm = warm_start(ls, cfg)
        diag_a, diag_g = ls.spec.diagonal
        for side, (which, owner, factor, previous, diag) in enumerate(
            (
                ("A", lp.a_owner, ls.a_factor, None if warm is None else warm.qa, diag_a),
                ("G", lp.g_owner, ls.g_factor, None if warm is None else warm.qg, diag_g),
            )
        ):
            label = f"layer {name!r}, the {which} factor"
            dev = factor.device
            sent = [
                torch.empty(s, dtype=cfg.inv_dtype, device=dev)
                for s in decomposition_shapes(factor.shape, diagonal=diag, eigen=eigen)
            ]
            ok = torch.zeros(1, dtype=cfg.inv_dtype, device=dev)
            if rank == owner:
                try:
                    dt = cfg.inv_dtype
                    kw: dict[str, Any] = {
                        "diagonal": diag,
                        "placeholder": ls.spec.placeholder[side],
                        "dtype": dt,
                        "compute_dtype": cdt,
                    }
                    if eigen:
                        got = pairs.pop((name, side), None)
                        q, d = got or eigh_side(
                            factor, previous, device=eigh_device, label=label, **kw
                        )
                        sent = [d] if q is None else [q, d]
                    else:
                        sent = [inverse_side(factor, damping, label=label, **kw)]
                    ok.fill_(1.0)
                except DecompositionError as err:  # workers keep their previous one
                    failure = f"the {which} factor: {err}"
                    sent = [t.zero_() for t in sent]
            sym = [False] * len(sent) if eigen or diag else [True]
            parts.append(
                comm.broadcast(
                    [*sent, ok],
                    src=owner,
                    ranks=lp.grad_workers,
                    kind="decompositions",
                    symmetric=[*sym, False],
                )
            )
        todo.append((name, parts[0], parts[1], failure))
    new = dict(layers)
    fresh = set()
    for name, a_part, g_part, failure in todo:
        *a_res, a_ok = a_part.wait()
        *g_res, g_ok = g_part.wait()
        if not (bool(a_ok.item()) and bool(g_ok.item())):
            new[name] = decomposition_failed(new[name], failure)
            continue
        dec: Decomposition
        if eigen:
            (qa, da), (qg, dg) = _basis(a_res), _basis(g_res)
            dgda = None
            if precompute_outer(outer, new[name].spec.diagonal):
                dgda = eigenvalue_outer(dg, da, damping)
            dec = EigenDecomposition(qa, da, qg, dg, dgda)
            if cfg.compute_method == "ekfac":
                dec = from_eigen(dec)
        else:
            dec = InverseDecomposition(a_res[0], g_res[0])
        new[name] = new[name].replace(decomposition=dec)
        fresh.add(name)
    return new, fresh


def _basis(received: list[torch.Tensor]) -> tuple[torch.Tensor | None, torch.Tensor]:
    """``(eigenvectors, eigenvalues)`` of one side as broadcast: a diagonal side sends its
    eigenvalues only."""
    return (None, received[0]) if len(received) == 1 else (received[0], received[1])


@without_autocast
def update_distributed(
    state: KFACState,
    grads: Mapping[str, torch.Tensor],
    *,
    plan: Plan,
    comm: Communicator,
    captures: Captures | Sequence[Captures] | None = None,
    batch_factors: BatchFactors | None = None,
    factor_reducer: OrderedReducer | None = None,
    damping: Hyper = 1e-3,
    factor_decay: Hyper = 0.95,
    kl_clip: Hyper | None = 1e-3,
    lr: Hyper = 0.1,
    update_factors: bool | Callable[[int], bool] = True,
    update_inverses: bool | Callable[[int], bool] = True,
    nonfinite: NonFinite = "skip",
    rows: Mapping[str, Rows] | None = None,
    grafting: str | None = None,
    graft_beta2: float = 0.999,
    graft_eps: float = 1e-8,
    eigenbasis_moments: bool = False,
    moment_beta2: float = 0.999,
    moment_eps: float = 1e-8,
    moment_beta1: float = 0.0,
    sync_free: bool = False,
    batched_eigh: bool = False,
    eigh_device: torch.device | str | None = None,
) -> tuple[dict[str, torch.Tensor], KFACState]:
    """:func:`kfac_func.update` across ranks, with the communication of ``plan``.

    Every rank calls it with its local captures and the rank-averaged gradients; every
    rank returns the same preconditioned gradients. Arguments are those of
    :func:`kfac_func.update`, plus the plan and its :class:`Communicator`, and
    ``batch_factors`` (``{layer: (A, G, weight)}`` of this rank, as from
    :func:`local_batch_factors`) for callers that built the factors already (the hooks of
    the stateful adapter) instead of ``captures``, ``factor_reducer`` (from
    :func:`start_factor_reduction`) holding layers whose reduction already started, and
    ``rows`` (see :func:`kfac_func.step.precondition.precondition_layer`; on one rank they are taken
    from ``captures``; with several ranks the gradients are averages, which local rows
    never reproduce). With ``sync_free=True`` (see :func:`kfac_func.update`) the grad
    workers check the gradients on the device and the flags that travel with broadcast
    gradients select on the receivers' devices: a step that only preconditions reads
    nothing on the host. DTensor gradients (FSDP2, HSDP, tensor parallelism: each rank's
    shards, as ``param.grad`` holds them) are gathered onto each layer's grad workers and
    come back as DTensors of the same placements (:mod:`kfac_func.distributed.sharded`);
    the captures must then hold the whole layers' inputs and output-gradients (the
    adapter's hooks gather tensor-parallel shards), and ``sync_free`` does not apply.
    ``batched_eigh`` and ``eigh_device`` (see
    :func:`kfac_func.decompose`) apply to the factors each owner decomposes.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import kfac_func as kf
        >>> model = nn.Linear(3, 2)
        >>> layers = kf.register(model)
        >>> plan = kf.make_plan(layers, world_size=1)
        >>> comm = kf.Communicator(plan)  # no process group: one rank
        >>> _, grads, caps = kf.capture(model, dict(model.named_parameters()),
        ...                             torch.randn(4, 3), lambda o: o.pow(2).mean())
        >>> new_grads, state = kf.update_distributed(kf.init(layers), grads, captures=caps,
        ...                                          plan=plan, comm=comm)
        >>> state.step
        1
    """
    if nonfinite not in ("skip", "raise"):
        raise ValueError(f"nonfinite must be 'skip' or 'raise', got {nonfinite!r}")
    check_sync_free(sync_free, nonfinite)
    names = _check_plan(state, plan)
    graft_settings = None
    if grafting is not None:
        graft_settings = Grafting(grafting, graft_beta2, graft_eps).check()
    basis_settings = None
    if eigenbasis_moments:
        basis_settings = BasisMoments(moment_beta2, moment_eps, moment_beta1).check(
            state.config.compute_method
        )
    check_grads_mapping(grads)  # before any collective
    # DTensor gradients (FSDP2, tensor parallelism): placements checked before any other
    # collective; their preconditioning stage is kfac_func.distributed.sharded's
    layouts = sharded_layouts(state.layers, grads, names, comm) if has_dtensors(grads) else None
    eigh_device = check_eigh_device(eigh_device)
    changes: dict[str, dict[str, object]] = {}
    step = state.step
    lam = resolve(damping, step)
    check_hyper("damping", lam, lambda v: v >= 0, ">= 0")
    layers = dict(state.layers)
    # what one-process sync_free steps decided on the device (this step checks its
    # factors and decompositions on the host): one read, only when they left anything
    leave_sync_free(layers)
    state = state.replace(layers=dict(layers))
    decay, statistics = 1.0, None  # this step's captures, when factors update
    factors_now = bool(resolve(update_factors, step))
    if factors_now:
        if captures is not None and batch_factors is not None:
            raise ValueError("give captures= or batch_factors=, not both")
        if captures is None and batch_factors is None and factor_reducer is None:
            raise ValueError("update_factors=True needs captures= (from kfac_func.capture)")
        decay = resolve(factor_decay, step)
        check_hyper("factor_decay", decay, lambda v: 0 <= v <= 1, "in [0, 1]")
        local = batch_factors or {}
        if captures is not None:
            local = local_batch_factors(state, captures)
            statistics = as_list(captures)
        layers = _reduce_factors(state, names, local, plan, comm, decay, nonfinite, factor_reducer)
    before = moment_bases(layers)
    inverses = bool(resolve(update_inverses, step))
    layers, fresh = _decompose(
        state, layers, names, plan, comm, lam, inverses, batched_eigh, eigh_device
    )
    carry_moments(layers, before, fresh)
    if state.config.compute_method == "ekfac" and statistics is not None:
        reduce_scales(
            layers, names, statistics, plan, comm, state.config.inv_dtype, decay, nonfinite, fresh
        )

    if layouts is not None:  # DTensor gradients: see kfac_func.distributed.sharded
        args = (lam, kl_clip, lr, step, nonfinite, graft_settings, basis_settings, changes)
        out = precondition_sharded(layers, grads, layouts, names, plan, comm, *args)
        layers.update({n: layers[n].replace(**c) for n, c in changes.items()})
        return out, state.replace(layers=layers, step=step + 1)
    rank = comm.rank
    if basis_settings is not None or sync_free:
        rows = {}  # eigenbasis moments need the gradient matrix itself
    elif rows is None and captures is not None and comm.world_size == 1:
        rows = captured_rows(state, captures)
    rows = rows or {}
    mine = [
        name
        for name in names
        if rank in plan.layers[name].grad_workers and layers[name].decomposition is not None
    ]
    # the layers this rank preconditions, group by group (validates every gradient
    # before any travels; the default mode's checks are read once, warned or raised)
    owned = preconditioned_layers(
        layers,
        grads,
        mine,
        lam,
        step=step,
        nonfinite=nonfinite,
        sync_free=sync_free,
        rows=rows,
        grafting=graft_settings,
        basis_moments=basis_settings,
        changes=changes,
    )
    finite: dict[str, torch.Tensor] = {}  # sync_free: the grad workers' checks, on device
    results: list[tuple[str, torch.Tensor, Pending]] = []
    for name in names:
        ls = layers[name]
        m = layer_matrix(ls, grads)
        p = m
        if name in owned:
            p, flag = owned[name]
            if sync_free:
                finite[name] = flag
        if plan.broadcast_gradients:
            # the sender's flag says whether it preconditioned the layer
            flag = torch.full((1,), float(p is not m), dtype=m.dtype, device=m.device)
            if name in finite:
                flag = finite[name].to(m.dtype).reshape(1)
            src = plan.src_of(name, rank)
            sent = [p, flag] if rank == src else [torch.empty_like(m), flag]
            pending = comm.broadcast(
                sent, src=src, ranks=plan.receiver_group_of(rank), kind="gradients"
            )
        else:
            pending = Pending(finish=[lambda p=p: [p]])
        results.append((name, m, pending))
    received = [(name, m, pending.wait()) for name, m, pending in results]
    if sync_free:
        done_flags = [
            (layers[n].spec, got[0], m, got[1][0] > 0 if plan.broadcast_gradients else finite[n])
            for n, m, got in received
            if plan.broadcast_gradients or n in finite
        ]
        out = apply_selected(grads, done_flags, kl_clip=kl_clip, lr=lr, step=step)
        for name, change in changes.items():
            layers[name] = layers[name].replace(**change)
        if factors_now:  # this step reads the device anyway
            report_layers(layers)
        return out, state.replace(layers=layers, step=step + 1)
    if plan.broadcast_gradients:  # the senders' flags, read in one host synchronisation
        flags = [got[1] for *_, got in received]
        ok = torch.cat([f.to(flags[0].device) for f in flags]).tolist() if flags else []
    else:
        ok = [got[0] is not m for _, m, got in received]
    done = [(layers[n].spec, got[0], m) for (n, m, got), k in zip(received, ok) if k]
    out = apply_preconditioned(grads, done, kl_clip=kl_clip, lr=lr, step=step)
    for name, change in changes.items():  # the running moments, on the grad workers
        layers[name] = layers[name].replace(**change)
    return out, state.replace(layers=layers, step=step + 1)
