"""Checksums of the tensors of a nested state dict, checked when it is loaded.

A checkpoint travels through files, object stores and distributed checkpoint
shards; a flipped bit in a factor would load without complaint and steer every later step.
:func:`add_checksums` records a SHA-256 digest of each tensor of a nested dict (its dtype,
shape and bytes) under ``"checksums"``, keyed by the tensor's dotted path;
:func:`verify_checksums` recomputes them and raises a
:class:`~kfac_func.checkpoint.errors.CheckpointFormatError` naming every tensor that
differs. A dict without ``"checksums"`` (an older checkpoint, or one edited on purpose and
its checksums dropped) is not checked.

The digests read each tensor's memory where it lies (a host tensor that is contiguous is
not copied; a device tensor is copied to the host once) and hash several tensors at once
on threads (``hashlib`` releases the interpreter lock while it hashes), so that checksums
cost about the time SHA-256 takes over the bytes, at memory speed.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from kfac_func.checkpoint.errors import CheckpointFormatError

__all__ = ["CHECKSUMS_KEY", "add_checksums", "tensor_digest", "verify_checksums"]

CHECKSUMS_KEY = "checksums"
"""The key of the ``{dotted path: SHA-256 hex digest}`` entry of a state dict."""


def tensor_digest(t: torch.Tensor) -> str:
    """The SHA-256 hex digest of a tensor's dtype, shape and values (read on the host,
    from its own memory when it is a contiguous host tensor).

    Example:
        >>> a = torch.arange(4.0)
        >>> tensor_digest(a) == tensor_digest(a.clone()) != tensor_digest(a.double())
        True
    """
    h = hashlib.sha256(f"{t.dtype} {tuple(t.shape)}".encode())
    data = t.detach()
    if data.numel():
        data = data.to("cpu").contiguous().reshape(-1)
        h.update(data.view(torch.uint8).numpy().data)
    return h.hexdigest()


_THREADS = max(1, min(8, os.cpu_count() or 1))
"""Threads that hash at once (each tensor on one of them)."""


def _digests(tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, str]:
    """``{path: tensor_digest(tensor)}``, several tensors hashed at once."""
    items = list(tensors)
    if len(items) < 2 or _THREADS == 1:
        return {path: tensor_digest(t) for path, t in items}
    with ThreadPoolExecutor(_THREADS) as pool:
        sums = pool.map(tensor_digest, [t for _, t in items])
        return dict(zip([path for path, _ in items], sums))


def _tensors(tree: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    for key, value in tree.items():
        if not prefix and key == CHECKSUMS_KEY:
            continue
        path = f"{prefix}{key}"
        if isinstance(value, torch.Tensor):
            yield path, value
        elif isinstance(value, Mapping):
            yield from _tensors(value, path + ".")


def add_checksums(state_dict: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` with ``"checksums"``: the digest of each of its tensors (nested
    dicts included), by dotted path; a dict without tensors gets none. The dict is
    changed in place and returned.

    Example:
        >>> sd = add_checksums({"steps": 3, "layers": {"0": {"A": torch.eye(2)}}})
        >>> list(sd["checksums"])
        ['layers.0.A']
    """
    sums = _digests(_tensors(state_dict))
    if sums:
        state_dict[CHECKSUMS_KEY] = sums
    return state_dict


def verify_checksums(state_dict: Mapping[str, Any], what: str = "state_dict") -> None:
    """Check the tensors of ``state_dict`` against its ``"checksums"`` (nothing to check
    without them).

    Raises:
        CheckpointFormatError: naming each tensor (``what`` and its dotted path) whose
            digest differs from the recorded one. Tensors the dict lacks are not checked
            (entries dropped on purpose; a loader that needs them says so).

    Example:
        >>> sd = add_checksums({"A": torch.eye(2)})
        >>> verify_checksums(sd)
        >>> sd["A"][0, 1] = 1e-30
        >>> verify_checksums(sd, "kfac")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        kfac_func.checkpoint.errors.CheckpointFormatError: kfac: the tensor 'A' ...
    """
    recorded = state_dict.get(CHECKSUMS_KEY)
    if recorded is None:
        return
    found = dict(_tensors(state_dict))
    now = _digests((path, found[path]) for path in recorded if path in found)
    bad = [
        f"the tensor {path!r} does not match its checksum"
        for path, digest in recorded.items()
        if path in now and now[path] != digest
    ]
    if bad:
        raise CheckpointFormatError(
            f"{what}: {'; '.join(bad)} (SHA-256 recorded when it was saved): the checkpoint "
            "is damaged; nothing was loaded"
        )
