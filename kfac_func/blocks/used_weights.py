"""Parameters that a module's forward uses directly: a child module that is never called,
or a module's own per-channel scale.

Some models hand parameters to functions instead of calling modules: the Mamba mixer of
transformers applies its depthwise ``conv1d`` as
``F.conv1d(x, conv1d.weight.squeeze(1).unsqueeze(1), conv1d.bias, padding=..., groups=...)``,
its ``dt_proj`` as ``dt_proj.weight @ x`` with the bias added inside the scan
(``dt + bias[..., None]``), and its own ``D`` as ``x * D[None, :, None]``. Hooks on the
children see nothing, so these layers would get no statistics.

Such a child is found at registration from its parent's source: the parent's ``forward``
reads ``self.<child>.weight`` and never calls ``self.<child>(...)``; a module's own scale
is registered for the classes :data:`OWN_SCALES` names (kind ``"channel_scale"``,
:class:`~kfac_func.blocks.channel_norm.ChannelScaleBlock`). Their layers are fed by the
module's calls (their :attr:`~kfac_func.blocks.spec.LayerSpec.module` is the module that
uses them): while its forward runs, a ``torch.overrides.TorchFunctionMode``
(:class:`WeightUseTap`) sees every torch function the forward calls, follows the
parameters through views and dtype casts, and reports the one call that computes each
layer's map as the layer's call:

- ``F.linear(x, weight, bias)`` and ``F.conv1d`` / ``F.conv2d`` with the child's weight
  (or a view of it of the weight's own shape, as ``squeeze(1).unsqueeze(1)`` gives), the
  child's bias and the child's own stride, padding, dilation and groups (a convolution
  padding with zeros): exactly the child's call, and the child's kind's statistics;
- ``weight @ x`` (a ``matmul`` with the weight on the left, found in the source as
  ``self.<child>.weight @``): the Linear map of the rows ``xᵀ``, reported as
  ``(xᵀ, outᵀ)``. A child with a bias that the source names too keeps it, and the forward
  must add the bias (or a view or cast of it) once to the product itself, along the
  product's output features: the gradient of that sum is the product's, so the factors
  are the Linear layer's with its bias (without the bias in the source, the layer holds
  its weight alone and the bias goes to the other optimizer);
- ``x * s`` for a module's own scale ``s`` of ``C`` entries broadcast along one dimension
  of ``x`` of size ``C``: that dimension is the channel of the
  ``"channel_scale"`` kind.

Any other use of a layer's parameters (or of a view or cast of them) in a tensor
computation, a second use, or none in a forward refuses the layer: the preconditioners
leave it to the other optimizer with a warning naming it, :func:`kfac_func.capture`
raises a ValueError naming the ``skip_layers=`` that leaves it out. Reading a parameter's
shape, dtype or device is no use. (With a fused kernel installed, the Mamba mixer hands
the parameters to the kernel: the layers are refused so.)
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils import _pytree as pytree

from kfac_func.blocks.checks import forward_source
from kfac_func.blocks.mapped import class_path
from kfac_func.blocks.registry import block_of
from kfac_func.blocks.spec import LayerSpec
from kfac_func.blocks.taps import ModeTap, RefusedCall, Site, computes

__all__ = ["OWN_SCALES", "WeightUseTap", "own_scales", "used_by_parent"]

OWN_SCALES: dict[str, tuple[str, ...]] = {
    "transformers.models.mamba.modeling_mamba.MambaMixer": ("D",),
    "transformers.models.falcon_mamba.modeling_falcon_mamba.FalconMambaMixer": ("D",),
}
"""Classes of well-known model code (by ``module.QualName``) whose named own parameters
their forward uses as per-channel scales (``x * D[None, :, None]``): registered as
``"channel_scale"`` layers, each checked by its module's forward like the children."""

# the kinds whose child may be used by its parent, and the calls that are their map
_CONVS = {"conv1d": (F.conv1d, 1), "conv2d": (F.conv2d, 2)}
_KINDS = ("linear", *_CONVS)
_CONV_ARGS = ("stride", "padding", "dilation", "groups")
_MATMULS = (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__)
_ADDS = (torch.add, torch.Tensor.add, torch.Tensor.__add__, torch.Tensor.__radd__)
_MULS = (torch.mul, torch.Tensor.mul, torch.Tensor.__mul__, torch.Tensor.__rmul__)
_CASTS = frozenset({"to", "float", "double", "half", "bfloat16", "type", "type_as"})
_SCALE = "channel_scale"  # kfac_func.blocks.channel_norm.ChannelScaleBlock's kind

Role = tuple[str, str]
"""``(layer, "weight" | "bias" | "product")``: what a tensor of the forward is."""


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
        ...     def forward(self, x):  # (N, 2, T) -> (N, 3, T), the bias added to the product
        ...         return self.proj.weight @ x + self.proj.bias[:, None]
        >>> spec = register(nn.Sequential(Mixer()))["0.proj"]
        >>> spec.module, spec.bias, spec.factor_shapes
        ('0', '0.proj.bias', ((3, 3), (3, 3)))
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
        if spec.bias is not None and re.search(rf"{me}\.bias\b", source) is None:
            spec, options["bias_apart"] = dataclasses.replace(spec, bias=None), True
    return spec.with_options(**options)  # it had none


def own_scales(name: str, module: nn.Module) -> list[LayerSpec]:
    """The ``"channel_scale"`` layers of ``module``'s own parameters that
    :data:`OWN_SCALES` names for its class (those that are one-dimensional and train).

    Example:
        >>> own_scales("mixer", torch.nn.Linear(2, 2))
        []
    """
    out = []
    for attr in OWN_SCALES.get(class_path(type(module)), ()):
        p = module._parameters.get(attr)
        if isinstance(p, torch.Tensor) and p.dim() == 1 and p.requires_grad:
            out.append(block_of(_SCALE).own_spec(name, attr, p))  # type: ignore[attr-defined]
    return out


class WeightUseTap(ModeTap):
    """Reports, while entered around one forward of ``module``, the call of each layer of
    ``specs`` (children whose weights the forward uses, the module's own scales) to
    ``site``; a layer is refused when the forward uses its parameters otherwise (see the
    module docstring)."""

    def __init__(self, module: nn.Module, specs: Sequence[LayerSpec], site: Site) -> None:
        super().__init__()
        self.site = site
        self.layers: dict[str, tuple[nn.Module, LayerSpec]] = {}
        for spec in specs:
            own = spec.kind == _SCALE
            self.layers[spec.name] = (
                module if own else module.get_submodule(spec.name.rpartition(".")[2]),
                spec,
            )
        self.seen: dict[str, int] = dict.fromkeys(self.layers, 0)
        self.bias_added: dict[str, int] = dict.fromkeys(self.layers, 0)
        self.products: set[str] = set()  # layers used as weight @ x with their bias apart
        self.problems: dict[str, str] = {}
        self.aliases: list[tuple[torch.Tensor, Role]] = []  # views, casts, products

    def _parameter(self, name: str, role: str) -> torch.Tensor | None:
        """The layer's parameter as its module holds it now (torch.func and FSDP put
        theirs in place before the forward)."""
        owner, spec = self.layers[name]
        if role == "bias":
            return owner.bias if spec.bias is not None else None  # type: ignore[return-value]
        attr = spec.weight.rpartition(".")[2]
        return getattr(owner, attr)  # type: ignore[no-any-return]

    def _role(self, t: Any) -> Role | None:
        """What ``t`` is: a layer's parameter, a view or cast of one, or a product."""
        if not isinstance(t, torch.Tensor):
            return None
        for name in self.layers:
            for role in ("weight", "bias"):
                if t is self._parameter(name, role):
                    return (name, role)
        return next((role for alias, role in self.aliases if t is alias), None)

    def called(
        self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        leaves = pytree.tree_leaves((args, kwargs))
        tracked = [(leaf, r) for leaf, r in zip(leaves, map(self._role, leaves)) if r]
        if not tracked:
            return func(*args, **kwargs)
        roles = [r for _, r in tracked]
        params = [r for r in roles if r[1] != "product"]
        names = {name for name, _ in params}
        name = next(iter(names), "")
        use = self._use(func, args, kwargs, name) if len(names) == 1 else None
        out = func(*args, **kwargs)
        if use is not None:
            self.seen[name] += 1
            x, to_layer, from_layer = use
            spec = self.layers[name][1]
            new = from_layer(self.site(spec, x, to_layer(out)))
            if func in _MATMULS and spec.bias is not None:  # its bias comes apart: follow it
                self.products.add(name)
                self.aliases.append((new, (name, "product")))
            return new
        if self._adds_bias(func, args, kwargs, roles, out):
            self.bias_added[roles[0][0]] += 1
            return out
        if len(roles) == 1 and isinstance(out, torch.Tensor) and _follows(func, tracked[0][0], out):
            self.aliases.append((out, roles[0]))  # a view or a cast: no computation yet
        elif computes(out):
            what = getattr(func, "__name__", str(func))
            for layer, role in params:
                word = role if role == "bias" else self.layers[layer][1].weight.rpartition(".")[2]
                self.problems.setdefault(layer, f"uses its {word} otherwise (in {what})")
        return out

    def _use(
        self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], name: str
    ) -> tuple[torch.Tensor, Callable[[Any], Any], Callable[[Any], Any]] | None:
        """``(input, the output in the layer's layout, and back)`` when the call computes
        the layer ``name``'s map (see the module docstring), else None."""
        child, spec = self.layers[name]
        if spec.kind == _SCALE:
            return self._scaled(func, args, kwargs, name)
        same = lambda t: t  # noqa: E731
        weight = self._parameter(name, "weight")
        if spec.kind == "linear" and func in _MATMULS:
            if len(args) == 2 and not kwargs and _whole(args[0], weight):
                x = args[1]
                if isinstance(x, torch.Tensor) and x.dim() >= 2:
                    flip = lambda t: t.mT  # noqa: E731
                    return x.mT, flip, flip
            return None
        named = dict(zip(("input", "weight", "bias", *_CONV_ARGS), args))
        named.update(kwargs)
        x = named.get("input")
        if not (isinstance(x, torch.Tensor) and _whole(named.get("weight"), weight)):
            return None
        if named.get("bias") is not self._parameter(name, "bias"):
            return None
        if spec.kind == "linear":
            linear = func is F.linear and set(named) <= {"input", "weight", "bias"}
            return (x, same, same) if linear else None
        conv, dims = _CONVS[spec.kind]
        if func is not conv or child.padding_mode != "zeros":  # else it pads before the call
            return None
        for key in _CONV_ARGS:
            given, own = named.get(key, 1 if key != "padding" else 0), getattr(child, key)
            if _tuple(given, dims) != _tuple(own, dims):
                return None
        return x, same, same

    def _scaled(
        self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], name: str
    ) -> tuple[torch.Tensor, Callable[[Any], Any], Callable[[Any], Any]] | None:
        """``x * s`` with ``s`` (a view or cast of) the scale, broadcast along one
        dimension of ``x``: ``x`` with that dimension moved to 1, and the moves."""
        if func not in _MULS or kwargs or len(args) != 2:
            return None
        mine = [self._role(a) == (name, "weight") for a in args]
        scales = [a for a, m in zip(args, mine) if m]
        others = [a for a, m in zip(args, mine) if not m]
        if len(scales) != 1 or len(others) != 1:
            return None
        s, x = scales[0], others[0]
        if not (isinstance(x, torch.Tensor) and isinstance(s, torch.Tensor)) or x.dim() < 2:
            return None
        shape = (1,) * (x.dim() - s.dim()) + tuple(s.shape)
        wide = [k for k, n in enumerate(shape) if n != 1]
        units = self.layers[name][1].groups
        if len(shape) != x.dim() or len(wide) != 1 or shape[wide[0]] != units:
            return None
        if x.shape[wide[0]] != units:
            return None
        k = wide[0]
        return x.movedim(k, 1), lambda t: t.movedim(k, 1), lambda t: t.movedim(1, k)

    def _adds_bias(
        self,
        func: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        roles: list[Role],
        out: Any,
    ) -> bool:
        """Whether the call adds a layer's bias to its product, along the features."""
        if func not in _ADDS or kwargs or len(args) != 2 or len(roles) != 2:
            return False
        if len({n for n, _ in roles}) != 1 or sorted(r for _, r in roles) != ["bias", "product"]:
            return False
        product, bias = sorted(args, key=lambda a: self._role(a)[1] != "product")  # type: ignore[index]
        if not (isinstance(out, torch.Tensor) and out.shape == product.shape):
            return False
        shape = (1,) * (product.dim() - bias.dim()) + tuple(bias.shape)
        features = product.dim() - 2  # weight @ x: the features before the positions
        return (
            all(n == 1 for k, n in enumerate(shape) if k != features)
            and shape[features] == product.shape[features]
        )

    def returned(self, out: Any) -> Any:
        for name, (child, spec) in self.layers.items():
            why = self.problems.get(name)
            if why is None and self.seen[name] != 1:
                why = f"its forward used it as the layer's map {self.seen[name]} times, not once"
            if why is None and name in self.products and self.bias_added[name] != 1:
                why = (
                    f"its forward added its bias to its product {self.bias_added[name]} "
                    "times, not once"
                )
            if why is not None:
                raise RefusedCall(name, _message(spec, child, why))
        return out


def _follows(func: Callable[..., Any], t: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether ``out`` is a view of ``t`` (of the tensor it views) or a dtype cast of it."""
    if out._base is not None:
        return out._base is (t if t._base is None else t._base)
    return getattr(func, "__name__", "") in _CASTS and t.shape == out.shape


def _whole(t: Any, w: torch.Tensor | None) -> bool:
    """Whether ``t`` holds the parameter ``w`` in its own shape (``w`` or a view of it)."""
    if not isinstance(t, torch.Tensor) or w is None:
        return False
    return t is w or (
        t._base is (w if w._base is None else w._base)
        and (t.shape, t.stride(), t.storage_offset()) == (w.shape, w.stride(), w.storage_offset())
    )


def _tuple(v: Any, dims: int) -> tuple[Any, ...]:
    return tuple(v) if isinstance(v, (tuple, list)) else (v,) * dims


def _message(spec: LayerSpec, owner: nn.Module, why: str) -> str:
    what = "its own parameter" if spec.kind == _SCALE else "its weight"
    return (
        f"layer {spec.name!r} ({type(owner).__name__}, kind {spec.kind!r}) is not called: "
        f"module {spec.module!r} uses {what} in its forward, and {why}"
    )
