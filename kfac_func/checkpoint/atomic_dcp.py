"""Atomic ``torch.distributed.checkpoint`` directories: a reader finds the previous
checkpoint or the new one, never a partial one.

``dcp.save`` writes its shard files and, last, the ``.metadata`` file into the directory
it is given; a job killed in between leaves a directory that ``dcp.load`` refuses (or,
overwriting an older checkpoint, a mix of both). :func:`save_dcp` writes into a sibling
directory ``.NAME.partial`` instead and, once every rank has written, renames it to
``NAME``: an existing ``NAME`` is first renamed to ``.NAME.previous`` and removed after
the new one is in place. :func:`load_dcp` reads ``NAME``, or ``.NAME.previous`` when a
save was killed between the two renames. Both are collectives (every rank calls them,
with the same path on a file system all ranks share); on one process without a process
group they need none.

A checkpoint of :class:`kfac_func.KFAC` is
``torch.distributed.checkpoint.state_dict.get_state_dict(model, opt)``: the optimizer's
part holds K-FAC's state, its tensors' checksums included (see
:meth:`kfac_func.KFAC.state_dict`); ``set_state_dict`` verifies them.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist

from kfac_func.checkpoint.lent import fresh_template
from kfac_func.checkpoint.state_files import _fsync_dir

__all__ = ["load_dcp", "previous_path", "save_dcp"]


def _partial_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.partial")


def previous_path(path: str | os.PathLike[str]) -> Path:
    """Where :func:`save_dcp` keeps the previous checkpoint of ``path`` while it swaps.

    Example:
        >>> previous_path("ckpt/latest").as_posix()
        'ckpt/.latest.previous'
    """
    path = Path(path)
    return path.with_name(f".{path.name}.previous")


def _rank(group: Any) -> int:
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


def _barrier(group: Any) -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier(group=group)


def _rename(src: Path, dst: Path) -> None:
    os.rename(src, dst)


def _swap(new: Path, path: Path) -> None:
    """Put the complete checkpoint ``new`` at ``path``; the one there is kept at
    :func:`previous_path` until then."""
    old = previous_path(path)
    if path.exists():
        if old.exists():
            shutil.rmtree(old)
        _rename(path, old)
    _rename(new, path)
    _fsync_dir(path.parent)
    if old.exists():
        shutil.rmtree(old)


def save_dcp(
    state_dict: dict[str, Any], path: str | os.PathLike[str], *, process_group: Any = None
) -> Path:
    """``torch.distributed.checkpoint.save(state_dict)`` to the directory ``path``,
    atomically (see the module docstring: a job killed at any point leaves the previous
    checkpoint for :func:`load_dcp`). A collective over ``process_group`` (default: the
    default group, or none on one process); rank 0 renames. Leftovers of a killed save
    are removed first.

    Returns:
        ``path``.

    Example:
        >>> import tempfile, warnings
        >>> import torch
        >>> from torch import nn
        >>> import kfac_func as kf
        >>> model = nn.Sequential(nn.Linear(4, 3))
        >>> opt = kf.KFAC(model)
        >>> ckpt = Path(tempfile.mkdtemp()) / "latest"
        >>> with warnings.catch_warnings():  # DCP warns that it runs without a process group
        ...     warnings.simplefilter("ignore", UserWarning)
        ...     _ = kf.save_dcp({"model": model.state_dict(), "optim": opt.state_dict()}, ckpt)
        ...     template = {"model": model.state_dict(), "optim": opt.state_dict()}
        ...     _ = kf.load_dcp(template, ckpt)
        >>> sorted(p.name for p in ckpt.parent.iterdir())
        ['latest']
    """
    from torch.distributed.checkpoint.state_dict_saver import save

    path = Path(path)
    partial = _partial_path(path)
    if _rank(process_group) == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        if partial.exists():  # a killed save's
            shutil.rmtree(partial)
    _barrier(process_group)
    save(state_dict, checkpoint_id=partial, process_group=process_group)
    _barrier(process_group)  # every rank's files are written
    if _rank(process_group) == 0:
        _swap(partial, path)
    _barrier(process_group)  # every rank sees the new checkpoint
    return path


def load_dcp(
    state_dict: dict[str, Any], path: str | os.PathLike[str], *, process_group: Any = None
) -> Path:
    """``torch.distributed.checkpoint.load(state_dict)`` (into its tensors, in place) from
    a checkpoint :func:`save_dcp` wrote at ``path``, or from :func:`previous_path` when a
    save was killed between its renames. Returns the directory read.

    The tensors of ``state_dict`` that a K-FAC state dict shares with its live state are
    first replaced by fresh ones (:func:`~kfac_func.checkpoint.lent.fresh_template`), so
    that the loaded values reach the state only through ``load_state_dict``, which checks
    them (a damaged checkpoint then changes nothing); the others (a model's parameters)
    are loaded in place.

    Raises:
        FileNotFoundError: naming ``path`` when neither exists.

    Example:
        >>> load_dcp({}, "no/such/ckpt")
        Traceback (most recent call last):
        ...
        FileNotFoundError: no checkpoint at 'no/such/ckpt' (nor at 'no/such/.ckpt.previous')
    """
    from torch.distributed.checkpoint.state_dict_loader import load

    path = Path(path)
    found = path if path.exists() else previous_path(path)
    if not found.exists():
        raise FileNotFoundError(
            f"no checkpoint at {path.as_posix()!r} (nor at {found.as_posix()!r})"
        )
    load(fresh_template(state_dict), checkpoint_id=found, process_group=process_group)
    return found
