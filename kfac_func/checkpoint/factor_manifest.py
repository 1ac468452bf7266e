"""The manifest of a factor directory (its commit point) and the file names it lists.

:func:`~kfac_func.checkpoint.factor_dir.save_factor_dir` writes the manifest last;
:func:`read_factor_manifest` reads and validates it. The manifest (UTF-8 JSON)::

    {"format": "kfac_func.FactorDir", "format_version": 1, "library_version": "0.1.0",
     "step": 3, "world_size": 4, "strategy": "MEM_OPT", "plan_fingerprint": "...",
     "include_decompositions": false,
     "layers": [{"name": "encoder.0", "file": "layer.encoder.0.safetensors",
                 "bytes": 3416, "sha256": "...", "writer": 2}, ...]}

File names (:func:`layer_file_name`) are derived from layer names alone and can never
leave the directory: every character outside ``[a-z0-9_.-]`` (upper-case letters included,
so that names differing only in case stay distinct on case-insensitive file systems) is
percent-encoded as UTF-8 bytes with upper-case hex digits, the result is prefixed by
``layer.`` (never ``.``, ``..``, hidden or empty) and suffixed by ``.safetensors``, and an
encoded name longer than 180 characters is cut and given ``~`` plus 16 hex digits of the
SHA-256 of the full name (``~`` appears nowhere else, so cut names never equal uncut
ones). The mapping is injective up to that 64-bit hash; the manifest maps files back to
names, and the loader only opens plain file names listed there.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

from kfac_func.checkpoint.errors import CheckpointFormatError, _version_problem
from kfac_func.distributed.plan import Plan
from kfac_func.state import KFACState

__all__ = [
    "MANIFEST_FORMAT_VERSION",
    "MANIFEST_NAME",
    "layer_file_name",
    "read_factor_manifest",
]

MANIFEST_NAME = "manifest.json"
"""File name of the manifest, the commit point of a factor directory."""

MANIFEST_FORMAT_VERSION = 1
"""Manifest format version this library writes (and the newest it reads)."""

_MANIFEST_FORMAT = "kfac_func.FactorDir"
_PREFIX = "layer."
_SUFFIX = ".safetensors"
_SAFE = frozenset("abcdefghijklmnopqrstuvwxyz0123456789_.-")
_MAX_ENCODED = 180  # + prefix/suffix (18) + the writer's ".<name>.<12 hex>.tmp": < 255 bytes
_HASH_HEX = 16

PathLike = str | os.PathLike[str]


# --------------------------------------------------------------------------- file names


def layer_file_name(name: str) -> str:
    """The file name of layer ``name`` inside a factor directory (a plain, ASCII name).

    See the module docstring for the encoding. It never contains a path separator, NUL,
    ``..`` as a whole name, or a leading dot, is at most 210 characters long, and distinct
    layer names give distinct file names, also when compared case-insensitively (up to a
    64-bit hash for names whose encoding exceeds 180 characters).

    Example:
        >>> layer_file_name("encoder.0")
        'layer.encoder.0.safetensors'
        >>> layer_file_name("../evil"), layer_file_name("Fc")
        ('layer...%2Fevil.safetensors', 'layer.%46c.safetensors')
        >>> len(layer_file_name("x" * 500))
        198
    """
    if not isinstance(name, str):
        raise TypeError(f"layer names are str, got {type(name).__name__}")
    parts = []
    for ch in name:
        if ch in _SAFE:
            parts.append(ch)
        else:  # surrogatepass: total on every str, even lone surrogates
            parts.extend(f"%{b:02X}" for b in ch.encode("utf-8", "surrogatepass"))
    if sum(map(len, parts)) > _MAX_ENCODED:
        digest = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:_HASH_HEX]
        kept, size = [], 0
        for p in parts:  # whole characters only: never a cut %XX triple
            if size + len(p) > _MAX_ENCODED - 1 - _HASH_HEX:
                break
            kept.append(p)
            size += len(p)
        parts = [*kept, "~", digest]
    return f"{_PREFIX}{''.join(parts)}{_SUFFIX}"


def _plain_file_name(file: str) -> bool:
    return (
        bool(file)
        and file not in (".", "..")
        and not any(c in file for c in "/\\\0")
        and os.path.basename(file) == file
        and not os.path.isabs(file)
    )


# --------------------------------------------------------------------------- manifest


def _manifest(
    state: KFACState,
    plan: Plan | None,
    world: int,
    include_decompositions: bool,
    written: dict[str, dict[str, Any]],
) -> dict[str, Any]:
    import kfac_func

    return {
        "format": _MANIFEST_FORMAT,
        "format_version": MANIFEST_FORMAT_VERSION,
        "library_version": kfac_func.__version__,
        "step": state.step,
        "world_size": world,
        "strategy": plan.strategy.name if plan is not None else None,
        "plan_fingerprint": plan.fingerprint() if plan is not None else None,
        "include_decompositions": include_decompositions,
        "layers": [{"name": name, **written[name]} for name in state.layers],
    }


def _bad(directory: str, msg: str) -> CheckpointFormatError:
    return CheckpointFormatError(f"factor checkpoint {directory!r}: {msg}")


def _field(obj: dict[str, Any], key: str, typ: type | tuple[type, ...], where: str) -> Any:
    value = obj.get(key)
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        raise ValueError(f"{where}{key!r} is missing or of the wrong type ({value!r})")
    return value


def read_factor_manifest(directory: PathLike) -> dict[str, Any]:
    """The validated manifest of a factor directory (see the module docstring).

    Raises:
        CheckpointFormatError: no manifest (the save was interrupted, failed or is still
            running), a malformed one, one of a newer format version, or one listing a
            file name that is not a plain name inside the directory.
        FileNotFoundError: ``directory`` does not exist.

    Example:
        >>> import tempfile
        >>> from torch import nn
        >>> import kfac_func as kf
        >>> state = kf.init(kf.register(nn.Sequential(nn.Linear(3, 2))))
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     kf.checkpoint.save_factor_dir(state, tmp)
        ...     m = kf.checkpoint.read_factor_manifest(tmp)
        >>> m["step"], m["world_size"], [(e["name"], e["file"]) for e in m["layers"]]
        (0, 1, [('0', 'layer.0.safetensors')])
    """
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"no factor checkpoint directory {directory!r}")
    path = os.path.join(directory, MANIFEST_NAME)
    if not os.path.exists(path):
        present = sorted(
            f for f in os.listdir(directory) if f.startswith(_PREFIX) and f.endswith(_SUFFIX)
        )
        raise _bad(
            directory,
            f"no {MANIFEST_NAME}: the save was interrupted, failed or has not finished (the "
            f"manifest is written last, after every layer file); {len(present)} layer "
            "file(s) present, refusing to load them",
        )
    try:
        with open(path, "rb") as f:
            manifest = json.loads(f.read().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _bad(directory, f"{MANIFEST_NAME} is not valid UTF-8 JSON ({e})") from e
    if not isinstance(manifest, dict) or manifest.get("format") != _MANIFEST_FORMAT:
        raise _bad(directory, f"{MANIFEST_NAME} does not describe a {_MANIFEST_FORMAT}")
    try:
        version = _field(manifest, "format_version", int, "")
        if unreadable := _version_problem("manifest", version, manifest, MANIFEST_FORMAT_VERSION):
            raise _bad(directory, unreadable)
        _field(manifest, "step", int, "")
        _field(manifest, "world_size", int, "")
        layers = _field(manifest, "layers", list, "")
        names: set[str] = set()
        files: set[str] = set()
        for i, entry in enumerate(layers):
            if not isinstance(entry, dict):
                raise ValueError(f"layers[{i}] is not an object")
            name = _field(entry, "name", str, f"layers[{i}] ")
            where = f"layer {name!r} "
            file = _field(entry, "file", str, where)
            _field(entry, "bytes", int, where)
            _field(entry, "sha256", str, where)
            if not _plain_file_name(file) or file == MANIFEST_NAME:
                raise ValueError(f"layer {name!r}: file {file!r} is not a plain file name")
            if name in names or file in files:
                raise ValueError(f"layer {name!r} or file {file!r} is listed twice")
            names.add(name)
            files.add(file)
    except ValueError as e:
        if isinstance(e, CheckpointFormatError):
            raise
        raise _bad(directory, f"malformed {MANIFEST_NAME}: {e}") from None
    return manifest
