"""Sharded factor checkpoints: one file per layer plus a manifest, resumable on any world size.

:func:`save_factor_dir` writes a directory::

    <directory>/
        layer.<encoded layer name>.safetensors   one per layer
        manifest.json                            written last: the commit point

Each layer file is an ordinary single-layer checkpoint of :mod:`kfac_func.checkpoint.state_files`
(``save_state`` of ``state.replace(layers={name: layer_state})``: same format, same
metadata, same atomic write), so every check of that module applies to it. Under a
:class:`~kfac_func.distributed.Plan` the file of a layer is written by the layer's A owner, the one
rank whose copy is current under every strategy (under ``MEM_OPT`` only the owner folds
and decomposes a layer; under ``COMM_OPT``/``HYBRID_OPT`` every rank holds the averaged
factors and the A owner is one of the layer's grad workers, so it holds the
decompositions too). Without a plan one process (rank 0) writes every file.

Commit protocol. Rank 0 first removes an old manifest (so that overwriting a directory in
place can never leave an old manifest in front of new files); after a collective every
rank writes its files; the ranks then exchange the names, sizes and SHA-256 digests of
what they wrote (an ``all_gather_object``, which is also the barrier), and only if every
rank succeeded rank 0 writes the manifest atomically; a last collective tells every rank
whether that worked. An exception on any rank makes every rank raise, and no manifest is
written. (Under NCCL, as for every object collective, each rank's CUDA device must be
set with ``torch.cuda.set_device`` first.) A directory without a manifest, or whose
manifest lists a file that is missing, has another size or another digest, is refused by
:func:`load_factor_dir` with an error naming every problem. Write each checkpoint to a
fresh directory (``ckpt/step_000100``): re-saving in place destroys the previous one
before the new one is committed.

File names (:func:`~kfac_func.checkpoint.factor_manifest.layer_file_name`) and the
manifest are described in :mod:`kfac_func.checkpoint.factor_manifest`.

Loading (:func:`load_factor_dir`) takes the plan of the *new* run, which may be for
another world size: the files do not depend on the saving plan. By default every rank
reads every layer file (factor files are small next to a model, and every rank then
holds the same, complete state and raises the same errors). With ``only_owned=True``,
allowed under ``MEM_OPT`` only, a rank reads just the layers it owns and keeps ``like``'s
entries for the others, which is exactly what an uninterrupted ``MEM_OPT`` run holds there
(:func:`kfac_func.distributed.update_distributed` neither folds nor decomposes other ranks'
layers); under ``COMM_OPT``/``HYBRID_OPT`` every rank holds the averaged factors, so every
rank must read every layer. Decompositions not in the files come back as ``None`` (see
:func:`~kfac_func.state_from_dict`): resume on an inverse-update step or save with
``include_decompositions=True`` to continue exactly.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from typing import Any

import safetensors.torch
import torch.distributed as dist

from kfac_func.checkpoint.errors import (
    CheckpointError,
    CheckpointFormatError,
    CheckpointMismatchError,
)
from kfac_func.checkpoint.factor_manifest import (
    MANIFEST_NAME,
    PathLike,
    _bad,
    _manifest,
    layer_file_name,
    read_factor_manifest,
)
from kfac_func.checkpoint.state_dict import state_from_dict
from kfac_func.checkpoint.state_files import _atomic_write, _fsync_dir, save_state
from kfac_func.distributed.plan import DistributedStrategy, Plan
from kfac_func.state import KFACState, LayerState

__all__ = [
    "load_factor_dir",
    "save_factor_dir",
]


# --------------------------------------------------------------------------- ranks
# which rank this process is, whether a plan fits, and how the ranks agree (gathering
# every rank's report, so that a failure on any rank makes every rank raise)


def _context(rank: int | None, *, any_rank: bool) -> tuple[bool, int, int]:
    """``(collective, rank, world)``: collective when a process group of >1 ranks is up."""
    if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool) or rank < 0):
        raise ValueError(f"rank must be a non-negative int, got {rank!r}")
    if dist.is_available() and dist.is_initialized():
        world, mine = dist.get_world_size(), dist.get_rank()
        if rank is not None and rank != mine:
            raise ValueError(f"rank={rank} but this process is rank {mine} of the process group")
        return world > 1, mine, world
    if rank not in (None, 0) and not any_rank:
        raise ValueError(
            f"rank={rank} without an initialized process group: save_factor_dir writes "
            "as rank 0 (pass plan=None to write every layer from one process)"
        )
    return False, 0 if rank is None else rank, 1


def _check_plan(plan: Plan, names: Sequence[str], what: str) -> None:
    if not isinstance(plan, Plan):
        raise TypeError(f"plan must be a kfac_func.distributed.Plan, got {type(plan).__name__}")
    if set(plan.layers) != set(names):
        missing = sorted(set(names) - set(plan.layers))
        extra = sorted(set(plan.layers) - set(names))
        raise ValueError(
            f"plan and {what} disagree on layers: not in plan {missing}, not in {what} {extra}"
        )


def _gather(collective: bool, world: int, obj: Any) -> list[Any]:
    if not collective:
        return [obj]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj)
    return out


def _raise_failures(reports: list[Any], rank: int, own: BaseException | None, what: str) -> None:
    """Every rank raises if any rank failed (the failing rank its own exception)."""
    failed = [(r, rep["error"]) for r, rep in enumerate(reports) if rep["error"] is not None]
    if not failed:
        return
    if own is not None:
        raise own
    detail = "; ".join(f"rank {r}: {msg}" for r, msg in failed)
    raise CheckpointError(f"{what} failed on another rank ({detail})")


def _describe(e: BaseException | None) -> str | None:
    return None if e is None else f"{type(e).__name__}: {e}"


# --------------------------------------------------------------------------- save


def _sha256_file(path: str) -> tuple[int, str]:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


def save_factor_dir(
    state: KFACState,
    directory: PathLike,
    *,
    plan: Plan | None = None,
    rank: int | None = None,
    include_decompositions: bool = False,
) -> None:
    """Write ``state`` as one checkpoint file per layer plus a manifest, written last.

    When ``torch.distributed`` is initialized with more than one rank this is a collective:
    every rank calls it with its own state and the same plan; each layer is written by its
    A owner under ``plan`` (by rank 0 when ``plan`` is None), and rank 0 writes the
    manifest once every rank has written its files. See the module docstring for the
    layout and the commit protocol.

    Args:
        state: this rank's state (under ``MEM_OPT`` only the owned layers need be current).
        directory: created if absent; best a fresh one per checkpoint (an existing
            manifest there is removed first, so the directory reads as incomplete until
            the new manifest is written).
        plan: the plan the state was trained with (its ``world_size`` must be the process
            group's); None: one writer for every layer.
        rank: this process's rank; defaults to the process group's (0 without one), and
            must equal it.
        include_decompositions: also store the decompositions (see
            :func:`kfac_func.state_to_dict`).

    Raises:
        ValueError: the plan does not fit the state or the process group.
        CheckpointError: another rank failed (the failing rank raises its own exception);
            no manifest is written then.

    Example:
        >>> import os, tempfile
        >>> import kfac_func as kf
        >>> from torch import nn
        >>> layers = kf.register(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)))
        >>> state = kf.init(layers).replace(step=5)
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     plan = kf.distributed.make_plan(layers, world_size=1)
        ...     kf.checkpoint.save_factor_dir(state, tmp, plan=plan)
        ...     print(sorted(os.listdir(tmp)))
        ...     print(kf.checkpoint.load_factor_dir(tmp, like=kf.init(layers)).step)
        ['layer.0.safetensors', 'layer.2.safetensors', 'manifest.json']
        5
    """
    if not isinstance(state, KFACState):
        raise TypeError(f"state must be a KFACState, got {type(state).__name__}")
    directory = os.fspath(directory)
    collective, rank, world = _context(rank, any_rank=False)
    if plan is not None:
        _check_plan(plan, list(state.layers), "state")
        if plan.world_size != world:
            raise ValueError(
                f"plan is for world_size={plan.world_size} but this process "
                + (
                    f"group has {world} ranks"
                    if collective
                    else "has no process group (initialize torch.distributed on every "
                    "rank, or pass plan=None to write every layer from one process)"
                )
            )
    files = {name: layer_file_name(name) for name in state.layers}
    if len(set(files.values())) != len(files):  # pragma: no cover - a 64-bit hash collision
        raise ValueError("two layer names map to the same file name")
    writer = {name: plan.layers[name].a_owner if plan else 0 for name in state.layers}
    manifest_path = os.path.join(directory, MANIFEST_NAME)
    what = f"save_factor_dir({directory!r})"

    # 1. the directory exists, and reads as uncommitted from now on
    own: BaseException | None = None
    try:
        os.makedirs(directory, exist_ok=True)
        if rank == 0 and os.path.lexists(manifest_path):
            os.remove(manifest_path)
            _fsync_dir(directory)
    except Exception as e:
        own = e
    _raise_failures(_gather(collective, world, {"error": _describe(own)}), rank, own, what)

    # 2. each rank writes its layers
    entries: dict[str, dict[str, Any]] = {}
    try:
        for name, ls in state.layers.items():
            if writer[name] != rank:
                continue
            path = os.path.join(directory, files[name])
            single = state.replace(layers={name: ls})
            save_state(single, path, include_decompositions=include_decompositions)
            size, digest = _sha256_file(path)
            entries[name] = {"file": files[name], "bytes": size, "sha256": digest, "writer": rank}
    except Exception as e:
        own = e
    reports = _gather(
        collective, world, {"error": _describe(own), "entries": entries, "step": state.step}
    )
    _raise_failures(reports, rank, own, what)

    # 3. rank 0 commits
    try:
        if rank == 0:
            steps = {rep["step"] for rep in reports}
            if len(steps) != 1:
                raise ValueError(f"ranks saved states of different steps {sorted(steps)}")
            written: dict[str, dict[str, Any]] = {}
            for rep in reports:
                written.update(rep["entries"])
            lost = [n for n in state.layers if n not in written]
            if lost:  # pragma: no cover - every layer has exactly one writer
                raise ValueError(f"no rank wrote layers {lost}")
            manifest = _manifest(state, plan, world, include_decompositions, written)
            text = json.dumps(manifest, indent=1).encode("utf-8")

            def write(tmp: str) -> None:
                with open(tmp, "wb") as f:
                    f.write(text)

            _atomic_write(manifest_path, write)
    except Exception as e:
        own = e
    _raise_failures(_gather(collective, world, {"error": _describe(own)}), rank, own, what)


# --------------------------------------------------------------------------- load


def load_factor_dir(
    directory: PathLike,
    *,
    like: KFACState,
    plan: Plan | None = None,
    rank: int | None = None,
    only_owned: bool = False,
) -> KFACState:
    """Rebuild a state from a directory of :func:`save_factor_dir`, for any world size.

    ``like`` is a state of the same model and configuration (typically ``kf.init(...)``)
    and supplies the specs, configuration and device, as for
    :func:`kfac_func.load_state`. Which layer files each rank reads: see the module
    docstring (and ``only_owned``). The step comes from the manifest; decompositions that
    were not saved are ``None``. Before anything is read, every file the manifest lists
    must exist with its recorded size; each file read must match its SHA-256 digest and
    the manifest's step.

    Args:
        directory: written by :func:`save_factor_dir`.
        like: the target state's structure.
        plan: the new run's plan; must cover ``like``'s layers and, with a process group,
            have its world size.
        rank: this process's rank under ``plan``; defaults to the process group's (0
            without one).
        only_owned: read owned layers only (``MEM_OPT`` plans only: under ``COMM_OPT`` and
            ``HYBRID_OPT`` every rank holds the averaged factors of every layer).

    Raises:
        CheckpointFormatError: no manifest (incomplete save), a malformed or future one,
            missing, truncated or altered layer files, or files of another step; every
            such problem is named in one message.
        CheckpointMismatchError: one error listing the configuration differences and
            every missing, extra or mis-shaped layer, as :func:`kfac_func.load_state`.
        ValueError: ``plan``/``rank``/``only_owned`` do not fit.

    Example:
        >>> import tempfile
        >>> import torch
        >>> from torch import nn
        >>> import kfac_func as kf
        >>> layers = kf.register(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)))
        >>> state = kf.init(layers, factor_dtype=torch.float64)
        >>> state = state.replace(layers={n: ls.replace(a_factor=ls.a_factor + 1)
        ...                               for n, ls in state.layers.items()})
        >>> mem_opt = kf.distributed.DistributedStrategy.MEM_OPT
        >>> plan2 = kf.distributed.make_plan(layers, world_size=2, grad_worker_fraction=mem_opt)
        >>> [plan2.layers[n].a_owner for n in layers]
        [1, 0]
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     kf.checkpoint.save_factor_dir(state, tmp)
        ...     like = kf.init(layers, factor_dtype=torch.float64)
        ...     mine = kf.checkpoint.load_factor_dir(tmp, like=like, plan=plan2, rank=1,
        ...                                          only_owned=True)
        >>> [float(mine.layers[n].a_factor[0, 0]) for n in layers]  # '0' read, '2' from like
        [1.0, 0.0]
    """
    if not isinstance(like, KFACState):
        raise TypeError(f"like must be a KFACState, got {type(like).__name__}")
    directory = os.fspath(directory)
    manifest = read_factor_manifest(directory)
    collective, rank, world = _context(rank, any_rank=True)
    if plan is not None:
        _check_plan(plan, list(like.layers), "like")
        if collective and plan.world_size != world:
            raise ValueError(
                f"plan is for world_size={plan.world_size}, the process group has {world} ranks"
            )
        if rank >= plan.world_size:
            raise ValueError(f"rank {rank} is outside the plan's world of {plan.world_size}")
    if only_owned:
        if plan is None:
            raise ValueError("only_owned=True needs the plan of the new run")
        if plan.strategy is not DistributedStrategy.MEM_OPT:
            raise ValueError(
                f"only_owned=True is for MEM_OPT plans; under {plan.strategy.name} every "
                "rank holds the averaged factors of every layer, so every rank must read "
                "every layer"
            )

    step: int = manifest["step"]
    entries = {e["name"]: e for e in manifest["layers"]}
    missing = [n for n in like.layers if n not in entries]
    extra = [n for n in entries if n not in like.layers]
    owned = {n for n, lp in plan.layers.items() if lp.a_owner == rank} if plan else set()
    wanted = [n for n in like.layers if n in entries and (not only_owned or n in owned)]

    # every listed file is there with its size, before anything is read
    problems: list[str] = []
    for name, e in entries.items():
        path = os.path.join(directory, e["file"])
        try:
            size = os.stat(path).st_size
        except FileNotFoundError:
            problems.append(f"layer {name!r}: file {e['file']!r} is missing")
            continue
        if size != e["bytes"]:
            problems.append(
                f"layer {name!r}: file {e['file']!r} has {size} bytes, the manifest "
                f"records {e['bytes']} (truncated or overwritten)"
            )
    if problems:
        raise _incomplete(directory, problems)

    config: list[str] = []
    mismatched: dict[str, list[str]] = {}
    loaded: dict[str, LayerState] = {}
    for name in wanted:
        e = entries[name]
        path = os.path.join(directory, e["file"])
        with open(path, "rb") as f:
            data = f.read()
        if len(data) != e["bytes"] or hashlib.sha256(data).hexdigest() != e["sha256"]:
            problems.append(
                f"layer {name!r}: file {e['file']!r} does not match its SHA-256 digest in "
                "the manifest (altered, or written by another save)"
            )
            continue
        try:
            flat = safetensors.torch.load(data)
        except Exception as err:  # SafetensorError and friends
            problems.append(f"layer {name!r}: cannot read {e['file']!r} ({_describe(err)})")
            continue
        try:
            single = state_from_dict(flat, like=like.replace(layers={name: like.layers[name]}))
        except CheckpointMismatchError as err:
            if err.missing or err.extra:
                problems.append(
                    f"layer {name!r}: file {e['file']!r} holds layers {err.extra!r} instead"
                )
            config += [c for c in err.config if c not in config]
            mismatched.update(err.mismatched)
            continue
        except CheckpointFormatError as err:
            problems.append(f"layer {name!r}: file {e['file']!r}: {err}")
            continue
        if single.step != step:
            problems.append(
                f"layer {name!r}: file {e['file']!r} holds step {single.step}, the manifest "
                f"step {step} (files of different saves)"
            )
            continue
        loaded[name] = single.layers[name]
    if problems:
        raise _incomplete(directory, problems)
    if config or missing or extra or mismatched:
        raise CheckpointMismatchError(config, missing, extra, mismatched, source=directory)
    layers = {name: loaded.get(name, ls) for name, ls in like.layers.items()}
    return KFACState(layers=layers, step=step, config=like.config)


def _incomplete(directory: str, problems: list[str]) -> CheckpointFormatError:
    lines = "\n".join(f"  {p}" for p in problems)
    return _bad(directory, f"incomplete or damaged, refusing to load:\n{lines}")
