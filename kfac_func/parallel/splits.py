"""Which modules are tensor-parallel linears, and how each is split over the model-parallel ranks.

A Megatron-style ``ColumnParallelLinear`` holds rows ``i·out/p … (i+1)·out/p`` of the full
weight on model-parallel rank ``i`` (split on the output dimension, weight dimension 0);
a ``RowParallelLinear`` holds columns ``i·in/p … (i+1)·in/p`` (split on the input
dimension, weight dimension 1). Both are recognised by *class*, before any single-device
layer kind is considered, so that a stand-in which subclasses ``nn.Linear`` (as
kfac-pytorch's tests write them) is never taken for a replicated linear:

- a class named ``ColumnParallelLinear`` or ``RowParallelLinear``, or a subclass of one
  (Megatron's, GPT-NeoX's and :mod:`kfac_func.parallel.layers`'s all qualify);
- a class the caller maps with ``parallel_classes={cls: "column" | "row"}`` (a class, its
  subclasses included, or a class name); the mapping wins over the names above, and
  ``None`` declares a class replicated.

A module with parameters of its own that *looks* tensor-parallel (a class name ending in
``ParallelLinear``, or the attributes Megatron's parallel linears carry:
``input_is_parallel``, ``gather_output``, ``input_size_per_partition``,
``output_size_per_partition``) but is neither is refused
with a ValueError that names it: registering its shard as a whole layer would give
factors of the wrong sizes on more than one model-parallel rank.

Pure functions; no process group.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import torch
from torch import nn

from kfac_func.blocks import LayerSpec
from kfac_func.blocks.linear import LinearBlock
from kfac_func.blocks.mapped import class_path

__all__ = [
    "COLUMN_PARALLEL_CLASSES",
    "PARALLEL_ATTRIBUTES",
    "ROW_PARALLEL_CLASSES",
    "ParallelClasses",
    "Split",
    "factor_parts",
    "looks_parallel",
    "parallel_spec",
    "parse_parallel_classes",
    "split_dim",
    "split_of",
]

Split = Literal["column", "row"]

ParallelClasses = Mapping[type[nn.Module] | str, Split | None]
"""``{module class or class name: "column" | "row" | None}``."""

COLUMN_PARALLEL_CLASSES = ("ColumnParallelLinear",)
"""Class names of linears whose weight is split on the output dimension."""

ROW_PARALLEL_CLASSES = ("RowParallelLinear",)
"""Class names of linears whose weight is split on the input dimension."""

PARALLEL_ATTRIBUTES = (
    "input_is_parallel",
    "gather_output",
    "input_size_per_partition",
    "output_size_per_partition",
)
"""Attributes of Megatron's parallel linears; a module with any of them looks parallel."""

_SPLITS = ("column", "row", None)


def parse_parallel_classes(classes: ParallelClasses | None) -> dict[type | str, Split | None]:
    """Check a ``parallel_classes`` mapping: keys are module classes or class names, values
    ``"column"``, ``"row"`` or None (replicated).

    Example:
        >>> from torch import nn
        >>> parse_parallel_classes({nn.Linear: "row"})
        {<class 'torch.nn.modules.linear.Linear'>: 'row'}
        >>> parse_parallel_classes({"MyLinear": "diagonal"})
        Traceback (most recent call last):
        ...
        ValueError: parallel_classes['MyLinear'] must be 'column', 'row' or None, got 'diagonal'
    """
    out: dict[type | str, Split | None] = {}
    for key, split in (classes or {}).items():
        if not (isinstance(key, str) or (isinstance(key, type) and issubclass(key, nn.Module))):
            raise ValueError(
                f"parallel_classes keys must be nn.Module classes or class names, got {key!r}"
            )
        if split not in _SPLITS:
            shown = key if isinstance(key, str) else key.__name__
            raise ValueError(
                f"parallel_classes[{shown!r}] must be 'column', 'row' or None, got {split!r}"
            )
        out[key] = split
    return out


def _mapped(
    module: nn.Module, classes: Mapping[type | str, Split | None]
) -> tuple[bool, Split | None]:
    """``(found, split)`` from the caller's mapping, most derived class first."""
    for cls in type(module).__mro__:
        for key in (cls, cls.__name__, class_path(cls)):
            if key in classes:
                return True, classes[key]
    return False, None


def split_of(module: nn.Module, classes: ParallelClasses | None = None) -> Split | None:
    """``"column"``, ``"row"`` or None (not a tensor-parallel linear), by class.

    The caller's ``classes`` (see :func:`parse_parallel_classes`) first, then the built-in
    class names, each matched against the module's class and its base classes.

    Example:
        >>> from torch import nn
        >>> class ColumnParallelLinear(nn.Linear):  # a stand-in, as in kfac-pytorch's tests
        ...     pass
        >>> split_of(ColumnParallelLinear(2, 2)), split_of(nn.Linear(2, 2))
        ('column', None)
        >>> class Projection(nn.Linear):
        ...     pass
        >>> split_of(Projection(2, 2), {Projection: "row"})
        'row'
    """
    found, split = _mapped(module, parse_parallel_classes(classes))
    if found:
        return split
    names = [c.__name__ for c in type(module).__mro__]
    for name in names:
        if name in COLUMN_PARALLEL_CLASSES:
            return "column"
        if name in ROW_PARALLEL_CLASSES:
            return "row"
    return None


def looks_parallel(module: nn.Module, classes: ParallelClasses | None = None) -> str | None:
    """Why ``module`` looks like a tensor-parallel linear that :func:`split_of` cannot
    place (None if it does not, or if it is placed or mapped).

    Example:
        >>> from torch import nn
        >>> class TEColumnParallelLinear(nn.Linear):
        ...     pass
        >>> looks_parallel(TEColumnParallelLinear(2, 2))
        "its class name 'TEColumnParallelLinear' ends in 'ParallelLinear'"
        >>> looks_parallel(TEColumnParallelLinear(2, 2), {"TEColumnParallelLinear": "column"})

        A module without parameters of its own is a container, judged by its children:

        >>> class ParallelLinear(nn.Module):  # GPT-NeoX's wrapper of its output layer
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.final_linear = TEColumnParallelLinear(2, 2)
        >>> looks_parallel(ParallelLinear()) is None, looks_parallel(ParallelLinear().final_linear)
        (True, "its class name 'TEColumnParallelLinear' ends in 'ParallelLinear'")
    """
    parsed = parse_parallel_classes(classes)
    if _mapped(module, parsed)[0] or split_of(module, parsed) is not None:
        return None
    if not module._parameters and not module._buffers:
        return None  # a container (GPT-NeoX's ParallelLinear wraps a column/row linear)
    for cls in type(module).__mro__:
        if cls.__name__.endswith("ParallelLinear"):
            return f"its class name {cls.__name__!r} ends in 'ParallelLinear'"
    attrs = [a for a in PARALLEL_ATTRIBUTES if hasattr(module, a)]
    if attrs:
        return f"it has the attribute(s) {', '.join(attrs)} of a tensor-parallel linear"
    return None


def split_dim(split: Split | None) -> int | None:
    """The dimension of the ``(out, in)`` weight that is split: 0 (column), 1 (row), None.

    Example:
        >>> split_dim("column"), split_dim("row"), split_dim(None)
        (0, 1, None)
    """
    return None if split is None else (0 if split == "column" else 1)


def factor_parts(spec: LayerSpec, split: Split | None, parts: int) -> tuple[int, int]:
    """The sides of the A and G factors that one model-parallel rank's shard covers.

    A row-parallel layer's ranks each see ``in / parts`` input features (the bias's
    column of ones is appended once, to the gathered input, so it is not split); a
    column-parallel layer's ranks each produce ``out / parts`` outputs. A side that is not
    split is the whole factor side.

    Example:
        >>> from kfac_func.blocks import LayerSpec
        >>> spec = LayerSpec("fc", "linear", "fc.weight", "fc.bias", 8, 6)
        >>> spec.a_dim, spec.g_dim
        (9, 6)
        >>> [factor_parts(spec, split, 2) for split in ("row", "column", None)]
        [(4, 6), (9, 3), (9, 6)]
    """
    if split == "row":
        return spec.in_dim // parts, spec.g_dim
    if split == "column":
        return spec.a_dim, spec.out_dim // parts
    return spec.a_dim, spec.g_dim


def _refuse(name: str, module: nn.Module, split: Split, why: str) -> ValueError:
    return ValueError(
        f"layer {name!r} ({class_path(type(module))}) is a {split}-parallel linear by its "
        f"class, but {why}; it cannot be placed over the model-parallel ranks (skip it with "
        "skip_layers, or map its class with parallel_classes={cls: None} if it is replicated)"
    )


def parallel_spec(name: str, module: nn.Module, split: Split, parts: int) -> LayerSpec:
    """The :class:`~kfac_func.blocks.LayerSpec` of the *full* layer whose ``split`` shard
    ``module`` holds on each of ``parts`` model-parallel ranks.

    The module must own a 2-d ``weight`` parameter (its shard) and at most a 1-d ``bias``
    with one entry per weight row (a column-parallel layer's bias is split like the
    rows; a row-parallel layer's bias is whole). Sizes the module states
    (``input_size``, ``output_size``, ``input_size_per_partition``,
    ``output_size_per_partition``) must agree with the shard over ``parts`` ranks, and a
    module in Megatron's sequence parallelism (``sequence_parallel=True``: each rank
    sees only its part of the tokens) is refused, each with a ValueError naming the layer.

    Example:
        >>> from torch import nn
        >>> class RowParallelLinear(nn.Linear):  # a stand-in holding one shard
        ...     pass
        >>> spec = parallel_spec("fc", RowParallelLinear(4, 3), "row", parts=2)
        >>> spec.in_dim, spec.out_dim, spec.bias
        (8, 3, 'fc.bias')
    """
    prefix = f"{name}." if name else ""
    weight = module._parameters.get("weight")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        shape = None if weight is None else tuple(weight.shape)
        raise _refuse(name, module, split, f"its weight parameter is {shape}, not a 2-d tensor")
    if getattr(module, "sequence_parallel", False) is True:
        raise _refuse(
            name,
            module,
            split,
            "it runs with sequence_parallel=True (each rank sees only its part of the "
            "tokens), which the model-parallel preconditioner does not gather",
        )
    rows, cols = weight.shape
    out_dim, in_dim = (rows * parts, cols) if split == "column" else (rows, cols * parts)
    per_rank = {"output_size_per_partition": rows, "input_size_per_partition": cols}
    for attr, want in (("input_size", in_dim), ("output_size", out_dim), *per_rank.items()):
        given = getattr(module, attr, None)
        if isinstance(given, int) and not isinstance(given, bool) and given != want:
            raise ValueError(
                f"layer {name!r} ({class_path(type(module))}): {attr}={given}, but a "
                f"{split}-parallel weight shard of shape {tuple(weight.shape)} over {parts} "
                f"model-parallel ranks makes {want} (is model_parallel_size right?)"
            )
    bias = module._parameters.get("bias")
    if bias is not None and tuple(bias.shape) != (rows,):
        raise _refuse(
            name,
            module,
            split,
            f"its bias has shape {tuple(bias.shape)}, expected ({rows},) for a weight shard "
            f"of shape {tuple(weight.shape)}",
        )
    bias_name = f"{prefix}bias" if bias is not None else None
    return LayerSpec(name, LinearBlock.kind, f"{prefix}weight", bias_name, in_dim, out_dim)
