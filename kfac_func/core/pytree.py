"""Register frozen dataclasses as pytree nodes with optree and with torch's own registry.

torch.func only understands classes known to ``torch.utils._pytree``; optree is what users
(and our serialization) walk. Data fields become children; static fields become hashable
metadata, so ``optree.tree_map(f, state)`` touches tensors only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any, TypeVar

import optree
import torch.utils._pytree as torch_pytree

T = TypeVar("T")

_GLOBAL = getattr(optree.registry, "__GLOBAL_NAMESPACE")


def register_dataclass(cls: type[T], data: Sequence[str], static: Sequence[str] = ()) -> type[T]:
    """Register ``cls`` (a dataclass) so that ``data`` fields are children, ``static`` metadata."""
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    if set(data) | set(static) != names or set(data) & set(static):
        raise TypeError(f"{cls.__name__}: data {data} and static {static} must split {names}")
    data, static = tuple(data), tuple(static)

    def flatten(obj: Any) -> tuple[list[Any], tuple[Any, ...], tuple[str, ...]]:
        return [getattr(obj, k) for k in data], tuple(getattr(obj, k) for k in static), data

    def unflatten(meta: tuple[Any, ...], children: Sequence[Any]) -> Any:
        return cls(**dict(zip(data, children)), **dict(zip(static, meta)))

    optree.register_pytree_node(
        cls,  # type: ignore[arg-type]
        flatten,
        unflatten,  # type: ignore[arg-type]
        path_entry_type=optree.GetAttrEntry,
        namespace=_GLOBAL,
    )

    # torch's pytree counts None as a leaf where optree sees an empty node: the fields that
    # hold None go into the context, so both walks see the same tensors
    def torch_flatten(obj: Any) -> tuple[list[Any], tuple[Any, ...]]:
        present = tuple(k for k in data if getattr(obj, k) is not None)
        return [getattr(obj, k) for k in present], (flatten(obj)[1], present)

    def torch_unflatten(children: Iterable[Any], context: Any) -> Any:
        meta, present = context
        values = dict(zip(present, children))
        return cls(**{k: values.get(k) for k in data}, **dict(zip(static, meta)))

    def torch_flatten_with_keys(obj: Any) -> tuple[list[Any], tuple[Any, ...]]:
        children, context = torch_flatten(obj)
        keys = [torch_pytree.GetAttrKey(k) for k in context[1]]
        return list(zip(keys, children)), context

    torch_pytree.register_pytree_node(
        cls,
        torch_flatten,
        torch_unflatten,
        serialized_type_name=f"{cls.__module__}.{cls.__qualname__}",
        flatten_with_keys_fn=torch_flatten_with_keys,  # type: ignore[arg-type]
    )
    return cls
