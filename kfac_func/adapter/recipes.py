"""The recipes of :class:`~kfac_func.KFAC`: what ``kf.KFAC(model)`` means with no other
argument, and kfac-pytorch's recipe one argument away.

A :class:`Recipe` holds the defaults of everything the optimizer face decides: the
learning rate, the betas (of Adam's step in K-FAC's eigenbasis and of AdamW on the other
parameters), the decoupled weight decay, the base optimizer's keyword arguments and the
preconditioner's (kfac-pytorch's arguments, and a :class:`~kfac_func.Settings` value for
the rest). Arguments given to :class:`~kfac_func.KFAC` replace the recipe's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kfac_func.adapter.settings import Settings
from kfac_func.step.hyper import DecayPerStep, GrowingInterval
from kfac_func.step.orthogonal import Orthogonal

__all__ = ["HEAD_NAMES", "RECIPES", "STATISTICS", "WIDE", "Recipe", "recipe_named"]


@dataclass(frozen=True)
class Recipe:
    """The defaults of :class:`~kfac_func.KFAC` for one recipe.

    Attributes:
        name: the recipe's name (a key of :data:`RECIPES`).
        lr: the default learning rate.
        betas: ``(β₁, β₂)`` of the eigenbasis moments and of AdamW on the parameters K-FAC
            does not precondition; None: the preconditioner's and AdamW's own defaults.
        weight_decay: the decoupled weight decay of every stepped parameter; None: each
            base optimizer's own default (torch's AdamW: 0.01 on the others, none on
            K-FAC's).
        base_kwargs: the keyword arguments of the base optimizer (SGD) of the
            preconditioned parameters.
        kfac_kwargs: the keyword arguments of the
            :class:`~kfac_func.KFACPreconditioner` (kfac-pytorch's).
        settings: the preconditioner's :class:`~kfac_func.Settings`.
        automatic: whether the face chooses the performance switches (batched
            decompositions, ``sync_free`` on one CUDA process) for the user.

    Example:
        >>> import kfac_func as kf
        >>> kf.RECIPES["recommended"].settings.eigenbasis_moments
        True
        >>> kf.RECIPES["kfac-pytorch"].lr
        0.001
    """

    name: str
    lr: float
    betas: tuple[float, float] | None
    weight_decay: float | None
    base_kwargs: Mapping[str, Any] = field(default_factory=dict)
    kfac_kwargs: Mapping[str, Any] = field(default_factory=dict)
    settings: Settings = field(default_factory=Settings)
    automatic: bool = False


RECOMMENDED_LR = 0.014
"""The default learning rate of the recommended recipe: among the learning rates that
every workload's tuning grid of the recipe (the race's ``kfac-moments-wide``) tried in the
optimizer race (0.007, 0.014, 0.028), the one whose worst final test loss on the tuning
seed is the smallest fraction of the way from the tuned rate's to AdamW's (see
docs/optimizers.md)."""

WIDE = 512
"""The recommended recipe's ``Orthogonal.wider_than`` and ``Orthogonal.block``: the layers
with a factor side wider than this take Muon's orthogonalized step on K-FAC's input
curvature instead of Adam's step in the eigenbasis, their G factors diagonal and their A
factors, where wider, in diagonal blocks no wider than this, so that no factor or block
wider than this is decomposed or (on the G side) gathered, at any model size. On a model
with no side that wide the recipe is Adam's step in K-FAC's eigenbasis on every layer."""

STATISTICS = GrowingInterval(first=1, until=256, most=4)
"""The recommended recipe's ``factor_update_steps``: statistics every step for the first
256 steps, every other step until step 512, then every 4th, with the factor decay that
keeps their memory in steps (``DecayPerStep(0.9, STATISTICS)``: 0.9, 0.81, then 0.6561).
Every other step from the start reached Muon's final loss sooner on the short races'
``lm`` and ``gpt2`` but lost the lead over Muon on ``lm4x`` (see docs/benchmarks.md); young
runs keep every step. On the 2,000-step ``lm_long`` every 4th step from step 512 tied every
other step's final loss with a third fewer steps gathering statistics (756 against 1,128;
see docs/benchmarks.md)."""

HEAD_NAMES = r"(^|\.)(lm_head|head|classifier|output)$"
"""The layer names the orthogonal recipes take for a model's head (``ortho_skip``): a
head keeps AdamW's step (``"orthogonal-two-sided"``), as Muon leaves it to AdamW, or
K-FAC's (``"orthogonal-kfac-head"``); give ``orthogonal=`` to name another."""

_ORTHOGONAL = {
    "kl_clip": None,
    "factor_update_steps": 2,
    "factor_decay": 0.81,
    "inv_update_steps": 10,
}
"""The orthogonal recipes' preconditioner arguments (with the ``"fisher"`` scaling): no
KL clip, factor statistics every 2 steps (decay 0.81: the memory in steps of 0.9 every step) and
factor powers every 10 steps. Cheaper than the recommended recipe's schedule: the
orthogonalized step reads the factors through their powers only, a smooth function of
them, where Adam's step in the eigenbasis needs the eigenbasis itself fresh."""


def _orthogonal(name: str, powers: tuple[float, float], moments: bool = False) -> Recipe:
    """An orthogonal recipe: :data:`_ORTHOGONAL`'s arguments, ``powers`` of the factors,
    :data:`HEAD_NAMES` for the head, the other layers on Adam's step in K-FAC's eigenbasis
    with ``moments``."""
    ortho = Orthogonal(powers=powers, skip=HEAD_NAMES)
    return Recipe(
        name=name,
        lr=0.02,
        betas=(0.9, 0.95),
        weight_decay=0.0,
        base_kwargs={"momentum": 0.0},
        kfac_kwargs=_ORTHOGONAL,
        settings=Settings(scaling="fisher", orthogonal=ortho, eigenbasis_moments=moments),
        automatic=True,
    )


RECIPES: dict[str, Recipe] = {
    "recommended": Recipe(
        name="recommended",
        lr=RECOMMENDED_LR,
        betas=(0.9, 0.95),
        weight_decay=0.0,
        base_kwargs={"momentum": 0.0},
        kfac_kwargs={
            "kl_clip": None,
            "factor_update_steps": STATISTICS,
            "inv_update_steps": GrowingInterval(),
            "factor_decay": DecayPerStep(0.9, STATISTICS),
        },
        settings=Settings(
            scaling="fisher",
            eigenbasis_moments=True,
            orthogonal=Orthogonal(powers=(0.5, 0.0), wider_than=WIDE, block=WIDE),
        ),
        automatic=True,
    ),
    "kfac-pytorch": Recipe(name="kfac-pytorch", lr=1e-3, betas=None, weight_decay=None),
    "orthogonal-two-sided": _orthogonal("orthogonal-two-sided", (0.25, 0.25)),
    "orthogonal-kfac-head": _orthogonal("orthogonal-kfac-head", (0.5, 0.0), moments=True),
}
"""The named recipes: ``"recommended"`` (the default: Adam's step in K-FAC's eigenbasis,
factor statistics every step, then every other step from step 256 and every 4th from
step 512 (:data:`STATISTICS`), eigenbases every 2 steps, growing to every 32 as a long run
goes on (:class:`~kfac_func.step.GrowingInterval`), and Muon's step on K-FAC's input
curvature for the layers with a side wider than :data:`WIDE`; the optimizer race's
``kfac-moments-wide``) and ``"kfac-pytorch"``
(kfac-pytorch's preconditioner defaults in front of plain SGD, AdamW with torch's
defaults on the other parameters: what ``kf.KFAC`` was before the recommended recipe),
and the orthogonal recipes (Muon's step on K-FAC's curvature, see
:mod:`kfac_func.step.orthogonal`): ``"orthogonal-two-sided"``, the hidden matrices'
momentum preconditioned as ``(G + δI)^(-1/4) U (A + δI)^(-1/4)`` and orthogonalized,
embeddings, norms and the head (:data:`HEAD_NAMES`) on AdamW; ``"orthogonal-kfac-head"``,
the momentum times ``(A + δI)^(-1/2)`` orthogonalized, their G factors diagonal, and the
head, embeddings and norms on Adam's step in K-FAC's eigenbasis. A one-sided recipe with
the head on AdamW (``"orthogonal"``) was retired: in the orthogonal race it ended behind
``"orthogonal-kfac-head"`` on the language model and GPT-2 and tied elsewhere (see
docs/benchmarks.md)."""


def recipe_named(name: str | Recipe) -> Recipe:
    """The :class:`Recipe` called ``name`` (a :class:`Recipe` is returned as it is).

    Raises:
        ValueError: ``name`` is not a key of :data:`RECIPES` (the error lists them).

    Example:
        >>> from kfac_func.adapter.recipes import recipe_named
        >>> recipe_named("recommended").betas
        (0.9, 0.95)
    """
    if isinstance(name, Recipe):
        return name
    if name not in RECIPES:
        raise ValueError(f"recipe must be one of {sorted(RECIPES)} or a Recipe, got {name!r}")
    return RECIPES[name]
