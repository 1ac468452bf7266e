"""Collective communication for a plan over torch.distributed (NCCL, gloo). No K-FAC math.

:class:`Communicator` creates the plan's process groups once and offers the two kinds of
traffic KAISA needs, both asynchronous:

- :class:`~kfac_func.distributed.reducer.OrderedReducer`: sums of tensors
  across ranks, issued in a fixed order of keys as they become ready, bucketed up to
  ``bucket_cap_mb`` (0: one collective per tensor), to every rank (all-reduce) or only to
  a destination rank per key (reduce), on a process group of its own; symmetric matrices
  can travel as their upper triangle (``symmetry_aware``);
- :meth:`Communicator.broadcast`: from one rank to a group of ranks.

Without an initialized process group (or with one rank) every operation is local.
Collectives (:attr:`Communicator.calls`) and bytes are counted per rank and per kind of
traffic, the bytes modelled on bandwidth-optimal ring
algorithms: of an all-reduce of ``S`` bytes over ``n`` ranks each rank sends
``2(n−1)S/n``, of a reduce or a broadcast ``(n−1)S/n``.
"""

from __future__ import annotations

import enum
import hashlib
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from kfac_func.distributed.plan import Plan

__all__ = ["AllreduceMethod", "Communicator", "Pending", "RankMismatchError"]

Group = Any  # dist.ProcessGroup | None (None: the default group)


def _pack(t: torch.Tensor, symmetric: bool) -> torch.Tensor:
    """Flatten; a symmetric matrix (last two dims) keeps only its upper triangle."""
    if not symmetric:
        return t.reshape(-1)
    n = t.shape[-1]
    iu = torch.triu_indices(n, n, device=t.device)
    return t[..., iu[0], iu[1]].reshape(-1)


def _unpack(flat: torch.Tensor, like: torch.Tensor, symmetric: bool) -> torch.Tensor:
    """A fresh tensor shaped like ``like``: never a view into a communication buffer,
    whose offset would change the memory alignment and with it the rounding of later
    BLAS calls (ranks must stay bit-identical)."""
    if not symmetric:
        return flat.reshape(like.shape).clone()
    n = like.shape[-1]
    iu = torch.triu_indices(n, n, device=flat.device)
    out = torch.empty(like.shape, dtype=flat.dtype, device=flat.device)
    vals = flat.reshape(*like.shape[:-2], -1)
    out[..., iu[0], iu[1]] = vals
    out[..., iu[1], iu[0]] = vals
    return out


class AllreduceMethod(enum.Enum):
    """How factor sums travel: ``ALLREDUCE`` issues one collective per tensor,
    ``ALLREDUCE_BUCKETED`` packs consecutive tensors into buckets of up to
    ``allreduce_bucket_cap_mb``.

    Example:
        >>> AllreduceMethod.for_bucket_cap(25.0), AllreduceMethod.for_bucket_cap(0)
        (<AllreduceMethod.ALLREDUCE_BUCKETED: 2>, <AllreduceMethod.ALLREDUCE: 1>)
    """

    ALLREDUCE = 1
    ALLREDUCE_BUCKETED = 2

    @classmethod
    def for_bucket_cap(cls, bucket_cap_mb: float) -> AllreduceMethod:
        """The method a bucket cap implies: bucketed when positive, one tensor each at 0."""
        return cls.ALLREDUCE_BUCKETED if bucket_cap_mb > 0 else cls.ALLREDUCE


class RankMismatchError(ValueError):
    """Ranks disagree on the plan or the settings that must be equal everywhere; raised
    on every rank, naming the first difference of each disagreeing rank."""


def _describe(value: object) -> str:
    """A rank-independent text for a setting (callables by name, not by address)."""
    if callable(value):
        name = getattr(value, "__qualname__", type(value).__qualname__)
        return f"<callable {getattr(value, '__module__', '?')}.{name}>"
    return repr(value)


@dataclass
class Pending:
    """Results of asynchronous collectives; :meth:`wait` returns them in order."""

    works: list[Any] = field(default_factory=list)
    finish: list[Any] = field(default_factory=list)

    def wait(self) -> list[torch.Tensor]:
        for w in self.works:
            w.wait()
        out: list[torch.Tensor] = []
        for f in self.finish:
            out.extend(f())
        return out


class Communicator:
    """Process groups of a :class:`Plan` and the collectives that execute it.

    All ranks must construct it at the same point with the same plan (``new_group`` is a
    collective). Groups are created here, once, never per step.

    Before creating any group, the ranks compare a hash of the plan's table and of
    ``settings`` (values that must agree, e.g. hyperparameters); if any rank differs,
    every rank raises :class:`RankMismatchError` naming the first differing line of each
    rank, instead of hanging later in mismatched collectives. ``timeout`` bounds every
    collective the communicator issues (groups of its own carry it); without it they
    inherit torch.distributed's default. A rank that dies makes the others' collectives
    fail (gloo and NCCL report the closed connection, or the timeout expires).

    Example:
        >>> from kfac_func.distributed.plan import make_plan
        >>> comm = Communicator(make_plan({"fc": (3, 2)}, world_size=1))
        >>> comm.rank, comm.world_size
        (0, 1)
        >>> comm.broadcast([torch.ones(2)], src=0, ranks=(0,), kind="demo").wait()
        [tensor([1., 1.])]
    """

    def __init__(
        self,
        plan: Plan,
        *,
        bucket_cap_mb: float = 25.0,
        symmetry_aware: bool = False,
        group: Group = None,
        settings: Mapping[str, object] | None = None,
        timeout: timedelta | None = None,
    ) -> None:
        if bucket_cap_mb < 0:
            raise ValueError(f"bucket_cap_mb must be >= 0, got {bucket_cap_mb}")
        self.active = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.active else 0
        self.world_size = dist.get_world_size() if self.active else 1
        if plan.world_size != self.world_size:
            raise ValueError(
                f"plan is for world_size={plan.world_size} but the process group has "
                f"{self.world_size} ranks (rank {self.rank})"
            )
        self.plan = plan
        self.bucket_cap_bytes = int(bucket_cap_mb * 1024 * 1024)
        self.symmetry_aware = symmetry_aware
        self.bytes: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()
        """Collectives issued so far, per kind of traffic (same keys as :attr:`bytes`)."""
        # the plan's groups and every rank's (the checkpoint's broadcasts under any plan)
        everyone = tuple(range(self.world_size))
        self._groups: dict[tuple[int, ...], Group] = {everyone: None}
        self._factor_group: Group = None
        self.timeout = timeout
        if self.active and self.world_size > 1:
            lines = [str(plan).splitlines()[0]]
            lines += [
                f"layer {lp.name!r}: A {lp.groups}x{lp.a_size}, G {lp.groups}x{lp.g_size}, "
                f"owners {lp.a_owner}/{lp.g_owner}, grad workers {lp.grad_workers}"
                for lp in plan.layers.values()
            ]
            lines += [f"{k} = {_describe(v)}" for k, v in sorted((settings or {}).items())]
            self._verify_agreement(lines)
            # factor reductions get a group of their own, so their order never interleaves
            # with other users of the default group (DDP's gradient buckets); with a
            # timeout, whole-world broadcasts use it too (the default group has its own)
            self._factor_group = dist.new_group(list(everyone), timeout=timeout)
            for ranks in (everyone, *plan.worker_groups, *plan.receiver_groups):
                if len(ranks) == self.world_size:
                    self._groups[ranks] = None if timeout is None else self._factor_group
                elif len(ranks) > 1 and ranks not in self._groups:
                    self._groups[ranks] = dist.new_group(list(ranks), timeout=timeout)

    def _device(self) -> torch.device:
        if dist.get_backend() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(out, t)
        return out

    def _verify_agreement(self, lines: list[str]) -> None:
        """Raise :class:`RankMismatchError` on every rank unless all ranks hold ``lines``.

        One all-gather of a 32-byte hash when ranks agree; otherwise the texts are
        exchanged (as bytes, nothing is unpickled) to name the differences.
        """
        dev = self._device()
        text = "\n".join(lines).encode()
        digest = torch.tensor(list(hashlib.sha256(text).digest()), dtype=torch.int64, device=dev)
        digests = self._all_gather(digest)
        if all(torch.equal(d, digests[0]) for d in digests):
            return
        n = torch.tensor([len(text)], dtype=torch.int64, device=dev)
        sizes = [int(s) for s in self._all_gather(n)]
        buf = torch.zeros(max(sizes), dtype=torch.uint8, device=dev)
        buf[: len(text)] = torch.tensor(list(text), dtype=torch.uint8)
        texts = [
            bytes(b[:size].cpu().tolist()).decode(errors="replace").splitlines()
            for b, size in zip(self._all_gather(buf), sizes)
        ]
        report = []
        for r, other in enumerate(texts):
            if other == texts[0]:
                continue
            i = next(
                (i for i, (x, y) in enumerate(zip(texts[0], other)) if x != y),
                min(len(texts[0]), len(other)),
            )
            mine = texts[0][i] if i < len(texts[0]) else "<nothing>"
            theirs = other[i] if i < len(other) else "<nothing>"
            report.append(f"  rank {r}: {theirs!r}\n  rank 0: {mine!r}")
        raise RankMismatchError(
            f"ranks disagree on the K-FAC plan or settings (seen from rank {self.rank}); "
            "first difference per rank:\n" + "\n".join(report)
        )

    @staticmethod
    def current_world_size() -> int:
        """World size of the default process group, 1 when none is initialized."""
        if dist.is_available() and dist.is_initialized():
            return dist.get_world_size()
        return 1

    @property
    def world_group(self) -> Group:
        """The group of every rank that K-FAC's world-wide collectives use (its own group,
        created once; None without a process group)."""
        return self._factor_group

    def group(self, ranks: tuple[int, ...]) -> Group:
        """The process group of ``ranks`` (one of the plan's groups, or every rank: the
        checkpoint's broadcasts under any plan)."""
        return self._groups[tuple(ranks)]

    # --- reductions ----------------------------------------------------------------

    def launch_reduce(
        self,
        idx: list[int],
        tensors: Sequence[torch.Tensor],
        sym: list[bool],
        targets: list[int | None],
        kind: str,
        pending: Pending,
        results: dict[int, torch.Tensor],
    ) -> None:
        """Launch one bucket: the sum over ranks of ``tensors[i]`` for ``i`` in ``idx``
        (packed as upper triangles where ``sym[i]``), to every rank or to
        ``targets[idx[0]]``; ``results[i]`` is filled once ``pending`` is waited on."""
        flats = [_pack(tensors[i], sym[i]) for i in idx]
        buf = torch.cat(flats) if len(flats) > 1 else flats[0].clone()
        dst = targets[idx[0]]
        n = self.world_size
        nbytes = buf.numel() * buf.element_size()
        if dst is None:
            work = dist.all_reduce(
                buf, op=dist.ReduceOp.SUM, group=self._factor_group, async_op=True
            )
            self.bytes[f"{kind} (all-reduce)"] += 2 * (n - 1) * nbytes // n
            self.calls[f"{kind} (all-reduce)"] += 1
        else:
            work = dist.reduce(
                buf, dst=dst, op=dist.ReduceOp.SUM, group=self._factor_group, async_op=True
            )
            self.bytes[f"{kind} (reduce)"] += (n - 1) * nbytes // n
            self.calls[f"{kind} (reduce)"] += 1
        pending.works.append(work)

        def finish() -> list[torch.Tensor]:
            if dst is not None and dst != self.rank:
                for i in idx:
                    results[i] = tensors[i]
                return []
            offset = 0
            for i, flat in zip(idx, flats):
                part = buf[offset : offset + flat.numel()]
                offset += flat.numel()
                results[i] = _unpack(part, tensors[i], sym[i])
            return []

        pending.finish.append(finish)

    # --- broadcasts ----------------------------------------------------------------

    def broadcast(
        self,
        tensors: Sequence[torch.Tensor],
        *,
        src: int,
        ranks: tuple[int, ...],
        kind: str,
        symmetric: Sequence[bool] | None = None,
    ) -> Pending:
        """Send ``tensors`` from ``src`` to the ``ranks`` group (which must hold ``src``).

        Only members of ``ranks`` may call it; on ``src`` the tensors are returned as
        they are (when they are contiguous, the layout the others receive), elsewhere
        they are buffers of the right shape and dtype that the result replaces (inputs
        are never modified).
        """
        if src not in ranks:
            raise ValueError(f"broadcast source rank {src} is not in group {ranks}")
        if self.rank not in ranks:
            raise ValueError(f"rank {self.rank} is not in broadcast group {ranks}")
        if not self.active or len(ranks) == 1:
            return Pending(finish=[lambda: list(tensors)])
        sym = [bool(s) and self.symmetry_aware for s in (symmetric or [False] * len(tensors))]
        flats = [_pack(t, s) for t, s in zip(tensors, sym)]
        dtypes = {t.dtype for t in flats}
        if len(dtypes) != 1:
            raise ValueError(f"broadcast of mixed dtypes {sorted(map(str, dtypes))}")
        buf = torch.cat(flats) if len(flats) > 1 else flats[0].clone()
        work = dist.broadcast(buf, src=src, group=self.group(ranks), async_op=True)
        n = len(ranks)
        self.bytes[f"{kind} (broadcast)"] += (n - 1) * buf.numel() * buf.element_size() // n
        self.calls[f"{kind} (broadcast)"] += 1

        def finish() -> list[torch.Tensor]:
            if self.rank == src and not any(sym) and all(t.is_contiguous() for t in tensors):
                return list(tensors)
            # receivers (and a source that packed triangles, or sent a tensor of another
            # layout, as eigh's column-major eigenvectors) read the sent values back, so
            # every rank of the group holds bit-identical tensors, laid out alike (so that
            # their products round alike)
            out, offset = [], 0
            for t, flat, s in zip(tensors, flats, sym):
                out.append(_unpack(buf[offset : offset + flat.numel()], t, s))
                offset += flat.numel()
            return out

        return Pending([work], [finish])

    def sum_bytes(self) -> int:
        """Bytes this rank sent so far (model: see the module docstring)."""
        return sum(self.bytes.values())
