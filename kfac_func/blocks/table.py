"""Layer registration: which modules K-FAC preconditions.

`register(model)` walks a model and returns a :class:`LayerTable`, a ``{name: LayerSpec}``
mapping that prints as a table. Which modules are handled, and how, is decided by the
registered layer kinds (:mod:`kfac_func.blocks.registry`); every other module that owns
parameters is listed with the reason it was skipped.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
import weakref
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

import torch
from torch import nn

from kfac_func.blocks.checks import overrides_forward
from kfac_func.blocks.mapped import (
    KindMap,
    Parsed,
    broadcast_table,
    class_path,
    mapped_block,
    parse_kinds,
)
from kfac_func.blocks.registry import blocks
from kfac_func.blocks.spec import LayerSpec
from kfac_func.blocks.tied import EMBEDDING_KINDS, tied_specs
from kfac_func.blocks.used_weights import own_scales, used_by_parent

if TYPE_CHECKING:
    from kfac_func.blocks.base import LayerBlock

__all__ = ["KFAC_APPROX", "LayerTable", "no_layers_error", "register"]


class LayerTable(dict[str, LayerSpec]):
    """``{name: LayerSpec}`` of registered layers, plus the modules that were skipped.

    ``str(table)`` is a title line (the ``repr``: how many layers, how many skipped), then
    one row per module with parameters: name, kind, A and G shapes, or why it was
    skipped; so ``print(pre.steps, pre.layers)`` starts the table on its own line.
    ``model_name`` is the class name of the registered model (None when unknown), for
    error messages.

    Example:
        >>> from torch import nn
        >>> import kfac_func as kf
        >>> print(kf.register(nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))))
        LayerTable(2 layers, 0 skipped):
        name  kind    A    G    note
        ----  ------  ---  ---  ----
        0     linear  5x5  3x3
        2     linear  4x4  2x2
    """

    def __init__(
        self,
        specs: Iterable[LayerSpec] = (),
        skipped: dict[str, str] | None = None,
        *,
        model_name: str | None = None,
    ):
        super().__init__((s.name, s) for s in specs)
        self.skipped: dict[str, str] = dict(skipped or {})
        self.model_name = model_name

    def __str__(self) -> str:
        rows = [("name", "kind", "A", "G", "note")]
        for spec in self.values():
            a, g = spec.factor_shapes
            note = ", ".join(spec.block.notes(spec))
            rows.append((spec.name, spec.kind, _fmt_shape(a), _fmt_shape(g), note))
        for name, why in self.skipped.items():
            rows.append((name, "-", "-", "-", f"skipped: {why}"))
        widths = [max(len(r[i]) for r in rows) for i in range(5)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join([f"{self!r}:", *lines])

    def __repr__(self) -> str:
        return f"LayerTable({len(self)} layers, {len(self.skipped)} skipped)"

    def split_parameters(self, model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
        """``(preconditioned, others)``: the parameters of ``model`` (the model this table
        was registered from) that a registered layer preconditions, and the rest (skipped
        or unsupported modules, tied parameters), each in ``model.parameters()`` order.

        The usual recipe gives the two lists different optimizers: SGD (or an optimizer
        with Adam's first moment) on K-FAC's gradients, AdamW on the others, whose
        gradients K-FAC passes unchanged.

        Example:
            >>> from torch import nn
            >>> model = nn.Sequential(nn.Linear(2, 3), nn.Embedding(4, 3))
            >>> kfac, rest = register(model, skip_layers=["Embedding"]).split_parameters(model)
            >>> [p.shape for p in kfac], [p.shape for p in rest]
            ([torch.Size([3, 2]), torch.Size([3])], [torch.Size([4, 3])])
        """
        names = {n for spec in self.values() for n in (spec.weight, spec.bias) if n}
        params = dict(model.named_parameters())
        unknown = sorted(names - set(params))
        if unknown:
            raise ValueError(
                f"the model has no parameters {unknown}: split_parameters needs the model "
                "the table was registered from"
            )
        mine = [p for n, p in params.items() if n in names]
        rest = [p for n, p in params.items() if n not in names]
        return mine, rest


def _fmt_shape(shape: tuple[int, ...]) -> str:
    return "x".join(str(s) for s in shape)


def _specs_for(name: str, module: nn.Module, kinds: Parsed | None = None) -> list[LayerSpec] | str:
    """The specs from the kind ``kinds`` maps ``module``'s class to (its ``mapped`` option
    names the class), else from the first registered kind that handles ``module``, or the
    reason the module is not supported."""
    mapped = mapped_block(module, kinds or {})
    if mapped is not None:
        block, options = mapped
        spec = block.mapped_spec(name, module, options)
        opts = {"mapped": class_path(type(module))}
        if not any(cls in (kinds or {}) for cls in type(module).__mro__):
            opts["mapped_by"] = "KNOWN_KINDS"
        return [spec.with_options(**opts)]
    for block in blocks():
        if block.matches(module):
            return _recognised(name, module, block)
    return _unsupported(module)


def _recognised(name: str, module: nn.Module, block: LayerBlock) -> list[LayerSpec] | str:
    """The specs of a module a kind recognised by itself. A module whose class is not the
    kind's own torch class (a subclass, a class recognised by name), or whose spec reads
    attributes the torch class does not use (an embedding's scale), is checked on its first
    call (option ``"checked"``: its class) where the kind computes outputs; where it does
    not, a class that overrides ``forward`` is skipped: nothing could check it."""
    specs = block.specs(name, module)
    own = type(module) in block.module_types and not block.reads_attributes
    if isinstance(specs, str) or own or block.checks_itself:
        return specs
    path = class_path(type(module))
    if not block.checkable:
        if not overrides_forward(module, block.module_types):
            return specs
        return (
            f"{path} overrides the forward of {_base_name(block)}, and kind "
            f"{block.kind!r} cannot check what it computes; its parameters are left to "
            "the other optimizer"
        )
    out = []
    for spec in specs:
        if spec.name == name and spec.module == name:
            spec = spec.with_options(checked=path)
        out.append(spec)
    return out


def _base_name(block: LayerBlock) -> str:
    return block.module_types[0].__name__ if block.module_types else "its kind's class"


def _unsupported(module: nn.Module) -> str:
    """Why ``module`` is skipped: its class (with the module path), and for a class whose
    name and parameters look like a norm's or a linear's, how to map it with ``kinds=``."""
    cls = type(module)
    why = f"unsupported kind {class_path(cls)}"
    lower = cls.__name__.lower()
    weight = module._parameters.get("weight")
    kind = None
    if isinstance(weight, torch.Tensor) and "norm" in lower and weight.dim() >= 1:
        kind = "rms_norm" if "rms" in lower else "layer_norm"
    elif isinstance(weight, torch.Tensor) and weight.dim() == 2 and "linear" in lower:
        kind = "linear"
    if kind is None or weight is None:
        return why
    what = {"layer_norm": "a layer norm", "rms_norm": "an RMS norm", "linear": "x @ weight.T"}
    hint = f"{why}; if it computes {what[kind]}, map it with kinds={{{cls.__name__}: {kind!r}}}"
    if kind != "linear" and _all_zero(weight):  # Gemma's norms: 1 + weight, from zero
        hint += (
            f" (if it scales by 1 + weight, as norms whose weight starts at zero do: "
            f"kinds={{{cls.__name__}: ({kind!r}, {{'offset': 1.0}})}})"
        )
    return hint


def _all_zero(weight: torch.Tensor) -> bool:
    if weight.device.type == "meta" or type(weight) not in (torch.Tensor, nn.Parameter):
        return False
    return bool(weight.numel()) and not bool(weight.detach().any())


def _bounded(spec: LayerSpec, max_factor_dim: int | None) -> LayerSpec:
    """``spec`` with every side wider than ``max_factor_dim`` made diagonal."""
    if max_factor_dim is None:
        return spec
    a, g = spec.a_dim > max_factor_dim, spec.g_dim > max_factor_dim
    diagonal = (spec.a_diagonal or a, spec.g_diagonal or g)
    return spec if diagonal == spec.diagonal else dataclasses.replace(spec, diagonal=diagonal)


KFAC_APPROX = ("expand", "reduce")


def _approx(spec: LayerSpec, kfac_approx: str | Mapping[str, str]) -> LayerSpec:
    """``spec`` with ``kfac_approx="reduce"`` in its options when asked for and offered."""
    if isinstance(kfac_approx, str):
        approx = kfac_approx
    else:
        approx = next((v for p, v in kfac_approx.items() if re.search(p, spec.name)), "expand")
    if approx != "reduce" or not spec.block.reducible:
        return spec
    return spec.with_options(kfac_approx="reduce")


def register(
    model: nn.Module,
    skip_layers: Iterable[str] | str | None = None,
    *,
    max_factor_dim: int | None = None,
    kfac_approx: str | Mapping[str, str] = "expand",
    kinds: KindMap | None = None,
) -> LayerTable:
    """Find the layers of ``model`` that K-FAC preconditions.

    Each module with parameters goes to the first registered layer kind that handles it
    (:func:`kfac_func.blocks.registry.blocks`: ``nn.Linear`` with inputs of any rank,
    ``nn.Conv2d`` with any geometry). Every other module that owns parameters is listed in
    ``table.skipped`` with the reason, never an error.

    Args:
        model: the model to scan.
        skip_layers: regular expressions searched (``re.search``) in each module's
            qualified name and its class name. A matching module is skipped together with
            all of its children.
        max_factor_dim: a factor side wider than this keeps only its diagonal (as SOAP's
            ``max_precond_dim``): a language-model head with a 50k vocabulary gets a
            vector of 50k entries, not a 50k × 50k matrix. None: no limit.
        kfac_approx: how layers that share a weight across positions (a Linear on
            sequences, convolutions) treat them (Eschenhagen et al., NeurIPS 2023):
            ``"expand"`` (every position a row) or ``"reduce"`` (inputs averaged and
            output-gradients summed over an example's positions: one row per example,
            cheaper). A string for every layer, or ``{regex: approx}`` searched in the
            layer names (the first match wins, others expand). Kinds without a reduce
            form (embeddings, attention projections, norms) keep expand; the table notes
            "reduce" where it applies.
        kinds: ``{module class: kind}`` for classes of the model's own that compute what a
            registered kind computes (nanoGPT's ``LayerNorm``, transformers'
            ``LlamaRMSNorm``): ``{MyLayerNorm: "layer_norm", LlamaRMSNorm: "rms_norm"}``;
            subclasses follow their class, and a mapping wins over the built-in kinds.
            ``{cls: (kind, {"eps": 1e-5})}`` gives options: a norm's ``eps``, else read
            from the module's ``eps`` or ``variance_epsilon`` attribute, else the default
            of the torch module (``layer_norm`` 1e-5, ``rms_norm`` None: the machine
            epsilon). Kinds that may be mapped: ``layer_norm``, ``rms_norm``, ``linear``
            (weight ``(out, in)``), ``transposed_linear`` (weight ``(in, out)``),
            ``embedding``. The module's parameters are checked here (a ValueError names
            the module unless they are a ``weight`` and an optional ``bias`` of the
            shapes the kind needs), its forward on its first call during a capture or
            under a preconditioner (the kind's computation of the output from the input
            must equal the module's output up to rounding, else a ValueError names the
            module, its class and the largest difference).

    Returns:
        A :class:`LayerTable` mapping module names to :class:`LayerSpec`.

    Example:
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
        >>> table = register(model, skip_layers=["Embedding"])
        >>> list(table)
        ['1', '3']
        >>> print(table)  # doctest: +NORMALIZE_WHITESPACE
        LayerTable(2 layers, 1 skipped):
        name  kind    A    G    note
        ----  ------  ---  ---  ----------------------------------------
        1     linear  5x5  4x4
        3     linear  5x5  2x2
        0     -       -    -    skipped: matched skip_layers 'Embedding'

        A norm class of the model's own is mapped to the kind it computes:

        >>> import torch
        >>> class LayerNorm(nn.Module):  # nanoGPT's: no eps attribute (eps 1e-5)
        ...     def __init__(self, d):
        ...         super().__init__()
        ...         self.weight = nn.Parameter(torch.ones(d))
        ...     def forward(self, x):
        ...         return nn.functional.layer_norm(x, self.weight.shape, self.weight, None, 1e-5)
        >>> model = nn.Sequential(nn.Linear(4, 4), LayerNorm(4))
        >>> print(register(model).skipped["1"])  # doctest: +ELLIPSIS +NORMALIZE_WHITESPACE
        unsupported kind ...LayerNorm; if it computes a layer norm, map it with
        kinds={LayerNorm: 'layer_norm'}
        >>> spec = register(model, kinds={LayerNorm: "layer_norm"})["1"]
        >>> spec.kind, spec.option("eps"), spec.factor_shapes
        ('layer_norm', 1e-05, ((4, 1), (4, 1, 1)))
    """
    if max_factor_dim is not None and (
        isinstance(max_factor_dim, bool)
        or not isinstance(max_factor_dim, int)
        or max_factor_dim < 1
    ):
        raise ValueError(f"max_factor_dim must be a positive int or None, got {max_factor_dim!r}")
    for value in [kfac_approx] if isinstance(kfac_approx, str) else kfac_approx.values():
        if value not in KFAC_APPROX:
            raise ValueError(f"kfac_approx must be one of {KFAC_APPROX}, got {value!r}")
    parsed = parse_kinds(kinds)
    if isinstance(skip_layers, str):
        skip_layers = [skip_layers]
    patterns = [(p, re.compile(p)) for p in (skip_layers or [])]
    specs: list[LayerSpec] = []
    skipped: dict[str, str] = {}
    skipped_prefixes: list[str] = []
    modules = dict(model.named_modules())

    for name, module in modules.items():
        if any(name == p or name.startswith(p + ".") for p in skipped_prefixes):
            continue
        cls = type(module).__name__
        hit = next((p for p, rx in patterns if rx.search(name) or rx.search(cls)), None)
        if hit is not None:
            skipped_prefixes.append(name)
            if any(True for _ in module.parameters()):
                skipped[name] = f"matched skip_layers {hit!r}"
            continue
        own_params = list(module.parameters(recurse=False))
        if not own_params:
            continue
        parent = name.rpartition(".")[0]
        table = broadcast_table(name, module, modules.get(parent))
        result = table if table is not None else _specs_for(name, module, parsed)
        if isinstance(result, list) and len(result) == 1:  # its weight used by the parent?
            used = used_by_parent(result[0], module, parent, modules.get(parent))
            result = result if used is None else used if isinstance(used, str) else [used]
        if isinstance(result, str):
            skipped[name] = result
            scales = own_scales(name, module)  # parameters its forward uses as scales
            specs += scales
            if scales:
                taken = {s.weight for s in scales}
                own = [n for n, _ in module.named_parameters(prefix=name, recurse=False)]
                left = ", ".join(n.rpartition(".")[2] for n in own if n not in taken)
                skipped[name] = f"{result} (of its parameters: {left})"
            continue
        if len(result) > 1 or result[0].name != name:
            skipped_prefixes.append(name)  # a module of several layers: children included
        frozen = [s.name for s in result if not model.get_parameter(s.weight).requires_grad]
        if frozen:
            skipped[name] = "weight does not require grad"
            continue
        specs += [_approx(_bounded(s, max_factor_dim), kfac_approx) for s in result]
    tied = _tied(model, specs)
    for name, why in tied.items():
        skipped[name] = why
    kept = [s for s in specs if s.name not in tied]
    # a module whose own parameters all belong to registered layers (BERT's LM head owns
    # the bias of its tied decoder) has nothing left to skip
    covered = {id(model.get_parameter(n)) for s in kept for n in s.param_names()}
    for name in [n for n in skipped if n in modules and n not in tied]:
        own = list(modules[name].parameters(recurse=False))
        if own and all(id(p) in covered for p in own):
            del skipped[name]
    return LayerTable(kept, skipped, model_name=type(model).__name__)


def no_layers_error(layers: Mapping[str, LayerSpec], model_name: str | None = None) -> ValueError:
    """The error for a model with no layer to precondition: it names the model's class
    (``model_name``, else the table's) and shows the table of what was skipped and why."""
    name = model_name or getattr(layers, "model_name", None) or "the model"
    if not isinstance(layers, LayerTable):
        table = "(an empty mapping of layers)"
    elif not layers and not layers.skipped:
        table = f"({name} has no parameters)"
    else:  # the model itself (name "") is shown by its class
        shown = {(k or f"(the {name} itself)"): v for k, v in layers.skipped.items()}
        table = str(LayerTable(layers.values(), shown))
    return ValueError(
        f"no layer of {name} can be preconditioned (kfac_func.register found none; the "
        f"table of its modules says why each was skipped):\n{table}"
    )


# the shared parameters already warned about, per model: the documented recipe registers
# twice (register(model), then KFACPreconditioner(model)), and says so once
_WARNED: weakref.WeakKeyDictionary[nn.Module, set[str]] = weakref.WeakKeyDictionary()


def _tied(model: nn.Module, specs: list[LayerSpec]) -> dict[str, str]:
    """``{layer: reason}`` for the layers that share a parameter with another registered
    layer and are skipped, with a warning (once per model and parameter): the shared
    gradient sums the uses of every layer, which the factors of neither describe.

    Embeddings and an output head that share their weight (a tied language-model head;
    T5's encoder and decoder tables too) are instead made one layer of kind ``"tied"``
    (:mod:`kfac_func.blocks.tied`), named after the head: ``specs`` is updated in place
    (the embeddings and the head replaced by it).
    """
    users: dict[int, list[tuple[str, str, str]]] = {}
    for spec in specs:
        for pname in spec.param_names():
            use = (spec.name, spec.module, pname)
            users.setdefault(id(model.get_parameter(pname)), []).append(use)
    canonical = {id(p): n for n, p in model.named_parameters()}
    by_name = {s.name: s for s in specs}
    out: dict[str, str] = {}
    for key, uses in users.items():
        # the parts of one module (an attention's q, k, v rows) share its parameters by design
        if len({module for _, module, _ in uses}) < 2:
            continue
        layers = sorted({layer for layer, _, _ in uses})
        shared = canonical.get(key, uses[0][2])
        why = "not an embedding and a head"
        embeddings = [s for s in specs if s.name in layers and s.kind in EMBEDDING_KINDS]
        heads = [by_name[n] for n in layers if by_name[n].kind not in EMBEDDING_KINDS]
        if embeddings and len(heads) == 1:  # one head: embeddings may be several
            bias = heads[0].bias
            if bias is not None:  # its name in named_parameters() (BERT's head shares it)
                bias = canonical.get(id(model.get_parameter(bias)), bias)
            tied = tied_specs(embeddings[0], heads[0], shared, bias, also=embeddings[1:])
            if not isinstance(tied, str):
                specs[specs.index(heads[0])] = tied
                for embedding in embeddings:
                    specs.remove(embedding)
                continue
            why = tied
        warned = _WARNED.setdefault(model, set())
        if shared not in warned:
            warned.add(shared)
            warnings.warn(
                f"parameter {shared!r} is shared by layers {layers}: K-FAC skips them (the "
                "gradient of a tied parameter sums the uses of every layer, which the factors "
                "of neither describe; only embeddings and one output head are "
                f"preconditioned together, and here {why}); precondition them with another "
                "optimizer",
                UserWarning,
                stacklevel=3,
            )
        for layer in layers:
            others = [o for o in layers if o != layer]
            out[layer] = f"shares parameter {shared!r} with {others}"
    return out
