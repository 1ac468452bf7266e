"""The factors of a tied embedding and head: one ``D ⊗ M`` for the sum of two uses.

See :mod:`kfac_func.blocks.tied` for the layer and the approximation; this module holds its
math. :func:`combine_uses` approximates ``Σᵢ Dᵢ ⊗ Mᵢ`` (``Dᵢ`` diagonal, vocabulary side;
``Mᵢ`` dense or diagonal, model side) by one Kronecker product, and :func:`tied_batch_factors`
builds one batch's use factors from the tied layer's Grams, with each use scaled by the
convention as its standalone layer would be.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kfac_func.blocks import Gram
from kfac_func.blocks.tied import EmbeddingUse, HeadUse
from kfac_func.core.conventions import Convention
from kfac_func.core.factors import factor_from_grams

__all__ = ["combine_stacked", "combine_uses", "is_tied", "stacked_like", "tied_batch_factors"]


def _trace(m: torch.Tensor) -> torch.Tensor:
    """Trace of a square matrix, or sum of a diagonal kept as a vector."""
    return m.sum(-1) if m.dim() == 1 else m.diagonal(dim1=-2, dim2=-1).sum(-1)


def combine_uses(
    uses: Sequence[tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(D, M)`` with ``D ⊗ M`` approximating ``Σᵢ Dᵢ ⊗ Mᵢ`` for ``uses = [(Dᵢ, Mᵢ)]``.

    With ``mᵢ = tr(Mᵢ)/d``, ``tᵢ = tr(Dᵢ) mᵢ`` (``tr(Dᵢ ⊗ Mᵢ) / d``), ``T = Σ tᵢ`` and the
    scale ``s = Σ tᵢ mᵢ / T``: ``D = Σ mᵢ Dᵢ / s`` and ``M = s · Σ tr(Dᵢ) Mᵢ / T``. The
    trace of the sum is kept; a use with ``Dᵢ ⊗ Mᵢ = 0`` drops out, so that one use alone
    is returned as it is; proportional uses are summed exactly. All uses vanishing gives
    zeros. No host synchronisation.

    Example:
        >>> d1, m1 = torch.tensor([1.0, 3.0]), torch.eye(2)
        >>> combine_uses([(d1, m1), (torch.zeros(2), 5 * torch.eye(2))])[0]
        tensor([1., 3.])
        >>> d, m = combine_uses([(d1, m1), (2 * d1, 3 * m1)])  # proportional: exact
        >>> torch.allclose(torch.kron(torch.diag(d), m), 7 * torch.kron(torch.diag(d1), m1))
        True
    """
    width = uses[0][1].shape[-1]
    ms = [_trace(m) / width for _, m in uses]
    trs = [_trace(d) for d, _ in uses]
    ts = [t * m for t, m in zip(trs, ms)]
    total = torch.stack(ts).sum(0)
    ok = total > 0
    safe = torch.where(ok, total, torch.ones_like(total))
    scale = torch.stack([t * m for t, m in zip(ts, ms)]).sum(0) / safe
    scale = torch.where(ok & (scale > 0), scale, torch.ones_like(scale))
    d_sum = sum((m * d for (d, _), m in zip(uses, ms)), torch.zeros_like(uses[0][0]))
    m_sum = sum((tr * m for (_, m), tr in zip(uses, trs)), torch.zeros_like(uses[0][1]))
    d_out = torch.where(ok, d_sum / scale, torch.zeros_like(d_sum))
    m_out = torch.where(ok, m_sum * (scale / safe), torch.zeros_like(m_sum))
    return d_out, m_out


def is_tied(grams: Sequence[Gram]) -> bool:
    """Whether ``grams`` are a tied layer's (their calls tell the use apart)."""
    return any(isinstance(g, (EmbeddingUse, HeadUse)) for g in grams)


def tied_batch_factors(
    a_grams: Sequence[Gram],
    g_grams: Sequence[Gram],
    convention: Convention,
    *,
    batch_size: int,
    loss_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(M, D)``: a tied layer's model-side (its A) and vocabulary-side (its G, diagonal)
    factors of one batch, one per use, stacked: ``M`` is ``(2, d, d)`` (``[M_h, M_e]``) and
    ``D`` is ``(2, V)`` (``[D_h, D_e]``), zeros for a use without calls.

    The head's calls give ``D_h`` = its output-gradients' diagonal Gram, scaled as a G
    factor, and ``M_h`` = its inputs' Gram, scaled as an A factor; the embedding's give
    ``D_e`` = token counts, scaled as an A factor (as the Embedding kind's A), and
    ``M_e`` = its output-gradients' Gram, scaled as a G factor. The uses stay apart until
    the window's factors are complete (summed over micro-batches and averaged over ranks,
    both linear): :func:`combine_stacked` then makes the layer's ``(M, D)``, so that the
    factors on several ranks equal one process's on the global batch.

    Example:
        >>> from kfac_func.blocks.tied import HeadUse
        >>> a = [HeadUse(torch.eye(2), 4, 1, False)]
        >>> g = [HeadUse(torch.tensor([4.0, 0.0, 8.0]), 4, 1, True)]
        >>> m, d = tied_batch_factors(a, g, "fisher", batch_size=4, loss_scale=1.0)
        >>> d  # the head's use, and no embedding call
        tensor([[1., 0., 2.],
                [0., 0., 0.]])
        >>> combine_stacked(m, d)[1]  # the head alone: its own factors
        tensor([1., 0., 2.])
    """
    uses: list[tuple[torch.Tensor, torch.Tensor] | None] = []
    for embedding in (False, True):
        picked = [
            (a, g) for a, g in zip(a_grams, g_grams) if isinstance(a, EmbeddingUse) == embedding
        ]
        if not picked:
            uses.append(None)
            continue
        inputs = factor_from_grams([a for a, _ in picked], convention)
        grads = factor_from_grams(
            [g for _, g in picked], convention, batch_size=batch_size, loss_scale=loss_scale
        )
        # in the head's orientation: (vocabulary side, model side)
        uses.append((inputs, grads) if embedding else (grads, inputs))
    some = next(u for u in uses if u is not None)
    full = [
        u if u is not None else (torch.zeros_like(some[0]), torch.zeros_like(some[1])) for u in uses
    ]
    return torch.stack([m for _, m in full]), torch.stack([d for d, _ in full])


def combine_stacked(m: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(M, D)`` of a tied layer from its stacked per-use factors (``m``: ``(uses, d, d)``
    or ``(uses, d)``, ``d``: ``(uses, V)``; see :func:`tied_batch_factors`), by
    :func:`combine_uses`.

    Example:
        >>> m = torch.stack([torch.eye(2), torch.zeros(2, 2)])
        >>> d = torch.stack([torch.tensor([1.0, 3.0]), torch.zeros(2)])
        >>> combine_stacked(m, d)[1]
        tensor([1., 3.])
    """
    d_out, m_out = combine_uses([(d[i], m[i]) for i in range(d.shape[0])])
    return m_out, d_out


def stacked_like(
    a_factor: torch.Tensor, g_factor: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero stacked batch factors of a tied layer whose running factors are ``a_factor``
    and ``g_factor`` (a rank that saw no call of the layer offers these).

    Example:
        >>> [t.shape for t in stacked_like(torch.eye(2), torch.ones(3))]
        [torch.Size([2, 2, 2]), torch.Size([2, 3])]
    """
    return (
        torch.zeros((2, *a_factor.shape), dtype=a_factor.dtype, device=a_factor.device),
        torch.zeros((2, *g_factor.shape), dtype=g_factor.dtype, device=g_factor.device),
    )
