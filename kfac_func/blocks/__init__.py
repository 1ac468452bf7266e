"""Layer kinds: one module per kind behind the protocol of :mod:`kfac_func.blocks.base`.

Importing this package imports every module in it, so each kind's module registers its
block (:func:`~kfac_func.blocks.registry.register_block`) and adding a kind is one new module.
The functions below dispatch on ``spec.kind``.

Example:
    >>> import torch
    >>> from kfac_func.blocks import a_gram, register
    >>> spec = register(torch.nn.Conv2d(1, 2, 3))[""]
    >>> a_gram(spec, torch.ones(1, 1, 4, 4)).gram.shape
    torch.Size([10, 10])
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Sequence

import torch

from kfac_func.blocks.base import LayerBlock
from kfac_func.blocks.registry import block_of, blocks, register_block
from kfac_func.blocks.spec import Gram, LayerSpec, Rows, diagonal_blocks
from kfac_func.blocks.table import LayerTable, register

__all__ = [
    "Gram",
    "LayerBlock",
    "LayerSpec",
    "LayerTable",
    "Rows",
    "a_gram",
    "block_of",
    "blocks",
    "call_grams",
    "g_gram",
    "grads_to_matrix",
    "joint_grams",
    "layer_rows",
    "matrix_to_grads",
    "register",
    "register_block",
    "summed",
]

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")


def a_gram(spec: LayerSpec, x: torch.Tensor, dtype: torch.dtype = torch.float32) -> Gram:
    """Gram statistics of one call's input (bias column of ones included), its products
    from operands in ``dtype``, in at least float32 (:func:`summed`); of a blocked A
    (:attr:`LayerSpec.a_blocks`) only the diagonal blocks.

    Example:
        >>> import torch
        >>> spec = register(torch.nn.Linear(2, 1))[""]
        >>> a_gram(spec, torch.ones(3, 2), torch.bfloat16).gram.dtype
        torch.float32
    """
    return summed(_blocked(spec, spec.block.a_gram(spec, x, dtype)))


def summed(gram: Gram) -> Gram:
    """``gram`` in at least float32: Grams whose products ran in a 16-bit dtype (their sums
    accumulate in float32 inside the product) are kept, added and averaged in float32,
    as the running factors are.

    Example:
        >>> summed(Gram(torch.ones(2, 2, dtype=torch.bfloat16), 4, 1)).gram.dtype
        torch.float32
    """
    wide = torch.promote_types(gram.gram.dtype, torch.float32)
    return gram if gram.gram.dtype == wide else gram._replace(gram=gram.gram.to(wide))


def joint_grams(
    spec: LayerSpec, x: torch.Tensor, r: torch.Tensor, dtype: torch.dtype = torch.float32
) -> tuple[Gram, Gram]:
    """The A and G statistics of one call of a kind with :attr:`LayerBlock.joint`
    statistics (from its input ``x`` and output-gradient ``r`` together); of a blocked A
    only the diagonal blocks.

    Example:
        >>> import torch
        >>> spec = register(torch.nn.Sequential(torch.nn.LayerNorm(3)))["0"]
        >>> a, g = joint_grams(spec, torch.randn(4, 3), torch.ones(4, 3))
        >>> a.gram.shape, g.gram.shape
        (torch.Size([3, 1]), torch.Size([3, 2, 2]))
    """
    a, g = spec.block.joint_grams(spec, x, r, dtype)
    return summed(_blocked(spec, a)), summed(g)


def _blocked(spec: LayerSpec, gram: Gram) -> Gram:
    """``gram`` as a blocked A's statistics: its :func:`diagonal_blocks` where the kind
    built the whole Gram (kinds that build the blocks themselves, as Linear's, and
    layers without blocks pass as they are)."""
    if spec.a_blocks == 1 or gram.gram.shape[-1] != spec.a_dim:
        return gram
    return gram._replace(gram=diagonal_blocks(gram.gram, spec.a_blocks))


def g_gram(spec: LayerSpec, r: torch.Tensor, dtype: torch.dtype = torch.float32) -> Gram:
    """Gram statistics of one call's raw output-gradient (products from operands in
    ``dtype``, in at least float32)."""
    return summed(spec.block.g_gram(spec, r, dtype))


def call_grams(
    spec: LayerSpec,
    inputs: Sequence[torch.Tensor],
    output_grads: Sequence[torch.Tensor],
    dtype: torch.dtype = torch.float32,
) -> tuple[list[Gram], list[Gram]]:
    """The A and G statistics of every call of a layer (inputs and output-gradients in
    call order), from each tensor alone or, for kinds with :attr:`LayerBlock.joint`
    statistics, from each call's pair."""
    block = spec.block
    if not block.joint:
        return [a_gram(spec, x, dtype) for x in inputs], [
            g_gram(spec, r, dtype) for r in output_grads
        ]
    if len(inputs) != len(output_grads):
        raise ValueError(
            f"layer {spec.name!r}: {len(inputs)} captured inputs but {len(output_grads)} "
            "output-gradients"
        )
    pairs = [joint_grams(spec, x, r, dtype) for x, r in zip(inputs, output_grads)]
    return [a for a, _ in pairs], [g for _, g in pairs]


def layer_rows(
    spec: LayerSpec, inputs: Sequence[torch.Tensor], output_grads: Sequence[torch.Tensor]
) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """The rows of every call for the low-rank path, or None if the kind has none."""
    if not spec.block.has_rows:
        return None
    return spec.block.rows(spec, inputs, output_grads)


def grads_to_matrix(
    spec: LayerSpec, weight_grad: torch.Tensor, bias_grad: torch.Tensor | None = None
) -> torch.Tensor:
    """Gradient matrix ``(*batch_shape, g_dim, a_dim)``; the bias is the last column.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> spec = register(nn.Linear(2, 1))[""]
        >>> grads_to_matrix(spec, torch.tensor([[1.0, 2.0]]), torch.tensor([3.0]))
        tensor([[1., 2., 3.]])
    """
    spec.block.check_grads(spec, weight_grad, bias_grad)
    return spec.block.to_matrix(spec, weight_grad, bias_grad)


def matrix_to_grads(spec: LayerSpec, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Inverse of :func:`grads_to_matrix`: ``(weight_grad, bias_grad or None)``.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> spec = register(nn.Linear(2, 1))[""]
        >>> matrix_to_grads(spec, torch.tensor([[1.0, 2.0, 3.0]]))
        (tensor([[1., 2.]]), tensor([3.]))
    """
    return spec.block.from_matrix(spec, m)
