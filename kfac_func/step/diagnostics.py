"""Diagnostics of a state: whether the damping drowns the curvature it is added to.

K-FAC divides each gradient by ``A ⊗ G + damping`` (``"eigen"``, ``"ekfac"``), or by
``A + damping`` and ``G + damping`` one side each (``"inverse"``). When the damping
exceeds that curvature by orders of magnitude, that is a division by the damping alone
(by its square under ``"inverse"``): plain SGD with the learning rate ``lr / damping``, at
K-FAC's cost. It happens to the ``"kfac-pytorch"`` scaling on losses averaged over many
rows (tokens of a language model, pixels): G is built from the gradients of the averaged
loss, so its entries shrink with the square of the row count, and a damping tuned for a
classifier dominates them.

:func:`damping_dominance` finds that regime in the factors the step divides by: the
running factors, which under ``"kfac-pytorch"`` start at the identity and show the data
only as that start decays (until then the identity, not the damping, sets the step, and
there is nothing to warn about). :func:`judged_at` says at which factor updates the adapter
judges them (the 1st, 2nd, 4th, ...: a bounded number of device synchronisations); it
warns at the first at which the damping dominates, once. Steps that divide by running
moments instead (``eigenbasis_moments``) are not judged: the damping sets no step there.
"""

from __future__ import annotations

import torch

from kfac_func.state import KFACState

__all__ = ["DOMINANCE", "JUDGE_LIMIT", "damping_dominance", "judged_at"]

#: how many times the curvature the damping must exceed, in every layer, for
#: :func:`damping_dominance` to report it
DOMINANCE = 100.0


#: the last factor update at which :func:`judged_at` judges the damping
JUDGE_LIMIT = 1024


def judged_at(factor_updates: int) -> bool:
    """Whether the damping is judged after this many factor updates: at the powers of two
    up to :data:`JUDGE_LIMIT` (the running factors then hold the data, an identity start
    having decayed, or the data moved; a bounded number of checks).

    Example:
        >>> [k for k in range(1, 20) if judged_at(k)]
        [1, 2, 4, 8, 16]
    """
    k = factor_updates
    return 0 < k <= JUDGE_LIMIT and k & (k - 1) == 0


def damping_dominance(
    state: KFACState,
    damping: float,
    *,
    before: KFACState | None = None,
    factor_decay: float = 0.0,
) -> tuple[str, float] | None:
    """The layer with the largest curvature and that curvature, if ``damping`` drowns all.

    A layer's curvature is what its method adds the damping to: the mean eigenvalue of
    ``A ⊗ G``, ``(tr A / n) (tr G / m)`` (``"eigen"``, ``"ekfac"``), or the larger of the
    sides' mean eigenvalues ``tr A / n`` and ``tr G / m`` (``"inverse"``, which damps each
    side), averaged over the groups of a grouped convolution; a placeholder side (a norm's
    ``A = 1``, never damped) leaves the other side alone to judge. Given ``before``, the
    state one factor update earlier, the factors judged are that update's batch factors,
    ``(new − decay·old) / (1 − decay)``; only layers whose factors that update changed
    count. Without it, the current (running) factors of every layer whose factors were
    ever updated count. Returns ``(layer, curvature)`` when ``damping`` exceeds
    :data:`DOMINANCE` times the curvature of every counted layer, otherwise None (also
    when no layer counts, or when ``factor_decay`` is 1 with ``before``). One
    synchronisation with the device.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import kfac_func as kf
        >>> state = kf.init(kf.register(nn.Sequential(nn.Linear(3, 2))))
        >>> layer = state.layers["0"].replace(
        ...     a_factor=torch.eye(4) * 1e-3, g_factor=torch.eye(2) * 1e-4, factor_updates=1
        ... )
        >>> small = state.replace(layers={"0": layer})
        >>> name, curvature = damping_dominance(small, damping=1e-3)
        >>> name, round(curvature, 12)
        ('0', 1e-07)
        >>> damping_dominance(small, damping=1e-6) is None
        True
    """
    if before is not None and factor_decay >= 1:
        return None
    fisher = state.config.convention == "fisher"  # whose first update replaces
    means = []
    for name, layer in state.layers.items():
        old = before.layers.get(name) if before is not None else None
        if layer.factor_updates == 0 or (
            before is not None and (old is None or old.factor_updates == layer.factor_updates)
        ):
            continue
        spec = layer.spec
        replaced = old is not None and old.factor_updates == 0 and fisher
        sides = []
        for new, prev, diagonal in (
            (layer.a_factor, old.a_factor if old else None, spec.a_diagonal),
            (layer.g_factor, old.g_factor if old else None, spec.g_diagonal),
        ):
            if prev is not None and not replaced:  # the batch part of the running average
                new = (new - factor_decay * prev) / (1 - factor_decay)
            sides.append((new if diagonal else new.diagonal(dim1=-2, dim2=-1)).mean(-1))
        sides = [s for s, held in zip(sides, spec.placeholder) if not held]
        if state.config.compute_method == "inverse":
            means.append((name, torch.stack([s.mean() for s in sides]).amax()))
        else:
            means.append((name, torch.stack(sides).prod(dim=0).mean()))
    if not means:
        return None
    first = means[0][1]
    values: list[float] = torch.stack(
        [v.to(first.device, torch.float64) for _, v in means]
    ).tolist()
    best = max(range(len(values)), key=values.__getitem__)
    if damping > DOMINANCE * values[best]:
        return means[best][0], values[best]
    return None
