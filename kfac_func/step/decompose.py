"""Stage 2 of the step: decompose the running factors (eigen or inverse).

:func:`decompose` is the public, pure stage; :func:`redecompose` and the functions around it
are the pieces the distributed step and the adapters reuse. A factor that cannot be
decomposed never stops training: its layer keeps its previous decomposition.
"""

from __future__ import annotations

import warnings
from collections.abc import MutableMapping

from kfac_func.core.conventions import decomposition_dtype
from kfac_func.core.decomposition import (
    Decomposition,
    DecompositionError,
    EigenDecomposition,
    EKFACDecomposition,
)
from kfac_func.core.ekfac import from_eigen
from kfac_func.core.layer_decomposition import eigen_decompose, inverse_decompose
from kfac_func.state import KFACConfig, KFACState, LayerState
from kfac_func.step.hyper import Hyper, check_hyper, resolve

__all__ = [
    "decompose",
    "decompose_layer",
    "decompose_layers",
    "decomposition_failed",
    "needs_decomposition",
    "redecompose",
    "warm_start",
]


def decompose(state: KFACState, *, damping: Hyper = 1e-3, only_missing: bool = False) -> KFACState:
    """Recompute every layer's decomposition from its current factors.

    With ``only_missing``, only layers without a decomposition are computed. Layers of a
    ``"fisher"`` state whose factors were never updated get none (their gradients pass
    unchanged), as zero factors carry no curvature. A factor that cannot be decomposed
    (see :func:`redecompose`) never stops training: its layer keeps its previous
    decomposition.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import kfac_func as kf
        >>> state = kf.init(kf.register(nn.Linear(3, 2)), convention="kfac-pytorch")
        >>> kf.decompose(state).layers[""].decomposition.da
        tensor([1., 1., 1., 1.])
    """
    lam = resolve(damping, state.step)
    check_hyper("damping", lam, lambda v: v >= 0, ">= 0")
    layers = dict(state.layers)
    decompose_layers(layers, lam, state.config, update_inverses=not only_missing)
    return state.replace(layers=layers)


def decompose_layers(
    layers: MutableMapping[str, LayerState],
    damping: float,
    config: KFACConfig,
    *,
    update_inverses: bool,
) -> set[str]:
    """:func:`redecompose` (in place) every layer of ``layers`` that
    :func:`needs_decomposition`, one layer at a time: a layer's previous decomposition
    (kept for a warm start and in case the new one fails) is dropped as soon as its
    replacement exists, not after the last layer (see :func:`fold_layers`). Returns the
    layers that got a new decomposition."""
    fresh = set()
    for name in list(layers):
        old = layers[name]
        if needs_decomposition(old, config, update_inverses=update_inverses):
            layers[name] = redecompose(old, damping, config)
            if layers[name].decomposition_failures == old.decomposition_failures:
                fresh.add(name)
        del old
    return fresh


def needs_decomposition(ls: LayerState, config: KFACConfig, *, update_inverses: bool) -> bool:
    """Whether a layer gets a new decomposition: on ``update_inverses`` steps, or when it
    has none yet; never from ``"fisher"`` factors that hold no data."""
    if ls.factor_updates == 0 and config.convention == "fisher":
        return False
    return update_inverses or ls.decomposition is None


def decompose_layer(ls: LayerState, damping: float, config: KFACConfig) -> Decomposition:
    """The configured decomposition of one layer's current factors (may raise
    :class:`~kfac_func.core.decomposition.DecompositionError`; see :func:`redecompose`)."""
    cdt = decomposition_dtype(config.convention, config.inv_dtype)
    if config.compute_method in ("eigen", "ekfac"):
        eig = eigen_decompose(
            ls.a_factor,
            ls.g_factor,
            damping,
            dtype=config.inv_dtype,
            compute_dtype=cdt,
            outer_product=config.compute_method == "eigen"
            and config.compute_eigenvalue_outer_product,
            warm_start=warm_start(ls, config),
            diagonal=ls.spec.diagonal,
        )
        return from_eigen(eig) if config.compute_method == "ekfac" else eig
    return inverse_decompose(
        ls.a_factor,
        ls.g_factor,
        damping,
        dtype=config.inv_dtype,
        compute_dtype=cdt,
        diagonal=ls.spec.diagonal,
    )


def warm_start(
    ls: LayerState, config: KFACConfig
) -> EigenDecomposition | EKFACDecomposition | None:
    """The decomposition to refresh under ``eigenbasis_refresh="qr"`` (None: decompose
    from scratch)."""
    dec = ls.decomposition
    if config.eigenbasis_refresh == "qr" and isinstance(
        dec, (EigenDecomposition, EKFACDecomposition)
    ):
        return dec
    return None


def redecompose(ls: LayerState, damping: float, config: KFACConfig) -> LayerState:
    """The layer with a new decomposition; if even the retries fail, the layer keeps its
    previous one (none before the first: its gradient passes unchanged) and counts the
    failure, with a warning the first time."""
    try:
        return ls.replace(decomposition=decompose_layer(ls, damping, config))
    except DecompositionError as err:
        return decomposition_failed(ls, str(err))


def decomposition_failed(ls: LayerState, reason: str | None) -> LayerState:
    """Count a failed decomposition; warn (once per layer) when ``reason`` is given."""
    if reason is not None and ls.decomposition_failures == 0:
        keep = "the previous decomposition" if ls.decomposition else "no preconditioning"
        warnings.warn(
            f"layer {ls.spec.name!r}: could not decompose {reason}; keeping {keep} "
            "(warned once per layer; LayerState.decomposition_failures counts them)",
            RuntimeWarning,
            stacklevel=3,
        )
    return ls.replace(decomposition_failures=ls.decomposition_failures + 1)
