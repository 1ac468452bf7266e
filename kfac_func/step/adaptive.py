"""The adaptive step: learning rate and momentum from the quadratic model, adaptive damping.

Instead of a fixed learning rate, the update ``x = α·(−Δ) + μ·δ`` (``Δ`` the preconditioned
gradient of :func:`kfac_func.update`, ``δ`` the previous update) takes the ``(α, μ)`` that
minimise the quadratic model ``M(x) = ½ xᵀ(C + λI)x + ∇hᵀx`` with the exact Gauss–Newton
curvature ``C = JᵀHJ`` of the batch (see :mod:`kfac_func.core.quadratic`). The damping
``λ`` (also K-FAC's damping) is adapted by the Levenberg–Marquardt rule from how much of
the predicted decrease the step achieved. One step of the functional loop::

    state = kf.step.init_adaptive(kf.init(layers, convention="fisher"), damping=1.0)  # once
    loss, grads, caps = kf.capture(model, params, x, loss_fn)
    directions, state = kf.update(state, grads, captures=caps,
                                  damping=state.adaptive.damping, kl_clip=None)
    updates, state, info = kf.step.adaptive_step(state, params, grads, directions,
                                            model=model, args=x, loss="cross_entropy")
    params = {k: p + updates[k] for k, p in params.items()}
    new_loss = loss_fn(torch.func.functional_call(model, params, (x,)))  # same batch
    state = kf.step.adapt_damping(state, new_loss, loss)

The products ``vᵀCw`` are exact (:func:`kfac_func.step.curvature.curvature_gram`). The
model's ``λ`` matches the damping of K-FAC's curvature under the ``"fisher"`` convention
(factors on the loss's own scale). Use ``kl_clip=None`` in ``kf.update``: ``α`` takes the
place of the learning rate.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, NamedTuple

import torch
from torch import nn

from kfac_func.core.output_hessian import OutputLoss, Reduction
from kfac_func.core.quadratic import (
    damped_gram,
    inner,
    lm_damping,
    reduction_ratio,
    solve_quadratic,
)
from kfac_func.state import AdaptiveRecord, AdaptiveState, KFACState
from kfac_func.step.curvature import Tensors, curvature_gram, same_keys
from kfac_func.step.hyper import NonFinite, NonFiniteError

__all__ = [
    "HISTORY",
    "AdaptiveInfo",
    "adapt_damping",
    "adaptive_step",
    "damping_due",
    "init_adaptive",
]

HISTORY = 16
"""How many steps :attr:`AdaptiveState.history` keeps."""


class AdaptiveInfo(NamedTuple):
    """What :func:`adaptive_step` computed: the coefficients, the model's change
    (``predicted``, ≤ 0), how it was solved (see :class:`QuadraticSolution`), the damping
    of the model (λ plus ``l2_reg``) and the model's ``Q`` (k×k) and ``b`` (k), float64."""

    alpha: float
    mu: float
    predicted: float
    method: str
    damping: float
    q: torch.Tensor
    b: torch.Tensor


def _positive(name: str, value: object, *, strict: bool) -> float:
    """``value`` as a float; a ValueError naming ``name`` unless finite and > 0 (``strict``)
    or >= 0."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    v = float(value) if number else math.nan  # type: ignore[arg-type]
    if not math.isfinite(v) or v < 0 or (strict and v == 0):
        raise ValueError(
            f"{name} must be a finite number {'>' if strict else '>='} 0, got {value!r}"
        )
    return v


def _scalar(name: str, value: float | torch.Tensor) -> float:
    """A loss value as a float (a one-element tensor is read from its device)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be a scalar, got a tensor of shape {tuple(value.shape)}")
        return float(value.detach())
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number or a one-element tensor, got {value!r}")
    return float(value)


def _adaptive(state: KFACState) -> AdaptiveState:
    if state.adaptive is None:
        raise ValueError("state has no adaptive part: start from kf.step.init_adaptive(state, ...)")
    return state.adaptive


def init_adaptive(state: KFACState, *, damping: float) -> KFACState:
    """``state`` with a fresh adaptive part starting at ``damping`` (> 0).

    Example:
        >>> import kfac_func as kf
        >>> from torch import nn
        >>> state = kf.step.init_adaptive(kf.init(kf.register(nn.Linear(2, 2))), damping=1.0)
        >>> state.adaptive.damping, state.adaptive.previous
        (1.0, None)
    """
    return state.replace(adaptive=AdaptiveState(_positive("damping", damping, strict=True)))


def damping_due(state: KFACState, *, interval: int = 5) -> bool:
    """Whether :func:`adapt_damping` adapts the damping after the latest
    :func:`adaptive_step` (every ``interval`` steps), so that it needs the new loss.

    Example:
        >>> import kfac_func as kf
        >>> from torch import nn
        >>> state = kf.step.init_adaptive(kf.init(kf.register(nn.Linear(2, 2))), damping=1.0)
        >>> kf.step.damping_due(state.replace(adaptive=state.adaptive.replace(steps=5)))
        True
    """
    _check_interval(interval)
    steps = _adaptive(state).steps
    return steps > 0 and steps % interval == 0


def _check_interval(interval: object) -> int:
    if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
        raise ValueError(f"interval must be an integer >= 1, got {interval!r}")
    return interval


def adaptive_step(
    state: KFACState,
    params: Tensors,
    grads: Tensors,
    directions: Tensors,
    *,
    model: nn.Module,
    args: Any,
    loss: OutputLoss = "cross_entropy",
    loss_reduction: Reduction = "mean",
    kwargs: dict[str, Any] | None = None,
    buffers: Tensors | None = None,
    l2_reg: float = 0.0,
    momentum: bool = True,
    rtol: float = 1e-6,
    nonfinite: NonFinite = "skip",
) -> tuple[dict[str, torch.Tensor], KFACState, AdaptiveInfo]:
    """The update ``x = α·(−Δ) + μ·δ`` minimising the quadratic model, to be *added* to the
    parameters (``θ ← θ + x``), with the new state and what was computed.

    Args:
        state: a state with an adaptive part (:func:`init_adaptive`).
        params: the parameters ``θ`` the gradients were taken at.
        grads: ``∇h`` at ``params`` (including any L2 term of the objective).
        directions: ``Δ``, the preconditioned gradients of :func:`kfac_func.update`.
        model, args, kwargs, buffers, loss, loss_reduction: the batch's forward and loss
            (see :func:`curvature_gram`); use the batch of ``grads``.
        l2_reg: added to the damping in the model (an L2 term of the objective).
        momentum: use the previous update ``δ`` (``state.adaptive.previous``); without it,
            or on the first step, only ``α`` is solved for.
        rtol: when ``Q`` counts as singular (see :func:`solve_quadratic`).
        nonfinite: NaN/Inf in the model: ``"skip"`` (warn, zero update) or ``"raise"``
            (:class:`NonFiniteError`).

    ``params``, ``grads``, ``directions`` and the previous update must have the same keys
    and shapes. The returned state keeps ``x`` as the next step's ``δ``; its damping
    changes only in :func:`adapt_damping`.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import kfac_func as kf
        >>> model = nn.Linear(3, 2)
        >>> x, t = torch.randn(8, 3), torch.randint(0, 2, (8,))
        >>> loss_fn = lambda out: nn.functional.cross_entropy(out, t)
        >>> state = kf.step.init_adaptive(kf.init(kf.register(model)), damping=1.0)
        >>> params = dict(model.named_parameters())
        >>> loss, grads, caps = kf.capture(model, params, x, loss_fn)
        >>> directions, state = kf.update(state, grads, captures=caps,
        ...                               damping=state.adaptive.damping, kl_clip=None)
        >>> updates, state, info = kf.step.adaptive_step(state, params, grads, directions,
        ...                                         model=model, args=x)
        >>> info.method, info.predicted < 0, state.adaptive.steps  # no δ yet: α only
        ('alpha', True, 1)
    """
    ad = _adaptive(state)
    if nonfinite not in ("skip", "raise"):
        raise ValueError(f"nonfinite must be 'skip' or 'raise', got {nonfinite!r}")
    reg = _positive("l2_reg", l2_reg, strict=False)
    names = list(params)
    same_keys("directions", directions, params)
    same_keys("grads", grads, params)
    prev = ad.previous if momentum else None
    if prev is not None:
        same_keys("the previous update (state.adaptive.previous)", prev, params)
    v1 = {k: -directions[k].detach() for k in names}
    vectors: list[Tensors] = [v1] if prev is None else [v1, prev]
    curvature = curvature_gram(
        model,
        params,
        args,
        vectors,
        loss=loss,
        loss_reduction=loss_reduction,
        kwargs=kwargs,
        buffers=buffers,
    )
    pieces = [[v[k] for k in names] for v in vectors]
    k = len(vectors)
    plain = torch.stack([inner(pieces[i], pieces[j]) for i in range(k) for j in range(k)])
    lam = ad.damping + reg
    q = damped_gram(curvature, plain.reshape(k, k).to(curvature.device), lam)
    g = [grads[n].detach() for n in names]
    b = torch.stack([inner(g, p) for p in pieces]).to(q.device)
    host = torch.cat([q.flatten(), b]).tolist()  # the one read of the step
    rows = [host[i * k : (i + 1) * k] for i in range(k)]
    sol = solve_quadratic(rows, host[k * k :], rtol=rtol)
    if sol.method == "nonfinite":
        msg = "non-finite values (NaN/Inf) in the quadratic model of the adaptive step"
        if nonfinite == "raise":
            raise NonFiniteError(msg)
        warnings.warn(f"{msg}; zero update for this step", RuntimeWarning, stacklevel=2)
    updates = {}
    for n in names:
        x = sol.alpha * v1[n] if sol.alpha != 0.0 else torch.zeros_like(v1[n])  # NaN-safe
        if prev is not None and sol.mu != 0.0:
            x = x + sol.mu * prev[n].to(x.dtype)
        updates[n] = x
    new = ad.replace(
        previous=updates,
        steps=ad.steps + 1,
        alpha=sol.alpha,
        mu=sol.mu,
        predicted=sol.predicted,
    )
    info = AdaptiveInfo(sol.alpha, sol.mu, sol.predicted, sol.method, lam, q, b)
    return updates, state.replace(adaptive=new), info


def adapt_damping(
    state: KFACState,
    new_loss: float | torch.Tensor | None,
    old_loss: float | torch.Tensor | None,
    *,
    interval: int = 5,
    damping_decay: float = 0.95,
    min_damping: float = 1e-8,
    max_damping: float = math.inf,
) -> KFACState:
    """Levenberg–Marquardt: after the latest :func:`adaptive_step`, ``ρ = (h(θ + x) − h(θ))
    / predicted``, and every ``interval`` steps ``λ ← ω·λ`` if ``ρ > 3/4``, ``λ ← λ/ω`` if
    ``ρ < 1/4``, with ``ω = damping_decay ** interval``, clamped to
    ``[min_damping, max_damping]``.

    ``new_loss`` is the loss at the updated parameters and ``old_loss`` the loss before the
    step, on the same batch. ``new_loss`` may be None at steps where no adaptation is due
    (:func:`damping_due`). ρ is None when no decrease was predicted and ``−∞`` when the new
    loss is not finite. The step's record is appended to the history (the latest
    :data:`HISTORY` are kept).

    Example:
        >>> import kfac_func as kf
        >>> from torch import nn
        >>> state = kf.step.init_adaptive(kf.init(kf.register(nn.Linear(2, 2))), damping=1.0)
        >>> # as adaptive_step leaves it: one step taken, a decrease of 1.0 predicted
        >>> ad = state.adaptive.replace(steps=1, alpha=1.0, mu=0.0, predicted=-1.0)
        >>> new = kf.step.adapt_damping(state.replace(adaptive=ad), 0.1, 1.0, interval=1)
        >>> new.adaptive.rho, new.adaptive.damping  # ρ = 0.9 > 3/4: λ ← 0.95·λ
        (0.9, 0.95)
    """
    ad = _adaptive(state)
    _check_interval(interval)
    decay = _positive("damping_decay", damping_decay, strict=True)
    if decay > 1:
        raise ValueError(f"damping_decay must be in (0, 1], got {damping_decay!r}")
    lo = _positive("min_damping", min_damping, strict=False)
    hi = (
        max_damping
        if max_damping == math.inf
        else _positive("max_damping", max_damping, strict=False)
    )
    if lo > hi:
        raise ValueError(f"min_damping {min_damping!r} is larger than max_damping {max_damping!r}")
    if ad.steps == 0 or ad.predicted is None:
        raise ValueError("adapt_damping follows adaptive_step: no step was taken yet")
    if ad.history and ad.history[-1].steps == ad.steps:
        raise ValueError(f"adapt_damping was already called after adaptive step {ad.steps}")
    due = ad.steps % interval == 0
    rho = None
    if new_loss is not None:
        if old_loss is None:
            raise ValueError("old_loss is needed with new_loss (the loss before the step)")
        change = _scalar("new_loss", new_loss) - _scalar("old_loss", old_loss)
        rho = reduction_ratio(change, ad.predicted)
    elif due:
        raise ValueError(
            f"new_loss is needed after adaptive step {ad.steps} (every interval={interval})"
        )
    lam = ad.damping
    if due:
        lam = lm_damping(lam, rho, omega=decay**interval, min_damping=lo, max_damping=hi)
    record = AdaptiveRecord(ad.steps, lam, ad.alpha or 0.0, ad.mu or 0.0, ad.predicted, rho)
    new = ad.replace(damping=lam, rho=rho, history=(*ad.history, record)[-HISTORY:])
    return state.replace(adaptive=new)
