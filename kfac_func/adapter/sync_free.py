"""The adapter's step without host synchronisation, and its compiled form.

``KFACPreconditioner(model, settings=Settings(sync_free=True))`` passes ``sync_free=True`` to
:func:`kfac_func.update` (and :func:`kfac_func.distributed.update_distributed`): on one process no
step reads anything on the host, whether it updates the factors, decomposes them or only
preconditions (see :mod:`kfac_func.step.sync_free` and
:mod:`kfac_func.step.decompose_groups`); layers whose gradients or batch factors held a
NaN or Inf are counted on the device and warned about by
:meth:`SyncFreeMixin.report_skipped`. ``compile=True`` (with ``sync_free=True``, on one
process) runs every step through ``torch.compile(kfac_func.update, fullgraph=True)``: one
graph per step kind, eigh inside it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kfac_func.state import KFACState
from kfac_func.step.decompose_groups import solver_failed
from kfac_func.step.options import StepOptions
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
        >>> pre = kf.KFACPreconditioner(model, settings=kf.Settings(sync_free=True))
        >>> model(torch.randn(16, 4)).pow(2).mean().backward()
        >>> pre.step()
        >>> pre.report_skipped()
        {}
    """

    _state: KFACState
    sync_free: bool
    """Whether steps decide on the device (no host synchronisation when only preconditioning)."""
    compile: bool
    """Whether steps run compiled (``torch.compile``, fullgraph; one graph per step kind)."""
    grouped: bool | None
    """Whether a step on one process computes the layers of one shape together (None: on
    accelerators)."""
    _compiled: Callable[..., Any] | None = None

    def _stepper(self) -> Callable[..., Any]:
        """:func:`kfac_func.update`, compiled when ``compile=True`` (at the first step; a
        graph for each step kind). Should a compiled step's solver fail (LAPACK or
        cuSOLVER not converging: an error raised before the state changed), that step
        runs eagerly, where the decompositions are retried in float64 with jitter."""
        if not self.compile:
            return update
        if self._compiled is None:
            self._compiled = torch.compile(update, fullgraph=True)
        compiled = self._compiled

        def step(state: KFACState, grads: Any, *, options: StepOptions, **kwargs: Any) -> Any:
            # schedules resolved and values checked eagerly, and handed over as keywords:
            # a number that changes between calls is symbolic in the compiled step, which
            # checks nothing then
            settings = options.at(int(state.step)).settings()
            try:
                return compiled(state, grads, **kwargs, **settings)
            except RuntimeError as err:
                if not solver_failed(err):
                    raise
                return update(state, grads, **kwargs, **settings)

        return step

    def report_skipped(self) -> dict[str, int]:
        """Warn about the layers whose gradients were skipped (non-finite) since the last
        report and return ``{layer: steps skipped since then}`` (one host
        synchronisation; see :func:`kfac_func.step.report_skipped`). Steps that update the
        factors report by themselves."""
        counts, self._state = report_skipped(self._state)
        return counts
