"""Layers whose parent's forward uses their weight directly: the module itself is never
called.

Some models hand a child's parameters to a function instead of calling the child: the
Mamba mixer of transformers applies its depthwise ``conv1d`` as
``F.conv1d(x, conv1d.weight.squeeze(1).unsqueeze(1), conv1d.bias, padding=..., groups=...)``
and its ``dt_proj`` as ``dt_proj.weight @ x`` (its bias added later, inside the scan).
Hooks on the child see nothing, so the layer would get no statistics.

Such a child is found at registration from its parent's source: the parent's ``forward``
reads ``self.<child>.weight`` and never calls ``self.<child>(...)``. Its layer is fed by
the parent's calls (its :attr:`~kfac_func.blocks.spec.LayerSpec.module` is the parent),
and while the parent's forward runs a ``torch.overrides.TorchFunctionMode``
(:class:`WeightUseTap`) sees every torch function the forward calls. It reports the one
call that computes the layer's map as the layer's call:

- ``F.linear(x, weight, bias)`` and ``F.conv1d`` / ``F.conv2d`` with the child's weight
  (or a view of it of the weight's own shape, as ``squeeze(1).unsqueeze(1)`` gives), the
  child's bias and the child's own stride, padding, dilation and groups (a convolution
  padding with zeros): exactly the child's call, and the child's kind's statistics;
- ``weight @ x`` (a ``matmul`` with the weight on the left): the Linear map of the rows
  ``xᵀ`` without a bias, reported as ``(xᵀ, outᵀ)``. A product cannot take a bias, and
  the parent's later use of it is not seen, so the layer of a Linear child used this way
  holds its weight alone (found in the source as ``self.<child>.weight @``); its bias is
  left to the other optimizer.

Any other use of the weight or of a view of it in a tensor computation, a second use, or
none in a forward refuses the layer: the preconditioners leave it to the other optimizer
with a warning naming it, :func:`kfac_func.capture` raises a ValueError naming the
``skip_layers=`` that leaves it out. Reading the weight's shape, dtype or device is no
use. (With a fused kernel installed, the Mamba mixer hands the weights to the kernel: the
layers are refused so.)
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils import _pytree as pytree

from kfac_func.blocks.checks import forward_source
from kfac_func.blocks.spec import LayerSpec
from kfac_func.blocks.taps import ModeTap, RefusedCall, Site, computes

__all__ = ["WeightUseTap", "used_by_parent"]

# the kinds whose child may be used by its parent, and the calls that are their map
_CONVS = {"conv1d": (F.conv1d, 1), "conv2d": (F.conv2d, 2)}
_KINDS = ("linear", *_CONVS)
_CONV_ARGS = ("stride", "padding", "dilation", "groups")


def used_by_parent(
    spec: LayerSpec, module: nn.Module, parent_name: str, parent: nn.Module | None
) -> LayerSpec | str | None:
    """``spec`` fed by its parent's forward when that forward uses the module's weight
    and never calls the module (see the module docstring); a reason to skip it when the
    use cannot be its map; None when the parent calls the module (or does not name it).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from kfac_func.blocks import register
        >>> class Mixer(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.proj = nn.Linear(2, 3)
        ...     def forward(self, x):  # (N, 2, T) -> (N, 3, T), the bias added apart
        ...         return self.proj.weight @ x + self.proj.bias[:, None]
        >>> spec = register(nn.Sequential(Mixer()))["0.proj"]
        >>> spec.module, spec.bias, spec.factor_shapes
        ('0', None, ((2, 2), (3, 3)))
    """
    attr = spec.name.rpartition(".")[2]
    if (
        parent is None
        or spec.kind not in _KINDS
        or spec.name != spec.module
        or spec.options
        or getattr(parent, attr, None) is not module
    ):
        return None
    source = forward_source(type(parent))
    me = rf"self\.{re.escape(attr)}"
    if re.search(rf"{me}\.weight\b", source) is None or re.search(rf"{me}\s*\(", source):
        return None
    options: dict[str, Any] = {"module": parent_name, "used_by_parent": True}
    if re.search(rf"{me}\.weight\s*@", source):
        if spec.kind != "linear":
            return f"its parent ({type(parent).__name__}) multiplies its weight (weight @ x)"
        if spec.bias is not None:  # a product takes no bias
            spec, options["bias_apart"] = dataclasses.replace(spec, bias=None), True
    return dataclasses.replace(spec, options=tuple(sorted(options.items())))


class WeightUseTap(ModeTap):
    """Reports, while entered around one forward of ``parent``, the call of each layer of
    ``specs`` (children whose weights the forward uses) to ``site``; the layer is refused
    when the forward uses the weight otherwise (see the module docstring)."""

    def __init__(self, parent: nn.Module, specs: Sequence[LayerSpec], site: Site) -> None:
        super().__init__()
        self.site = site
        self.children = {
            spec.name: (parent.get_submodule(spec.name.rpartition(".")[2]), spec) for spec in specs
        }
        self.seen: dict[str, int] = dict.fromkeys(self.children, 0)
        self.problems: dict[str, str] = {}
        self.views: list[tuple[torch.Tensor, str]] = []  # views of the weights made so far

    def called(
        self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        leaves = pytree.tree_leaves((args, kwargs))
        owners = {o for o in map(self._owner, leaves) if o is not None}
        if not owners:
            return func(*args, **kwargs)
        (name, *others) = sorted(owners)
        child, spec = self.children[name]
        use = None if others else self._use(func, args, kwargs, child, spec)
        out = func(*args, **kwargs)
        if use is not None:
            self.seen[name] += 1
            x, to_layer = use
            return to_layer(self.site(spec, x, to_layer(out)))
        if isinstance(out, torch.Tensor) and out._base is not None and self._owner(out._base):
            self.views.append((out, name))  # a reshaping of the weight: no computation yet
        elif computes(out):
            for owner in owners:
                what = getattr(func, "__name__", str(func))
                self.problems.setdefault(owner, f"uses its weight otherwise (in {what})")
        return out

    def _owner(self, t: Any) -> str | None:
        """The layer whose weight ``t`` is (or a view of it made in this forward)."""
        if not isinstance(t, torch.Tensor):
            return None
        for name, (child, _) in self.children.items():
            if t is child.weight:
                return name
        return next((name for view, name in self.views if t is view), None)

    def _use(
        self,
        func: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        child: nn.Module,
        spec: LayerSpec,
    ) -> tuple[torch.Tensor, Callable[[Any], Any]] | None:
        """``(input, map to the layer's output layout and back)`` when the call computes
        the layer's map (see the module docstring), else None."""
        same = lambda t: t  # noqa: E731
        if (
            spec.bias is None
            and spec.kind == "linear"
            and func in (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__)
        ):
            if len(args) == 2 and not kwargs and self._owner(args[0]) and _whole(args[0], child):
                x = args[1]
                if isinstance(x, torch.Tensor) and x.dim() >= 2:
                    return x.mT, lambda t: t.mT
            return None
        named = dict(zip(("input", "weight", "bias", *_CONV_ARGS), args))
        named.update(kwargs)
        weight, x = named.get("weight"), named.get("input")
        if not (isinstance(x, torch.Tensor) and isinstance(weight, torch.Tensor)):
            return None
        bias = child.bias if spec.bias is not None else None  # the layer's (a product's: none)
        if named.get("bias") is not bias or not _whole(weight, child):
            return None
        if spec.kind == "linear":
            return (
                (x, same)
                if func is F.linear and set(named) <= {"input", "weight", "bias"}
                else None
            )
        conv, dims = _CONVS[spec.kind]
        if func is not conv or child.padding_mode != "zeros":  # else it pads before the call
            return None
        for key in _CONV_ARGS:
            given, own = named.get(key, 1 if key != "padding" else 0), getattr(child, key)
            if _tuple(given, dims) != _tuple(own, dims):
                return None
        return x, same

    def returned(self, out: Any) -> Any:
        for name, (child, spec) in self.children.items():
            why = self.problems.get(name)
            if why is None and self.seen[name] != 1:
                why = f"its forward used it as the layer's map {self.seen[name]} times, not once"
            if why is not None:
                raise RefusedCall(name, _message(spec, child, why))
        return out


def _whole(t: torch.Tensor, child: nn.Module) -> bool:
    """Whether ``t`` holds the child's weight in the weight's own shape."""
    w = cast(torch.Tensor, child.weight)
    return t is w or (
        t._base is (w if w._base is None else w._base)
        and (t.shape, t.stride(), t.storage_offset()) == (w.shape, w.stride(), w.storage_offset())
    )


def _tuple(v: Any, dims: int) -> tuple[Any, ...]:
    return tuple(v) if isinstance(v, (tuple, list)) else (v,) * dims


def _message(spec: LayerSpec, child: nn.Module, why: str) -> str:
    return (
        f"layer {spec.name!r} ({type(child).__name__}, kind {spec.kind!r}) is not called: "
        f"module {spec.module!r} uses its weight in its forward, and {why}"
    )
