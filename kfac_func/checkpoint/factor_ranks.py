"""The ranks of a factor-directory save or load: which rank this process is, whether
a plan fits, and how the ranks agree (gathering every rank's report, so that a failure
on any rank makes every rank raise).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from kfac_func.checkpoint.errors import CheckpointError
from kfac_func.distributed.plan import Plan


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
