"""Module hooks that run a forward inside a kind's :meth:`~kfac_func.blocks.LayerBlock.tap`,
for the layers whose calls happen inside their module's forward (attention projections,
the lookup of an embedding whose forward computes its ids).
Shared by :func:`kfac_func.capture` and the adapters' recording hooks.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import _C, nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils.hooks import RemovableHandle

from kfac_func.blocks.spec import LayerSpec

__all__ = [
    "ModeTap",
    "OutputTap",
    "RefusedCall",
    "Site",
    "Sites",
    "call_sites",
    "computes",
    "tap_hooks",
    "tapped",
]

Site = Callable[[LayerSpec, torch.Tensor, torch.Tensor], torch.Tensor]
"""``site(layer, input, output) -> output`` for one call of a tapped layer."""


Sites = Mapping[str, tuple[nn.Module, list[LayerSpec]]]
"""``{module name: (module, the layers its calls feed)}``."""


def call_sites(
    model: nn.Module, specs: Mapping[str, LayerSpec]
) -> dict[str, tuple[nn.Module, list[LayerSpec]]]:
    """The modules whose calls feed the layers ``specs``: a layer's own module, or the
    module it is a part of (the projections of one attention share theirs); a tied layer
    (:mod:`kfac_func.blocks.tied`) is fed by its head and by its embeddings.

    Example:
        >>> import torch
        >>> from kfac_func.blocks import register
        >>> model = torch.nn.Sequential(torch.nn.MultiheadAttention(4, 1), torch.nn.Linear(4, 2))
        >>> {name: len(s) for name, (_, s) in call_sites(model, register(model)).items()}
        {'0': 4, '1': 1}
    """
    out: dict[str, tuple[nn.Module, list[LayerSpec]]] = {}
    for spec in specs.values():
        # a tied head's embeddings feed the same layer
        tied = [] if spec.option("tied") is None else [str(spec.option("tied"))]
        for module in [spec.module, *tied, *spec.option("tied_also", ())]:
            if module not in out:
                out[module] = (model.get_submodule(module), [])
            out[module][1].append(spec)
    return out


class RefusedCall(ValueError):
    """A call of ``layer`` that is not what its kind computes, found by its tap (the message
    says why): the layer is refused (see :func:`tap_hooks`).

    Example:
        >>> err = RefusedCall("emb", "module 'emb' computes something else")
        >>> err.layer, isinstance(err, ValueError), str(err)
        ('emb', True, "module 'emb' computes something else")
    """

    def __init__(self, layer: str, why: str) -> None:
        super().__init__(why)
        self.layer = layer


class OutputTap(AbstractContextManager[None]):
    """A tap that reports its layer's call once the module's forward has returned: it is
    entered before the forward, left after it, and then :meth:`returned` gets the
    module's output (a lookup recorded inside the forward is reported with the output the
    module returns: :mod:`kfac_func.blocks.recorded_embedding`).

    Example:
        >>> class Doubled(OutputTap):  # reports twice the output
        ...     def __exit__(self, *exc):
        ...         return None
        ...     def returned(self, out):
        ...         return 2 * out
        >>> with Doubled() as tap:
        ...     out = 3
        >>> tap.returned(out)
        6
    """

    def returned(self, out: Any) -> Any:
        """The output that replaces the module's ``out`` (the site's result), or a
        :class:`RefusedCall` when the call was not what the kind computes."""
        raise NotImplementedError


class ModeTap(TorchFunctionMode, OutputTap):
    """An :class:`OutputTap` that sees every torch function the module's forward calls
    (a ``torch.overrides.TorchFunctionMode``: :mod:`kfac_func.blocks.recorded_embedding`,
    :mod:`kfac_func.blocks.used_weights`). It leaves the mode stack wherever it is on it:
    the forward hooks of two observers of one module (a preconditioner's and a capture's)
    leave their modes in the order they entered them. :meth:`called` sees each call.
    """

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        return self.called(func, args, dict(kwargs or {}))

    def called(
        self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """The result of ``func(*args, **kwargs)``, a torch function the forward calls."""
        raise NotImplementedError

    def __exit__(self, *exc: object) -> None:
        stack = [_C._get_function_stack_at(i) for i in range(_C._len_torch_function_stack())]
        if not any(mode is self for mode in stack):
            return
        above = []
        while True:
            mode = _C._pop_torch_function_stack()
            if mode is self:
                break
            above.append(mode)
        for mode in reversed(above):
            _C._push_on_torch_function_stack(mode)


def computes(out: Any) -> bool:
    """Whether a function's result holds a tensor (reading a shape or a dtype does not).

    Example:
        >>> import torch
        >>> computes(torch.ones(2).shape), computes((torch.ones(2), 3))
        (False, True)
    """
    return any(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(out))


def tapped(specs: Sequence[LayerSpec]) -> bool:
    """Whether the calls of the layers ``specs`` (of one call site, :func:`call_sites`)
    are reported by a tap (:func:`tap_hooks`) rather than by a forward hook: a kind that
    :attr:`~kfac_func.blocks.LayerBlock.taps`, or children whose weights their parent's
    forward uses (:mod:`kfac_func.blocks.used_weights`)."""
    return specs[0].block.taps or bool(specs[0].option("used_by_parent"))


class _Interrupted(RuntimeError):
    """The module's forward raised: its tap is left without checking what it saw."""


def tap_hooks(
    module: nn.Module,
    specs: Sequence[LayerSpec],
    site: Callable[[], Site | None],
    wrap: Callable[[Any], Any] = lambda hook: hook,
    refuse: Callable[[str, str], None] | None = None,
) -> list[RemovableHandle]:
    """A forward pre-hook that enters ``specs[0].block.tap(module, specs, s)`` with
    ``s = site()`` (nothing when it returns None) and a forward hook, run even when the
    forward raises, that leaves it; for a kind that :attr:`~LayerBlock.recomputes`, one
    forward hook whose result replaces the output. ``wrap`` is applied to the hooks (e.g.
    to keep them out of ``torch.compile``'s tracing). A tap that is an :class:`OutputTap`
    gets the module's output once left, and its result replaces the output; its
    :class:`RefusedCall` is handed to ``refuse(layer, why)`` (the module's later
    forwards are tapped for its other layers only), or without ``refuse`` raised as a
    ValueError that names the ``skip_layers=`` leaving the layer out.

    Example:
        >>> import torch
        >>> from kfac_func.blocks import register
        >>> attn = torch.nn.MultiheadAttention(4, 1)
        >>> seen = []
        >>> handles = tap_hooks(attn, list(register(attn).values()),
        ...                     lambda: lambda spec, x, out: seen.append(spec.name) or out)
        >>> _ = attn(*(torch.randn(3, 1, 4),) * 3)
        >>> seen
        ['q_proj', 'k_proj', 'v_proj', 'out_proj']
    """
    block = specs[0].block
    if block.recomputes:

        def after(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> Any:
            s = site()
            return None if s is None else block.recompute(mod, specs, s, args, kwargs, out)

        return [module.register_forward_hook(wrap(after), with_kwargs=True)]
    open_taps: list[Any] = []
    refused: set[str] = set()

    def pre(mod: nn.Module, args: tuple[Any, ...]) -> None:
        live = [spec for spec in specs if spec.name not in refused]
        s = site() if live else None
        if s is None:
            open_taps.append(None)
            return
        ctx = specs[0].block.tap(mod, live, s)
        ctx.__enter__()
        open_taps.append(ctx)

    def post(mod: nn.Module, args: tuple[Any, ...], out: Any) -> Any:
        ctx = open_taps.pop() if open_taps else None
        if ctx is None:
            return None
        if out is None:  # the forward raised
            err = _Interrupted("forward raised")
            ctx.__exit__(type(err), err, None)
            return None
        ctx.__exit__(None, None, None)
        if not isinstance(ctx, OutputTap):
            return None
        try:
            new = ctx.returned(out)
        except RefusedCall as err:
            if refuse is None:
                skip = "^" + re.escape(err.layer) + "$"
                raise ValueError(f"{err}. Leave the layer out: skip_layers=[{skip!r}]") from None
            refused.add(err.layer)
            refuse(err.layer, str(err))
            return None
        return None if new is out else new

    return [
        module.register_forward_pre_hook(wrap(pre)),
        module.register_forward_hook(wrap(post), always_call=True),
    ]
