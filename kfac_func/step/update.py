"""`update`: one pure K-FAC step, composed of the three stages.

1. :func:`~kfac_func.step.accumulate.accumulate_factors` folds the batch factors of the
   captures into the running averages (``factor_decay``);
2. :func:`~kfac_func.step.decompose.decompose` recomputes the eigendecompositions or
   damped inverses;
3. :func:`~kfac_func.step.precondition.precondition_grads` applies them to the gradients
   and scales by ``kl_clip``.

Every function returns new objects and leaves its inputs untouched, except that
``update(..., donate=True)`` may reuse the state it is handed (see :func:`update`).
Hyperparameters are numbers or ``step -> value`` callables, evaluated at ``state.step``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from kfac_func.blocks import Rows
from kfac_func.captures import Captures
from kfac_func.state import KFACState, LayerState
from kfac_func.step.accumulate import fold_layers
from kfac_func.step.autocast import without_autocast
from kfac_func.step.basis import carry_moments, moment_bases
from kfac_func.step.batch_factors import (
    LayerFactors,
    build_batch_factors,
    layer_batch_factors,
    layer_stats,
)
from kfac_func.step.checks import validate_grads
from kfac_func.step.decompose import decompose_layers
from kfac_func.step.ekfac import update_scales
from kfac_func.step.grouped import precondition_layers
from kfac_func.step.grouping import grouped_here
from kfac_func.step.hyper import as_list, resolve, take
from kfac_func.step.options import StepOptions, step_options
from kfac_func.step.orthogonal import held_layers, orthogonal_layers, prepare_layers
from kfac_func.step.precondition import captured_rows
from kfac_func.step.sync_free import leave_sync_free

__all__ = ["update"]


@without_autocast
def update(
    state: KFACState,
    grads: Mapping[str, torch.Tensor],
    *,
    captures: Captures | Sequence[Captures] | None = None,
    batch_factors: Mapping[str, LayerFactors] | None = None,
    rows: Mapping[str, Rows] | None = None,
    donate: bool = False,
    options: StepOptions | None = None,
    **settings: Any,
) -> tuple[dict[str, torch.Tensor], KFACState]:
    """One K-FAC step: returns ``(preconditioned_grads, new_state)``; inputs are untouched
    (unless donated).

    The step's settings (damping, factor_decay, kl_clip, lr, update_factors,
    update_inverses, nonfinite, eigenbasis moments, sync_free, grouped, ...) are
    the fields of :class:`kfac_func.StepOptions`, described there: pass them as
    ``options=``, as keywords, or both (the keywords override ``options``).

    Args:
        state: from :func:`kfac_func.init` or a previous ``update``.
        grads: ``{param_name: grad}``; parameters of unregistered layers pass unchanged.
        captures: from :func:`kfac_func.capture` (or a list of them, one per micro-batch
            of an accumulation window); needed when factors are updated, unless
            ``batch_factors`` are given instead.
        batch_factors: ``{layer: (A, G, weight)}`` already built from this step's
            statistics (as :func:`factors_from_stats` returns them; the weight is not
            used on one process), instead of ``captures``.
        rows: ``{layer: [(input rows, output-gradient rows), ...]}`` of Linear layers (see
            :func:`precondition_layer`); taken from ``captures`` when not given.
        donate: hand ``state`` over to the step (as JAX's buffer donation): its
            ``layers`` dict is updated in place, each layer's entry replaced as soon as
            its new factors or decomposition exist, so that the old ones are freed one
            layer at a time instead of being held, with the whole new state, until the
            step returns. The entries of ``batch_factors`` and ``rows`` (when they are
            mutable) are removed as they are used, for the same reason. Use only the
            returned state afterwards: the donated one, and every state sharing its
            ``layers`` dict (``state.replace(step=...)`` copies share it), holds the new
            layers under the old step. The memory is saved only when nothing else holds
            the old state (``grads, state = update(state, ..., donate=True)``). Results
            are the same as without donation. Missing or misshapen gradients are refused
            before anything changes; an error after that (``nonfinite="raise"``) leaves
            each layer of the donated state either as it was or as the step left it.
        options: the step's settings (:class:`kfac_func.StepOptions`; None: its
            defaults).
        **settings: fields of :class:`kfac_func.StepOptions`, overriding ``options``
            (a TypeError names any other keyword).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import kfac_func as kf
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
        >>> params = dict(model.named_parameters())
        >>> state = kf.init(kf.register(model))
        >>> x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
        >>> loss, grads, caps = kf.capture(model, params, x,
        ...                                lambda out: nn.functional.cross_entropy(out, y))
        >>> new_grads, state = kf.update(state, grads, captures=caps, damping=1e-2)
        >>> state.step, sorted(new_grads) == sorted(params)
        (1, True)
        >>> opts = kf.StepOptions(damping=1e-2, eigenbasis_moments=True, kl_clip=None)
        >>> new_grads, state = kf.update(state, grads, captures=caps, options=opts, donate=True)
        >>> state.step
        2
    """
    opts = step_options(options, settings)
    step, config = state.step, state.config
    stage = opts.stage_settings(config.compute_method, step)
    sync_free, nonfinite = opts.sync_free, opts.nonfinite
    grouped = grouped_here(opts.grouped, state.layers)
    ortho = stage.orthogonal
    validate_grads(state.layers, grads)  # before anything changes, donated or not
    layers = state.layers if donate else dict(state.layers)
    if not sync_free:
        leave_sync_free(layers)  # what earlier sync_free steps left on the device
    micro: list[Captures] | None = None  # this step's statistics, when factors update
    decay = 1.0
    factors_now = bool(resolve(opts.update_factors, step))
    if factors_now:
        if captures is not None and batch_factors is not None:
            raise ValueError("give captures= or batch_factors=, not both")
        if captures is None and batch_factors is None:
            raise ValueError("update_factors=True needs captures= (from kfac_func.capture)")
        decay = opts.decay_at(step)
        micro = as_list(captures) if captures is not None else None
        gram = opts.gram_dtype
        made: dict[str, LayerFactors] | None = None
        if grouped and micro is not None:  # the layers of one shape together
            specs = {name: ls.spec for name, ls in layers.items()}
            made = build_batch_factors(
                specs, lambda name: layer_stats(specs[name], micro, config, gram), config
            )

        def batch_of(name: str, ls: LayerState) -> LayerFactors | None:
            if made is not None:
                return made.pop(name, None)
            if micro is not None:
                return layer_batch_factors(ls.spec, micro, config, gram)
            return take(batch_factors, name, donate)

        fold_layers(layers, batch_of, decay, config, nonfinite, sync_free, grouped)
    lam = stage.damping
    before = moment_bases(layers)
    inverses_now = bool(resolve(opts.update_inverses, step))
    fresh = decompose_layers(
        layers,
        lam,
        config,
        update_inverses=inverses_now,
        grouped=grouped or opts.batched_eigh,
        sync_free=sync_free,
        hold=held_layers(layers, ortho, step) if inverses_now else (),
    )
    carry_moments(layers, before, fresh, grouped=grouped)
    if config.compute_method == "ekfac" and micro is not None:
        # EKFAC: this step's per-example moments in the current eigenbases
        update_scales(layers, micro, decay, nonfinite, fresh, sync_free)
    if ortho is not None:  # the layers taking orthogonalized steps: momenta and powers
        prepare_layers(layers, orthogonal_layers(layers, ortho), ortho, fresh)
    changes: dict[str, dict[str, object]] = {}
    plain = stage.basis_moments is None and ortho is None and not sync_free
    if rows is None and captures is not None and plain:
        rows = captured_rows(state, captures)  # the default mode's shortcut of Linear layers
    out = precondition_layers(
        layers,
        grads,
        stage,
        kl_clip=opts.kl_clip,
        lr=opts.lr,
        rows=rows,
        consume_rows=donate,
        changes=changes,
        grouped=grouped,
    )
    for name, change in changes.items():  # the running moments (and skip counters)
        layers[name] = layers[name].replace(**change)
    return out, state.replace(layers=layers, step=step + 1)
