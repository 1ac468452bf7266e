"""The errors of loading a checkpoint: :class:`CheckpointError` and its two kinds, a file
that is not a readable kfac_func checkpoint (:class:`CheckpointFormatError`) and a
well-formed one that does not fit the ``like`` state (:class:`CheckpointMismatchError`).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

__all__ = [
    "CheckpointError",
    "CheckpointFormatError",
    "CheckpointMismatchError",
]


class CheckpointError(ValueError):
    """A checkpoint cannot be turned into a state."""


class CheckpointFormatError(CheckpointError):
    """Not a readable kfac_func checkpoint: truncated or corrupt file, missing or malformed
    metadata, missing or unexpected tensors, or a format version newer than this library."""


class CheckpointMismatchError(CheckpointError):
    """A well-formed checkpoint that does not fit the ``like`` state.

    The message lists every problem; they are also available as attributes.

    Attributes:
        config: configuration differences (``"convention: 'fisher' in the checkpoint,
            'kfac-pytorch' in like"``).
        missing: layers of ``like`` absent from the checkpoint.
        extra: layers of the checkpoint absent from ``like``.
        mismatched: ``{layer: [reasons]}`` for layers present in both whose spec, shapes or
            dtypes differ.
        source: the file, when raised by :func:`load_state`.
    """

    def __init__(
        self,
        config: list[str],
        missing: list[str],
        extra: list[str],
        mismatched: dict[str, list[str]],
        *,
        source: str | None = None,
    ) -> None:
        self.config = config
        self.missing = missing
        self.extra = extra
        self.mismatched = mismatched
        self.source = source
        what = "checkpoint" if source is None else f"checkpoint {source!r}"
        lines = [f"{what} does not match the `like` state:"]
        lines += [f"  config: {c}" for c in config]
        if missing:
            lines.append(f"  missing layers (in like, not in the checkpoint): {_names(missing)}")
        if extra:
            lines.append(f"  extra layers (in the checkpoint, not in like): {_names(extra)}")
        for name, reasons in mismatched.items():
            lines.append(f"  layer {name!r}: {'; '.join(reasons)}")
        super().__init__("\n".join(lines))

    def __reduce__(self) -> tuple[Any, ...]:  # picklable despite the keyword-only source
        args = (self.config, self.missing, self.extra, self.mismatched)
        return (functools.partial(type(self), source=self.source), args)


def _names(names: list[str]) -> str:
    return ", ".join(repr(n) for n in names)


def _version_problem(what: str, version: int, meta: Mapping[str, Any], newest: int) -> str | None:
    """Why ``what`` (a file whose metadata ``meta`` has format ``version``) cannot be read
    by this library, which reads versions 1 to ``newest``; None when it can."""
    if 1 <= version <= newest:
        return None
    import kfac_func

    return (
        f"{what} has format version {version} (written by kfac_func "
        f"{meta.get('library_version', '?')}); this library (kfac_func "
        f"{kfac_func.__version__}) reads format version {newest}"
        + (": upgrade kfac_func to load it" if version > newest else "")
    )
