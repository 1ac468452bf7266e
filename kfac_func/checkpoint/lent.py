"""State dicts that share a live state's tensors, and templates that do not.

``state_dict()`` of the preconditioner and of :class:`~kfac_func.KFAC` returns the state's
own tensors, as ``torch.optim``'s optimizers do: a checkpoint costs no copy of the state
(the step never writes into a tensor of its state, it makes new ones, so a state dict
taken before a step keeps its values). ``torch.distributed.checkpoint.load`` however
writes *into* the tensors of the state dict it is handed; handed such a state dict as its
template, it would overwrite the live state before ``load_state_dict`` could check the
checkpoint (a damaged one would then be refused with the state already gone).

:func:`lend` records the tensors a state dict shares with a live state (weakly: the record
ends with the tensor); :func:`fresh_template` replaces them in a template by empty tensors
of the same shape, dtype, device and layout, so that DCP loads into those and the live
state changes only when ``load_state_dict`` accepts them. :func:`kfac_func.load_dcp` does
this before it loads; a plain ``dcp.load`` into such a template writes the live state, as
it writes a ``torch.optim`` optimizer's.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

__all__ = ["fresh_template", "lend"]

_LENT: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
"""The lent tensors, by the address of their storage (alive while the tensor is)."""


def _key(t: torch.Tensor) -> int | None:
    """The address of ``t``'s storage: a DTensor's is its local shard's; None for a
    tensor subclass with no storage of its own (nothing a state lends)."""
    local = getattr(t, "to_local", None)  # a DTensor (FSDP2, tensor parallelism)
    if callable(local):
        t = local()
    try:
        return int(t.untyped_storage().data_ptr())
    except RuntimeError:  # "invalid python storage": a wrapper subclass
        return None


def lend(tree: Any) -> Any:
    """Record every tensor of ``tree`` (nested dicts, lists and tuples) as shared with a
    live state; returns ``tree``.

    Example:
        >>> t = torch.ones(2)
        >>> sd = lend({"A": t})
        >>> fresh_template(sd)["A"] is t
        False
    """
    if isinstance(tree, torch.Tensor):
        key = _key(tree) if tree.numel() else None
        if key is not None:
            _LENT[key] = tree
    elif isinstance(tree, dict):
        for value in tree.values():
            lend(value)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            lend(value)
    return tree


def fresh_template(tree: Any) -> Any:
    """``tree`` with every tensor that shares storage with a lent one (:func:`lend`)
    replaced by an empty tensor like it (in place in its dicts and lists; a tuple is
    rebuilt); the other tensors (a model's parameters, which DCP loads in place) are
    kept. Returns ``tree``.

    Example:
        >>> w = torch.zeros(3)
        >>> sd = {"model": {"w": w}, "optim": lend({"A": torch.eye(2)})}
        >>> out = fresh_template(sd)
        >>> out["model"]["w"] is w, out["optim"]["A"].shape
        (True, torch.Size([2, 2]))
    """
    if isinstance(tree, torch.Tensor):
        key = _key(tree) if tree.numel() else None
        if key is not None and _LENT.get(key) is not None:
            return torch.empty_like(tree)
        return tree
    if isinstance(tree, dict):
        for key, value in tree.items():
            tree[key] = fresh_template(value)
    elif isinstance(tree, list):
        tree[:] = [fresh_template(v) for v in tree]
    elif isinstance(tree, tuple):
        return tuple(fresh_template(v) for v in tree)
    return tree
