"""K-FAC's arithmetic never runs under autocast.

A user's ``torch.autocast`` region is meant for the model's forward. When a step of this
library is called inside one (``with torch.autocast(...): loss, grads, caps =
kf.capture(...); kf.update(...)``), its Gram products would run in bfloat16 or float16
and the factors would come out in that dtype, no longer in the state's ``factor_dtype``.
:func:`without_autocast` wraps the public steps so that they compute as configured
(``factor_dtype``, ``inv_dtype``) whatever region they are called from, as the adapter's
hooks already do for the statistics they collect.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import torch

__all__ = ["autocast_off", "without_autocast"]

P = ParamSpec("P")
R = TypeVar("R")

# the device types whose autocast a step turns off (the others have no autocast of
# their own in the backends this library supports)
_DEVICE_TYPES = ("cpu", "cuda")


def autocast_off(device_type: str) -> contextlib.AbstractContextManager[object]:
    """A region with ``device_type``'s autocast off: ``torch.autocast(device_type,
    enabled=False)`` where it is on, else nothing to enter (entering an autocast region
    costs more than many a small layer's statistics).

    Example:
        >>> with torch.autocast("cpu", dtype=torch.bfloat16), autocast_off("cpu"):
        ...     (torch.ones(2, 2) @ torch.ones(2, 2)).dtype
        torch.float32
    """
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def without_autocast(fn: Callable[P, R]) -> Callable[P, R]:
    """``fn`` with autocast disabled while it runs (when it is enabled at all; nothing is
    changed under ``torch.compile``'s tracing).

    Example:
        >>> @without_autocast
        ... def gram(x: torch.Tensor) -> torch.Tensor:
        ...     return x.T @ x
        >>> with torch.autocast("cpu", dtype=torch.bfloat16):
        ...     gram(torch.ones(2, 2)).dtype
        torch.float32
    """

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        if torch.compiler.is_compiling():
            return fn(*args, **kwargs)
        active = [d for d in _DEVICE_TYPES if torch.is_autocast_enabled(d)]
        if not active:
            return fn(*args, **kwargs)
        with contextlib.ExitStack() as stack:
            for d in active:
                stack.enter_context(torch.autocast(d, enabled=False))
            return fn(*args, **kwargs)

    return wrapper
