"""What every stage of the step shares: hyperparameter values, checks and the NaN policy.

Hyperparameters are numbers or ``step -> value`` callables, evaluated at ``state.step``
(:func:`resolve`); :func:`check` refuses values out of range with an error naming them.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Literal, TypeVar

import torch

from kfac_func.captures import Captures

__all__ = [
    "GrowingInterval",
    "Hyper",
    "NonFinite",
    "NonFiniteError",
    "as_list",
    "check_hyper",
    "clip_and_rate",
    "exp_decay_factor_averaging",
    "non_finite",
    "resolve",
    "resolve_checked",
    "take",
]


T = TypeVar("T")


Hyper = float | Callable[[int], float]


NonFinite = Literal["skip", "raise"]


class NonFiniteError(ValueError):
    """A NaN or Inf reached K-FAC; the message names the layer and the tensor."""


def resolve(value: T | Callable[[int], T], step: int) -> T:
    return value(step) if callable(value) else value  # type: ignore[return-value]


HYPER_CHECKS: dict[str, tuple[Callable[[float], bool], str]] = {
    # the hyperparameters a step resolves at its step, with their ranges
    "lr": (lambda v: v >= 0, ">= 0"),
    "kl_clip": (lambda v: v > 0, "> 0 (or None to disable)"),
    "damping": (lambda v: v >= 0, ">= 0"),
    "factor_decay": (lambda v: 0 <= v <= 1, "in [0, 1]"),
}


def check_hyper(name: str, value: float | None, ok: Callable[[float], bool], expected: str) -> None:
    """Raise a TypeError unless ``value`` is a number, a ValueError unless ``ok(value)``.

    Inside a compiled step (``torch.compile`` traces it, and a value that changed between
    calls is symbolic there) nothing is checked: the caller checks the values eagerly
    first (:meth:`kfac_func.StepOptions.at`).

    Example:
        >>> check_hyper("lr", -1.0, lambda v: v >= 0, ">= 0")
        Traceback (most recent call last):
        ...
        ValueError: lr must be >= 0, got -1.0
    """
    if torch.compiler.is_compiling():
        return
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    if math.isnan(value) or not ok(value):
        raise ValueError(f"{name} must be {expected}, got {value!r}")


def resolve_checked(name: str, value: Hyper, step: int) -> float:
    """``value`` at ``step`` (:func:`resolve`), checked (:func:`check_hyper`) against the
    range ``HYPER_CHECKS`` gives the hyperparameter ``name``.

    Example:
        >>> resolve_checked("damping", lambda k: -0.1 * k, 2)
        Traceback (most recent call last):
        ...
        ValueError: damping must be >= 0, got -0.2
    """
    resolved = resolve(value, step)
    check_hyper(name, resolved, *HYPER_CHECKS[name])
    return resolved


def clip_and_rate(kl_clip: Hyper | None, lr: Hyper, step: int) -> tuple[float | None, float]:
    """``kl_clip`` (None: no clipping) and ``lr`` at ``step``, checked (a ValueError names
    the bad one).

    Example:
        >>> clip_and_rate(1e-3, lambda k: 0.1 * k, 2)
        (0.001, 0.2)
    """
    clip = resolve(kl_clip, step) if kl_clip is not None else None
    rate = resolve_checked("lr", lr, step)
    if clip is not None:
        check_hyper("kl_clip", clip, *HYPER_CHECKS["kl_clip"])
    return clip, rate


def exp_decay_factor_averaging(min_value: float = 0.95) -> Callable[[int], float]:
    """A ``factor_decay`` schedule: ``min(1 - 1/k, min_value)`` at step ``k``.

    Early on, the running averages of the factors weigh every batch so far equally
    (``1 - 1/k`` is the decay of a plain mean of ``k`` batches); once that decay reaches
    ``min_value`` they become exponential averages with decay ``min_value``. Step 0 is
    treated as step 1 (decay 0: the first factors replace the initial ones). Pass the
    result as ``factor_decay`` to a preconditioner or to :func:`kfac_func.update`.

    Raises:
        ValueError: ``min_value <= 0`` (at construction), or a negative step.

    Example:
        >>> decay = exp_decay_factor_averaging(0.9)
        >>> [round(decay(k), 3) for k in (0, 1, 2, 4, 10, 100)]
        [0.0, 0.0, 0.5, 0.75, 0.9, 0.9]
    """
    if isinstance(min_value, bool) or not isinstance(min_value, (int, float)):
        raise TypeError(f"min_value must be a number, got {min_value!r}")
    if not min_value > 0:
        raise ValueError(f"min_value must be greater than 0, got {min_value!r}")

    def factor_decay(step: int) -> float:
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        return min(1.0 - 1.0 / max(step, 1), float(min_value))

    return factor_decay


@dataclass(frozen=True)
class GrowingInterval:
    """An ``inv_update_steps`` (or ``factor_update_steps``) schedule for long runs: fresh
    eigenbases (or statistics) every ``first`` steps while the curvature moves fast, then
    half as often each time the run doubles:
    ``first`` steps apart until step ``until``, ``2·first`` until ``2·until``, ``4·first``
    until ``4·until`` and so on, at most ``most`` apart. Each step where the interval
    doubles is a multiple of the new interval, so kfac-pytorch's rule (decompose where
    ``step % interval == 0``) refreshes on a regular grid that thins out: with the
    defaults every 2 steps until step 256, every 4 until 512, every 8 until 1,024,
    every 16 until 2,048, then every 32: 320 eigenbases in 2,000 steps instead of 1,000.

    Raises:
        ValueError: ``first`` or ``most`` not a positive int, ``most < first``, or
            ``until`` not a positive multiple of ``most`` (the grid would not align).

    Example:
        >>> interval = GrowingInterval()
        >>> [interval(t) for t in (0, 255, 256, 600, 1500, 5000)]
        [2, 2, 4, 8, 16, 32]
    """

    first: int = 2
    until: int = 256
    most: int = 32

    def __post_init__(self) -> None:
        for name in ("first", "until", "most"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"GrowingInterval.{name} must be a positive int, got {v!r}")
        if self.most < self.first or self.until % self.most:
            raise ValueError(
                f"GrowingInterval needs first <= most and until a multiple of most, got "
                f"first={self.first}, until={self.until}, most={self.most}"
            )

    def __call__(self, step: int) -> int:
        interval, end = self.first, self.until
        while step >= end and interval < self.most:
            interval, end = interval * 2, end * 2
        return min(interval, self.most)


@dataclass(frozen=True)
class DecayPerStep:
    """A ``factor_decay`` for statistics gathered every ``interval`` steps (a number or a
    schedule of the step, such as a :class:`GrowingInterval`): ``per_step`` to the power of
    the interval at the step, so that the running average forgets at the same rate per
    step, however many steps apart its statistics come.

    Example:
        >>> decay = DecayPerStep(0.9, GrowingInterval(first=1, until=256, most=2))
        >>> [round(decay(t), 4) for t in (0, 255, 256, 4000)]
        [0.9, 0.9, 0.81, 0.81]
    """

    per_step: float
    interval: int | Callable[[int], int]

    def __call__(self, step: int) -> float:
        every = self.interval(step) if callable(self.interval) else self.interval
        return float(self.per_step) ** int(every)


def as_list(captures: Captures | Sequence[Captures]) -> list[Captures]:
    return [captures] if isinstance(captures, Captures) else list(captures)


def take(mapping: Mapping[str, T] | None, key: str, consume: bool) -> T | None:
    """``mapping[key]`` or None; with ``consume``, removed from a mutable ``mapping`` so that
    the caller's mapping no longer keeps it alive."""
    if mapping is None:
        return None
    if consume and isinstance(mapping, MutableMapping):
        taken: T | None = mapping.pop(key, None)
        return taken
    return mapping.get(key)


def non_finite(layer: str, what: str, mode: NonFinite) -> None:
    msg = f"layer {layer!r}: non-finite values (NaN/Inf) in {what}"
    if mode == "raise":
        raise NonFiniteError(msg)
    warnings.warn(f"{msg}; skipped for this step", RuntimeWarning, stacklevel=3)
