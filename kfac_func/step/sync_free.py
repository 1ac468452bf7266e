"""The pieces of a step without host synchronisation (``sync_free=True``).

By default a step reads every layer's checks on the host (one synchronisation, see
:func:`kfac_func.step.checks.check_layers`) and branches in Python: a layer whose gradient
holds a NaN or Inf is left out and a warning names it. On a GPU that read waits for every
queued kernel. With ``sync_free=True`` the decision stays on the device:

- each layer's finiteness is a 0-d bool tensor (:func:`layer_finite`);
- the layer is preconditioned whatever it holds, and ``torch.where`` selects the
  preconditioned or the raw gradient (:func:`apply_selected`); a skipped layer's term of
  the kl_clip sum is zero, its running moments keep their old values (:func:`keep_where`);
- the skips are counted in the state (``LayerState.grad_skips``, a 0-d int64 tensor,
  :func:`count_skips`) and warned about later: at the next step that updates the factors
  (which reads the device anyway), or when :func:`report_skipped` is called.

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
from kfac_func.step.checks import layer_grads
from kfac_func.step.hyper import Hyper, NonFinite, clip_and_rate

__all__ = [
    "all_finite_each",
    "all_finite_tensor",
    "apply_selected",
    "check_sync_free",
    "count_skips",
    "keep_where",
    "layer_finite",
    "report_layers",
    "report_skipped",
]


def check_sync_free(sync_free: bool, nonfinite: NonFinite) -> None:
    """Refuse ``nonfinite="raise"`` with ``sync_free=True`` (raising needs a host read)."""
    if not isinstance(sync_free, bool):
        raise TypeError(f"sync_free must be a bool, got {sync_free!r}")
    if sync_free and nonfinite == "raise":
        raise ValueError(
            "sync_free=True decides on the device and cannot raise on a non-finite "
            "gradient: use nonfinite='skip' (the skips are counted in the state and "
            "reported by kfac_func.report_skipped and at the next factor update)"
        )


def layer_finite(spec: LayerSpec, grads: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Whether every entry of the layer's gradients is finite, as a 0-d bool tensor on the
    gradients' device (no host synchronisation).

    Example:
        >>> from torch import nn
        >>> from kfac_func.blocks import register
        >>> spec = register(nn.Linear(2, 1))[""]
        >>> g = {"weight": torch.tensor([[1.0, float("nan")]]), "bias": torch.zeros(1)}
        >>> layer_finite(spec, g)
        tensor(False)
    """
    w, b = layer_grads(spec, grads)
    finite = all_finite_tensor(w)
    return finite if b is None else finite & all_finite_tensor(b)


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
    done: Sequence[tuple[LayerSpec, torch.Tensor, torch.Tensor, torch.Tensor]],
    *,
    kl_clip: Hyper | None,
    lr: Hyper,
    step: int,
) -> dict[str, torch.Tensor]:
    """Scale the preconditioned matrices by the kl_clip factor and write back, for each
    layer, the preconditioned or the raw gradient as its flag selects.

    ``done`` holds ``(spec, preconditioned matrix, raw matrix, flag)``: the flag is a 0-d
    bool tensor (True: use the preconditioned matrix). Layers whose flag is False add 0 to
    the kl_clip sum, which is taken in name order as
    :func:`kfac_func.step.precondition.write_preconditioned` takes it (the same numbers
    when every flag is True). Nothing in ``done`` is modified. Every other entry of
    ``grads`` passes unchanged into the new dict.
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
            terms.append(torch.where(flag, term, torch.zeros_like(term)))
        first = by_name[names[0]][0]
        scale = kl_clip_scale_of_terms(terms, clip, rate, dtype=first.dtype)
    out = dict(grads)
    for spec, p, m, flag in done:
        scaled = p if scale is None else p * scale.to(p.dtype)
        chosen = torch.where(flag, scaled, m.to(p.dtype))
        spec.block.write_grads(spec, out, grads, *matrix_to_grads(spec, chosen))
    return out


def report_layers(layers: MutableMapping[str, LayerState]) -> dict[str, int]:
    """Warn (RuntimeWarning) about every layer whose ``grad_skips`` grew since its last
    report, and record them as reported in ``layers`` (in place). Reads all counters in
    one host synchronisation; returns ``{layer: steps skipped since the last report}``."""
    counted = [(name, ls) for name, ls in layers.items() if ls.grad_skips is not None]
    if not counted:
        return {}
    first = counted[0][1].grad_skips
    assert first is not None
    values = torch.stack(
        [ls.grad_skips.to(first.device) for _, ls in counted if ls.grad_skips is not None]
    ).tolist()
    fresh: dict[str, int] = {}
    for (name, ls), total in zip(counted, values):
        new = int(total) - ls.grad_skips_reported
        if new <= 0:
            continue
        fresh[name] = new
        layers[name] = ls.replace(grad_skips_reported=int(total))
        warnings.warn(
            f"layer {name!r}: non-finite values (NaN/Inf) in the gradients of "
            f"{list(ls.spec.param_names())} on {new} step(s) since the last report; those "
            "steps passed its gradient unchanged (sync_free=True)",
            RuntimeWarning,
            stacklevel=3,
        )
    return fresh


def report_skipped(state: KFACState) -> tuple[dict[str, int], KFACState]:
    """Warn about the layers whose gradients ``sync_free=True`` steps skipped since the
    last report, and return ``({layer: steps skipped since then}, new state)``.

    One host synchronisation reads every layer's counter (``LayerState.grad_skips``).
    :func:`kfac_func.update` calls it by itself at every step that updates the factors;
    call it between those to hear of skips sooner (the returned state records them as
    reported, so that each skip is warned about once).

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
        ...     counts, state = kf.report_skipped(state)
        >>> counts, len(caught)
        ({'': 1}, 1)
    """
    if not isinstance(state, KFACState):
        raise TypeError(f"state must be a KFACState, got {type(state).__name__}")
    layers = dict(state.layers)
    fresh = report_layers(layers)
    return fresh, state.replace(layers=layers)
