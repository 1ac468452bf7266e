"""A :class:`~kfac_func.KFACState` as a flat ``{key: tensor}`` dict and back.

:func:`state_to_dict` flattens a state into the tensors and the metadata tensor of the
format described in :mod:`kfac_func.checkpoint.state_format`. The dict alone round-trips
through ``torch.save`` + ``torch.load(weights_only=True)`` and through safetensors (files:
:mod:`kfac_func.checkpoint.state_files`).

Loading (:func:`state_from_dict`, :func:`kfac_func.load_state`) checks the file against a
state of the same model (``like=kf.init(kf.register(model), ...)``) and either returns a
complete new state or raises one :class:`CheckpointMismatchError` listing every problem;
malformed, truncated or future-version files raise
:class:`~kfac_func.checkpoint.errors.CheckpointFormatError`. Decompositions that the file
does not hold come back as ``None`` (see :func:`state_from_dict`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import optree
import torch

from kfac_func.blocks import LayerSpec
from kfac_func.blocks.tied import newly_tied
from kfac_func.checkpoint.errors import CheckpointMismatchError, _names
from kfac_func.checkpoint.state_format import (
    _CONFIG_FIELDS,
    _COUNTER_DTYPES,
    _OPTIONAL_TENSORS,
    _SPEC_DEFAULTS,
    _SPEC_FIELDS,
    META_KEY,
    _adaptive_key,
    _decode_meta,
    _dense,
    _encode,
    _expected_keys,
    _fmt,
    _json_value,
    _key,
    _layer_key,
    _metadata,
)
from kfac_func.core.decomposition import DECOMPOSITIONS, decomposition_from_fields
from kfac_func.state import MOMENT_FIELDS, AdaptiveState, KFACState, LayerState

__all__ = [
    "state_from_dict",
    "state_to_dict",
]


# --------------------------------------------------------------------------- to dict


def state_to_dict(
    state: KFACState, *, include_decompositions: bool = False
) -> dict[str, torch.Tensor]:
    """Flatten ``state`` into ``{key: tensor}`` plus the metadata tensor ``__kfac_meta__``.

    Keys are the optree paths of the state's tensors joined with dots
    (``layers.<layer name>.a_factor``, ``layers.<layer name>.decomposition.qa``); counters,
    layer specs and the configuration go into the JSON metadata (see
    :mod:`kfac_func.checkpoint.state_format`).
    Tensors are detached and made contiguous (a copy only for those that were not; their
    original strides are recorded in the metadata), otherwise shared with ``state``.

    Args:
        state: the state to flatten.
        include_decompositions: also store the decompositions (without them the loaded
            state has none: see :func:`state_from_dict`).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import kfac_func as kf
        >>> state = kf.init(kf.register(nn.Sequential(nn.Linear(3, 2))))
        >>> d = kf.state_to_dict(state)
        >>> sorted(d)
        ['__kfac_meta__', 'layers.0.a_factor', 'layers.0.g_factor']
        >>> import io
        >>> buf = io.BytesIO()
        >>> torch.save(d, buf)
        >>> _ = buf.seek(0)
        >>> kf.state_from_dict(torch.load(buf, weights_only=True), like=state).step
        0
    """
    if not isinstance(state, KFACState):
        raise TypeError(f"state must be a KFACState, got {type(state).__name__}")
    out: dict[str, torch.Tensor] = {}
    strides: dict[str, list[int]] = {}
    paths, leaves, _ = optree.tree_flatten_with_path(state)  # type: ignore[arg-type,var-annotated]
    for path, leaf in zip(paths, leaves):
        if not include_decompositions and path[0] == "layers" and path[2:3] == ("decomposition",):
            continue
        if path[0] == "layers" and path[2:3] == ("ortho_power",):
            continue  # derived from the decomposition, recomputed by the next step
        # unique: the last component is always a field name, and the field names of a
        # layer (a_factor, g_factor) and of a decomposition (qa, ..., g_inv) are disjoint
        key = _key(path)
        if not leaf.is_contiguous() and _dense(leaf.shape, leaf.stride()):
            strides[key] = list(leaf.stride())
        out[key] = leaf.detach().contiguous()
    out[META_KEY] = _encode(_metadata(state, include_decompositions, strides))
    return out


# --------------------------------------------------------------------------- from dict


def _decomposition_shapes(spec: LayerSpec) -> dict[str, tuple[int, ...]]:
    b, a, g = spec.batch_shape, spec.a_dim, spec.g_dim
    a_shape, g_shape = spec.factor_shapes
    return {
        "qa": a_shape,
        "da": a_shape if spec.a_diagonal else a_shape[:-1],
        "qg": g_shape,
        "dg": g_shape if spec.g_diagonal else g_shape[:-1],
        "dgda": (*b, g, a),
        "a_inv": a_shape,
        "g_inv": g_shape,
        "scale": (*b, g, a),
    }


def _shape(s: torch.Size | tuple[int, ...]) -> tuple[int, ...]:
    return tuple(int(x) for x in s)


def _layer_problems(
    entry: dict[str, Any], ls: LayerState, d: Mapping[str, torch.Tensor], like: KFACState
) -> list[str]:
    name = entry["name"]
    reasons = []
    want_spec = {k: _json_value(getattr(ls.spec, k)) for k in _SPEC_FIELDS}
    # a field added to LayerSpec later is absent from older checkpoints: its default
    got_spec = {**_SPEC_DEFAULTS, **entry["spec"]}
    diff = [
        f"{k} {got_spec.get(k)!r} vs {want_spec[k]!r}"
        for k in _SPEC_FIELDS
        if got_spec.get(k) != want_spec[k]
    ]
    diff += [f"unknown field {k!r}" for k in got_spec if k not in want_spec]
    if diff:
        reasons.append(f"spec differs (checkpoint vs like): {', '.join(diff)}")
    checks = [
        (f, d[_layer_key(name, f)], _shape(getattr(ls, f).shape), getattr(ls, f).dtype)
        for f in ("a_factor", "g_factor")
    ]
    for moment in MOMENT_FIELDS:
        if entry.get(moment):
            key = _layer_key(name, moment)
            checks.append((moment, d[key], ls.spec.matrix_shape, like.config.factor_dtype))
    for counter, dtype in _COUNTER_DTYPES.items():
        if entry.get(counter):
            checks.append((counter, d[_layer_key(name, counter)], (), dtype))
    dec = entry.get("decomposition")
    if dec is not None:
        shapes = _decomposition_shapes(ls.spec)
        checks += [
            (
                f"decomposition.{f}",
                d[_layer_key(name, "decomposition", f)],
                shapes[f],
                like.config.inv_dtype,
            )
            for f in dec["tensors"]
        ]
    for what, t, shape, dtype in checks:
        if _shape(t.shape) != shape:
            reasons.append(f"{what} shape {_shape(t.shape)} in the checkpoint, {shape} in like")
        if t.dtype != dtype:
            reasons.append(f"{what} dtype {t.dtype} in the checkpoint, {dtype} in like")
    return reasons


def _restore(t: torch.Tensor, layout: Sequence[int] | None, device: torch.device) -> torch.Tensor:
    """A fresh copy of ``t`` on ``device`` in the memory layout ``layout`` (matmul results
    depend on it; None: row-major)."""
    if not layout:
        return torch.empty(t.shape, dtype=t.dtype, device=device).copy_(t)
    return torch.empty_strided(t.shape, layout, dtype=t.dtype, device=device).copy_(t)


def _build_adaptive(
    meta: dict[str, Any] | None,
    like: KFACState,
    d: Mapping[str, torch.Tensor],
    strides: Mapping[str, list[int]],
) -> AdaptiveState | None:
    """The file's adaptive part; ``like``'s when the file has none (older files)."""
    if meta is None:
        return like.adaptive
    previous = None
    if meta["previous"] is not None:
        have = like.adaptive.previous if like.adaptive is not None else None
        tensors = list(have.values()) if have else [ls.a_factor for ls in like.layers.values()]
        device = tensors[0].device if tensors else torch.device("cpu")
        previous = {
            n: _restore(d[_adaptive_key(n)], strides.get(_adaptive_key(n)), device)
            for n in meta["previous"]
        }

    return AdaptiveState.restored(meta, previous)


def _build_layer(
    entry: dict[str, Any],
    ls: LayerState,
    d: Mapping[str, torch.Tensor],
    strides: Mapping[str, list[int]],
) -> LayerState:
    name = entry["name"]
    device = ls.a_factor.device

    def get(*rest: str) -> torch.Tensor:
        key = _layer_key(name, *rest)
        return _restore(d[key], strides.get(key), device)

    dec_meta = entry.get("decomposition")
    decomposition = None
    if dec_meta is not None:
        cls = DECOMPOSITIONS[dec_meta["type"]]
        tensors = {f: get("decomposition", f) for f in dec_meta["tensors"]}
        decomposition = decomposition_from_fields(cls, tensors)
    optional = {f: get(f) if entry.get(f) else None for f in _OPTIONAL_TENSORS}
    return LayerState(
        a_factor=get("a_factor"),
        g_factor=get("g_factor"),
        **optional,  # type: ignore[arg-type]
        moment_count=entry["moment_count"],
        grad_skips_reported=entry["grad_skips_reported"],
        decomposition=decomposition,
        spec=ls.spec,
        factor_updates=entry["factor_updates"],
        skipped_updates=entry["skipped_updates"],
        decomposition_failures=entry["decomposition_failures"],
    )


def state_from_dict(d: Mapping[str, torch.Tensor], *, like: KFACState) -> KFACState:
    """Rebuild a state from :func:`state_to_dict`'s output, checked against ``like``.

    ``like`` is a state of the same model and configuration, typically
    ``kf.init(kf.register(model), ...)``; it supplies the layer specs, the configuration
    and the device (its tensors' values are not used). The step, counters, factors and
    stored decompositions come from ``d``, copied onto ``like``'s device in the memory
    layout they had when saved (so the new state shares no memory with ``d``).
    Decompositions not stored come back as ``None``: the next :func:`kfac_func.step.update`
    computes them from that step's factors, or ``kf.decompose(state, damping=...,
    only_missing=True)`` computes them now from the loaded factors. The adaptive part
    (:class:`~kfac_func.state.AdaptiveState`) is the file's; a file without one (written
    without it, or before it existed) gives ``like.adaptive``.

    Raises:
        CheckpointFormatError: missing/malformed metadata, a format version newer than
            this library reads, or tensors missing from / unexpected in ``d``.
        CheckpointMismatchError: one error listing every configuration difference
            (convention, compute method, dtypes, ...), every missing and extra layer, and
            every layer whose spec, shapes or dtypes differ. Nothing is half-loaded.

    A checkpoint written before tied embeddings and heads were preconditioned (when both
    were skipped) loads into a state that has their tied layer, which starts fresh, as
    ``like`` holds it (see :func:`kfac_func.blocks.tied.newly_tied`).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import kfac_func as kf
        >>> state = kf.init(kf.register(nn.Linear(3, 2)), convention="kfac-pytorch")
        >>> state = kf.decompose(state.replace(step=4), damping=0.1)
        >>> d = kf.state_to_dict(state, include_decompositions=True)
        >>> restored = kf.state_from_dict(d, like=kf.init(kf.register(nn.Linear(3, 2)),
        ...                                               convention="kfac-pytorch"))
        >>> restored.step, torch.equal(restored.layers[""].decomposition.qa,
        ...                            state.layers[""].decomposition.qa)
        (4, True)
        >>> kf.state_from_dict(d, like=kf.init(kf.register(nn.Linear(3, 5)),
        ...                                    convention="kfac-pytorch"))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        kfac_func...CheckpointMismatchError: checkpoint does not match the `like` state:
          layer '': spec differs (checkpoint vs like): out_dim 2 vs 5; ...
    """
    if not isinstance(like, KFACState):
        raise TypeError(f"like must be a KFACState, got {type(like).__name__}")
    if not isinstance(d, Mapping):
        raise TypeError(f"expected a mapping of tensors, got {type(d).__name__}")
    meta = _decode_meta(d)
    expected = _expected_keys(meta)
    bad_types = [k for k, v in d.items() if not isinstance(k, str) or not torch.is_tensor(v)]
    absent = [k for k in expected if k not in d]
    unexpected = sorted(set(d) - set(expected) - {META_KEY}, key=str)
    if absent or unexpected or bad_types:
        parts = []
        if absent:
            parts.append(f"tensors listed in the metadata are missing: {_names(absent)}")
        if unexpected:
            parts.append(f"unexpected keys: {_names(unexpected)}")
        if bad_types:
            parts.append(f"entries that are not str -> tensor: {bad_types!r}")
        raise _fmt("; ".join(parts))
    for key, layout in meta.get("strides", {}).items():
        if key not in d or not _dense(d[key].shape, layout):
            raise _fmt(f"strides {layout!r} recorded for {key!r} do not fit that tensor")

    config = [
        f"{k}: {meta['config'][k]!r} in the checkpoint, {want!r} in like"
        for k in _CONFIG_FIELDS
        if meta["config"][k] != (want := _json_value(getattr(like.config, k)))
    ]
    entries = {e["name"]: e for e in meta["layers"]}
    fresh = newly_tied(like.layers, entries)
    missing = [n for n in like.layers if n not in entries and n not in fresh]
    extra = [n for n in entries if n not in like.layers]
    mismatched = {}
    for name, ls in like.layers.items():
        if name in entries:
            reasons = _layer_problems(entries[name], ls, d, like)
            if reasons:
                mismatched[name] = reasons
    if config or missing or extra or mismatched:
        raise CheckpointMismatchError(config, missing, extra, mismatched)

    strides = meta.get("strides", {})
    layers = {
        name: ls if name in fresh else _build_layer(entries[name], ls, d, strides)
        for name, ls in like.layers.items()
    }
    adaptive = _build_adaptive(meta["adaptive"], like, d, strides)
    return KFACState(layers=layers, step=meta["step"], config=like.config, adaptive=adaptive)
