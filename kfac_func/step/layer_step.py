"""One layer's preconditioning: the function the preconditioning stage maps over a group.

:func:`precondition_with` preconditions one checked layer's gradient matrix by its
decomposition (:func:`precondition_layer`) or by its eigenbasis moments, then grafts it
(:class:`Grafting`). It is a function of tensors with no host decision, so the stage
(:mod:`kfac_func.step.grouped`) runs it over stacks of layers under
:func:`torch.func.vmap`, and on a lone layer as it is.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kfac_func.blocks import Rows
from kfac_func.core.factors import rows_reproduce
from kfac_func.core.grafting import GRAFTING, graft_moment, graft_scale
from kfac_func.core.preconditioning import precondition, precondition_rows
from kfac_func.state import LayerState
from kfac_func.step.basis import BasisMoments, precondition_in_basis
from kfac_func.step.checks import rows_cheaper
from kfac_func.step.hyper import NonFinite, check_hyper
from kfac_func.step.orthogonal import Orthogonal, precondition_orthogonal

__all__ = ["Grafting", "StageSettings", "graft", "precondition_layer", "precondition_with"]


class Grafting(NamedTuple):
    """Grafting settings (see :mod:`kfac_func.core.grafting`): ``mode`` ``"sgd"`` or
    ``"adam"``, and Adam's ``beta2`` and ``eps``."""

    mode: str
    beta2: float = 0.999
    eps: float = 1e-8

    def check(self) -> Grafting:
        """This, validated (a ValueError names the bad setting)."""
        if self.mode not in GRAFTING:
            raise ValueError(f"grafting must be one of {GRAFTING} or None, got {self.mode!r}")
        check_hyper("graft_beta2", self.beta2, lambda v: 0 <= v < 1, "in [0, 1)")
        check_hyper("graft_eps", self.eps, lambda v: v >= 0, ">= 0")
        return self


def graft(
    ls: LayerState,
    p: torch.Tensor,
    m: torch.Tensor,
    grafting: Grafting,
    step: int,
    changes: dict[str, dict[str, object]] | None,
) -> None:
    """Rescale ``p`` (the caller's own temporary, in place) to the grafted step's norm;
    Adam's new running moment of the layer goes into ``changes[layer]``."""
    moment = None
    if grafting.mode == "adam":
        dtype = ls.a_factor.dtype
        moment = graft_moment(ls.graft_moment, m.to(dtype), grafting.beta2)
        if changes is not None:
            changes.setdefault(ls.spec.name, {})["graft_moment"] = moment
    scale = graft_scale(
        p, m, grafting.mode, moment=moment, step=step + 1, beta2=grafting.beta2, eps=grafting.eps
    )
    p.mul_(scale.to(p.dtype))


class StageSettings(NamedTuple):
    """The preconditioning stage's settings for one step: the resolved damping, the step,
    what non-finite gradients do (``"skip"``, ``"warn"``, ``"raise"``), whether the step
    is sync-free (judged on the device), and the Adam grafting, eigenbasis moments and
    orthogonalized step (None: off). Built once per step (see
    :meth:`kfac_func.step.options.StepOptions.stage_settings`).

    Example:
        >>> StageSettings(0.01, step=3).sync_free
        False
    """

    damping: float
    step: int
    nonfinite: NonFinite = "skip"
    sync_free: bool = False
    grafting: Grafting | None = None
    basis_moments: BasisMoments | None = None
    orthogonal: Orthogonal | None = None


def precondition_with(
    ls: LayerState,
    m: torch.Tensor,
    settings: StageSettings,
    rows: Rows | None,
    changes: dict[str, dict[str, object]] | None,
    step: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """One checked layer's preconditioned gradient matrix: its orthogonalized step when
    ``settings.orthogonal`` is given and the layer keeps an orthogonal momentum (see
    :mod:`kfac_func.step.orthogonal`; not grafted), else by its decomposition
    (:func:`precondition_layer`) or by its eigenbasis moments, then grafted; the changes
    of its state (running moments) go into ``changes[layer]``. ``step`` replaces
    ``settings.step`` (a tensor in a compiled step)."""
    orthogonal, grafting = settings.orthogonal, settings.grafting
    basis_moments = settings.basis_moments
    if orthogonal is not None and ls.ortho_momentum is not None:
        p, new = precondition_orthogonal(ls, m, orthogonal)
        if changes is not None:
            changes.setdefault(ls.spec.name, {}).update(new)
        return p
    if basis_moments is not None:
        p, new = precondition_in_basis(ls, m, basis_moments)
        if changes is not None:
            changes.setdefault(ls.spec.name, {}).update(new)
    else:
        p = precondition_layer(ls, m, settings.damping, rows, checked=True)
    if grafting is not None:
        graft(ls, p, m, grafting, settings.step if step is None else step, changes)  # type: ignore[arg-type]
    return p


def precondition_layer(
    ls: LayerState,
    m: torch.Tensor,
    damping: float,
    rows: Rows | None = None,
    *,
    checked: bool = False,
) -> torch.Tensor:
    """Precondition one layer's gradient matrix with its decomposition.

    With the rows of a Linear layer's calls, when the gradient is exactly their product
    (:func:`kfac_func.core.factors.rows_reproduce`) and that is cheaper
    (``n(d_out² + d_in² + d_out·d_in) < d_out·d_in(d_out + d_in)`` for ``n`` rows), the
    products with the gradient become products with the rows
    (:func:`kfac_func.core.decomposition.precondition_rows`); the result is the same up to
    rounding.
    """
    dec = ls.decomposition
    assert dec is not None
    spec = ls.spec
    if rows and rows_cheaper(spec, rows) and (checked or rows_reproduce(spec, m, rows)):
        return precondition_rows(rows, dec, damping, bias=spec.has_bias, dtype=m.dtype)
    return precondition(m, dec, damping)
