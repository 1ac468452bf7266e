"""What every stage of the step shares: hyperparameter values, checks and the NaN policy.

Hyperparameters are numbers or ``step -> value`` callables, evaluated at ``state.step``
(:func:`resolve`); :func:`check` refuses values out of range with an error naming them.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import Literal, TypeVar

from kfac_func.captures import Captures

__all__ = [
    "Hyper",
    "NonFinite",
    "NonFiniteError",
    "as_list",
    "check_hyper",
    "non_finite",
    "resolve",
    "take",
]


T = TypeVar("T")


Hyper = float | Callable[[int], float]


NonFinite = Literal["skip", "raise"]


class NonFiniteError(ValueError):
    """A NaN or Inf reached K-FAC; the message names the layer and the tensor."""


def resolve(value: T | Callable[[int], T], step: int) -> T:
    return value(step) if callable(value) else value  # type: ignore[return-value]


def check_hyper(name: str, value: float | None, ok: Callable[[float], bool], expected: str) -> None:
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    if math.isnan(value) or not ok(value):
        raise ValueError(f"{name} must be {expected}, got {value!r}")


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
