"""The batch factors of a step: each layer's A and G from this step's statistics.

:func:`factors_from_stats` makes one layer's batch factors from its Grams (each Gram
scaled and summed, a handful of operations per factor). :func:`build_batch_factors`
makes them for a step's layers: the Grams of the layers whose statistics have the same
shape, dtype, device and kind (one call in one micro-batch: the common case) are stacked
and scaled in those few operations, so that a factor step's operations
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
from kfac_func.core.factors import factor_from_grams, group_means, mean_over_rows
from kfac_func.core.stacks import per_row, stacked
from kfac_func.core.tied_factors import is_tied, tied_batch_factors
from kfac_func.state import KFACConfig

__all__ = [
    "LayerFactors",
    "MicroBatchStats",
    "build_batch_factors",
    "factors_from_stats",
    "from_pooled",
    "layer_batch_factors",
    "layer_stats",
    "pooling_terms",
]


class LayerFactors(NamedTuple):
    """One layer's batch factors and what they count for when the windows of several ranks
    are averaged (:func:`pooling_terms`): G by ``weight`` (the window's examples under
    ``"fisher"``, else 1), A by ``rows``, the rows it averages (a number, or a tensor of
    one entry per group for per-group means: a mixture's experts); None: A by ``weight``
    too. One process uses neither."""

    a: torch.Tensor
    g: torch.Tensor
    weight: float
    rows: float | torch.Tensor | None = None


class MicroBatchStats(NamedTuple):
    """One layer's statistics from one micro-batch: per-call Grams of inputs and
    output-gradients, the micro-batch's example count and its loss scale."""

    a: list[Gram]
    g: list[Gram]
    batch_size: int
    loss_scale: float


def factors_from_stats(
    name: str, micro_batches: Sequence[MicroBatchStats], config: KFACConfig
) -> LayerFactors | None:
    """A, G and weights of one accumulation window for one layer; None if it saw nothing.

    G averages the micro-batches' factors by
    :func:`~kfac_func.core.conventions.micro_batch_weights`. A, under ``"fisher"`` and for
    per-group statistics (a mixture's experts) under either convention, is the mean over
    every row of the window (:func:`~kfac_func.core.factors.mean_over_rows`), so that it
    does not depend on how the rows fall into micro-batches; a tied layer's, and A under
    ``"kfac-pytorch"``, average the micro-batches' as G does.
    """
    seen = [m for m in micro_batches if m.a]
    if not seen:
        return None
    sizes = [m.batch_size for m in seen]
    by_rows = not any(is_tied(m.a) for m in seen) and (
        config.convention == "fisher" or seen[0].a[0].groups is not None
    )
    a_sum: torch.Tensor | None = None
    g_sum: torch.Tensor | None = None
    for w, m in zip(micro_batch_weights(config.convention, sizes), seen):
        if len(m.a) != len(m.g):
            raise ValueError(
                f"layer {name!r}: {len(m.a)} captured inputs but {len(m.g)} output-gradients"
            )
        a: torch.Tensor | None
        if is_tied(m.a):  # an embedding and a head sharing one weight
            a, g = tied_batch_factors(
                m.a, m.g, config.convention, batch_size=m.batch_size, loss_scale=m.loss_scale
            )
        else:
            a = None if by_rows else factor_from_grams(m.a, config.convention)
            g = factor_from_grams(
                m.g, config.convention, batch_size=m.batch_size, loss_scale=m.loss_scale
            )
        if g_sum is None:  # the first: no copy when its weight is 1
            a_sum, g_sum = (a, g) if w == 1 else (None if a is None else w * a, w * g)
        else:
            if a is not None and a_sum is not None:  # our own temporaries: in place
                a_sum.add_(a, alpha=w)
            g_sum.add_(g, alpha=w)
    rows = None
    if by_rows:
        a_sum, rows = mean_over_rows([x for m in seen for x in m.a])
    assert a_sum is not None and g_sum is not None
    weight = float(sum(sizes)) if config.convention == "fisher" else 1.0
    return LayerFactors(a_sum, g_sum, weight, rows)


def layer_batch_factors(
    spec: LayerSpec,
    micro_batches: Sequence[Captures],
    config: KFACConfig,
    gram_dtype: torch.dtype | None = None,
) -> LayerFactors | None:
    """:func:`factors_from_stats` of captures (one per micro-batch)."""
    stats = layer_stats(spec, micro_batches, config, gram_dtype)
    return factors_from_stats(spec.name, stats, config)


def layer_stats(
    spec: LayerSpec,
    micro_batches: Sequence[Captures],
    config: KFACConfig,
    gram_dtype: torch.dtype | None = None,
) -> list[MicroBatchStats]:
    """The layer's statistics in each of the captures (one per micro-batch) that saw it:
    their Gram products from operands in ``gram_dtype`` (None: the factors' dtype; see
    :class:`kfac_func.StepOptions`), summed in at least float32."""
    stats = []
    for cap in micro_batches:
        lc = cap.layers.get(spec.name)
        if lc is None or not lc.inputs:
            continue
        dtype = gram_dtype or config.factor_dtype
        a, g = call_grams(spec, lc.inputs, lc.output_grads, dtype)
        stats.append(MicroBatchStats(a, g, cap.batch_size, cap.loss_scale))
    return stats


def build_batch_factors(
    specs: Mapping[str, LayerSpec],
    stats_of: Callable[[str], Sequence[MicroBatchStats]],
    config: KFACConfig,
) -> dict[str, LayerFactors]:
    """``{layer: LayerFactors}`` as :func:`factors_from_stats`
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
            if len(names) == 1 or not one or is_tied(seen[0].a) or seen[0].a[0].groups is not None:
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
            for (name, a, *_, m), fa, fg in zip(members, a_stack.unbind(0), g_stack.unbind(0)):
                out[name] = _one_call(fa, fg, a, m, config)
        del groups
    return out


def _one_call(
    a: torch.Tensor, g: torch.Tensor, gram: Gram, m: MicroBatchStats, config: KFACConfig
) -> LayerFactors:
    """The batch factors ``a, g`` of a window of one call, with the weights
    :func:`factors_from_stats` gives them."""
    if config.convention == "fisher":
        return LayerFactors(a, g, float(m.batch_size), float(gram.rows))
    return LayerFactors(a, g, 1.0)


def pooling_terms(
    spec: LayerSpec,
    batch: LayerFactors | None,
    zeros: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """``[rows·A, weight·G, (weight, rows…)]``: what one rank contributes to the sums over
    ranks that :func:`from_pooled` turns into the pooled batch factors (``rows`` per group
    for per-group means). A rank that did not call the layer (``batch`` None) contributes
    ``zeros`` (tensors shaped as its batch factors) and zero weights.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from kfac_func.blocks import register
        >>> spec = register(nn.Linear(1, 1, bias=False))[""]
        >>> terms = pooling_terms(spec, LayerFactors(torch.ones(1, 1), torch.ones(1, 1), 2.0, 6.0))
        >>> [t.flatten().tolist() for t in terms]
        [[6.0], [2.0], [2.0, 6.0]]
    """
    if batch is None:
        assert zeros is not None
        za, zg = zeros
        size = 1 + (spec.groups if spec.block.routed else 1)
        return [za, zg, torch.zeros(size, dtype=za.dtype, device=za.device)]
    a, g, w, rows = LayerFactors(*batch)
    if isinstance(rows, torch.Tensor):
        rows = rows.to(a.dtype)
        weight = torch.full((1,), w, dtype=a.dtype, device=a.device)
        weighted = a * per_row(rows, a)
        return [weighted, w * g, torch.cat([weight, rows])]
    n = w if rows is None else rows
    return [n * a, w * g, torch.tensor([w, n], dtype=a.dtype, device=a.device)]


def from_pooled(terms: Sequence[torch.Tensor]) -> LayerFactors | None:
    """The batch factors pooled over ranks from the sums of their :func:`pooling_terms`;
    None when no rank saw the layer.

    Example:
        >>> import torch
        >>> sums = [torch.full((1, 1), 9.0), torch.full((1, 1), 4.0), torch.tensor([4.0, 9.0])]
        >>> from_pooled(sums)[:2]
        (tensor([[1.]]), tensor([[1.]]))
    """
    wa, wg, weights = terms
    w = float(weights[0])  # one read: whether any rank saw the layer
    if w == 0.0:
        return None
    rows = weights[1:]
    if rows.numel() == 1:
        return LayerFactors(wa / rows, wg / w, w)
    return LayerFactors(group_means(wa, rows), wg / w, w, rows)


def _scaled(grams: Sequence[Gram], scales: Sequence[float]) -> torch.Tensor:
    """The stack of ``gram · scale``: what :func:`~kfac_func.core.factors.factor_from_grams`
    computes for each."""
    stack, fresh = stacked([g.gram for g in grams])
    if all(s == scales[0] for s in scales):
        total = stack.mul_(scales[0]) if fresh else stack * scales[0]
    else:
        k = per_row(torch.tensor(scales, dtype=stack.dtype, device=stack.device), stack)
        total = stack.mul_(k) if fresh else stack * k
    return total
