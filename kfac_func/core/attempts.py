"""Attempts at a decomposition, and the retries that follow a failed one.

:func:`robust` makes one factor's attempts (its dtype, float64, float64 with jitter)
until one gives finite results; :func:`first_attempts` makes the first attempt of several
factors and reads their checks in one host synchronisation, handing any failure to that
factor's own retries. :mod:`kfac_func.core.decomposition` builds ``eigh`` and the damped
inverse on them.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable, Sequence

import torch

from kfac_func.blocks.spec import cast

__all__ = [
    "DecompositionError",
    "Outcome",
    "all_finite",
    "all_finite_together",
    "compute_dtype_of",
    "condition_estimate",
    "first_attempts",
    "outcome_of",
    "robust",
    "solver_error",
]


def all_finite(t: torch.Tensor) -> bool:
    """Whether every entry is finite: a finite sum proves it without the temporaries of
    ``isfinite``; only a sum that overflowed is checked entry by entry.

    Example:
        >>> all_finite(torch.tensor([1.0, 2.0])), all_finite(torch.tensor([1.0, float("nan")]))
        (True, False)
    """
    return all_finite_together((t,))


def all_finite_together(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether every entry of every tensor is finite, in one host read where they are: a
    finite sum of their sums proves it; only after a sum that overflowed (or one that is
    not finite) is each checked entry by entry.

    Example:
        >>> all_finite_together([torch.ones(2), torch.zeros(3)])
        True
        >>> all_finite_together([torch.ones(2), torch.tensor([float("inf")])])
        False
    """
    total: torch.Tensor | None = None
    for t in tensors:
        if t.numel():
            total = t.sum() if total is None else total + t.sum()
    if total is None or math.isfinite(float(total)):
        return True
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def compute_dtype_of(dtype: torch.dtype, compute_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype a decomposition runs in: ``compute_dtype``, by default the storage
    ``dtype`` promoted to at least float32.

    Example:
        >>> compute_dtype_of(torch.bfloat16, None), compute_dtype_of(torch.float32, torch.float64)
        (torch.float32, torch.float64)
    """
    return compute_dtype or torch.promote_types(dtype, torch.float32)


class DecompositionError(ArithmeticError):
    """A factor could not be decomposed, not even in float64 with added jitter.

    The message says what was tried and gives the factor's condition estimate."""


Outcome = tuple[torch.Tensor, ...] | RuntimeError
"""What one attempt of a decomposition gave: its results, or the error it raised."""

# relative jitters (times the mean |diagonal| of the factor) of the float64 retries
_JITTERS = (0.0, 1e-10, 1e-6)


def condition_estimate(factor: torch.Tensor) -> float:
    """Largest ratio of extreme singular values over the batch (inf if singular, nan if
    the factor is not finite); from the diagonal if the SVD itself fails.

    Example:
        >>> condition_estimate(torch.diag(torch.tensor([4.0, 0.5])))
        8.0
    """
    f = factor.detach().to(torch.float64)
    if not all_finite(f):
        return math.nan
    try:
        s = torch.linalg.svdvals(f)
        hi, lo = s[..., 0], s[..., -1]
    except RuntimeError:
        diag = f.diagonal(dim1=-2, dim2=-1).abs()
        hi, lo = diag.amax(-1), diag.amin(-1)
    with torch.no_grad():
        ratio = torch.where(lo > 0, hi / lo.clamp(min=1e-300), torch.full_like(hi, math.inf))
    return float(ratio.max())


# markers of errors raised by a GPU solver library (cuSOLVER, MAGMA, hipSOLVER) rather
# than by the numbers: e.g. CUSOLVER_STATUS_INVALID_VALUE from syevd on large factors
_SOLVER_MARKERS = ("cusolver", "magma", "hipsolver", "rocsolver")


def solver_error(err: BaseException) -> bool:
    """Whether ``err`` comes from a GPU solver library (cuSOLVER, MAGMA, hipSOLVER): a
    ``RuntimeError`` (or ``torch.linalg.LinAlgError``) whose message names one. Such an
    error says nothing about the factor; its retries run on the CPU.

    Example:
        >>> solver_error(RuntimeError("cusolver error: CUSOLVER_STATUS_INVALID_VALUE"))
        True
        >>> solver_error(torch.linalg.LinAlgError("linalg.eigh: failed to converge"))
        False
    """
    text = str(err).lower()
    return isinstance(err, RuntimeError) and any(m in text for m in _SOLVER_MARKERS)


def _device_name(device: torch.device) -> str:
    return "the CPU" if device.type == "cpu" else str(device)


def _attempt_name(dt: torch.dtype, jitter: float, device: torch.device | None) -> str:
    """How an attempt of :func:`robust` is named in its messages ("float64 + 1e-06·I on
    the CPU"); formatted only when a message needs it."""
    text = str(dt).removeprefix("torch.") + (f" + {jitter:.2g}·I" if jitter else "")
    return text if device is None else f"{text} on {_device_name(device)}"


@functools.cache
def _plan(compute_dtype: torch.dtype) -> tuple[tuple[torch.dtype, float], ...]:
    """The attempts of :func:`robust`: ``(dtype, relative jitter)``, the first in
    ``compute_dtype``, then the float64 ones."""
    first = ((compute_dtype, 0.0),) if compute_dtype != torch.float64 else ()
    return first + tuple((torch.float64, rel) for rel in _JITTERS)


def _refuse_nonfinite(factor: torch.Tensor, what: str, tried: list[str]) -> None:
    """After the first failed attempt (none ``tried`` before it), raise
    :class:`DecompositionError` if the factor itself holds NaN/Inf."""
    if not tried and not all_finite(factor):
        raise DecompositionError(f"{what}: the factor holds NaN/Inf")


def robust(
    factor: torch.Tensor,
    compute_dtype: torch.dtype,
    attempt: Callable[[torch.Tensor, float], tuple[torch.Tensor, ...]],
    what: str,
    dtype: torch.dtype,
    *,
    label: str | None = None,
    first: Outcome | None = None,
) -> tuple[torch.Tensor, ...]:
    """``attempt(factor in some dtype, jitter)`` in ``compute_dtype``, then in float64,
    then in float64 with growing jitter, until its results are finite in ``dtype`` (the
    storage dtype: a float64 result may overflow float32). Returns them in ``dtype`` on
    the factor's device.

    The attempts run on the factor's device. After a GPU solver error
    (:func:`solver_error`) the remaining attempts run on the CPU, and a success after one
    is reported with a ``RuntimeWarning`` that starts with ``label`` (e.g. the layer and
    the factor).

    A factor that holds NaN/Inf is refused once the first attempt fails (its results are
    not finite, or it raised), without a retry: it is not checked before, as a factor
    folded in this step is known finite already.

    ``first``: the outcome of the first attempt, made already (:func:`first_attempts`;
    its results in ``dtype``, or the error it raised), taken instead of making it again.

    Example:
        >>> def attempt(f, jitter):  # fails in float32, as a solver might
        ...     if f.dtype == torch.float32:
        ...         raise RuntimeError("not in float32")
        ...     return (f.sqrt(),)
        >>> robust(torch.tensor([4.0]), torch.float32, attempt, "sqrt", torch.float32)
        (tensor([2.]),)
    """
    home = factor.device
    run_on = home
    tried: list[str] = []
    solver: str | None = None  # the first solver error, when one was met
    scale: float | None = None  # the mean |diagonal|, read once a retry needs it
    for dt, rel in _plan(compute_dtype):
        if rel and scale is None:
            scale = float(factor.detach().diagonal(dim1=-2, dim2=-1).abs().double().mean())
            scale = scale if scale > 0 else 1.0
        jitter = rel * (scale or 1.0)
        try:
            if first is not None:  # (made already: taken once)
                given, first = first, None
                out = outcome_of(given)
            else:
                out = tuple(cast(t, dtype, home) for t in attempt(cast(factor, dt, run_on), jitter))
        except RuntimeError as err:  # torch.linalg.LinAlgError, cuSOLVER errors and kin
            _refuse_nonfinite(factor, what, tried)
            where = _attempt_name(dt, jitter, run_on if run_on != home else None)
            line = str(err).splitlines()[0][:120] if str(err) else type(err).__name__
            tried.append(f"{where}: {line}")
            if solver_error(err):
                dt_name = str(dt).removeprefix("torch.")
                solver = solver or f"{dt_name} on {_device_name(run_on)}: {line}"
                run_on = torch.device("cpu")
            continue
        if all_finite_together(out):
            if solver is not None:
                where = _attempt_name(dt, jitter, run_on if run_on != home else None)
                warnings.warn(
                    f"{label + ': ' if label else ''}{what} raised a solver error ({solver}); "
                    f"the retry in {where} succeeded",
                    RuntimeWarning,
                    stacklevel=2,
                )
            return out
        _refuse_nonfinite(factor, what, tried)
        where = _attempt_name(dt, jitter, run_on if run_on != home else None)
        tried.append(f"{where}: non-finite result in {str(dtype).removeprefix('torch.')}")
    raise DecompositionError(
        f"{what} failed ({'; '.join(tried)}); condition estimate {condition_estimate(factor):.3g}"
    )


def first_attempts(
    factors: Sequence[torch.Tensor],
    attempt: Callable[[torch.Tensor, float], tuple[torch.Tensor, ...]],
    compute_dtype: torch.dtype,
    dtype: torch.dtype,
) -> tuple[list[Outcome], bool]:
    """The first attempt of :func:`robust` on each of ``factors`` (in ``compute_dtype``,
    on its device, without jitter): each one's results in ``dtype`` or the error it
    raised, and whether every attempt succeeded with finite results, read in one host
    synchronisation for them all. A layer's two factors decomposed together pay one check
    instead of two; where one failed, each factor takes its own retries from its outcome
    (``first=`` of :func:`~kfac_func.core.decomposition.eigh_factor` and
    :func:`~kfac_func.core.decomposition.damped_inverse`), as if decomposed alone.

    Example:
        >>> from kfac_func.core.decomposition import eigh_attempt
        >>> out, ok = first_attempts([torch.eye(2), 2 * torch.eye(3)], eigh_attempt,
        ...                          torch.float32, torch.float32)
        >>> ok, out[1][1]
        (True, tensor([2., 2., 2.]))
        >>> first_attempts([torch.full((2, 2), float("nan"))], eigh_attempt,
        ...                torch.float32, torch.float32)[1]
        False
    """
    outs: list[Outcome] = []
    for f in factors:
        try:
            outs.append(tuple(cast(t, dtype) for t in attempt(cast(f, compute_dtype), 0.0)))
        except RuntimeError as err:  # handed to the factor's retries (see robust)
            outs.append(err)
    made = [out for out in outs if isinstance(out, tuple)]
    ok = len(made) == len(outs) and all_finite_together([t for out in made for t in out])
    return outs, ok


def outcome_of(first: Outcome) -> tuple[torch.Tensor, ...]:
    """The results of an attempt made already, or its error raised again.

    Example:
        >>> outcome_of((torch.ones(1),))
        (tensor([1.]),)
    """
    if isinstance(first, RuntimeError):
        raise first
    return first
