"""EKFAC across ranks: the per-example moments of every rank's examples, summed.

Every rank projects its own examples' gradients into the layer's eigenbasis. Under
``COMM_OPT`` every rank holds every basis; under ``HYBRID_OPT`` and ``MEM_OPT`` the first
grad worker of each layer lends its basis to the other ranks for the factor step
(:func:`lend_bases`: one broadcast per layer; ranks that are no grad worker drop it
afterwards). The sums of the moments and the example counts are then reduced in the plan's
order (:class:`~kfac_func.distributed.reducer.OrderedReducer`), so every rank sees the
same global moments, and the grad workers fold them into the same scale. The math is that
of :mod:`kfac_func.step.ekfac`.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, MutableMapping, Sequence

import torch

from kfac_func.captures import Captures
from kfac_func.core.decomposition import EKFACDecomposition
from kfac_func.distributed.communicator import Communicator
from kfac_func.distributed.plan import Plan
from kfac_func.distributed.reducer import OrderedReducer
from kfac_func.state import LayerState
from kfac_func.step.ekfac import fold_moments, layer_moment_sums
from kfac_func.step.hyper import NonFinite

__all__ = ["lend_bases", "reduce_scales"]


def lend_bases(
    layers: Mapping[str, LayerState],
    names: Sequence[str],
    plan: Plan,
    comm: Communicator,
    dtype: torch.dtype,
) -> dict[str, EKFACDecomposition]:
    """The EKFAC decomposition of every layer of ``names`` that has one, on every rank:
    a rank's own (grad workers), or a lent one holding the first grad worker's bases and a
    zero scale (the others); ``dtype`` is the decompositions' (the state's ``inv_dtype``).
    A collective: every rank calls it, with the same plan."""
    everyone = tuple(range(comm.world_size))
    out: dict[str, EKFACDecomposition] = {}
    for name in names:
        ls, lp = layers[name], plan.layers[name]
        dec = ls.decomposition
        if tuple(lp.grad_workers) == everyone:
            if isinstance(dec, EKFACDecomposition):
                out[name] = dec
            continue
        spec = ls.spec
        device = ls.a_factor.device
        shapes = [
            shape for shape, diagonal in zip(spec.factor_shapes, spec.diagonal) if not diagonal
        ]
        if isinstance(dec, EKFACDecomposition):
            sent = [q for q in (dec.qa, dec.qg) if q is not None]
            have = torch.ones(1, dtype=dtype, device=device)
        else:
            sent = [torch.zeros(s, dtype=dtype, device=device) for s in shapes]
            have = torch.zeros(1, dtype=dtype, device=device)
        got = comm.broadcast(
            [*(t.to(dtype) for t in sent), have],
            src=lp.grad_workers[0],
            ranks=everyone,
            kind="ekfac",
        ).wait()
        if not float(got[-1][0]):
            continue  # no decomposition yet
        if isinstance(dec, EKFACDecomposition):
            out[name] = dec
            continue
        bases = iter(got[:-1])
        qa = None if spec.a_diagonal else next(bases)
        qg = None if spec.g_diagonal else next(bases)
        scale = torch.zeros(spec.matrix_shape, dtype=dtype, device=device)
        out[name] = EKFACDecomposition(qa, qg, scale)
    return out


def reduce_scales(
    layers: MutableMapping[str, LayerState],
    names: Sequence[str],
    micro: Sequence[Captures],
    plan: Plan,
    comm: Communicator,
    dtype: torch.dtype,
    decay: float,
    nonfinite: NonFinite,
    fresh: Collection[str] = (),
) -> None:
    """Fold the moments of all ranks' examples into every EKFAC layer's scale (in place),
    restarting the layers in ``fresh`` (their basis is new)."""
    bases = lend_bases(layers, names, plan, comm, dtype)
    ekfac = [n for n in names if n in bases]
    if not ekfac:
        return
    reducer = OrderedReducer(comm, ekfac, symmetric=[False, False], kind="ekfac")
    for name in ekfac:
        dec = bases[name]
        sums = layer_moment_sums(layers[name].spec, micro, dec)
        total, count = (torch.zeros_like(dec.scale), 0) if sums is None else sums
        n = torch.full((1,), float(count), dtype=dec.scale.dtype, device=dec.scale.device)
        reducer.ready(name, [total.to(dec.scale.dtype), n])
    reduced = reducer.finish(lambda name: [])
    for name in ekfac:
        total, n = reduced[name]
        examples = float(n[0])
        if examples == 0 or not isinstance(layers[name].decomposition, EKFACDecomposition):
            continue  # (a lent basis: this rank keeps no scale)
        layers[name] = fold_moments(
            layers[name], total / examples, decay, nonfinite, restart=name in fresh
        )
