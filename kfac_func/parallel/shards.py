"""Pure pieces of model-parallel K-FAC: which captured tensors are shards, and the
kl_clip scale summed over ranks.

No process group here: :mod:`kfac_func.parallel.preconditioner` moves the tensors and calls these.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kfac_func.blocks import LayerSpec
from kfac_func.core.preconditioning import kl_clip_scale_of_terms, kl_clip_term

__all__ = ["is_shard", "kl_clip_from_terms", "kl_clip_terms"]


def is_shard(spec: LayerSpec, split: str | None, parts: int, size: int, which: str) -> bool:
    """Whether a captured tensor whose last dimension is ``size`` is a model-parallel shard.

    ``which`` is ``"a"`` (the layer input: a shard of a row-parallel layer's features) or
    ``"g"`` (the output-gradient: a shard of a column-parallel layer's outputs). A tensor
    with the full size is the whole, replicated tensor. Any other size is an error that
    names the layer.

    Example:
        >>> from kfac_func.blocks import LayerSpec
        >>> spec = LayerSpec("fc", "linear", "fc.weight", None, 8, 6)
        >>> is_shard(spec, "row", 2, 4, "a"), is_shard(spec, "row", 2, 8, "a")
        (True, False)
    """
    full, sharded = (spec.in_dim, "row") if which == "a" else (spec.out_dim, "column")
    if split != sharded or parts == 1 or not spec.block.tensor_parallel:
        return False
    if size == full:
        return False
    if size * parts == full:
        return True
    what = "input" if which == "a" else "output-gradient"
    raise ValueError(
        f"layer {spec.name!r} ({split}-parallel over {parts} ranks): captured {what} has "
        f"last dimension {size}, expected {full} (whole) or {full // parts} (shard)"
    )


def kl_clip_terms(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """``Σ P ⊙ grad`` over (preconditioned, raw) matrix pairs, as a float64 0-d tensor on
    the CPU: the pairs' :func:`~kfac_func.core.preconditioning.kl_clip_term`, added in order.

    Summed over every layer of every rank, it gives :func:`kl_clip_from_terms`.
    """
    total = torch.zeros((), dtype=torch.float64)
    for p, g in pairs:
        total = total + kl_clip_term(p, g).cpu()
    return total


def kl_clip_from_terms(total: torch.Tensor, kl_clip: float, lr: float) -> torch.Tensor:
    """``min(1, sqrt(kl_clip / |lr² · total|))`` in float64 (1 when the total is zero), as
    :func:`kfac_func.core.kl_clip_scale` computes it from the pairs of one process
    (:func:`~kfac_func.core.preconditioning.kl_clip_scale_of_terms` of the one total).

    Example:
        >>> kl_clip_from_terms(torch.tensor(4.0, dtype=torch.float64), kl_clip=1.0, lr=1.0)
        tensor(0.5000, dtype=torch.float64)
    """
    return kl_clip_scale_of_terms([total.double()], kl_clip, lr, dtype=torch.float64)
