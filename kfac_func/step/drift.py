"""How far an eigenbasis has drifted from its factor, and which layers' bases to refresh.

Adam's step in K-FAC's eigenbasis (``eigenbasis_moments``) uses only the eigenbases of
the factors, and a basis goes stale as the running factor moves: ``QᵀFQ``
is no longer diagonal. A full ``eigh`` of every factor on every decomposition step costs
most of the step on wide layers, while many bases have barely moved. With
``refresh_drift`` (:class:`~kfac_func.StepOptions`) a decomposition step refreshes only
the layers whose basis has drifted past the threshold in A or G, measured on the basis's
leading columns: for the columns ``q`` of the ``columns`` largest eigenvalues,

    ``drift = Σ ‖F q − (qᵀ F q) q‖² / Σ ‖F q‖²``,

the part of ``F q`` outside ``q``'s own direction: the off-diagonal mass of ``QᵀFQ`` in
those columns relative to their whole mass, 0 for an exact eigenbasis. It costs
``n² · columns`` multiply-adds per factor against ``eigh``'s ``O(n³)``, and the step reads
the drifts of all layers from the device once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from kfac_func.core.decomposition import EigenDecomposition
from kfac_func.state import LayerState

__all__ = ["DRIFT_COLUMNS", "basis_drift", "drifted_layers", "one_process_only"]

DRIFT_COLUMNS = 16
"""The leading eigenbasis columns whose drift is measured (all of a narrower factor)."""


def basis_drift(
    factor: torch.Tensor,
    basis: torch.Tensor,
    eigenvalues: torch.Tensor,
    columns: int = DRIFT_COLUMNS,
) -> torch.Tensor:
    """The drift of ``basis`` from ``factor`` (a 0-d tensor; the largest over leading
    batch dimensions): over the columns of the ``columns`` largest ``eigenvalues``, the
    mass of ``F q`` outside ``q`` relative to the mass of ``F q``.

    Example:
        >>> f = torch.diag(torch.tensor([3.0, 2.0, 1.0]))
        >>> q = torch.eye(3)
        >>> float(basis_drift(f, q, torch.tensor([3.0, 2.0, 1.0])))
        0.0
        >>> c, s = 0.8, 0.6  # the basis turned in the plane of the first two axes
        >>> turned = torch.tensor([[c, -s, 0.0], [s, c, 0.0], [0.0, 0.0, 1.0]])
        >>> round(float(basis_drift(f, turned, torch.tensor([3.0, 2.0, 1.0]))), 4)
        0.0329
    """
    n = basis.shape[-1]
    k = min(columns, n)
    f = factor.to(basis.dtype)
    idx = eigenvalues.topk(k, dim=-1).indices  # (..., k)
    q = basis.gather(-1, idx.unsqueeze(-2).expand(*basis.shape[:-1], k))  # (..., n, k)
    fq = f @ q
    rest = fq - q * (fq * q).sum(dim=-2, keepdim=True)
    mass = fq.square().sum(dim=(-2, -1))
    drift = rest.square().sum(dim=(-2, -1)) / mass.clamp_min(torch.finfo(mass.dtype).tiny)
    return drift.amax() if drift.dim() else drift


def drifted_layers(
    layers: Mapping[str, LayerState], names: Sequence[str], threshold: float
) -> list[str]:
    """The layers of ``names`` to decompose anew under ``refresh_drift=threshold``: those
    without an eigendecomposition yet, and those whose A or G basis drifted past
    ``threshold`` (:func:`basis_drift`; a diagonal factor has no basis to drift). A drift
    that is not finite refreshes its layer. The drifts are read on the host once.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import kfac_func as kf
        >>> state = kf.init(kf.register(nn.Linear(2, 2)))
        >>> drifted_layers(state.layers, [""], 0.01)  # no eigenbasis yet
        ['']
    """
    measured: dict[str, torch.Tensor] = {}
    for name in names:
        ls = layers[name]
        dec = ls.decomposition
        if not isinstance(dec, EigenDecomposition):
            continue
        sides = [
            basis_drift(f, q, d).to(torch.float32)
            for f, q, d in ((ls.a_factor, dec.qa, dec.da), (ls.g_factor, dec.qg, dec.dg))
            if q is not None
        ]
        measured[name] = torch.stack(sides).amax() if sides else ls.a_factor.new_zeros(())
    drifts = dict(zip(measured, torch.stack(list(measured.values())).tolist())) if measured else {}
    # not (d <= threshold): a NaN drift refreshes its layer
    return [n for n in names if n not in drifts or not drifts[n] <= threshold]


def one_process_only(where: str) -> ValueError:
    """The error for ``refresh_drift`` given to a step of several processes, ``where``
    saying which (the adapter's constructor and :func:`kfac_func.update_distributed` each
    refuse it before any collective).

    Example:
        >>> str(one_process_only("this is one of 2 processes")).split("; ")[1]
        'this is one of 2 processes: give refresh_drift=None'
    """
    return ValueError(
        "refresh_drift decides on one process which layers to decompose; "
        f"{where}: give refresh_drift=None"
    )
