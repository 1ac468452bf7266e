"""kfac-pytorch's preconditioner arguments, described once for every preconditioner class.

:class:`SharedArguments` lists the keyword arguments that
:class:`~kfac_func.adapter.preconditioner.KFACPreconditioner`,
:class:`~kfac_func.parallel.preconditioner.ParallelKFACPreconditioner` and
:class:`~kfac_func.parallel.gpt_neox.GPTNeoXKFACPreconditioner` share (their names, types
and documentation): kfac-pytorch's, and ``settings=`` (:class:`~kfac_func.Settings`, the
rest); :data:`KFAC_PYTORCH_DEFAULTS` gives their defaults. Each constructor takes
them as ``**shared: Unpack[SharedArguments]`` (what type checkers read), shows them in its
signature with :func:`shares_arguments` (what ``inspect.signature`` and ``help`` read),
and hands them to :meth:`KFACArguments._set_arguments`, which checks them (numbers may
also be ``step -> value`` callables) and stores them, and the settings every class reads,
as attributes. ``HYPER`` names the hyperparameters that are saved in state dicts and
printed.
"""

from __future__ import annotations

import enum
import inspect
import logging
from collections.abc import Callable, Mapping
from typing import Any, TypedDict, TypeVar

import torch
from torch import nn

from kfac_func.adapter.settings import SETTINGS, Settings, settings_from_keywords
from kfac_func.blocks import LayerSpec
from kfac_func.distributed.communicator import AllreduceMethod
from kfac_func.distributed.plan import AssignmentStrategy
from kfac_func.state import KFACState, init

__all__ = [
    "HYPER",
    "KFAC_PYTORCH_DEFAULTS",
    "ComputeMethod",
    "FloatOrFn",
    "IntOrFn",
    "KFACArguments",
    "PreconditionerBase",
    "SharedArguments",
    "check_bucket_cap",
    "log_registered",
    "parse_enum",
    "shares_arguments",
]

IntOrFn = int | Callable[[int], int]
FloatOrFn = float | Callable[[int], float]
Init = TypeVar("Init", bound=Callable[..., None])

HYPER = (
    "factor_update_steps",
    "inv_update_steps",
    "damping",
    "factor_decay",
    "kl_clip",
    "lr",
)
"""The hyperparameters a state dict saves (when not callables) and ``repr`` shows."""


class ComputeMethod(enum.Enum):
    """How the curvature is inverted: eigendecomposition, damped inverses, or EKFAC
    (the eigenbasis with corrected eigenvalues; ``scaling="fisher"``)."""

    EIGEN = 1
    INVERSE = 2
    EKFAC = 3


def parse_enum(cls: type[enum.Enum], value: Any, arg: str) -> Any:
    """``value`` as a member of ``cls``: a member, or its name in any case."""
    if isinstance(value, cls):
        return value
    if isinstance(value, str) and value.upper() in cls.__members__:
        return cls[value.upper()]
    names = ", ".join(m.lower() for m in cls.__members__)
    raise ValueError(f"{arg} must be one of {names} (or {cls.__name__}), got {value!r}")


def check_bucket_cap(cap: float) -> None:
    """A ValueError unless ``allreduce_bucket_cap_mb`` is >= 0 (0: one collective per tensor).

    Example:
        >>> check_bucket_cap(-1)
        Traceback (most recent call last):
        ...
        ValueError: allreduce_bucket_cap_mb must be >= 0, got -1
    """
    if cap < 0:
        raise ValueError(f"allreduce_bucket_cap_mb must be >= 0, got {cap!r}")


def log_registered(
    level: int,
    model: nn.Module,
    layers: Mapping[str, LayerSpec],
    plan: object,
    where: str = "",
    title: str = "K-FAC registered layers",
) -> None:
    """Log to the ``"kfac_func"`` logger at ``level``: one line per registered layer,
    ``Registered name="fc1": ...`` (``where`` appended, e.g. the pipeline stage), then the
    layer table under ``title``, then the ``plan``'s assignments.

    Example:
        >>> from kfac_func.blocks import register
        >>> model = nn.Sequential(nn.Linear(3, 2))
        >>> seen = []
        >>> class Keep(logging.Handler):
        ...     def emit(self, record: logging.LogRecord) -> None:
        ...         seen.append(record.getMessage())
        >>> log, keep = logging.getLogger("kfac_func"), Keep()
        >>> log.addHandler(keep)
        >>> level = log.level
        >>> log.setLevel(logging.INFO)
        >>> log_registered(logging.INFO, model, register(model), "one rank")
        >>> log.removeHandler(keep)
        >>> log.setLevel(level)
        >>> for line in (seen[0], seen[-1]):
        ...     print(line)
        Registered name="0": Linear, linear, A 4x4, G 2x2
        K-FAC layer assignments: one rank
    """
    logger = logging.getLogger("kfac_func")
    for name, spec in layers.items():
        module = type(model.get_submodule(spec.module)).__name__
        sides = ("x".join(map(str, shape)) for shape in spec.factor_shapes)
        logger.log(
            level,
            'Registered name="%s": %s, %s, A %s, G %s%s',
            name,
            module,
            spec.kind,
            *sides,
            where,
        )
    logger.log(level, "%s:\n%s", title, layers)
    logger.log(level, "K-FAC layer assignments: %s", plan)


def _check_number(name: str, value: Any, ok: Callable[[float], bool], expected: str) -> None:
    """A TypeError unless ``value`` is a number (or a ``step -> value`` callable), a
    ValueError unless it is ``expected``; both name the argument and show the value."""
    if callable(value):
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"{name} must be a number ({expected}) or a step -> value callable, got "
            f"{value!r} of type {type(value).__name__}"
        )
    if not ok(value):
        raise ValueError(f"{name} must be {expected}, got {value!r}")


class SharedArguments(TypedDict, total=False):
    """The keyword arguments that :class:`~kfac_func.KFACPreconditioner`,
    :class:`~kfac_func.parallel.ParallelKFACPreconditioner` and
    :class:`~kfac_func.parallel.GPTNeoXKFACPreconditioner` share: kfac-pytorch 0.4.2's, with
    its defaults (:data:`KFAC_PYTORCH_DEFAULTS`, which a class may change where it says so),
    and ``settings``, everything else. Each hyperparameter may be a number or a
    ``step -> value`` callable.

    Attributes:
        factor_update_steps: collect statistics on steps ``k % factor_update_steps == 0``.
        inv_update_steps: recompute the decompositions every this many steps.
        damping: Tikhonov damping λ >= 0 (with ``adaptive=``, the starting λ).
        factor_decay: the factors' running-average coefficient, in [0, 1] (0: the latest
            batch factors only; 1: frozen factors; see
            :func:`kfac_func.step.exp_decay_factor_averaging`, whose first value is 0).
        kl_clip: bound of the scale ``min(1, sqrt(kl_clip / |lr² Σ P ⊙ grad|))`` of the
            preconditioned gradients (> 0); None disables it.
        lr: the learning rate in the ``kl_clip`` scale (only there: keep it the
            optimizer's, e.g. ``lambda k: optimizer.param_groups[0]["lr"]``).
        accumulation_steps: micro-batches (forward/backward passes) per optimizer step;
            a window's statistics form one factor update.
        allreduce_bucket_cap_mb: largest bucket (MB) of the factor all-reduces; 0: one
            collective per tensor.
        assignment_strategy: balance decompositions over ranks by ``COMPUTE`` (``n³``)
            or ``MEMORY`` (``n²``) cost (an
            :class:`~kfac_func.distributed.AssignmentStrategy` or name).
        compute_method: ``"eigen"``, ``"inverse"`` or ``"ekfac"`` (``scaling="fisher"``
            only), or a :class:`ComputeMethod`.
        compute_eigenvalue_outer_product: eigen: precompute ``1 / (dg daᵀ + λ)``; needs
            ``colocate_factors``.
        symmetry_aware: send only the upper triangle of symmetric factors.
        grad_scaler: a ``GradScaler`` or a ``() -> scale`` callable; the hooks unscale
            the output-gradients with it (call ``scaler.unscale_`` before ``step()``).
        factor_dtype: the factors' dtype (None: the weights' promoted to at least
            float32; kfac-pytorch uses the autocast dtype).
        inv_dtype: the dtype decompositions are stored in.
        skip_layers: regexes searched in module names and class names; matches are not
            registered.
        update_factors_in_hook: build each call's statistics in the hooks (and, on several
            ranks, start the factor all-reduces in the backward pass) instead of keeping
            the raw tensors until ``step()``; the results are the same.
        loglevel: the :mod:`logging` level of the construction report on the
            ``"kfac_func"`` logger: a ``Registered name="...": ...`` line per layer, the
            layer table and the layer assignments (DEBUG: silent unless shown).
        settings: a :class:`~kfac_func.Settings`, everything kfac-pytorch does not
            have (the factors' scaling, eigenbasis moments, ...); None: its defaults, which
            are kfac-pytorch's behaviour. Its fields given as keywords of their own still
            work, with a ``DeprecationWarning`` (see
            :func:`~kfac_func.adapter.settings.settings_from_keywords`).
    """

    factor_update_steps: IntOrFn
    inv_update_steps: IntOrFn
    damping: FloatOrFn
    factor_decay: FloatOrFn
    kl_clip: FloatOrFn | None
    lr: FloatOrFn
    accumulation_steps: int
    allreduce_bucket_cap_mb: float
    assignment_strategy: AssignmentStrategy | str
    compute_method: ComputeMethod | str
    compute_eigenvalue_outer_product: bool
    symmetry_aware: bool
    grad_scaler: Any
    factor_dtype: torch.dtype | None
    inv_dtype: torch.dtype
    skip_layers: list[str] | None
    update_factors_in_hook: bool
    loglevel: int
    settings: Settings | None


KFAC_PYTORCH_DEFAULTS: SharedArguments = {
    "factor_update_steps": 1,
    "inv_update_steps": 1,
    "damping": 0.001,
    "factor_decay": 0.95,
    "kl_clip": 0.001,
    "lr": 0.1,
    "accumulation_steps": 1,
    "allreduce_bucket_cap_mb": 25.0,
    "assignment_strategy": AssignmentStrategy.COMPUTE,
    "compute_method": ComputeMethod.EIGEN,
    "compute_eigenvalue_outer_product": True,
    "symmetry_aware": False,
    "grad_scaler": None,
    "factor_dtype": None,
    "inv_dtype": torch.float32,
    "skip_layers": None,
    "update_factors_in_hook": True,
    "loglevel": logging.DEBUG,
    "settings": None,
}
"""The defaults of :class:`SharedArguments`: kfac-pytorch 0.4.2's, and ours."""


def shares_arguments(
    defaults: Mapping[str, Any] | None = None, described: type = SharedArguments
) -> Callable[[Init], Init]:
    """A constructor taking ``**shared: Unpack[described]`` (:class:`SharedArguments`, or
    a TypedDict extending it) shows them in its signature (``inspect.signature``,
    ``help``): keyword-only, with the defaults of :data:`KFAC_PYTORCH_DEFAULTS` or, for
    the names in ``defaults``, the class's own (every name ``described`` adds needs one).

    Example:
        >>> class Demo(KFACArguments):
        ...     @shares_arguments({"damping": 0.5})
        ...     def __init__(self, model: nn.Module, **shared: Any) -> None:
        ...         self._set_arguments(model, shared, {"damping": 0.5})
        >>> inspect.signature(Demo).parameters["damping"]
        <Parameter "damping: 'FloatOrFn' = 0.5">
        >>> Demo(nn.Linear(2, 2), kl_clip=None).kl_clip is None
        True
    """
    chosen = {**KFAC_PYTORCH_DEFAULTS, **(defaults or {})}
    # the annotations as written (this module postpones them: ForwardRefs)
    kinds = {k: getattr(v, "__forward_arg__", v) for k, v in described.__annotations__.items()}

    def decorate(init: Init) -> Init:
        own = list(inspect.signature(init).parameters.values())
        keyword = inspect.Parameter.KEYWORD_ONLY
        shared = [
            inspect.Parameter(k, keyword, default=chosen[k], annotation=v) for k, v in kinds.items()
        ]
        keep = [p for p in own if p.kind is not inspect.Parameter.VAR_KEYWORD]
        init.__signature__ = inspect.Signature([*keep, *shared])  # type: ignore[attr-defined]
        return init

    return decorate


class KFACArguments:
    """kfac-pytorch's preconditioner arguments (:class:`SharedArguments`), validated and
    stored as attributes; shared by the preconditioner classes."""

    # the attributes' types are those _set_arguments stores
    def _set_arguments(
        self,
        model: nn.Module,
        given: SharedArguments,
        defaults: SharedArguments | None = None,
        takes: tuple[str, ...] = SETTINGS,
    ) -> SharedArguments:
        """Check and store the shared arguments ``given`` to the constructor, the others
        taking ``defaults`` (the class's own, as :func:`shares_arguments` shows them) or
        kfac-pytorch's, and the settings of ``settings=`` and of the deprecated keywords of
        the fields in ``takes`` (:func:`~kfac_func.adapter.settings.settings_from_keywords`,
        kept as :attr:`settings`); returns the shared arguments. A name that is neither is
        a TypeError naming the class, as Python's own."""
        owner = type(self).__name__
        settings = settings_from_keywords(given, owner, takes)  # type: ignore[arg-type]
        for name in given:
            if name not in SharedArguments.__annotations__:
                raise TypeError(f"{owner}() got an unexpected keyword argument {name!r}")
        a: SharedArguments = {**KFAC_PYTORCH_DEFAULTS, **(defaults or {}), **given}
        cap = a["allreduce_bucket_cap_mb"]
        check_bucket_cap(cap)
        reduce_method: AllreduceMethod = (
            AllreduceMethod.for_bucket_cap(cap)
            if settings.allreduce_method is None
            else parse_enum(AllreduceMethod, settings.allreduce_method, "allreduce_method")
        )
        if reduce_method is AllreduceMethod.ALLREDUCE_BUCKETED and cap == 0:
            raise ValueError(
                "allreduce_method=ALLREDUCE_BUCKETED needs allreduce_bucket_cap_mb > 0 "
                "(a cap of 0 means one collective per tensor: ALLREDUCE)"
            )
        method = parse_enum(ComputeMethod, a["compute_method"], "compute_method")
        strategy = parse_enum(AssignmentStrategy, a["assignment_strategy"], "assignment_strategy")
        for name, value in (
            ("factor_update_steps", a["factor_update_steps"]),
            ("inv_update_steps", a["inv_update_steps"]),
            ("accumulation_steps", a["accumulation_steps"]),
        ):
            _check_number(name, value, lambda v: int(v) == v and v > 0, "a positive int")
        _check_number("damping", a["damping"], lambda v: v >= 0, ">= 0")
        # [0, 1] as in kfac_func.update: 0 keeps only the latest batch factors (the first
        # value exp_decay_factor_averaging gives), 1 freezes the factors
        _check_number("factor_decay", a["factor_decay"], lambda v: 0 <= v <= 1, "in [0, 1]")
        _check_number("lr", a["lr"], lambda v: v >= 0, ">= 0")
        if a["kl_clip"] is not None:
            _check_number("kl_clip", a["kl_clip"], lambda v: v > 0, "> 0 (or None to disable)")

        self.model = model
        self.factor_update_steps = a["factor_update_steps"]
        self.inv_update_steps = a["inv_update_steps"]
        self.damping = a["damping"]
        self.factor_decay = a["factor_decay"]
        self.kl_clip = a["kl_clip"]
        self.lr = a["lr"]
        self.accumulation_steps = a["accumulation_steps"]
        self.allreduce_bucket_cap_mb = cap
        self.allreduce_method = reduce_method
        self.assignment_strategy = strategy
        self.compute_method = method
        self.compute_eigenvalue_outer_product = a["compute_eigenvalue_outer_product"]
        self.symmetry_aware = a["symmetry_aware"]
        self.grad_scaler = a["grad_scaler"]
        self.inv_dtype = a["inv_dtype"]
        self.settings = settings
        """The :class:`~kfac_func.Settings` this preconditioner was built with."""
        self.gram_dtype = settings.gram_dtype
        skip = a["skip_layers"]
        self.skip_layers = [] if skip is None else list(skip)
        self.update_factors_in_hook = a["update_factors_in_hook"]
        self.loglevel = a["loglevel"]
        self.scaling = settings.scaling
        self.loss_reduction = settings.loss_reduction
        divisor = settings.loss_divisor
        self.loss_divisor = 1.0 if divisor is None else float(divisor)
        # the hyperparameters as constructed (a scheduler moves them later): a state dict
        # records them, so that loading it into the same construction replaces nothing
        # the constructor chose
        self._constructed = {k: getattr(self, k) for k in HYPER}
        return a

    @property
    def _bucket_cap_mb(self) -> float:
        """The bucket cap the communicator uses: 0 (one collective per tensor) for
        ``ALLREDUCE``, else ``allreduce_bucket_cap_mb``."""
        if self.allreduce_method is AllreduceMethod.ALLREDUCE:
            return 0.0
        return self.allreduce_bucket_cap_mb

    def _loss_scale(self, batch_size: int) -> float:
        """``c`` with the backpropagated loss ``= c · Σ_n ℓ_n`` for a micro-batch of
        ``batch_size`` examples (see :attr:`kfac_func.Captures.loss_scale`)."""
        return (1.0 / batch_size if self.loss_reduction == "mean" else 1.0) / self.loss_divisor


class PreconditionerBase(KFACArguments):
    """What every preconditioner class asks of its arguments and state: the step count, a
    hyperparameter's current value, and whether this step collects statistics."""

    _state: KFACState
    layers: Mapping[str, LayerSpec]
    factor_dtype: torch.dtype
    eigenbasis_moments: bool = False

    @property
    def steps(self) -> int:
        """Number of :meth:`step` calls so far."""
        return self._state.step

    def _repr(self, name: str, where: str, *settings: str) -> str:
        """``name(N layers<where>, <the hyperparameters>, <settings>, scaling=...)``."""
        hyper = ", ".join(f"{k}={getattr(self, k)!r}" for k in HYPER)
        tail = ", ".join((*settings, f"scaling={self.scaling!r}"))
        return f"{name}({len(self.layers)} layers{where}, {hyper}, {tail})"

    def _first_state(self, device: torch.device, **options: Any) -> KFACState:
        """The registered layers' fresh state (:func:`kfac_func.init`) on ``device``, as the
        stored arguments and :attr:`factor_dtype` ask, with ``init``'s other ``options``."""
        return init(
            self.layers,
            convention=self.scaling,  # type: ignore[arg-type]
            compute_method=self.compute_method.name.lower(),
            compute_eigenvalue_outer_product=self.compute_eigenvalue_outer_product,
            factor_dtype=self.factor_dtype,
            inv_dtype=self.inv_dtype,
            device=device,
            **options,
        )

    def _value(self, v: Any) -> Any:
        return v(self.steps) if callable(v) else v

    def _collecting(self) -> bool:
        return (
            self.model.training
            and torch.is_grad_enabled()
            and (self.steps % int(self._value(self.factor_update_steps)) == 0)
        )
