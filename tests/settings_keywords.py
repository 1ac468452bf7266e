"""A preconditioner's keyword arguments as it takes them, for tests that list settings
among kfac-pytorch's arguments (parametrized dicts, helpers' ``**kw``): the fields of
``kf.Settings`` go into one ``settings=`` value, the rest stay keywords.

The test files import this module by name (pytest puts the test directory on
``sys.path``, as for ``gloo.py``).
"""

from __future__ import annotations

from typing import Any

from kfac_func.adapter.settings import settings_from_keywords

__all__ = ["with_settings"]


def with_settings(**kwargs: Any) -> dict[str, Any]:
    """``kwargs`` with the fields of ``kf.Settings`` moved into ``settings=`` (into the
    ``settings=`` already given, if any), without the preconditioners' deprecation.

    Example:
        >>> kw = with_settings(damping=0.1, scaling="fisher")
        >>> kw["damping"], kw["settings"].scaling
        (0.1, 'fisher')
    """
    settings = settings_from_keywords(kwargs, "with_settings", warn=False)
    return {**kwargs, "settings": settings}
