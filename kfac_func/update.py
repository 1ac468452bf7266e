"""`update`: one pure K-FAC step, composed of three pure stages.

1. :func:`accumulate_factors` folds the batch factors of the captures into the running
   averages (``factor_decay``);
2. :func:`decompose` recomputes the eigendecompositions or damped inverses;
3. :func:`precondition_grads` applies them to the gradients and scales by ``kl_clip``.

Every function returns new objects and leaves its inputs untouched, except that
``update(..., donate=True)`` may reuse the state it is handed (see :func:`update`).
Hyperparameters are numbers or ``step -> value`` callables, evaluated at ``state.step``.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import Literal, NamedTuple, TypeVar

import torch

from kfac_func.capture import Captures
from kfac_func.conventions import decomposition_dtype, micro_batch_weights
from kfac_func.decomposition import (
    Decomposition,
    DecompositionError,
    EigenDecomposition,
    all_finite,
    eigen_decompose,
    inverse_decompose,
    kl_clip_scale_of_terms,
    kl_clip_term,
    precondition,
    precondition_rows,
)
from kfac_func.factors import (
    Gram,
    Rows,
    a_gram,
    check_grads,
    factor_from_grams,
    g_gram,
    grads_to_matrix,
    linear_rows,
    matrix_to_grads,
    rows_match,
    rows_reproduce,
)
from kfac_func.layers import LayerSpec
from kfac_func.state import KFACConfig, KFACState, LayerState

__all__ = [
    "NonFiniteError",
    "accumulate_factors",
    "decompose",
    "precondition_grads",
    "update",
]

T = TypeVar("T")
Hyper = float | Callable[[int], float]
NonFinite = Literal["skip", "raise"]
LayerFactors = tuple[torch.Tensor, torch.Tensor, float]
"""One layer's batch factors ``(A, G, weight)`` (see :func:`factors_from_stats`)."""


class NonFiniteError(ValueError):
    """A NaN or Inf reached K-FAC; the message names the layer and the tensor."""


def _resolve(value: T | Callable[[int], T], step: int) -> T:
    return value(step) if callable(value) else value  # type: ignore[return-value]


def _check(name: str, value: float | None, ok: Callable[[float], bool], expected: str) -> None:
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    if math.isnan(value) or not ok(value):
        raise ValueError(f"{name} must be {expected}, got {value!r}")


def _as_list(captures: Captures | Sequence[Captures]) -> list[Captures]:
    return [captures] if isinstance(captures, Captures) else list(captures)


def _take(mapping: Mapping[str, T] | None, key: str, consume: bool) -> T | None:
    """``mapping[key]`` or None; with ``consume``, removed from a mutable ``mapping`` so that
    the caller's mapping no longer keeps it alive."""
    if mapping is None:
        return None
    if consume and isinstance(mapping, MutableMapping):
        taken: T | None = mapping.pop(key, None)
        return taken
    return mapping.get(key)


class MicroBatchStats(NamedTuple):
    """One layer's statistics from one micro-batch: per-call Grams of inputs and
    output-gradients, the micro-batch's example count and its loss scale."""

    a: list[Gram]
    g: list[Gram]
    batch_size: int
    loss_scale: float


def factors_from_stats(
    name: str, micro_batches: Sequence[MicroBatchStats], config: KFACConfig
) -> tuple[torch.Tensor, torch.Tensor, float] | None:
    """A, G and weight of one accumulation window for one layer; None if it saw nothing.

    The weight is what the window counts for when windows of several ranks are averaged
    (see :func:`kfac_func.conventions.micro_batch_weights`).
    """
    seen = [m for m in micro_batches if m.a]
    if not seen:
        return None
    sizes = [m.batch_size for m in seen]
    a_sum: torch.Tensor | None = None
    g_sum: torch.Tensor | None = None
    for w, m in zip(micro_batch_weights(config.convention, sizes), seen):
        if len(m.a) != len(m.g):
            raise ValueError(
                f"layer {name!r}: {len(m.a)} captured inputs but {len(m.g)} output-gradients"
            )
        a = factor_from_grams(m.a, config.convention)
        g = factor_from_grams(
            m.g, config.convention, batch_size=m.batch_size, loss_scale=m.loss_scale
        )
        if a_sum is None or g_sum is None:  # the first: no copy when its weight is 1
            a_sum, g_sum = (a, g) if w == 1 else (w * a, w * g)
        else:
            a_sum.add_(a, alpha=w)  # our own temporaries: accumulate in place
            g_sum.add_(g, alpha=w)
    assert a_sum is not None and g_sum is not None
    return a_sum, g_sum, float(sum(sizes)) if config.convention == "fisher" else 1.0


def layer_batch_factors(
    spec: LayerSpec, micro_batches: Sequence[Captures], config: KFACConfig
) -> tuple[torch.Tensor, torch.Tensor, float] | None:
    """:func:`factors_from_stats` of captures (one per micro-batch)."""
    stats = []
    for cap in micro_batches:
        lc = cap.layers.get(spec.name)
        if lc is None or not lc.inputs:
            continue
        dt = config.factor_dtype
        stats.append(
            MicroBatchStats(
                [a_gram(spec, x, dt) for x in lc.inputs],
                [g_gram(spec, r, dt) for r in lc.output_grads],
                cap.batch_size,
                cap.loss_scale,
            )
        )
    return factors_from_stats(spec.name, stats, config)


def factors_finite(name: str, a: torch.Tensor, g: torch.Tensor, mode: NonFinite) -> bool:
    """True if both batch factors are finite; else warn (``"skip"``) or raise."""
    bad = [w for w, f in (("A", a), ("G", g)) if not all_finite(f)]
    if bad:
        _non_finite(name, f"the {' and '.join(bad)} factor of this batch", mode)
    return not bad


def fold_checked(
    ls: LayerState,
    a: torch.Tensor,
    g: torch.Tensor,
    decay: float,
    config: KFACConfig,
    nonfinite: NonFinite,
) -> LayerState:
    """:func:`fold_factors` when both batch factors are finite, else the layer unchanged
    but for one more skipped update (or :class:`NonFiniteError`).

    A running factor that holds NaN/Inf already (a state built or loaded that way) is
    restarted from the batch factor, with a warning, so that it cannot stay poisoned.
    """
    name = ls.spec.name
    if not factors_finite(name, a, g, nonfinite):
        return ls.replace(skipped_updates=ls.skipped_updates + 1)
    new = fold_factors(ls, a, g, decay, config)
    bad = [w for w, f in (("A", new.a_factor), ("G", new.g_factor)) if not all_finite(f)]
    if bad:
        msg = f"layer {name!r}: the running {' and '.join(bad)} factor held NaN/Inf"
        if nonfinite == "raise":
            raise NonFiniteError(msg)
        warnings.warn(f"{msg}; restarted from this batch", RuntimeWarning, stacklevel=2)
        new = new.replace(
            a_factor=a if "A" in bad else new.a_factor, g_factor=g if "G" in bad else new.g_factor
        )
    return new


def fold_factors(
    ls: LayerState, a: torch.Tensor, g: torch.Tensor, decay: float, config: KFACConfig
) -> LayerState:
    """Running average ``decay·old + (1−decay)·batch`` (the first ``"fisher"`` update
    takes the batch factors as they are)."""
    if ls.factor_updates == 0 and config.convention == "fisher":
        new_a, new_g = a, g
    else:
        # one new tensor per factor: decay·old, then + (1 − decay)·batch in place
        new_a = ls.a_factor.mul(decay).add_(a, alpha=1 - decay)
        new_g = ls.g_factor.mul(decay).add_(g, alpha=1 - decay)
    return ls.replace(a_factor=new_a, g_factor=new_g, factor_updates=ls.factor_updates + 1)


def _non_finite(layer: str, what: str, mode: NonFinite) -> None:
    msg = f"layer {layer!r}: non-finite values (NaN/Inf) in {what}"
    if mode == "raise":
        raise NonFiniteError(msg)
    warnings.warn(f"{msg}; skipped for this step", RuntimeWarning, stacklevel=3)


def accumulate_factors(
    state: KFACState,
    captures: Captures | Sequence[Captures],
    *,
    factor_decay: Hyper = 0.95,
    nonfinite: NonFinite = "skip",
) -> KFACState:
    """Fold one accumulation window of captures into the running-average factors.

    ``new = decay · old + (1 − decay) · batch``; the first update of a ``"fisher"`` state
    takes the batch factor as is (see :mod:`kfac_func.conventions`). Several captures
    (micro-batches) form one update. Layers absent from the captures keep their factors.
    A layer whose batch factors hold NaN/Inf keeps its factors and counts a skipped update
    (``nonfinite="skip"``, with a warning) or raises :class:`NonFiniteError`.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import kfac_func as kf
        >>> model = nn.Linear(3, 2)
        >>> state = kf.init(kf.register(model))
        >>> _, _, caps = kf.capture(model, dict(model.named_parameters()),
        ...                         torch.randn(4, 3), lambda out: out.sum())
        >>> kf.accumulate_factors(state, caps).layers[""].factor_updates
        1
    """
    decay = _resolve(factor_decay, state.step)
    _check("factor_decay", decay, lambda v: 0 < v <= 1, "in (0, 1]")
    micro = _as_list(captures)
    layers = dict(state.layers)
    fold_layers(
        layers,
        lambda _, ls: layer_batch_factors(ls.spec, micro, state.config),
        decay,
        state.config,
        nonfinite,
    )
    return state.replace(layers=layers)


def fold_layers(
    layers: MutableMapping[str, LayerState],
    batch_of: Callable[[str, LayerState], LayerFactors | None],
    decay: float,
    config: KFACConfig,
    nonfinite: NonFinite,
) -> None:
    """:func:`fold_checked` every layer of ``layers`` (in place) with the batch factors
    ``batch_of(name, layer)``; layers for which it returns None are left as they are.

    Layer by layer: each entry is replaced as soon as its new factors exist and its batch
    factors are dropped before the next layer's are made, so when ``layers`` is the only
    holder of the old layer states (a donated state) the old factors are freed one layer
    at a time instead of after the whole step.
    """
    for name in list(layers):
        batch = batch_of(name, layers[name])
        if batch is not None:
            layers[name] = fold_checked(layers[name], batch[0], batch[1], decay, config, nonfinite)
        del batch


def decompose(state: KFACState, *, damping: Hyper = 1e-3, only_missing: bool = False) -> KFACState:
    """Recompute every layer's decomposition from its current factors.

    With ``only_missing``, only layers without a decomposition are computed. Layers of a
    ``"fisher"`` state whose factors were never updated get none (their gradients pass
    unchanged), as zero factors carry no curvature. A factor that cannot be decomposed
    (see :func:`redecompose`) never stops training: its layer keeps its previous
    decomposition.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import kfac_func as kf
        >>> state = kf.init(kf.register(nn.Linear(3, 2)), convention="kfac-pytorch")
        >>> kf.decompose(state).layers[""].decomposition.da
        tensor([1., 1., 1., 1.])
    """
    lam = _resolve(damping, state.step)
    _check("damping", lam, lambda v: v >= 0, ">= 0")
    layers = dict(state.layers)
    decompose_layers(layers, lam, state.config, update_inverses=not only_missing)
    return state.replace(layers=layers)


def decompose_layers(
    layers: MutableMapping[str, LayerState],
    damping: float,
    config: KFACConfig,
    *,
    update_inverses: bool,
) -> None:
    """:func:`redecompose` (in place) every layer of ``layers`` that
    :func:`needs_decomposition`, one layer at a time: a layer's previous decomposition
    (kept for a warm start and in case the new one fails) is dropped as soon as its
    replacement exists, not after the last layer (see :func:`fold_layers`)."""
    for name in list(layers):
        if needs_decomposition(layers[name], config, update_inverses=update_inverses):
            layers[name] = redecompose(layers[name], damping, config)


def needs_decomposition(ls: LayerState, config: KFACConfig, *, update_inverses: bool) -> bool:
    """Whether a layer gets a new decomposition: on ``update_inverses`` steps, or when it
    has none yet; never from ``"fisher"`` factors that hold no data."""
    if ls.factor_updates == 0 and config.convention == "fisher":
        return False
    return update_inverses or ls.decomposition is None


def decompose_layer(ls: LayerState, damping: float, config: KFACConfig) -> Decomposition:
    """The configured decomposition of one layer's current factors (may raise
    :class:`~kfac_func.decomposition.DecompositionError`; see :func:`redecompose`)."""
    cdt = decomposition_dtype(config.convention, config.inv_dtype)
    if config.compute_method == "eigen":
        return eigen_decompose(
            ls.a_factor,
            ls.g_factor,
            damping,
            dtype=config.inv_dtype,
            compute_dtype=cdt,
            outer_product=config.compute_eigenvalue_outer_product,
            warm_start=warm_start(ls, config),
        )
    return inverse_decompose(
        ls.a_factor, ls.g_factor, damping, dtype=config.inv_dtype, compute_dtype=cdt
    )


def warm_start(ls: LayerState, config: KFACConfig) -> EigenDecomposition | None:
    """The decomposition to refresh under ``eigenbasis_refresh="qr"`` (None: decompose
    from scratch)."""
    dec = ls.decomposition
    if config.eigenbasis_refresh == "qr" and isinstance(dec, EigenDecomposition):
        return dec
    return None


def redecompose(ls: LayerState, damping: float, config: KFACConfig) -> LayerState:
    """The layer with a new decomposition; if even the retries fail, the layer keeps its
    previous one (none before the first: its gradient passes unchanged) and counts the
    failure, with a warning the first time."""
    try:
        return ls.replace(decomposition=decompose_layer(ls, damping, config))
    except DecompositionError as err:
        return decomposition_failed(ls, str(err))


def decomposition_failed(ls: LayerState, reason: str | None) -> LayerState:
    """Count a failed decomposition; warn (once per layer) when ``reason`` is given."""
    if reason is not None and ls.decomposition_failures == 0:
        keep = "the previous decomposition" if ls.decomposition else "no preconditioning"
        warnings.warn(
            f"layer {ls.spec.name!r}: could not decompose {reason}; keeping {keep} "
            "(warned once per layer; LayerState.decomposition_failures counts them)",
            RuntimeWarning,
            stacklevel=3,
        )
    return ls.replace(decomposition_failures=ls.decomposition_failures + 1)


def _layer_grads(
    spec: LayerSpec, grads: Mapping[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The layer's ``(weight, bias)`` gradients; errors name the layer, missing keys and
    shapes."""
    missing = [p for p in spec.param_names() if p not in grads]
    if missing:
        raise ValueError(f"layer {spec.name!r}: no gradient for {missing} in grads")
    w, b = grads[spec.weight], grads[spec.bias] if spec.bias else None
    check_grads(spec, w, b)
    return w, b


def layer_matrix(ls: LayerState, grads: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The layer's gradient matrix; errors name the layer, missing keys and shapes."""
    return grads_to_matrix(ls.spec, *_layer_grads(ls.spec, grads))


def precondition_grads(
    state: KFACState,
    grads: Mapping[str, torch.Tensor],
    *,
    damping: Hyper = 1e-3,
    kl_clip: Hyper | None = 1e-3,
    lr: Hyper = 0.1,
    nonfinite: NonFinite = "skip",
    rows: Mapping[str, Rows] | None = None,
) -> dict[str, torch.Tensor]:
    """Precondition the gradients of every decomposed layer; others pass unchanged.

    The preconditioned gradients of all layers are scaled by
    ``min(1, sqrt(kl_clip / |lr² Σ P ⊙ grad|))`` unless ``kl_clip`` is None. ``rows``
    (``{layer: [(input rows, output-gradient rows), ...]}``, see
    :func:`precondition_layer`) lets Linear layers skip dense products.

    Returns:
        A new dict with the keys of ``grads``.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import kfac_func as kf
        >>> layers = kf.register(nn.Linear(1, 1))
        >>> state = kf.decompose(kf.init(layers, convention="kfac-pytorch"), damping=1.0)
        >>> g = {"weight": torch.ones(1, 1), "bias": torch.ones(1)}
        >>> kf.precondition_grads(state, g, damping=1.0, kl_clip=None)["weight"]
        tensor([[0.5000]])
    """
    lam = _resolve(damping, state.step)
    _check("damping", lam, lambda v: v >= 0, ">= 0")
    return precondition_layers(
        state.layers,
        grads,
        lam,
        kl_clip=kl_clip,
        lr=lr,
        step=state.step,
        nonfinite=nonfinite,
        rows=rows,
    )


def precondition_layers(
    layers: Mapping[str, LayerState],
    grads: Mapping[str, torch.Tensor],
    damping: float,
    *,
    kl_clip: Hyper | None,
    lr: Hyper,
    step: int,
    nonfinite: NonFinite,
    rows: Mapping[str, Rows] | None = None,
    consume_rows: bool = False,
) -> dict[str, torch.Tensor]:
    """:func:`precondition_grads` of ``layers`` with a resolved ``damping``.

    Holds one layer's gradient matrix at a time: its term of the kl_clip sum is taken as
    soon as the layer is preconditioned. With ``consume_rows``, each layer's entry is
    removed from a mutable ``rows`` once used.
    """
    done: list[tuple[LayerSpec, torch.Tensor]] = []
    terms: dict[str, torch.Tensor] = {}
    decomposed = [name for name, ls in layers.items() if ls.decomposition is not None]
    checks = check_layers(layers, grads, decomposed, nonfinite, rows)
    for name, ls in layers.items():
        taken = _take(rows, name, consume_rows)
        check = checks.get(name)
        if check is None or not check.finite:
            continue
        m = layer_matrix(ls, grads)
        p = precondition_layer(ls, m, damping, taken if check.rows else None, checked=True)
        if kl_clip is not None:
            terms[ls.spec.name] = kl_clip_term(p, m)
        done.append((ls.spec, p))
        del m
    return write_preconditioned(grads, done, terms, kl_clip=kl_clip, lr=lr, step=step)


class LayerCheck(NamedTuple):
    """What :func:`check_layers` found for one layer: its gradients are finite, and its
    rows may replace its gradient matrix (:func:`precondition_layer`)."""

    finite: bool
    rows: bool


def rows_cheaper(spec: LayerSpec, rows: Rows | None) -> bool:
    """Whether a Linear layer's rows make preconditioning cheaper than its matrix:
    ``n(d_out² + d_in² + d_out·d_in) < d_out·d_in(d_out + d_in)`` for ``n`` rows."""
    if not rows or spec.kind != "linear":
        return False
    n = sum(a.shape[0] for a, _ in rows)
    o, i = spec.g_dim, spec.a_dim
    return n * (o * o + i * i + o * i) < o * i * (o + i)


def validate_grads(layers: Mapping[str, LayerState], grads: Mapping[str, torch.Tensor]) -> None:
    """Raise a ValueError naming the layer unless ``grads`` holds every layer's gradients
    with the layer's shapes (no computation, no host synchronisation)."""
    for ls in layers.values():
        _layer_grads(ls.spec, grads)


def check_layers(
    layers: Mapping[str, LayerState],
    grads: Mapping[str, torch.Tensor],
    names: Sequence[str],
    nonfinite: NonFinite,
    rows: Mapping[str, Rows] | None = None,
) -> dict[str, LayerCheck]:
    """Check the gradients of the layers ``names`` before preconditioning them.

    Every layer of ``layers`` must have its gradients in ``grads`` with its shapes
    (ValueError naming the layer otherwise). For each of ``names``: are the gradients
    finite (else warned or raised as :func:`grads_finite` does), and do the layer's
    ``rows`` reproduce its gradient (:func:`kfac_func.factors.rows_match`, when
    :func:`rows_cheaper`)? The answers of all layers are computed on the gradients' device
    and read in one host synchronisation (a second only for a sum that overflowed).
    """
    validate_grads(layers, grads)
    flags: list[torch.Tensor] = []
    for name in names:
        spec = layers[name].spec
        w, b = _layer_grads(spec, grads)
        flags.append(torch.isfinite(w.sum() if b is None else w.sum() + b.sum()))
        layer_rows = (rows or {}).get(name)
        if layer_rows and rows_cheaper(spec, layer_rows):
            flags.append(rows_match(spec, w, b, layer_rows))
        else:
            flags.append(torch.zeros((), dtype=torch.bool, device=w.device))
    read = torch.stack([f.to(flags[0].device) for f in flags]).tolist() if flags else []
    out: dict[str, LayerCheck] = {}
    for k, name in enumerate(names):
        finite, use_rows = read[2 * k], read[2 * k + 1]
        if not finite:  # a NaN/Inf entry, or a sum that overflowed: the exact check
            ls = layers[name]
            finite = grads_finite(name, ls.spec, layer_matrix(ls, grads), nonfinite)
        out[name] = LayerCheck(finite, finite and use_rows)
    return out


def precondition_layer(
    ls: LayerState,
    m: torch.Tensor,
    damping: float,
    rows: Rows | None = None,
    *,
    checked: bool = False,
) -> torch.Tensor:
    """Precondition one layer's gradient matrix with its decomposition.

    With the rows of a Linear layer's calls, when the gradient is exactly their product
    (:func:`kfac_func.factors.rows_reproduce`) and that is cheaper
    (``n(d_out² + d_in² + d_out·d_in) < d_out·d_in(d_out + d_in)`` for ``n`` rows), the
    products with the gradient become products with the rows
    (:func:`kfac_func.decomposition.precondition_rows`); the result is the same up to
    rounding.
    """
    dec = ls.decomposition
    assert dec is not None
    spec = ls.spec
    if rows and rows_cheaper(spec, rows) and (checked or rows_reproduce(spec, m, rows)):
        return precondition_rows(rows, dec, damping, bias=spec.has_bias, dtype=m.dtype)
    return precondition(m, dec, damping)


def captured_rows(state: KFACState, captures: Captures | Sequence[Captures]) -> dict[str, Rows]:
    """The rows of every Linear layer's calls in ``captures`` (all micro-batches)."""
    out: dict[str, Rows] = {}
    micro = _as_list(captures)
    for name, ls in state.layers.items():
        if ls.spec.kind != "linear":
            continue
        found = [
            pair
            for cap in micro
            if name in cap.layers
            for pair in linear_rows(ls.spec, cap.layers[name].inputs, cap.layers[name].output_grads)
        ]
        if found:
            out[name] = found
    return out


def grads_finite(name: str, spec: LayerSpec, m: torch.Tensor, mode: NonFinite) -> bool:
    """True if the gradient matrix is finite; else warn (``"skip"``) or raise."""
    if all_finite(m):
        return True
    _non_finite(name, f"the gradients of {list(spec.param_names())}", mode)
    return False


def apply_preconditioned(
    grads: Mapping[str, torch.Tensor],
    done: Sequence[tuple[LayerSpec, torch.Tensor, torch.Tensor]],
    *,
    kl_clip: Hyper | None,
    lr: Hyper,
    step: int,
) -> dict[str, torch.Tensor]:
    """Scale the preconditioned matrices by the kl_clip factor and write them back.

    ``done`` holds ``(spec, preconditioned matrix, raw matrix)`` of the layers that were
    preconditioned; every other entry of ``grads`` passes unchanged into the new dict.
    The preconditioned matrices are scaled in place (see :func:`write_preconditioned`).
    """
    terms: dict[str, torch.Tensor] = {}
    if kl_clip is not None:
        terms = {spec.name: kl_clip_term(p, m) for spec, p, m in done}
    pairs = [(spec, p) for spec, p, _ in done]
    return write_preconditioned(grads, pairs, terms, kl_clip=kl_clip, lr=lr, step=step)


def write_preconditioned(
    grads: Mapping[str, torch.Tensor],
    done: Sequence[tuple[LayerSpec, torch.Tensor]],
    terms: Mapping[str, torch.Tensor],
    *,
    kl_clip: Hyper | None,
    lr: Hyper,
    step: int,
) -> dict[str, torch.Tensor]:
    """Scale the preconditioned matrices by the kl_clip factor and write them back.

    ``done`` holds ``(spec, preconditioned matrix)`` of the layers that were
    preconditioned, ``terms`` their :func:`~kfac_func.decomposition.kl_clip_term` by layer
    name (needed unless ``kl_clip`` is None). The matrices must be the caller's own
    temporaries: they are scaled in place. Every other entry of ``grads`` passes unchanged
    into the new dict.
    """
    clip = _resolve(kl_clip, step) if kl_clip is not None else None
    rate = _resolve(lr, step)
    _check("lr", rate, lambda v: v >= 0, ">= 0")
    if clip is not None:
        _check("kl_clip", clip, lambda v: v > 0, "> 0 (or None to disable)")
    if clip is not None and done:
        # summed in name order, so that ranks whose states list layers in another order
        # round it the same
        first = min(done, key=lambda t: t[0].name)[1]
        names = sorted(spec.name for spec, _ in done)
        scale = kl_clip_scale_of_terms([terms[n] for n in names], clip, rate, dtype=first.dtype)
        for _, p in done:
            p.mul_(scale.to(p.dtype))
    out = dict(grads)
    for spec, p in done:
        w, b = matrix_to_grads(spec, p)
        out[spec.weight] = w.to(grads[spec.weight].dtype)
        if spec.bias is not None and b is not None:
            out[spec.bias] = b.to(grads[spec.bias].dtype)
    return out


def update(
    state: KFACState,
    grads: Mapping[str, torch.Tensor],
    *,
    captures: Captures | Sequence[Captures] | None = None,
    batch_factors: Mapping[str, LayerFactors] | None = None,
    rows: Mapping[str, Rows] | None = None,
    damping: Hyper = 1e-3,
    factor_decay: Hyper = 0.95,
    kl_clip: Hyper | None = 1e-3,
    lr: Hyper = 0.1,
    update_factors: bool | Callable[[int], bool] = True,
    update_inverses: bool | Callable[[int], bool] = True,
    nonfinite: NonFinite = "skip",
    donate: bool = False,
) -> tuple[dict[str, torch.Tensor], KFACState]:
    """One K-FAC step: returns ``(preconditioned_grads, new_state)``; inputs are untouched
    (unless donated).

    Args:
        state: from :func:`kfac_func.init` or a previous ``update``.
        grads: ``{param_name: grad}``; parameters of unregistered layers pass unchanged.
        captures: from :func:`kfac_func.capture` (or a list of them, one per micro-batch
            of an accumulation window); needed when factors are updated, unless
            ``batch_factors`` are given instead.
        batch_factors: ``{layer: (A, G, weight)}`` already built from this step's
            statistics (as :func:`factors_from_stats` returns them; the weight is not
            used on one process), instead of ``captures``.
        rows: ``{layer: [(input rows, output-gradient rows), ...]}`` of Linear layers (see
            :func:`precondition_layer`); taken from ``captures`` when not given.
        damping: Tikhonov damping λ.
        factor_decay: running-average coefficient in (0, 1].
        kl_clip: gradient-scale clipping; None disables it.
        lr: learning rate used by the kl_clip scale.
        update_factors: fold the captures into the factors this step.
        update_inverses: recompute decompositions this step (layers without one are
            always decomposed once their factors hold data).
        nonfinite: ``"skip"`` (warn, keep that layer's state, pass its gradient
            unchanged) or ``"raise"`` (:class:`NonFiniteError`) on NaN/Inf.
        donate: hand ``state`` over to the step (as JAX's buffer donation): its
            ``layers`` dict is updated in place, each layer's entry replaced as soon as
            its new factors or decomposition exist, so that the old ones are freed one
            layer at a time instead of being held, with the whole new state, until the
            step returns. The entries of ``batch_factors`` and ``rows`` (when they are
            mutable) are removed as they are used, for the same reason. Use only the
            returned state afterwards: the donated one, and every state sharing its
            ``layers`` dict (``state.replace(step=...)`` copies share it), holds the new
            layers under the old step. The memory is saved only when nothing else holds
            the old state (``grads, state = update(state, ..., donate=True)``). Results
            are the same as without donation. Missing or misshapen gradients are refused
            before anything changes; an error after that (``nonfinite="raise"``) leaves
            each layer of the donated state either as it was or as the step left it.

    All hyperparameters may be ``step -> value`` callables, evaluated at ``state.step``.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import kfac_func as kf
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
        >>> params = dict(model.named_parameters())
        >>> state = kf.init(kf.register(model))
        >>> x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
        >>> loss, grads, caps = kf.capture(model, params, x,
        ...                                lambda out: nn.functional.cross_entropy(out, y))
        >>> new_grads, state = kf.update(state, grads, captures=caps, damping=1e-2)
        >>> state.step, sorted(new_grads) == sorted(params)
        (1, True)
        >>> new_grads, state = kf.update(state, grads, captures=caps, donate=True)
        >>> state.step
        2
    """
    if nonfinite not in ("skip", "raise"):
        raise ValueError(f"nonfinite must be 'skip' or 'raise', got {nonfinite!r}")
    step, config = state.step, state.config
    validate_grads(state.layers, grads)  # before anything changes, donated or not
    layers = state.layers if donate else dict(state.layers)
    if _resolve(update_factors, step):
        if captures is not None and batch_factors is not None:
            raise ValueError("give captures= or batch_factors=, not both")
        if captures is None and batch_factors is None:
            raise ValueError("update_factors=True needs captures= (from kfac_func.capture)")
        decay = _resolve(factor_decay, step)
        _check("factor_decay", decay, lambda v: 0 < v <= 1, "in (0, 1]")
        micro = _as_list(captures) if captures is not None else None

        def batch_of(name: str, ls: LayerState) -> LayerFactors | None:
            if micro is not None:
                return layer_batch_factors(ls.spec, micro, config)
            return _take(batch_factors, name, donate)

        fold_layers(layers, batch_of, decay, config, nonfinite)
    lam = _resolve(damping, step)
    _check("damping", lam, lambda v: v >= 0, ">= 0")
    decompose_layers(layers, lam, config, update_inverses=bool(_resolve(update_inverses, step)))
    if rows is None and captures is not None:
        rows = captured_rows(state, captures)
    out = precondition_layers(
        layers,
        grads,
        lam,
        kl_clip=kl_clip,
        lr=lr,
        step=step,
        nonfinite=nonfinite,
        rows=rows,
        consume_rows=donate,
    )
    return out, state.replace(layers=layers, step=step + 1)
