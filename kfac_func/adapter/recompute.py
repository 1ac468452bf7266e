"""Forward passes re-run inside the backward pass (activation checkpointing), told apart
from the real ones.

Activation checkpointing frees a segment's activations after the forward pass and
recomputes them in the backward pass by calling the segment's forward again, which fires
the forward hooks of its layers a second time:

- non-reentrant checkpointing (``torch.utils.checkpoint.checkpoint(..., use_reentrant=
  False)``, Hugging Face's ``gradient_checkpointing_enable()``, FSDP2's
  ``checkpoint_wrapper``) runs the real forward with gradients, so the hooks saw each call
  there; the recomputation only refills the saved tensors, and the gradients flow through
  the graph of the real forward: the recomputed outputs never receive one.
- reentrant checkpointing (``use_reentrant=True``) runs the real forward without
  gradients, which the hooks skip (nothing of it could be differentiated); the
  gradients flow through the graph of the recomputation.

Both run the recomputation from the autograd engine, inside the backward pass
(:func:`in_backward`). So the hooks count a call made there only once its output-gradient
arrives: the calls of a reentrant recomputation count (once, as their real forward was
skipped), those of a non-reentrant one never do, and the statistics are taken once per
real call either way. Nothing here depends on the checkpoint's internals.
"""

from __future__ import annotations

import torch

__all__ = ["in_backward"]


def in_backward() -> bool:
    """Whether the caller runs inside the autograd engine's backward pass (a forward
    called there is a recomputation).

    Example:
        >>> import torch
        >>> seen = []
        >>> x = torch.ones(2, requires_grad=True)
        >>> y = x * 2
        >>> _ = y.register_hook(lambda g: seen.append(in_backward()))
        >>> y.sum().backward()
        >>> in_backward(), seen
        (False, [True])
    """
    return bool(torch._C._current_graph_task_id() != -1)
