"""Module classes of the user's handled as a registered kind: ``register(..., kinds=...)``.

A model may compute a layer norm, an RMS norm or a linear map with a class of its own
(nanoGPT's ``LayerNorm``, transformers' ``LlamaRMSNorm``), which no kind recognises.
``kinds={MyLayerNorm: "layer_norm"}`` (or ``{MyLayerNorm: ("layer_norm", {"eps": 1e-5})}``)
maps the class, and its subclasses, to a kind whose :attr:`~LayerBlock.mappable` is set.
The mapping is checked twice:

- at registration, against the module's own parameters (:func:`mapped_params`: a
  ``weight`` and an optional ``bias`` of the shapes the kind needs, nothing else);
- on the module's first call (:func:`check_call`, run by the forward hooks of
  :func:`checking`): the kind's own computation of the output from the call's input
  (:meth:`LayerBlock.output`) must equal the module's output up to rounding, else a
  ValueError names the module, its class, the kind and the largest difference.

Modules that a kind recognises by themselves are checked the same way on their first call
when their class is not the kind's own torch class (a subclass of ``nn.Embedding`` or
``nn.Linear``, Hugging Face's ``Conv1D`` recognised by its name): such a class may override
``forward`` (OPT's learned positions add an offset to positions they compute from the
attention mask; Gemma's word embedding multiplies by ``sqrt(d)``), and its factors would
then describe another computation. :func:`checked_modules` lists what each registered
layer's first calls are checked against; a module that fails is refused (the
preconditioners leave its parameters to another optimizer, with a warning naming it,
:func:`kfac_func.capture` raises) instead of being preconditioned with wrong factors.
"""

from __future__ import annotations

import contextlib
import re
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn

from kfac_func.blocks.registry import block_of, blocks

if TYPE_CHECKING:
    from kfac_func.blocks.base import LayerBlock
    from kfac_func.blocks.spec import LayerSpec

__all__ = [
    "KNOWN_KINDS",
    "CheckedModule",
    "KindMap",
    "call_mismatch",
    "check_call",
    "check_hooks",
    "checked_modules",
    "checking",
    "class_path",
    "mapped_block",
    "mapped_params",
    "mapping_error",
    "overrides_forward",
    "parse_kinds",
]

KindMap = Mapping[type[nn.Module], "str | tuple[str, Mapping[str, Any]]"]
"""``{module class: kind}`` or ``{module class: (kind, options)}``."""

Parsed = dict[type[nn.Module], tuple["LayerBlock", dict[str, Any]]]

# the specs whose module's first call matched the kind (the check runs once per mapping)
_CHECKED: weakref.WeakKeyDictionary[nn.Module, set[LayerSpec]] = weakref.WeakKeyDictionary()

# how many units in the last place of the output dtype a mapped module's output may differ
# from the kind's computation (float64) by, relative to the output's largest entry
_ULPS = 64


def class_path(cls: type) -> str:
    """``module.QualName`` of a class, as error messages and the layer table name it.

    Example:
        >>> from torch import nn
        >>> class_path(nn.LayerNorm)
        'torch.nn.modules.normalization.LayerNorm'
    """
    return f"{cls.__module__}.{cls.__qualname__}"


def _mappable() -> list[str]:
    return sorted(b.kind for b in blocks() if b.mappable)


def parse_kinds(kinds: KindMap | None) -> Parsed:
    """``{class: (block, options)}`` of a ``kinds=`` argument, each entry checked: a module
    class, a mappable kind, options that kind takes.

    Example:
        >>> from torch import nn
        >>> class MyNorm(nn.Module): ...
        >>> block, options = parse_kinds({MyNorm: ("layer_norm", {"eps": 1e-6})})[MyNorm]
        >>> block.kind, options
        ('layer_norm', {'eps': 1e-06})
    """
    if kinds is None:
        return {}
    if not isinstance(kinds, Mapping):
        raise TypeError(f"kinds must be a mapping {{module class: kind}}, got {type(kinds)}")
    out: Parsed = {}
    for cls, value in kinds.items():
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise TypeError(f"kinds: keys must be nn.Module classes, got {cls!r}")
        if isinstance(value, str):
            kind, options = value, {}
        elif (
            isinstance(value, tuple)
            and len(value) == 2
            and isinstance(value[0], str)
            and isinstance(value[1], Mapping)
        ):
            kind, options = value[0], dict(value[1])
        else:
            raise TypeError(
                f"kinds[{cls.__name__}]: expected a kind name or (kind, {{option: value}}), "
                f"got {value!r}"
            )
        try:
            block = block_of(kind)
        except ValueError:
            raise ValueError(
                f"kinds[{cls.__name__}]: unknown layer kind {kind!r}; kinds a module class "
                f"may be mapped to: {_mappable()}"
            ) from None
        if not block.mappable:
            raise ValueError(
                f"kinds[{cls.__name__}]: kind {kind!r} cannot be given to a module class of "
                f"its own; kinds a module class may be mapped to: {_mappable()}"
            )
        unknown = sorted(set(options) - set(block.mapped_options))
        if unknown:
            raise ValueError(
                f"kinds[{cls.__name__}]: kind {kind!r} takes the options "
                f"{list(block.mapped_options)}, got {unknown}"
            )
        out[cls] = (block, options)
    return out


_TRANSFORMERS_RMS_NORMS = (
    "llama.LlamaRMSNorm",
    "mistral.MistralRMSNorm",
    "mixtral.MixtralRMSNorm",
    "qwen2.Qwen2RMSNorm",
    "qwen2_moe.Qwen2MoeRMSNorm",
    "qwen3.Qwen3RMSNorm",
    "qwen3_moe.Qwen3MoeRMSNorm",
    "t5.T5LayerNorm",
    "mt5.MT5LayerNorm",
    "phi3.Phi3RMSNorm",
    "olmo2.Olmo2RMSNorm",
    "granite.GraniteRMSNorm",
    "deepseek_v3.DeepseekV3RMSNorm",
    "smollm3.SmolLM3RMSNorm",
    "mamba.MambaRMSNorm",
)

_TRANSFORMERS_OFFSET_RMS_NORMS = (
    "gemma.GemmaRMSNorm",
    "gemma2.Gemma2RMSNorm",
    "gemma3.Gemma3RMSNorm",
    "vaultgemma.VaultGemmaRMSNorm",
    "t5gemma.T5GemmaRMSNorm",
)

KNOWN_KINDS: dict[str, str | tuple[str, dict[str, Any]]] = {
    **{
        f"transformers.models.{m}.modeling_{m}.{c}": "rms_norm"
        for m, c in (n.split(".") for n in _TRANSFORMERS_RMS_NORMS)
    },
    **{
        f"transformers.models.{m}.modeling_{m}.{c}": ("rms_norm", {"offset": 1.0})
        for m, c in (n.split(".") for n in _TRANSFORMERS_OFFSET_RMS_NORMS)
    },
}
"""Classes of well-known model code mapped without ``kinds=`` (by ``module.QualName``, so
that nothing is imported), to a kind or ``(kind, options)``: Hugging Face ``transformers``'
RMS norms that compute ``weight · x / sqrt(mean(x²) + eps)`` (``eps`` their
``variance_epsilon``), as ``nn.RMSNorm`` does, and Gemma's, which scale by ``1 + weight``
(``offset`` 1). Their first call is checked like any mapping. A ``kinds=`` entry for a
class wins."""


def mapped_block(module: nn.Module, parsed: Parsed) -> tuple[LayerBlock, dict[str, Any]] | None:
    """The ``(block, options)`` ``kinds=`` maps ``module``'s class (or its nearest mapped
    base class) to, else the kind :data:`KNOWN_KINDS` gives its class, or None.

    Example:
        >>> from torch import nn
        >>> mapped_block(nn.ReLU(), {}) is None
        True
    """
    for cls in type(module).__mro__:
        if cls in parsed:
            return parsed[cls]
    known = KNOWN_KINDS.get(class_path(type(module)))
    if known is None:
        return None
    kind, options = (known, {}) if isinstance(known, str) else known
    return block_of(kind), dict(options)


def mapping_error(
    name: str, module: nn.Module, kind: str, why: str, known: bool | None = None
) -> ValueError:
    """A ValueError naming the module, its class and the kind ``kinds=`` (or, ``known``,
    :data:`KNOWN_KINDS`; None: whichever names its class) mapped it to."""
    path = class_path(type(module))
    if known is None:
        known = path in KNOWN_KINDS
    by = "KNOWN_KINDS (override it with kinds=)" if known else "kinds="
    return ValueError(f"module {name!r} ({path}) is mapped to kind {kind!r} by {by}, but {why}")


def mapped_params(
    name: str, module: nn.Module, kind: str
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The module's own ``weight`` and ``bias`` (None when absent or None); a ValueError
    names the module unless those are its only parameters and ``weight`` is one."""
    own = dict(module.named_parameters(recurse=False))
    others = sorted(set(own) - {"weight", "bias"})
    if "weight" not in own or others:
        raise mapping_error(
            name,
            module,
            kind,
            f"the kind needs the parameters 'weight' and optionally 'bias', and the module "
            f"has {sorted(own)}",
        )
    return own["weight"], own.get("bias")


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
        hint = spec.block.mismatch_hint(spec, params, xd, got, tol)
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
        >>> class Positions(nn.Embedding):
        ...     def forward(self, mask):
        ...         return super().forward(mask.cumsum(-1) + 2)
        >>> model = nn.Sequential(nn.Linear(2, 2), Positions(8, 2))
        >>> [(c.module, c.spec.kind, c.mapped) for c in checked_modules(register(model))]
        [('1', 'embedding', False)]
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
