"""The registry of layer kinds: ``kind -> LayerBlock``.

Every module of :mod:`kfac_func.blocks` is imported when the package is, and each kind's
module registers its block with :func:`register_block`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from kfac_func.blocks.base import LayerBlock

__all__ = ["block_of", "blocks", "register_block"]

_BLOCKS: dict[str, LayerBlock] = {}

B = TypeVar("B", bound="type[LayerBlock]")


def register_block(cls: B) -> B:
    """Class decorator: register one instance of ``cls`` under ``cls.kind``.

    Example:
        >>> {"linear", "conv2d", "embedding"} <= {b.kind for b in blocks()}
        True
    """
    kind = cls.kind
    if kind in _BLOCKS and type(_BLOCKS[kind]) is not cls:
        raise ValueError(f"layer kind {kind!r} is registered already ({type(_BLOCKS[kind])})")
    _BLOCKS[kind] = cls()
    return cls


def block_of(kind: str) -> LayerBlock:
    """The block registered for ``kind``; a ValueError lists the known kinds otherwise."""
    try:
        return _BLOCKS[kind]
    except KeyError:
        raise ValueError(f"unknown layer kind {kind!r}; registered: {sorted(_BLOCKS)}") from None


def blocks() -> tuple[LayerBlock, ...]:
    """Every registered block, in registration order."""
    return tuple(_BLOCKS.values())
