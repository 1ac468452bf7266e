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
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from kfac_func.blocks.registry import block_of, blocks

if TYPE_CHECKING:
    from kfac_func.blocks.base import LayerBlock
    from kfac_func.blocks.spec import LayerSpec

__all__ = [
    "KNOWN_KINDS",
    "KindMap",
    "check_call",
    "checking",
    "class_path",
    "mapped_block",
    "mapped_params",
    "mapping_error",
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
)

KNOWN_KINDS: dict[str, str] = {
    f"transformers.models.{m}.modeling_{m}.{c}": "rms_norm"
    for m, c in (n.split(".") for n in _TRANSFORMERS_RMS_NORMS)
}
"""Classes of well-known model code mapped without ``kinds=`` (by ``module.QualName``, so
that nothing is imported): Hugging Face ``transformers``' RMS norms that compute
``weight · x / sqrt(mean(x²) + eps)`` (``eps`` their ``variance_epsilon``), as
``nn.RMSNorm`` does. Their first call is checked like any mapping. Norms that scale by
``1 + weight`` (Gemma) are not among them. A ``kinds=`` entry for a class wins."""


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
    kind = KNOWN_KINDS.get(class_path(type(module)))
    return None if kind is None else (block_of(kind), {})


def mapping_error(name: str, module: nn.Module, kind: str, why: str) -> ValueError:
    """A ValueError naming the module, its class and the kind ``kinds=`` mapped it to."""
    path = class_path(type(module))
    by = "KNOWN_KINDS (override it with kinds=)" if path in KNOWN_KINDS else "kinds="
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


def check_call(spec: LayerSpec, module: nn.Module, x: Any, out: Any) -> None:
    """Raise a ValueError naming the module unless its output ``out`` for input ``x``
    equals the output of its mapped kind (:meth:`LayerBlock.output`, in float64) up to
    rounding in ``out``'s dtype. Inputs the check cannot read (meta tensors, batched
    tensors of ``vmap``, tensor subclasses) pass.

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
    if not (_readable(x) and _readable(out)):
        return
    weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
    if not isinstance(weight, torch.Tensor):
        return
    params = {"weight": weight.detach().double()}
    if isinstance(bias, torch.Tensor):
        params["bias"] = bias.detach().double()
    xd = x.detach()
    try:
        ref = spec.block.output(spec, params, xd if not xd.is_floating_point() else xd.double())
    except ValueError as err:
        why = f"its input does not fit: {err}"
        raise mapping_error(spec.name, module, spec.kind, why) from None
    got = out.detach().double()
    if ref.shape != got.shape:
        raise mapping_error(
            spec.name,
            module,
            spec.kind,
            f"its output has shape {tuple(got.shape)} where the kind computes {tuple(ref.shape)}",
        )
    diff = float((ref - got).abs().max()) if got.numel() else 0.0
    scale = float(ref.abs().max()) if ref.numel() else 0.0
    dtype = out.dtype if out.is_floating_point() else torch.float32
    # a module may compute in float32 inside a float64 model (transformers' RMS norms do)
    eps = max(torch.finfo(dtype).eps, torch.finfo(torch.float32).eps)
    tol = _ULPS * eps * max(scale, torch.finfo(dtype).tiny)
    if not diff <= tol:
        options = {k: v for k, v in spec.options if k in spec.block.mapped_options}
        raise mapping_error(
            spec.name,
            module,
            spec.kind,
            f"on its first call its output differs from what the kind computes from the "
            f"same input by up to {diff:.3g} (largest output {scale:.3g}, allowed {tol:.3g} "
            f"in {dtype}); the module computes something else{_with(options)}",
        )


def _with(options: dict[str, Any]) -> str:
    if not options:
        return ""
    shown = ", ".join(f"{k}={v!r}" for k, v in sorted(options.items()))
    return f", or with other options than {shown} (give them as kinds={{cls: (kind, {{...}})}})"


def _readable(t: Any) -> bool:
    if not isinstance(t, torch.Tensor) or t.device.type == "meta":
        return False
    if type(t) not in (torch.Tensor, nn.Parameter):
        return False
    return not torch._C._functorch.is_batchedtensor(t)


@contextlib.contextmanager
def checking(model: nn.Module, specs: Mapping[str, LayerSpec]) -> Iterator[None]:
    """While entered, forward hooks check the first call of every module mapped by
    ``kinds=`` (:func:`check_call`); modules already checked are not hooked.

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


def check_hooks(model: nn.Module, specs: Mapping[str, LayerSpec]) -> list[Any]:
    """The handles of forward hooks that check the first call of each mapped module (the
    preconditioners keep them with their other hooks)."""
    handles = []
    for spec in specs.values():
        if spec.option("mapped") is None:
            continue
        module = model.get_submodule(spec.module)
        if spec in _CHECKED.get(module, ()):
            continue

        def hook(m: nn.Module, args: tuple[Any, ...], out: Any, spec: LayerSpec = spec) -> None:
            if not args or spec in _CHECKED.get(m, ()):
                return
            check_call(spec, m, args[0], out)
            if _readable(args[0]) and _readable(out):
                _CHECKED.setdefault(m, set()).add(spec)

        handles.append(module.register_forward_hook(hook))
    return handles
