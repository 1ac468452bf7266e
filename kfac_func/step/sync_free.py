"""The pieces of a step without host synchronisation (``sync_free=True``).

By default a step reads every layer's checks on the host (one synchronisation, see
:mod:`kfac_func.step.grouped`) and branches in Python: a layer whose gradient
holds a NaN or Inf is left out and a warning names it. On a GPU that read waits for every
queued kernel. With ``sync_free=True`` the decision stays on the device:

- each layer's finiteness is a 0-d bool tensor (:func:`all_finite_tensor`);
- the layer is preconditioned whatever it holds, and ``torch.where`` selects the
  preconditioned or the raw gradient (:func:`apply_selected`); a skipped layer's term of
  the kl_clip sum is zero, its running moments keep their old values (:func:`keep_where`);
- the skips are counted in the state (``LayerState.grad_skips``, a 0-d int64 tensor,
  :func:`count_skips`) and warned about later: when :func:`report_skipped` is called, or
  at the next step without ``sync_free`` (which reads the device anyway).

Steps that update the factors or decompose them decide on the device as well (see
:func:`~kfac_func.step.accumulate.settle_on_device` and
:mod:`kfac_func.step.decompose_groups`).

When every gradient is finite the numbers are exactly those of the default mode's dense
path. The rows shortcut of Linear layers (:func:`kfac_func.step.precondition.precondition_layer`)
needs a host decision and is not taken in this mode.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, MutableMapping, Sequence

import torch

from kfac_func.blocks import LayerSpec, matrix_to_grads
from kfac_func.core.preconditioning import kl_clip_scale_of_terms, kl_clip_term
from kfac_func.state import KFACState, LayerState
from kfac_func.step.hyper import Hyper, NonFinite, clip_and_rate

__all__ = [
    "all_finite_each",
    "all_finite_rows",
    "all_finite_tensor",
    "apply_selected",
    "check_sync_free",
    "count_skips",
    "keep_where",
    "leave_sync_free",
    "report_layers",
    "report_skipped",
    "usable_only",
]


def check_sync_free(sync_free: bool, nonfinite: NonFinite) -> None:
    """Refuse ``nonfinite="raise"`` with ``sync_free=True`` (raising needs a host read)."""
    if not isinstance(sync_free, bool):
        raise TypeError(f"sync_free must be a bool, got {sync_free!r}")
    if sync_free and nonfinite == "raise":
        raise ValueError(
            "sync_free=True decides on the device and cannot raise on a non-finite "
            "gradient: use nonfinite='skip' (the skips are counted in the state and "
            "reported by kfac_func.step.report_skipped)"
        )


def all_finite_tensor(t: torch.Tensor) -> torch.Tensor:
    """Whether every entry of ``t`` is finite, as a 0-d bool tensor (no host read).

    Exact, by the extremes (reductions propagate NaN): two reductions and no temporary of
    ``t``'s size, several times faster than ``isfinite(t).all()``.

    Example:
        >>> all_finite_tensor(torch.tensor([1.0, float("inf")]))
        tensor(False)
    """
    if t.numel() == 0:
        return torch.ones((), dtype=torch.bool, device=t.device)
    lo, hi = torch.aminmax(t)
    return torch.isfinite(lo) & torch.isfinite(hi)


def all_finite_each(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Whether each of ``tensors`` is finite, as one bool vector (no host read): the
    extremes of each (:func:`all_finite_tensor`), checked together in one ``isfinite``.

    Example:
        >>> all_finite_each([torch.ones(2), torch.tensor([float("nan")]), torch.zeros(0)])
        tensor([ True, False,  True])
    """
    device = tensors[0].device
    ends = [
        torch.stack(torch.aminmax(t)).to(device)
        if t.numel()
        else torch.zeros(2, dtype=t.dtype, device=device)
        for t in tensors
    ]
    return torch.isfinite(torch.stack(ends)).all(dim=1)


def all_finite_rows(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``(n, len(tensors))`` bools: whether row ``i`` (``t[i]``) of each stacked tensor is
    finite, by its extremes, checked together in one ``isfinite``.

    Example:
        >>> t = torch.tensor([[1.0, 2.0], [float("inf"), 0.0]])
        >>> all_finite_rows([t, torch.zeros(2, 3)])
        tensor([[ True,  True],
                [False,  True]])
    """
    n = tensors[0].shape[0]
    rows = [t.reshape(n, -1) for t in tensors]  # amin and amax: faster than aminmax here
    ends = [torch.stack([r.amin(1), r.amax(1)], dim=1) for r in rows]
    return torch.isfinite(torch.stack(ends, dim=1)).all(dim=2)


def count_skips(ls: LayerState, finite: torch.Tensor) -> torch.Tensor:
    """The layer's ``grad_skips`` counter, one higher where ``finite`` is False."""
    skipped = (~finite).to(torch.int64)
    return skipped if ls.grad_skips is None else ls.grad_skips + skipped


def keep_where(
    ls: LayerState, change: Mapping[str, object], finite: torch.Tensor
) -> dict[str, object]:
    """``change`` (new running moments of the layer) where ``finite``, else the old values
    (zeros for a moment that did not exist yet, which the moments treat as none)."""
    out: dict[str, object] = {}
    for key, new in change.items():
        old = getattr(ls, key)
        if isinstance(new, torch.Tensor):
            keep = torch.zeros_like(new) if old is None else old.to(new.dtype)
            out[key] = torch.where(finite, new, keep)
        else:  # counters kept on the host (moment_count) count the step either way
            out[key] = new
    return out


def apply_selected(
    grads: Mapping[str, torch.Tensor],
    done: Sequence[tuple[LayerSpec, torch.Tensor, torch.Tensor, torch.Tensor | None]],
    *,
    kl_clip: Hyper | None,
    lr: Hyper,
    step: int,
) -> dict[str, torch.Tensor]:
    """Scale the preconditioned matrices by the kl_clip factor and write back, for each
    layer, the preconditioned or the raw gradient as its flag selects.

    ``done`` holds ``(spec, preconditioned matrix, raw matrix, flag)``: the flag is a 0-d
    bool tensor (True: use the preconditioned matrix), or None where the host knows the
    layer was preconditioned. Layers whose flag is False add 0 to the kl_clip sum, which
    is taken in name order, as the preconditioning stage takes it (the same numbers when
    every flag is True). Nothing in ``done`` is modified. Every other entry of ``grads``
    passes unchanged into the new dict.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from kfac_func.blocks import register
        >>> spec = register(nn.Linear(2, 1, bias=False))[""]
        >>> grads = {"weight": torch.ones(1, 2)}
        >>> done = [(spec, torch.full((1, 2), 3.0), torch.ones(1, 2), torch.tensor(False))]
        >>> apply_selected(grads, done, kl_clip=None, lr=0.1, step=0)["weight"]
        tensor([[1., 1.]])
    """
    clip, rate = clip_and_rate(kl_clip, lr, step)
    scale: torch.Tensor | None = None
    if clip is not None and done:
        by_name = {spec.name: (p, m, flag) for spec, p, m, flag in done}
        names = sorted(by_name)
        terms = []
        for name in names:
            p, m, flag = by_name[name]
            term = kl_clip_term(p, m)
            terms.append(term if flag is None else torch.where(flag, term, torch.zeros_like(term)))
        first = by_name[names[0]][0]
        scale = kl_clip_scale_of_terms(terms, clip, rate, dtype=first.dtype)
    out = dict(grads)
    for spec, p, m, flag in done:
        chosen = p if scale is None else p * scale.to(p.dtype)
        if flag is not None:
            chosen = torch.where(flag, chosen, m.to(p.dtype))
        spec.block.write_grads(spec, out, grads, *matrix_to_grads(spec, chosen))
    return out


def report_layers(layers: MutableMapping[str, LayerState]) -> dict[str, int]:
    """Warn (RuntimeWarning) about every layer whose ``grad_skips`` grew since its last
    report, and record them as reported in ``layers`` (in place); likewise the factor
    updates that ``sync_free`` steps skipped (``factor_skips``, moved to
    ``skipped_updates``). Reads all counters in one host synchronisation; returns
    ``{layer: gradients skipped since the last report}``."""
    counted = [
        (name, ls)
        for name, ls in layers.items()
        if ls.grad_skips is not None or ls.factor_skips is not None
    ]
    if not counted:
        return {}
    device = next(
        t.device for _, ls in counted for t in (ls.grad_skips, ls.factor_skips) if t is not None
    )
    zero = torch.zeros((), dtype=torch.int64, device=device)
    values = torch.stack(
        [
            (zero if t is None else t.to(device))
            for _, ls in counted
            for t in (ls.grad_skips, ls.factor_skips)
        ]
    ).tolist()
    fresh: dict[str, int] = {}
    for i, (name, ls) in enumerate(counted):
        total, factor_skips = int(values[2 * i]), int(values[2 * i + 1])
        if factor_skips > 0:
            assert ls.factor_skips is not None
            ls = ls.replace(
                factor_updates=ls.factor_updates - factor_skips,
                skipped_updates=ls.skipped_updates + factor_skips,
                factor_skips=torch.zeros_like(ls.factor_skips),
            )
            layers[name] = ls
            warnings.warn(
                f"layer {name!r}: non-finite values (NaN/Inf) in the batch factors of "
                f"{factor_skips} factor update(s) since the last report; the layer kept its "
                "factors (sync_free=True)",
                RuntimeWarning,
                stacklevel=3,
            )
        if ls.grad_skips is None:
            continue
        new = total - ls.grad_skips_reported
        if new <= 0:
            continue
        fresh[name] = new
        layers[name] = ls.replace(grad_skips_reported=total)
        warnings.warn(
            f"layer {name!r}: non-finite values (NaN/Inf) in the gradients of "
            f"{list(ls.spec.param_names())} on {new} step(s) since the last report; those "
            "steps passed its gradient unchanged (sync_free=True)",
            RuntimeWarning,
            stacklevel=3,
        )
    return fresh


def leave_sync_free(layers: MutableMapping[str, LayerState]) -> None:
    """Before a step that checks on the host (``sync_free=False``), settle what
    ``sync_free`` steps left on the device (in place, one host synchronisation, only
    when they left anything): the skipped factor updates are reported and counted
    (:func:`report_layers`), and a decomposition that is not ``usable`` is dropped (the
    layer's gradient passes unchanged until its next decomposition, as before its first);
    the device flags are then None."""
    if not any(ls.factor_skips is not None or ls.usable is not None for ls in layers.values()):
        return
    report_layers(layers)
    layers.update(usable_only(layers))
    for name, ls in layers.items():
        if ls.factor_skips is not None:
            layers[name] = ls.replace(factor_skips=None)


def usable_only(layers: Mapping[str, LayerState]) -> dict[str, LayerState]:
    """``layers`` (a new dict) with each ``usable`` flag read on the host (one
    synchronisation, only when there are flags) and dropped: a layer whose decomposition
    is not usable has none (its gradient passes unchanged), as a step that checks on the
    host needs them.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import kfac_func as kf
        >>> state = kf.decompose(kf.init(kf.register(nn.Linear(2, 1)), convention="kfac-pytorch"))
        >>> off = {"": state.layers[""].replace(usable=torch.tensor(False))}
        >>> usable_only(off)[""].decomposition is None
        True
    """
    out = dict(layers)
    flagged = [(name, ls, ls.usable) for name, ls in layers.items() if ls.usable is not None]
    if flagged:
        device = flagged[0][2].device
        usable = torch.stack([u.to(device) for _, _, u in flagged])
        for (name, ls, _), ok in zip(flagged, usable.tolist()):
            out[name] = ls.replace(decomposition=ls.decomposition if ok else None, usable=None)
    return out


def report_skipped(state: KFACState) -> tuple[dict[str, int], KFACState]:
    """Warn about the layers whose gradients ``sync_free=True`` steps skipped since the
    last report, and return ``({layer: steps skipped since then}, new state)``.

    One host synchronisation reads every layer's counters (``LayerState.grad_skips``,
    and ``LayerState.factor_skips``: the factor updates skipped, warned about too and
    moved to ``skipped_updates``). ``sync_free`` steps never call it: call it where a read
    costs nothing (when logging); a step without ``sync_free`` calls it first. The returned
    state records the skips as reported, so that each is warned about once.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import kfac_func as kf
        >>> layers = kf.register(nn.Linear(2, 1))
        >>> state = kf.decompose(kf.init(layers, convention="kfac-pytorch"), damping=1.0)
        >>> bad = {"weight": torch.tensor([[float("nan"), 1.0]]), "bias": torch.ones(1)}
        >>> g, state = kf.update(state, bad, update_factors=False, update_inverses=False,
        ...                      sync_free=True)
        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     counts, state = kf.step.report_skipped(state)
        >>> counts, len(caught)
        ({'': 1}, 1)
    """
    if not isinstance(state, KFACState):
        raise TypeError(f"state must be a KFACState, got {type(state).__name__}")
    layers = dict(state.layers)
    fresh = report_layers(layers)
    return fresh, state.replace(layers=layers)
