"""`Settings`: the preconditioners' arguments that kfac-pytorch does not have, as one value.

:class:`~kfac_func.KFACPreconditioner` takes kfac-pytorch 0.4.2's arguments by name, with
its defaults, and everything this library adds (the factors' scaling, Adam's step in
K-FAC's eigenbasis, Muon's step, steps without host synchronisation, ...) as one
frozen :class:`Settings` value, ``settings=``, as Distributed Shampoo's optimizer takes its
config objects::

    pre = kf.KFACPreconditioner(model, damping=1e-2, settings=kf.Settings(scaling="fisher"))

A setting given as a keyword of its own (``scaling="fisher"``), as before, still works for
one release: :func:`settings_from_keywords` moves it into the value with a
``DeprecationWarning`` naming the keyword and its replacement; a setting given both ways
is a ValueError. The model-parallel preconditioners take the settings that apply to them
(:data:`PARALLEL_SETTINGS`).
"""

from __future__ import annotations

import dataclasses
import sys
import warnings
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from kfac_func.adapter.adaptive import AdaptiveStepper
from kfac_func.blocks.mapped import KindMap
from kfac_func.captures import check_loss_divisor
from kfac_func.core.conventions import CONVENTIONS, convention_argument
from kfac_func.distributed.communicator import AllreduceMethod
from kfac_func.step.basis import BasisMoments
from kfac_func.step.orthogonal import Orthogonal

__all__ = ["PARALLEL_SETTINGS", "SETTINGS", "Settings", "settings_from_keywords"]

_FLAGS = ("eigenbasis_moments", "batched_eigh", "sync_free", "compile")


@dataclass(frozen=True)
class Settings:
    """What a preconditioner does beyond kfac-pytorch's arguments; every field's default
    is kfac-pytorch's behaviour (or, for ``grouped``, the same numbers to rounding).

    Attributes:
        scaling: the factors' convention: ``"kfac-pytorch"`` (hyperparameters carry over
            from kfac-pytorch) or ``"fisher"`` (the per-example Fisher, for new models);
            see :mod:`kfac_func.core.conventions`.
        loss_reduction: ``"mean"`` or ``"sum"``, how the loss reduces the batch.
        loss_divisor: what the loss was divided by besides (``k`` for ``loss / k`` over
            ``k`` accumulated micro-batches); None: 1 (the GPT-NeoX preconditioner's:
            ``accumulation_steps``).
        kinds: ``{module class: kind}`` (or ``{cls: (kind, {"eps": ...})}``) for the
            model's own classes that compute a registered kind, e.g. ``{LlamaRMSNorm:
            "rms_norm"}`` (see :func:`kfac_func.register`); each mapped module's first
            call is checked against the kind's computation.
        max_factor_dim: factor sides wider than this keep only their diagonal.
        kfac_approx: ``"expand"`` or ``"reduce"`` for weight-sharing layers, or
            ``{regex: approx}`` (see :func:`kfac_func.register`).
        gram_dtype: the dtype of the operands of the statistics' Gram products, summed
            into the factors in at least float32 (see :class:`kfac_func.StepOptions`):
            None, the factors' (exact); ``torch.bfloat16`` where the hardware multiplies
            it natively (half the cost or less; the activations of an autocast region are
            then used as they are).
        eigenbasis_moments: Adam's step in K-FAC's eigenbasis (see :func:`kfac_func.update`).
        moment_beta1: the eigenbasis moments' ``β₁`` (0: no first moment).
        moment_beta2, moment_eps: the eigenbasis moments' ``β₂`` and ``ε``.
        orthogonal: a :class:`~kfac_func.Orthogonal`: Muon's step on K-FAC's curvature
            for the layers holding one weight matrix; the others take Adam's step in
            K-FAC's eigenbasis under ``eigenbasis_moments``, else are not registered (see
            :func:`~kfac_func.step.orthogonal.orthogonal_table`). None: K-FAC's step.
        adaptive: an :class:`~kfac_func.adapter.AdaptiveStepper` of the model (one
            process, plain parameters, ``kl_clip=None``): ``step()`` then updates the
            parameters itself.
        eigenbasis_refresh: ``"eigh"``, or ``"qr"`` (one warm-started QR iteration per
            refresh after the first; see :func:`kfac_func.core.decomposition.refresh_eigh`).
        batched_eigh: decompose factors of equal shape, dtype and device with one stacked
            ``eigh`` call per group.
        grouped: on one process, compute the layers of one shape together (see
            :func:`kfac_func.update`; transient memory: about the largest group's factors).
            None: where the factors are on an accelerator, not on a CPU.
        sync_free: step without reading the device on the host (finiteness decided by
            ``torch.where``; skipped layers and factor updates counted in the state and
            reported by ``report_skipped()``); see :mod:`kfac_func.step.sync_free`.
        compile: with ``sync_free=True`` on one process, run every step (factor,
            decomposition and precondition-only steps) through
            ``torch.compile(fullgraph=True)``.
        allreduce_method: ``ALLREDUCE_BUCKETED`` or ``ALLREDUCE`` (an
            :class:`~kfac_func.distributed.AllreduceMethod` or its name); None:
            ``ALLREDUCE`` iff ``allreduce_bucket_cap_mb`` is 0.
        collective_timeout: a ``timedelta`` bounding each collective (None: the group's).

    Raises:
        ValueError: a setting out of range, named (checks that need the compute method or
            the model are the preconditioner's).
        TypeError: a flag that is not a bool, or an ``orthogonal`` or ``adaptive`` of
            another type.

    Example:
        >>> import kfac_func as kf
        >>> s = kf.Settings(scaling="fisher", eigenbasis_moments=True, moment_beta2=0.95)
        >>> s.replace(sync_free=True).sync_free, s.moment_beta2
        (True, 0.95)
        >>> kf.Settings(loss_reduction="max")
        Traceback (most recent call last):
        ...
        ValueError: loss_reduction must be 'mean' or 'sum', got 'max'
    """

    scaling: str = "kfac-pytorch"
    loss_reduction: str = "mean"
    loss_divisor: float | None = None
    kinds: KindMap | None = None
    max_factor_dim: int | None = None
    kfac_approx: str | Mapping[str, str] = "expand"
    gram_dtype: torch.dtype | None = None
    eigenbasis_moments: bool = False
    moment_beta1: float = 0.0
    moment_beta2: float = 0.999
    moment_eps: float = 1e-8
    orthogonal: Orthogonal | None = None
    adaptive: AdaptiveStepper | None = None
    eigenbasis_refresh: str = "eigh"
    batched_eigh: bool = False
    grouped: bool | None = None
    sync_free: bool = False
    compile: bool = False
    allreduce_method: AllreduceMethod | str | None = None
    collective_timeout: timedelta | None = None

    def __post_init__(self) -> None:
        for name in _FLAGS:
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.grouped is not None and not isinstance(self.grouped, bool):
            raise TypeError(f"grouped must be a bool or None, got {self.grouped!r}")
        if self.compile and not self.sync_free:
            raise ValueError(
                "compile=True compiles each step as one graph, which needs the checks on "
                "the device: pass sync_free=True as well"
            )
        if self.scaling not in CONVENTIONS:
            raise ValueError(f"scaling must be one of {CONVENTIONS}, got {self.scaling!r}")
        if self.loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {self.loss_reduction!r}")
        if self.loss_divisor is not None:
            check_loss_divisor(self.loss_divisor)
        gram = self.gram_dtype
        if gram is not None and not (isinstance(gram, torch.dtype) and gram.is_floating_point):
            raise ValueError(f"gram_dtype must be a floating torch.dtype or None, got {gram!r}")
        if self.eigenbasis_moments:
            BasisMoments(self.moment_beta2, self.moment_eps, self.moment_beta1).check("eigen")
        if self.orthogonal is not None and not isinstance(self.orthogonal, Orthogonal):
            raise TypeError(f"orthogonal must be a kfac_func.Orthogonal, got {self.orthogonal!r}")
        if self.adaptive is not None and not isinstance(self.adaptive, AdaptiveStepper):
            raise TypeError(
                "adaptive must be a kfac_func.adapter.AdaptiveStepper or None, "
                f"got {self.adaptive!r}"
            )
        timeout = self.collective_timeout
        if timeout is not None and not (isinstance(timeout, timedelta) and timeout > timedelta()):
            raise ValueError(
                f"collective_timeout must be a positive datetime.timedelta or None, got {timeout!r}"
            )

    def replace(self, **changes: Any) -> Settings:
        """A copy with ``changes`` (fields of this class), checked again.

        Example:
            >>> Settings().replace(grouped=False).grouped
            False
        """
        return dataclasses.replace(self, **changes)

    def named(self) -> set[str]:
        """The fields that differ from their defaults.

        Example:
            >>> sorted(Settings(scaling="fisher", grouped=None).named())
            ['scaling']
        """
        return {k for k, v in _DEFAULTS.items() if getattr(self, k) != v}


SETTINGS = tuple(f.name for f in dataclasses.fields(Settings))
"""The fields of :class:`Settings`: the keywords :func:`settings_from_keywords` moves."""
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Settings)}

PARALLEL_SETTINGS = ("scaling", "loss_reduction", "loss_divisor", "kinds", "gram_dtype")
"""The settings the model-parallel preconditioners take
(:class:`~kfac_func.parallel.ParallelKFACPreconditioner`,
:class:`~kfac_func.parallel.GPTNeoXKFACPreconditioner`)."""


def settings_from_keywords(
    given: dict[str, Any],
    owner: str,
    takes: Collection[str] = SETTINGS,
    *,
    base: Settings | None = None,
    warn: bool = True,
) -> Settings:
    """Take ``settings=`` and the settings given as keywords of their own out of
    ``given``, a constructor's keyword arguments (``owner`` names the class), and return
    them as one :class:`Settings`: ``settings=`` (else ``base``, else the defaults) with
    the keywords' fields replaced. The keywords are those of the fields in ``takes`` (and
    ``convention=``, ``scaling``'s alias); with ``warn`` each is deprecated and warns,
    naming itself and its replacement, attributed to the first caller outside kfac_func
    (once the settings are checked: a refused call warns about nothing). Other keywords
    stay in ``given``.

    Raises:
        ValueError: a setting given both as a keyword and (other than its default) in
            ``settings=``, ``scaling`` and ``convention`` given different values, a
            ``settings=`` value with fields ``owner`` does not take, or a setting out of
            range (:class:`Settings`' own checks).
        TypeError: ``settings=`` that is not a :class:`Settings`.

    Example:
        >>> import warnings
        >>> given = {"damping": 0.1, "scaling": "fisher"}
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     s = settings_from_keywords(given, "Demo")
        >>> s.scaling, given, str(caught[0].message).split(";")[0]
        ('fisher', {'damping': 0.1}, 'Demo(scaling=...) is deprecated')
        >>> settings_from_keywords({"grouped": False, "settings": Settings(grouped=False)}, "Demo")
        Traceback (most recent call last):
        ...
        ValueError: Demo: ['grouped'] given both as keywords and in settings=; give each once
    """
    user = given.pop("settings", None)
    if user is not None and not isinstance(user, Settings):
        raise TypeError(f"{owner}: settings must be a kfac_func.Settings, got {user!r}")
    start = user if user is not None else base if base is not None else Settings()
    chosen = set() if user is None else user.named()
    refused = sorted(chosen - set(takes))
    if refused:
        raise ValueError(f"{owner} does not take the settings {refused} (it takes {list(takes)})")
    names = [k for k in given if k in takes or (k == "convention" and "scaling" in takes)]
    old = {k: given.pop(k) for k in names}
    if "scaling" in old or "convention" in old:
        alias = old.pop("convention", None)
        scaling = convention_argument(alias, old.pop("scaling", None), default="")
        if scaling:
            old["scaling"] = scaling
    both = sorted(set(old) & chosen)
    if both:
        raise ValueError(f"{owner}: {both} given both as keywords and in settings=; give each once")
    settings = start.replace(**old) if old else start  # checked: a refused call warns nothing
    for k in names if warn else ():
        field = "scaling" if k == "convention" else k
        warnings.warn(
            f"{owner}({k}=...) is deprecated; pass settings=kf.Settings({field}=...) instead "
            "(the keyword will be removed in a future release)",
            DeprecationWarning,
            stacklevel=_outside_kfac_func(),
        )
    return settings


def _outside_kfac_func() -> int:
    """The ``stacklevel`` that attributes a warning issued by this function's caller to
    the first frame outside kfac_func (the user's call)."""
    frame, level = sys._getframe(2), 2
    while frame.f_back is not None and frame.f_globals.get("__name__", "").startswith("kfac_func"):
        frame, level = frame.f_back, level + 1
    return level
