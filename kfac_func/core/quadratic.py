"""The quadratic model of the adaptive step, its 2×2 minimisation and the damping rule.

The adaptive step (:mod:`kfac_func.step.adaptive`) looks for the update ``x = α·v₁ + μ·v₂``
that minimises the local quadratic model of the objective ``h``::

    M(x) = ½ xᵀ (C + λI) x + ∇hᵀ x

where ``v₁ = −Δ`` is K-FAC's step direction (``Δ`` the preconditioned gradient, as
:func:`kfac_func.update` returns it), ``v₂ = δ`` the previous update, ``C`` the exact
curvature (the Gauss–Newton matrix of the loss) and ``λ`` the damping. Over ``(α, μ)`` the
model is ``½ cᵀ Q c + bᵀ c`` with ``Qᵢⱼ = vᵢᵀ (C + λI) vⱼ`` and ``bᵢ = ∇hᵀ vᵢ``, minimised by
``c = −Q⁻¹ b`` where the predicted change of the objective is ``½ bᵀ c`` (negative: a
decrease). :func:`solve_quadratic` does this robustly; :func:`reduction_ratio` and
:func:`lm_damping` are the Levenberg–Marquardt adaptation of ``λ`` from the change that
the step actually achieved. Everything here is on host floats except :func:`inner`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

__all__ = [
    "QuadraticSolution",
    "damped_gram",
    "inner",
    "lm_damping",
    "reduction_ratio",
    "solve_quadratic",
]

Matrix = torch.Tensor | Sequence[Sequence[float]]
Vector = torch.Tensor | Sequence[float]


class QuadraticSolution(NamedTuple):
    """The minimiser of the model over ``(α, μ)`` and the model's value there.

    ``method`` says which problem was solved: ``"alpha_mu"`` (both coefficients),
    ``"alpha"`` (``μ = 0``: no second vector, or ``Q`` not safely positive definite),
    ``"none"`` (no step: the first vector is zero or has no positive curvature) or
    ``"nonfinite"`` (``Q`` or ``b`` held NaN/Inf; no step).
    """

    alpha: float
    mu: float
    predicted: float
    method: str


def _number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise ValueError(f"{name} must be a number, got {value!r}")
    return float(value)


def inner(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> torch.Tensor:
    """``Σₖ ⟨aₖ, bₖ⟩``: the inner product of two vectors given in pieces, as a float64 0-d tensor.

    Products are taken in the pieces' dtype and accumulated in float64.

    Example:
        >>> import torch
        >>> inner([torch.ones(2), torch.full((3,), 2.0)], [torch.ones(2), torch.ones(3)])
        tensor(8., dtype=torch.float64)
    """
    if len(a) != len(b):
        raise ValueError(f"inner needs as many pieces in a as in b, got {len(a)} and {len(b)}")
    sums = []
    for x, y in zip(a, b):
        if x.shape != y.shape:
            raise ValueError(f"inner: pieces of shapes {tuple(x.shape)} and {tuple(y.shape)}")
        sums.append(torch.sum(x * y, dtype=torch.float64))
    return torch.stack(sums).sum() if sums else torch.zeros((), dtype=torch.float64)


def damped_gram(curvature: torch.Tensor, vector_gram: torch.Tensor, damping: float) -> torch.Tensor:
    """``Q = C_V + λ G_V``: the model's matrix from the curvature Gram ``C_V = VᵀCV``, the
    plain Gram ``G_V = VᵀV`` of the vectors and the damping ``λ`` (symmetrised).

    Example:
        >>> import torch
        >>> damped_gram(torch.tensor([[2.0, 1.0], [1.0, 3.0]]), torch.eye(2), 0.5)
        tensor([[2.5000, 1.0000],
                [1.0000, 3.5000]])
    """
    lam = _number("damping", damping)
    if lam < 0:
        raise ValueError(f"damping must be >= 0, got {damping!r}")
    if curvature.shape != vector_gram.shape or curvature.dim() != 2:
        raise ValueError(
            f"curvature and vector_gram must be square matrices of one shape, got "
            f"{tuple(curvature.shape)} and {tuple(vector_gram.shape)}"
        )
    q = curvature + lam * vector_gram
    return (q + q.T) / 2


def _host(q: Matrix, b: Vector) -> tuple[list[list[float]], list[float]]:
    rows = q.tolist() if isinstance(q, torch.Tensor) else [list(r) for r in q]
    vec = b.tolist() if isinstance(b, torch.Tensor) else list(b)
    k = len(vec)
    if k not in (1, 2) or len(rows) != k or any(len(r) != k for r in rows):
        raise ValueError(f"q must be k×k and b of length k for k in (1, 2), got q={rows!r}")
    return [[float(x) for x in r] for r in rows], [float(x) for x in vec]


def solve_quadratic(q: Matrix, b: Vector, *, rtol: float = 1e-6) -> QuadraticSolution:
    """Minimise ``½ cᵀ Q c + bᵀ c`` over ``c = (α, μ)`` (or over ``α`` alone when ``b`` has one
    entry), falling back to ``μ = 0`` when ``Q`` is not safely positive definite.

    The 2×2 problem is solved when ``Q₁₁ > 0``, ``Q₂₂ > 0`` and
    ``det Q > rtol · Q₁₁ Q₂₂`` (the vectors are not nearly parallel under ``Q``); otherwise
    ``α = −b₁/Q₁₁`` with ``μ = 0`` when ``Q₁₁ > 0``; otherwise no step. ``predicted`` is the
    model's value at the solution, ``½ bᵀ c`` (≤ 0).

    Example:
        >>> s = solve_quadratic([[2.0, 0.0], [0.0, 4.0]], [-2.0, 2.0])
        >>> s.alpha, s.mu, s.predicted, s.method
        (1.0, -0.5, -1.5, 'alpha_mu')
        >>> solve_quadratic([[2.0, 0.0], [0.0, 0.0]], [-2.0, 0.0]).method  # δ = 0
        'alpha'
    """
    rows, vec = _host(q, b)
    tol = _number("rtol", rtol)
    if not all(math.isfinite(x) for x in [*vec, *rows[0], *rows[-1]]):
        return QuadraticSolution(0.0, 0.0, 0.0, "nonfinite")
    q11, b1 = rows[0][0], vec[0]
    if len(vec) == 2:
        q12, q22, b2 = (rows[0][1] + rows[1][0]) / 2, rows[1][1], vec[1]
        det = q11 * q22 - q12 * q12
        if q11 > 0 and q22 > 0 and det > tol * q11 * q22:
            alpha = -(q22 * b1 - q12 * b2) / det
            mu = -(q11 * b2 - q12 * b1) / det
            return QuadraticSolution(alpha, mu, 0.5 * (b1 * alpha + b2 * mu), "alpha_mu")
    if q11 > 0:
        alpha = -b1 / q11
        return QuadraticSolution(alpha, 0.0, 0.5 * b1 * alpha, "alpha")
    return QuadraticSolution(0.0, 0.0, 0.0, "none")


def reduction_ratio(actual: float, predicted: float | None) -> float | None:
    """ρ = actual change / predicted change of the objective.

    ``None`` when no decrease was predicted (``predicted`` None or ≥ 0: there is nothing to
    compare); ``−∞`` when the actual change is not finite (the step failed outright).

    Example:
        >>> reduction_ratio(-0.9, -1.0), reduction_ratio(float("nan"), -1.0)
        (0.9, -inf)
        >>> reduction_ratio(0.0, 0.0) is None
        True
    """
    if predicted is None or not predicted < 0:
        return None
    change = float(actual)
    if not math.isfinite(change):
        return -math.inf
    return change / predicted


def lm_damping(
    damping: float,
    rho: float | None,
    *,
    omega: float,
    min_damping: float = 0.0,
    max_damping: float = math.inf,
) -> float:
    """The Levenberg–Marquardt rule: ``λ ← ω·λ`` when ``ρ > 3/4`` (the model was good),
    ``λ ← λ/ω`` when ``ρ < 1/4`` (or ρ is NaN), unchanged otherwise or when ``ρ`` is None;
    the result clamped to ``[min_damping, max_damping]``.

    Args:
        damping: the current ``λ`` (≥ 0).
        rho: the reduction ratio (:func:`reduction_ratio`).
        omega: the factor in ``(0, 1]``, e.g. ``(19/20)**interval``.
        min_damping, max_damping: the bounds (``0 ≤ min_damping ≤ max_damping``).

    Example:
        >>> lm_damping(1.0, 0.9, omega=0.5), lm_damping(1.0, 0.1, omega=0.5)
        (0.5, 2.0)
        >>> lm_damping(1.0, 0.5, omega=0.5), lm_damping(1.0, 0.1, omega=0.5, max_damping=1.5)
        (1.0, 1.5)
    """
    lam = _number("damping", damping)
    w = _number("omega", omega)
    lo, hi = _number("min_damping", min_damping), _number("max_damping", max_damping)
    if lam < 0 or not math.isfinite(lam):
        raise ValueError(f"damping must be finite and >= 0, got {damping!r}")
    if not 0 < w <= 1:
        raise ValueError(f"omega must be in (0, 1], got {omega!r}")
    if not 0 <= lo <= hi:
        raise ValueError(
            f"min_damping and max_damping must satisfy 0 <= min_damping <= max_damping, "
            f"got {min_damping!r} and {max_damping!r}"
        )
    if rho is not None and rho > 0.75:
        lam = w * lam
    elif rho is not None and not rho >= 0.25:  # includes NaN
        lam = lam / w
    return min(max(lam, lo), hi)
