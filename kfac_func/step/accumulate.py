"""Stage 1 of the step: fold batch factors into the running averages.

:func:`accumulate_factors` is the public, pure stage; :func:`fold_layers` folds a step's
layers, those of one shape together; :func:`fold_checked` and the functions around it are
the one-layer pieces the distributed step and the adapters reuse.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Hashable, MutableMapping, Sequence

import torch

from kfac_func.captures import Captures
from kfac_func.core.attempts import all_finite_together
from kfac_func.core.stacks import per_row, stacked
from kfac_func.core.tied_factors import combine_stacked
from kfac_func.state import KFACConfig, KFACState, LayerState
from kfac_func.step.autocast import without_autocast
from kfac_func.step.batch_factors import LayerFactors, layer_batch_factors
from kfac_func.step.hyper import (
    Hyper,
    NonFinite,
    NonFiniteError,
    as_list,
    non_finite,
    resolve_checked,
)
from kfac_func.step.sync_free import all_finite_each, all_finite_rows

__all__ = [
    "accumulate_factors",
    "add_skips",
    "fold_checked",
    "fold_deferred",
    "fold_factors",
    "fold_layers",
    "host_knows_data",
    "no_data",
    "no_data_rows",
    "running_average",
    "settle_folds",
    "settle_on_device",
    "takes_batch",
]


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
    if checks is not None:
        settle_folds(layers, [(ls.spec.name, checks, ls)], nonfinite)
    return layers[ls.spec.name]


def fold_deferred(
    ls: LayerState,
    a: torch.Tensor,
    g: torch.Tensor,
    decay: float,
    config: KFACConfig,
    sync_free: bool = False,
) -> tuple[LayerState, torch.Tensor | None]:
    """:func:`fold_checked` decided on the device: the layer with the batch factors
    folded in where they are finite (else its factors as they were), each running factor
    that held NaN/Inf restarted from the batch's, and the four checks (batch A, batch G,
    folded A, folded G finite) as one bool tensor. The layer's counters assume a good
    update until :func:`settle_folds` reads the checks, in one host synchronisation for
    all the layers of a step (or :func:`settle_on_device` counts them, ``sync_free``:
    then a layer whose updates so far were all skipped takes the batch as its first).
    On a CPU, where reading the checks synchronises nothing, the folded factors are
    checked first (:func:`~kfac_func.core.attempts.all_finite_together`) and the
    selection is skipped when they pass (the same factors, fewer passes over them): the
    checks are None then, every one passed and nothing is left to settle."""
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
    if _host_reads(a, sync_free) and all_finite_together((new.a_factor, new.g_factor)):
        # NaN/Inf in a batch factor would have reached its fold: the batch's are finite
        return new, None
    checks = all_finite_each([a, g, new.a_factor, new.g_factor])
    ok, na, ng = checks[0] & checks[1], checks[2], checks[3]
    old_a, old_g = ls.a_factor.to(a.device), ls.g_factor.to(g.device)
    new = new.replace(
        a_factor=torch.where(ok, torch.where(na, new.a_factor, a), old_a),
        g_factor=torch.where(ok, torch.where(ng, new.g_factor, g), old_g),
    )
    return new, checks


def _host_reads(t: torch.Tensor, sync_free: bool) -> bool:
    """Whether the host reads the fold's checks for free: on a CPU, outside ``sync_free``
    steps and compiled graphs (elsewhere the device selects). Where every check passes,
    every factor is the running average as folded, and the selection that keeps a layer's
    old factors where its batch's were not finite has nothing to do."""
    return not sync_free and t.device.type == "cpu" and not torch.compiler.is_compiling()


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
    gram_dtype: torch.dtype | None = None,
) -> KFACState:
    """Fold one accumulation window of captures into the running-average factors
    (their Gram products from operands in ``gram_dtype``, see
    :class:`kfac_func.StepOptions`).

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
    decay = resolve_checked("factor_decay", factor_decay, state.step)
    micro = as_list(captures)
    layers = dict(state.layers)
    fold_layers(
        layers,
        lambda _, ls: layer_batch_factors(ls.spec, micro, state.config, gram_dtype),
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
    grouped: bool = True,
) -> None:
    """:func:`fold_checked` every layer of ``layers`` (in place) with the batch factors
    ``batch_of(name, layer)``; layers for which it returns None are left as they are.

    The layers whose batch and running factors have the same shapes, dtypes and devices
    are folded together (``grouped``): their factors stacked, the average, its checks and
    the selection of the old factors where the batch's were not finite computed once per
    group, in the same elementwise operations as for one layer (the same numbers). A layer
    alone in its shape, a tied layer's stacked uses, and every layer when not ``grouped``
    is folded as soon as its batch factors exist, and they are dropped before the next
    layer's are made: when ``layers`` is the only holder of the old layer states (a
    donated state) the old factors are then freed one layer at a time. The checks of all
    layers are read at the end, in one host synchronisation (:func:`settle_folds`, whose
    warnings come in the layers' order), or counted on the device (``sync_free``,
    :func:`settle_on_device`).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import kfac_func as kf
        >>> state = kf.init(kf.register(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))))
        >>> layers = dict(state.layers)
        >>> batch = (torch.eye(3), torch.eye(2), 1.0)
        >>> fold_layers(layers, lambda n, ls: batch, 0.5, state.config, "skip")
        >>> layers["1"].factor_updates, layers["1"].a_factor[0, 0].item()
        (1, 1.0)
    """
    order = {name: k for k, name in enumerate(layers)}
    pending: list[tuple[str, torch.Tensor, LayerState]] = []
    batches: dict[str, LayerFactors] = {}
    groups: dict[Hashable, list[str]] = {}
    for name in list(layers):
        batch = batch_of(name, layers[name])
        if batch is None:
            continue
        key = _key(layers[name], batch, config) if grouped else None
        if key is None:
            _fold_one(layers, name, batch, decay, config, sync_free, pending)
        else:
            batches[name] = batch
            groups.setdefault(key, []).append(name)
        del batch
    for names in groups.values():
        if len(names) == 1:
            _fold_one(layers, names[0], batches.pop(names[0]), decay, config, sync_free, pending)
        else:
            group = [batches.pop(n) for n in names]
            _fold_group(layers, names, group, decay, config, sync_free, pending)
            del group
    pending.sort(key=lambda item: order[item[0]])
    if sync_free:
        settle_on_device(layers, pending)
    else:
        settle_folds(layers, pending, nonfinite)


def _fold_one(
    layers: MutableMapping[str, LayerState],
    name: str,
    batch: LayerFactors,
    decay: float,
    config: KFACConfig,
    sync_free: bool,
    pending: list[tuple[str, torch.Tensor, LayerState]],
) -> None:
    """One layer folded (:func:`fold_deferred`); its checks go into ``pending`` with the
    counters of the layer before (all that is kept of it)."""
    before = layers[name]
    layers[name], checks = fold_deferred(before, batch[0], batch[1], decay, config, sync_free)
    if checks is not None:  # (None: every check passed, read on the host already)
        pending.append((name, checks, before.replace(a_factor=_NONE, g_factor=_NONE)))


def _fold_group(
    layers: MutableMapping[str, LayerState],
    names: Sequence[str],
    batches: Sequence[LayerFactors],
    decay: float,
    config: KFACConfig,
    sync_free: bool,
    pending: list[tuple[str, torch.Tensor, LayerState]],
) -> None:
    """:func:`fold_deferred` of the layers ``names`` (equal :func:`_key`), stacked."""
    states = [layers[n] for n in names]
    # the batch factors of a group built together are views of one stack already
    a = stacked([b[0] for b in batches])[0]
    g = stacked([b[1] for b in batches])[0]
    old_a = stacked([ls.a_factor for ls in states])[0]
    old_g = stacked([ls.g_factor for ls in states])[0]
    if takes_batch(states[0], config):
        new_a, new_g = a, g
    else:
        new_a, new_g = running_average(old_a, a, decay), running_average(old_g, g, decay)
    empty = no_data_rows(states, config) if sync_free else None
    if empty is not None:  # layers whose updates were all skipped take the batch
        new_a = torch.where(per_row(empty, a), a, new_a)
        new_g = torch.where(per_row(empty, g), g, new_g)
    checks = all_finite_rows([a, g, new_a, new_g])
    ok = checks[:, 0] & checks[:, 1]
    out_a, out_g = new_a, new_g
    if not (_host_reads(checks, sync_free) and bool(checks.all())):
        # selected into the new stacks themselves (no further group-sized temporary)
        out_a = _select(ok, checks[:, 2], new_a, a, old_a)
        out_g = _select(ok, checks[:, 3], new_g, g, old_g)
    skips = _group_skips(states, ok) if sync_free else [None] * len(names)
    for name, ls, fa, fg, c, s in zip(
        names, states, out_a.unbind(0), out_g.unbind(0), checks.unbind(0), skips
    ):
        layers[name] = ls.replace(a_factor=fa, g_factor=fg, factor_updates=ls.factor_updates + 1)
        if s is not None:
            layers[name] = layers[name].replace(factor_skips=s)
        else:
            pending.append((name, c, ls))


_NONE = torch.empty(0)


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
        return torch.where(per_row(ok, new), new, old)
    torch.where(per_row(folded, new), new, batch, out=out)
    return torch.where(per_row(ok, new), out, old, out=out)


def _key(ls: LayerState, batch: LayerFactors, config: KFACConfig) -> Hashable | None:
    """What layers must share to be folded together; a tied layer's stacked uses, or
    factors on another device than the batch's, fold alone (None)."""
    a, g = batch[0], batch[1]
    alone = (
        ls.spec.block.stacked_uses
        or a.dim() != ls.a_factor.dim()
        or ls.a_factor.device != a.device
        or ls.g_factor.device != g.device
    )
    if alone:
        return None
    first = takes_batch(ls, config)
    shapes = tuple((tuple(t.shape), t.dtype, t.device) for t in (a, g, ls.a_factor, ls.g_factor))
    return (shapes, first)
