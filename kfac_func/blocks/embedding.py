"""``nn.Embedding``: one-hot inputs, so the A factor is diagonal (token frequencies).

``y = W[x]`` is the linear layer ``y = onehot(x) @ W`` with weight ``Wᵀ`` of shape
``(d, V)``: the gradient matrix is ``dWᵀ`` (``g_dim = d`` rows, ``a_dim = V`` columns), A
the diagonal of token counts (``Σ onehot onehotᵀ`` is diagonal: a vector of ``V`` entries,
never a ``V × V`` matrix) and G the ``d × d`` Gram of the output-gradients. K-FAC memory is
``O(V + d²)``. Every position of a sequence is a row (the "expand" convention).

A ``padding_idx`` row has a zero gradient, and stays zero after preconditioning (A is
diagonal, so columns are not mixed). Embeddings with ``sparse=True`` (sparse gradients),
``max_norm`` (the forward renormalises the weight in place) or ``scale_grad_by_freq`` (the
gradient is rescaled by token frequency) are skipped, with that reason in the table.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kfac_func.blocks.base import LayerBlock
from kfac_func.blocks.checks import overrides_forward
from kfac_func.blocks.mapped import mapped_params, mapping_error
from kfac_func.blocks.registry import register_block
from kfac_func.blocks.spec import (
    CheckedCall,
    Gram,
    LayerSpec,
    row_gram,
    shape_error,
    token_counts,
)

__all__ = ["EmbeddingBlock", "embed_scale"]


def embed_scale(module: nn.Module) -> float | None:
    """The scale of an embedding that multiplies its lookup by a constant, as Hugging Face
    code writes it (Gemma's, BART's: an ``embed_scale`` number or 0-d tensor attribute;
    for a tensor on the meta device, a model built there before its weights exist, the
    number Gemma 3 keeps beside it, ``scalar_embed_scale``), or None (no such attribute,
    a scale of 1, or one that cannot be read).

    Example:
        >>> from torch import nn
        >>> emb = nn.Embedding(5, 4)
        >>> embed_scale(emb) is None
        True
        >>> emb.embed_scale = 2.0
        >>> embed_scale(emb)
        2.0
    """
    value = getattr(module, "embed_scale", None)
    if isinstance(value, torch.Tensor) and value.device.type == "meta":
        value = getattr(module, "scalar_embed_scale", None)
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.device.type == "meta" or value.is_complex():
            return None
        value = float(value.detach().reshape(()))
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return None if value == 1.0 or value != value else value


@register_block
class EmbeddingBlock(LayerBlock):
    """A lookup table ``W`` of shape ``(V, d)`` (``in_dim = V``, ``out_dim = d``).

    Example:
        >>> import torch
        >>> from kfac_func.blocks import register
        >>> spec = register(torch.nn.Embedding(5, 3))[""]
        >>> spec.factor_shapes
        ((5,), (3, 3))
        >>> spec.block.a_gram(spec, torch.tensor([[0, 2, 2]]), torch.float32).gram
        tensor([1., 0., 2., 0., 0.])
    """

    kind = "embedding"
    module_types = (nn.Embedding,)
    formula_text = "weight[input]"

    def matches(self, module: nn.Module) -> bool:
        """An ``nn.Embedding`` (or a subclass that keeps its ``forward``) without a scale
        (see :func:`embed_scale`); a subclass with a ``forward`` of its own is
        :mod:`kfac_func.blocks.recorded_embedding`'s."""
        return (
            isinstance(module, nn.Embedding)
            and embed_scale(module) is None
            and not overrides_forward(module, (nn.Embedding,))
        )

    def spec(self, name: str, module: nn.Module) -> LayerSpec | str:
        assert isinstance(module, nn.Embedding)
        if module.sparse:
            return "sparse=True: sparse gradients are not supported"
        if module.max_norm is not None:
            return "max_norm renormalises the weight inside the forward; not supported"
        if module.scale_grad_by_freq:
            return "scale_grad_by_freq rescales the gradient by token frequency; not supported"
        prefix = f"{name}." if name else ""
        return LayerSpec(
            name,
            self.kind,
            f"{prefix}weight",
            None,
            module.num_embeddings,
            module.embedding_dim,
            diagonal=(True, False),
        )

    mappable = True

    def mapped_spec(self, name: str, module: nn.Module, options: Mapping[str, Any]) -> LayerSpec:
        """A lookup table of a class of the user's: ``weight`` ``(V, d)``, no bias, computing
        ``weight[x]``."""
        weight, bias = mapped_params(name, module, self.kind)
        if bias is not None or weight.dim() != 2:
            raise mapping_error(
                name,
                module,
                self.kind,
                f"the kind needs a 2-d weight and no bias, and it has a weight of shape "
                f"{tuple(weight.shape)}{' and a bias' if bias is not None else ''}",
            )
        prefix = f"{name}." if name else ""
        v, d = (int(s) for s in weight.shape)
        return LayerSpec(name, self.kind, f"{prefix}weight", None, v, d, diagonal=(True, False))

    def output(
        self, spec: LayerSpec, params: Mapping[str, torch.Tensor], x: torch.Tensor
    ) -> torch.Tensor:
        if x.is_floating_point() or x.is_complex():
            raise shape_error(spec, "input", "integer token indices", x.shape)
        return F.embedding(x, params["weight"])

    def weight_shape(self, spec: LayerSpec) -> tuple[int, ...]:
        return (spec.in_dim, spec.out_dim)

    def mismatch_hint(self, spec: LayerSpec, call: CheckedCall) -> str | None:
        """A constant factor (a scaled embedding whose scale the kind was not told) is
        named with the mapping that tells it."""
        hint = super().mismatch_hint(spec, call)
        if hint is None or spec.kind != "embedding":
            return hint
        rows = call.params["weight"][call.x]
        c = float((call.got * rows).sum()) / float(rows.pow(2).sum())
        return (
            f"{hint} (a scaled embedding: map its class with kinds={{cls: "
            f"('scaled_embedding', {{'scale': {c:.6g}}})}}, or give it an embed_scale attribute)"
        )

    def examples(self, spec: LayerSpec, x: torch.Tensor) -> int | None:
        """``N`` of ids ``(N, T, ...)``; 1 for a single id. 1-d ids ``(T,)`` do not tell: one
        unbatched sequence (or positions broadcast over the batch, as nanoGPT's
        ``wpe(arange(T))``) or ``T`` examples of one id each; the other layers say which."""
        if x.dim() == 0:
            return 1
        return int(x.shape[0]) if x.dim() >= 2 else None

    def broadcast_call(
        self, spec: LayerSpec, x: torch.Tensor, out: Any, batch_size: int
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Positions shared by the batch: ids ``(1, T)`` (Hugging Face's ``position_ids``)
        or ``(T,)`` with ``T != batch_size`` (nanoGPT's ``wpe(arange(T))``), whose output
        the model broadcasts against ``(N, T, d)``, are expanded to ``(N, T)`` and the
        output to ``(N, T, d)``: each example's output-gradient then reaches the factors
        on its own (``G`` averages over examples as every layer's does, and factors
        averaged over ranks equal one process's), instead of the batch's sum.

        Example:
            >>> import torch
            >>> from kfac_func.blocks import register
            >>> spec = register(torch.nn.Embedding(8, 3))[""]
            >>> ids, out = torch.arange(5)[None], torch.ones(1, 5, 3)
            >>> x, out = spec.block.broadcast_call(spec, ids, out, 4)
            >>> tuple(x.shape), tuple(out.shape)
            ((4, 5), (4, 5, 3))
        """
        if batch_size <= 1 or not isinstance(out, torch.Tensor):
            return None
        if x.dim() >= 2 and x.shape[0] == 1 and out.dim() == x.dim() + 1 and out.shape[0] == 1:
            return x.expand(batch_size, *x.shape[1:]), out.expand(batch_size, *out.shape[1:])
        if x.dim() == 1 and x.shape[0] != batch_size and out.dim() == 2:
            return x.expand(batch_size, -1), out.expand(batch_size, -1, -1)
        return None

    def a_gram(self, spec: LayerSpec, x: torch.Tensor, dtype: torch.dtype) -> Gram:
        """Token counts ``(V,)``: the diagonal of ``Σ onehot onehotᵀ``."""
        if x.is_floating_point() or x.is_complex():
            raise shape_error(spec, "input", "integer token indices", x.shape)
        return Gram(token_counts(spec, x, spec.in_dim, dtype), x.numel(), 1, True)

    def g_gram(self, spec: LayerSpec, r: torch.Tensor, dtype: torch.dtype) -> Gram:
        if r.dim() == 0 or r.shape[-1] != spec.out_dim:
            raise shape_error(spec, "output-gradient", f"last dimension {spec.out_dim}", r.shape)
        rows = r.to(dtype).reshape(-1, spec.out_dim)
        d = spec.g_diagonal
        return Gram(row_gram(rows, False, d), rows.shape[0], 1, d)

    def to_matrix(
        self, spec: LayerSpec, weight_grad: torch.Tensor, bias_grad: torch.Tensor | None
    ) -> torch.Tensor:
        return weight_grad.mT

    def from_matrix(
        self, spec: LayerSpec, m: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return m.mT, None
