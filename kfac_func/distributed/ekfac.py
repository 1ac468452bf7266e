"""EKFAC across ranks: the per-example moments of every rank's examples, summed.

Every rank projects its own examples' gradients into the eigenbasis it holds, so EKFAC
under a plan needs every rank to hold every layer's decomposition: ``COMM_OPT``
(:func:`check_ekfac_plan`). The sums of the moments and the example counts are reduced
in the plan's order (:class:`~kfac_func.distributed.reducer.OrderedReducer`), so every rank
folds the same global moments into the same scale. The math is that of
:mod:`kfac_func.step.ekfac`.
"""

from __future__ import annotations

from collections.abc import Collection, MutableMapping, Sequence

import torch

from kfac_func.captures import Captures
from kfac_func.core.decomposition import EKFACDecomposition
from kfac_func.distributed.communicator import Communicator
from kfac_func.distributed.plan import Plan
from kfac_func.distributed.reducer import OrderedReducer
from kfac_func.state import LayerState
from kfac_func.step.ekfac import fold_moments, layer_moment_sums
from kfac_func.step.hyper import NonFinite

__all__ = ["check_ekfac_plan", "reduce_scales"]


def check_ekfac_plan(plan: Plan) -> None:
    """Raise a ValueError unless every rank is a grad worker of every layer (COMM_OPT)."""
    everyone = tuple(range(plan.world_size))
    partial = [n for n, lp in plan.layers.items() if tuple(lp.grad_workers) != everyone]
    if partial:
        raise ValueError(
            f"compute_method='ekfac' needs every rank to hold every layer's eigenbasis "
            f"(grad_worker_fraction=1, COMM_OPT); the plan ({plan.strategy.name}) gives "
            f"layers {partial[:3]} to ranks {list(plan.layers[partial[0]].grad_workers)} only"
        )


def reduce_scales(
    layers: MutableMapping[str, LayerState],
    names: Sequence[str],
    micro: Sequence[Captures],
    comm: Communicator,
    decay: float,
    nonfinite: NonFinite,
    fresh: Collection[str] = (),
) -> None:
    """Fold the moments of all ranks' examples into every EKFAC layer's scale (in place),
    restarting the layers in ``fresh`` (their basis is new)."""
    ekfac = [n for n in names if isinstance(layers[n].decomposition, EKFACDecomposition)]
    if not ekfac:
        return
    reducer = OrderedReducer(comm, ekfac, symmetric=[False, False], kind="ekfac")
    for name in ekfac:
        dec = layers[name].decomposition
        assert isinstance(dec, EKFACDecomposition)
        sums = layer_moment_sums(layers[name].spec, micro, dec)
        total, count = (torch.zeros_like(dec.scale), 0) if sums is None else sums
        n = torch.full((1,), float(count), dtype=dec.scale.dtype, device=dec.scale.device)
        reducer.ready(name, [total.to(dec.scale.dtype), n])
    reduced = reducer.finish(lambda name: [])
    for name in ekfac:
        total, n = reduced[name]
        examples = float(n[0])
        if examples == 0:
            continue
        layers[name] = fold_moments(
            layers[name], total / examples, decay, nonfinite, restart=name in fresh
        )
