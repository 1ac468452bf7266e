"""`update_distributed`: the K-FAC step of :func:`kfac_func.update`, executed under a plan.

Composition only, stage by stage (see :mod:`kfac_func.distributed.kaisa` for the factor
and decomposition stages, :mod:`kfac_func.distributed.sharded` for DTensor gradients):

1. settle what earlier one-process ``sync_free`` steps decided on the device;
2. factors: local batch factors, averaged over ranks and folded by their owners;
3. decompositions: the owners decompose and broadcast to the layer's grad workers (and
   EKFAC's eigenvalue corrections are reduced);
4. preconditioning: each grad worker preconditions its layers, group by group;
5. exchange: under ``MEM_OPT``/``HYBRID_OPT`` the grad workers broadcast the results (with a
   flag saying whether the layer was preconditioned) to their receiver groups;
6. apply: every rank applies the same kl_clip scale to the same tensors.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch

from kfac_func.blocks import Rows
from kfac_func.captures import Captures
from kfac_func.distributed.communicator import Communicator, Pending
from kfac_func.distributed.dtensor import has_dtensors
from kfac_func.distributed.ekfac import reduce_scales
from kfac_func.distributed.kaisa import (
    BatchFactors,
    check_plan,
    decompose_owned,
    local_batch_factors,
    reduce_factors,
)
from kfac_func.distributed.plan import Plan
from kfac_func.distributed.reducer import OrderedReducer
from kfac_func.distributed.sharded import precondition_sharded, sharded_layouts
from kfac_func.state import KFACState, LayerState
from kfac_func.step.autocast import without_autocast
from kfac_func.step.basis import carry_moments, moment_bases
from kfac_func.step.checks import check_grads_mapping, layer_matrix
from kfac_func.step.grouped import preconditioned_layers
from kfac_func.step.hyper import as_list, resolve
from kfac_func.step.options import StepOptions, step_options
from kfac_func.step.orthogonal import held_layers, orthogonal_layers, prepare_layers
from kfac_func.step.precondition import captured_rows
from kfac_func.step.sync_free import apply_selected, leave_sync_free, report_layers

__all__ = ["update_distributed"]

Changes = dict[str, dict[str, object]]


class _Received(NamedTuple):
    """One layer after the exchange: its gradient matrix, the preconditioned one (or the
    gradient itself), and whether it was preconditioned (a bool, or a 0-d device flag)."""

    name: str
    grad: torch.Tensor
    result: torch.Tensor
    done: bool | torch.Tensor


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
    rows: Mapping[str, Rows] | None = None,
    options: StepOptions | None = None,
    **settings: Any,
) -> tuple[dict[str, torch.Tensor], KFACState]:
    """:func:`kfac_func.update` across ranks, with the communication of ``plan``.

    Every rank calls it with its local captures and the rank-averaged gradients; every
    rank returns the same preconditioned gradients. Arguments are those of
    :func:`kfac_func.update` (the settings: :class:`kfac_func.StepOptions`, as
    ``options=`` or keywords), plus the plan and its :class:`Communicator`, and
    ``batch_factors`` (``{layer: LayerFactors}`` of this rank, as from
    :func:`local_batch_factors`) for callers that built the factors already (the hooks of
    the stateful adapter) instead of ``captures``, ``factor_reducer`` (from
    :func:`start_factor_reduction`) holding layers whose reduction already started, and
    ``rows`` (see :func:`kfac_func.step.precondition.precondition_layer`; on one rank they
    are taken from ``captures``; with several ranks the gradients are averages, which
    local rows never reproduce). With ``sync_free=True`` the grad workers check the
    gradients on the device and the flags that travel with broadcast gradients select on
    the receivers' devices: a step that only preconditions reads nothing on the host
    (factor and decomposition steps are checked on the host). DTensor gradients (FSDP2,
    HSDP, tensor parallelism: each rank's shards, as ``param.grad`` holds them) are
    gathered onto each layer's grad workers and come back as DTensors of the same
    placements (:mod:`kfac_func.distributed.sharded`); the captures must then hold the
    whole layers' inputs and output-gradients (the adapter's hooks gather tensor-parallel
    shards), and ``sync_free`` does not apply. ``batched_eigh`` applies to the factors
    each owner decomposes; the preconditioning is grouped whatever
    ``grouped`` says (the factor and decomposition stages go layer by layer).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import kfac_func as kf
        >>> model = nn.Linear(3, 2)
        >>> layers = kf.register(model)
        >>> plan = kf.distributed.make_plan(layers, world_size=1)
        >>> comm = kf.distributed.Communicator(plan)  # no process group: one rank
        >>> _, grads, caps = kf.capture(model, dict(model.named_parameters()),
        ...                             torch.randn(4, 3), lambda o: o.pow(2).mean())
        >>> new_grads, state = kf.distributed.update_distributed(
        ...     kf.init(layers), grads, captures=caps, plan=plan, comm=comm
        ... )
        >>> state.step
        1
    """
    opts = step_options(options, settings)
    names = check_plan(state, plan)
    check_grads_mapping(grads)  # before any collective
    # DTensor gradients (FSDP2, tensor parallelism): placements checked before any other
    # collective; their preconditioning stage is kfac_func.distributed.sharded's
    layouts = sharded_layouts(state.layers, grads, names, comm) if has_dtensors(grads) else None
    step = state.step
    stage = opts.stage_settings(state.config.compute_method, step)
    # stage 1: settle what one-process sync_free steps decided on the device (this step
    # checks its factors and decompositions on the host): one read, only if they left any
    settled = dict(state.layers)
    leave_sync_free(settled)
    state = state.replace(layers=settled)
    # stage 2: this step's factors folded in (and its captures kept for EKFAC's stage 3)
    factors_now = bool(resolve(opts.update_factors, step))
    layers, statistics, decay = dict(state.layers), None, 1.0
    if factors_now:
        if captures is not None and batch_factors is not None:
            raise ValueError("give captures= or batch_factors=, not both")
        if captures is None and batch_factors is None and factor_reducer is None:
            raise ValueError("update_factors=True needs captures= (from kfac_func.capture)")
        decay = opts.decay_at(step)
        local = batch_factors or {}
        if captures is not None:
            local = local_batch_factors(state, captures, opts.gram_dtype)
            statistics = as_list(captures)
        nonfinite = opts.nonfinite
        layers = reduce_factors(state, names, local, plan, comm, decay, nonfinite, factor_reducer)
    # stage 3: the owners' decompositions on the grad workers, the eigenbasis moments
    # carried into new bases, EKFAC's corrected eigenvalues from this step's statistics
    before = moment_bases(layers)
    inverses_now = bool(resolve(opts.update_inverses, step))
    layers, fresh = decompose_owned(
        state,
        layers,
        names,
        plan,
        comm,
        stage.damping,
        inverses_now,
        opts.batched_eigh,
        hold=held_layers(layers, stage.orthogonal, step) if inverses_now else (),
    )
    carry_moments(layers, before, fresh)
    ortho = stage.orthogonal
    if ortho is not None:  # the layers this rank steps orthogonally: momenta and powers
        workers = {n: layers[n] for n in names if comm.rank in plan.layers[n].grad_workers}
        prepare_layers(layers, orthogonal_layers(workers, ortho), ortho, fresh)
    if state.config.compute_method == "ekfac" and statistics is not None:
        dtype = state.config.inv_dtype
        reduce_scales(layers, names, statistics, plan, comm, dtype, decay, opts.nonfinite, fresh)
    changes: Changes = {}
    if layouts is not None:  # DTensor gradients: see kfac_func.distributed.sharded
        out = precondition_sharded(
            layers, grads, layouts, names, plan, comm, stage, opts.kl_clip, opts.lr, changes
        )
        return out, _finished(state, layers, changes)
    if stage.basis_moments is not None or stage.orthogonal is not None or opts.sync_free:
        rows = {}  # eigenbasis moments and orthogonal steps need the gradient matrix itself
    elif rows is None and captures is not None and comm.world_size == 1:
        rows = captured_rows(state, captures)
    mine = [
        name
        for name in names
        if comm.rank in plan.layers[name].grad_workers and layers[name].decomposition is not None
    ]
    # stage 4: the layers this rank preconditions, group by group (validates every
    # gradient before any travels; the default mode's checks are read once, warned or raised)
    owned = preconditioned_layers(layers, grads, mine, stage, rows=rows or {}, changes=changes)
    received = _exchange(layers, grads, names, owned, plan, comm, opts.sync_free)
    # the default mode applies the layers that were preconditioned (read with the flags)
    selected = [
        (layers[r.name].spec, r.result, r.grad, None if r.done is True else r.done)
        for r in received
        if r.done is not False
    ]
    out = apply_selected(grads, selected, kl_clip=opts.kl_clip, lr=opts.lr, step=step)
    new = _finished(state, layers, changes)
    if opts.sync_free and factors_now:  # this step reads the device anyway
        report_layers(new.layers)
    return out, new


def _exchange(
    layers: Mapping[str, LayerState],
    grads: Mapping[str, torch.Tensor],
    names: list[str],
    owned: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
    plan: Plan,
    comm: Communicator,
    sync_free: bool,
) -> list[_Received]:
    """Stage 5: every layer's preconditioned gradient on every rank that applies it.

    Without broadcasts (``COMM_OPT``) each rank has what it preconditioned. Otherwise each
    layer's grad worker sends its result with a flag (whether it preconditioned the
    layer; under ``sync_free`` the device check itself) to its receiver group. In the
    default mode the flags are read in one host synchronisation; under ``sync_free``
    they stay on the device and select there."""
    if not plan.broadcast_gradients:
        return [
            _Received(name, layer_matrix(layers[name], grads), p, flag if sync_free else True)
            for name, (p, flag) in ((n, owned[n]) for n in names if n in owned)
        ]
    pending: list[tuple[str, torch.Tensor, Pending]] = []
    ranks = plan.receiver_group_of(comm.rank)
    for name in names:
        m = layer_matrix(layers[name], grads)
        p, flag = owned.get(name, (m, None))
        if flag is None or not sync_free:  # whether the sender preconditioned the layer
            flag = torch.full((1,), float(p is not m), dtype=m.dtype, device=m.device)
        src = plan.src_of(name, comm.rank)
        sent = [p, flag.to(m.dtype).reshape(1)]
        if comm.rank != src:
            sent[0] = torch.empty_like(m)
        pending.append((name, m, comm.broadcast(sent, src=src, ranks=ranks, kind="gradients")))
    got = [(name, m, work.wait()) for name, m, work in pending]
    if sync_free:  # the senders' flags select on the device
        return [_Received(name, m, res[0], res[1][0] > 0) for name, m, res in got]
    flags = [res[1] for *_, res in got]  # read in one host synchronisation
    ok = torch.cat([f.to(flags[0].device) for f in flags]).tolist() if flags else []
    return [_Received(name, m, res[0], bool(k)) for (name, m, res), k in zip(got, ok)]


def _finished(state: KFACState, layers: dict[str, LayerState], changes: Changes) -> KFACState:
    """Stage 6's state: the running moments the grad workers computed, one step on."""
    for name, change in changes.items():
        layers[name] = layers[name].replace(**change)
    return state.replace(layers=layers, step=state.step + 1)
