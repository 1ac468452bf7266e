"""Checkpoints of a :class:`~kfac_func.KFACState`: a flat ``{key: tensor}`` dict and files.

Format (version 1)
------------------
:func:`state_to_dict` flattens a state into tensors whose keys are its optree paths joined
with dots, exactly ``".".join(path)`` for ``optree.tree_flatten_with_path(state)``:

- ``layers.<layer name>.a_factor`` and ``layers.<layer name>.g_factor``;
- with ``include_decompositions=True``, ``layers.<layer name>.decomposition.<field>``
  (``qa``, ``da``, ``qg``, ``dg`` and, when precomputed, ``dgda`` for the eigen method;
  ``a_inv``, ``g_inv`` for the inverse method).

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

The dict alone round-trips through ``torch.save`` + ``torch.load(weights_only=True)`` and
through safetensors. :func:`save_state` writes it atomically to a ``.safetensors`` file
(the JSON is also put in the safetensors header metadata) or, for ``.pt``/``.pth`` paths,
with ``torch.save`` of the flat dict (tensors only, never other pickled objects).

Loading (:func:`state_from_dict`, :func:`load_state`) checks the file against a state of the
same model (``like=kf.init(kf.register(model), ...)``) and either returns a complete new state
or raises one :class:`CheckpointMismatchError` listing every problem; malformed, truncated or
future-version files raise :class:`CheckpointFormatError`. Decompositions that the file
does not hold come back as ``None``: :func:`kfac_func.step.update` computes them on its next call
(from the factors of that step), or call ``kf.decompose(state, damping=...,
only_missing=True)`` to compute them right away from the loaded factors.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import json
import os
import secrets
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import optree
import safetensors
import safetensors.torch
import torch

from kfac_func.blocks import LayerSpec
from kfac_func.core.decomposition import EigenDecomposition, InverseDecomposition
from kfac_func.state import KFACConfig, KFACState, LayerState

__all__ = [
    "FORMAT_VERSION",
    "META_KEY",
    "CheckpointError",
    "CheckpointFormatError",
    "CheckpointMismatchError",
    "load_state",
    "save_state",
    "state_from_dict",
    "state_to_dict",
]

FORMAT_VERSION = 1
"""Checkpoint format version this library writes (and the newest it reads)."""

META_KEY = "__kfac_meta__"
"""Reserved key of the JSON metadata tensor (and of the safetensors header entry)."""

_FORMAT_NAME = "kfac_func.KFACState"
_DECOMPOSITIONS: dict[str, type[EigenDecomposition] | type[InverseDecomposition]] = {
    "eigen": EigenDecomposition,
    "inverse": InverseDecomposition,
}
_CONFIG_FIELDS = tuple(f.name for f in dataclasses.fields(KFACConfig))
_SPEC_FIELDS = tuple(f.name for f in dataclasses.fields(LayerSpec))
_TORCH_SUFFIXES = (".pt", ".pth")
_ZIP_MAGIC = b"PK\x03\x04"

PathLike = str | os.PathLike[str]


class CheckpointError(ValueError):
    """A checkpoint cannot be turned into a state."""


class CheckpointFormatError(CheckpointError):
    """Not a readable kfac_func checkpoint: truncated or corrupt file, missing or malformed
    metadata, missing or unexpected tensors, or a format version newer than this library."""


class CheckpointMismatchError(CheckpointError):
    """A well-formed checkpoint that does not fit the ``like`` state.

    The message lists every problem; they are also available as attributes.

    Attributes:
        config: configuration differences (``"convention: 'fisher' in the checkpoint,
            'kfac-pytorch' in like"``).
        missing: layers of ``like`` absent from the checkpoint.
        extra: layers of the checkpoint absent from ``like``.
        mismatched: ``{layer: [reasons]}`` for layers present in both whose spec, shapes or
            dtypes differ.
        source: the file, when raised by :func:`load_state`.
    """

    def __init__(
        self,
        config: list[str],
        missing: list[str],
        extra: list[str],
        mismatched: dict[str, list[str]],
        *,
        source: str | None = None,
    ) -> None:
        self.config = config
        self.missing = missing
        self.extra = extra
        self.mismatched = mismatched
        self.source = source
        what = "checkpoint" if source is None else f"checkpoint {source!r}"
        lines = [f"{what} does not match the `like` state:"]
        lines += [f"  config: {c}" for c in config]
        if missing:
            lines.append(f"  missing layers (in like, not in the checkpoint): {_names(missing)}")
        if extra:
            lines.append(f"  extra layers (in the checkpoint, not in like): {_names(extra)}")
        for name, reasons in mismatched.items():
            lines.append(f"  layer {name!r}: {'; '.join(reasons)}")
        super().__init__("\n".join(lines))

    def __reduce__(self) -> tuple[Any, ...]:  # picklable despite the keyword-only source
        args = (self.config, self.missing, self.extra, self.mismatched)
        return (functools.partial(type(self), source=self.source), args)


def _names(names: list[str]) -> str:
    return ", ".join(repr(n) for n in names)


# --------------------------------------------------------------------------- to dict


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


def _decomposition_meta(ls: LayerState) -> dict[str, Any] | None:
    d = ls.decomposition
    if d is None:
        return None
    kind = "eigen" if isinstance(d, EigenDecomposition) else "inverse"
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
    }


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


def state_to_dict(
    state: KFACState, *, include_decompositions: bool = False
) -> dict[str, torch.Tensor]:
    """Flatten ``state`` into ``{key: tensor}`` plus the metadata tensor ``__kfac_meta__``.

    Keys are the optree paths of the state's tensors joined with dots
    (``layers.<layer name>.a_factor``, ``layers.<layer name>.decomposition.qa``); counters,
    layer specs and the configuration go into the JSON metadata (see the module docstring).
    Tensors are detached and made contiguous (a copy only for those that were not; their
    original strides are recorded in the metadata), otherwise shared with ``state``.

    Args:
        state: the state to flatten.
        include_decompositions: also store the decompositions. Without them the loaded
            state has none, and the next :func:`kfac_func.step.update` recomputes them from the
            factors of that step (``kf.decompose(state, damping=..., only_missing=True)``
            computes them eagerly from the loaded factors instead).

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
        if not include_decompositions and path[2:3] == ("decomposition",):
            continue
        # unique: the last component is always a field name, and the field names of a
        # layer (a_factor, g_factor) and of a decomposition (qa, ..., g_inv) are disjoint
        key = _key(path)
        if not leaf.is_contiguous() and _dense(leaf.shape, leaf.stride()):
            strides[key] = list(leaf.stride())
        out[key] = leaf.detach().contiguous()
    out[META_KEY] = _encode(_metadata(state, include_decompositions, strides))
    return out


# --------------------------------------------------------------------------- from dict


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
    if version > FORMAT_VERSION or version < 1:
        import kfac_func

        raise CheckpointFormatError(
            f"checkpoint has format version {version} (written by kfac_func "
            f"{meta.get('library_version', '?')}); this library (kfac_func "
            f"{kfac_func.__version__}) reads format version {FORMAT_VERSION}"
            + (": upgrade kfac_func to load it" if version > FORMAT_VERSION else "")
        )
    _get(meta, "step", int, "")
    config = _get(meta, "config", dict, "")
    config.setdefault("eigenbasis_refresh", "eigh")  # files written before it existed
    for k in _CONFIG_FIELDS:
        _get(config, k, (str, bool), "config ")
    strides = meta.get("strides", {})
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
        entry.setdefault("decomposition_failures", 0)  # files written before this counter
        _get(entry, "decomposition_failures", int, f"layer {name!r} ")
        _get(entry, "spec", dict, f"layer {name!r} ")
        dec = entry.get("decomposition")
        if dec is not None:
            if not isinstance(dec, dict):
                raise _fmt(f"layer {name!r}: decomposition is not an object")
            where = f"layer {name!r} decomposition "
            kind = _get(dec, "type", str, where)
            if kind != config["compute_method"] or kind not in _DECOMPOSITIONS:
                raise _fmt(
                    f"layer {name!r}: decomposition type {kind!r} in a checkpoint of "
                    f"compute_method {config['compute_method']!r}"
                )
            fields = {f.name for f in dataclasses.fields(_DECOMPOSITIONS[kind])}
            tensors = _get(dec, "tensors", list, where)
            if not set(tensors) <= fields or len(set(tensors)) != len(tensors):
                raise _fmt(f"layer {name!r}: bad decomposition tensors {tensors!r}")
    return meta


def _expected_keys(meta: dict[str, Any]) -> list[str]:
    keys = []
    for entry in meta["layers"]:
        name = entry["name"]
        keys += [_layer_key(name, "a_factor"), _layer_key(name, "g_factor")]
        if entry.get("decomposition") is not None:
            keys += [
                _layer_key(name, "decomposition", f) for f in entry["decomposition"]["tensors"]
            ]
    return keys


def _decomposition_shapes(spec: LayerSpec) -> dict[str, tuple[int, ...]]:
    b, a, g = spec.batch_shape, spec.a_dim, spec.g_dim
    return {
        "qa": (*b, a, a),
        "da": (*b, a),
        "qg": (*b, g, g),
        "dg": (*b, g),
        "dgda": (*b, g, a),
        "a_inv": (*b, a, a),
        "g_inv": (*b, g, g),
    }


def _shape(s: torch.Size | tuple[int, ...]) -> tuple[int, ...]:
    return tuple(int(x) for x in s)


def _layer_problems(
    entry: dict[str, Any], ls: LayerState, d: Mapping[str, torch.Tensor], like: KFACState
) -> list[str]:
    name = entry["name"]
    reasons = []
    want_spec = {k: _json_value(getattr(ls.spec, k)) for k in _SPEC_FIELDS}
    got_spec = entry["spec"]
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


def _contiguous_strides(shape: Sequence[int]) -> list[int]:
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= max(n, 1)
    return out[::-1]


def _build_layer(
    entry: dict[str, Any],
    ls: LayerState,
    d: Mapping[str, torch.Tensor],
    strides: Mapping[str, list[int]],
) -> LayerState:
    name = entry["name"]
    device = ls.a_factor.device

    def get(*rest: str) -> torch.Tensor:
        # a fresh tensor in the original memory layout: matmul results depend on it
        key = _layer_key(name, *rest)
        t = d[key]
        layout = strides.get(key) or _contiguous_strides(t.shape)
        return torch.empty_strided(t.shape, layout, dtype=t.dtype, device=device).copy_(t)

    dec_meta = entry.get("decomposition")
    decomposition = None
    if dec_meta is not None:
        cls = _DECOMPOSITIONS[dec_meta["type"]]
        decomposition = cls(**{f: get("decomposition", f) for f in dec_meta["tensors"]})
    return LayerState(
        a_factor=get("a_factor"),
        g_factor=get("g_factor"),
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
    only_missing=True)`` computes them now from the loaded factors.

    Raises:
        CheckpointFormatError: missing/malformed metadata, a format version newer than
            this library reads, or tensors missing from / unexpected in ``d``.
        CheckpointMismatchError: one error listing every configuration difference
            (convention, compute method, dtypes, ...), every missing and extra layer, and
            every layer whose spec, shapes or dtypes differ. Nothing is half-loaded.

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
        kfac_func.checkpoint.state_files.CheckpointMismatchError: checkpoint does not match the `like` state:
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
    missing = [n for n in like.layers if n not in entries]
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
    layers = {name: _build_layer(entries[name], ls, d, strides) for name, ls in like.layers.items()}
    return KFACState(layers=layers, step=meta["step"], config=like.config)


# --------------------------------------------------------------------------- files


def _is_torch_path(path: str) -> bool:
    return path.lower().endswith(_TORCH_SUFFIXES)


def _fsync_dir(directory: str) -> None:
    if os.name == "nt":  # pragma: no cover - directories cannot be opened on Windows
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:  # pragma: no cover - file systems without directory fsync
        if e.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def _atomic_write(path: str, write: Callable[[str], None]) -> None:
    """``write(tmp)`` into a fresh file next to ``path``, fsync it, rename it over ``path``."""
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{secrets.token_hex(6)}.tmp")
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    try:
        write(tmp)
        with open(tmp, "r+b") as f:
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    _fsync_dir(directory)


def _compact(d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU tensors that each own their whole storage (safetensors refuses shared ones)."""
    out = {}
    seen: set[int] = set()
    for k, t in d.items():
        t = t.detach().to("cpu").contiguous()
        storage = t.untyped_storage()
        if storage.data_ptr() in seen or storage.nbytes() != t.numel() * t.element_size():
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        out[k] = t
    return out


def save_state(state: KFACState, path: PathLike, *, include_decompositions: bool = False) -> None:
    """Write ``state`` to ``path`` atomically.

    ``.pt``/``.pth`` paths get ``torch.save`` of the flat dict of :func:`state_to_dict`
    (tensors only, loadable with ``torch.load(weights_only=True)``); any other path gets a
    safetensors file whose header metadata also holds the JSON under ``__kfac_meta__``.
    Tensors are written from the CPU. The file is written to a temporary file in the same
    directory, flushed and fsynced, renamed over ``path`` and the directory fsynced: a
    reader sees the old checkpoint or the new one, never a partial file. On an exception
    the temporary file is removed; a killed process may leave a ``.<name>.<hex>.tmp``
    file behind but never touches ``path``.

    Args:
        state: the state to save.
        path: destination file.
        include_decompositions: also store the decompositions (see :func:`state_to_dict`).

    Example:
        >>> import os, tempfile
        >>> from torch import nn
        >>> import kfac_func as kf
        >>> state = kf.init(kf.register(nn.Linear(3, 2)))
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     kf.save_state(state, os.path.join(tmp, "kfac.safetensors"))
        ...     kf.save_state(state, os.path.join(tmp, "kfac.pt"))
        ...     sorted(os.listdir(tmp))
        ['kfac.pt', 'kfac.safetensors']
    """
    path = os.fspath(path)
    flat = _compact(state_to_dict(state, include_decompositions=include_decompositions))
    if _is_torch_path(path):

        def write(tmp: str) -> None:
            with open(tmp, "wb") as f:
                torch.save(flat, f)

    else:
        meta_text = bytes(flat[META_KEY].tolist()).decode("utf-8")

        def write(tmp: str) -> None:
            safetensors.torch.save_file(flat, tmp, metadata={META_KEY: meta_text})

    _atomic_write(path, write)


def _read(path: str) -> dict[str, torch.Tensor]:
    with open(path, "rb") as f:
        magic = f.read(len(_ZIP_MAGIC))
    as_torch = magic == _ZIP_MAGIC or _is_torch_path(path)
    fmt = "a torch.save file" if as_torch else "a safetensors file"
    try:
        if as_torch:
            loaded = torch.load(path, map_location="cpu", weights_only=True)
        else:
            with safetensors.safe_open(path, framework="pt", device="cpu") as f:
                header = (f.metadata() or {}).get(META_KEY)
                loaded = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
            if header is not None and META_KEY in loaded:
                if bytes(loaded[META_KEY].tolist()).decode("utf-8", "replace") != header:
                    raise ValueError(f"header metadata and the {META_KEY!r} tensor differ")
            elif header is not None:
                loaded[META_KEY] = _encode(json.loads(header))
    except Exception as e:  # parsers raise RuntimeError, OSError(EINVAL), SafetensorError...
        detail = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise CheckpointFormatError(
            f"cannot read {path!r} as {fmt}: the file is truncated or corrupt "
            f"({type(e).__name__}: {detail})"
        ) from e
    if not isinstance(loaded, dict):
        raise CheckpointFormatError(f"{path!r} holds a {type(loaded).__name__}, not a dict")
    return loaded


def load_state(path: PathLike, *, like: KFACState) -> KFACState:
    """Read a checkpoint written by :func:`save_state` (either format) and rebuild the state.

    torch.save files are read with ``torch.load(weights_only=True)``; the format is
    recognised from the file's first bytes (falling back to the ``.pt``/``.pth`` suffix).
    Tensors are moved to the device of ``like``; see :func:`state_from_dict` for the
    checks against ``like`` and for decompositions that the file does not hold (they are
    ``None``; ``update`` or ``kf.decompose(state, damping=..., only_missing=True)``
    recompute them).

    Raises:
        CheckpointFormatError: the file is truncated, corrupt, not a kfac_func checkpoint,
            or of a newer format version; the message names the path.
        CheckpointMismatchError: the checkpoint is of another model or configuration.
        FileNotFoundError: no file at ``path``.

    Example:
        >>> import os, tempfile
        >>> import torch
        >>> from torch import nn
        >>> import kfac_func as kf
        >>> layers = kf.register(nn.Linear(3, 2))
        >>> state = kf.init(layers, factor_dtype=torch.float64).replace(step=7)
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     path = os.path.join(tmp, "kfac.safetensors")
        ...     kf.save_state(state, path)
        ...     restored = kf.load_state(path, like=kf.init(layers, factor_dtype=torch.float64))
        >>> restored.step, restored.layers[""].a_factor.dtype
        (7, torch.float64)
    """
    path = os.fspath(path)
    loaded = _read(path)
    try:
        return state_from_dict(loaded, like=like)
    except CheckpointMismatchError as e:
        raise CheckpointMismatchError(
            e.config, e.missing, e.extra, e.mismatched, source=path
        ) from None
    except CheckpointFormatError as e:
        raise CheckpointFormatError(f"{path!r}: {e}") from None
