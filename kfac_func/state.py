"""Immutable K-FAC state pytrees.

``KFACState(step, layers={name: LayerState}, config)`` is a frozen dataclass registered
with optree and with torch's pytree registry. Tensors (factors, decompositions) are the
children; counters, layer specs and the configuration are static metadata, so
``optree.tree_map(lambda t: t.to(device), state)`` touches tensors only. The optional
``KFACState.adaptive`` (:class:`AdaptiveState`) holds the damping and the previous update
of the adaptive step (:mod:`kfac_func.step.adaptive`). Nothing in the
library mutates a state: every transition builds a new one. The one exception is asked
for by name: a state donated to :func:`kfac_func.update` (``donate=True``) has its
``layers`` dict updated in place, so that the step frees each layer's old tensors as soon
as their replacements exist (the donated state must not be used afterwards).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar

import torch

from kfac_func.blocks import LayerSpec
from kfac_func.blocks.table import no_layers_error
from kfac_func.core.conventions import (
    Convention,
    check_convention,
    convention_argument,
    initial_factor,
)
from kfac_func.core.decomposition import COMPUTE_METHODS, EIGENBASIS_REFRESH, Decomposition
from kfac_func.core.orthogonal import FactorPowers
from kfac_func.core.pytree import register_dataclass

__all__ = [
    "MOMENT_FIELDS",
    "AdaptiveRecord",
    "AdaptiveState",
    "KFACConfig",
    "KFACState",
    "LayerState",
    "init",
]


@dataclass(frozen=True)
class KFACConfig:
    """Choices fixed for the life of a state (they decide its structure and meaning).

    Attributes:
        convention: ``"fisher"`` or ``"kfac-pytorch"`` (see :mod:`kfac_func.core.conventions`).
        compute_method: ``"eigen"``, ``"inverse"`` or ``"ekfac"`` (K-FAC's eigenbasis with
            corrected eigenvalues, see :mod:`kfac_func.core.ekfac`; ``"fisher"`` only).
        compute_eigenvalue_outer_product: eigen only: precompute ``1/(dg daᵀ + λ)`` when
            decomposing (λ then stays fixed until the next decomposition); never for
            layers with a diagonal factor.
        factor_dtype: dtype factors accumulate in (inputs of lower precision are cast up).
        inv_dtype: dtype decompositions are stored in.
        eigenbasis_refresh: eigen only: ``"eigh"`` recomputes the eigendecompositions
            exactly; ``"qr"`` refreshes the previous eigenbasis with one warm-started
            power (QR) iteration (see :func:`kfac_func.core.decomposition.refresh_eigh`), far
            cheaper than eigh, approximate, converging over successive refreshes.
    """

    convention: Convention = "fisher"
    compute_method: str = "eigen"
    compute_eigenvalue_outer_product: bool = True
    factor_dtype: torch.dtype = torch.float32
    inv_dtype: torch.dtype = torch.float32
    eigenbasis_refresh: str = "eigh"

    def __post_init__(self) -> None:
        check_convention(self.convention)
        if self.eigenbasis_refresh not in EIGENBASIS_REFRESH:
            raise ValueError(
                f"eigenbasis_refresh must be one of {EIGENBASIS_REFRESH}, "
                f"got {self.eigenbasis_refresh!r}"
            )
        if self.compute_method not in COMPUTE_METHODS:
            raise ValueError(
                f"compute_method must be one of {COMPUTE_METHODS}, got {self.compute_method!r}"
            )
        if self.compute_method == "ekfac" and self.convention != "fisher":
            raise ValueError(
                "compute_method='ekfac' corrects the eigenvalues with per-example gradients, "
                "which the 'fisher' convention defines: use convention='fisher' "
                "(scaling='fisher' in the preconditioners)"
            )
        for name in ("factor_dtype", "inv_dtype"):
            dt = getattr(self, name)
            if not isinstance(dt, torch.dtype) or not dt.is_floating_point:
                raise ValueError(f"{name} must be a floating torch.dtype, got {dt!r}")


MOMENT_FIELDS = ("basis_moment", "basis_momentum", "ortho_momentum")
"""The running moments a :class:`LayerState` may hold, each of its gradient matrix's
shape."""


@dataclass(frozen=True)
class LayerState:
    """Per-layer state: running-average factors and their latest decomposition.

    Attributes:
        a_factor, g_factor: running averages of A and G (``spec.factor_shapes``).
        decomposition: :class:`EigenDecomposition`, :class:`InverseDecomposition`, or
            ``None`` before the first one (the layer's gradient then passes unchanged).
        spec: the layer (static).
        factor_updates: number of batch factors averaged in so far (static).
        skipped_updates: factor updates skipped because of non-finite values (static).
        decomposition_failures: decompositions that failed even after the retries of
            :func:`kfac_func.core.decomposition.eigh_factor`, each time keeping the previous
            decomposition (static).
        basis_moment: the running second moment of the layer's gradient in its
            eigenbasis (``update(..., eigenbasis_moments=True)``, see
            :mod:`kfac_func.core.basis_moments`), or None.
        basis_momentum: the running first moment of the layer's gradient kept by
            eigenbasis moments with ``moment_beta1 > 0``, in the eigenbasis (rotated
            exactly into each new one), or None.
        ortho_momentum: the momentum of the layer's gradient kept by orthogonalized steps
            (``update(..., orthogonal=True)``, see :mod:`kfac_func.step.orthogonal`), in
            the layer's own coordinates, or None: it also marks the layers taking them.
        ortho_power: the damped factor powers of those layers
            (:class:`~kfac_func.core.orthogonal.FactorPowers`), computed from each new
            decomposition; derived, so not checkpointed (recomputed at the next step).
        moment_count: how many gradients ``basis_moment`` holds (static; its bias
            correction).
        grad_skips: the steps whose gradient of this layer was non-finite and passed
            unchanged under ``sync_free=True`` (see :func:`kfac_func.update`): a 0-d
            int64 tensor on the layer's device, counted without reading it on the host;
            None before the first such step.
        grad_skips_reported: how many of ``grad_skips`` were already warned about
            (static; see :func:`kfac_func.step.report_skipped`).
        factor_skips: the factor updates of ``sync_free=True`` steps whose batch factors
            held NaN/Inf (the layer kept its factors), not reported yet: a 0-d int64
            tensor, counted in ``factor_updates`` until :func:`kfac_func.step.report_skipped`
            moves them to ``skipped_updates``; None before the first such step.
        usable: whether ``decomposition`` is applied, decided on the device by
            ``sync_free=True`` decomposition steps (a 0-d bool tensor: False while the
            factors hold no data or no decomposition came out finite); None: whenever
            there is a decomposition.
    """

    a_factor: torch.Tensor
    g_factor: torch.Tensor
    decomposition: Decomposition | None
    spec: LayerSpec
    factor_updates: int = 0
    skipped_updates: int = 0
    decomposition_failures: int = 0
    basis_moment: torch.Tensor | None = None
    basis_momentum: torch.Tensor | None = None
    ortho_momentum: torch.Tensor | None = None
    ortho_power: FactorPowers | None = None
    moment_count: int = 0
    grad_skips: torch.Tensor | None = None
    grad_skips_reported: int = 0
    factor_skips: torch.Tensor | None = None
    usable: torch.Tensor | None = None

    def replace(self, **changes: object) -> LayerState:
        """A copy with ``changes`` applied (fields of this class; a TypeError names any
        other). The class checks nothing on construction, so the copy is made directly,
        without the constructor call of ``dataclasses.replace``: a step replaces each
        layer's state a few times.

        Example:
            >>> import kfac_func as kf
            >>> ls = kf.init(kf.register(torch.nn.Linear(2, 1))).layers[""]
            >>> ls.replace(factor_updates=3).factor_updates, ls.factor_updates
            (3, 0)
        """
        return _copy_with(self, changes, _LAYER_FIELDS)


_LAYER_FIELDS = frozenset(f.name for f in dataclasses.fields(LayerState))


_T = TypeVar("_T")


def _copy_with(obj: _T, changes: Mapping[str, object], names: frozenset[str]) -> _T:
    """A copy of a frozen dataclass instance that checks nothing on construction, with
    ``changes`` (fields among ``names``; a TypeError names any other) applied."""
    unknown = changes.keys() - names
    if unknown:
        raise TypeError(f"{type(obj).__name__} has no fields {sorted(unknown)}")
    new = object.__new__(type(obj))
    new.__dict__.update(obj.__dict__)
    new.__dict__.update(changes)
    return new


class AdaptiveRecord(NamedTuple):
    """One adaptive step as :attr:`AdaptiveState.history` keeps it."""

    steps: int
    """The value of :attr:`AdaptiveState.steps` after that step."""
    damping: float
    """The damping after the step's adaptation (if any)."""
    alpha: float
    mu: float
    predicted: float
    rho: float | None


@dataclass(frozen=True)
class AdaptiveState:
    """The adaptive part of a state: damping, previous update and the last quadratic model.

    See :mod:`kfac_func.step.adaptive` (``init_adaptive``, ``adaptive_step``,
    ``adapt_damping``). Only ``previous`` holds tensors; the rest is static metadata.

    Attributes:
        damping: the current damping λ (Levenberg–Marquardt adapted).
        previous: the update ``x`` applied at the last step (``θ ← θ + x``), keyed like the
            parameters, or None before the first step.
        steps: number of adaptive steps taken.
        alpha, mu: the last step's coefficients of ``−Δ`` and of the previous update.
        predicted: the last step's change of the quadratic model (≤ 0), or None.
        rho: the last reduction ratio (actual / predicted change), or None.
        history: the latest steps, oldest first (a bounded number of them).
    """

    damping: float
    previous: dict[str, torch.Tensor] | None = None
    steps: int = 0
    alpha: float | None = None
    mu: float | None = None
    predicted: float | None = None
    rho: float | None = None
    history: tuple[AdaptiveRecord, ...] = ()

    def replace(self, **changes: object) -> AdaptiveState:
        """A copy with ``changes`` applied."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    @classmethod
    def restored(
        cls, fields: Mapping[str, Any], previous: dict[str, torch.Tensor] | None
    ) -> AdaptiveState:
        """The state that saved ``fields`` (numbers, None where unset, ``history`` as
        sequences of an :class:`AdaptiveRecord`'s fields), with the tensors ``previous``.

        Example:
            >>> saved = {"damping": 0.1, "steps": 1, "history": [[1, 0.1, 1, 0, -2, None]]}
            >>> AdaptiveState.restored(saved, None).history
            (AdaptiveRecord(steps=1, damping=0.1, alpha=1.0, mu=0.0, predicted=-2.0, rho=None),)
        """

        def number(v: Any) -> float | None:
            return None if v is None else float(v)

        return cls(
            damping=float(fields["damping"]),
            previous=previous,
            steps=int(fields.get("steps", 0)),
            alpha=number(fields.get("alpha")),
            mu=number(fields.get("mu")),
            predicted=number(fields.get("predicted")),
            rho=number(fields.get("rho")),
            history=tuple(
                AdaptiveRecord(
                    int(r[0]), float(r[1]), float(r[2]), float(r[3]), float(r[4]), number(r[5])
                )
                for r in fields.get("history", ())
            ),
        )


@dataclass(frozen=True)
class KFACState:
    """The whole K-FAC state: a step counter, per-layer states and the configuration.

    ``step`` counts calls of :func:`kfac_func.update`; hyperparameter callables receive it.
    ``adaptive`` is the state of the adaptive step (:class:`AdaptiveState`), or None.
    """

    layers: dict[str, LayerState]
    step: int = 0
    config: KFACConfig = field(default_factory=KFACConfig)
    adaptive: AdaptiveState | None = None

    def replace(self, **changes: object) -> KFACState:
        """A copy with ``changes`` applied (fields of this class; a TypeError names any
        other), made as :meth:`LayerState.replace` makes its copies.

        Example:
            >>> import kfac_func as kf
            >>> kf.init(kf.register(torch.nn.Linear(2, 1))).replace(step=4).step
            4
        """
        return _copy_with(self, changes, _STATE_FIELDS)


_STATE_FIELDS = frozenset(f.name for f in dataclasses.fields(KFACState))


register_dataclass(
    LayerState,
    data=(
        "a_factor",
        "g_factor",
        "decomposition",
        *MOMENT_FIELDS,
        "ortho_power",
        "grad_skips",
        "factor_skips",
        "usable",
    ),
    static=(
        "spec",
        "factor_updates",
        "skipped_updates",
        "decomposition_failures",
        "moment_count",
        "grad_skips_reported",
    ),
)
register_dataclass(
    AdaptiveState,
    data=("previous",),
    static=("damping", "steps", "alpha", "mu", "predicted", "rho", "history"),
)
register_dataclass(KFACState, data=("layers", "adaptive"), static=("step", "config"))


def init(
    layers: Mapping[str, LayerSpec],
    *,
    convention: Convention | None = None,
    compute_method: str = "eigen",
    compute_eigenvalue_outer_product: bool = True,
    factor_dtype: torch.dtype = torch.float32,
    inv_dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    eigenbasis_refresh: str = "eigh",
    allow_empty: bool = False,
    scaling: Convention | None = None,
) -> KFACState:
    """A fresh state for ``layers`` (as returned by :func:`kfac_func.register`).

    ``convention`` is ``"fisher"`` (the default) or ``"kfac-pytorch"`` (see
    :mod:`kfac_func.core.conventions`); ``scaling`` is an alias of it (the preconditioners'
    name for the same setting; both given and different: a ValueError).

    Factors start at the convention's initial value (zeros that the first update replaces
    for ``"fisher"``, the identity for ``"kfac-pytorch"``); there is no decomposition yet.

    Raises:
        ValueError: ``layers`` is empty (no layer of the model can be preconditioned; the
            message names the model's class and shows the table of skipped modules),
            unless ``allow_empty`` (a pipeline stage may hold no preconditioned layer).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import kfac_func as kf
        >>> state = kf.init(kf.register(nn.Linear(3, 2)), factor_dtype=torch.float64)
        >>> state.layers[""].a_factor.shape, state.step
        (torch.Size([4, 4]), 0)
    """
    convention = check_convention(convention_argument(convention, scaling, default="fisher"))
    if not layers and not allow_empty:
        raise no_layers_error(layers)
    config = KFACConfig(
        convention,
        compute_method,
        compute_eigenvalue_outer_product,
        factor_dtype,
        inv_dtype,
        eigenbasis_refresh,
    )
    dev = torch.device(device) if device is not None else None
    states = {}
    for name, spec in layers.items():
        a_shape, g_shape = spec.factor_shapes
        states[name] = LayerState(
            a_factor=initial_factor(
                convention,
                a_shape,
                factor_dtype,
                dev,
                spec.a_diagonal,
                width=spec.a_dim if spec.a_blocks > 1 else None,
            ),
            g_factor=initial_factor(convention, g_shape, factor_dtype, dev, spec.g_diagonal),
            decomposition=None,
            spec=spec,
        )
    return KFACState(layers=states, step=0, config=config)
