"""The batch factors of a step: each layer's A and G from this step's statistics.

:func:`factors_from_stats` makes one layer's batch factors from its Grams (each Gram
scaled, then symmetrised, a handful of operations per factor). :func:`build_batch_factors`
makes them for a step's layers: the Grams of the layers whose statistics have the same
shape, dtype, device and kind (one call in one micro-batch: the common case) are stacked
and scaled and symmetrised in those few operations, so that a factor step's operations
grow with the number of shapes, not of layers. The numbers are the one-layer ones
exactly (the same elementwise operations, in the same dtype); a layer with several calls
or micro-batches, a tied one, and one alone in its shape take the one-layer function.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import NamedTuple

import torch

from kfac_func.blocks import Gram, LayerSpec, call_grams
from kfac_func.captures import Captures
from kfac_func.core.conventions import a_scales, g_scales, micro_batch_weights
from kfac_func.core.factors import factor_from_grams, symmetrize
from kfac_func.core.stacks import stacked
from kfac_func.core.tied_factors import is_tied, tied_batch_factors
from kfac_func.state import KFACConfig

__all__ = [
    "LayerFactors",
    "MicroBatchStats",
    "build_batch_factors",
    "factors_from_stats",
    "layer_batch_factors",
    "layer_stats",
]


LayerFactors = tuple[torch.Tensor, torch.Tensor, float]
"""One layer's batch factors ``(A, G, weight)`` (see :func:`factors_from_stats`)."""


class MicroBatchStats(NamedTuple):
    """One layer's statistics from one micro-batch: per-call Grams of inputs and
    output-gradients, the micro-batch's example count and its loss scale."""

    a: list[Gram]
    g: list[Gram]
    batch_size: int
    loss_scale: float


def factors_from_stats(
    name: str, micro_batches: Sequence[MicroBatchStats], config: KFACConfig
) -> tuple[torch.Tensor, torch.Tensor, float] | None:
    """A, G and weight of one accumulation window for one layer; None if it saw nothing.

    The weight is what the window counts for when windows of several ranks are averaged
    (see :func:`kfac_func.core.conventions.micro_batch_weights`).
    """
    seen = [m for m in micro_batches if m.a]
    if not seen:
        return None
    sizes = [m.batch_size for m in seen]
    a_sum: torch.Tensor | None = None
    g_sum: torch.Tensor | None = None
    for w, m in zip(micro_batch_weights(config.convention, sizes), seen):
        if len(m.a) != len(m.g):
            raise ValueError(
                f"layer {name!r}: {len(m.a)} captured inputs but {len(m.g)} output-gradients"
            )
        if is_tied(m.a):  # an embedding and a head sharing one weight
            a, g = tied_batch_factors(
                m.a, m.g, config.convention, batch_size=m.batch_size, loss_scale=m.loss_scale
            )
        else:
            a = factor_from_grams(m.a, config.convention)
            g = factor_from_grams(
                m.g, config.convention, batch_size=m.batch_size, loss_scale=m.loss_scale
            )
        if a_sum is None or g_sum is None:  # the first: no copy when its weight is 1
            a_sum, g_sum = (a, g) if w == 1 else (w * a, w * g)
        else:
            a_sum.add_(a, alpha=w)  # our own temporaries: accumulate in place
            g_sum.add_(g, alpha=w)
    assert a_sum is not None and g_sum is not None
    return a_sum, g_sum, float(sum(sizes)) if config.convention == "fisher" else 1.0


def layer_batch_factors(
    spec: LayerSpec, micro_batches: Sequence[Captures], config: KFACConfig
) -> tuple[torch.Tensor, torch.Tensor, float] | None:
    """:func:`factors_from_stats` of captures (one per micro-batch)."""
    return factors_from_stats(spec.name, layer_stats(spec, micro_batches, config), config)


def layer_stats(
    spec: LayerSpec, micro_batches: Sequence[Captures], config: KFACConfig
) -> list[MicroBatchStats]:
    """The layer's statistics in each of the captures (one per micro-batch) that saw it."""
    stats = []
    for cap in micro_batches:
        lc = cap.layers.get(spec.name)
        if lc is None or not lc.inputs:
            continue
        a, g = call_grams(spec, lc.inputs, lc.output_grads, config.factor_dtype)
        stats.append(MicroBatchStats(a, g, cap.batch_size, cap.loss_scale))
    return stats


def build_batch_factors(
    specs: Mapping[str, LayerSpec],
    stats_of: Callable[[str], Sequence[MicroBatchStats]],
    config: KFACConfig,
) -> dict[str, LayerFactors]:
    """``{layer: (A, G, weight)}`` as :func:`factors_from_stats`
    makes them from each layer's statistics ``stats_of(layer)``, for the layers of
    ``specs``, those of one shape together (see the module docstring); layers that saw
    nothing are left out. The statistics are asked for group by group, and a group's are
    dropped once its factors exist.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import kfac_func as kf
        >>> state = kf.init(kf.register(nn.Sequential(nn.Linear(1, 1), nn.Linear(1, 1))))
        >>> def stats_of(name):
        ...     k = 1.0 + int(name)
        ...     return [MicroBatchStats([Gram(k * torch.eye(2), 4, 1)],
        ...                             [Gram(torch.eye(1), 4, 1)], 4, 0.25)]
        >>> specs = {n: ls.spec for n, ls in state.layers.items()}
        >>> build_batch_factors(specs, stats_of, state.config)["1"][0]
        tensor([[0.5000, 0.0000],
                [0.0000, 0.5000]])
    """
    out: dict[str, LayerFactors] = {}
    by_shape: dict[Hashable, list[str]] = {}
    for name, spec in specs.items():
        by_shape.setdefault((spec.factor_shapes, spec.diagonal), []).append(name)
    for names in by_shape.values():
        groups: dict[Hashable, list[tuple[str, Gram, float, Gram, float, MicroBatchStats]]] = {}
        for name in names:
            micro = stats_of(name)
            seen = [m for m in micro if m.a]
            one = len(seen) == 1 and len(seen[0].a) == 1 and len(seen[0].g) == 1
            if len(names) == 1 or not one or is_tied(seen[0].a):
                found = factors_from_stats(name, micro, config)
                if found is not None:
                    out[name] = found
                continue
            m = seen[0]
            a, g = m.a[0], m.g[0]
            sa = a_scales(config.convention, [a.rows], [a.spatial])[0]
            sg = g_scales(config.convention, [g.rows], [g.spatial], m.batch_size, m.loss_scale)[0]
            key = tuple(
                (tuple(x.gram.shape), x.gram.dtype, x.gram.device, x.diagonal) for x in (a, g)
            )
            groups.setdefault(key, []).append((name, a, sa, g, sg, m))
        for members in groups.values():
            if len(members) == 1:
                name, *_, m = members[0]
                found = factors_from_stats(name, [m], config)
                assert found is not None
                out[name] = found
                continue
            a_stack = _scaled([x[1] for x in members], [x[2] for x in members])
            g_stack = _scaled([x[3] for x in members], [x[4] for x in members])
            for (name, *_, m), fa, fg in zip(members, a_stack.unbind(0), g_stack.unbind(0)):
                out[name] = (fa, fg, _weight(m, config))
        del groups
    return out


def _weight(m: MicroBatchStats, config: KFACConfig) -> float:
    """What a window of this one micro-batch counts for (as :func:`factors_from_stats`)."""
    return float(m.batch_size) if config.convention == "fisher" else 1.0


def _scaled(grams: Sequence[Gram], scales: Sequence[float]) -> torch.Tensor:
    """The stack of ``gram · scale``, symmetrised unless the Grams are diagonals: what
    :func:`~kfac_func.core.factors.factor_from_grams` computes for each."""
    stack, fresh = stacked([g.gram for g in grams])
    if all(s == scales[0] for s in scales):
        total = stack.mul_(scales[0]) if fresh else stack * scales[0]
    else:
        k = torch.tensor(scales, dtype=stack.dtype, device=stack.device)
        k = k.reshape(-1, *([1] * (stack.dim() - 1)))
        total = stack.mul_(k) if fresh else stack * k
    return total if grams[0].diagonal else symmetrize(total)
