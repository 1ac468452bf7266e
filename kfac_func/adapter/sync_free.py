"""The adapter's step without host synchronisation, and its compiled form.

``KFACPreconditioner(model, sync_free=True)`` passes ``sync_free=True`` to
:func:`kfac_func.update` (and :func:`kfac_func.update_distributed`): steps that only
precondition read nothing on the host (see :mod:`kfac_func.step.sync_free`); layers
whose gradients held a NaN or Inf are counted and warned about at the next factor update
or by :meth:`SyncFreeMixin.report_skipped`. ``compile=True`` (with ``sync_free=True``, on
one process) runs those steps through ``torch.compile(kfac_func.update, fullgraph=True)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kfac_func.state import KFACState
from kfac_func.step.hyper import check_step_hyper
from kfac_func.step.sync_free import report_skipped
from kfac_func.step.update import update

__all__ = ["SyncFreeMixin"]


class SyncFreeMixin:
    """``sync_free`` and ``compile`` for a preconditioner that keeps its state in
    ``_state``.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import kfac_func as kf
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        >>> pre = kf.KFACPreconditioner(model, sync_free=True)
        >>> model(torch.randn(16, 4)).pow(2).mean().backward()
        >>> pre.step()
        >>> pre.report_skipped()
        {}
    """

    _state: KFACState
    sync_free: bool
    """Whether steps decide on the device (no host synchronisation when only preconditioning)."""
    compile: bool
    """Whether steps that only precondition run compiled (``torch.compile``, fullgraph)."""
    grouped: bool
    """Whether a step on one process computes the layers of one shape together."""

    def _set_sync_free(self, sync_free: bool, compile: bool, grouped: bool = True) -> None:
        for name, value in (("sync_free", sync_free), ("compile", compile), ("grouped", grouped)):
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool, got {value!r}")
        if compile and not sync_free:
            raise ValueError(
                "compile=True compiles the steps that only precondition as one graph, which "
                "needs the checks on the device: pass sync_free=True as well"
            )
        self.sync_free = sync_free
        self.compile = compile
        self.grouped = grouped
        self._compiled: Callable[..., Any] | None = None

    def _stepper(self, precondition_only: bool) -> Callable[..., Any]:
        """:func:`kfac_func.update`, compiled for steps that only precondition when
        ``compile=True`` (compiled at the first such step)."""
        if not (self.compile and precondition_only):
            return update
        if self._compiled is None:
            self._compiled = torch.compile(update, fullgraph=True)
        compiled = self._compiled

        def step(state: KFACState, grads: Any, **kwargs: Any) -> Any:
            # schedules resolved and values checked eagerly: a value that changes between
            # calls is symbolic in the compiled step, which checks nothing then
            return compiled(state, grads, **check_step_hyper(int(state.step), kwargs))

        return step

    def report_skipped(self) -> dict[str, int]:
        """Warn about the layers whose gradients were skipped (non-finite) since the last
        report and return ``{layer: steps skipped since then}`` (one host
        synchronisation; see :func:`kfac_func.report_skipped`). Steps that update the
        factors report by themselves."""
        counts, self._state = report_skipped(self._state)
        return counts
