"""Eigenbasis moments in the step: the settings, one layer's preconditioning, and carrying
the moments into a recomputed eigenbasis. The math is in
:mod:`kfac_func.core.basis_moments`.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Mapping, MutableMapping
from typing import Any, NamedTuple

import torch
from torch.func import vmap

from kfac_func.core.basis_moments import adam_in_basis
from kfac_func.core.basis_moments import carry_moments as carry_both
from kfac_func.core.decomposition import Decomposition, EigenDecomposition, EKFACDecomposition
from kfac_func.core.stacks import stacked
from kfac_func.state import LayerState
from kfac_func.step.hyper import check_hyper

__all__ = ["BasisMoments", "basis_of", "carry_moments", "moment_bases", "precondition_in_basis"]


class BasisMoments(NamedTuple):
    """Settings of eigenbasis moments (see :mod:`kfac_func.core.basis_moments`): Adam's
    ``beta2``, ``eps`` and ``beta1`` (0: no first moment)."""

    beta2: float = 0.999
    eps: float = 1e-8
    beta1: float = 0.0

    def check(self, compute_method: str) -> BasisMoments:
        """This, validated for a state of ``compute_method`` (a ValueError names the bad
        setting)."""
        if compute_method not in ("eigen", "ekfac"):
            raise ValueError(
                "eigenbasis_moments needs an eigenbasis: compute_method 'eigen' or 'ekfac', "
                f"got {compute_method!r}"
            )
        check_hyper("moment_beta2", self.beta2, lambda v: 0 <= v < 1, "in [0, 1)")
        check_hyper("moment_eps", self.eps, lambda v: v >= 0, ">= 0")
        check_hyper("moment_beta1", self.beta1, lambda v: 0 <= v < 1, "in [0, 1)")
        return self


def basis_of(dec: Decomposition) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(qa, qg)`` of an eigen or EKFAC decomposition."""
    if not isinstance(dec, (EigenDecomposition, EKFACDecomposition)):
        raise TypeError(f"{type(dec).__name__} has no eigenbasis")
    return dec.qa, dec.qg


def precondition_in_basis(
    ls: LayerState, m: torch.Tensor, settings: BasisMoments
) -> tuple[torch.Tensor, dict[str, object]]:
    """``(P, changes)``: the layer's gradient matrix ``m`` preconditioned by its running
    moment in its eigenbasis, and the changes of the layer state that hold the new moment
    (``ls.replace(**changes)``)."""
    assert ls.decomposition is not None
    qa, qg = basis_of(ls.decomposition)
    dtype = ls.a_factor.dtype
    p, moment, first = adam_in_basis(
        m.to(dtype),
        None if qa is None else qa.to(dtype),
        None if qg is None else qg.to(dtype),
        ls.basis_moment,
        ls.moment_count,
        beta2=settings.beta2,
        eps=settings.eps,
        first=ls.basis_momentum,
        beta1=settings.beta1,
    )
    changes: dict[str, object] = {"basis_moment": moment, "moment_count": ls.moment_count + 1}
    if first is not None:
        changes["basis_momentum"] = first
    return p.to(m.dtype), changes


def moment_bases(
    layers: Mapping[str, LayerState],
) -> dict[str, tuple[torch.Tensor | None, torch.Tensor | None]]:
    """The eigenbases that the moments of ``layers`` are kept in, before a decomposition
    stage replaces them (see :func:`carry_moments`)."""
    return {
        name: basis_of(ls.decomposition)
        for name, ls in layers.items()
        if ls.basis_moment is not None and ls.decomposition is not None
    }


def carry_moments(
    layers: MutableMapping[str, LayerState],
    before: Mapping[str, tuple[torch.Tensor | None, torch.Tensor | None]],
    fresh: Collection[str],
    *,
    grouped: bool = False,
) -> None:
    """Carry the moments of every layer in ``fresh`` (decomposed anew) from its basis in
    ``before`` into its new one (in place; the count is kept): the second moment's
    diagonal approximately (:func:`~kfac_func.core.basis_moments.carry_moment`), the
    first moment exactly (:func:`~kfac_func.core.basis_moments.rotate_moment`). With
    ``grouped``, layers whose moments and bases have the same shapes are carried together
    (stacked, under :func:`torch.func.vmap`; the same numbers to rounding)."""
    todo: dict[Hashable, list[tuple[str, Any, Any]]] = {}
    for name in fresh:
        ls = layers[name]
        if name not in before or ls.basis_moment is None or ls.decomposition is None:
            continue
        old = before[name]
        new = basis_of(ls.decomposition)
        if all(o is n for o, n in zip(old, new)):
            continue
        parts = (ls.basis_moment, ls.basis_momentum, *old, *new)
        key = tuple(None if t is None else (tuple(t.shape), t.dtype, t.device) for t in parts)
        todo.setdefault(key if grouped else name, []).append((name, old, new))
    for members in todo.values():
        if len(members) == 1:
            name, old, new = members[0]
            ls = layers[name]
            moment, first = carry_both(ls.basis_moment, ls.basis_momentum, old, new)  # type: ignore[arg-type]
            layers[name] = ls.replace(basis_moment=moment, basis_momentum=first)
            continue
        states = [layers[name] for name, _, _ in members]
        columns = [
            [ls.basis_moment for ls in states],
            [ls.basis_momentum for ls in states],
            *([m[1][k] for m in members] for k in range(2)),
            *([m[2][k] for m in members] for k in range(2)),
        ]
        present = [c[0] is not None for c in columns]
        stacks = [stacked(c)[0] for c, here in zip(columns, present) if here]  # type: ignore[arg-type]

        def carry(*ts: torch.Tensor, present: list[bool] = present) -> Any:
            it = iter(ts)
            moment, first, oa, og, na, ng = (next(it) if here else None for here in present)
            out = carry_both(moment, first, (oa, og), (na, ng))  # type: ignore[arg-type]
            return out if out[1] is not None else out[0]

        result = vmap(carry)(*stacks)
        seconds, firsts = result if isinstance(result, tuple) else (result, None)
        second_each = seconds.unbind(0)
        first_each = [None] * len(members) if firsts is None else firsts.unbind(0)
        for (name, _, _), ls, moment, first in zip(members, states, second_each, first_each):
            layers[name] = ls.replace(basis_moment=moment, basis_momentum=first)
