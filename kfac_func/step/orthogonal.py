"""Orthogonalized steps in the step: the settings, which layers take them, and one layer's
preconditioning. The math is in :mod:`kfac_func.core.orthogonal`.

A layer takes the orthogonalized step when its kind holds one weight matrix
(:attr:`kfac_func.blocks.LayerBlock.orthogonalizable`: linear layers, convolutions,
attention projections, experts), its name does not match ``ortho_skip`` and, with
``ortho_wider_than``, one of its factor sides is wider than that. It keeps its
momentum in ``LayerState.ortho_momentum`` (in the layer's own coordinates, so that a new
eigenbasis needs no carrying), which also marks it, and its damped factor powers in
``LayerState.ortho_power`` (recomputed when the layer is decomposed). The other layers
of the step (norms, embeddings, a head matched by ``ortho_skip``) take the step's other
preconditioning: the eigenbasis moments when they are on, K-FAC's damped inverse
otherwise.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Collection, Mapping, MutableMapping
from typing import NamedTuple

import torch

from kfac_func.blocks import LayerSpec, LayerTable
from kfac_func.core.decomposition import EigenDecomposition
from kfac_func.core.orthogonal import (
    apply_powers,
    blocked_step,
    factor_powers,
    newton_schulz,
    orthogonal_scale,
)
from kfac_func.state import LayerState
from kfac_func.step.hyper import check_hyper

__all__ = [
    "TABLE_SETTINGS",
    "Orthogonal",
    "held_layers",
    "orthogonal_layers",
    "orthogonal_table",
    "precondition_orthogonal",
    "prepare_layers",
    "takes_orthogonal",
]


class Orthogonal(NamedTuple):
    """Settings of the orthogonalized step (see :mod:`kfac_func.core.orthogonal`).

    Attributes:
        powers: ``(p, q)``: the powers of the damped A and G factors (0: that side is not
            used).
        damping: ``δ``, relative to each factor's mean eigenvalue.
        beta: the momentum (Nesterov's, as Muon's) averaged before the preconditioning.
        steps: Newton–Schulz iterations.
        skip: a regular expression searched in the layer names: matching layers do not
            take the orthogonalized step (None: every layer whose kind can).
        dtype: the dtype of the Newton–Schulz iteration (``torch.bfloat16``, as Muon's,
            where the hardware multiplies it natively: about twice as fast); None: the
            factors'.
        wider_than: None, or only the layers with a factor side wider than this take the
            orthogonalized step: Muon's step where K-FAC's would decompose the widest
            factors, K-FAC's own step (or AdamW) on the narrow layers.
        block: None, or with one-sided powers (``(p, 0)``) the A factor of a layer taking
            the orthogonalized step, where it is wider than this, is kept as
            ``ceil(n / block)`` diagonal blocks of equal width (at most ``block``; see
            :attr:`kfac_func.blocks.LayerSpec.a_blocks`), as Distributed Shampoo blocks a
            wide side: its statistics, decompositions, power and memory grow with
            ``n · block`` instead of ``n²``, ``n³``. Set by
            :func:`orthogonal_table` when the table is built.
        every: the layers taking the orthogonalized step are decomposed again (new
            powers) only on the decomposition steps whose number is a multiple of this
            (1: on every one). Their step reads the factors through the damped powers
            only, a smooth function of them, where Adam's step in the eigenbasis needs
            the eigenbasis itself fresh; a layer without a decomposition gets one on any
            decomposition step.
    """

    powers: tuple[float, float] = (0.5, 0.0)
    damping: float = 0.01
    beta: float = 0.95
    steps: int = 5
    skip: str | None = None
    dtype: torch.dtype | None = None
    wider_than: int | None = None
    block: int | None = None
    every: int = 1

    def check(self, compute_method: str) -> Orthogonal:
        """This, validated for a state of ``compute_method`` (a ValueError names the bad
        setting).

        Example:
            >>> Orthogonal(powers=(0.5, -1.0)).check("eigen")
            Traceback (most recent call last):
            ...
            ValueError: ortho_powers must be two numbers in [0, 1], got (0.5, -1.0)
        """
        if compute_method not in ("eigen", "ekfac"):
            raise ValueError(
                "orthogonal steps take powers in the eigenbasis: compute_method 'eigen' or "
                f"'ekfac', got {compute_method!r}"
            )
        ok = (
            isinstance(self.powers, tuple)
            and len(self.powers) == 2
            and all(isinstance(v, (int, float)) and 0 <= v <= 1 for v in self.powers)
        )
        if not ok:
            raise ValueError(f"ortho_powers must be two numbers in [0, 1], got {self.powers!r}")
        check_hyper("ortho_damping", self.damping, lambda v: v >= 0, ">= 0")
        check_hyper("ortho_beta", self.beta, lambda v: 0 <= v < 1, "in [0, 1)")
        for name, n in (("ortho_steps", self.steps), ("ortho_every", self.every)):
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"{name} must be a positive int, got {n!r}")
        if self.skip is not None:
            re.compile(self.skip)
        for name, w in (("ortho_wider_than", self.wider_than), ("ortho_block", self.block)):
            if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
                raise ValueError(f"{name} must be a positive int or None, got {w!r}")
        if self.block is not None and (self.powers[1] != 0 or compute_method != "eigen"):
            raise ValueError(
                "ortho_block splits the A factor of the one-sided step (powers (p, 0), "
                f"compute_method 'eigen'), got powers {self.powers!r} and {compute_method!r}"
            )
        if self.dtype is not None and not (
            isinstance(self.dtype, torch.dtype) and self.dtype.is_floating_point
        ):
            raise ValueError(
                f"ortho_dtype must be a floating torch.dtype or None, got {self.dtype!r}"
            )
        return self


TABLE_SETTINGS = ("block",)
"""The fields of :class:`Orthogonal` that shape the layer table (:func:`orthogonal_table`)
rather than the step: the step reads them from the layers' specs, and
:class:`~kfac_func.StepOptions` has no field for them."""


def _orthogonal(spec: LayerSpec, rx: re.Pattern[str] | None, wider_than: int | None) -> bool:
    """Whether the layer of ``spec`` takes the orthogonalized step under the ``skip``
    pattern ``rx`` and ``wider_than``."""
    return (
        spec.block.orthogonalizable
        and (rx is None or rx.search(spec.name) is None)
        and (wider_than is None or max(spec.a_dim, spec.g_dim) > wider_than)
    )


def takes_orthogonal(spec: LayerSpec, settings: Orthogonal) -> bool:
    """Whether the layer of ``spec`` takes the orthogonalized step under ``settings`` (as
    :func:`orthogonal_layers` chooses).

    Example:
        >>> from torch import nn
        >>> import kfac_func as kf
        >>> takes_orthogonal(kf.register(nn.Linear(4, 3))[""], Orthogonal(wider_than=4))
        True
    """
    rx = None if settings.skip is None else re.compile(settings.skip)
    return _orthogonal(spec, rx, settings.wider_than)


def orthogonal_table(table: LayerTable, settings: Orthogonal, *, others: bool) -> LayerTable:
    """``table`` made ready for orthogonalized steps under ``settings``: with one-sided
    powers (``(p, 0)``) the G factor of every layer taking them (as
    :func:`orthogonal_layers` chooses them) is kept as its diagonal (the step does not use
    G, and a diagonal one costs ``rows × d_out`` to build instead of ``rows × d_out²``,
    and nothing to decompose), and with ``settings.block`` its A factor, where wider, as
    diagonal blocks; without ``others`` the other layers are moved to
    ``table.skipped`` (their parameters are left to another optimizer, as Muon leaves
    embeddings, norms and the head to AdamW).

    Example:
        >>> from torch import nn
        >>> import kfac_func as kf
        >>> model = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3), nn.Linear(3, 8))
        >>> table = orthogonal_table(kf.register(model), Orthogonal(), others=False)
        >>> table["0"].factor_shapes, table.skipped["1"]
        (((5, 5), (3,)), 'takes no orthogonalized step (left to the other optimizer)')
        >>> table = orthogonal_table(kf.register(model), Orthogonal(wider_than=6), others=True)
        >>> table["0"].factor_shapes, table["2"].factor_shapes  # only "2" is wider than 6
        (((5, 5), (3, 3)), ((4, 4), (8,)))
        >>> blocked = orthogonal_table(kf.register(model), Orthogonal(block=3), others=True)
        >>> blocked["0"].factor_shapes  # 5 inputs in 2 blocks of 3
        ((2, 3, 3), (3,))
    """
    rx = None if settings.skip is None else re.compile(settings.skip)
    one_sided = settings.powers[1] == 0
    specs, skipped = [], dict(table.skipped)
    for s in table.values():
        if not _orthogonal(s, rx, settings.wider_than):
            if others:
                specs.append(s)
            else:
                skipped[s.name] = "takes no orthogonalized step (left to the other optimizer)"
        elif one_sided:
            k = 1
            if settings.block is not None and not s.a_diagonal and s.a_dim > settings.block:
                k = -(-s.a_dim // settings.block)
            specs.append(dataclasses.replace(s, diagonal=(s.a_diagonal, True), a_blocks=k))
        else:
            specs.append(s)
    return LayerTable(specs, skipped, model_name=table.model_name)


def orthogonal_layers(layers: Mapping[str, LayerState], settings: Orthogonal) -> list[str]:
    """The names of ``layers`` that take the orthogonalized step under ``settings``: those
    whose kind can (:attr:`~kfac_func.blocks.LayerBlock.orthogonalizable`), whose name
    ``settings.skip`` (a regular expression, ``re.search``) does not match and, with
    ``settings.wider_than``, with a factor side wider than that.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import kfac_func as kf
        >>> model = nn.Sequential(nn.Embedding(5, 4), nn.Linear(4, 4), nn.Linear(4, 6))
        >>> state = kf.init(kf.register(model))
        >>> orthogonal_layers(state.layers, Orthogonal(skip=r"^2$"))
        ['1']
        >>> orthogonal_layers(state.layers, Orthogonal(wider_than=5))
        ['2']
    """
    rx = None if settings.skip is None else re.compile(settings.skip)
    return [name for name, ls in layers.items() if _orthogonal(ls.spec, rx, settings.wider_than)]


def held_layers(
    layers: Mapping[str, LayerState], settings: Orthogonal | None, step: int
) -> set[str]:
    """The layers of ``layers`` that keep their decompositions on the decomposition step
    ``step``: those taking the orthogonalized step under ``settings`` when ``step`` is
    not a multiple of ``settings.every``; none otherwise.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import kfac_func as kf
        >>> state = kf.init(kf.register(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))))
        >>> wide = Orthogonal(wider_than=5, every=4)
        >>> sorted(held_layers(state.layers, wide, 6)), held_layers(state.layers, wide, 8)
        (['0', '1'], set())
    """
    if settings is None or step % settings.every == 0:
        return set()
    return set(orthogonal_layers(layers, settings))


def prepare_layers(
    layers: MutableMapping[str, LayerState],
    names: list[str],
    settings: Orthogonal,
    fresh: Collection[str],
) -> None:
    """Make each of ``names`` ready for its orthogonalized step (in place): a zero momentum
    where it has none (which also marks the layer, before the step groups the layers), and
    its factor powers (:func:`~kfac_func.core.orthogonal.factor_powers`) where it has none
    or was decomposed this step (``fresh``). Powers are kept from one decomposition to the
    next: new ``ortho_powers`` or ``ortho_damping`` apply from the next decomposition, as a
    new damping does for the inverse method. Layers without a decomposition yet are left
    without powers (the step passes them over). A TypeError names a layer whose
    decomposition has no eigenbasis."""
    for name in names:
        ls = layers[name]
        if ls.ortho_momentum is None:
            f = ls.a_factor
            zeros = torch.zeros(ls.spec.matrix_shape, dtype=f.dtype, device=f.device)
            ls = ls.replace(ortho_momentum=zeros)
        dec = ls.decomposition
        if dec is not None and (ls.ortho_power is None or name in fresh):
            if not isinstance(dec, EigenDecomposition):
                raise TypeError(
                    f"layer {name!r}: orthogonal steps take powers of an eigen decomposition, "
                    f"got {type(dec).__name__}"
                )
            width = ls.spec.a_dim if ls.spec.a_blocks > 1 else None
            power = factor_powers(dec, settings.powers, settings.damping, a_width=width)
            ls = ls.replace(ortho_power=power)
        layers[name] = ls


def precondition_orthogonal(
    ls: LayerState, m: torch.Tensor, settings: Orthogonal
) -> tuple[torch.Tensor, dict[str, object]]:
    """``(P, changes)``: one layer's orthogonalized step from its gradient matrix ``m``, and
    the change of its state that holds the new momentum.

    The momentum ``b ← β b + m`` is taken Nesterov's way (``u = m + β b``), preconditioned
    by the layer's factor powers (``LayerState.ortho_power``, see :func:`prepare_layers`),
    orthogonalized (:func:`~kfac_func.core.orthogonal.newton_schulz`) and scaled to AdamW's
    root-mean-square (:func:`~kfac_func.core.orthogonal.orthogonal_scale`): the momentum
    in the factors' dtype, the powers and the iteration in ``settings.dtype`` (the
    factors' when None); returned in ``m``'s. A layer whose A factor is blocked takes the
    step block by block (:func:`~kfac_func.core.orthogonal.blocked_step`)."""
    assert ls.ortho_momentum is not None and ls.ortho_power is not None
    g = m.to(ls.a_factor.dtype)
    momentum = torch.add(g, ls.ortho_momentum, alpha=settings.beta)
    u = torch.add(g, momentum, alpha=settings.beta)
    v = u if settings.dtype is None else u.to(settings.dtype)
    power = ls.ortho_power
    if ls.spec.a_blocks > 1 and power.a is not None and power.g is None:
        out = blocked_step(v, power.a, settings.steps)
    else:
        out = newton_schulz(apply_powers(v, power), settings.steps) * orthogonal_scale(m.shape)
    return out.to(m.dtype), {"ortho_momentum": momentum}
