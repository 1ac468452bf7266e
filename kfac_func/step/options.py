"""`StepOptions`: every setting of a K-FAC step, as one frozen value.

:func:`kfac_func.update`, :func:`kfac_func.distributed.update_distributed`,
:func:`kfac_func.step.precondition_grads` and :class:`kfac_func.KFACPreconditioner` read their
step settings from it (each stage the ones it uses). The functions take it as
``options=`` and any of its fields as keywords, which override it:

    opts = kf.StepOptions(damping=1e-2, eigenbasis_moments=True, kl_clip=None)
    grads, state = kf.update(state, grads, captures=caps, options=opts)
    grads, state = kf.update(state, grads, captures=caps, options=opts, lr=0.05)

Settings that do not depend on the step are checked when the value is made (a ValueError
or TypeError names the setting); hyperparameters, which may be ``step -> value``
callables, are checked at each step (:meth:`StepOptions.at`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from kfac_func.step.basis import BasisMoments
from kfac_func.step.hyper import (
    HYPER_CHECKS,
    Hyper,
    NonFinite,
    check_hyper,
    resolve,
    resolve_checked,
)
from kfac_func.step.layer_step import StageSettings
from kfac_func.step.orthogonal import Orthogonal
from kfac_func.step.sync_free import check_sync_free

__all__ = ["DEFAULT_DAMPING", "StepOptions", "step_options"]

DEFAULT_DAMPING = 1e-3
"""The damping of a step given none (``StepOptions.damping=None``) that decomposes."""

_FLAGS = ("eigenbasis_moments", "orthogonal", "sync_free", "batched_eigh")


@dataclass(frozen=True)
class StepOptions:
    """The settings of a K-FAC step; see :func:`kfac_func.update` for the step itself.

    Attributes:
        damping: Tikhonov damping λ. None: ``1e-3`` for a step that decomposes; for
            :func:`kfac_func.step.precondition_grads` alone, the damping each decomposition
            was made with (see there).
        factor_decay: running-average coefficient of the factors in [0, 1] (0: the
            batch factors replace the average).
        kl_clip: gradient-scale clipping, ``min(1, sqrt(kl_clip / |lr² Σ P ⊙ grad|))``;
            None disables it.
        lr: learning rate used by the kl_clip scale.
        update_factors: fold this step's statistics into the factors.
        gram_dtype: the dtype of the operands of the statistics' Gram products (their
            sums are accumulated in float32, or the factors' dtype where wider): None,
            the factors' dtype (exact); ``torch.bfloat16`` rounds each input and
            output-gradient entry to 8 significant bits, so that every entry of a Gram is
            within ``3 · 2⁻⁸ · Σ|x||y|`` of the exact one, at half the cost or less
            where the hardware multiplies bfloat16 natively (CPUs with AVX-512 BF16 or
            AMX, CUDA GPUs). Captures made under ``torch.autocast`` then keep their
            bfloat16 activations as they are. The norms' statistics, elementwise with no
            products to speed up, and an embedding's token counts (integers) stay in at
            least float32 whatever this is.
        update_inverses: recompute the decompositions this step (layers without one are
            always decomposed once their factors hold data). Under
            ``compute_method="ekfac"`` the corrected eigenvalues are updated from the
            captures whenever the factors are (restarted in a basis computed this step;
            see :func:`kfac_func.step.correct_eigenvalues`).
        nonfinite: ``"skip"`` (warn, keep that layer's state, pass its gradient
            unchanged) or ``"raise"`` (:class:`kfac_func.NonFiniteError`) on NaN/Inf.
        eigenbasis_moments: divide each layer's gradient in its eigenbasis by the root of
            a running second moment of the gradient there (Adam's step in K-FAC's
            eigenbasis, the idea of SOAP; see :mod:`kfac_func.core.basis_moments`)
            instead of by the eigenvalues plus damping (``"eigen"`` or ``"ekfac"``). The
            moments live in the state (``LayerState.basis_moment``), are carried into each
            new eigenbasis, and start with a layer's first decomposition. Usually with
            ``kl_clip=None`` and the learning rate of Adam.
        moment_beta2, moment_eps: the moments' ``β₂`` and ``ε``.
        moment_beta1: Adam's ``β₁`` for eigenbasis moments: the gradient is averaged first
            (``LayerState.basis_momentum``) and the average preconditioned, as SOAP does;
            use the consuming optimizer without momentum then. 0: none.
        orthogonal: Muon's step on K-FAC's curvature (see
            :mod:`kfac_func.step.orthogonal`): each layer whose kind holds one weight
            matrix and whose name ``ortho_skip`` does not match takes its Nesterov
            momentum (``ortho_beta``, kept in ``LayerState.ortho_momentum``),
            preconditioned by powers of its damped factors,
            ``(G + δ·mean(G) I)^(-q) U (A + δ·mean(A) I)^(-p)``, orthogonalized by
            ``ortho_steps`` Newton–Schulz iterations and scaled to AdamW's RMS
            (``0.2·sqrt(max(rows, cols))``); the consuming optimizer takes no momentum
            then, and ``kl_clip`` is usually None. The other layers take the step's
            other preconditioning (eigenbasis moments when on). Needs ``"eigen"`` or
            ``"ekfac"``.
        ortho_powers: ``(p, q)``, the powers of A and G in [0, 1]: ``(0.5, 0.0)``
            one-sided (G is not used: register it diagonal, see
            :func:`kfac_func.register`'s ``max_factor_dim``), ``(0.25, 0.25)`` two-sided.
        ortho_damping: ``δ``, relative to each factor's mean eigenvalue.
        ortho_beta, ortho_steps: the momentum and the Newton–Schulz iterations.
        ortho_dtype: the iteration's dtype (``torch.bfloat16`` as Muon's; None: the
            factors').
        ortho_skip: a regular expression of the layer names that do not take the
            orthogonalized step (a head kept on K-FAC's own step); None: none.
        ortho_wider_than: None, or only the layers with a factor side wider than this
            take the orthogonalized step; the others take the step's other
            preconditioning.
        ortho_every: the layers taking the orthogonalized step get new decompositions
            (and powers) only on the ``update_inverses`` steps whose number is a multiple
            of this (1: on every one; see :class:`kfac_func.Orthogonal`).
        sync_free: decide on the device (see :mod:`kfac_func.step.sync_free`): each
            layer's gradient is checked for NaN/Inf there and ``torch.where`` selects its
            preconditioned or its raw gradient; the kl_clip scale stays a tensor. On one
            process factor updates and decompositions decide on the device too (see
            :mod:`kfac_func.step.decompose_groups`; ``LayerState.factor_skips`` and
            ``LayerState.usable``): no step kind reads anything on the host, and
            ``torch.compile(kfac_func.update, fullgraph=True)`` traces each whole. Skipped
            layers are counted in the state (``LayerState.grad_skips``) and warned about
            by :func:`kfac_func.step.report_skipped` (or by the next step without
            ``sync_free``). With every gradient and factor finite the results equal the
            default's dense path exactly (captured rows are not used). Needs
            ``nonfinite="skip"``. Under ``eigenbasis_moments`` a skipped step still counts
            in ``moment_count`` (the moments themselves keep their values).
        batched_eigh: one batched eigh per factor shape across layers (see
            :func:`kfac_func.decompose`).
        grouped: compute the layers of one shape together, as stacked tensors: their batch
            factors (:mod:`kfac_func.step.batch_factors`), running factors
            (:func:`~kfac_func.step.accumulate.fold_layers`), preconditioning
            (:mod:`kfac_func.step.grouped`) and, for the eigen methods,
            eigendecompositions (as ``batched_eigh``) and precomputed ``dgda``. The
            operations of those stages grow with the number of distinct layer shapes, not
            of layers. ``grouped=False`` runs every layer as a group of one, through the
            same code (the old factors and decompositions are then freed layer by layer);
            the results are the same to rounding. None (the default): grouped where the
            factors are on an accelerator, where each operation is a kernel launch; one
            layer at a time on a CPU, where stacking measured slower
            (:func:`~kfac_func.step.grouping.grouped_here`).

    All hyperparameters (``damping``, ``factor_decay``, ``kl_clip``, ``lr``,
    ``update_factors``, ``update_inverses``) may be ``step -> value`` callables, evaluated
    at ``state.step``.

    Example:
        >>> import kfac_func as kf
        >>> opts = kf.StepOptions(damping=1e-2, eigenbasis_moments=True, kl_clip=None)
        >>> opts.replace(lr=0.05).lr, opts.basis_settings("eigen")
        (0.05, BasisMoments(beta2=0.999, eps=1e-08, beta1=0.0))
        >>> kf.StepOptions(nonfinite="ignore")
        Traceback (most recent call last):
        ...
        ValueError: nonfinite must be 'skip' or 'raise', got 'ignore'
    """

    damping: Hyper | None = None
    factor_decay: Hyper = 0.95
    kl_clip: Hyper | None = 1e-3
    lr: Hyper = 0.1
    update_factors: bool | Callable[[int], bool] = True
    update_inverses: bool | Callable[[int], bool] = True
    nonfinite: NonFinite = "skip"
    eigenbasis_moments: bool = False
    moment_beta2: float = 0.999
    moment_eps: float = 1e-8
    moment_beta1: float = 0.0
    orthogonal: bool = False
    ortho_powers: tuple[float, float] = (0.5, 0.0)
    ortho_damping: float = 0.01
    ortho_beta: float = 0.95
    ortho_steps: int = 5
    ortho_skip: str | None = None
    ortho_dtype: torch.dtype | None = None
    ortho_wider_than: int | None = None
    ortho_every: int = 1
    sync_free: bool = False
    batched_eigh: bool = False
    grouped: bool | None = None
    gram_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        if torch.compiler.is_compiling():
            return  # checked eagerly by the caller of the compiled step
        if self.nonfinite not in ("skip", "raise"):
            raise ValueError(f"nonfinite must be 'skip' or 'raise', got {self.nonfinite!r}")
        for name in _FLAGS:
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.grouped is not None and not isinstance(self.grouped, bool):
            raise TypeError(f"grouped must be a bool or None, got {self.grouped!r}")
        check_sync_free(self.sync_free, self.nonfinite)
        if self.eigenbasis_moments:
            BasisMoments(self.moment_beta2, self.moment_eps, self.moment_beta1).check("eigen")
        if self.orthogonal:
            self.orthogonal_settings("eigen")
        dt = self.gram_dtype
        if dt is not None and not (isinstance(dt, torch.dtype) and dt.is_floating_point):
            raise ValueError(f"gram_dtype must be a floating torch.dtype or None, got {dt!r}")

    def replace(self, **changes: Any) -> StepOptions:
        """A copy with ``changes`` (fields of this class; a TypeError names any other).

        Example:
            >>> StepOptions().replace(damping=0.1).damping
            0.1
        """
        if not changes:
            return self
        unknown = sorted(set(changes) - set(FIELDS))
        if unknown:
            raise TypeError(
                f"unknown step settings {unknown}: the settings are StepOptions' fields "
                f"{sorted(FIELDS)}"
            )
        return dataclasses.replace(self, **changes)

    def stage_settings(self, compute_method: str, step: int) -> StageSettings:
        """The preconditioning stage's settings at ``step`` for a state of
        ``compute_method``: the damping then, and the checked eigenbasis moments and
        orthogonalized step.

        Example:
            >>> s = StepOptions(damping=0.01, eigenbasis_moments=True).stage_settings("eigen", 0)
            >>> s.damping, s.basis_moments is not None, s.orthogonal
            (0.01, True, None)
        """
        return StageSettings(
            self.damping_at(step),
            step,
            self.nonfinite,
            self.sync_free,
            self.basis_settings(compute_method),
            self.orthogonal_settings(compute_method),
        )

    def basis_settings(self, compute_method: str) -> BasisMoments | None:
        """The eigenbasis moments of this step for a state of ``compute_method``, checked
        (None: not used)."""
        if not self.eigenbasis_moments:
            return None
        moments = BasisMoments(self.moment_beta2, self.moment_eps, self.moment_beta1)
        return moments.check(compute_method)

    def orthogonal_settings(self, compute_method: str) -> Orthogonal | None:
        """The orthogonalized step's settings for a state of ``compute_method``, checked
        (None: not used).

        Example:
            >>> StepOptions(orthogonal=True).orthogonal_settings("eigen").powers
            (0.5, 0.0)
        """
        if not self.orthogonal:
            return None
        powers = (
            tuple(self.ortho_powers) if isinstance(self.ortho_powers, list) else self.ortho_powers
        )
        settings = Orthogonal(
            powers,  # type: ignore[arg-type]
            self.ortho_damping,
            self.ortho_beta,
            self.ortho_steps,
            self.ortho_skip,
            self.ortho_dtype,
            self.ortho_wider_than,
            every=self.ortho_every,
        )
        return settings.check(compute_method)

    def at(self, step: int) -> StepOptions:
        """These options with every hyperparameter evaluated at ``step`` and checked (a
        ValueError names a bad value): what a compiled step is handed, whose own checks
        are skipped while compiling.

        Example:
            >>> opts = StepOptions(lr=lambda k: 0.1 / k, update_inverses=lambda k: k % 5 == 0)
            >>> opts.at(10).lr, opts.at(10).update_inverses, opts.at(11).update_inverses
            (0.01, True, False)
        """
        values: dict[str, Any] = {}
        for name, (ok, expected) in HYPER_CHECKS.items():
            value = getattr(self, name)
            if value is None or isinstance(value, torch.Tensor):
                continue
            value = resolve(value, step)
            check_hyper(name, value, ok, expected)
            values[name] = value
        for name in ("update_factors", "update_inverses"):
            values[name] = bool(resolve(getattr(self, name), step))
        return dataclasses.replace(self, **values)

    def settings(self) -> dict[str, Any]:
        """``{field: value}``: these options as the keywords of a step function.

        Example:
            >>> StepOptions(lr=0.5).settings()["lr"]
            0.5
        """
        return {name: getattr(self, name) for name in FIELDS}

    def decay_at(self, step: int) -> float:
        """The factor decay at ``step`` (checked: in [0, 1]).

        Example:
            >>> StepOptions(factor_decay=lambda k: 1 - 1 / (k + 1)).decay_at(3)
            0.75
        """
        return resolve_checked("factor_decay", self.factor_decay, step)

    def damping_at(self, step: int) -> float:
        """The damping of a step that decomposes, at ``step`` (checked)."""
        damping = DEFAULT_DAMPING if self.damping is None else self.damping
        return resolve_checked("damping", damping, step)


FIELDS = tuple(f.name for f in dataclasses.fields(StepOptions))


def step_options(options: StepOptions | None, settings: Mapping[str, Any]) -> StepOptions:
    """``options`` (the defaults when None) with the keyword ``settings`` of a call
    applied: how the step functions read their settings.

    Example:
        >>> step_options(None, {"damping": 0.1}).damping
        0.1
        >>> step_options(StepOptions(lr=0.2), {"dampnig": 0.1})  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        TypeError: unknown step settings ['dampnig']: the settings are StepOptions' fields [...]
    """
    if options is None:
        if torch.compiler.is_compiling():
            return StepOptions(**settings)
        return StepOptions().replace(**settings)
    if not isinstance(options, StepOptions):
        raise TypeError(f"options must be a kfac_func.StepOptions, got {options!r}")
    return options.replace(**settings)
