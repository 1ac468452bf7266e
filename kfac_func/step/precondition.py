"""Stage 3 of the step: precondition the gradients and scale them by kl_clip.

:func:`precondition_grads` is the public, pure stage; the computation is
:mod:`kfac_func.step.grouped`'s (the layers of one shape together, a lone layer as a
group of one), which the distributed step shares.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from kfac_func.blocks import Rows
from kfac_func.captures import Captures
from kfac_func.core.decomposition import EigenDecomposition, InverseDecomposition
from kfac_func.state import KFACState, LayerState
from kfac_func.step.autocast import without_autocast
from kfac_func.step.basis import BasisMoments
from kfac_func.step.checks import validate_grads
from kfac_func.step.grouped import precondition_layers
from kfac_func.step.grouping import grouped_here
from kfac_func.step.hyper import as_list
from kfac_func.step.options import StepOptions, step_options
from kfac_func.step.orthogonal import orthogonal_layers, prepare_layers
from kfac_func.step.sync_free import usable_only

__all__ = ["captured_rows", "precondition_grads"]


@without_autocast
def precondition_grads(
    state: KFACState,
    grads: Mapping[str, torch.Tensor],
    *,
    rows: Mapping[str, Rows] | None = None,
    options: StepOptions | None = None,
    **settings: Any,
) -> dict[str, torch.Tensor]:
    """Precondition the gradients of every decomposed layer; others pass unchanged.

    The settings are those of :class:`kfac_func.StepOptions` (``options=``, keywords, or
    both; the keywords override ``options``); this stage reads ``damping``, ``kl_clip``,
    ``lr``, ``nonfinite``, the eigenbasis-moment settings, ``sync_free`` and ``grouped``,
    and leaves the others to the stages that use them. ``basis_moments=`` a
    :class:`~kfac_func.step.basis.BasisMoments` value spells out the eigenbasis moments.

    With ``eigenbasis_moments``, each layer's gradient is scaled by the state's running moment
    in its eigenbasis instead of by the eigenvalues (see
    :mod:`kfac_func.core.basis_moments`). The running moments have this gradient folded in
    for the step without being stored:
    :func:`kfac_func.update` stores them. The preconditioned gradients of all layers are
    then scaled by ``min(1, sqrt(kl_clip / |lr² Σ P ⊙ grad|))`` unless ``kl_clip`` is
    None. ``rows`` (``{layer: [(input rows, output-gradient rows), ...]}``, see
    :func:`~kfac_func.step.layer_step.precondition_layer`) lets Linear layers skip dense
    products.

    ``damping`` λ divides by ``dg daᵀ + λ`` in the eigenbasis (``"eigen"``, ``"ekfac"``).
    Not given (None), it is the damping of the decomposition where the decomposition holds
    one (the inverse method's damped inverses, the eigen method's precomputed ``dgda``,
    :attr:`kfac_func.KFACConfig.compute_eigenvalue_outer_product`) and ``1e-3`` elsewhere.
    Given, it applies to every layer it can: an eigen decomposition's ``dgda`` is set aside
    and the division recomputed from ``dg`` and ``da`` with this λ (an elementwise outer
    product per layer). The inverse method's inverses cannot be re-damped: their layers
    keep the damping they were decomposed with, and a UserWarning names them (decompose
    again with :func:`kfac_func.decompose` at the new damping to change it).
    :func:`kfac_func.update` decomposes with its own ``damping`` and does not warn.

    ``sync_free=True`` checks the gradients on the device (see
    :mod:`kfac_func.step.sync_free`): no host synchronisation, and a layer with a NaN or
    Inf passes its gradient unchanged without a warning (:func:`kfac_func.update` counts
    and reports those skips); ``rows`` are not used then. With every gradient finite the
    result equals the default's without rows. Traceable by
    ``torch.compile(fullgraph=True)``.

    ``grouped=True`` (the default on accelerators) preconditions the layers of one shape
    together, as stacked tensors (:mod:`kfac_func.step.grouped`); ``grouped=False`` (the
    default on a CPU) one layer at a time. The results are the same to rounding.

    Returns:
        A new dict with the keys of ``grads``.

    Example:
        >>> import torch
        >>> import kfac_func as kf
        >>> state = kf.init(kf.register(torch.nn.Linear(1, 1)), convention="kfac-pytorch")
        >>> g = {"weight": torch.ones(1, 1), "bias": torch.ones(1)}
        >>> state = kf.decompose(state, damping=1.0)
        >>> kf.step.precondition_grads(state, g, damping=1.0, kl_clip=None)["weight"]
        tensor([[0.5000]])
    """
    opts = step_options(options, _spelled_out(settings))
    stage = opts.stage_settings(state.config.compute_method, state.step)
    validate_grads(state.layers, grads)
    ortho = stage.orthogonal
    layers: Mapping[str, LayerState] = state.layers
    if ortho is not None:  # momenta from zero, powers where missing (update stores both)
        layers = dict(layers)
        prepare_layers(layers, orthogonal_layers(layers, ortho), ortho, ())
    if not stage.sync_free:  # decompositions that sync_free steps judged on the device
        layers = usable_only(layers)
    if stage.basis_moments is None and opts.damping is not None:
        layers = _damped_by(layers, stage.damping)
    return precondition_layers(
        layers,
        grads,
        stage,
        kl_clip=opts.kl_clip,
        lr=opts.lr,
        rows=None if stage.sync_free else rows,
        grouped=grouped_here(opts.grouped, layers),
    )


def _spelled_out(settings: dict[str, Any]) -> dict[str, Any]:
    """``settings`` with a :class:`~kfac_func.step.basis.BasisMoments` value of
    ``basis_moments`` (the stage's own spelling of it) as the fields of
    :class:`~kfac_func.StepOptions`."""
    out = dict(settings)
    moments = out.pop("basis_moments", None)
    if isinstance(moments, BasisMoments):
        out.update(
            eigenbasis_moments=True,
            moment_beta2=moments.beta2,
            moment_eps=moments.eps,
            moment_beta1=moments.beta1,
        )
    elif moments is not None:
        raise TypeError(f"basis_moments must be a BasisMoments or None, got {moments!r}")
    return out


def _damped_by(layers: Mapping[str, LayerState], damping: float) -> Mapping[str, LayerState]:
    """``layers`` preconditioned with ``damping``: eigen decompositions without their
    precomputed ``dgda`` (the division is recomputed with ``damping``); a UserWarning names
    the layers whose inverses hold the damping they were decomposed with."""
    out = dict(layers)
    fixed: list[str] = []
    for name, ls in layers.items():
        dec = ls.decomposition
        if isinstance(dec, EigenDecomposition) and dec.dgda is not None:
            out[name] = ls.replace(decomposition=dataclasses.replace(dec, dgda=None))
        elif isinstance(dec, InverseDecomposition):
            fixed.append(name)
    if fixed:
        warnings.warn(
            f"precondition_grads(damping={damping!r}): layers {fixed} hold damped inverses "
            "(compute_method='inverse'), so the damping of their decomposition applies, "
            "not this one; decompose again (kfac_func.decompose) with this damping to "
            "change it",
            UserWarning,
            stacklevel=3,
        )
    return out


def captured_rows(state: KFACState, captures: Captures | Sequence[Captures]) -> dict[str, Rows]:
    """The rows of the calls in ``captures`` (all micro-batches) of every layer whose kind
    has rows (:attr:`kfac_func.blocks.LayerBlock.has_rows`)."""
    out: dict[str, Rows] = {}
    micro = as_list(captures)
    for name, ls in state.layers.items():
        if not ls.spec.block.has_rows:
            continue
        found = [
            pair
            for cap in micro
            if name in cap.layers
            for pair in ls.spec.block.rows(
                ls.spec, cap.layers[name].inputs, cap.layers[name].output_grads
            )
        ]
        if found:
            out[name] = found
    return out
