"""Layer names as the model's users know them: without the module prefixes that wrappers
insert.

FSDP2's activation checkpointing (``checkpoint_wrapper``, ``apply_activation_checkpointing``)
puts each wrapped module under ``_checkpoint_wrapped_module``, so that
``model.named_modules()`` says ``blocks.0._checkpoint_wrapped_module.fc``. The wrapper
strips the prefix from ``state_dict()`` and ``named_parameters()``, and forwards attribute
lookups to the wrapped module, so ``model.get_submodule("blocks.0.fc")`` finds the layer:
the preconditioner's layers, state and state dicts use the stripped names too, and a
state saved without the wrappers loads with them (and back).
"""

from __future__ import annotations

import dataclasses

from kfac_func.blocks import LayerSpec, LayerTable

__all__ = ["WRAPPER_PREFIXES", "unwrapped"]

WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.",)
"""Module-name parts that wrappers insert (``torch.distributed.algorithms._checkpoint``)."""


_NAMED = ("module", "tied", "tied_also")
"""Options of a spec that hold module names: the layer's module, a tied layer's uses."""


def _option(key: str, value: object) -> object:
    """An option's value with the wrapper prefixes taken out of the module names it holds."""
    if key not in _NAMED:
        return value
    if isinstance(value, str):
        return _strip(value)
    if isinstance(value, tuple) and all(isinstance(v, str) for v in value):
        return tuple(_strip(v) for v in value)
    return value


def _strip(name: str) -> str:
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
        if name.endswith(prefix[:-1]):  # the wrapped module itself
            name = name[: -len(prefix)].rstrip(".")
    return name


def unwrapped(table: LayerTable) -> LayerTable:
    """``table`` with the wrapper prefixes taken out of every layer, parameter and module
    name (the table itself when there are none).

    Example:
        >>> from torch import nn
        >>> from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        ...     checkpoint_wrapper)
        >>> from kfac_func.blocks import register
        >>> model = nn.Sequential(checkpoint_wrapper(nn.Linear(2, 2)))
        >>> list(register(model)), list(unwrapped(register(model)))
        (['0._checkpoint_wrapped_module'], ['0'])
        >>> unwrapped(register(model))["0"].weight
        '0.weight'
    """

    def spec(s: LayerSpec) -> LayerSpec:
        options = tuple((k, _option(k, v)) for k, v in s.options)
        return dataclasses.replace(
            s,
            name=_strip(s.name),
            weight=_strip(s.weight),
            bias=None if s.bias is None else _strip(s.bias),
            options=options,
        )

    names = [*table, *table.skipped, *(repr(s.options) for s in table.values())]
    if not any(p[:-1] in n for n in names for p in WRAPPER_PREFIXES):
        return table
    skipped = {_strip(n): why for n, why in table.skipped.items()}
    return LayerTable([spec(s) for s in table.values()], skipped, model_name=table.model_name)
