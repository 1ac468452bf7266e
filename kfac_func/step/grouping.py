"""Which layers the preconditioning stage computes together (:mod:`kfac_func.step.grouped`).

Layers whose states and gradients have the same shapes, dtypes, kind and settings
(:func:`group_key`) and the same moment count form a group; the tensors a group stacks
are those of :data:`GROUPED_FIELDS`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Iterator, Mapping, Sequence
from typing import Any

import torch

from kfac_func.state import MOMENT_FIELDS, LayerState
from kfac_func.step.checks import layer_grads

__all__ = ["GROUPED_FIELDS", "group_key", "grouped_here", "plan_groups"]

GROUPED_FIELDS = ("decomposition", *MOMENT_FIELDS, "ortho_power", "grad_skips", "usable")
"""The fields of a :class:`~kfac_func.state.LayerState` that the preconditioning reads
and that a group stacks (the factors are not read: only their dtype is)."""


def grouped_here(grouped: bool | None, layers: Mapping[str, LayerState]) -> bool:
    """Whether a step computes the layers of one shape together: ``grouped`` as given,
    or for None (the default) where the layers' factors are on an accelerator. On a CPU a
    step is arithmetic, not kernel launches, and the stacking costs more than it saves
    (see the ``grouped`` setting of :class:`kfac_func.StepOptions`).

    Example:
        >>> import kfac_func as kf
        >>> layers = kf.init(kf.register(torch.nn.Linear(2, 2))).layers
        >>> grouped_here(None, layers), grouped_here(True, layers)
        (False, True)
    """
    if grouped is not None:
        return grouped
    first = next(iter(layers.values()), None)
    return first is not None and first.a_factor.device.type != "cpu"


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
    # the module a part belongs to (option "module") is a name too: the experts, or the
    # attention projections, of every layer of a model group together
    unnamed = dataclasses.replace(
        spec, options=tuple(kv for kv in spec.options if kv[0] != "module")
    )
    settings = tuple(
        getattr(unnamed, f.name) for f in dataclasses.fields(spec) if f.name not in _NAMES
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


def leaves_of(value: Any) -> list[torch.Tensor]:
    """The tensors of a field, in the order :func:`rebuild` takes them.

    Example:
        >>> from kfac_func.core.decomposition import InverseDecomposition
        >>> len(leaves_of(InverseDecomposition(torch.eye(2), torch.eye(3)))), leaves_of(None)
        (2, [])
    """
    if value is None:
        return []
    if isinstance(value, torch.Tensor):
        return [value]
    found = (getattr(value, f.name) for f in dataclasses.fields(value))
    return [t for t in found if t is not None]


def rebuild(template: Any, leaves: Iterator[torch.Tensor]) -> Any:
    """``template`` (a field of the first layer) with its tensors taken from ``leaves``.

    Example:
        >>> from kfac_func.core.decomposition import InverseDecomposition
        >>> d = rebuild(InverseDecomposition(torch.eye(2), torch.eye(3)),
        ...             iter([torch.zeros(2, 2), torch.ones(3, 3)]))
        >>> d.g_inv.sum().item()
        9.0
    """
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
