"""A weight shared by one or more embedding modules and a head: one layer, two uses.

Language models with tied heads (GPT-2, nanoGPT, Llama-style ``tie_word_embeddings``) use one
parameter ``W`` of shape ``(V, d)`` twice: the embedding looks up rows ``W[x]`` and the head
computes logits ``h Wᵀ`` (an ``nn.Linear(d, V, bias=False)`` whose weight is the same
Parameter). Its gradient is the sum of both uses' gradients. :func:`tied_specs` turns such a
pair, found by :func:`kfac_func.register`, into one layer of kind ``"tied"``, named after the
head, whose calls are both modules' calls (the embedding's in its option ``"tied"``).

Several embedding modules may hold the one Parameter with at most one head (T5: ``shared``,
``encoder.embed_tokens`` and ``decoder.embed_tokens`` are three ``nn.Embedding`` with one
weight, tied to ``lm_head``): their lookups are the embedding use, pooled as the calls of
one embedding module called several times are (the others are named in the option
``"tied_also"``). So the factors are those of the same model written with one embedding
module under several names; a module never called (T5's ``shared``) adds nothing. They
must be of one kind (and one scale); otherwise the weight keeps the warned skip.

Both uses are written in the head's orientation: the gradient matrix is ``dW`` itself
(``g_dim = V`` rows: the vocabulary, ``a_dim = d`` columns: the model width).

- head use: ``dW = Σ rᵀ h`` over its rows, factors ``D_h = diag(G_h)`` (the output-gradients'
  Gram, kept as its diagonal, ``V``) and ``M_h = A_h`` (the inputs' Gram, ``d × d``);
- embedding use: ``dW = Σ onehot(x) rᵀ``, factors ``D_e = c`` (the token counts, the
  Embedding kind's diagonal A, ``V``) and ``M_e = R`` (its output-gradients' Gram, ``d × d``),

each scaled by the convention exactly as the standalone Linear (with a diagonal G) and
Embedding layers would be. The curvature of ``W`` is approximated by
``D_h ⊗ M_h + D_e ⊗ M_e`` (cross terms between the uses dropped, as K-FAC drops those
between the calls of one module), which is not one Kronecker product; the layer keeps
``D ⊗ M`` with the vocabulary side ``D`` diagonal and the model side ``M`` dense
(:func:`kfac_func.core.tied_factors.combine_uses`). With ``mᵢ = tr(Mᵢ)/d``,
``tᵢ = tr(Dᵢ) mᵢ = tr(Dᵢ ⊗ Mᵢ) / d``, ``T = Σ tᵢ`` and ``s = Σ tᵢ mᵢ / T``::

    D = Σᵢ mᵢ Dᵢ / s,        M = s · Σᵢ tr(Dᵢ) Mᵢ / T

so that, for any uses,

- ``tr(D ⊗ M) = Σᵢ tr(Dᵢ ⊗ Mᵢ)`` (the trace is kept);
- when one use vanishes (``Dⱼ ⊗ Mⱼ = 0``, e.g. the embedding's output is unused), ``D`` and
  ``M`` are the other use's factors themselves (every compute method is then exactly the
  single layer's);
- when the uses are proportional (``D₂ = a D₁``, ``M₂ = b M₁``), ``D ⊗ M = D₁ ⊗ M₁ + D₂ ⊗ M₂``.

The uses are kept apart (stacked) while a window's batch factors are summed over its
micro-batches and averaged over the ranks, both linear, and combined once the window is
complete (:func:`kfac_func.core.tied_factors.combine_stacked`); the running averages of
``D`` and ``M`` then proceed as for any layer. So the factors on several ranks equal one
process's on the global batch. Pairs whose shapes
disagree, a weight of two heads, and other shared parameters keep
:func:`kfac_func.register`'s warned skip.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from kfac_func.blocks.base import JointBlock
from kfac_func.blocks.registry import register_block
from kfac_func.blocks.spec import Gram, LayerSpec, row_gram, shape_error, token_counts

__all__ = ["EMBEDDING_KINDS", "EmbeddingUse", "HeadUse", "TiedBlock", "newly_tied", "tied_specs"]

EMBEDDING_KINDS = ("embedding", "scaled_embedding")
"""The kinds of an embedding that may be tied to a head."""


class HeadUse(Gram):
    """A :class:`Gram` of one call of a tied layer's head (``a``: its inputs, ``d``; ``g``:
    its output-gradients, diagonal, ``V``)."""

    __slots__ = ()


class EmbeddingUse(Gram):
    """A :class:`Gram` of one call of a tied layer's embedding (``a`` list: the token counts,
    ``V``; ``g`` list: the output-gradients' Gram, ``d``)."""

    __slots__ = ()


@register_block
class TiedBlock(JointBlock):
    """The weight ``W`` ``(V, d)`` shared by an embedding and an output head
    (``in_dim = d``, ``out_dim = V``; the vocabulary side is diagonal).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from kfac_func.blocks import register
        >>> model = nn.Sequential(nn.Embedding(7, 3), nn.Linear(3, 7, bias=False))
        >>> model[1].weight = model[0].weight
        >>> spec = register(model)["1"]
        >>> spec.kind, spec.weight, spec.factor_shapes, spec.option("tied")
        ('tied', '0.weight', ((3, 3), (7,)), '0')
    """

    kind = "tied"  # joint: a call's statistics depend on which use it is (told by its input)
    stacked_uses = 2
    module_types = ()  # made by register() from a pair of layers, never from one module
    model_parallel = False

    def matches(self, module: nn.Module) -> bool:
        return False

    def spec(self, name: str, module: nn.Module) -> LayerSpec | str:
        return "a tied layer is made from an embedding and a head by register()"

    def notes(self, spec: LayerSpec) -> list[str]:
        names = ", ".join(repr(n) for n in self.embeddings(spec))
        return [f"tied with {names}", *super().notes(spec)]

    @staticmethod
    def embeddings(spec: LayerSpec) -> list[str]:
        """The names of the embedding modules whose calls are the embedding use: the
        option ``"tied"``, then those of ``"tied_also"`` (a weight held by several)."""
        return [str(spec.option("tied")), *spec.option("tied_also", ())]

    @staticmethod
    def embedding_scale(spec: LayerSpec) -> float:
        """The constant the embedding multiplies its lookup by (1 but for a scaled
        embedding, :mod:`kfac_func.blocks.scaled_embedding`): its use's output-gradients
        reach the weight multiplied by it."""
        return float(spec.option("embedding_scale", 1.0))

    def embedding_spec(self, spec: LayerSpec) -> LayerSpec:
        """The embedding of the tied layer as a layer of its own (its kind, the shared
        weight in the embedding's orientation).

        Example:
            >>> from torch import nn
            >>> from kfac_func.blocks import register
            >>> model = nn.Sequential(nn.Embedding(7, 3), nn.Linear(3, 7, bias=False))
            >>> model[1].weight = model[0].weight
            >>> spec = register(model)["1"]
            >>> emb = spec.block.embedding_spec(spec)
            >>> emb.name, emb.kind, emb.weight_shape
            ('0', 'embedding', (7, 3))
        """
        scale = spec.option("embedding_scale")
        options = () if scale is None else (("scale", float(scale)),)
        return LayerSpec(
            str(spec.option("tied")),
            "embedding" if scale is None else "scaled_embedding",
            spec.weight,
            None,
            spec.out_dim,
            spec.in_dim,
            diagonal=(True, False),
            options=options,
        )

    def checked_calls(self, spec: LayerSpec) -> list[tuple[str, LayerSpec, bool]]:
        """The embedding's first call, checked as its kind's, when its class is not the
        torch class; the head's as a linear's, likewise."""
        out = []
        if spec.option("tied_checked") is not None:
            emb = self.embedding_spec(spec)
            out.append((emb.name, emb, False))
        if spec.option("checked") is not None:
            head = LayerSpec(spec.name, "linear", spec.weight, spec.bias, spec.in_dim, spec.out_dim)
            out.append((spec.name, head, False))
        return out

    @staticmethod
    def is_embedding_call(x: torch.Tensor, r: torch.Tensor) -> bool:
        """Whether a call is the embedding's: its input (token ids) has one dimension less
        than its output-gradient; the head's input has as many."""
        return x.dim() == r.dim() - 1

    def joint_grams(
        self, spec: LayerSpec, x: torch.Tensor, r: torch.Tensor, dtype: torch.dtype
    ) -> tuple[Gram, Gram]:
        d, v = spec.in_dim, spec.out_dim
        if r.dim() == 0:
            raise shape_error(spec, "output-gradient", f"last dimension {d} or {v}", r.shape)
        if self.is_embedding_call(x, r):
            if r.shape[-1] != d or tuple(x.shape) != tuple(r.shape[:-1]):
                raise shape_error(
                    spec, "embedding output-gradient", f"shape {(*x.shape, d)}", r.shape
                )
            if x.is_floating_point() or x.is_complex():
                raise shape_error(spec, "embedding input", "integer token indices", x.shape)
            counts = token_counts(spec, x, v, dtype)
            rows = r.to(dtype).reshape(-1, d) * self.embedding_scale(spec)
            gram = row_gram(rows, False, spec.a_diagonal)
            if spec.has_bias:  # the embedding does not use the head's bias: zeros there
                gram = nn.functional.pad(gram, (0, 1) if spec.a_diagonal else (0, 1, 0, 1))
            n = rows.shape[0]
            return EmbeddingUse(counts, n, 1, True), EmbeddingUse(gram, n, 1, spec.a_diagonal)
        if x.shape[-1] != d or r.shape[-1] != v or x.shape[:-1] != r.shape[:-1]:
            raise shape_error(
                spec,
                "head input and output-gradient",
                f"shapes (..., {d}) and (..., {v})",
                (*x.shape, *r.shape),
            )
        xs = x.to(dtype).reshape(-1, d)
        rs = r.to(dtype).reshape(-1, v)
        n = xs.shape[0]
        a = row_gram(xs, spec.has_bias, spec.a_diagonal)
        return HeadUse(a, n, 1, spec.a_diagonal), HeadUse(row_gram(rs, False, True), n, 1, True)

    def example_rows(
        self, spec: LayerSpec, x: torch.Tensor, r: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Head call: ``(inputs, output-gradients)``; embedding call: ``(output-gradients,
        one-hot token rows)`` (its gradient ``Σ onehot rᵀ`` in the head's orientation)."""
        n = x.shape[0] if r.dim() > 1 else 1
        d, v = spec.in_dim, spec.out_dim
        if self.is_embedding_call(x, r):
            ids = x.reshape(n, -1).long()
            onehot = nn.functional.one_hot(ids, v).to(r.dtype)
            rows = r.reshape(n, -1, d) * self.embedding_scale(spec)
            if spec.has_bias:  # no use of the head's bias
                rows = nn.functional.pad(rows, (0, 1))
            return rows, onehot
        rows = x.reshape(n, -1, d)
        if spec.has_bias:
            rows = nn.functional.pad(rows, (0, 1), value=1.0)
        return rows, r.reshape(n, -1, v)


def tied_specs(
    embedding: LayerSpec,
    head: LayerSpec,
    weight: str,
    bias: str | None = None,
    also: Sequence[LayerSpec] = (),
) -> LayerSpec | str:
    """The tied layer of an embedding and a head that share the parameter named ``weight``
    (its name in ``named_parameters()``), or why the pair cannot be one. A head with a bias
    (BERT's) keeps it: named ``bias`` (its name in ``named_parameters()``; default the
    head's), the model side's last row and column, which the embedding's use leaves zero.
    ``also``: further embedding modules holding the same weight, whose calls join the
    embedding use (of the embedding's kind and scale, else why not).

    Example:
        >>> e = LayerSpec("wte", "embedding", "wte.weight", None, 7, 3, diagonal=(True, False))
        >>> h = LayerSpec("lm_head", "linear", "lm_head.weight", None, 3, 7)
        >>> spec = tied_specs(e, h, "wte.weight")
        >>> spec.name, spec.weight, spec.diagonal
        ('lm_head', 'wte.weight', (False, True))
        >>> e2 = LayerSpec("dec", "embedding", "wte.weight", None, 7, 3, diagonal=(True, False))
        >>> tied_specs(e, h, "wte.weight", also=[e2]).option("tied_also")
        ('dec',)
    """
    if embedding.kind not in EMBEDDING_KINDS or head.kind != "linear":
        return f"kinds {embedding.kind!r} and {head.kind!r} are not an embedding and a head"
    for other in also:
        if (other.kind, other.option("scale")) != (embedding.kind, embedding.option("scale")):
            return (
                f"the embeddings {embedding.name!r} and {other.name!r} are not of one kind "
                "and scale"
            )
        if other.option("checked") or other.option("mapped"):
            return f"the embedding {other.name!r} is checked on its first call"
    if (embedding.in_dim, embedding.out_dim) != (head.out_dim, head.in_dim):
        return f"shapes {embedding.weight_shape} and {head.weight_shape} disagree"
    if head.option("rows") is not None or head.module != head.name:
        return f"the head {head.name!r} is a part of another module"
    options: dict[str, Any] = {"tied": embedding.name}
    if also:
        options["tied_also"] = tuple(o.name for o in also)
    if embedding.kind == "scaled_embedding":
        options["embedding_scale"] = float(embedding.option("scale"))
    # the first calls still checked: the embedding's (as its kind) and the head's
    checked = embedding.option("checked") or embedding.option("mapped")
    if checked is not None:
        options["tied_checked"] = checked
    if head.option("checked") or head.option("mapped"):
        options["checked"] = head.option("checked") or head.option("mapped")
    return LayerSpec(
        head.name,
        TiedBlock.kind,
        weight,
        (bias or head.bias) if head.has_bias else None,
        head.in_dim,
        head.out_dim,
        diagonal=(head.a_diagonal or any(e.g_diagonal for e in (embedding, *also)), True),
        options=tuple(sorted(options.items())),
    )


def newly_tied(layers: Mapping[str, Any], saved: Collection[str]) -> set[str]:
    """The tied layers (:mod:`kfac_func.blocks.tied`) of ``layers`` that a checkpoint of
    the layers ``saved`` predates: neither the tied layer nor its embeddings are in it
    (older versions skipped them). They load as they are in ``layers`` (fresh), not as
    missing.

    Example:
        >>> from torch import nn
        >>> from kfac_func.blocks import register
        >>> model = nn.Sequential(nn.Embedding(5, 3), nn.Linear(3, 5, bias=False))
        >>> model[1].weight = model[0].weight
        >>> newly_tied(register(model), saved=[]), newly_tied(register(model), ["1"])
        ({'1'}, set())
    """
    out = set()
    for name, item in layers.items():
        spec = getattr(item, "spec", item)
        if spec.kind != "tied" or name in saved:
            continue
        if not any(e in saved for e in TiedBlock.embeddings(spec)):
            out.add(name)
    return out
