"""Embeddings whose ``forward`` computes the ids it looks up: the lookup recorded inside
the forward.

A subclass of ``nn.Embedding`` that overrides ``forward`` may look up other ids than its
input: OPT's learned positions (``OPTLearnedPositionalEmbedding``) are called on the
attention mask and look up the positions plus an offset of 2. The hooks see the call's
arguments, not the ids, so the Embedding kind's statistics cannot be taken from them.

This kind records the lookup itself. While the module's forward runs, a
``torch.overrides.TorchFunctionMode`` (entered by the forward pre-hook, left by the
forward hook: :func:`~kfac_func.blocks.taps.tap_hooks`) sees every torch function the
forward calls, and keeps the ``F.embedding`` calls whose weight is the module's weight:
the ids actually looked up and the rows returned. When the forward returns, the call is
reported with those ids as its input, so the factors are exactly the Embedding kind's
(A the counts of the looked-up ids, G the Gram of the output-gradient rows: see
:mod:`kfac_func.blocks.embedding`). The call is refused (the layer is left to the other
optimizer, with a warning naming it; :func:`kfac_func.capture` raises a ValueError naming
the ``skip_layers=`` that leaves it out) unless the forward made exactly one lookup of
the weight, with neither ``max_norm``, ``scale_grad_by_freq`` nor ``sparse``, whose
output is the module's output, and used the weight in no other tensor computation (a
slice ``weight[a:b]``, a product, a second lookup): the factors would describe another
map. Reading the weight's shape, dtype or device is no use. Every call is checked so.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils import _pytree as pytree

from kfac_func.blocks.checks import overrides_forward
from kfac_func.blocks.embedding import EmbeddingBlock, embed_scale
from kfac_func.blocks.mapped import class_path
from kfac_func.blocks.registry import register_block
from kfac_func.blocks.spec import LayerSpec
from kfac_func.blocks.taps import ModeTap, RefusedCall, Site, computes

__all__ = ["RecordedEmbeddingBlock"]

# the arguments of F.embedding after (input, weight), with the values the kind allows
_ALLOWED = {"max_norm": None, "scale_grad_by_freq": False, "sparse": False}
_NAMES = ("padding_idx", "max_norm", "norm_type", "scale_grad_by_freq", "sparse")


@register_block
class RecordedEmbeddingBlock(EmbeddingBlock):
    """An ``nn.Embedding`` subclass that overrides ``forward``: its statistics come from
    the ids its forward looks up in its weight (recorded while the forward runs).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from kfac_func.blocks import register
        >>> class Positions(nn.Embedding):  # OPT's shape: positions from a mask, plus 2
        ...     def forward(self, mask):
        ...         return super().forward(torch.cumsum(mask, 1) * mask + 1)
        >>> spec = register(Positions(6, 3))[""]
        >>> spec.kind, spec.factor_shapes
        ('recorded_embedding', ((6,), (3, 3)))
    """

    kind = "recorded_embedding"
    taps = True
    checks_itself = True
    mappable = False
    model_parallel = False
    formula_text = "weight[ids] of the one lookup of its weight in its forward"

    def matches(self, module: nn.Module) -> bool:
        """An ``nn.Embedding`` subclass without a scale (:func:`embed_scale`) whose class
        defines its own ``forward``."""
        return (
            isinstance(module, nn.Embedding)
            and embed_scale(module) is None
            and overrides_forward(module, (nn.Embedding,))
        )

    def notes(self, spec: LayerSpec) -> list[str]:
        return [*super().notes(spec), "ids recorded in its forward"]

    def tap(self, module: nn.Module, specs: Sequence[LayerSpec], site: Site) -> _LookupTap:
        """The mode that records the lookups of ``module``'s weight during one forward,
        reporting the call as ``site(spec, ids, output)`` when the forward returns."""
        return _LookupTap(module, specs[0], site)


class _LookupTap(ModeTap):
    """Records the ``F.embedding`` lookups of one module's weight, and its other uses,
    while entered (around one forward of the module)."""

    def __init__(self, module: nn.Module, spec: LayerSpec, site: Site) -> None:
        super().__init__()
        self.module, self.spec, self.site = module, spec, site
        self.lookups: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.problems: list[str] = []

    def called(
        self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        out = func(*args, **kwargs)
        # read at each call: the module's weight is the tensor its forward reads now
        # (torch.func's functional_call and FSDP put theirs in place before the forward)
        weight = getattr(self.module, "weight", None)
        if weight is None:
            return out
        if func is F.embedding:
            found = _lookup(args, kwargs)
            if found is not None and found[1] is weight:
                ids, _, options = found
                bad = [f"{k}={v!r}" for k, v in options.items() if _ALLOWED.get(k, v) != v]
                if bad:
                    self._problem(f"looks it up with {', '.join(bad)}")
                self.lookups.append((ids, out))
                return out
        leaves = pytree.tree_leaves((args, kwargs))
        if any(leaf is weight for leaf in leaves) and computes(out):
            self._problem(f"uses the weight otherwise (in {getattr(func, '__name__', func)})")
        return out

    def _problem(self, what: str) -> None:
        if what not in self.problems:
            self.problems.append(what)

    def returned(self, out: Any) -> Any:
        why = self._why_not(out)
        if why is not None:
            raise RefusedCall(self.spec.name, _message(self.spec, self.module, why))
        return self.site(self.spec, self.lookups[0][0], out)

    def _why_not(self, out: Any) -> str | None:
        """Why the call is not ``weight[ids]`` of one lookup, or None."""
        n = len(self.lookups)
        if self.problems:
            return f"its forward {'; '.join(self.problems)}"
        if n != 1:
            return f"its forward looks up its weight with F.embedding {n} times, not once"
        if out is not self.lookups[0][1]:
            return "its output is not the output of the lookup (the forward computes on it)"
        return None


def _lookup(
    args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> tuple[torch.Tensor, Any, dict[str, Any]] | None:
    """``(ids, weight, {other argument: value})`` of a call of ``F.embedding``."""
    named = dict(zip(("input", "weight", *_NAMES), args))
    named.update(kwargs)
    ids = named.pop("input", None)
    weight = named.pop("weight", None)
    if not isinstance(ids, torch.Tensor):
        return None
    return ids, weight, named


def _message(spec: LayerSpec, module: nn.Module, why: str) -> str:
    cls = type(module).__name__
    return (
        f"module {spec.name!r} ({class_path(type(module))}) was registered as kind "
        f"{spec.kind!r}, but {cls} overrides forward: its output is not "
        f"{spec.block.formula(spec)}; {why}"
    )
