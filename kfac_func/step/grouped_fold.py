"""The factor stage of the grouped step: running averages of equal-shaped layers folded
together.

:func:`~kfac_func.step.accumulate.fold_layers` folds one layer at a time (a few
operations each: the average, its checks, the selection of the old factors where the
batch's were not finite). :func:`fold_layers_grouped` stacks the batch and running
factors of the layers whose factors have the same shapes, dtypes and devices, and folds
each group in those few operations; the numbers are the same (the same elementwise
formula), and all the checks are read in one host synchronisation
(:func:`~kfac_func.step.accumulate.settle_folds`). Unlike the per-layer stage it holds
the batch factors of all layers at once.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, MutableMapping, Sequence

import torch

from kfac_func.core.stacks import stacked
from kfac_func.state import KFACConfig, LayerState
from kfac_func.step.accumulate import (
    LayerFactors,
    add_skips,
    fold_deferred,
    host_knows_data,
    running_average,
    settle_folds,
    settle_on_device,
    takes_batch,
)
from kfac_func.step.hyper import NonFinite

__all__ = ["all_finite_rows", "fold_layers_grouped", "no_data_rows"]


def all_finite_rows(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``(n, len(tensors))`` bools: whether row ``i`` (``t[i]``) of each stacked tensor is
    finite, by its extremes, checked together in one ``isfinite``.

    Example:
        >>> t = torch.tensor([[1.0, 2.0], [float("inf"), 0.0]])
        >>> all_finite_rows([t, torch.zeros(2, 3)])
        tensor([[ True,  True],
                [False,  True]])
    """
    n = tensors[0].shape[0]
    rows = [t.reshape(n, -1) for t in tensors]  # amin and amax: faster than aminmax here
    ends = [torch.stack([r.amin(1), r.amax(1)], dim=1) for r in rows]
    return torch.isfinite(torch.stack(ends, dim=1)).all(dim=2)


def fold_layers_grouped(
    layers: MutableMapping[str, LayerState],
    batch_of: Callable[[str, LayerState], LayerFactors | None],
    decay: float,
    config: KFACConfig,
    nonfinite: NonFinite,
    sync_free: bool = False,
) -> None:
    """:func:`~kfac_func.step.accumulate.fold_layers`, group by group (see the module
    docstring); the same factors, counters and warnings (``sync_free``: the skips
    counted on the device, as there).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import kfac_func as kf
        >>> state = kf.init(kf.register(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))))
        >>> layers = dict(state.layers)
        >>> batch = (torch.eye(3), torch.eye(2), 1.0)
        >>> fold_layers_grouped(layers, lambda n, ls: batch, 0.5, state.config, "skip")
        >>> layers["1"].factor_updates, layers["1"].a_factor[0, 0].item()
        (1, 1.0)
    """
    batches: dict[str, LayerFactors] = {}
    groups: dict[Hashable, list[str]] = {}
    for name in list(layers):
        batch = batch_of(name, layers[name])
        if batch is None:
            continue
        batches[name] = batch
        groups.setdefault(_key(layers[name], batch, config), []).append(name)
    pending: list[tuple[str, torch.Tensor, LayerState]] = []
    for names in groups.values():
        if len(names) == 1:
            (name,) = names
            before = layers[name]
            a, g, _ = batches.pop(name)
            layers[name], checks = fold_deferred(before, a, g, decay, config, sync_free)
            pending.append((name, checks, before))
            continue
        states = [layers[n] for n in names]
        # the batch factors of a group built together are views of one stack already
        a = stacked([batches[n][0] for n in names])[0]
        g = stacked([batches[n][1] for n in names])[0]
        for n in names:
            del batches[n]
        old_a = stacked([ls.a_factor for ls in states])[0]
        old_g = stacked([ls.g_factor for ls in states])[0]
        if takes_batch(states[0], config):
            new_a, new_g = a, g
        else:
            new_a, new_g = running_average(old_a, a, decay), running_average(old_g, g, decay)
        empty = no_data_rows(states, config) if sync_free else None
        if empty is not None:  # layers whose updates were all skipped take the batch
            new_a = torch.where(_rows(empty, a), a, new_a)
            new_g = torch.where(_rows(empty, g), g, new_g)
        checks = all_finite_rows([a, g, new_a, new_g])
        ok = checks[:, 0] & checks[:, 1]
        # selected into the new stacks themselves (no further group-sized temporary)
        out_a = _select(ok, checks[:, 2], new_a, a, old_a)
        out_g = _select(ok, checks[:, 3], new_g, g, old_g)
        skips = _group_skips(states, ok) if sync_free else [None] * len(names)
        for name, ls, fa, fg, c, s in zip(
            names, states, out_a.unbind(0), out_g.unbind(0), checks.unbind(0), skips
        ):
            layers[name] = ls.replace(
                a_factor=fa, g_factor=fg, factor_updates=ls.factor_updates + 1
            )
            if s is not None:
                layers[name] = layers[name].replace(factor_skips=s)
            else:
                pending.append((name, c, ls))
        del states, a, g, old_a, old_g, new_a, new_g, out_a, out_g
    if sync_free:
        settle_on_device(layers, pending)
    else:
        settle_folds(layers, pending, nonfinite)


def no_data_rows(states: Sequence[LayerState], config: KFACConfig) -> torch.Tensor | None:
    """:func:`~kfac_func.step.accumulate.no_data` of a group, one flag per layer, in a
    few operations (None where the host knows for every layer)."""
    if all(host_knows_data(ls, config) for ls in states):
        return None
    device = states[0].a_factor.device
    zero = torch.zeros((), dtype=torch.int64, device=device)
    skips = stacked([zero if ls.factor_skips is None else ls.factor_skips for ls in states])[0]
    # a layer the host knows about compares with -1, which no count equals
    known = [-1 if host_knows_data(ls, config) else ls.factor_updates for ls in states]
    return skips == torch.tensor(known, dtype=torch.int64, device=device)


def _group_skips(states: Sequence[LayerState], ok: torch.Tensor) -> list[torch.Tensor]:
    """The group's ``factor_skips`` counters after this update (``ok``: one flag per
    layer), computed together."""
    prev = [ls.factor_skips for ls in states]
    if all(p is None for p in prev):
        return list(add_skips(None, ok).unbind(0))
    zero = torch.zeros((), dtype=torch.int64, device=ok.device)
    stack = stacked([zero if p is None else p.to(ok.device) for p in prev])[0]
    return list(add_skips(stack, ok).unbind(0))


def _select(
    ok: torch.Tensor,
    folded: torch.Tensor,
    new: torch.Tensor,
    batch: torch.Tensor,
    old: torch.Tensor,
) -> torch.Tensor:
    """Per row: ``new`` where the batch was finite (``ok``) and the fold too (``folded``),
    the batch where only the fold was not (a running factor restarted), else ``old``;
    written into ``new`` unless it is the batch itself (the first update)."""
    out = new if new is not batch else None
    if out is None:
        return torch.where(_rows(ok, new), new, old)
    torch.where(_rows(folded, new), new, batch, out=out)
    return torch.where(_rows(ok, new), out, old, out=out)


def _rows(flags: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``flags`` (one per row of ``like``) shaped to broadcast over ``like``."""
    return flags.reshape(-1, *([1] * (like.dim() - 1)))


def _key(ls: LayerState, batch: LayerFactors, config: KFACConfig) -> Hashable:
    """What layers must share to be folded together; a tied layer's stacked uses, or
    factors on another device than the batch's, fold alone."""
    a, g, _ = batch
    alone = (
        ls.spec.block.stacked_uses
        or a.dim() != ls.a_factor.dim()
        or ls.a_factor.device != a.device
        or ls.g_factor.device != g.device
    )
    if alone:
        return ("alone", ls.spec.name)
    first = takes_batch(ls, config)
    shapes = tuple((tuple(t.shape), t.dtype, t.device) for t in (a, g, ls.a_factor, ls.g_factor))
    return (shapes, first)
