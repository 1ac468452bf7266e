"""The format of state checkpoints: tensor keys and the JSON metadata, encoded and
validated here (:func:`~kfac_func.checkpoint.state_dict.state_to_dict` and
:func:`~kfac_func.checkpoint.state_dict.state_from_dict` use it).

Format (version 1)
------------------
:func:`state_to_dict` flattens a state into tensors whose keys are its optree paths joined
with dots, exactly ``".".join(path)`` for ``optree.tree_flatten_with_path(state)``:

- ``layers.<layer name>.a_factor`` and ``layers.<layer name>.g_factor``;
- with ``include_decompositions=True``, ``layers.<layer name>.decomposition.<field>``
  (``qa``, ``da``, ``qg``, ``dg`` and, when precomputed, ``dgda`` for the eigen method;
  ``a_inv``, ``g_inv`` for the inverse method);
- ``layers.<layer name>.grad_skips`` (a 0-d int64 tensor) once ``sync_free=True`` steps
  counted the layer's skipped gradients; the metadata flags it (``"grad_skips"``) and
  holds ``"grad_skips_reported"`` (files written before these counters load without them);
  likewise ``layers.<layer name>.factor_skips`` (0-d int64) and ``layers.<layer
  name>.usable`` (0-d bool), the device's decisions of ``sync_free=True`` factor and
  decomposition steps (flags ``"factor_skips"`` and ``"usable"``);
- with an adaptive part (:class:`~kfac_func.state.AdaptiveState`) that holds a previous
  update, ``adaptive.previous.<parameter name>``. Its numbers (damping, counters, the last
  coefficients, the history) are in the metadata under ``"adaptive"`` (absent or null
  without one; files written before it existed load as without one).

Layer names may themselves contain dots (``encoder.0``), so keys are never parsed: the
reserved key ``__kfac_meta__`` holds a UTF-8 JSON document (a 1-D ``uint8`` tensor) with
the explicit, ordered index of layers, from which every expected key is rebuilt::

    {"format": "kfac_func.KFACState", "format_version": 1, "library_version": "0.1.0",
     "step": 6,
     "config": {"convention": "fisher", "compute_method": "eigen",
                "compute_eigenvalue_outer_product": true,
                "factor_dtype": "float32", "inv_dtype": "float32"},
     "decompositions": "eigen",          # type of the stored decompositions, or null
     "layers": [{"name": "encoder.0", "factor_updates": 6, "skipped_updates": 0,
                 "decomposition_failures": 0,
                 "spec": {"name": "encoder.0", "kind": "conv2d", "weight": "...", ...},
                 "decomposition": {"type": "eigen",
                                   "tensors": ["qa", "da", "qg", "dg", "dgda"]}}, ...],
     "strides": {"layers.head.0.decomposition.qa": [1, 97], ...}}

Tensors are stored row-major contiguous (their values are exactly the state's). ``strides``
records the memory layout of those that were not (eigenvectors from ``torch.linalg.eigh``
are column-major); loading restores it, because matrix products, hence a resumed run's
bits, depend on the layout of their operands. With it, saving after step N, loading in a
fresh process and continuing gives bit-identical gradients and states to an uninterrupted
run (when the decompositions are saved, or the next step recomputes them anyway).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from kfac_func.blocks import LayerSpec
from kfac_func.checkpoint.errors import CheckpointFormatError, _version_problem
from kfac_func.core.decomposition import DECOMPOSITIONS
from kfac_func.state import (
    MOMENT_FIELDS,
    AdaptiveRecord,
    AdaptiveState,
    KFACConfig,
    KFACState,
    LayerState,
)

__all__ = [
    "FORMAT_VERSION",
    "META_KEY",
]

FORMAT_VERSION = 1
"""Checkpoint format version this library writes (and the newest it reads)."""

META_KEY = "__kfac_meta__"
"""Reserved key of the JSON metadata tensor (and of the safetensors header entry)."""

_FORMAT_NAME = "kfac_func.KFACState"
_CONFIG_FIELDS = tuple(f.name for f in dataclasses.fields(KFACConfig))
_SPEC_FIELDS = tuple(f.name for f in dataclasses.fields(LayerSpec))
_COUNTER_DTYPES = {"grad_skips": torch.int64, "factor_skips": torch.int64, "usable": torch.bool}
"""The optional 0-d tensors of a layer that ``sync_free=True`` steps keep on the device
(see the format above), with their dtypes."""
# the optional tensors of a layer, each flagged in its metadata entry
_OPTIONAL_TENSORS = (*MOMENT_FIELDS, *_COUNTER_DTYPES)


# --------------------------------------------------------------------------- encode


def _key(path: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in path)


def _layer_key(name: str, *rest: str) -> str:
    return _key(("layers", name, *rest))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _json_value(v: Any) -> Any:
    if isinstance(v, torch.dtype):
        return _dtype_name(v)
    if isinstance(v, tuple):
        return [_json_value(x) for x in v]
    return v


_SPEC_DEFAULTS = {
    f.name: _json_value(f.default)
    for f in dataclasses.fields(LayerSpec)
    if f.default is not dataclasses.MISSING
}
"""Defaults of the spec fields, for checkpoints written before a field existed."""


def _decomposition_meta(ls: LayerState) -> dict[str, Any] | None:
    d = ls.decomposition
    if d is None:
        return None
    kind = next(k for k, cls in DECOMPOSITIONS.items() if isinstance(d, cls))
    fields = [f.name for f in dataclasses.fields(d) if getattr(d, f.name) is not None]
    return {"type": kind, "tensors": fields}


def _metadata(
    state: KFACState, include_decompositions: bool, strides: dict[str, list[int]]
) -> dict[str, Any]:
    import kfac_func

    layers = []
    kinds = set()
    for name, ls in state.layers.items():
        dec = _decomposition_meta(ls) if include_decompositions else None
        if dec is not None:
            kinds.add(dec["type"])
        layers.append(
            {
                "name": name,
                "factor_updates": ls.factor_updates,
                "skipped_updates": ls.skipped_updates,
                "decomposition_failures": ls.decomposition_failures,
                **{moment: getattr(ls, moment) is not None for moment in MOMENT_FIELDS},
                "moment_count": ls.moment_count,
                "grad_skips": ls.grad_skips is not None,
                "grad_skips_reported": ls.grad_skips_reported,
                "factor_skips": ls.factor_skips is not None,
                "usable": ls.usable is not None,
                "spec": {k: _json_value(getattr(ls.spec, k)) for k in _SPEC_FIELDS},
                "decomposition": dec,
            }
        )
    return {
        "format": _FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "library_version": kfac_func.__version__,
        "step": state.step,
        "config": {k: _json_value(getattr(state.config, k)) for k in _CONFIG_FIELDS},
        "decompositions": kinds.pop() if len(kinds) == 1 else None,
        "layers": layers,
        "strides": strides,
        "adaptive": _adaptive_meta(state.adaptive),
    }


_ADAPTIVE_NUMBERS = ("alpha", "mu", "predicted", "rho")


def _adaptive_meta(ad: AdaptiveState | None) -> dict[str, Any] | None:
    """The numbers of the adaptive part (floats round-trip exactly through JSON)."""
    if ad is None:
        return None
    return {
        "damping": ad.damping,
        "steps": ad.steps,
        **{k: getattr(ad, k) for k in _ADAPTIVE_NUMBERS},
        "history": [list(r) for r in ad.history],
        "previous": None if ad.previous is None else list(ad.previous),
    }


def _adaptive_key(name: str) -> str:
    return _key(("adaptive", "previous", name))


def _number(value: Any, optional: bool) -> bool:
    if value is None:
        return optional
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _decode_adaptive(meta: dict[str, Any]) -> None:
    """Validate ``meta["adaptive"]`` in place (None when the file has no adaptive part)."""
    ad = meta.setdefault("adaptive", None)  # files written before adaptive steps
    if ad is None:
        return
    if not isinstance(ad, dict):
        raise _fmt("metadata 'adaptive' is not an object")
    if not _number(ad.get("damping"), False):
        raise _fmt("metadata adaptive 'damping' must be a number")
    _get(ad, "steps", int, "adaptive ")
    for k in (*_ADAPTIVE_NUMBERS, "previous"):
        ad.setdefault(k, None)
    for k in _ADAPTIVE_NUMBERS:
        if not _number(ad[k], True):
            raise _fmt(f"metadata adaptive {k!r} must be a number or null")
    history = _get(ad, "history", list, "adaptive ")
    fields = len(AdaptiveRecord._fields)
    for r in history:
        ok = isinstance(r, list) and len(r) == fields and isinstance(r[0], int)
        if not ok or not all(_number(x, i == fields - 1) for i, x in enumerate(r[1:], 1)):
            raise _fmt(f"metadata adaptive history entry {r!r} is malformed")
    previous = ad["previous"]
    if previous is not None and (
        not isinstance(previous, list)
        or not all(isinstance(n, str) for n in previous)
        or len(set(previous)) != len(previous)
    ):
        raise _fmt("metadata adaptive 'previous' must be null or a list of distinct names")


def _dense(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """Whether ``strides`` lay out ``shape`` densely (a permutation of row-major order)."""
    if len(shape) != len(strides) or any(s < 0 for s in strides):
        return False
    expected = 1
    for i in sorted(range(len(shape)), key=lambda i: strides[i]):
        if shape[i] != 1 and strides[i] != expected:
            return False
        expected *= shape[i]
    return True


def _encode(meta: dict[str, Any]) -> torch.Tensor:
    text = json.dumps(meta, separators=(",", ":"))
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8)


# --------------------------------------------------------------------------- decode


def _fmt(msg: str) -> CheckpointFormatError:
    return CheckpointFormatError(f"malformed kfac_func checkpoint: {msg}")


def _get(obj: Mapping[str, Any], key: str, typ: type | tuple[type, ...], where: str) -> Any:
    if key not in obj:
        raise _fmt(f"metadata {where} has no {key!r}")
    value = obj[key]
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        raise _fmt(f"metadata {where}{key!r} has the wrong type ({type(value).__name__})")
    return value


def _decode_meta(d: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """Parse and validate the metadata (everything but the comparison with ``like``)."""
    if META_KEY not in d:
        raise CheckpointFormatError(
            f"no {META_KEY!r} metadata in the checkpoint: not written by "
            "kfac_func.state_to_dict / save_state"
        )
    t = d[META_KEY]
    if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or t.dim() != 1:
        raise _fmt(f"{META_KEY!r} must be a 1-D uint8 tensor")
    try:
        meta = json.loads(bytes(t.tolist()).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _fmt(f"{META_KEY!r} is not valid UTF-8 JSON ({e})") from e
    if not isinstance(meta, dict) or meta.get("format") != _FORMAT_NAME:
        raise _fmt(f"{META_KEY!r} does not describe a {_FORMAT_NAME}")
    version = _get(meta, "format_version", int, "")
    if unreadable := _version_problem("checkpoint", version, meta, FORMAT_VERSION):
        raise CheckpointFormatError(unreadable)
    _get(meta, "step", int, "")
    config = _get(meta, "config", dict, "")
    config.setdefault("eigenbasis_refresh", "eigh")  # files written before it existed
    for k in _CONFIG_FIELDS:
        _get(config, k, (str, bool), "config ")
    strides = meta.get("strides", {})
    _decode_adaptive(meta)
    if not isinstance(strides, dict) or not all(
        isinstance(v, list) and all(isinstance(x, int) for x in v) for v in strides.values()
    ):
        raise _fmt("metadata 'strides' must map keys to lists of integers")
    layers = _get(meta, "layers", list, "")
    seen: set[str] = set()
    for i, entry in enumerate(layers):
        if not isinstance(entry, dict):
            raise _fmt(f"metadata layers[{i}] is not an object")
        name = _get(entry, "name", str, f"layers[{i}] ")
        if name in seen:
            raise _fmt(f"layer {name!r} is listed twice")
        seen.add(name)
        _get(entry, "factor_updates", int, f"layer {name!r} ")
        _get(entry, "skipped_updates", int, f"layer {name!r} ")
        if entry.get("graft_moment"):
            raise _fmt(
                f"layer {name!r} holds Adam grafting's running moment ('graft_moment'): "
                "grafting was retired, so this checkpoint's step cannot be resumed"
            )
        # fields that files written before them lack: their defaults
        for field, default in (
            ("decomposition_failures", 0),
            *((flag, False) for flag in MOMENT_FIELDS),
            ("moment_count", 0),
            ("grad_skips", False),
            ("grad_skips_reported", 0),
            ("factor_skips", False),
            ("usable", False),
        ):
            entry.setdefault(field, default)
            _get(entry, field, type(default), f"layer {name!r} ")
        _get(entry, "spec", dict, f"layer {name!r} ")
        dec = entry.get("decomposition")
        if dec is not None:
            if not isinstance(dec, dict):
                raise _fmt(f"layer {name!r}: decomposition is not an object")
            where = f"layer {name!r} decomposition "
            kind = _get(dec, "type", str, where)
            if kind != config["compute_method"] or kind not in DECOMPOSITIONS:
                raise _fmt(
                    f"layer {name!r}: decomposition type {kind!r} in a checkpoint of "
                    f"compute_method {config['compute_method']!r}"
                )
            fields = {f.name for f in dataclasses.fields(DECOMPOSITIONS[kind])}
            tensors = _get(dec, "tensors", list, where)
            if not set(tensors) <= fields or len(set(tensors)) != len(tensors):
                raise _fmt(f"layer {name!r}: bad decomposition tensors {tensors!r}")
    return meta


def _expected_keys(meta: dict[str, Any]) -> list[str]:
    keys = []
    for entry in meta["layers"]:
        name = entry["name"]
        keys += [_layer_key(name, "a_factor"), _layer_key(name, "g_factor")]
        keys += [_layer_key(name, f) for f in _OPTIONAL_TENSORS if entry.get(f)]
        if entry.get("decomposition") is not None:
            keys += [
                _layer_key(name, "decomposition", f) for f in entry["decomposition"]["tensors"]
            ]
    adaptive = meta.get("adaptive")
    if adaptive is not None and adaptive.get("previous") is not None:
        keys += [_adaptive_key(n) for n in adaptive["previous"]]
    return keys
