"""Layer registration: which modules K-FAC preconditions.

`register(model)` walks a model and returns a :class:`LayerTable`, a ``{name: LayerSpec}``
mapping that prints as a table. Which modules are handled, and how, is decided by the
registered layer kinds (:mod:`kfac_func.blocks.base`); every other module that owns
parameters is listed with the reason it was skipped.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from torch import nn

from kfac_func.blocks.base import LayerSpec, blocks

__all__ = ["LayerTable", "register"]


class LayerTable(dict[str, LayerSpec]):
    """``{name: LayerSpec}`` of registered layers, plus the modules that were skipped.

    ``str(table)`` renders one row per module with parameters: name, kind, A and G
    shapes, or why it was skipped.
    """

    def __init__(self, specs: Iterable[LayerSpec] = (), skipped: dict[str, str] | None = None):
        super().__init__((s.name, s) for s in specs)
        self.skipped: dict[str, str] = dict(skipped or {})

    def __str__(self) -> str:
        rows = [("name", "kind", "A", "G", "note")]
        for spec in self.values():
            a, g = spec.factor_shapes
            note = f"{spec.groups} groups" if spec.groups > 1 else ""
            rows.append((spec.name, spec.kind, _fmt_shape(a), _fmt_shape(g), note))
        for name, why in self.skipped.items():
            rows.append((name, "-", "-", "-", f"skipped: {why}"))
        widths = [max(len(r[i]) for r in rows) for i in range(5)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"LayerTable({len(self)} layers, {len(self.skipped)} skipped)"


def _fmt_shape(shape: tuple[int, ...]) -> str:
    return "x".join(str(s) for s in shape)


def _spec_for(name: str, module: nn.Module) -> LayerSpec | str:
    """A LayerSpec from the first registered kind that handles ``module``, or the reason
    the module is not supported."""
    for block in blocks():
        if block.matches(module):
            return block.spec(name, module)
    return f"unsupported kind {type(module).__name__}"


def register(model: nn.Module, skip_layers: Iterable[str] | str | None = None) -> LayerTable:
    """Find the layers of ``model`` that K-FAC preconditions.

    Each module with parameters goes to the first registered layer kind that handles it
    (:func:`kfac_func.blocks.base.blocks`: ``nn.Linear`` with inputs of any rank,
    ``nn.Conv2d`` with any geometry). Every other module that owns parameters is listed in
    ``table.skipped`` with the reason, never an error.

    Args:
        model: the model to scan.
        skip_layers: regular expressions searched (``re.search``) in each module's
            qualified name and its class name. A matching module is skipped together with
            all of its children.

    Returns:
        A :class:`LayerTable` mapping module names to :class:`LayerSpec`.

    Example:
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
        >>> table = register(model, skip_layers=["Embedding"])
        >>> list(table)
        ['1', '3']
        >>> print(table)  # doctest: +NORMALIZE_WHITESPACE
        name  kind    A    G    note
        ----  ------  ---  ---  ----------------------------------------
        1     linear  5x5  4x4
        3     linear  5x5  2x2
        0     -       -    -    skipped: matched skip_layers 'Embedding'
    """
    if isinstance(skip_layers, str):
        skip_layers = [skip_layers]
    patterns = [(p, re.compile(p)) for p in (skip_layers or [])]
    specs: list[LayerSpec] = []
    skipped: dict[str, str] = {}
    skipped_prefixes: list[str] = []

    for name, module in model.named_modules():
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
        result = _spec_for(name, module)
        if isinstance(result, str):
            skipped[name] = result
        elif not module.get_parameter("weight").requires_grad:
            skipped[name] = "weight does not require grad"
        else:
            specs.append(result)
    return LayerTable(specs, skipped)
