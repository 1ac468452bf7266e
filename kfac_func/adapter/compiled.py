"""The preconditioner's hooks beside ``torch.compile`` of the model.

Three things make module hooks and TorchDynamo meet safely:

- :func:`uncompiled` unwraps ``torch.compile(model)`` (an ``OptimizedModule``) to the
  module it compiles: the layers are registered on, and named after, the eager model, so
  names (and checkpoints) are the same whether the model is compiled or not, and in
  either order.
- :func:`opaque` makes a hook body run eagerly when Dynamo traces the module that calls
  it: Dynamo breaks the graph there instead of tracing the hook's Python state (which
  would guard on it, recompiling at every change, and fail on mutations), and the hook
  sees real tensors, on which it can register gradient hooks. Outside a compiled region
  the body is called directly, without the cost of leaving Dynamo.
- :func:`forget_compiled_code` drops the code Dynamo compiled before the hooks existed.
  Dynamo does not guard on a module's *empty* hook dicts
  (``torch._dynamo.config.skip_nnmodule_hook_guards``, on by default), so code traced
  from a model (or another instance of its class) without hooks would keep running
  without them: no statistics at all. Once hooks are present they are guarded, and
  removing them recompiles.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn

__all__ = ["eager_forward", "forget_compiled_code", "opaque", "uncompiled"]

F = TypeVar("F", bound=Callable[..., Any])


def uncompiled(model: nn.Module) -> nn.Module:
    """The module ``torch.compile`` compiles in ``model`` (``model`` itself if it is not
    an ``OptimizedModule``; nested wrappers are unwrapped all the way).

    Example:
        >>> import torch
        >>> net = torch.nn.Linear(2, 2)
        >>> uncompiled(torch.compile(net)) is net, uncompiled(net) is net
        (True, True)
    """
    optimized = getattr(torch._dynamo.eval_frame, "OptimizedModule", ())
    while isinstance(model, optimized):
        model = model._orig_mod
    return model


def opaque(fn: F) -> F:
    """``fn`` as a hook that TorchDynamo does not trace: inside a compiled region it runs
    eagerly at a graph break (``torch.compiler.disable``), elsewhere it is called as is.

    Example:
        >>> import torch
        >>> seen = []
        >>> net = torch.nn.Linear(2, 2)
        >>> _ = net.register_forward_hook(opaque(lambda m, args, out: seen.append(out.shape)))
        >>> _ = torch.compile(net, backend="eager")(torch.ones(3, 2))
        >>> seen
        [torch.Size([3, 2])]
    """
    disabled = torch.compiler.disable(fn, recursive=True)  # type: ignore[no-untyped-call]

    @functools.wraps(fn)
    def hook(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return disabled(*args, **kwargs)
        return fn(*args, **kwargs)

    return hook  # type: ignore[return-value]


def forget_compiled_code() -> bool:
    """Drop the code TorchDynamo compiled so far in this process (it recompiles, with
    the hooks now present, at the next call), if it compiled any; returns whether it had.

    Module calls are compiled through code shared by every module (``Module.__call__``)
    and through whatever function called the model, so the code that may have inlined a
    model without hooks cannot be told apart: all of it is dropped. Call it after adding
    hooks to a model that may have been compiled (or whose class may have been).

    Example:
        >>> import torch
        >>> f = torch.compile(lambda x: x + 1, backend="eager")
        >>> _ = f(torch.ones(1))
        >>> forget_compiled_code()
        True
    """
    from torch._dynamo import convert_frame

    seen = convert_frame.input_codes.seen + convert_frame.output_codes.seen
    if not any(code() is not None for code in seen):
        return False
    reset = getattr(torch._dynamo, "reset_code_caches", None)
    (reset or torch._dynamo.reset)()
    return True


class _EagerForward:
    """The handle of :func:`eager_forward`: ``remove()`` gives the module its own forward
    back."""

    def __init__(self, module: nn.Module) -> None:
        self.module: nn.Module | None = module

    def remove(self) -> None:
        if self.module is not None and "forward" in vars(self.module):
            del self.module.forward
        self.module = None


def eager_forward(module: nn.Module) -> _EagerForward:
    """Make ``module``'s forward run eagerly inside a compiled model (a graph break around
    it), for modules whose layers are observed inside their forward by patching the
    functional ops they call (attention projections: see
    :meth:`kfac_func.blocks.LayerBlock.tap`), which code compiled once would not see again.
    Returns a handle whose ``remove()`` undoes it.

    Example:
        >>> import torch
        >>> attn = torch.nn.MultiheadAttention(4, 1)
        >>> handle = eager_forward(attn)
        >>> "forward" in vars(attn)
        True
        >>> handle.remove()
        >>> "forward" in vars(attn)
        False
    """
    module.forward = torch.compiler.disable(module.forward, recursive=True)  # type: ignore[method-assign, no-untyped-call]
    return _EagerForward(module)
