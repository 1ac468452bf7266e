"""The adaptive step on a module's own parameters, for the stateful preconditioners.

:class:`AdaptiveStepper` holds the settings of :func:`kfac_func.step.adaptive_step` and
:func:`kfac_func.step.adapt_damping`; its :meth:`~AdaptiveStepper.step` computes the update from
the raw and the preconditioned gradients, adds it to the parameters in place, evaluates
the caller's loss closure once when the damping is due for adaptation, and returns the
new state. It owns no math: everything is in :mod:`kfac_func.step.adaptive`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from kfac_func.adapter.compiled import uncompiled
from kfac_func.core.output_hessian import OutputLoss, Reduction
from kfac_func.distributed.dtensor import is_dtensor
from kfac_func.state import KFACState
from kfac_func.step.adaptive import AdaptiveInfo, adapt_damping, adaptive_step, damping_due
from kfac_func.step.hyper import NonFinite

__all__ = ["AdaptiveStepper", "check_adaptive"]


class AdaptiveStepper:
    """Adaptive steps (learning rate, momentum, damping) applied to ``model`` in place.

    Args:
        model: the module whose parameters are updated.
        loss, loss_reduction: the loss as a function of the model's output (see
            :func:`kfac_func.step.curvature_gram`).
        l2_reg, momentum, rtol, nonfinite: as in :func:`kfac_func.step.adaptive_step`.
        interval, damping_decay, min_damping, max_damping: as in
            :func:`kfac_func.step.adapt_damping`.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import kfac_func as kf
        >>> from kfac_func.adapter.adaptive import AdaptiveStepper
        >>> torch.manual_seed(0) and None
        >>> model = nn.Linear(3, 2)
        >>> x, t = torch.randn(8, 3), torch.randn(8, 2)
        >>> loss_fn = lambda out: nn.functional.mse_loss(out, t)
        >>> state = kf.step.init_adaptive(kf.init(kf.register(model)), damping=1.0)
        >>> stepper = AdaptiveStepper(model, loss="mse", interval=1)
        >>> params = dict(model.named_parameters())
        >>> loss, grads, caps = kf.capture(model, params, x, loss_fn)
        >>> directions, state = kf.update(state, grads, captures=caps,
        ...                               damping=state.adaptive.damping, kl_clip=None)
        >>> state, info = stepper.step(state, grads, directions, args=x,
        ...                            loss_closure=lambda: loss_fn(model(x)), old_loss=loss)
        >>> bool(loss_fn(model(x)) < loss), info.method
        (True, 'alpha')
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        loss: OutputLoss = "cross_entropy",
        loss_reduction: Reduction = "mean",
        l2_reg: float = 0.0,
        momentum: bool = True,
        rtol: float = 1e-6,
        nonfinite: NonFinite = "skip",
        interval: int = 5,
        damping_decay: float = 0.95,
        min_damping: float = 1e-8,
        max_damping: float = math.inf,
    ) -> None:
        self.model = model
        self.loss = loss
        self.loss_reduction = loss_reduction
        self.l2_reg = l2_reg
        self.momentum = momentum
        self.rtol = rtol
        self.nonfinite = nonfinite
        self.interval = interval
        self.damping_decay = damping_decay
        self.min_damping = min_damping
        self.max_damping = max_damping

    def step(
        self,
        state: KFACState,
        grads: Mapping[str, torch.Tensor],
        directions: Mapping[str, torch.Tensor],
        *,
        args: Any,
        loss_closure: Callable[[], float | torch.Tensor],
        old_loss: float | torch.Tensor,
        kwargs: dict[str, Any] | None = None,
    ) -> tuple[KFACState, AdaptiveInfo]:
        """One adaptive step: update the parameters named in ``directions`` in place.

        Args:
            state: a state with an adaptive part (:func:`kfac_func.step.init_adaptive`).
            grads: the raw gradients ``∇h`` of this batch, by parameter name.
            directions: the preconditioned gradients of :func:`kfac_func.update`.
            args, kwargs: the model's input for this batch.
            loss_closure: the loss of this batch at the model's current parameters; called
                (without gradients) after the update, only when the damping is due.
            old_loss: the loss of this batch before the update.

        Returns:
            ``(new_state, info)``.
        """
        params = {n: p for n, p in self.model.named_parameters() if n in directions}
        updates, state, info = adaptive_step(
            state,
            params,
            grads,
            directions,
            model=self.model,
            args=args,
            kwargs=kwargs,
            loss=self.loss,
            loss_reduction=self.loss_reduction,
            l2_reg=self.l2_reg,
            momentum=self.momentum,
            rtol=self.rtol,
            nonfinite=self.nonfinite,
        )
        with torch.no_grad():
            for name, p in params.items():
                p.add_(updates[name].to(p.dtype))
        new_loss = None
        if damping_due(state, interval=self.interval):
            with torch.no_grad():
                new_loss = loss_closure()
        state = adapt_damping(
            state,
            new_loss,
            old_loss,
            interval=self.interval,
            damping_decay=self.damping_decay,
            min_damping=self.min_damping,
            max_damping=self.max_damping,
        )
        return state, info


def check_adaptive(
    adaptive: AdaptiveStepper | None, model: nn.Module, kl_clip: object, world_size: int
) -> None:
    """Raise a ValueError unless ``adaptive`` (when given) can step ``model``: a stepper of
    the same model, ``kl_clip=None``, one process, plain (not DTensor) parameters.

    Example:
        >>> from torch import nn
        >>> check_adaptive(None, nn.Linear(2, 2), 0.001, 1)  # nothing to check
    """
    if adaptive is None:
        return
    if uncompiled(adaptive.model) is not model:
        raise ValueError("adaptive= must be an AdaptiveStepper of the same model")
    if kl_clip is not None:
        raise ValueError(
            "adaptive steps choose their own length (the quadratic model's learning "
            "rate): pass kl_clip=None"
        )
    if world_size > 1:
        raise ValueError(
            f"adaptive= runs on one process; this process group has {world_size} ranks"
        )
    if any(is_dtensor(p) for p in model.parameters()):
        raise ValueError(
            "adaptive= needs plain parameters (its curvature products run the model "
            "under torch.func); this model has DTensor parameters (FSDP2 or tensor "
            "parallelism)"
        )
