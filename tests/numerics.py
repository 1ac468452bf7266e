"""Comparisons of what a computation determines uniquely, with tolerances said where they are
derived, so that a test holds on every CPU's kernels, not by the accident of one.

Two computations of the same step (grouped and per layer, sync-free and checked, compiled
and eager, with and without activation checkpointing) round differently wherever their
kernels differ: another instruction set, another blocking of a matrix product, a batched
call instead of a loop. What survives those differences, and what the tests compare:

- **Factors** are sums of products: equal to a few units of rounding of their largest
  entry.
- **Eigenvectors are not unique** inside a repeated eigenvalue, and a factor built from
  fewer rows than its width has a repeated eigenvalue zero (its null space) whose
  eigenvectors any rounding change rotates. A decomposition is compared through what it
  determines: its eigenvalues and the factor it reconstructs, ``Q diag(d) Qᵀ``; EKFAC's
  through the operator it applies.
- **A preconditioned gradient** is unique where the factors determine it. Adam's step in
  an eigenbasis (``eigenbasis_moments``) divides each coordinate by its own root mean
  square, so in a direction where the gradient is zero in exact arithmetic (a null
  direction of A or G: fewer rows than width, a LayerNorm's zero-mean output, softmax's
  gradient summing to zero) it turns rounding noise ``u·|g|`` into a step of size
  ``u·|g| / ε``, and in float32 into a step as large as any other. Those directions have
  no unique answer. :func:`assert_close_where_determined` compares the gradient matrices
  projected onto the eigenvectors of A and G whose eigenvalues exceed ``rel`` times the
  largest (``P_g · M · P_a``), where the step is determined; the projectors come from the
  reference's factors.
- **Adam's step in an eigenbasis also follows the eigenvectors**, which a rounding ``u``
  of a factor turns by ``u · λ_max / gap`` (Davis–Kahan; inside a cluster of eigenvalues
  closer than rounding, by anything). :func:`moments_tolerance` compares it only on
  eigenvectors isolated by a ``gap`` and derives the tolerance from the gaps left.
- **A warm-started eigenbasis** (``eigenbasis_refresh="qr"``, one power iteration from
  the previous eigenvectors) is a function of the factor *and* of the previous basis: a
  null space leaves that basis free, and the refresh carries its rotation into the
  factor's range. Such a comparison needs factors without a null space.
- **The conditioning of the damped preconditioner**: a relative rounding difference ``u``
  in its input comes out as up to ``u · κ`` with ``κ = (λ_max(G)·λ_max(A) + λ) / λ``;
  :func:`damped_rtol` turns that into a tolerance.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from kfac_func.blocks import grads_to_matrix
from kfac_func.core.decomposition import (
    EigenDecomposition,
    EKFACDecomposition,
    InverseDecomposition,
)

F64 = torch.float64

MOMENTS: dict[str, float] = {"rel": 1e-6, "rtol": 1e-10, "atol": 1e-12}
"""float64 tolerances of Adam's step in an eigenbasis, for
:func:`assert_close_where_determined` and :func:`assert_same_states`: each coordinate is
divided by its own root mean square, so a coordinate 10⁻ᵏ of the largest carries 10ᵏ times
the relative rounding of its projection; compared where the eigenvalues exceed 1e-6 of the
largest, with four orders of magnitude of that amplification allowed (1e-10 against
float64's 1e-16). What the rounding of the eigenvectors adds, :func:`moments_tolerance`
derives."""


def moments_tolerance(
    state: Any, dtype: torch.dtype, *, rel: float = 1e-6, gap: float = 1e-6
) -> dict[str, float]:
    """Tolerances of Adam's step in an eigenbasis, computed in ``dtype``, for
    :func:`assert_close_where_determined` and :func:`assert_same_states`: compared where A's
    and G's eigenvalues exceed ``rel`` of the largest and lie farther than ``gap`` of it from
    every other, with :data:`MOMENTS`'s ``atol`` raised to ``u · S / rel``, ``S`` the largest
    ``λ_max / gap`` of the compared eigenvalues of ``state``'s (the reference's) factors, at
    most ``1 / gap``.

    Derivation: a rounding ``u`` of a factor turns an eigenvector by ``u · λ_max`` over the
    distance to its nearest eigenvalue (Davis–Kahan), so a coordinate ``q_gᵀ M q_a`` moves by
    ``u · S · |M|``; a compared coordinate is about ``rel · |M|`` or more (both eigenvalues
    above ``rel``), and Adam divides it by its own root mean square, so its step (of the
    size of every other, the scale of the comparison) moves by up to ``u · S / rel`` of that
    scale. Inside a cluster of eigenvalues closer than ``gap`` the eigenvectors, and so
    Adam's step there, are not determined at all: measured on an AMD EPYC CPU's BLAS against
    another's, the nanoGPT fixture's grouped and per-layer steps differ by 5.9e-6 of the
    scale at ``S = 6.3e6`` with every eigenvalue above 1e-6 compared, GPT-2's float32 ones
    by 4.5e-5 at 1e-3. A missing or wrongly scaled layer differs by the order of the scale.
    """
    worst = 1.0
    for ls in state.layers.values():
        for factor in (ls.a_factor, ls.g_factor):
            f = factor.to(F64)
            if f.dim() == 1 or f.shape[-1] != f.shape[-2]:
                continue
            w = torch.linalg.eigvalsh(f).reshape(-1, f.shape[-1])
            keep = _kept(w, rel, gap)
            if bool(keep.any()):
                top = w.abs().amax(dim=-1, keepdim=True)
                worst = max(worst, float((top / _nearest(w))[keep].max()))
    bound = unit_roundoff(dtype) * worst / rel
    return {**MOMENTS, "rel": rel, "gap": gap, "atol": max(MOMENTS["atol"], bound)}


def named(what: str) -> Callable[[str], str]:
    """A ``msg=`` for ``torch.testing.assert_close`` that keeps its numbers and adds a name."""
    return lambda message: f"{what}: {message}"


def unit_roundoff(dtype: torch.dtype) -> float:
    """Half the distance from 1 to the next number of ``dtype``."""
    return float(torch.finfo(dtype).eps) / 2


def _nearest(w: torch.Tensor) -> torch.Tensor:
    """Each of the ascending eigenvalues ``w`` (batched over leading dimensions): its
    distance to the nearest other (infinite when alone)."""
    inf = torch.full_like(w[..., :1], float("inf"))
    d = w.diff(dim=-1)
    return torch.minimum(torch.cat([inf, d], dim=-1), torch.cat([d, inf], dim=-1))


def _kept(w: torch.Tensor, rel: float, gap: float) -> torch.Tensor:
    """Which of the ascending eigenvalues ``w`` (batched over leading dimensions) exceed
    ``rel`` times the largest and, when ``gap`` is positive, lie farther than ``gap`` times
    the largest from every other: the eigenvectors a rounding of the factor moves by at most
    ``u / gap`` (Davis–Kahan)."""
    top = w.abs().amax(dim=-1, keepdim=True)
    keep = w > rel * top
    if gap > 0:
        keep &= _nearest(w) > gap * top
    return keep


def spectral_projector(factor: torch.Tensor, rel: float, gap: float = 0.0) -> torch.Tensor:
    """The orthogonal projector onto the eigenvectors of a symmetric factor (or of a diagonal
    one stored as its vector) whose eigenvalues exceed ``rel`` times the largest (and, with
    ``gap``, are isolated as :func:`_kept` says), in float64; batched over leading
    dimensions. A diagonal factor's eigenvectors are the coordinates whatever the gaps."""
    f = factor.to(F64)
    if f.dim() == 1 or f.shape[-1] != f.shape[-2]:  # diagonal factors, stacked or not
        return torch.diag_embed((f > rel * f.abs().amax(dim=-1, keepdim=True)).to(F64))
    w, q = torch.linalg.eigh(f)
    keep = _kept(w, rel, gap).to(F64)
    return (q * keep[..., None, :]) @ q.mT


def layer_matrices(state: Any, grads: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each layer's gradient matrix ``(g_dim, a_dim)`` (bias last), by layer name."""
    out = {}
    for name, ls in state.layers.items():
        spec = ls.spec
        if spec.weight not in grads:
            continue
        bias = grads.get(spec.bias) if spec.bias is not None else None
        out[name] = grads_to_matrix(spec, grads[spec.weight], bias)
    return out


def assert_close_where_determined(
    got: Mapping[str, torch.Tensor],
    want: Mapping[str, torch.Tensor],
    state: Any,
    *,
    rel: float,
    rtol: float,
    atol: float,
    gap: float = 0.0,
) -> None:
    """Equal preconditioned gradients where the factors of ``state`` (the reference's)
    determine them: each layer's gradient matrix projected onto the eigenvectors of A and G
    above ``rel`` times their largest eigenvalue (and isolated by ``gap``, see
    :func:`spectral_projector`); parameters outside K-FAC's layers are compared whole.
    Tolerances apply to the projections, relative to their largest entry."""
    assert set(got) == set(want)
    matrices_got, matrices_want = layer_matrices(state, got), layer_matrices(state, want)
    covered = set()
    for name, m_want in matrices_want.items():
        ls = state.layers[name]
        p_a = spectral_projector(ls.a_factor, rel, gap)
        p_g = spectral_projector(ls.g_factor, rel, gap)
        if m_want.dim() != p_a.dim():  # no projection fits: compared entry by entry below
            continue
        covered.update(ls.spec.param_names())
        w = p_g @ m_want.to(F64) @ p_a
        scale = float(w.abs().max())
        torch.testing.assert_close(
            p_g @ matrices_got[name].to(F64) @ p_a,
            w,
            rtol=rtol,
            atol=atol * max(scale, 1.0),
            msg=named(
                f"layer {name!r} (projected onto A's and G's eigenvalues > {rel:g}·max"
                + (f", isolated by > {gap:g}·max)" if gap else ")")
            ),
        )
    for k in want:
        if k not in covered:
            torch.testing.assert_close(got[k], want[k], rtol=rtol, atol=atol, msg=named(k))


def _reconstruct(q: torch.Tensor | None, d: torch.Tensor) -> torch.Tensor:
    if q is None:
        return d.to(F64)
    return (q.to(F64) * d.to(F64)[..., None, :]) @ q.to(F64).mT


def _probe(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(0), dtype=F64)


def _ekfac_apply(dec: EKFACDecomposition, m: torch.Tensor) -> torch.Tensor:
    qg = None if dec.qg is None else dec.qg.to(F64)
    qa = None if dec.qa is None else dec.qa.to(F64)
    inner = m if qg is None else qg.mT @ m
    inner = inner if qa is None else inner @ qa
    inner = inner * dec.scale.to(F64)
    inner = inner if qg is None else qg @ inner
    return inner if qa is None else inner @ qa.mT


def assert_same_decomposition(
    got: Any, want: Any, *, rtol: float, atol: float, what: str = "decomposition"
) -> None:
    """Equal decompositions in what they determine: eigenvalues and the reconstructed
    factors (not eigenvectors, which a repeated eigenvalue leaves free), EKFAC's operator
    applied to a fixed random matrix, inverses entry by entry. ``atol`` is relative to the
    largest entry of the compared quantity."""
    assert type(got) is type(want), (what, type(got), type(want))

    def close(a: torch.Tensor, b: torch.Tensor, part: str) -> None:
        b64 = b.to(F64)
        scale = max(float(b64.abs().max()), 1e-300) if b64.numel() else 1.0
        torch.testing.assert_close(
            a.to(F64), b64, rtol=rtol, atol=atol * scale, msg=named(f"{what}: {part}")
        )

    if isinstance(want, EigenDecomposition):
        close(got.da, want.da, "eigenvalues of A")
        close(got.dg, want.dg, "eigenvalues of G")
        close(_reconstruct(got.qa, got.da), _reconstruct(want.qa, want.da), "Qa·diag(da)·Qaᵀ")
        close(_reconstruct(got.qg, got.dg), _reconstruct(want.qg, want.dg), "Qg·diag(dg)·Qgᵀ")
        assert (got.dgda is None) == (want.dgda is None), what
        if want.dgda is not None:
            close(got.dgda, want.dgda, "dgda")
    elif isinstance(want, EKFACDecomposition):
        m = _probe(tuple(want.scale.shape))
        close(_ekfac_apply(got, m), _ekfac_apply(want, m), "the EKFAC operator")
    elif isinstance(want, InverseDecomposition):
        close(got.a_inv, want.a_inv, "A's inverse")
        close(got.g_inv, want.g_inv, "G's inverse")
    else:
        raise TypeError(f"{what}: unknown decomposition {type(want).__name__}")


def _in_parameter_space(ls: Any, moment: torch.Tensor, rel: float, gap: float) -> torch.Tensor:
    """An eigenbasis moment rotated back, ``Qg·m·Qaᵀ``, projected where it is determined."""
    dec = ls.decomposition
    m = moment.to(F64)
    if dec.qg is not None:
        m = dec.qg.to(F64) @ m
    if dec.qa is not None:
        m = m @ dec.qa.to(F64).mT
    p_g = spectral_projector(ls.g_factor, rel, gap)
    p_a = spectral_projector(ls.a_factor, rel, gap)
    return p_g @ m @ p_a


def assert_same_states(
    got: Any,
    want: Any,
    *,
    rel: float,
    rtol: float,
    atol: float,
    gap: float = 0.0,
    exact_moments: bool = False,
) -> None:
    """Equal K-FAC states in what they determine: factors entry by entry, decompositions
    by :func:`assert_same_decomposition`, eigenbasis moments rotated back to the
    parameters' space and projected where the factors determine them (entry by entry with
    ``exact_moments``) and the counters entry by entry."""
    assert list(got.layers) == list(want.layers)
    for name, w in want.layers.items():
        g = got.layers[name]

        def close(a: torch.Tensor, b: torch.Tensor, part: str, name: str = name) -> None:
            torch.testing.assert_close(
                a.to(F64), b.to(F64), rtol=rtol, atol=atol, msg=named(f"layer {name!r}: {part}")
            )

        close(g.a_factor, w.a_factor, "A")
        close(g.g_factor, w.g_factor, "G")
        assert (g.decomposition is None) == (w.decomposition is None), name
        if w.decomposition is not None:
            assert_same_decomposition(
                g.decomposition, w.decomposition, rtol=rtol, atol=atol, what=f"layer {name!r}"
            )
        for field in ("basis_moment", "basis_momentum"):
            a, b = getattr(g, field), getattr(w, field)
            assert (a is None) == (b is None), (name, field)
            if b is None:
                continue
            if exact_moments:
                close(a, b, field)
            else:
                close(
                    _in_parameter_space(g, a, rel, gap), _in_parameter_space(w, b, rel, gap), field
                )
        for field in ("grad_skips", "factor_skips", "usable"):
            a, b = getattr(g, field), getattr(w, field)
            assert (a is None) == (b is None), (name, field)
            if b is not None:
                close(a, b, field)
        assert (g.factor_updates, g.moment_count) == (w.factor_updates, w.moment_count), name


def _largest_eigenvalue(factor: torch.Tensor) -> float:
    f = factor.to(F64)
    if f.dim() == 1 or f.shape[-1] != f.shape[-2]:
        return float(f.abs().max())
    return float(torch.linalg.eigvalsh(f).abs().max())


def damped_rtol(state: Any, damping: float, dtype: torch.dtype, slack: float = 64.0) -> float:
    """A relative tolerance for two roundings of the damped K-FAC preconditioner: ``slack ·
    u · κ`` with ``κ = (λ_max(G)·λ_max(A) + λ) / λ``, the largest over the layers of
    ``state`` (the conditioning of ``(G ⊗ A + λI)⁻¹``; eigen and EKFAC are bounded by it
    too), ``u`` the unit roundoff of ``dtype``."""
    kappa = 1.0
    for ls in state.layers.values():
        a = (
            float(torch.linalg.matrix_norm(ls.a_factor.to(F64), ord=2).max())
            if ls.a_factor.dim() > 1
            else float(ls.a_factor.abs().max())
        )
        g = (
            float(torch.linalg.matrix_norm(ls.g_factor.to(F64), ord=2).max())
            if ls.g_factor.dim() > 1
            else float(ls.g_factor.abs().max())
        )
        kappa = max(kappa, (a * g + damping) / damping)
    return slack * unit_roundoff(dtype) * kappa


def assert_close_to_scale(
    got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor], *, rtol: float
) -> None:
    """Equal tensors to ``rtol`` of each one's largest entry: the error bound of a
    computation whose rounding is amplified by a condition number (an entry much smaller
    than the largest carries the largest one's absolute error)."""
    assert set(got) == set(want)
    for k, w in want.items():
        scale = float(w.abs().max()) if w.numel() else 0.0
        torch.testing.assert_close(got[k], w, rtol=rtol, atol=rtol * scale, msg=named(k))


def eigenvector_sensitivity(state: Any, rel: float = 1e-9) -> float:
    """``λ_max / (smallest gap)`` over the eigenvalues of the factors of ``state`` that exceed
    ``rel`` times the largest: a rounding ``u`` of a factor moves its eigenvectors by about
    ``u`` times this (Davis–Kahan), which a step that is not a function of the factor alone
    (EKFAC's corrected eigenvalues, Adam's moments in the eigenbasis) passes on."""
    worst = 1.0
    for ls in state.layers.values():
        for factor in (ls.a_factor, ls.g_factor):
            f = factor.to(F64)
            if f.dim() == 1 or f.shape[-1] != f.shape[-2]:
                continue
            w = torch.linalg.eigvalsh(f).reshape(-1, f.shape[-1])
            for row in w:
                top = float(row.abs().max())
                kept = row[row > rel * top]
                if kept.numel() > 1:
                    gap = float(kept.diff().min())
                    worst = max(worst, top / max(gap, top * 1e-300))
    return worst
