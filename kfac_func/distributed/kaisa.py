"""KAISA's factor and decomposition stages of :func:`kfac_func.distributed.update_distributed`
(composed in :mod:`kfac_func.distributed.step`).

The stages of :mod:`kfac_func.step` and the factor decompositions do the math,
:class:`kfac_func.distributed.communicator.Communicator` moves tensors, the
:class:`kfac_func.distributed.plan.Plan` says who does what:

1. every rank computes its local batch factors (:func:`local_batch_factors`); they are
   averaged over ranks (weighted like micro-batches, see
   :func:`kfac_func.core.conventions.micro_batch_weights`) by a bucketed asynchronous
   all-reduce, or, under ``MEM_OPT`` where only the owner needs them, by a reduce to the
   owner (half the bytes), and folded (:func:`reduce_factors`);
2. the owners decompose their factors and broadcast the results to the layer's grad
   workers (:func:`decompose_owned`; ``COMM_OPT``, ``HYBRID_OPT``).

Gradients must already be averaged over data-parallel ranks (as DDP does). Each rank
keeps a full :class:`KFACState`; under ``MEM_OPT`` a rank's factors are current only for
the layers it owns, and decompositions live only on grad workers.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch

from kfac_func.captures import Captures
from kfac_func.core.attempts import DecompositionError
from kfac_func.core.conventions import decomposition_dtype
from kfac_func.core.decomposition import (
    Decomposition,
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
from kfac_func.distributed.plan import DistributedStrategy, Plan
from kfac_func.distributed.reducer import OrderedReducer
from kfac_func.state import KFACState, LayerState
from kfac_func.step.accumulate import fold_layers
from kfac_func.step.batch_factors import (
    LayerFactors,
    build_batch_factors,
    from_pooled,
    layer_stats,
    pooling_terms,
)
from kfac_func.step.decompose import decomposition_failed
from kfac_func.step.decompose_groups import batched_eigenpairs, needs_decomposition, warm_start
from kfac_func.step.hyper import NonFinite, as_list

__all__ = [
    "check_plan",
    "decompose_owned",
    "local_batch_factors",
    "offer_factors",
    "reduce_factors",
    "start_factor_reduction",
]


def check_plan(state: KFACState, plan: Plan) -> list[str]:
    """The layers in the plan's (name) order, which every rank shares whatever the order
    of its state: reductions are issued and the kl_clip sum is taken in this order."""
    if set(state.layers) != set(plan.layers):
        missing = sorted(set(state.layers) - set(plan.layers))
        extra = sorted(set(plan.layers) - set(state.layers))
        raise ValueError(
            f"plan and state disagree on layers: not in plan {missing}, not in state {extra}"
        )
    return list(plan.layers)


BatchFactors = Mapping[str, LayerFactors]


def local_batch_factors(
    state: KFACState,
    captures: Captures | Sequence[Captures],
    gram_dtype: torch.dtype | None = None,
) -> dict[str, LayerFactors]:
    """``{layer: LayerFactors}`` of this rank's captures (layers not called are absent;
    Gram products from operands in ``gram_dtype``, None: the factors' dtype)."""
    micro = as_list(captures)
    specs = {name: ls.spec for name, ls in state.layers.items()}
    cfg = state.config
    return build_batch_factors(
        specs, lambda name: layer_stats(specs[name], micro, cfg, gram_dtype), cfg
    )


def start_factor_reduction(state: KFACState, plan: Plan, comm: Communicator) -> OrderedReducer:
    """An in-order reduction of every layer's :func:`~kfac_func.step.batch_factors.pooling_terms`
    (layers in plan order).

    Offer a layer with :func:`offer_factors` as soon as its window is complete (the
    adapter does so from autograd hooks, overlapping communication with the backward
    pass); :func:`update_distributed` offers the rest and folds the sums. Under
    ``MEM_OPT`` each layer is reduced to its owner only.
    """
    dst = None
    if plan.strategy is DistributedStrategy.MEM_OPT:
        dst = {name: plan.layers[name].a_owner for name in plan.layers}
    order = check_plan(state, plan)
    return OrderedReducer(comm, order, symmetric=[True, True, False], dst=dst)


def offer_factors(reducer: OrderedReducer, ls: LayerState, batch: LayerFactors | None) -> None:
    """Offer one layer's local batch factors (None: not called here, contributes nothing)."""
    symmetric = [not ls.spec.a_diagonal, not ls.spec.g_diagonal, False]
    zeros = None
    if batch is None and ls.spec.block.stacked_uses:  # a tied layer's stack its uses
        zeros = stacked_like(ls.a_factor, ls.g_factor)
    elif batch is None:
        zeros = (torch.zeros_like(ls.a_factor), torch.zeros_like(ls.g_factor))
    reducer.ready(ls.spec.name, pooling_terms(ls.spec, batch, zeros), symmetric)


def reduce_factors(
    state: KFACState,
    names: list[str],
    local: BatchFactors,
    plan: Plan,
    comm: Communicator,
    decay: float,
    nonfinite: NonFinite,
    reducer: OrderedReducer | None,
) -> dict[str, LayerState]:
    """The layers with this step's factors folded in by the ranks that keep them: the
    local batch factors ``local`` averaged over ranks (the reduction of ``reducer`` where
    it started already)."""
    cfg = state.config
    layers = dict(state.layers)
    batches: dict[str, LayerFactors] = dict(local)
    if comm.world_size > 1:
        reducer = reducer or start_factor_reduction(state, plan, comm)
        for name in names:
            if not reducer.offered(name):
                offer_factors(reducer, state.layers[name], local.get(name))
        sums = reducer.finish(lambda name: [])  # every layer was offered above
        to_owner = plan.strategy is DistributedStrategy.MEM_OPT
        batches = {}
        for name in names:
            if to_owner and comm.rank != plan.layers[name].a_owner:
                continue  # only the owner receives (and needs) the sums
            pooled = from_pooled(sums[name])
            if pooled is not None:
                batches[name] = pooled
    # folded as update() folds them, the layers of one shape together
    fold_layers(layers, lambda name, _: batches.pop(name, None), decay, cfg, nonfinite)
    return layers


def decompose_owned(
    state: KFACState,
    layers: dict[str, LayerState],
    names: list[str],
    plan: Plan,
    comm: Communicator,
    damping: float,
    update_inverses: bool,
    batched_eigh: bool = False,
    hold: Collection[str] = (),
) -> tuple[dict[str, LayerState], set[str]]:
    """The layers with the decompositions of this step, and the names of those that got a
    new one on this rank (``batched_eigh``: the factors this rank owns, together); the
    layers in ``hold`` keep theirs where they have one (as in
    :func:`~kfac_func.step.decompose.decompose_layers`)."""
    cfg = state.config
    cdt = decomposition_dtype(cfg.convention, cfg.inv_dtype)
    eigen = cfg.compute_method in ("eigen", "ekfac")
    outer = cfg.compute_method == "eigen" and cfg.compute_eigenvalue_outer_product
    rank = comm.rank

    def now(name: str) -> bool:
        return update_inverses and name not in hold

    todo: list[tuple[str, Pending, Pending, str | None]] = []
    owned = [  # (layer, 0 for A or 1 for G) this rank decomposes, with batched_eigh
        (n, side)
        for n in (names if batched_eigh else ())
        for side, owner in enumerate((plan.layers[n].a_owner, plan.layers[n].g_owner))
        if owner == rank and needs_decomposition(layers[n], cfg, update_inverses=now(n))
    ]
    pairs = batched_eigenpairs(layers, cfg, owned)
    for name in names:
        lp, ls = plan.layers[name], layers[name]
        if rank not in lp.grad_workers or not needs_decomposition(
            ls, cfg, update_inverses=now(name)
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
                        q, d = got or eigh_side(factor, previous, label=label, **kw)
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
