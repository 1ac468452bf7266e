"""Module classes of the user's handled as a registered kind: ``register(..., kinds=...)``.

A model may compute a layer norm, an RMS norm or a linear map with a class of its own
(nanoGPT's ``LayerNorm``, transformers' ``LlamaRMSNorm``), which no kind recognises.
``kinds={MyLayerNorm: "layer_norm"}`` (or ``{MyLayerNorm: ("layer_norm", {"eps": 1e-5})}``)
maps the class, and its subclasses, to a kind whose :attr:`~LayerBlock.mappable` is set.
The mapping is checked twice:

- at registration, against the module's own parameters (:func:`mapped_params`: a
  ``weight`` and an optional ``bias`` of the shapes the kind needs, nothing else);
- on the module's first call (:mod:`kfac_func.blocks.checks`): the kind's own computation
  of the output from the call's input (:meth:`LayerBlock.output`) must equal the module's
  output up to rounding, else a ValueError names the module, its class, the kind and the
  largest difference.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from kfac_func.blocks.registry import block_of, blocks

if TYPE_CHECKING:
    from kfac_func.blocks.base import LayerBlock

__all__ = [
    "BROADCAST_TABLE",
    "KNOWN_KINDS",
    "KindMap",
    "broadcast_table",
    "class_path",
    "mapped_block",
    "mapped_params",
    "mapping_error",
    "parse_kinds",
]

KindMap = Mapping[type[nn.Module], "str | tuple[str, Mapping[str, Any]]"]
"""``{module class: kind}`` or ``{module class: (kind, options)}``."""

Parsed = dict[type[nn.Module], tuple["LayerBlock", dict[str, Any]]]


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


BROADCAST_TABLE = (
    "a relative-position table ({cls}.{attr}): its lookup of (query, key) position "
    "buckets is one (T, T) input broadcast over the batch, so its gradient is the sum of "
    "the examples' and the per-example statistics K-FAC needs are lost (its factors would "
    "hold the square of the sum, not the sum of squares); its parameters are left to the "
    "other optimizer"
)


def broadcast_table(name: str, module: nn.Module, parent: nn.Module | None) -> str | None:
    """Why ``module`` (registered as ``name``, a child of ``parent``) is skipped when it is
    an embedding of relative-position buckets that the model broadcasts over the batch
    (T5 and the models built on its attention: an ``nn.Embedding`` named
    ``relative_attention_bias`` whose parent computes the bias with ``compute_bias``),
    else None.

    Example:
        >>> from torch import nn
        >>> class Attention(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.relative_attention_bias = nn.Embedding(32, 2)
        ...     def compute_bias(self, q, k): ...
        >>> att = Attention()
        >>> broadcast_table("relative_attention_bias", att.relative_attention_bias, att)[:45]
        'a relative-position table (Attention.relative'
    """
    attr = name.rpartition(".")[2]
    if (
        attr == "relative_attention_bias"
        and isinstance(module, nn.Embedding)
        and callable(getattr(parent, "compute_bias", None))
    ):
        return BROADCAST_TABLE.format(cls=type(parent).__name__, attr=attr)
    return None
