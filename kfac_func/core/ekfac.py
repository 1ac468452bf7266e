"""EKFAC (George et al., NeurIPS 2018): K-FAC's eigenbasis with corrected eigenvalues.

K-FAC's curvature ``G ⊗ A`` has the eigenbasis ``Qg ⊗ Qa`` and the eigenvalues
``dg daᵀ``. EKFAC keeps the basis and replaces the eigenvalues by the second moment of the
per-example gradients projected into it:

    scale = (1/N) Σ_n (Qgᵀ ∇W_n Qa)²   (elementwise square, ``(g_dim, a_dim)``),

the exact diagonal of the Fisher in that basis (of the empirical Fisher with per-example
losses ``ℓ_n``; of the MC Fisher with sampled targets). With ``∇W_n = Σ_t g_nt a_ntᵀ``
(``t``: the positions that share the weight, one for a plain Linear) it is computed from
the rows of the layer's calls, ``Â = A_rows Qa`` and ``Ĝ = G_rows Qg``, without forming
per-example gradients when ``t`` has one position (``scale = (Ĝ²)ᵀ Â² / N``), and in chunks
of examples otherwise. A running average of it (``factor_decay``) is what preconditioning
divides by: ``Qg [(Qgᵀ M Qa) / (scale + λ)] Qaᵀ``. Pure tensor functions.
"""

from __future__ import annotations

import torch

from kfac_func.core.decomposition import EigenDecomposition, EKFACDecomposition

__all__ = ["example_moments", "from_eigen", "rescaled"]

_CHUNK_ELEMENTS = 1 << 24
"""At most this many entries of per-example projected gradients exist at once."""


def from_eigen(eig: EigenDecomposition) -> EKFACDecomposition:
    """The EKFAC decomposition of a fresh eigenbasis, its scale K-FAC's eigenvalues
    ``dg daᵀ`` until per-example statistics correct them.

    Example:
        >>> from kfac_func.core.layer_decomposition import eigen_decompose
        >>> d = from_eigen(eigen_decompose(torch.eye(2), 3 * torch.eye(1), 0.0))
        >>> d.scale
        tensor([[3., 3.]])
    """
    scale = eig.dg.unsqueeze(-1) * eig.da.unsqueeze(-2)
    return EKFACDecomposition(eig.qa, eig.qg, scale)


def example_moments(
    a_rows: torch.Tensor,
    g_rows: torch.Tensor,
    qa: torch.Tensor | None,
    qg: torch.Tensor | None,
) -> torch.Tensor:
    """``Σ_n (Qgᵀ (Σ_t g_nt a_ntᵀ) Qa)²`` (a sum over examples; divide by their number).

    Args:
        a_rows: ``(*batch, N, T, a_dim)`` input rows per example and position (the bias
            column included).
        g_rows: ``(*batch, N, T, g_dim)`` per-example output-gradient rows.
        qa, qg: the eigenbases (``None``: the identity).

    Example:
        >>> a, g = torch.randn(5, 1, 3), torch.randn(5, 1, 2)
        >>> per_example = torch.einsum("ntg,nta->nga", g, a)
        >>> torch.allclose(example_moments(a, g, None, None), per_example.pow(2).sum(0))
        True
    """
    # the bases (*batch, n, n) broadcast over examples and positions
    a_hat = a_rows if qa is None else a_rows @ qa.unsqueeze(-3)
    g_hat = g_rows if qg is None else g_rows @ qg.unsqueeze(-3)
    if a_hat.shape[-2] == 1:  # one position per example: a sum of outer products
        return g_hat.squeeze(-2).pow(2).mT @ a_hat.squeeze(-2).pow(2)
    n = a_hat.shape[-3]
    per = max(1, _CHUNK_ELEMENTS // max(1, a_hat[..., 0, 0, :].numel() * g_hat.shape[-1]))
    total: torch.Tensor | None = None
    for start in range(0, n, per):
        chunk = torch.einsum(
            "...ntg,...nta->...nga",
            g_hat[..., start : start + per, :, :],
            a_hat[..., start : start + per, :, :],
        )
        term = chunk.pow(2).sum(dim=-3)
        total = term if total is None else total.add_(term)
    assert total is not None, "no examples"
    return total


def rescaled(
    dec: EKFACDecomposition, moments: torch.Tensor, decay: float, restart: bool
) -> EKFACDecomposition:
    """``dec`` with its scale the running average ``decay·scale + (1−decay)·moments``, or
    ``moments`` itself when ``restart`` (a basis computed this step: the old scale belongs
    to the old basis)."""
    if restart:
        return EKFACDecomposition(dec.qa, dec.qg, moments.to(dec.scale.dtype))
    scale = dec.scale.mul(decay).add_(moments.to(dec.scale.dtype), alpha=1 - decay)
    return EKFACDecomposition(dec.qa, dec.qg, scale)
