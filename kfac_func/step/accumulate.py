"""Stage 1 of the step: fold batch factors into the running averages.

:func:`accumulate_factors` is the public, pure stage; :func:`fold_layers` and the functions
around it are the pieces the distributed step and the adapters reuse.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, MutableMapping, Sequence
from typing import NamedTuple

import torch

from kfac_func.blocks import Gram, LayerSpec, call_grams
from kfac_func.captures import Captures
from kfac_func.core.conventions import micro_batch_weights
from kfac_func.core.factors import factor_from_grams
from kfac_func.core.tied_factors import combine_stacked, is_tied, tied_batch_factors
from kfac_func.state import KFACConfig, KFACState, LayerState
from kfac_func.step.autocast import without_autocast
from kfac_func.step.hyper import (
    Hyper,
    NonFinite,
    NonFiniteError,
    as_list,
    check_hyper,
    non_finite,
    resolve,
)
from kfac_func.step.sync_free import all_finite_each

__all__ = [
    "LayerFactors",
    "MicroBatchStats",
    "accumulate_factors",
    "add_skips",
    "factors_from_stats",
    "fold_checked",
    "fold_deferred",
    "fold_factors",
    "fold_layers",
    "host_knows_data",
    "layer_batch_factors",
    "layer_stats",
    "no_data",
    "running_average",
    "settle_folds",
    "settle_on_device",
    "takes_batch",
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


def fold_checked(
    ls: LayerState,
    a: torch.Tensor,
    g: torch.Tensor,
    decay: float,
    config: KFACConfig,
    nonfinite: NonFinite,
) -> LayerState:
    """:func:`fold_factors` when both batch factors are finite, else the layer unchanged
    but for one more skipped update (or :class:`NonFiniteError`).

    A running factor that holds NaN/Inf already (a state built or loaded that way) is
    restarted from the batch factor, with a warning, so that it cannot stay poisoned.
    """
    new, checks = fold_deferred(ls, a, g, decay, config)
    layers = {ls.spec.name: new}
    settle_folds(layers, [(ls.spec.name, checks, ls)], nonfinite)
    return layers[ls.spec.name]


def fold_deferred(
    ls: LayerState,
    a: torch.Tensor,
    g: torch.Tensor,
    decay: float,
    config: KFACConfig,
    sync_free: bool = False,
) -> tuple[LayerState, torch.Tensor]:
    """:func:`fold_checked` decided on the device: the layer with the batch factors
    folded in where they are finite (else its factors as they were), each running factor
    that held NaN/Inf restarted from the batch's, and the four checks (batch A, batch G,
    folded A, folded G finite) as one bool tensor. The layer's counters assume a good
    update until :func:`settle_folds` reads the checks, in one host synchronisation for
    all the layers of a step (or :func:`settle_on_device` counts them, ``sync_free``:
    then a layer whose updates so far were all skipped takes the batch as its first)."""
    if ls.spec.block.stacked_uses and a.dim() == ls.a_factor.dim() + 1:
        # a tied layer's uses, kept apart until the window is complete (on every rank)
        a, g = combine_stacked(a, g)
    new = fold_factors(ls, a, g, decay, config)
    empty = no_data(ls, config) if sync_free else None
    if empty is not None:
        new = new.replace(
            a_factor=torch.where(empty, a, new.a_factor),
            g_factor=torch.where(empty, g, new.g_factor),
        )
    checks = all_finite_each([a, g, new.a_factor, new.g_factor])
    ok, na, ng = checks[0] & checks[1], checks[2], checks[3]
    old_a, old_g = ls.a_factor.to(a.device), ls.g_factor.to(g.device)
    new = new.replace(
        a_factor=torch.where(ok, torch.where(na, new.a_factor, a), old_a),
        g_factor=torch.where(ok, torch.where(ng, new.g_factor, g), old_g),
    )
    return new, checks


def settle_folds(
    layers: MutableMapping[str, LayerState],
    pending: Sequence[tuple[str, torch.Tensor, LayerState]],
    nonfinite: NonFinite,
) -> None:
    """Read the checks of :func:`fold_deferred` (``(layer, checks, the layer before)``;
    only its counters are read) in one host synchronisation and set each layer's counters
    (in place): a layer whose batch factors held NaN/Inf kept its factors and counts a
    skipped update, with a warning (``"skip"``) or :class:`NonFiniteError` (``"raise"``);
    a running factor that held NaN/Inf was restarted from the batch, with a warning (or
    the error)."""
    if not pending:
        return
    device = pending[0][1].device
    read = torch.stack([c.to(device) for _, c, _ in pending]).tolist()
    for (name, _, before), (fa, fg, na, ng) in zip(pending, read):
        if not (fa and fg):
            bad = [w for w, f in (("A", fa), ("G", fg)) if not f]
            non_finite(name, f"the {' and '.join(bad)} factor of this batch", nonfinite)
            layers[name] = layers[name].replace(
                factor_updates=before.factor_updates, skipped_updates=before.skipped_updates + 1
            )
            continue
        bad = [w for w, f in (("A", na), ("G", ng)) if not f]
        if bad:
            msg = f"layer {name!r}: the running {' and '.join(bad)} factor held NaN/Inf"
            if nonfinite == "raise":
                raise NonFiniteError(msg)
            warnings.warn(f"{msg}; restarted from this batch", RuntimeWarning, stacklevel=3)


def settle_on_device(
    layers: MutableMapping[str, LayerState],
    pending: Sequence[tuple[str, torch.Tensor, LayerState]],
) -> None:
    """:func:`settle_folds` without reading the host (``sync_free=True``): each layer whose
    batch factors held NaN/Inf counts the update in its ``factor_skips`` (a device
    counter that :func:`kfac_func.step.report_skipped` reads, warns about and moves to
    ``skipped_updates``); a restarted running factor is not warned about."""
    for name, checks, before in pending:
        layers[name] = layers[name].replace(
            factor_skips=add_skips(before.factor_skips, checks[..., 0] & checks[..., 1])
        )


def add_skips(skips: torch.Tensor | None, ok: torch.Tensor) -> torch.Tensor:
    """``skips`` (None: 0) plus one where ``ok`` is False, as int64.

    Example:
        >>> add_skips(torch.tensor([2, 0]), torch.tensor([True, False]))
        tensor([2, 1])
    """
    skipped = (~ok).to(torch.int64)
    return skipped if skips is None else skips.to(ok.device) + skipped


def no_data(ls: LayerState, config: KFACConfig) -> torch.Tensor | None:
    """Under ``sync_free``, whether a ``"fisher"`` layer's factors still hold no data
    although ``factor_updates`` counts updates (every one of them skipped, on the
    device), as a 0-d bool tensor; None where the host knows (no skips counted, or no
    update yet, or the ``"kfac-pytorch"`` convention, whose starting factors are data).

    Example:
        >>> from torch import nn
        >>> import kfac_func as kf
        >>> state = kf.init(kf.register(nn.Linear(2, 2)))
        >>> ls = state.layers[""].replace(factor_updates=1, factor_skips=torch.tensor(1))
        >>> no_data(ls, state.config)
        tensor(True)
    """
    if host_knows_data(ls, config) or ls.factor_skips is None:
        return None
    return torch.eq(ls.factor_skips, ls.factor_updates)


def host_knows_data(ls: LayerState, config: KFACConfig) -> bool:
    """Whether the host knows that the layer's factors hold data (or that they do not),
    where :func:`no_data` is None."""
    return bool(config.convention != "fisher" or ls.factor_skips is None or ls.factor_updates == 0)


def fold_factors(
    ls: LayerState, a: torch.Tensor, g: torch.Tensor, decay: float, config: KFACConfig
) -> LayerState:
    """Running average ``decay·old + (1−decay)·batch`` (the first ``"fisher"`` update
    takes the batch factors as they are)."""
    if ls.a_factor.device != a.device or ls.g_factor.device != g.device:
        if ls.factor_updates:
            raise ValueError(
                f"layer {ls.spec.name!r}: its factors are on {ls.a_factor.device} but this "
                f"batch's are on {a.device}; move the state there (optree.tree_map(lambda t: "
                "t.to(device), state)) or build it with kfac_func.init(..., device=...)"
            )
        # a state built without device= for a model elsewhere: its starting factors
        # (constants) move to the batch's device with the first update
        ls = ls.replace(a_factor=ls.a_factor.to(a.device), g_factor=ls.g_factor.to(g.device))
    if takes_batch(ls, config):
        new_a, new_g = a, g
    else:
        new_a, new_g = (
            running_average(ls.a_factor, a, decay),
            running_average(ls.g_factor, g, decay),
        )
    return ls.replace(a_factor=new_a, g_factor=new_g, factor_updates=ls.factor_updates + 1)


def takes_batch(ls: LayerState, config: KFACConfig) -> bool:
    """Whether the layer's next update takes the batch factors as they are: the first
    update of a ``"fisher"`` state (its starting factors are zeros, not data)."""
    return ls.factor_updates == 0 and config.convention == "fisher"


def running_average(old: torch.Tensor, batch: torch.Tensor, decay: float) -> torch.Tensor:
    """``decay · old + (1 − decay) · batch``: the two products, then their sum in place of
    the first; each operation rounded on its own, so that one layer's factor, a stack of
    them, and the fused kernel of a compiled step (which computes the same three
    operations) round alike. (``add_(batch, alpha=...)`` would round the product and the
    sum once, eagerly, but not in a compiled step.)

    Example:
        >>> running_average(torch.ones(2), torch.zeros(2), 0.75)
        tensor([0.7500, 0.7500])
    """
    return old.mul(decay).add_(batch.mul(1 - decay))


@without_autocast
def accumulate_factors(
    state: KFACState,
    captures: Captures | Sequence[Captures],
    *,
    factor_decay: Hyper = 0.95,
    nonfinite: NonFinite = "skip",
) -> KFACState:
    """Fold one accumulation window of captures into the running-average factors.

    ``new = decay · old + (1 − decay) · batch``; the first update of a ``"fisher"`` state
    takes the batch factor as is (see :mod:`kfac_func.core.conventions`). Several captures
    (micro-batches) form one update. Layers absent from the captures keep their factors.
    A layer whose batch factors hold NaN/Inf keeps its factors and counts a skipped update
    (``nonfinite="skip"``, with a warning) or raises :class:`NonFiniteError`.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import kfac_func as kf
        >>> model = nn.Linear(3, 2)
        >>> state = kf.init(kf.register(model))
        >>> _, _, caps = kf.capture(model, dict(model.named_parameters()),
        ...                         torch.randn(4, 3), lambda out: out.sum())
        >>> kf.step.accumulate_factors(state, caps).layers[""].factor_updates
        1
    """
    decay = resolve(factor_decay, state.step)
    check_hyper("factor_decay", decay, lambda v: 0 <= v <= 1, "in [0, 1]")
    micro = as_list(captures)
    layers = dict(state.layers)
    fold_layers(
        layers,
        lambda _, ls: layer_batch_factors(ls.spec, micro, state.config),
        decay,
        state.config,
        nonfinite,
    )
    return state.replace(layers=layers)


def fold_layers(
    layers: MutableMapping[str, LayerState],
    batch_of: Callable[[str, LayerState], LayerFactors | None],
    decay: float,
    config: KFACConfig,
    nonfinite: NonFinite,
    sync_free: bool = False,
) -> None:
    """:func:`fold_checked` every layer of ``layers`` (in place) with the batch factors
    ``batch_of(name, layer)``; layers for which it returns None are left as they are.

    Layer by layer: each entry is replaced as soon as its new factors exist and its batch
    factors are dropped before the next layer's are made, so when ``layers`` is the only
    holder of the old layer states (a donated state) the old factors are freed one layer
    at a time instead of after the whole step. The checks of all layers are read at the
    end, in one host synchronisation (:func:`settle_folds`), or counted on the device
    (``sync_free``, :func:`settle_on_device`).
    """
    pending = []
    for name in list(layers):
        batch = batch_of(name, layers[name])
        if batch is not None:
            before = layers[name]
            layers[name], checks = fold_deferred(
                before, batch[0], batch[1], decay, config, sync_free
            )
            # the counters are all that is kept of the layer before
            pending.append((name, checks, before.replace(a_factor=_NONE, g_factor=_NONE)))
            del before
        del batch
    if sync_free:
        settle_on_device(layers, pending)
    else:
        settle_folds(layers, pending, nonfinite)


_NONE = torch.empty(0)
