"""First calls checked: a module registered under a kind computes what the kind computes.

A kind's factors describe the map the kind computes (:meth:`LayerBlock.output`). A module
mapped to a kind with ``kinds=`` (or :data:`~kfac_func.blocks.mapped.KNOWN_KINDS`), and a
module a kind recognised by itself whose class is not the kind's own torch class (a
subclass of ``nn.Linear``, Hugging Face's ``Conv1D`` recognised by its name, an embedding
whose scale is read from an attribute), is checked on its first call:
the kind's computation of the output from the call's input, in float64, must equal the
module's output up to rounding (:func:`call_mismatch`). :func:`checked_modules` lists what
each registered layer's first calls are checked against (:meth:`LayerBlock.checked_calls`).

A mapped module that fails raises a ValueError naming the module, its class, the kind and
the largest difference (:func:`check_call`). A recognised module that fails is refused: the
preconditioners leave its layer to the other optimizer with a warning naming it
(:mod:`kfac_func.adapter.fallback`), :func:`kfac_func.capture` raises a ValueError with the
``skip_layers=`` that leaves it out (:func:`checking`). Subclasses that keep the forward, or
override it with the same computation, pass. Kinds that check every call themselves
(:attr:`LayerBlock.checks_itself`: a subclass of ``nn.Embedding`` that overrides
``forward``, whose lookup is recorded, :mod:`kfac_func.blocks.recorded_embedding`) are not
checked here.
"""

from __future__ import annotations

import contextlib
import inspect
import re
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import torch
from torch import nn

from kfac_func.blocks.mapped import class_path, mapping_error
from kfac_func.blocks.spec import CheckedCall, LayerSpec

__all__ = [
    "CheckedModule",
    "Refuse",
    "call_mismatch",
    "check_call",
    "check_hooks",
    "checked_modules",
    "checking",
    "forward_source",
    "overrides_forward",
]

# the specs whose module's first call matched the kind (the check runs once per mapping)
_CHECKED: weakref.WeakKeyDictionary[nn.Module, set[LayerSpec]] = weakref.WeakKeyDictionary()

# how many units in the last place of the output dtype a mapped module's output may differ
# from the kind's computation (float64) by, relative to the output's largest entry
_ULPS = 64


def call_mismatch(spec: LayerSpec, module: nn.Module, x: Any, out: Any) -> str | None:
    """Why ``module``'s output ``out`` for the input ``x`` is not what ``spec``'s kind
    computes from ``x`` (:meth:`LayerBlock.output`, in float64) up to rounding in ``out``'s
    dtype, or None when it is. Inputs, outputs and parameters the check cannot read (meta
    tensors, batched tensors of ``vmap``, tensor subclasses such as DTensors) pass.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from kfac_func.blocks import register
        >>> emb = nn.Embedding(4, 2)
        >>> spec = register(emb)[""]
        >>> ids = torch.tensor([[0, 3]])
        >>> call_mismatch(spec, emb, ids, emb(ids)) is None
        True
        >>> print(call_mismatch(spec, emb, ids, 2 * emb(ids)))  # doctest: +ELLIPSIS
        its output differs from ... by up to ...; it is 2 times what the kind computes (a ...
    """
    found = _mismatch(spec, module, x, out)
    if found is None:
        return None
    why, hint = found
    return f"{why}; {hint}" if hint else why


def _mismatch(
    spec: LayerSpec, module: nn.Module, x: Any, out: Any
) -> tuple[str, str | None] | None:
    """``(why, what the module computes instead or None)`` of :func:`call_mismatch`."""
    if not (_readable(x) and _readable(out)):
        return None
    weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
    if not _readable(weight) or (isinstance(bias, torch.Tensor) and not _readable(bias)):
        return None  # sharded parameters (FSDP2, tensor parallelism): not read here
    assert isinstance(weight, torch.Tensor)
    params = {"weight": weight.detach().double()}
    if isinstance(bias, torch.Tensor):
        params["bias"] = bias.detach().double()
    xd = x.detach()
    xd = xd.double() if xd.is_floating_point() else xd
    try:
        with torch.autocast(xd.device.type, enabled=False):  # float64, whatever the region
            ref = spec.block.output(spec, params, xd)
    except (ValueError, IndexError, RuntimeError) as err:
        return f"its input {_shape(x)} does not fit what the kind computes ({err})", None
    got = out.detach().double()
    if ref.shape != got.shape:
        return (
            f"its output has shape {tuple(got.shape)} where the kind computes "
            f"{tuple(ref.shape)} from its input {_shape(x)}"
        ), None
    diff = float((ref - got).abs().max()) if got.numel() else 0.0
    top_ref = float(ref.abs().max()) if ref.numel() else 0.0
    top_got = float(got.abs().max()) if got.numel() else 0.0
    dtype = out.dtype if out.is_floating_point() else torch.float32
    # a module may compute in float32 inside a float64 model (transformers' RMS norms do)
    eps = max(torch.finfo(dtype).eps, torch.finfo(torch.float32).eps)
    tol = _ULPS * eps * max(top_ref, top_got, torch.finfo(dtype).tiny)
    if diff <= tol:
        return None
    why = (
        f"its output differs from what the kind computes from the same input by up to "
        f"{diff:.3g} (largest entry of the module's output {top_got:.3g}, of the kind's "
        f"{top_ref:.3g}; allowed {tol:.3g} in {dtype})"
    )
    with torch.autocast(xd.device.type, enabled=False):
        hint = spec.block.mismatch_hint(spec, CheckedCall(params, xd, got, tol))
    if hint is not None:  # the mappings it suggests, for this class
        hint = hint.replace("kinds={cls:", f"kinds={{{type(module).__name__}:")
    return why, hint


def check_call(spec: LayerSpec, module: nn.Module, x: Any, out: Any) -> None:
    """Raise a ValueError naming the module unless its output ``out`` for input ``x``
    equals the output of its mapped kind (:func:`call_mismatch`).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from kfac_func.blocks import register
        >>> class Scale(nn.Module):  # not a layer norm: no normalisation
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.weight = nn.Parameter(torch.ones(3))
        ...     def forward(self, x):
        ...         return x * self.weight
        >>> model = Scale()
        >>> spec = register(model, kinds={Scale: "layer_norm"})[""]
        >>> x = torch.tensor([[1.0, 2.0, 4.0]])
        >>> check_call(spec, model, x, model(x))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: module '' (...Scale) is mapped to kind 'layer_norm' by kinds=, but ...
    """
    found = _mismatch(spec, module, x, out)
    if found is None:
        return
    why, hint = found
    if hint is None:
        options = {k: v for k, v in spec.options if k in spec.block.mapped_options}
        hint = f"the module computes something else{_with(options)}"
    known = spec.option("mapped_by") == "KNOWN_KINDS"
    raise mapping_error(spec.name, module, spec.kind, f"on its first call {why}; {hint}", known)


def overrides_forward(module: nn.Module, base: tuple[type[nn.Module], ...]) -> bool:
    """Whether ``module``'s class defines a ``forward`` of its own, not that of the first
    of ``base`` among its base classes (True when none of ``base`` is one).

    Example:
        >>> from torch import nn
        >>> class Plain(nn.Linear): ...
        >>> class Own(nn.Linear):
        ...     def forward(self, x):
        ...         return super().forward(x) + 1
        >>> overrides_forward(Plain(2, 2), (nn.Linear,)), overrides_forward(Own(2, 2), (nn.Linear,))
        (False, True)
    """
    cls = type(module)
    owner = next((c for c in cls.__mro__ if c in base), None)
    return owner is None or cls.forward is not owner.forward


_SOURCES: dict[type[nn.Module], str] = {}


def forward_source(cls: type[nn.Module]) -> str:
    """The source of ``cls.forward`` (through its decorators), or ``""`` where Python
    has none (a class defined in a session, a compiled one); cached by class.

    Example:
        >>> from torch import nn
        >>> "F.linear(input, self.weight, self.bias)" in forward_source(nn.Linear)
        True
    """
    if cls not in _SOURCES:
        try:
            _SOURCES[cls] = inspect.getsource(inspect.unwrap(cls.forward))
        except (OSError, TypeError):
            _SOURCES[cls] = ""
    return _SOURCES[cls]


class CheckedModule(NamedTuple):
    """A module whose first call is checked for a registered layer: the module's name,
    the spec its output is computed with (:meth:`LayerBlock.output`), the registered
    layer it belongs to, and whether the module was mapped to the kind (``kinds=`` or
    :data:`KNOWN_KINDS`: a mismatch is an error) or recognised by the kind (a subclass,
    a class name: a mismatch refuses the layer)."""

    module: str
    spec: LayerSpec
    layer: str
    mapped: bool


def checked_modules(specs: Mapping[str, LayerSpec]) -> list[CheckedModule]:
    """The modules whose first call is checked, for the layers ``specs``
    (:meth:`LayerBlock.checked_calls`).

    Example:
        >>> from torch import nn
        >>> from kfac_func.blocks import register
        >>> class Shifted(nn.Linear):
        ...     def forward(self, x):
        ...         return super().forward(x) + 1.0
        >>> model = nn.Sequential(nn.Linear(2, 2), Shifted(2, 2))
        >>> [(c.module, c.spec.kind, c.mapped) for c in checked_modules(register(model))]
        [('1', 'linear', False)]
    """
    return [
        CheckedModule(module, spec, layer.name, mapped)
        for layer in specs.values()
        for module, spec, mapped in layer.block.checked_calls(layer)
    ]


def _refusal(check: CheckedModule, module: nn.Module, why: str) -> str:
    """The message of a module recognised by a kind (not mapped) whose first call does
    not compute what the kind computes."""
    spec = check.spec
    path = class_path(type(module))
    cls = type(module).__name__
    base = spec.block.module_types
    if not base:
        what = f"{cls} (recognised by its class name) computes something else"
    elif overrides_forward(module, base):
        what = f"{cls} overrides forward"
    else:
        what = f"{cls} computes something else"
    part = "" if check.layer == check.module else f" (part of layer {check.layer!r})"
    return (
        f"module {check.module!r} ({path}){part} was registered as kind {spec.kind!r}, but "
        f"{what}: its output is not {spec.block.formula(spec)} of the input the hooks see; "
        f"{why}"
    )


def _with(options: dict[str, Any]) -> str:
    if not options:
        return ""
    shown = ", ".join(f"{k}={v!r}" for k, v in sorted(options.items()))
    return f", or with other options than {shown} (give them as kinds={{cls: (kind, {{...}})}})"


def _shape(x: Any) -> str:
    return f"of shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else f"{type(x).__name__}"


def _readable(t: Any) -> bool:
    if not isinstance(t, torch.Tensor) or t.device.type == "meta":
        return False
    if type(t) not in (torch.Tensor, nn.Parameter):
        return False
    return not torch._C._functorch.is_batchedtensor(t)


@contextlib.contextmanager
def checking(model: nn.Module, specs: Mapping[str, LayerSpec]) -> Iterator[None]:
    """While entered, forward hooks check the first call of every module whose output the
    layers ``specs`` rely on (:func:`checked_modules`); modules already checked are not
    hooked. A mismatch raises a ValueError naming the module (for a module recognised
    by a kind, with the ``skip_layers=`` that leaves its layer out).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(2, 2))
        >>> with checking(model, {}):
        ...     _ = model(torch.ones(1, 2))
    """
    handles = check_hooks(model, specs)
    try:
        yield
    finally:
        for h in handles:
            h.remove()


Refuse = Callable[[str, str], None]
"""``(layer, why) -> None``: what a preconditioner does with a layer whose module's first
call is not what the layer's kind computes."""


def check_hooks(
    model: nn.Module,
    specs: Mapping[str, LayerSpec],
    refuse: Refuse | None = None,
    wrap: Callable[[Callable[..., None]], Callable[..., None]] | None = None,
) -> list[Any]:
    """The handles of forward hooks (run before the module's other forward hooks) that
    check the first call of each module of :func:`checked_modules` (the preconditioners
    keep them with their other hooks). A mapped module that fails raises
    :func:`mapping_error`; a module recognised by its kind that fails is handed to
    ``refuse(layer, why)`` (once), or without ``refuse`` raises a ValueError naming it.
    ``wrap`` wraps each hook (the preconditioners' keep it out of ``torch.compile``'s
    graphs, as their other hooks).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from kfac_func.blocks import register
        >>> class Shifted(nn.Linear):
        ...     def forward(self, x):
        ...         return super().forward(x) + 1.0
        >>> model = nn.Sequential(Shifted(2, 2))
        >>> refused = {}
        >>> handles = check_hooks(model, register(model), refused.__setitem__)
        >>> _ = model(torch.ones(1, 2))
        >>> print(refused["0"])  # doctest: +ELLIPSIS
        module '0' (...Shifted) was registered as kind 'linear', but Shifted overrides forward: ...
    """
    handles = []
    for check in checked_modules(specs):
        module = model.get_submodule(check.module)
        if check.spec in _CHECKED.get(module, ()):
            continue
        hook = _check_hook(check, refuse)
        if wrap is not None:
            hook = wrap(hook)
        handles.append(module.register_forward_hook(hook, prepend=True))
    return handles


def _check_hook(check: CheckedModule, refuse: Refuse | None) -> Callable[..., None]:
    """The forward hook of :func:`check_hooks` for one module."""
    refused = False

    def hook(m: nn.Module, args: tuple[Any, ...], out: Any) -> None:
        nonlocal refused
        if refused or not args or check.spec in _CHECKED.get(m, ()):
            return
        why = call_mismatch(check.spec, m, args[0], out)
        if why is None:
            if _readable(args[0]) and _readable(out):
                _CHECKED.setdefault(m, set()).add(check.spec)
            return
        if check.mapped:
            check_call(check.spec, m, args[0], out)
        message = _refusal(check, m, why)
        if refuse is None:
            skip = "^" + re.escape(check.layer) + "$"
            raise ValueError(f"{message}. Leave the layer out: skip_layers=[{skip!r}]")
        refused = True
        refuse(check.layer, message)

    return hook
