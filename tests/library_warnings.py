"""Warnings raised *from* kfac_func, made errors: for the examples and the documentation,
which must run without the library's own warnings.

A warning is the library's when the code that calls ``warnings.warn`` is a module of
``kfac_func`` (its ``stacklevel`` usually attributes it to the caller, so the
``module`` field of a warnings filter, which matches that attribution, cannot tell).
:func:`library_warnings_are_errors` raises them as exceptions, as
``warnings.simplefilter("error")`` would, and leaves other warnings alone.

Run as a script, ``python tests/library_warnings.py SCRIPT ARGS...`` runs ``SCRIPT`` as
``__main__`` under it.
"""

from __future__ import annotations

import contextlib
import runpy
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_ORIGINAL = warnings.warn


def _strict_warn(message: Any, category: Any = None, stacklevel: int = 1, **kw: Any) -> None:
    caller = sys._getframe(1).f_globals.get("__name__", "")
    if caller == "kfac_func" or str(caller).startswith("kfac_func."):
        if isinstance(message, Warning):
            raise message
        raise (category or UserWarning)(f"{message} [raised from {caller}]")
    _ORIGINAL(message, category, stacklevel + 1, **kw)


@contextlib.contextmanager
def library_warnings_are_errors() -> Iterator[None]:
    """While entered, a warning issued by a module of kfac_func is raised instead.

    Example:
        >>> with library_warnings_are_errors():
        ...     exec("import warnings; warnings.warn('mine')", {"__name__": "kfac_func.x"})
        Traceback (most recent call last):
        ...
        UserWarning: mine [raised from kfac_func.x]
    """
    warnings.warn = _strict_warn  # type: ignore[assignment]
    try:
        yield
    finally:
        warnings.warn = _ORIGINAL


if __name__ == "__main__":
    script, *args = sys.argv[1:]
    sys.argv = [script, *args]
    here = Path(__file__).resolve().parent
    # the checkout's kfac_func (tests/..), then the script's folder, as `python SCRIPT` has
    sys.path[:1] = [str(Path(script).resolve().parent), str(here.parent)]
    with library_warnings_are_errors():
        runpy.run_path(script, run_name="__main__")
