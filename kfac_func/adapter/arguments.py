"""kfac-pytorch's preconditioner arguments, described once for every preconditioner class.

:meth:`KFACArguments._set_arguments` is the one description of the keyword arguments that
:class:`~kfac_func.adapter.preconditioner.KFACPreconditioner`,
:class:`~kfac_func.parallel.preconditioner.ParallelKFACPreconditioner` and
:class:`~kfac_func.parallel.gpt_neox.GPTNeoXKFACPreconditioner` share: their names, how
they are checked (numbers may also be ``step -> value`` callables) and the attributes they
are stored as. Each constructor keeps its explicit signature (what ``inspect.signature``,
type checkers and the API reference read) and hands its arguments over by name with
:func:`arguments_of`; their documentation is :class:`KFACPreconditioner`'s ``Args``, to
which the other two refer. ``HYPER`` names the hyperparameters that are saved in state
dicts and printed.
"""

from __future__ import annotations

import enum
import inspect
import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from kfac_func.blocks import LayerSpec
from kfac_func.captures import check_loss_divisor
from kfac_func.core.conventions import CONVENTIONS, convention_argument
from kfac_func.distributed.communicator import AllreduceMethod
from kfac_func.distributed.plan import AssignmentStrategy
from kfac_func.state import KFACState, init

__all__ = [
    "HYPER",
    "ComputeMethod",
    "FloatOrFn",
    "IntOrFn",
    "KFACArguments",
    "PreconditionerBase",
    "arguments_of",
    "check_bucket_cap",
    "log_registered",
    "parse_enum",
]

IntOrFn = int | Callable[[int], int]
FloatOrFn = float | Callable[[int], float]

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


def arguments_of(function: Callable[..., Any], given: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of ``given`` (a constructor's ``locals()``) that name parameters of
    ``function``: a constructor hands the arguments it shares with ``function`` over by
    name, so that their list is written once, in ``function``'s signature.

    Example:
        >>> def build(a: int, *, b: int = 2) -> int:
        ...     return a + b
        >>> def wrapper(a: int, b: int = 5, c: int = 0) -> int:
        ...     return build(**arguments_of(build, locals()))
        >>> wrapper(1)
        6
    """
    names = inspect.signature(function).parameters
    return {name: given[name] for name in names if name in given and name != "self"}


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
    logger: logging.Logger,
    level: int,
    model: nn.Module,
    layers: Mapping[str, LayerSpec],
    where: str = "",
) -> None:
    """Log one line per registered layer, ``Registered name="fc1": ...`` at ``level``
    (``where`` is appended, e.g. the pipeline stage).

    Example:
        >>> from kfac_func.blocks import register
        >>> model = nn.Sequential(nn.Linear(3, 2))
        >>> seen = []
        >>> class Keep(logging.Handler):
        ...     def emit(self, record: logging.LogRecord) -> None:
        ...         seen.append(record.getMessage())
        >>> log = logging.getLogger("kfac_func.demo")
        >>> log.addHandler(Keep())
        >>> log.setLevel(logging.INFO)
        >>> log_registered(log, logging.INFO, model, register(model))
        >>> seen
        ['Registered name="0": Linear, linear, A 4x4, G 2x2']
    """
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


class KFACArguments:
    """kfac-pytorch's preconditioner arguments, validated and stored as attributes (numbers
    may also be ``step -> value`` callables); shared by the preconditioner classes."""

    model: nn.Module
    factor_update_steps: IntOrFn
    inv_update_steps: IntOrFn
    damping: FloatOrFn
    factor_decay: FloatOrFn
    kl_clip: FloatOrFn | None
    lr: FloatOrFn
    accumulation_steps: int
    allreduce_bucket_cap_mb: float
    allreduce_method: AllreduceMethod
    assignment_strategy: AssignmentStrategy
    compute_method: ComputeMethod
    compute_eigenvalue_outer_product: bool
    symmetry_aware: bool
    grad_scaler: Any
    inv_dtype: torch.dtype
    skip_layers: list[str]
    update_factors_in_hook: bool
    loglevel: int
    scaling: str
    loss_reduction: str
    loss_divisor: float

    def _set_arguments(
        self,
        model: nn.Module,
        *,
        factor_update_steps: IntOrFn,
        inv_update_steps: IntOrFn,
        damping: FloatOrFn,
        factor_decay: FloatOrFn,
        kl_clip: FloatOrFn | None,
        lr: FloatOrFn,
        accumulation_steps: int,
        allreduce_bucket_cap_mb: float,
        assignment_strategy: AssignmentStrategy | str,
        compute_method: ComputeMethod | str,
        compute_eigenvalue_outer_product: bool,
        symmetry_aware: bool,
        grad_scaler: Any,
        inv_dtype: torch.dtype,
        skip_layers: list[str] | None,
        update_factors_in_hook: bool,
        loglevel: int,
        scaling: str | None,
        loss_reduction: str,
        loss_divisor: float = 1.0,
        allreduce_method: AllreduceMethod | str | None = None,
        convention: str | None = None,
    ) -> None:
        """Check and store the shared arguments: this signature is their one list (the
        constructors hand them over with :func:`arguments_of`), documented in
        :class:`~kfac_func.adapter.preconditioner.KFACPreconditioner`'s ``Args``."""
        # scaling= is the preconditioners' name, convention= the functional API's
        scaling = convention_argument(convention, scaling, default="kfac-pytorch")
        check_bucket_cap(allreduce_bucket_cap_mb)
        reduce_method: AllreduceMethod = (
            AllreduceMethod.for_bucket_cap(allreduce_bucket_cap_mb)
            if allreduce_method is None
            else parse_enum(AllreduceMethod, allreduce_method, "allreduce_method")
        )
        if reduce_method is AllreduceMethod.ALLREDUCE_BUCKETED and allreduce_bucket_cap_mb == 0:
            raise ValueError(
                "allreduce_method=ALLREDUCE_BUCKETED needs allreduce_bucket_cap_mb > 0 "
                "(a cap of 0 means one collective per tensor: ALLREDUCE)"
            )
        method = parse_enum(ComputeMethod, compute_method, "compute_method")
        strategy = parse_enum(AssignmentStrategy, assignment_strategy, "assignment_strategy")
        for name, value in (
            ("factor_update_steps", factor_update_steps),
            ("inv_update_steps", inv_update_steps),
            ("accumulation_steps", accumulation_steps),
        ):
            _check_number(name, value, lambda v: int(v) == v and v > 0, "a positive int")
        _check_number("damping", damping, lambda v: v >= 0, ">= 0")
        # [0, 1] as in kfac_func.update: 0 keeps only the latest batch factors (the first
        # value exp_decay_factor_averaging gives), 1 freezes the factors
        _check_number("factor_decay", factor_decay, lambda v: 0 <= v <= 1, "in [0, 1]")
        _check_number("lr", lr, lambda v: v >= 0, ">= 0")
        if kl_clip is not None:
            _check_number("kl_clip", kl_clip, lambda v: v > 0, "> 0 (or None to disable)")
        if scaling not in CONVENTIONS:
            raise ValueError(f"scaling must be one of {CONVENTIONS}, got {scaling!r}")
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
        check_loss_divisor(loss_divisor)

        self.model = model
        self.factor_update_steps = factor_update_steps
        self.inv_update_steps = inv_update_steps
        self.damping = damping
        self.factor_decay = factor_decay
        self.kl_clip = kl_clip
        self.lr = lr
        self.accumulation_steps = accumulation_steps
        self.allreduce_bucket_cap_mb = allreduce_bucket_cap_mb
        self.allreduce_method = reduce_method
        self.assignment_strategy = strategy
        self.compute_method = method
        self.compute_eigenvalue_outer_product = compute_eigenvalue_outer_product
        self.symmetry_aware = symmetry_aware
        self.grad_scaler = grad_scaler
        self.inv_dtype = inv_dtype
        self.skip_layers = [] if skip_layers is None else list(skip_layers)
        self.update_factors_in_hook = update_factors_in_hook
        self.loglevel = loglevel
        self.scaling = scaling
        self.loss_reduction = loss_reduction
        self.loss_divisor = float(loss_divisor)
        # the hyperparameters as constructed (a scheduler moves them later): a state dict
        # records them, so that loading it into the same construction replaces nothing
        # the constructor chose
        self._constructed = {k: getattr(self, k) for k in HYPER}

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
