"""The decompositions of a step computed on the device, the factors of one shape together.

Two users of one device computation (``_dense`` over stacks of equal-shaped factors,
in the dtypes of the checked one-layer decomposition,
:func:`~kfac_func.step.decompose.redecompose`, so that every result equals its result
when the factors are sound):

- the default mode's :func:`batched_eigenpairs`: the eigenpairs of the factors that share
  their shape with another, their finiteness read in one host synchronisation; every
  other side (alone in its shape, diagonal, refreshed by QR, not finite) is left to the
  checked path with its retries (float64, jitter) and warnings;
- ``sync_free`` steps' :func:`new_decompositions`: every side on the device (a diagonal
  side is its clamped entries, a placeholder side ones, a side refreshed by QR one power
  iteration), each with a 0-d bool flag that is never read on the host:
  :func:`select_on_device` keeps each layer's previous decomposition where the new one is
  not finite (``torch.where``), and its ``usable`` flag (a 0-d bool tensor in the state)
  says whether its decomposition is applied: False while the layer's factors hold no data
  (every update skipped) or no decomposition of it came out finite; the preconditioning
  of ``sync_free`` steps passes such a layer's gradient unchanged.

The running factors are finite by construction (a batch factor with NaN/Inf is never
folded in), so a non-finite result means an overflow of the storage dtype. An error
raised by the solver itself (LAPACK's failure to converge, :func:`solver_failed`) is left
to the caller.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, MutableMapping
from typing import Any

import torch

from kfac_func.core.attempts import solver_error
from kfac_func.core.conventions import decomposition_dtype
from kfac_func.core.decomposition import (
    Decomposition,
    EigenDecomposition,
    EKFACDecomposition,
    InverseDecomposition,
    eigenvalue_outer,
    power_refresh,
)
from kfac_func.core.ekfac import from_eigen
from kfac_func.core.layer_decomposition import (
    Eigenpair,
    damped_reciprocal,
    eigen_decompose,
    placeholder_side,
)
from kfac_func.core.stacks import per_row, stacked
from kfac_func.state import KFACConfig, LayerState
from kfac_func.step.accumulate import no_data_rows
from kfac_func.step.grouping import leaves_of, rebuild
from kfac_func.step.sync_free import all_finite_rows

__all__ = [
    "Made",
    "batched_eigenpairs",
    "batched_outers",
    "needs_decomposition",
    "new_decompositions",
    "select_on_device",
    "solver_failed",
    "warm_start",
]

# torch.linalg.LinAlgError (not among the exports of torch's type stubs)
_LINALG_ERROR: type[RuntimeError] = getattr(torch.linalg, "LinAlgError")  # noqa: B009

# one side's result: (eigenvectors or None, eigenvalues) or (inverse,), and its flag
_Side = tuple[tuple[Any, ...], torch.Tensor]

Made = dict[str, tuple[Decomposition, torch.Tensor, torch.Tensor]]
"""``{layer: (new decomposition, A finite, G finite)}``: both sides' results, and whether
each came out finite (0-d bool tensors)."""


def new_decompositions(
    layers: Mapping[str, LayerState],
    todo: list[str],
    damping: float,
    config: KFACConfig,
    *,
    grouped: bool = True,
) -> Made:
    """The new decompositions of the layers ``todo`` and their finiteness, computed on the
    device (see the module docstring); the sides of one shape together unless not
    ``grouped`` (then each layer's sides on their own). ``layers`` is not changed.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import kfac_func as kf
        >>> state = kf.init(kf.register(nn.Linear(2, 2)), convention="kfac-pytorch")
        >>> made = new_decompositions(state.layers, [""], 0.1, state.config)
        >>> made[""][0].da, made[""][1] & made[""][2]
        (tensor([1., 1., 1.]), tensor(True))
    """
    eigen = config.compute_method in ("eigen", "ekfac")
    sides = _sides(layers, todo, config, damping, eigen, grouped)
    pairs = {key: side[0] for key, side in sides.items()} if eigen else {}
    dgda = batched_outers(layers, config, pairs, damping) if grouped else {}  # type: ignore[arg-type]
    made: Made = {}
    for name in todo:
        ls = layers[name]
        (ra, oka), (rg, okg) = sides[(name, 0)], sides[(name, 1)]
        new: Decomposition
        if eigen:
            outer = config.compute_method == "eigen" and config.compute_eigenvalue_outer_product
            eig = eigen_decompose(
                ls.a_factor,
                ls.g_factor,
                damping,
                outer_product=outer,
                diagonal=ls.spec.diagonal,
                eigenpairs=(ra, rg),
                dgda=dgda.get(name),
            )
            new = from_eigen(eig) if config.compute_method == "ekfac" else eig
        else:
            new = InverseDecomposition(ra[0], rg[0])
        made[name] = (new, oka, okg)
    return made


def select_on_device(
    layers: MutableMapping[str, LayerState], made: Made, config: KFACConfig
) -> None:
    """Each layer of ``made`` (in place) with its new decomposition where it came out
    finite, else its previous one, and its ``usable`` flag, decided on the device (see
    the module docstring); the layers of one layout selected together."""
    groups: dict[Hashable, list[str]] = {}
    for name, (new, *_) in made.items():
        groups.setdefault(_select_key(layers[name], new), []).append(name)
    for names in groups.values():
        _select_group(layers, names, made, config)


def batched_eigenpairs(
    layers: Mapping[str, LayerState],
    config: KFACConfig,
    sides: Iterable[tuple[str, int]],
) -> dict[tuple[str, int], Eigenpair]:
    """The eigenpairs of the factors ``sides`` (``(layer, 0)`` for A, ``(layer, 1)`` for G)
    that share their shape with another, for the eigen methods: one batched ``eigh`` per
    shape on the device, whose results' finiteness is read in one host synchronisation.
    Sides that are diagonal, placeholders, refreshed by QR or alone in their shape, those
    of a stack whose ``eigh`` raised and those that did not come out finite are missing:
    the checked one-layer path decomposes them (with its retries). A result equals the
    one-factor ``eigh``'s to rounding (not always bit for bit: stacked matrices are not
    aligned as separate ones are).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import kfac_func as kf
        >>> model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 2))
        >>> state = kf.init(kf.register(model), convention="kfac-pytorch")
        >>> sides = [(n, s) for n in state.layers for s in (0, 1)]
        >>> sorted(batched_eigenpairs(state.layers, state.config, sides))
        [('0', 0), ('0', 1), ('1', 0), ('1', 1), ('2', 0)]
    """
    if config.compute_method not in ("eigen", "ekfac"):
        return {}
    groups: dict[Hashable, list[tuple[tuple[str, int], torch.Tensor]]] = {}
    for name, side in sides:
        ls = layers[name]  # a placeholder side is diagonal too
        if ls.spec.diagonal[side] or warm_start(ls, config) is not None:
            continue
        factor = ls.g_factor if side else ls.a_factor
        groups.setdefault((tuple(factor.shape), factor.dtype, factor.device), []).append(
            ((name, side), factor)
        )
    cdt = decomposition_dtype(config.convention, config.inv_dtype)
    found: list[tuple[list[tuple[str, int]], tuple[torch.Tensor, ...], torch.Tensor]] = []
    for members in groups.values():
        if len(members) < 2:
            continue
        factors = [f for _, f in members]
        try:  # the stack is handed over: _dense frees it as soon as it is read
            results = _dense(stacked(factors)[0], 0.0, True, config.inv_dtype, cdt)
        except RuntimeError:  # the factors get the checked path's retries
            continue
        q, d = results
        # finite sums prove finite results (a sum that overflowed sends the factor the
        # checked way, which decides exactly)
        found.append(
            (
                [key for key, _ in members],
                results,
                torch.isfinite(q.flatten(1).sum(1) + d.flatten(1).sum(1)),
            )
        )
    if not found:
        return {}
    ok = iter(torch.cat([f.to(found[0][2].device) for *_, f in found]).tolist())  # one read
    out: dict[tuple[str, int], Eigenpair] = {}
    for keys, (q, d), _ in found:
        for key, qk, dk in zip(keys, q.unbind(0), d.unbind(0)):
            if next(ok):
                out[key] = (qk, dk)
    return out


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


def needs_decomposition(ls: LayerState, config: KFACConfig, *, update_inverses: bool) -> bool:
    """Whether a layer gets a new decomposition: on ``update_inverses`` steps, or when it
    has none yet; never from ``"fisher"`` factors that hold no data."""
    if ls.factor_updates == 0 and config.convention == "fisher":
        return False
    return update_inverses or ls.decomposition is None


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


def solver_failed(err: BaseException) -> bool:
    """Whether ``err``, raised by a step, is a linear-algebra solver's failure (LAPACK's
    ``LinAlgError``, or a GPU solver library's error, see
    :func:`~kfac_func.core.attempts.solver_error`): what the checked decomposition
    stage retries.

    Example:
        >>> solver_failed(torch.linalg.LinAlgError("linalg.eigh: failed to converge"))
        True
        >>> solver_failed(ValueError("bad input"))
        False
    """
    return isinstance(err, _LINALG_ERROR) or solver_error(err)


def _sides(
    layers: Mapping[str, LayerState],
    todo: list[str],
    config: KFACConfig,
    damping: float,
    eigen: bool,
    grouped: bool = True,
) -> dict[tuple[str, int], _Side]:
    """Each side's decomposition and finiteness flag: the dense factors of one shape
    together (each layer's own unless ``grouped``), the others one by one."""
    dtype = config.inv_dtype
    cdt = decomposition_dtype(config.convention, dtype)
    out: dict[tuple[str, int], _Side] = {}
    groups: dict[Hashable, list[tuple[tuple[str, int], torch.Tensor]]] = {}
    for name in todo:
        ls = layers[name]
        w = warm_start(ls, config) if eigen else None
        for side, factor in ((0, ls.a_factor), (1, ls.g_factor)):
            key = (name, side)
            if ls.spec.placeholder[side]:
                ones = placeholder_side(factor, dtype=dtype)
                true = torch.ones((), dtype=torch.bool, device=factor.device)
                out[key] = (((None, ones) if eigen else (ones,)), true)
            elif ls.spec.diagonal[side]:
                out[key] = _one(_diagonal(factor, damping, eigen, dtype, cdt))
            elif w is not None:
                previous = w.qg if side else w.qa
                assert previous is not None
                out[key] = _one(power_refresh(factor, previous, dtype=dtype))
            else:
                shape = (tuple(factor.shape), factor.dtype, factor.device)
                groups.setdefault(shape if grouped else (shape, key), []).append((key, factor))
    # the largest stacks first, while the fewest results are held: the stage's peak is
    # what it holds plus the current stack's solver temporaries
    for members in sorted(groups.values(), key=lambda m: -len(m) * m[0][1].numel()):
        # the stack is handed over: _dense frees it as soon as it is read
        results = _dense(stacked([f for _, f in members])[0], damping, eigen, dtype, cdt)
        flags = all_finite_rows(list(results)).all(dim=1).unbind(0)
        each = list(zip(*(r.unbind(0) for r in results)))
        for k, (key, _) in enumerate(members):
            out[key] = (each[k], flags[k])
    return out


def _dense(
    stack: torch.Tensor,
    damping: float,
    eigen: bool,
    dtype: torch.dtype,
    cdt: torch.dtype,
) -> tuple[torch.Tensor, ...]:
    """``(eigenvectors, eigenvalues)`` or ``(inverse,)`` of a stack of dense factors, as
    :func:`~kfac_func.core.decomposition.eigh_factor` and
    :func:`~kfac_func.core.decomposition.damped_inverse` compute them (without checks)."""
    f = stack.to(cdt)
    del stack  # the caller hands over its only reference: freed before the copies below
    if eigen:
        d, q = torch.linalg.eigh(f.mT)  # column-major in and out, as eigh_factor's
        del f
        return q.to(dtype), d.to(dtype).clamp(min=0.0)
    eye = torch.eye(f.shape[-1], dtype=f.dtype, device=f.device)
    return (torch.linalg.inv((f + damping * eye).mT).to(dtype).mT,)


def _diagonal(
    factor: torch.Tensor, damping: float, eigen: bool, dtype: torch.dtype, cdt: torch.dtype
) -> tuple[Any, ...]:
    """A diagonal side: ``(None, clamped entries)`` or ``(1 / (d + λ),)`` (the
    pseudo-inverse's cut-off when ``λ = 0``), as the checked path computes it."""
    if eigen:
        return None, factor.to(dtype).clamp(min=0.0)
    return (damped_reciprocal(factor, damping, dtype=dtype, compute_dtype=cdt),)


def _select_key(ls: LayerState, new: Decomposition) -> Hashable:
    """What layers must share to have their new decompositions selected together: the
    shapes of the new tensors, whether the previous decomposition has the same ones, and
    whether the layer has a ``usable`` flag."""
    fresh = _layout(new)
    return (type(new).__name__, fresh, _same_layout(ls, new), ls.usable is None)


def _layout(dec: Decomposition) -> tuple[Hashable, ...]:
    return tuple((tuple(t.shape), t.dtype, t.device) for t in leaves_of(dec))


def _same_layout(ls: LayerState, new: Decomposition) -> bool:
    """Whether the layer's previous decomposition has the tensors ``new`` has."""
    old = ls.decomposition
    return old is not None and type(old) is type(new) and _layout(old) == _layout(new)


def _select_group(
    layers: MutableMapping[str, LayerState],
    names: list[str],
    made: Made,
    config: KFACConfig,
) -> None:
    """Each layer of ``names`` (one :func:`_select_key`) with its new decomposition where
    both sides came out finite, else its previous one (zeros when it had none, or one of
    another structure), and its ``usable`` flag; the layers stacked, a few operations for
    all of them (in place)."""
    states = [layers[n] for n in names]
    first = states[0]
    news = [made[n][0] for n in names]
    ok = stacked([made[n][1] for n in names])[0] & stacked([made[n][2] for n in names])[0]
    fresh = [stacked(list(ts))[0] for ts in zip(*(leaves_of(d) for d in news))]
    device = fresh[0].device
    if _same_layout(first, news[0]):
        kept = [
            stacked([t.to(device) for t in ts])[0]
            for ts in zip(*(leaves_of(ls.decomposition) for ls in states))
        ]
        if first.usable is None:
            before = torch.ones(len(names), dtype=torch.bool, device=device)
        else:
            before = stacked([ls.usable for ls in states])[0]  # type: ignore[misc]
    else:
        kept = [torch.zeros_like(t) for t in fresh]
        before = torch.zeros(len(names), dtype=torch.bool, device=device)
    chosen = [torch.where(per_row(ok, t), t, k) for t, k in zip(fresh, kept)]
    usable = ok | before
    empty = no_data_rows(states, config)
    if empty is not None:
        usable = usable & ~empty.to(device)
    per = [t.unbind(0) for t in chosen]
    for i, (name, ls, flag) in enumerate(zip(names, states, usable.unbind(0))):
        dec = rebuild(news[i], iter(p[i] for p in per))
        layers[name] = ls.replace(decomposition=dec, usable=flag)


def _one(result: tuple[Any, ...]) -> _Side:
    """A side decomposed alone, with its finiteness flag."""
    tensors = [t for t in result if t is not None]
    flags = all_finite_rows([t.unsqueeze(0) for t in tensors]).all()
    return result, flags
