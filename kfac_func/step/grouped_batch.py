"""The batch factors of equal-shaped layers built together.

:func:`~kfac_func.step.accumulate.factors_from_stats` makes one layer's batch factors from
its Grams: each Gram scaled, then symmetrised, a handful of operations per factor and
layer. :func:`batch_factors_grouped` stacks the Grams of the layers whose statistics have
the same shape, dtype, device and kind (one call in one micro-batch: the common case) and
scales and symmetrises each stack in those few operations, so that a factor step's
operations grow with the number of shapes, not of layers. The numbers are the per-layer
ones exactly (the same elementwise operations, in the same dtype); a layer with several
calls or micro-batches, or a tied one, takes the per-layer path.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence

import torch

from kfac_func.blocks import Gram, LayerSpec
from kfac_func.core.conventions import a_scales, g_scales
from kfac_func.core.factors import symmetrize
from kfac_func.core.stacks import stacked
from kfac_func.core.tied_factors import is_tied
from kfac_func.state import KFACConfig
from kfac_func.step.accumulate import LayerFactors, MicroBatchStats, factors_from_stats

__all__ = ["batch_factors_grouped"]


def batch_factors_grouped(
    specs: Mapping[str, LayerSpec],
    stats_of: Callable[[str], Sequence[MicroBatchStats]],
    config: KFACConfig,
) -> dict[str, LayerFactors]:
    """``{layer: (A, G, weight)}`` as :func:`~kfac_func.step.accumulate.factors_from_stats`
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
        >>> batch_factors_grouped(specs, stats_of, state.config)["1"][0]
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
