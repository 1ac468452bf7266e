"""Stage 2 of the step: decompose the running factors (eigen or inverse).

:func:`decompose` is the public, pure stage; :func:`redecompose` and the functions around it
are the pieces the distributed step and the adapters reuse. A factor that cannot be
decomposed never stops training: its layer keeps its previous decomposition.
"""

from __future__ import annotations

import warnings
from collections.abc import Hashable, Iterable, Mapping, MutableMapping

import torch

from kfac_func.core.conventions import decomposition_dtype
from kfac_func.core.decomposition import (
    Decomposition,
    DecompositionError,
    EigenDecomposition,
    EKFACDecomposition,
    eigenvalue_outer,
    eigh_factors,
)
from kfac_func.core.ekfac import from_eigen
from kfac_func.core.layer_decomposition import Eigenpair, eigen_decompose, inverse_decompose
from kfac_func.core.stacks import stacked
from kfac_func.state import KFACConfig, KFACState, LayerState
from kfac_func.step.autocast import without_autocast
from kfac_func.step.hyper import Hyper, check_hyper, resolve

__all__ = [
    "batched_eigenpairs",
    "check_eigh_device",
    "decompose",
    "decompose_layer",
    "decompose_layers",
    "decomposition_failed",
    "needs_decomposition",
    "redecompose",
    "warm_start",
]


@without_autocast
def decompose(
    state: KFACState,
    *,
    damping: Hyper = 1e-3,
    only_missing: bool = False,
    batched_eigh: bool = False,
    eigh_device: torch.device | str | None = None,
) -> KFACState:
    """Recompute every layer's decomposition from its current factors.

    With ``only_missing``, only layers without a decomposition are computed. Layers of a
    ``"fisher"`` state whose factors were never updated get none (their gradients pass
    unchanged), as zero factors carry no curvature. A factor that cannot be decomposed
    (see :func:`redecompose`) never stops training: its layer keeps its previous
    decomposition.

    Two settings for GPUs (``"eigen"`` and ``"ekfac"``; ``update``, ``update_distributed``
    and ``KFACPreconditioner`` take them too):

    - ``batched_eigh``: factors of equal shape and dtype, across layers, are stacked and
      decomposed with one ``eigh`` call per shape (see
      :func:`~kfac_func.core.decomposition.eigh_factors`), instead of one call per
      factor: on a GPU fewer solver calls, each of which waits for its result; on a CPU
      LAPACK decomposes the stack one matrix at a time. Results equal the per-factor
      ones to rounding (not always bit for bit); every new decomposition is held until
      the last layer's is made, where the per-factor path frees each layer's previous
      one as it goes. Not for eigenbases refreshed by QR (they are not eigh).
    - ``eigh_device``: where eigh runs, e.g. ``"cpu"`` to offload it from a GPU (its
      results are moved back to the factors' device); None: the factors' device.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import kfac_func as kf
        >>> state = kf.init(kf.register(nn.Linear(3, 2)), convention="kfac-pytorch")
        >>> kf.decompose(state).layers[""].decomposition.da
        tensor([1., 1., 1., 1.])
        >>> batched = kf.decompose(state, batched_eigh=True, eigh_device="cpu")
        >>> torch.equal(batched.layers[""].decomposition.qa, torch.eye(4))
        True
    """
    lam = resolve(damping, state.step)
    check_hyper("damping", lam, lambda v: v >= 0, ">= 0")
    layers = dict(state.layers)
    decompose_layers(
        layers,
        lam,
        state.config,
        update_inverses=not only_missing,
        batched_eigh=batched_eigh,
        eigh_device=eigh_device,
    )
    return state.replace(layers=layers)


def check_eigh_device(eigh_device: torch.device | str | None) -> torch.device | None:
    """``eigh_device`` as a ``torch.device`` (None stays None); a ValueError names the
    argument when it is not a device.

    Example:
        >>> check_eigh_device("cpu")
        device(type='cpu')
    """
    if eigh_device is None:
        return None
    try:
        return torch.device(eigh_device)
    except (RuntimeError, TypeError, ValueError) as err:
        raise ValueError(
            f"eigh_device must be None or a device such as 'cpu', got {eigh_device!r}"
        ) from err


def batched_eigenpairs(
    layers: Mapping[str, LayerState],
    config: KFACConfig,
    sides: Iterable[tuple[str, int]],
    *,
    eigh_device: torch.device | None = None,
) -> dict[tuple[str, int], Eigenpair]:
    """The eigenpairs of the factors ``sides`` (``(layer, 0)`` for A, ``(layer, 1)`` for G)
    from batched eigh calls (:func:`~kfac_func.core.decomposition.eigh_factors`), for the
    eigen methods. Sides that are diagonal, refreshed by QR or that the batched calls gave
    no result for are missing: decompose those one by one."""
    if config.compute_method not in ("eigen", "ekfac"):
        return {}
    keys, factors = [], []
    for name, side in sides:
        ls = layers[name]
        if ls.spec.diagonal[side] or warm_start(ls, config) is not None:
            continue
        keys.append((name, side))
        factors.append(ls.g_factor if side else ls.a_factor)
    cdt = decomposition_dtype(config.convention, config.inv_dtype)
    results = eigh_factors(factors, dtype=config.inv_dtype, compute_dtype=cdt, device=eigh_device)
    return {k: r for k, r in zip(keys, results) if r is not None}


def batched_outers(
    layers: Mapping[str, LayerState],
    config: KFACConfig,
    pairs: Mapping[tuple[str, int], Eigenpair],
    damping: float,
) -> dict[str, torch.Tensor]:
    """The precomputed ``dgda = 1/(dg daᵀ + λ)`` of the layers whose two eigenpairs are in
    ``pairs``, computed together for layers of equal shapes (a few operations per group);
    empty unless the configuration precomputes it (``"eigen"`` with
    ``compute_eigenvalue_outer_product``). Layers alone in their shape are left out (their
    decomposition computes it)."""
    if config.compute_method != "eigen" or not config.compute_eigenvalue_outer_product:
        return {}
    groups: dict[Hashable, list[str]] = {}
    for name, ls in layers.items():
        a, g = pairs.get((name, 0)), pairs.get((name, 1))
        if a is None or g is None or any(ls.spec.diagonal):
            continue
        key = (tuple(a[1].shape), tuple(g[1].shape), a[1].dtype, a[1].device)
        groups.setdefault(key, []).append(name)
    out: dict[str, torch.Tensor] = {}
    for names in groups.values():
        if len(names) < 2:
            continue
        da = stacked([pairs[(n, 0)][1] for n in names])[0]
        dg = stacked([pairs[(n, 1)][1] for n in names])[0]
        out.update(zip(names, eigenvalue_outer(dg, da, damping).unbind(0)))
    return out


def decompose_layers(
    layers: MutableMapping[str, LayerState],
    damping: float,
    config: KFACConfig,
    *,
    update_inverses: bool,
    batched_eigh: bool = False,
    eigh_device: torch.device | str | None = None,
    grouped: bool = False,
) -> set[str]:
    """:func:`redecompose` (in place) every layer of ``layers`` that
    :func:`needs_decomposition`, one layer at a time: a layer's previous decomposition
    (kept for a warm start and in case the new one fails) is dropped as soon as its
    replacement exists, not after the last layer (see :func:`fold_layers`). With
    ``batched_eigh`` the eigendecompositions of equal-shaped factors are computed first,
    together (see :func:`decompose`). ``grouped``: batched eigh, and the precomputed
    ``dgda`` of equal-shaped layers computed together (operations per group, not per
    layer). Returns the layers that got a new decomposition."""
    device = check_eigh_device(eigh_device)
    todo = [
        name
        for name, ls in layers.items()
        if needs_decomposition(ls, config, update_inverses=update_inverses)
    ]
    pairs: dict[tuple[str, int], Eigenpair] = {}
    if batched_eigh or grouped:
        sides = [(name, side) for name in todo for side in (0, 1)]
        pairs = batched_eigenpairs(layers, config, sides, eigh_device=device)
    outers = batched_outers(layers, config, pairs, damping) if grouped else {}
    fresh = set()
    for name in todo:
        old = layers[name]
        given = (pairs.pop((name, 0), None), pairs.pop((name, 1), None))
        layers[name] = redecompose(
            old, damping, config, eigh_device=device, eigenpairs=given, dgda=outers.pop(name, None)
        )
        if layers[name].decomposition_failures == old.decomposition_failures:
            fresh.add(name)
        del old, given
    return fresh


def needs_decomposition(ls: LayerState, config: KFACConfig, *, update_inverses: bool) -> bool:
    """Whether a layer gets a new decomposition: on ``update_inverses`` steps, or when it
    has none yet; never from ``"fisher"`` factors that hold no data."""
    if ls.factor_updates == 0 and config.convention == "fisher":
        return False
    return update_inverses or ls.decomposition is None


def decompose_layer(
    ls: LayerState,
    damping: float,
    config: KFACConfig,
    *,
    eigh_device: torch.device | str | None = None,
    eigenpairs: tuple[Eigenpair | None, Eigenpair | None] = (None, None),
    dgda: torch.Tensor | None = None,
) -> Decomposition:
    """The configured decomposition of one layer's current factors (may raise
    :class:`~kfac_func.core.decomposition.DecompositionError`; see :func:`redecompose`).
    ``eigh_device``, ``eigenpairs`` and ``dgda`` are :func:`~kfac_func.core.eigen_decompose`'s."""
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
            eigh_device=eigh_device,
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


def redecompose(
    ls: LayerState,
    damping: float,
    config: KFACConfig,
    *,
    eigh_device: torch.device | str | None = None,
    eigenpairs: tuple[Eigenpair | None, Eigenpair | None] = (None, None),
    dgda: torch.Tensor | None = None,
) -> LayerState:
    """The layer with a new decomposition; if even the retries fail, the layer keeps its
    previous one (none before the first: its gradient passes unchanged) and counts the
    failure, with a warning the first time."""
    try:
        dec = decompose_layer(
            ls, damping, config, eigh_device=eigh_device, eigenpairs=eigenpairs, dgda=dgda
        )
        return ls.replace(decomposition=dec)
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
