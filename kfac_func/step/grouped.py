"""The grouped step: layers of one shape preconditioned together.

A per-layer step costs a few dozen small tensor operations, and the Python around them,
for every layer; on a GPU each operation is a kernel launch, so a deep model's step is
launch-bound. Here the layers whose states and gradients have the same shapes, dtypes,
kind and settings (:func:`group_key`) form a *group*: each of their tensors is stacked
once, the per-layer function (:func:`~kfac_func.step.layer_step.precondition_with`, the
per-layer step's own) runs once over the stacks under :func:`torch.func.vmap`, and the
results are unbound into the layers. The operations of a step grow with the number of
groups, not of layers: a transformer has a handful of groups whatever its depth.

The numbers are the per-layer step's up to the rounding of batched products (the same
formulas, in the same dtypes; the kl_clip terms are summed in name order as there). A
group holds two layers or more; a layer alone, one without a decomposition and one whose
rows make its preconditioning cheaper (:func:`~kfac_func.step.checks.rows_cheaper`) run
as one-layer units of the same code, without stacking.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Hashable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch.func import vmap

from kfac_func.blocks import LayerSpec, Rows
from kfac_func.core.factors import rows_match
from kfac_func.core.preconditioning import kl_clip_scale_of_vector, kl_clip_term
from kfac_func.core.stacks import stacked
from kfac_func.state import LayerState
from kfac_func.step.basis import BasisMoments
from kfac_func.step.checks import layer_grads, rows_cheaper, validate_grads
from kfac_func.step.hyper import Hyper, NonFinite, check_hyper, non_finite, resolve, take
from kfac_func.step.layer_step import Grafting, precondition_with
from kfac_func.step.sync_free import all_finite_tensor, count_skips, keep_where

__all__ = [
    "GROUPED_FIELDS",
    "group_key",
    "plan_groups",
    "precondition_layers_grouped",
]

GROUPED_FIELDS = ("decomposition", "graft_moment", "basis_moment", "basis_momentum", "grad_skips")
"""The fields of a :class:`~kfac_func.state.LayerState` that the preconditioning reads
and that a group stacks (the factors are not read: only their dtype is)."""


def group_key(ls: LayerState, grads: Mapping[str, torch.Tensor]) -> Hashable:
    """What two layers must share to be preconditioned together: the layer's spec but for
    its names, the structure, shapes, dtypes and devices of the tensors of
    :data:`GROUPED_FIELDS` and the dtypes of its gradients and factors (the moments'
    counts, their bias correction, are compared apart: see :func:`plan_groups`).
    Validates the layer's gradients (a ValueError names the layer).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import kfac_func as kf
        >>> state = kf.decompose(kf.init(kf.register(nn.Sequential(
        ...     nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 2))), convention="kfac-pytorch"))
        >>> grads = {f"{i}.{p}": torch.zeros(s) for i, w in ((0, 3), (1, 3), (2, 2))
        ...          for p, s in (("weight", (w, 3)), ("bias", (w,)))}
        >>> keys = [group_key(state.layers[n], grads) for n in ("0", "1", "2")]
        >>> keys[0] == keys[1], keys[0] == keys[2]
        (True, False)
    """
    spec = ls.spec
    w, b = layer_grads(spec, grads)
    settings = tuple(
        getattr(spec, f.name) for f in dataclasses.fields(spec) if f.name not in _NAMES
    )
    tensors = tuple(_describe(getattr(ls, f)) for f in GROUPED_FIELDS)
    grad_types = (w.dtype, w.device, None if b is None else b.dtype)
    factor_types = (ls.a_factor.dtype, ls.g_factor.dtype)
    return (settings, spec.bias is None, tensors, grad_types, factor_types)


_NAMES = ("name", "weight", "bias")


def _describe(value: Any) -> Hashable:
    """A field's structure, shapes, dtypes and devices: None, a tensor, or a decomposition
    (a dataclass of tensors and Nones)."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.dtype, value.device)
    parts = tuple((f.name, _describe(getattr(value, f.name))) for f in dataclasses.fields(value))
    return (type(value).__name__, parts)


def _leaves(value: Any) -> list[torch.Tensor]:
    """The tensors of a field, in the order :func:`_rebuild` takes them."""
    if value is None:
        return []
    if isinstance(value, torch.Tensor):
        return [value]
    found = (getattr(value, f.name) for f in dataclasses.fields(value))
    return [t for t in found if t is not None]


def _rebuild(template: Any, leaves: Iterator[torch.Tensor]) -> Any:
    """``template`` (a field of the first layer) with its tensors taken from ``leaves``."""
    if template is None:
        return None
    if isinstance(template, torch.Tensor):
        return next(leaves)
    names = [f.name for f in dataclasses.fields(template) if getattr(template, f.name) is not None]
    return dataclasses.replace(template, **{n: next(leaves) for n in names})


def plan_groups(
    layers: Mapping[str, LayerState],
    names: Sequence[str],
    grads: Mapping[str, torch.Tensor],
    *,
    alone: Sequence[str] = (),
) -> list[list[str]]:
    """``names`` split into units computed together: each group of two layers or more
    with equal :func:`group_key` and equal moment counts, in the order of their first
    layer, then each other layer (and each of ``alone``) on its own.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import kfac_func as kf
        >>> model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2), nn.Linear(2, 3),
        ...                       nn.Linear(3, 3))
        >>> state = kf.decompose(kf.init(kf.register(model), convention="kfac-pytorch"))
        >>> grads = {k: torch.zeros_like(p) for k, p in model.named_parameters()}
        >>> plan_groups(state.layers, list(state.layers), grads)
        [['0', '3'], ['1'], ['2']]
    """
    groups: dict[Hashable, list[str]] = {}
    for name in names:
        key = ("alone", name) if name in alone else group_key(layers[name], grads)
        groups.setdefault(key, []).append(name)
    # and equal moment counts (compared, not hashed: under torch.compile a count that
    # changes from step to step is symbolic, and hashing it would recompile every step);
    # a compiled step takes each layer's count as a tensor instead (see _stage)
    if torch.compiler.is_compiling():
        together = [g for g in groups.values() if len(g) > 1]
        return together + [g for g in groups.values() if len(g) == 1]
    runs: list[list[str]] = []
    for members in groups.values():
        split: list[list[str]] = []
        for name in members:
            count = layers[name].moment_count
            same = [run for run in split if layers[run[0]].moment_count == count]
            if same:
                same[0].append(name)
            else:
                split.append([name])
        runs += split
    return [g for g in runs if len(g) > 1] + [g for g in runs if len(g) == 1]


class _Unit:
    """Layers computed together (stacked, under vmap) or one layer (as it is)."""

    def __init__(self, names: list[str], layers: Mapping[str, LayerState], grads: Any) -> None:
        self.names = names
        self.states = [layers[n] for n in names]
        self.first = self.states[0]
        self.batched = len(names) > 1
        spec = self.first.spec
        pairs = [layer_grads(ls.spec, grads) for ls in self.states]
        if not self.batched:
            self.m = spec.block.to_matrix(spec, *pairs[0])
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

    def fields(self) -> list[torch.Tensor]:
        """The tensors of :data:`GROUPED_FIELDS`, stacked when batched (a stack that the
        layers' tensors are already views of is taken as it is, see :func:`stacked`).
        Sets :attr:`relaid`: the layers' decompositions as views of fresh stacks (their
        new layout, for the state; None when there is nothing to change)."""
        per = [[t for f in GROUPED_FIELDS for t in _leaves(getattr(ls, f))] for ls in self.states]
        self.relaid: list[Any] | None = None
        if not self.batched:
            return per[0]
        out = [stacked(xs) for xs in zip(*per)]
        k = len(_leaves(self.first.decomposition))
        if any(fresh for _, fresh in out[:k]) and not torch.compiler.is_compiling():
            views = list(zip(*(t.unbind(0) for t, _ in out[:k])))
            self.relaid = [_rebuild(ls.decomposition, iter(v)) for ls, v in zip(self.states, views)]
        return [t for t, _ in out]

    def run(self, fn: Any, *args: Any, shared: tuple[Any, ...] = ()) -> Any:
        """``fn(*args, *shared)``: vmapped over the stacked ``args`` when batched (the
        ``shared`` values are the same for every layer)."""
        if not self.batched:
            return fn(*args, *shared)
        return vmap(fn, in_dims=(0,) * len(args) + (None,) * len(shared))(*args, *shared)

    def per_layer(self, t: torch.Tensor) -> Sequence[torch.Tensor]:
        """A stacked result, one tensor per layer."""
        return t.unbind(0) if self.batched else (t,)


def precondition_layers_grouped(
    layers: Mapping[str, LayerState],
    grads: Mapping[str, torch.Tensor],
    damping: float,
    *,
    kl_clip: Hyper | None,
    lr: Hyper,
    step: int,
    nonfinite: NonFinite,
    sync_free: bool = False,
    rows: Mapping[str, Rows] | None = None,
    consume_rows: bool = False,
    grafting: Grafting | None = None,
    basis_moments: BasisMoments | None = None,
    changes: dict[str, dict[str, object]] | None = None,
) -> dict[str, torch.Tensor]:
    """:func:`~kfac_func.step.precondition.precondition_layers` (``sync_free=False``) or
    :func:`~kfac_func.step.precondition.precondition_layers_sync_free` (``sync_free=True``),
    computed group by group (see the module docstring): the same results, warnings and
    changes of the layer states (``changes[layer]``).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import kfac_func as kf
        >>> model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
        >>> state = kf.decompose(kf.init(kf.register(model), convention="kfac-pytorch"),
        ...                      damping=1.0)
        >>> grads = {k: torch.ones_like(p) for k, p in model.named_parameters()}
        >>> out = precondition_layers_grouped(state.layers, grads, 1.0, kl_clip=None, lr=0.1,
        ...                                   step=0, nonfinite="skip")
        >>> out["1.bias"]
        tensor([0.5000, 0.5000, 0.5000])
    """
    validate_grads(layers, grads)
    clip = resolve(kl_clip, step) if kl_clip is not None else None
    rate = resolve(lr, step)
    check_hyper("lr", rate, lambda v: v >= 0, ">= 0")
    if clip is not None:
        check_hyper("kl_clip", clip, lambda v: v > 0, "> 0 (or None to disable)")
    decomposed = [name for name, ls in layers.items() if ls.decomposition is not None]
    taken = {name: take(rows, name, consume_rows) for name in decomposed}
    alone: list[str] = []
    if not sync_free and basis_moments is None:
        alone = [n for n in decomposed if rows_cheaper(layers[n].spec, taken[n])]
    plan = plan_groups(layers, decomposed, grads, alone=alone)
    units = [_Unit(names, layers, grads) for names in plan]
    # default mode: {finite layer: whether its rows replace its gradient}
    use_rows = {} if sync_free else _check(units, layers, grads, taken, alone, nonfinite)

    settings = _Settings(damping, step, grafting, basis_moments, sync_free, clip is not None)
    terms: list[torch.Tensor] = []
    results = []
    for unit in units:
        name = unit.names[0]
        layer_rows = taken.get(name) if use_rows.get(name) else None
        stage = functools.partial(_stage, settings, unit.first, layer_rows)
        if torch.compiler.is_compiling():
            # the step and the moments' count change from call to call, so they are
            # symbolic in a compiled step: handed to the vmapped function as tensors, which
            # its graph takes as inputs (a symbolic int closed over by vmap is not)
            device = unit.m.device
            counts = [_scalar(ls.moment_count, device) for ls in unit.states]
            count = torch.stack(counts) if unit.batched else counts[0]
            shared = (_scalar(step, device),)
            res = unit.run(stage, unit.m, unit.finite, unit.fields(), count, shared=shared)
        else:
            res = unit.run(stage, unit.m, unit.finite, unit.fields())
        if clip is not None:
            terms.append(res["term"].reshape(-1))
        results.append((unit, res["p"], res["change"]))

    scale: torch.Tensor | None = None
    if clip is not None and terms:
        # summed in name order, as the per-layer step sums them
        order = [name for unit in units for name in unit.names]
        place = {name: k for k, name in enumerate(order)}
        names = sorted(order)
        vector = torch.cat(terms) if len(terms) > 1 else terms[0]
        if names != order:
            index = torch.tensor([place[n] for n in names], device=vector.device)
            vector = vector.index_select(0, index)
        dtype = next(p.dtype for unit, p, _ in results if names[0] in unit.names)
        scale = kl_clip_scale_of_vector(vector, clip, rate, dtype=dtype)

    out = dict(grads)
    for unit, p, change in results:
        write = functools.partial(_written, unit.first.spec, scale, sync_free)
        new = unit.run(write, p, unit.m, unit.finite)
        ws = unit.per_layer(new[0])
        bs = unit.per_layer(new[1]) if len(new) > 1 else [None] * len(ws)
        news = {k: unit.per_layer(v) for k, v in change.items()}
        for i, (name, ls) in enumerate(zip(unit.names, unit.states)):
            if not sync_free and name not in use_rows:  # default mode: finite layers only
                continue
            ls.spec.block.write_grads(ls.spec, out, grads, ws[i], bs[i])
            if changes is None:
                continue
            mine: dict[str, object] = {k: v[i] for k, v in news.items()}
            if unit.relaid is not None:  # the same values, as views of the group's stack
                mine["decomposition"] = unit.relaid[i]
            if basis_moments is not None:
                mine["moment_count"] = ls.moment_count + 1
            if mine:
                changes[name] = mine
    return out


def _scalar(value: int, device: torch.device) -> torch.Tensor:
    """A counter as a 0-d float64 tensor."""
    return torch.scalar_tensor(value, dtype=torch.float64, device=device)


class _Settings(NamedTuple):
    damping: float
    step: int
    grafting: Grafting | None
    basis_moments: BasisMoments | None
    sync_free: bool
    kl_clip: bool


def _stage(
    settings: _Settings,
    first: LayerState,
    layer_rows: Rows | None,
    m: torch.Tensor,
    finite: torch.Tensor,
    leaves: list[torch.Tensor],
    count: torch.Tensor | None = None,
    step: torch.Tensor | None = None,
) -> dict[str, Any]:
    """One layer's preconditioned matrix ``p``, the tensors of its state that change
    (``change``) and its kl_clip term (``term``, 0 where ``finite`` is False): the
    function a group runs under vmap. ``first`` gives the static parts of the layer state,
    ``leaves`` the tensors of :data:`GROUPED_FIELDS` (as :meth:`_Unit.fields` lists them)."""
    taken = iter(leaves)
    ls = first.replace(**{f: _rebuild(getattr(first, f), taken) for f in GROUPED_FIELDS})
    if count is not None:  # compiled: the counters as tensors (see the caller)
        ls = ls.replace(moment_count=count)
    mine: dict[str, dict[str, object]] = {}
    p = precondition_with(
        ls,
        m,
        settings.damping,
        layer_rows,
        step=settings.step if step is None else step,  # type: ignore[arg-type]
        grafting=settings.grafting,
        basis_moments=settings.basis_moments,
        changes=mine,
    )
    new = mine.get(ls.spec.name, {})
    change: dict[str, object] = {
        k: v for k, v in new.items() if isinstance(v, torch.Tensor) and k != "moment_count"
    }
    if settings.sync_free:
        change = keep_where(ls, change, finite)
        change["grad_skips"] = count_skips(ls, finite)
    out: dict[str, Any] = {"p": p, "change": change}
    if settings.kl_clip:
        term = kl_clip_term(p, m)
        out["term"] = torch.where(finite, term, torch.zeros_like(term))
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
    step's own temporary, is scaled in place, as the per-layer step scales it."""
    if not select:
        out = p if scale is None else p.mul_(scale.to(p.dtype))
    else:
        scaled = p if scale is None else p * scale.to(p.dtype)
        out = torch.where(finite, scaled, m.to(p.dtype))
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
    finiteness (warned about, in the layers' order, or raised as the per-layer step
    does), and whether the rows of each of ``alone`` reproduce its gradient. Returns
    ``{finite layer: use its rows}``."""
    flags = [u.finite.reshape(-1) for u in units]
    order = [name for u in units for name in u.names]
    for name in alone:
        spec = layers[name].spec
        w, b = layer_grads(spec, grads)
        layer_rows = rows[name]
        assert layer_rows is not None
        flags.append(rows_match(spec, w, b, layer_rows).reshape(1))
    if not flags:
        return {}
    read = torch.cat([f.to(flags[0].device) for f in flags]).tolist()
    finite = dict(zip(order, read))
    by_rows = dict(zip(alone, read[len(order) :]))
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
