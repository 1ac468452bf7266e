"""Scaled embeddings: ``y = s · W[x]`` with a constant ``s`` (Gemma's word embeddings
multiply by ``sqrt(d)``, BART's by ``sqrt(d)`` when ``scale_embedding``).

The lookup is the linear map ``onehot(x) @ (s W)``: the gradient of ``W`` is
``s · Σ onehot(x) gᵀ`` over the rows, ``g`` the output-gradient. So A is the embedding's
(the token counts, diagonal) and G is ``s²`` times the Gram of the output-gradients: the
Gram of the gradients ``s g`` that reach ``W``'s rows. Everything else (one row per
position, shared positions broadcast over the batch, the gradient matrix ``dWᵀ``) is the
Embedding kind's. A module is recognised as a scaled embedding by an ``embed_scale``
attribute (:func:`~kfac_func.blocks.embedding.embed_scale`); its first call is checked
against ``s · W[x]`` like any subclass's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kfac_func.blocks.embedding import EmbeddingBlock, embed_scale
from kfac_func.blocks.mapped import mapping_error
from kfac_func.blocks.registry import register_block
from kfac_func.blocks.spec import Gram, LayerSpec, shape_error

__all__ = ["ScaledEmbeddingBlock"]


@register_block
class ScaledEmbeddingBlock(EmbeddingBlock):
    """A lookup table ``W`` ``(V, d)`` whose rows are multiplied by the constant
    ``scale`` (option ``"scale"``).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from kfac_func.blocks import register
        >>> class Scaled(nn.Embedding):  # as Gemma's
        ...     def __init__(self):
        ...         super().__init__(5, 4)
        ...         self.embed_scale = 2.0
        ...     def forward(self, ids):
        ...         return super().forward(ids) * self.embed_scale
        >>> spec = register(Scaled())[""]
        >>> spec.kind, spec.option("scale"), spec.factor_shapes
        ('scaled_embedding', 2.0, ((5,), (4, 4)))
        >>> spec.block.g_gram(spec, torch.ones(1, 3, 4), torch.float32).gram[0, 0]
        tensor(12.)
    """

    kind = "scaled_embedding"
    module_types = (nn.Embedding,)
    reads_attributes = True
    mapped_options = ("scale",)

    def matches(self, module: nn.Module) -> bool:
        """An ``nn.Embedding`` (or subclass) with an ``embed_scale`` other than 1."""
        return isinstance(module, nn.Embedding) and embed_scale(module) is not None

    def spec(self, name: str, module: nn.Module) -> LayerSpec | str:
        spec = super().spec(name, module)
        scale = embed_scale(module)
        if isinstance(spec, str) or scale is None:
            return spec
        return _with_scale(spec, scale)

    def mapped_spec(self, name: str, module: nn.Module, options: Mapping[str, Any]) -> LayerSpec:
        """A scaled lookup table of a class of the user's: ``weight`` ``(V, d)``, no bias,
        computing ``scale * weight[x]``; ``scale`` from ``options``, else the module's
        ``embed_scale``."""
        spec = super().mapped_spec(name, module, options)
        scale = options["scale"] if "scale" in options else embed_scale(module)
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale != scale:
            raise mapping_error(
                name,
                module,
                self.kind,
                f"it needs a number 'scale' (kinds={{cls: ('{self.kind}', {{'scale': s}})}} "
                f"or an embed_scale attribute), got {scale!r}",
            )
        return _with_scale(spec, float(scale))

    def formula(self, spec: LayerSpec) -> str:
        return f"{spec.option('scale'):.6g} * weight[input]"

    def output(
        self, spec: LayerSpec, params: Mapping[str, torch.Tensor], x: torch.Tensor
    ) -> torch.Tensor:
        if x.is_floating_point() or x.is_complex():
            raise shape_error(spec, "input", "integer token indices", x.shape)
        return F.embedding(x, params["weight"]) * float(spec.option("scale"))

    def g_gram(self, spec: LayerSpec, r: torch.Tensor, dtype: torch.dtype) -> Gram:
        """``scale²`` times the Embedding kind's: the Gram of the gradients ``scale · r``
        that reach the weight's rows."""
        gram = super().g_gram(spec, r, dtype)
        s = float(spec.option("scale"))
        return gram._replace(gram=gram.gram * (s * s))


def _with_scale(spec: LayerSpec, scale: float) -> LayerSpec:
    options = tuple(sorted({**dict(spec.options), "scale": scale}.items()))
    return LayerSpec(
        spec.name,
        ScaledEmbeddingBlock.kind,
        spec.weight,
        spec.bias,
        spec.in_dim,
        spec.out_dim,
        diagonal=spec.diagonal,
        options=options,
    )
