"""The preconditioning stage of every step: layers of one shape preconditioned together.

Preconditioning one layer costs a few dozen small tensor operations, and the Python
around them; on a GPU each operation is a kernel launch, so a deep model's step is
launch-bound. Here the layers whose states and gradients have the same shapes, dtypes,
kind and settings (:func:`~kfac_func.step.grouping.group_key`) form a *group*: each of
their tensors is stacked once, the one-layer function
(:func:`~kfac_func.step.layer_step.precondition_with`) runs once
over the stacks under :func:`torch.func.vmap`, and the results are unbound into the
layers. The operations of a step grow with the number of
groups, not of layers: a transformer has a handful of groups whatever its depth.

A group holds two layers or more; a layer alone, one whose rows make its
preconditioning cheaper (:func:`~kfac_func.step.checks.rows_cheaper`), and every layer
when a step asks for ``grouped=False`` run as one-layer units of the same code, without
stacking or vmap: their numbers are the groups' up to the rounding of batched products
(the same formulas, in the same dtypes; the kl_clip terms are summed in name order
either way). The default mode's checks (finiteness, and whether a layer's rows reproduce
its gradient) are computed on the device and read in one host synchronisation;
``sync_free`` never reads them (see :mod:`kfac_func.step.sync_free`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.func import vmap

from kfac_func.blocks import LayerSpec, Rows
from kfac_func.blocks.spec import cast
from kfac_func.core.factors import rows_match
from kfac_func.core.preconditioning import kl_clip_scale_of_vector, kl_clip_term
from kfac_func.core.stacks import stacked
from kfac_func.state import LayerState
from kfac_func.step.checks import layer_grads, rows_cheaper, validate_grads
from kfac_func.step.grouping import GROUPED_FIELDS, leaves_of, plan_groups, rebuild
from kfac_func.step.hyper import (
    Hyper,
    NonFinite,
    clip_and_rate,
    non_finite,
    take,
)
from kfac_func.step.layer_step import StageSettings, precondition_with
from kfac_func.step.sync_free import all_finite_tensor, count_skips, keep_where

__all__ = ["precondition_layers", "preconditioned_layers"]


class _Unit:
    """Layers computed together (stacked, under vmap) or one layer (as it is)."""

    def __init__(
        self, names: list[str], layers: Mapping[str, LayerState], grads: Any, on_device: bool
    ) -> None:
        self.names = names
        self.states = [layers[n] for n in names]
        self.first = self.states[0]
        self.batched = len(names) > 1
        spec = self.first.spec
        pairs = [layer_grads(ls.spec, grads, checked=True) for ls in self.states]
        # a layer alone whose check the host reads (the default mode) is proved finite
        # by its sum, read with the others' (see _check); None: the layer counts only
        # if it passed, so its results need no selection on the device
        self.finite: torch.Tensor | None = None
        if not self.batched:
            self.m = spec.block.to_matrix(spec, *pairs[0])
            if on_device:
                self.finite = all_finite_tensor(self.m)
            return
        w = torch.stack([p[0] for p in pairs])
        if pairs[0][1] is None:
            self.m = vmap(lambda w: spec.block.to_matrix(spec, w, None))(w)
        else:
            b = torch.stack([p[1] for p in pairs])  # type: ignore[misc]
            self.m = vmap(lambda w, b: spec.block.to_matrix(spec, w, b))(w, b)
        rows = self.m.reshape(len(names), -1)  # the extremes propagate NaN (and amin and
        # amax along a dimension are several times faster than aminmax)
        self.finite = torch.isfinite(rows.amin(1)) & torch.isfinite(rows.amax(1))

    def fields(self) -> list[torch.Tensor] | None:
        """The tensors of :data:`GROUPED_FIELDS`, stacked, when batched (a stack that the
        layers' tensors are already views of is taken as it is, see :func:`stacked`);
        None for one layer (its state holds them as they are). Sets :attr:`relaid`: the
        layers' decompositions as views of fresh stacks (their new layout, for the state;
        None when there is nothing to change)."""
        self.relaid: list[Any] | None = None
        if not self.batched:
            return None
        per = [[t for f in GROUPED_FIELDS for t in leaves_of(getattr(ls, f))] for ls in self.states]
        out = [stacked(xs) for xs in zip(*per)]
        k = len(leaves_of(self.first.decomposition))
        if any(fresh for _, fresh in out[:k]) and not torch.compiler.is_compiling():
            views = list(zip(*(t.unbind(0) for t, _ in out[:k])))
            self.relaid = [rebuild(ls.decomposition, iter(v)) for ls, v in zip(self.states, views)]
        return [t for t, _ in out]

    def run(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)``: vmapped over the stacked ``args`` when batched."""
        return vmap(fn)(*args) if self.batched else fn(*args)

    def per_layer(self, t: torch.Tensor) -> Sequence[torch.Tensor]:
        """A stacked result, one tensor per layer."""
        return t.unbind(0) if self.batched else (t,)


def precondition_layers(
    layers: Mapping[str, LayerState],
    grads: Mapping[str, torch.Tensor],
    settings: StageSettings,
    *,
    kl_clip: Hyper | None,
    lr: Hyper,
    rows: Mapping[str, Rows] | None = None,
    consume_rows: bool = False,
    changes: dict[str, dict[str, object]] | None = None,
    grouped: bool = True,
) -> dict[str, torch.Tensor]:
    """:func:`~kfac_func.precondition_grads` of ``layers`` under the stage's ``settings``
    (a resolved damping), computed group by group (see the module docstring;
    ``grouped=False``: one layer at a time).

    In the default mode a layer whose gradients hold NaN/Inf passes them unchanged (warned
    about, in the layers' order, or raised: ``settings.nonfinite``), and a layer whose
    ``rows`` reproduce its gradient is preconditioned from them where that is cheaper;
    with ``settings.sync_free`` each layer's finiteness (and its decomposition's
    ``usable`` flag) selects the result or the raw gradient on the device. With
    ``consume_rows``, each layer's entry is removed from a mutable ``rows`` once taken.
    The new running moments of each layer (eigenbasis moments, orthogonal
    momenta; under ``sync_free`` the ``grad_skips`` counter too) go into
    ``changes[layer]`` (for ``LayerState.replace``). The caller has checked ``grads``
    (:func:`~kfac_func.step.checks.validate_grads`, before anything changed).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import kfac_func as kf
        >>> model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
        >>> state = kf.decompose(kf.init(kf.register(model), convention="kfac-pytorch"),
        ...                      damping=1.0)
        >>> grads = {k: torch.ones_like(p) for k, p in model.named_parameters()}
        >>> out = precondition_layers(state.layers, grads, StageSettings(1.0, step=0),
        ...                           kl_clip=None, lr=0.1)
        >>> out["1.bias"]
        tensor([0.5000, 0.5000, 0.5000])
    """
    clip, rate = clip_and_rate(kl_clip, lr, settings.step)
    decomposed = [name for name, ls in layers.items() if ls.decomposition is not None]
    taken = {name: take(rows, name, consume_rows) for name in decomposed}
    kept, results = _compute(
        layers, grads, decomposed, taken, settings, changes, clip is not None, grouped
    )
    sync_free = settings.sync_free
    terms = [res["term"].reshape(-1) for _, res in results] if clip is not None else []
    scale: torch.Tensor | None = None
    if clip is not None and terms:
        # summed in name order, so that ranks listing the layers in another order, and
        # every grouping, round it alike
        order = [name for unit, _ in results for name in unit.names]
        place = {name: k for k, name in enumerate(order)}
        names = sorted(order)
        vector = torch.cat(terms) if len(terms) > 1 else terms[0]
        if names != order:
            index = torch.tensor([place[n] for n in names], device=vector.device)
            vector = vector.index_select(0, index)
        dtype = next(res["p"].dtype for unit, res in results if names[0] in unit.names)
        scale = kl_clip_scale_of_vector(vector, clip, rate, dtype=dtype)

    out = dict(grads)
    for unit, res in results:
        write = functools.partial(_written, unit.first.spec, scale, sync_free)
        new = unit.run(write, res["p"], unit.m, res["select"])
        ws = unit.per_layer(new[0])
        bs = unit.per_layer(new[1]) if len(new) > 1 else [None] * len(ws)
        for i, (name, ls) in enumerate(zip(unit.names, unit.states)):
            if name in kept:  # default mode: the finite layers only
                ls.spec.block.write_grads(ls.spec, out, grads, ws[i], bs[i])
    return out


def preconditioned_layers(
    layers: Mapping[str, LayerState],
    grads: Mapping[str, torch.Tensor],
    names: Sequence[str],
    settings: StageSettings,
    *,
    rows: Mapping[str, Rows] | None = None,
    changes: dict[str, dict[str, object]] | None = None,
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The preconditioned gradient matrices of the decomposed layers among ``names``,
    computed group by group, before the kl_clip scale: ``{layer: (P, finite)}`` with
    ``finite`` a 0-d bool tensor. In the default mode only the layers whose gradients are
    finite are there (the others warned about or raised, as
    :func:`precondition_layers` does); with ``sync_free`` every one, its
    flag deciding on the device. The changes of the layer states go into
    ``changes[layer]`` (as :func:`precondition_layers`'s). The distributed step
    preconditions the layers a rank owns with it.

    Example:
        >>> import torch
        >>> import kfac_func as kf
        >>> layer = torch.nn.Linear(3, 3)
        >>> state = kf.init(kf.register(layer), convention="kfac-pytorch")
        >>> state = kf.decompose(state, damping=1.0)
        >>> grads = {k: torch.ones_like(p) for k, p in layer.named_parameters()}
        >>> out = preconditioned_layers(state.layers, grads, [""], StageSettings(1.0, step=0))
        >>> out[""][0][:, -1], out[""][1]
        (tensor([0.5000, 0.5000, 0.5000]), tensor(True))
    """
    validate_grads(layers, grads)
    chosen = [n for n in names if layers[n].decomposition is not None]
    taken = {n: None if rows is None else rows.get(n) for n in chosen}
    kept, results = _compute(layers, grads, chosen, taken, settings, changes, False)
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for unit, res in results:
        select = res["select"]
        if select is None:  # a layer alone that passed the host's check
            select = torch.ones((), dtype=torch.bool, device=res["p"].device)
        ps, flags = unit.per_layer(res["p"]), unit.per_layer(select)
        out.update((n, (p, f)) for n, p, f in zip(unit.names, ps, flags) if n in kept)
    return out


def _compute(
    layers: Mapping[str, LayerState],
    grads: Mapping[str, torch.Tensor],
    names: Sequence[str],
    taken: Mapping[str, Rows | None],
    settings: StageSettings,
    changes: dict[str, dict[str, object]] | None,
    kl_terms: bool,
    grouped: bool = True,
) -> tuple[set[str], list[tuple[_Unit, dict[str, Any]]]]:
    """The layers of ``names`` (decomposed layers) whose results count (every one under
    ``sync_free``; in the default mode the finite ones, see :func:`_check`) and the
    results of :func:`_stage` (with their kl_clip terms if ``kl_terms``) of each unit
    (layers stacked together, or one alone: each alone unless ``grouped``) that has a
    layer that counts; the changes of the counted layers' states go into ``changes``
    (:func:`_record`)."""
    nonfinite = settings.nonfinite
    alone: list[str] = []
    if not settings.sync_free and settings.basis_moments is None and settings.orthogonal is None:
        alone = [n for n in names if rows_cheaper(layers[n].spec, taken.get(n))]
    plan = plan_groups(layers, names, grads, alone=alone if grouped else names)
    units = [_Unit(group, layers, grads, settings.sync_free) for group in plan]
    use_rows = {} if settings.sync_free else _check(units, layers, grads, taken, alone, nonfinite)
    kept = set(names) if settings.sync_free else set(use_rows)
    results = []
    for unit in units:
        name = unit.names[0]
        if unit.finite is None and name not in kept:  # a layer alone that failed the check
            continue
        layer_rows = taken.get(name) if use_rows.get(name) else None
        stage = functools.partial(_stage, settings, kl_terms, unit.first, layer_rows)
        if torch.compiler.is_compiling():
            # the moments' count changes from call to call, so it is symbolic in a
            # compiled step: handed to the vmapped function as a tensor, which its graph
            # takes as an input (a symbolic int closed over by vmap is not)
            device = unit.m.device
            counts = [_scalar(ls.moment_count, device) for ls in unit.states]
            count = torch.stack(counts) if unit.batched else counts[0]
            res = unit.run(stage, unit.m, unit.finite, unit.fields(), count)
        else:
            res = unit.run(stage, unit.m, unit.finite, unit.fields())
        results.append((unit, res))
    for unit, res in results:
        _record(unit, res, kept, settings, changes)
    return kept, results


def _record(
    unit: _Unit,
    res: Mapping[str, Any],
    kept: set[str],
    settings: StageSettings,
    changes: dict[str, dict[str, object]] | None,
) -> None:
    """The changes of the unit's layer states into ``changes[layer]``: the new running
    moments (of the ``kept`` layers only), the moments' count, and the decompositions as
    views of the group's stack where they were stacked afresh."""
    if changes is None:
        return
    news = {k: unit.per_layer(v) for k, v in res["change"].items()}
    for i, (name, ls) in enumerate(zip(unit.names, unit.states)):
        if name not in kept:
            continue
        mine: dict[str, object] = {k: v[i] for k, v in news.items()}
        if unit.relaid is not None:  # the same values, as views of the group's stack
            mine["decomposition"] = unit.relaid[i]
        if settings.basis_moments is not None:
            mine["moment_count"] = ls.moment_count + 1
        if mine:
            changes[name] = mine


def _scalar(value: int, device: torch.device) -> torch.Tensor:
    """A counter as a 0-d float64 tensor."""
    return torch.scalar_tensor(value, dtype=torch.float64, device=device)


def _stage(
    settings: StageSettings,
    kl_terms: bool,
    first: LayerState,
    layer_rows: Rows | None,
    m: torch.Tensor,
    finite: torch.Tensor | None,
    leaves: list[torch.Tensor] | None,
    count: torch.Tensor | None = None,
) -> dict[str, Any]:
    """One layer's preconditioned matrix ``p``, the tensors of its state that change
    (``change``) and its kl_clip term (``term``, 0 where ``finite`` is False; ``finite``
    None: a layer alone that passed the host's check): the function a group runs under
    vmap. ``first`` gives the static parts of the layer state, ``leaves`` the tensors of
    :data:`GROUPED_FIELDS` (as :meth:`_Unit.fields` lists them; None: ``first``'s own, a
    unit of one layer)."""
    ls = first
    if leaves is not None:
        taken = iter(leaves)
        ls = first.replace(**{f: rebuild(getattr(first, f), taken) for f in GROUPED_FIELDS})
    if count is not None:  # compiled: the counters as tensors (see the caller)
        ls = ls.replace(moment_count=count)
    mine: dict[str, dict[str, object]] = {}
    p = precondition_with(ls, m, settings, layer_rows, mine)
    new = mine.get(ls.spec.name, {})
    change: dict[str, object] = {
        k: v for k, v in new.items() if isinstance(v, torch.Tensor) and k != "moment_count"
    }
    select = finite
    if settings.sync_free:
        assert finite is not None
        chosen = finite if ls.usable is None else finite & ls.usable  # see decompose_groups
        change = keep_where(ls, change, chosen)
        change["grad_skips"] = count_skips(ls, finite)
        select = chosen
    out: dict[str, Any] = {"p": p, "change": change, "select": select}
    if kl_terms:
        term = kl_clip_term(p, m)
        out["term"] = term if select is None else torch.where(select, term, torch.zeros_like(term))
    return out


def _written(
    spec: LayerSpec,
    scale: torch.Tensor | None,
    select: bool,
    p: torch.Tensor,
    m: torch.Tensor,
    finite: torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    """The gradients written for one layer (the weight's, and the bias's if it has one):
    from ``p`` scaled by the kl_clip factor, where ``finite`` if ``select`` (else from the
    raw matrix ``m``); without ``select`` (the caller writes finite layers only) ``p``, the
    step's own temporary, is scaled in place."""
    if not select:
        out = p if scale is None else p.mul_(cast(scale, p.dtype))
    else:
        scaled = p if scale is None else p * cast(scale, p.dtype)
        out = torch.where(finite, scaled, cast(m, p.dtype))
    w, b = spec.block.from_matrix(spec, out)
    return (w,) if b is None else (w, b)


def _check(
    units: Sequence[_Unit],
    layers: Mapping[str, LayerState],
    grads: Mapping[str, torch.Tensor],
    rows: Mapping[str, Rows | None],
    alone: Sequence[str],
    nonfinite: NonFinite,
) -> dict[str, bool]:
    """The default mode's checks, read in one host synchronisation: every layer's
    finiteness (warned about, in the layers' order, or raised), and whether the rows of
    each of ``alone`` reproduce its gradient. Returns ``{finite layer: use its rows}``.

    A layer alone is read by the sum of its gradient matrix: a finite sum proves every
    entry finite, and only a sum that is not (an overflow, or a NaN/Inf) is checked entry
    by entry."""
    flags = [u.finite.reshape(-1) for u in units if u.finite is not None]
    order = [name for u in units if u.finite is not None for name in u.names]
    for name in alone:
        spec = layers[name].spec
        w, b = layer_grads(spec, grads, checked=True)
        layer_rows = rows[name]
        assert layer_rows is not None
        flags.append(rows_match(spec, w, b, layer_rows).reshape(1))
    lone = [u for u in units if u.finite is None]
    # one read: the flags as 0/1, then the lone layers' sums (in float32: a sum that
    # overflows it is checked exactly below)
    parts = [f.float() for f in flags]
    if lone:
        parts.append(torch.stack([cast(u.m.sum(), device=lone[0].m.device) for u in lone]).float())
    if not parts:
        return {}
    device = parts[0].device
    whole = torch.cat([cast(t, device=device) for t in parts]) if len(parts) > 1 else parts[0]
    read = whole.tolist()
    finite = {name: bool(v) for name, v in zip(order, read)}
    by_rows = {name: bool(v) for name, v in zip(alone, read[len(order) :])}
    for u, total in zip(lone, read[len(order) + len(alone) :]):  # a sum not finite: exactly
        finite[u.names[0]] = math.isfinite(total) or bool(torch.isfinite(u.m).all())
    out: dict[str, bool] = {}
    for name in layers:
        if name not in finite:
            continue
        if finite[name]:
            out[name] = bool(by_rows.get(name, False))
        else:
            spec = layers[name].spec
            non_finite(name, f"the gradients of {list(spec.param_names())}", nonfinite)
    return out
