"""Writing the preconditioned gradients back into the parameters' ``.grad``."""

from __future__ import annotations

from collections.abc import Mapping

import torch

__all__ = ["copy_back"]


def copy_back(grads: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor]) -> None:
    """Copy each of ``new`` into the tensor of ``grads`` it replaces (those that are not
    the same object), in place: one ``torch._foreach_copy_`` for plain tensors, one copy
    each for DTensors (FSDP2), which have no foreach copy.

    Example:
        >>> g = {"w": torch.zeros(2)}
        >>> copy_back(g, {"w": torch.ones(2)})
        >>> g["w"]
        tensor([1., 1.])
    """
    changed = [(g, new[k]) for k, g in grads.items() if new[k] is not g]
    with torch.no_grad():
        if changed and all(type(g) is torch.Tensor for g, _ in changed):
            torch._foreach_copy_([g for g, _ in changed], [n for _, n in changed])
        else:
            for g, n in changed:
                g.copy_(n)
