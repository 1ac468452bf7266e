"""Checkpoint files of a :class:`~kfac_func.KFACState`, written atomically.

:func:`save_state` writes the flat dict of
:func:`~kfac_func.checkpoint.state_dict.state_to_dict` atomically to a ``.safetensors``
file (the JSON metadata is also put in the safetensors header metadata) or, for
``.pt``/``.pth`` paths, with ``torch.save`` of the flat dict (tensors only, never other
pickled objects). :func:`load_state` reads either format and rebuilds the state with
:func:`~kfac_func.checkpoint.state_dict.state_from_dict`; its errors name the file. The
atomic write (see :func:`save_state`) also commits the manifests of factor directories
(:mod:`kfac_func.checkpoint.factor_dir`).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
from collections.abc import Callable

import safetensors
import safetensors.torch
import torch

from kfac_func.checkpoint.errors import CheckpointFormatError, CheckpointMismatchError
from kfac_func.checkpoint.state_dict import state_from_dict, state_to_dict
from kfac_func.checkpoint.state_format import META_KEY, _encode
from kfac_func.state import KFACState

__all__ = [
    "load_state",
    "save_state",
]

_TORCH_SUFFIXES = (".pt", ".pth")
_ZIP_MAGIC = b"PK\x03\x04"

PathLike = str | os.PathLike[str]


def _is_torch_path(path: str) -> bool:
    return path.lower().endswith(_TORCH_SUFFIXES)


def _fsync_dir(directory: PathLike) -> None:
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
    checks against ``like`` and for decompositions that the file does not hold.

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
