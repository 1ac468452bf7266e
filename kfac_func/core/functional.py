"""A model called with other tensors, left as it was found.

:func:`torch.func.functional_call` swaps the given tensors into the model's modules for the
call and puts the originals back afterwards. A module reachable under two attribute names
(``self.alias = self.lin``) is swapped twice and restored twice, and the second
restoration puts back what the first swap left (torch 2.13): after the call the model
holds the call's tensors, plain tensors that are no longer its parameters, and a later
forward or optimizer step silently uses them. :func:`functional_call` here restores every
entry that the call left replaced.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.func import functional_call as _torch_functional_call

__all__ = ["functional_call"]


def functional_call(
    model: nn.Module,
    tensors: dict[str, torch.Tensor] | tuple[dict[str, torch.Tensor], ...],
    args: Any = (),
    kwargs: dict[str, Any] | None = None,
) -> Any:
    """:func:`torch.func.functional_call`, after which the model holds its own parameters
    and buffers again, aliased modules included.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> lin = nn.Linear(2, 2)
        >>> model = nn.Sequential(lin, lin)  # one module under two names
        >>> weight = lin.weight
        >>> ones = {k: torch.ones_like(v) for k, v in model.named_parameters()}
        >>> functional_call(model, ones, (torch.zeros(1, 2),))
        tensor([[3., 3.]])
        >>> lin.weight is weight
        True
    """
    saved = [
        (module, slot, dict(getattr(module, slot)))
        for module in model.modules()
        for slot in ("_parameters", "_buffers")
    ]
    try:
        return _torch_functional_call(model, tensors, args, kwargs)
    finally:
        for module, slot, entries in saved:
            now = getattr(module, slot)
            for name, value in entries.items():
                if now.get(name) is not value:
                    now[name] = value
