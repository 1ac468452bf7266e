"""EKFAC's stage of the step: the corrected eigenvalues of every layer decomposed with
``compute_method="ekfac"``, from this step's captures, in the current eigenbasis.

:func:`correct_eigenvalues` is the public, pure stage (after :func:`~kfac_func.decompose`);
:func:`update_scales` the piece :func:`kfac_func.update` runs right after decomposing,
restarting the average of the layers whose basis was just computed. The math is in
:mod:`kfac_func.core.ekfac`.
"""

from __future__ import annotations

from collections.abc import Collection, MutableMapping, Sequence

import torch

from kfac_func.blocks import LayerSpec
from kfac_func.captures import Captures
from kfac_func.core.attempts import all_finite
from kfac_func.core.decomposition import EKFACDecomposition
from kfac_func.core.ekfac import example_moments, rescaled
from kfac_func.state import KFACState, LayerState
from kfac_func.step.hyper import Hyper, NonFinite, as_list, non_finite, resolve_checked
from kfac_func.step.sync_free import all_finite_tensor

__all__ = [
    "correct_eigenvalues",
    "fold_moments",
    "layer_moment_sums",
    "update_scales",
]


def layer_moment_sums(
    spec: LayerSpec, micro: Sequence[Captures], dec: EKFACDecomposition
) -> tuple[torch.Tensor, int] | None:
    """``(Σ_n (Qgᵀ ∇W_n Qa)², N)`` over the examples of ``micro`` (per-example gradients of
    the per-example losses: raw output-gradients divided by the captures' loss scale), or
    None when the layer was not called or its kind has no per-example rows.

    Every call of the layer in one capture adds to the same examples' gradients, so the
    calls must see the same number of examples (a ValueError names the layer otherwise).
    """
    dtype = dec.scale.dtype
    total: torch.Tensor | None = None
    examples = 0
    for cap in micro:
        lc = cap.layers.get(spec.name)
        if lc is None or not lc.inputs:
            continue
        rows = [
            spec.block.example_rows(spec, x.to(dtype), r.to(dtype) / cap.loss_scale)
            for x, r in zip(lc.inputs, lc.output_grads)
        ]
        if any(r is None for r in rows):
            return None
        a_parts = [r[0] for r in rows if r is not None]
        g_parts = [r[1] for r in rows if r is not None]
        if len({a.shape[-3] for a in a_parts}) != 1:
            raise ValueError(
                f"layer {spec.name!r}: its calls in one batch see different numbers of "
                f"examples {[a.shape[-3] for a in a_parts]}"
            )
        a, g = torch.cat(a_parts, dim=-2), torch.cat(g_parts, dim=-2)
        qa = None if dec.qa is None else dec.qa.to(dtype)
        qg = None if dec.qg is None else dec.qg.to(dtype)
        m = example_moments(a, g, qa, qg)
        total = m if total is None else total.add_(m)
        examples += a.shape[-3]
    return None if total is None else (total, examples)


def update_scales(
    layers: MutableMapping[str, LayerState],
    micro: Sequence[Captures],
    decay: float,
    nonfinite: NonFinite,
    fresh: Collection[str] = (),
    sync_free: bool = False,
) -> None:
    """Fold this step's moments into the scale of every EKFAC layer of ``layers`` (in
    place); the layers in ``fresh`` got their eigenbasis this step and restart from the
    moments. A layer whose moments hold NaN/Inf keeps its scale (warned or raised as
    ``nonfinite`` says; ``sync_free``: selected on the device, without a warning)."""
    for name in list(layers):
        ls = layers[name]
        dec = ls.decomposition
        if not isinstance(dec, EKFACDecomposition):
            continue
        sums = layer_moment_sums(ls.spec, micro, dec)
        if sums is None:
            continue
        moments = sums[0] / sums[1]  # (1/N) Σ_n (Qgᵀ ∇W_n Qa)²
        if sync_free:
            new = rescaled(dec, moments, decay, name in fresh)
            ok = all_finite_tensor(moments)
            kept = EKFACDecomposition(dec.qa, dec.qg, torch.where(ok, new.scale, dec.scale))
            layers[name] = ls.replace(decomposition=kept)
        else:
            layers[name] = fold_moments(ls, moments, decay, nonfinite, restart=name in fresh)


def fold_moments(
    ls: LayerState, moments: torch.Tensor, decay: float, nonfinite: NonFinite, restart: bool
) -> LayerState:
    """``ls`` with ``moments`` folded into its EKFAC scale (see
    :func:`kfac_func.core.ekfac.rescaled`); unchanged, warned or raised as ``nonfinite``
    says, when they hold NaN/Inf."""
    dec = ls.decomposition
    assert isinstance(dec, EKFACDecomposition)
    if not all_finite(moments):
        non_finite(ls.spec.name, "the EKFAC moments of this batch", nonfinite)
        return ls
    return ls.replace(decomposition=rescaled(dec, moments, decay, restart))


def correct_eigenvalues(
    state: KFACState,
    captures: Captures | Sequence[Captures],
    *,
    factor_decay: Hyper = 0.95,
    nonfinite: NonFinite = "skip",
) -> KFACState:
    """Fold the captures' per-example gradient moments into the corrected eigenvalues of
    every layer decomposed with ``compute_method="ekfac"`` (in its current basis):
    ``scale = decay · scale + (1 − decay) · (1/N) Σ_n (Qgᵀ ∇W_n Qa)²``.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import kfac_func as kf
        >>> model = nn.Linear(3, 2)
        >>> state = kf.init(kf.register(model), compute_method="ekfac")
        >>> _, grads, caps = kf.capture(model, dict(model.named_parameters()),
        ...                             torch.randn(4, 3), lambda out: out.pow(2).mean())
        >>> state = kf.decompose(kf.step.accumulate_factors(state, caps))
        >>> kf.step.correct_eigenvalues(state, caps).layers[""].decomposition.scale.shape
        torch.Size([2, 4])
    """
    decay = resolve_checked("factor_decay", factor_decay, state.step)
    layers = dict(state.layers)
    update_scales(layers, as_list(captures), decay, nonfinite)
    return state.replace(layers=layers)
