"""`LambdaParamScheduler`: multiplicative schedules of a preconditioner's hyperparameters."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

__all__ = ["LambdaParamScheduler"]

_INTS = ("factor_update_steps", "inv_update_steps")


class LambdaParamScheduler:
    """Multiply hyperparameters by ``lambda(step)`` each time :meth:`step` is called.

    Like ``torch.optim.lr_scheduler.MultiplicativeLR``, for the preconditioner's
    ``factor_update_steps``, ``inv_update_steps`` (kept integers, at least 1), ``damping``,
    ``factor_decay``, ``kl_clip`` and ``lr``. A hyperparameter that is already a callable
    cannot also be scheduled (ValueError). An update interval that a lambda would take
    below 1 (e.g. a lambda yielding 0) is kept at 1, with a warning naming it the first
    time this happens to it.

    Example:
        >>> from torch import nn
        >>> from kfac_func import KFACPreconditioner
        >>> pre = KFACPreconditioner(nn.Linear(2, 2), damping=0.1)
        >>> scheduler = LambdaParamScheduler(pre, damping_lambda=lambda step: 0.5)
        >>> scheduler.step()
        >>> pre.damping
        0.05
    """

    def __init__(
        self,
        preconditioner: Any,
        *,
        factor_update_steps_lambda: Callable[[int], float] | None = None,
        inv_update_steps_lambda: Callable[[int], float] | None = None,
        damping_lambda: Callable[[int], float] | None = None,
        factor_decay_lambda: Callable[[int], float] | None = None,
        kl_clip_lambda: Callable[[int], float] | None = None,
        lr_lambda: Callable[[int], float] | None = None,
    ) -> None:
        given = {
            "factor_update_steps": factor_update_steps_lambda,
            "inv_update_steps": inv_update_steps_lambda,
            "damping": damping_lambda,
            "factor_decay": factor_decay_lambda,
            "kl_clip": kl_clip_lambda,
            "lr": lr_lambda,
        }
        self._lambdas = {k: f for k, f in given.items() if f is not None}
        for name in self._lambdas:
            current = getattr(preconditioner, name)
            if callable(current):
                raise ValueError(
                    f"preconditioner.{name} is already a callable; it cannot also be "
                    "scheduled by LambdaParamScheduler"
                )
            if current is None:
                raise ValueError(f"preconditioner.{name} is None; there is nothing to scale")
        self._preconditioner = preconditioner
        self._clamped: set[str] = set()

    def step(self, step: int | None = None) -> None:
        """Apply every lambda at ``step`` (default: the preconditioner's step count)."""
        pre = self._preconditioner
        k = pre.steps if step is None else step
        for name, fn in self._lambdas.items():
            value = getattr(pre, name) * fn(k)
            if name in _INTS:
                if int(value) < 1 and name not in self._clamped:
                    self._clamped.add(name)
                    warnings.warn(
                        f"LambdaParamScheduler: {name}_lambda took {name} to {value!r} at "
                        f"step {k}; {name} is kept at 1",
                        UserWarning,
                        stacklevel=2,
                    )
                value = max(1, int(value))
            setattr(pre, name, value)
