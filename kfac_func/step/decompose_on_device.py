"""The decomposition stage without host synchronisation (``sync_free=True``).

:func:`~kfac_func.step.decompose.decompose_layers` checks every factor and every result on
the host and retries a failed decomposition in float64 with jitter
(:func:`~kfac_func.core.decomposition.eigh_factor`): a read of the device for each. Here
the decisions stay on the device, so that a decomposition step can run compiled and be
captured whole:

- the factors of one shape are decomposed together (one batched ``eigh`` or inverse per
  shape; a diagonal side is its clamped entries, a placeholder side ones, a side
  refreshed by QR one power iteration), in the dtypes of the checked path, so that every
  result equals its result when the factors are sound;
- each layer keeps its previous decomposition where the new one is not finite
  (``torch.where``), and its ``usable`` flag (a 0-d bool tensor in the state) says
  whether its decomposition is applied: False while the layer's factors hold no data
  (every update skipped) or no decomposition of it came out finite; the preconditioning
  of ``sync_free`` steps passes such a layer's gradient unchanged.

The running factors are finite by construction (a batch factor with NaN/Inf is never
folded in), so a non-finite result means an overflow of the storage dtype; the retries of
the checked path are not run for it. An error raised by the solver itself (LAPACK's
failure to converge) is left to the caller (the adapter's compiled step reruns the step
eagerly, with those retries).
"""

from __future__ import annotations

from collections.abc import Hashable, MutableMapping
from typing import Any

import torch

from kfac_func.core.conventions import decomposition_dtype
from kfac_func.core.decomposition import (
    Decomposition,
    EigenDecomposition,
    InverseDecomposition,
    eigenvalue_outer,
    power_refresh,
    solver_error,
)
from kfac_func.core.ekfac import from_eigen
from kfac_func.core.layer_decomposition import (
    damped_reciprocal,
    placeholder_side,
    precompute_outer,
)
from kfac_func.core.stacks import stacked
from kfac_func.state import KFACConfig, LayerState
from kfac_func.step.decompose import batched_outers, needs_decomposition, warm_start
from kfac_func.step.grouped_fold import all_finite_rows, no_data_rows
from kfac_func.step.grouping import leaves_of, rebuild

__all__ = ["decompose_layers_on_device", "solver_failed"]

# torch.linalg.LinAlgError (not among the exports of torch's type stubs)
_LINALG_ERROR: type[RuntimeError] = getattr(torch.linalg, "LinAlgError")  # noqa: B009

# one side's result: (eigenvectors or None, eigenvalues) or (inverse,), and its flag
_Side = tuple[tuple[Any, ...], torch.Tensor]


def decompose_layers_on_device(
    layers: MutableMapping[str, LayerState],
    damping: float,
    config: KFACConfig,
    *,
    update_inverses: bool,
    eigh_device: torch.device | None = None,
) -> set[str]:
    """:func:`~kfac_func.step.decompose.decompose_layers` (in place) without reading the
    device on the host (see the module docstring). Returns the layers that got a new
    decomposition (or kept their previous one where the new one was not finite).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import kfac_func as kf
        >>> state = kf.init(kf.register(nn.Linear(2, 2)), convention="kfac-pytorch")
        >>> layers = dict(state.layers)
        >>> decompose_layers_on_device(layers, 0.1, state.config, update_inverses=True)
        {''}
        >>> layers[""].decomposition.da, layers[""].usable
        (tensor([1., 1., 1.]), tensor(True))
    """
    todo = [
        name
        for name, ls in layers.items()
        if needs_decomposition(ls, config, update_inverses=update_inverses)
    ]
    if not todo:
        return set()
    eigen = config.compute_method in ("eigen", "ekfac")
    sides = _sides(layers, todo, config, damping, eigen, eigh_device)
    pairs = {key: side[0] for key, side in sides.items()} if eigen else {}
    dgda = batched_outers(layers, config, pairs, damping)  # type: ignore[arg-type]
    made: dict[str, tuple[Decomposition, torch.Tensor, torch.Tensor]] = {}
    for name in todo:
        ls = layers[name]
        (ra, oka), (rg, okg) = sides[(name, 0)], sides[(name, 1)]
        new: Decomposition
        if eigen:
            eig = EigenDecomposition(ra[0], ra[1], rg[0], rg[1], dgda.get(name))
            if eig.dgda is None and precompute_outer(
                config.compute_method == "eigen" and config.compute_eigenvalue_outer_product,
                ls.spec.diagonal,
            ):
                eig = EigenDecomposition(eig.qa, eig.da, eig.qg, eig.dg, _outer(eig, damping))
            new = from_eigen(eig) if config.compute_method == "ekfac" else eig
        else:
            new = InverseDecomposition(ra[0], rg[0])
        made[name] = (new, oka, okg)
    groups: dict[Hashable, list[str]] = {}
    for name, (new, _, _) in made.items():
        groups.setdefault(_select_key(layers[name], new), []).append(name)
    for names in groups.values():
        _select_group(layers, names, made, config)
    return set(todo)


def solver_failed(err: BaseException) -> bool:
    """Whether ``err``, raised by a step, is a linear-algebra solver's failure (LAPACK's
    ``LinAlgError``, or a GPU solver library's error, see
    :func:`~kfac_func.core.decomposition.solver_error`): what the checked decomposition
    stage retries.

    Example:
        >>> solver_failed(torch.linalg.LinAlgError("linalg.eigh: failed to converge"))
        True
        >>> solver_failed(ValueError("bad input"))
        False
    """
    return isinstance(err, _LINALG_ERROR) or solver_error(err)


def _sides(
    layers: MutableMapping[str, LayerState],
    todo: list[str],
    config: KFACConfig,
    damping: float,
    eigen: bool,
    eigh_device: torch.device | None,
) -> dict[tuple[str, int], _Side]:
    """Each side's decomposition and finiteness flag: the dense factors of one shape
    together, the others one by one."""
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
                out[key] = (((None, ones) if eigen else (ones,)), _true(factor))
            elif ls.spec.diagonal[side]:
                out[key] = _one(_diagonal(factor, damping, eigen, dtype, cdt))
            elif w is not None:
                previous = w.qg if side else w.qa
                assert previous is not None
                out[key] = _one(power_refresh(factor, previous, dtype=dtype))
            else:
                groups.setdefault((tuple(factor.shape), factor.dtype, factor.device), []).append(
                    (key, factor)
                )
    for members in groups.values():
        stack = stacked([f for _, f in members])[0]
        results = _dense(stack, damping, eigen, dtype, cdt, eigh_device)
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
    eigh_device: torch.device | None,
) -> tuple[torch.Tensor, ...]:
    """``(eigenvectors, eigenvalues)`` or ``(inverse,)`` of a stack of dense factors, as
    :func:`~kfac_func.core.decomposition.eigh_factor` and
    :func:`~kfac_func.core.decomposition.damped_inverse` compute them (without checks)."""
    home = stack.device
    run_on = eigh_device if eigh_device is not None else home
    if eigen:
        d, q = torch.linalg.eigh(stack.to(run_on, cdt))
        return q.to(home, dtype).contiguous(), d.to(home, dtype).clamp(min=0.0)
    f = stack.to(cdt)
    eye = torch.eye(f.shape[-1], dtype=f.dtype, device=f.device)
    return (torch.linalg.inv(f + damping * eye).to(dtype).contiguous(),)


def _diagonal(
    factor: torch.Tensor, damping: float, eigen: bool, dtype: torch.dtype, cdt: torch.dtype
) -> tuple[Any, ...]:
    """A diagonal side: ``(None, clamped entries)`` or ``(1 / (d + λ),)`` (the
    pseudo-inverse's cut-off when ``λ = 0``), as the checked path computes it."""
    if eigen:
        return None, factor.to(dtype).clamp(min=0.0)
    return (damped_reciprocal(factor, damping, dtype=dtype, compute_dtype=cdt),)


def _outer(eig: EigenDecomposition, damping: float) -> torch.Tensor:
    return eigenvalue_outer(eig.dg, eig.da, damping)


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
    made: dict[str, tuple[Decomposition, torch.Tensor, torch.Tensor]],
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
    chosen = [torch.where(_rows(ok, t), t, k) for t, k in zip(fresh, kept)]
    usable = ok | before
    empty = no_data_rows(states, config)
    if empty is not None:
        usable = usable & ~empty.to(device)
    per = [t.unbind(0) for t in chosen]
    for i, (name, ls, flag) in enumerate(zip(names, states, usable.unbind(0))):
        dec = rebuild(news[i], iter(p[i] for p in per))
        layers[name] = ls.replace(decomposition=dec, usable=flag)


def _rows(flags: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """One flag per row of ``like``, shaped to broadcast over it."""
    return flags.reshape(-1, *([1] * (like.dim() - 1)))


def _one(result: tuple[Any, ...]) -> _Side:
    """A side decomposed alone, with its finiteness flag."""
    tensors = [t for t in result if t is not None]
    flags = all_finite_rows([t.unsqueeze(0) for t in tensors]).all()
    return result, flags


def _true(like: torch.Tensor) -> torch.Tensor:
    return torch.ones((), dtype=torch.bool, device=like.device)
