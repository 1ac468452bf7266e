"""One layer's preconditioning: the function the preconditioning stage maps over a group.

:func:`precondition_with` preconditions one checked layer's gradient matrix by its
decomposition (:func:`precondition_layer`) or by its eigenbasis moments. It is a function
of tensors with no host decision, so the stage
(:mod:`kfac_func.step.grouped`) runs it over stacks of layers under
:func:`torch.func.vmap`, and on a lone layer as it is.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kfac_func.blocks import Rows
from kfac_func.core.factors import rows_reproduce
from kfac_func.core.preconditioning import precondition, precondition_rows
from kfac_func.state import LayerState
from kfac_func.step.basis import BasisMoments, precondition_in_basis
from kfac_func.step.checks import rows_cheaper
from kfac_func.step.hyper import NonFinite
from kfac_func.step.orthogonal import Orthogonal, precondition_orthogonal

__all__ = ["StageSettings", "precondition_layer", "precondition_with"]


class StageSettings(NamedTuple):
    """The preconditioning stage's settings for one step: the resolved damping, the step,
    what non-finite gradients do (``"skip"``, ``"warn"``, ``"raise"``), whether the step
    is sync-free (judged on the device), and the eigenbasis moments and orthogonalized
    step (None: off). Built once per step (see
    :meth:`kfac_func.step.options.StepOptions.stage_settings`).

    Example:
        >>> StageSettings(0.01, step=3).sync_free
        False
    """

    damping: float
    step: int
    nonfinite: NonFinite = "skip"
    sync_free: bool = False
    basis_moments: BasisMoments | None = None
    orthogonal: Orthogonal | None = None


def precondition_with(
    ls: LayerState,
    m: torch.Tensor,
    settings: StageSettings,
    rows: Rows | None,
    changes: dict[str, dict[str, object]] | None,
) -> torch.Tensor:
    """One checked layer's preconditioned gradient matrix: its orthogonalized step when
    ``settings.orthogonal`` is given and the layer keeps an orthogonal momentum (see
    :mod:`kfac_func.step.orthogonal`), else by its decomposition
    (:func:`precondition_layer`) or by its eigenbasis moments; the changes of its state
    (running moments) go into ``changes[layer]``."""
    orthogonal, basis_moments = settings.orthogonal, settings.basis_moments
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
