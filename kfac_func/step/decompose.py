"""Stage 2 of the step: decompose the running factors (eigen or inverse).

:func:`decompose` is the public, pure stage; :func:`decompose_layers` decomposes a step's
layers (the factors of one shape together by :mod:`kfac_func.step.decompose_groups`, the
others checked here); :func:`redecompose` and the functions around it are the checked
one-layer pieces, which the distributed step and the adapters use too. A factor that cannot be
decomposed never stops training: its layer keeps its previous decomposition.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Collection, Mapping, MutableMapping
from typing import Any

import torch

from kfac_func.core.attempts import DecompositionError
from kfac_func.core.conventions import decomposition_dtype
from kfac_func.core.decomposition import Decomposition, EigenDecomposition
from kfac_func.core.ekfac import from_eigen
from kfac_func.core.layer_decomposition import Eigenpair, eigen_decompose, inverse_decompose
from kfac_func.state import KFACConfig, KFACState, LayerState
from kfac_func.step.autocast import without_autocast
from kfac_func.step.decompose_groups import (
    batched_eigenpairs,
    batched_outers,
    needs_decomposition,
    new_decompositions,
    select_on_device,
    solver_failed,
    warm_start,
)
from kfac_func.step.hyper import Hyper, resolve_checked

__all__ = [
    "decompose",
    "decompose_layer",
    "decompose_layers",
    "decomposition_failed",
    "redecompose",
]


@without_autocast
def decompose(
    state: KFACState,
    *,
    damping: Hyper = 1e-3,
    only_missing: bool = False,
    batched_eigh: bool = False,
) -> KFACState:
    """Recompute every layer's decomposition from its current factors.

    With ``only_missing``, only layers without a decomposition are computed. Layers of a
    ``"fisher"`` state whose factors were never updated get none (their gradients pass
    unchanged), as zero factors carry no curvature. A factor that cannot be decomposed
    (see :func:`redecompose`) never stops training: its layer keeps its previous
    decomposition.

    ``batched_eigh``, a setting for GPUs (``"eigen"`` and ``"ekfac"``; ``update``,
    ``update_distributed`` and ``KFACPreconditioner`` take it too): factors of equal shape
    and dtype, across layers, are stacked and decomposed with one ``eigh`` call per shape
    (see :func:`~kfac_func.step.decompose_groups.batched_eigenpairs`), instead of one
    call per factor: on a GPU fewer solver calls, each of which waits for its result; on
    a CPU LAPACK decomposes the stack one matrix at a time. Results equal the per-factor
    ones to rounding (not always bit for bit). Eigenbases refreshed by QR are refreshed
    one by one (they are not eigh).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import kfac_func as kf
        >>> state = kf.init(kf.register(nn.Linear(3, 2)), convention="kfac-pytorch")
        >>> kf.decompose(state).layers[""].decomposition.da
        tensor([1., 1., 1., 1.])
        >>> batched = kf.decompose(state, batched_eigh=True)
        >>> torch.equal(batched.layers[""].decomposition.qa, torch.eye(4))
        True
    """
    lam = resolve_checked("damping", damping, state.step)
    layers = dict(state.layers)
    decompose_layers(
        layers,
        lam,
        state.config,
        update_inverses=not only_missing,
        grouped=batched_eigh,
    )
    return state.replace(layers=layers)


def decompose_layers(
    layers: MutableMapping[str, LayerState],
    damping: float,
    config: KFACConfig,
    *,
    update_inverses: bool,
    grouped: bool = True,
    sync_free: bool = False,
    hold: Collection[str] = (),
) -> set[str]:
    """Decompose (in place) every layer of ``layers`` that :func:`needs_decomposition`:
    the decomposition stage of every step. Returns the layers that got a new one. The
    layers named in ``hold`` keep their decomposition where they have one, even on an
    ``update_inverses`` step (:func:`kfac_func.step.orthogonal.held_layers`).

    The factors of one shape are decomposed together on the device (``grouped``; see
    :mod:`kfac_func.step.decompose_groups`). The default mode reads whether they came out
    finite in one host synchronisation, and decomposes the other sides one by one with
    the checks and retries of :func:`redecompose` (float64, jitter; a layer that still
    fails keeps its previous decomposition, with a warning), one layer at a time: each
    layer's previous decomposition is dropped as soon as its replacement exists, and a
    layer whose A factor equals the previous layer's takes its eigenbasis. With
    ``sync_free`` nothing is read: every side is computed on the device and each layer
    keeps its previous decomposition where the new one is not finite, as its ``usable``
    flag says (:func:`~kfac_func.step.decompose_groups.select_on_device`); should the
    solver itself fail (LAPACK not converging), the layers take the default mode's path
    (a compiled step raises: the adapter reruns it eagerly).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import kfac_func as kf
        >>> state = kf.init(kf.register(nn.Linear(2, 2)), convention="kfac-pytorch")
        >>> layers = dict(state.layers)
        >>> decompose_layers(layers, 0.1, state.config, update_inverses=True)
        {''}
        >>> layers[""].decomposition.da
        tensor([1., 1., 1.])
    """
    todo = [
        name
        for name, ls in layers.items()
        if needs_decomposition(ls, config, update_inverses=update_inverses and name not in hold)
    ]
    if sync_free and todo:
        try:
            made = new_decompositions(layers, todo, damping, config, grouped=grouped)
        except RuntimeError as err:  # nothing of layers changed yet
            if not solver_failed(err) or torch.compiler.is_compiling():
                raise
        else:
            select_on_device(layers, made, config)
            return set(todo)
    pairs: dict[tuple[str, int], Eigenpair] = {}
    takers = _takers(layers, todo, config)  # their A factor's eigenpair is the previous layer's
    if grouped:
        sides = [(name, side) for name in todo for side in (0, 1) if side or name not in takers]
        pairs = batched_eigenpairs(layers, config, sides)
    outers = batched_outers(layers, config, pairs, damping) if grouped else {}
    fresh = set()
    last_a: Eigenpair | None = None  # the previous layer's A eigenpair, where it has one
    for name in todo:
        old = layers[name]
        given = (pairs.pop((name, 0), None), pairs.pop((name, 1), None))
        if name in takers and last_a is not None:
            given = (last_a, given[1])
        layers[name] = redecompose(
            old, damping, config, eigenpairs=given, dgda=outers.pop(name, None)
        )
        dec, last_a = layers[name].decomposition, None
        if layers[name].decomposition_failures == old.decomposition_failures:
            fresh.add(name)
            if isinstance(dec, EigenDecomposition) and dec.qa is not None:
                last_a = (dec.qa, dec.da)
            if sync_free:  # decided on the host after the solver's failure: applied
                usable = torch.ones((), dtype=torch.bool, device=old.a_factor.device)
                layers[name] = layers[name].replace(usable=usable)
        del old, given
    return fresh


def _takers(layers: Mapping[str, LayerState], todo: list[str], config: KFACConfig) -> set[str]:
    """The layers of ``todo`` whose A factor equals the previous one's (an attention's
    query, key and value projections read one input, so their A factors are equal): they
    take its eigenpair instead of an ``eigh`` of their own, which would give it again (to
    rounding: LAPACK may round another copy of a matrix differently). Compared on a CPU
    only, where reading the factors costs no synchronisation; eigenbases decomposed from
    scratch only (not refreshed by QR)."""
    out: set[str] = set()
    if config.compute_method != "eigen":
        return out
    for before, name in itertools.pairwise(todo):
        a, b = layers[before], layers[name]
        if not any(
            ls.spec.diagonal[0] or warm_start(ls, config) is not None for ls in (a, b)
        ) and _same(a.a_factor, b.a_factor):
            out.add(name)
    return out


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two factors on a CPU are equal, entry for entry, in the same dtype (the
    diagonals of large ones compared first: factors that differ almost always differ
    there, at a small fraction of the cost of comparing every entry)."""
    if not (a.device.type == b.device.type == "cpu" and a.shape == b.shape):
        return False
    if a.dtype != b.dtype:
        return False
    diagonals = (t.diagonal(dim1=-2, dim2=-1) for t in (a, b))
    if a.numel() > _SAME_AT_ONCE and not torch.equal(*diagonals):
        return False
    return torch.equal(a, b)


# factors of at most this many entries are compared whole at once (a comparison of the
# diagonals first costs more operations than it saves)
_SAME_AT_ONCE = 64 * 64


def decompose_layer(
    ls: LayerState,
    damping: float,
    config: KFACConfig,
    *,
    eigenpairs: tuple[Eigenpair | None, Eigenpair | None] = (None, None),
    dgda: torch.Tensor | None = None,
) -> Decomposition:
    """The configured decomposition of one layer's current factors (may raise
    :class:`~kfac_func.core.attempts.DecompositionError`; see :func:`redecompose`).
    ``eigenpairs`` and ``dgda`` are :func:`~kfac_func.core.eigen_decompose`'s."""
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
            eigenpairs=eigenpairs,
            name=ls.spec.name,
            dgda=dgda,
            placeholder=ls.spec.placeholder,
        )
        return from_eigen(eig) if config.compute_method == "ekfac" else eig
    return inverse_decompose(
        ls.a_factor,
        ls.g_factor,
        damping,
        dtype=config.inv_dtype,
        compute_dtype=cdt,
        diagonal=ls.spec.diagonal,
        name=ls.spec.name,
        placeholder=ls.spec.placeholder,
    )


def redecompose(ls: LayerState, damping: float, config: KFACConfig, **options: Any) -> LayerState:
    """The layer with a new decomposition (:func:`decompose_layer`'s, with its keyword
    ``options``); if even the retries fail, the layer keeps its previous one (none before
    the first: its gradient passes unchanged) and counts the failure, with a warning the
    first time."""
    try:
        return ls.replace(decomposition=decompose_layer(ls, damping, config, **options))
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
