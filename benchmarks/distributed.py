"""Step time and traffic of ``kf.distributed.update_distributed`` on 1, 2 and 4 gloo ranks.

Run ``python benchmarks/distributed.py`` (about a minute on a 2-core CPU) or ``--quick``
(a narrow MLP and three repetitions, under 30 s: a smoke test, not a measurement).

What is measured
----------------
For each world size (1, 2, 4; one ``torch.multiprocessing`` spawn each, one after the
other, gloo over a file store, one intra-op thread per rank) and each KAISA strategy
(``COMM_OPT``; ``HYBRID_OPT`` where the world has an even number of ranks above 2;
``MEM_OPT``), with ``compute_method="eigen"`` and the eigenvalue outer product:

- the median wall time of one ``kf.distributed.update_distributed`` call, excluding ``kf.capture``
  (every rank's captures and gradients are computed once, before the spawn, by the
  parent, and the gradients are averaged over ranks as DDP does, outside the clock); all
  ranks enter each timed call together (a barrier) and a call counts as long as its
  slowest rank;
- the bytes each rank sends per step, from the communicator's counters
  (``Communicator.bytes``, a ring model: an all-reduce of ``S`` bytes over ``n`` ranks
  sends ``2(n-1)S/n`` per rank, a reduce or broadcast ``(n-1)S/n``), split into factors
  (including the tiny all-reduce of the micro-batch weights), decompositions and
  preconditioned gradients;
- the ratio of the step time to the 1-rank step time of the same intervals.

Intervals ``F/I`` (factor update every ``F`` steps, decomposition every ``I``): ``1/1``
(every step updates both) and the amortized ``10/100`` (1 % of steps update both, 9 %
only the factors, 90 % only precondition). Each kind of step is timed separately and the
amortized time and bytes are the per-kind medians weighted by how often each kind occurs;
the kinds are interleaved (order reversed on every other repetition) so that machine
noise hits them alike.

``--start-method forkserver`` starts ranks by forking a server that imported torch once,
instead of a fresh interpreter per rank (``spawn``, the default): start-up drops from
seconds per rank to a fraction of a second; the measurements are the same.

Ranks share the machine's cores: with 4 ranks on 2 cores the CPU is oversubscribed and
step times grow for that reason alone. The bytes are the portable number.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import os
import platform
import statistics
import sys
import tempfile
import time
from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn import functional as F

try:
    import kfac_func as kf
except ImportError:  # a checkout without `pip install -e .`: use the repository's copy
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import kfac_func as kf

from kfac_func.distributed.plan import DistributedStrategy, resolve_grad_workers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_time import (
    KIND_NAMES,
    Kind,
    kind_weights,
    parse_intervals,
)

TRAFFIC = ("factors", "decompositions", "gradients")
HYPER: dict[str, Any] = dict(damping=1e-3, factor_decay=0.95, kl_clip=1e-3, lr=0.1)


# --------------------------------------------------------------------------- setup


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Step time and bytes per rank of kf.distributed.update_distributed on 1, 2 "
        "and 4 gloo ranks (COMM_OPT, HYBRID_OPT, MEM_OPT; eigen).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--quick", action="store_true", help="narrow MLP, 3 reps: a smoke test")
    p.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4], help="world sizes")
    p.add_argument(
        "--widths",
        type=int,
        nargs="+",
        default=[512, 512, 256, 256],
        help="MLP input and hidden widths: Linear layers between consecutive "
        "widths, then a Linear head to --classes",
    )
    p.add_argument("--classes", type=int, default=10, help="outputs of the MLP head")
    p.add_argument("--batch", type=int, default=64, help="local batch per rank")
    p.add_argument("--reps", type=int, default=9, help="timed steps of each kind")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps of each kind")
    p.add_argument(
        "--intervals",
        type=parse_intervals,
        nargs="+",
        default=[(1, 1), (10, 100)],
        help="F/I: factor/decomposition intervals",
    )
    p.add_argument(
        "--bucket-cap-mb", type=float, default=25.0, help="Communicator bucket cap (0: no buckets)"
    )
    p.add_argument(
        "--symmetry-aware", action="store_true", help="send symmetric factors as upper triangles"
    )
    p.add_argument(
        "--start-method",
        choices=["spawn", "forkserver"],
        default="spawn",
        help="how ranks start: spawn (each rank imports torch, seconds per rank) or "
        "forkserver (one server imports torch and kfac_func once, ranks fork from it)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the model and the batches")
    args = p.parse_args(argv)
    if args.quick:
        args.widths, args.reps, args.warmup = [64, 64, 32], 3, 1
    if any(w < 1 for w in args.worlds):
        p.error("world sizes must be positive")
    return args


def make_mlp(widths: list[int], classes: int) -> nn.Module:
    mods: list[nn.Module] = []
    for a, b in itertools.pairwise(widths):
        mods += [nn.Linear(a, b), nn.ReLU()]
    mods.append(nn.Linear(widths[-1], classes))
    return nn.Sequential(*mods)


def strategies(world: int) -> list[DistributedStrategy]:
    """Strategies that are distinct on ``world`` ranks (1 rank: all are local)."""
    out = [DistributedStrategy.COMM_OPT]
    if world == 1:
        return out
    if world > 2 and world % 2 == 0:
        out.append(DistributedStrategy.HYBRID_OPT)
    return [*out, DistributedStrategy.MEM_OPT]


def make_data(args: argparse.Namespace, world: int) -> dict[str, Any]:
    """Every rank's gradients and captures of one local batch (the model is fixed)."""
    torch.manual_seed(args.seed)
    model = make_mlp(args.widths, args.classes)
    layers = kf.register(model)
    params = dict(model.named_parameters())
    grads, caps = [], []
    for _ in range(world):
        x = torch.randn(args.batch, args.widths[0])
        y = torch.randint(0, args.classes, (args.batch,))
        _, g, c = kf.capture(
            model, params, x, lambda out, y=y: F.cross_entropy(out, y), layers=layers
        )
        grads.append(g)
        caps.append(c)
    return {"grads": grads, "captures": caps}


# --------------------------------------------------------------------------- one rank


def ddp_average(grads: dict[str, torch.Tensor], world: int) -> dict[str, torch.Tensor]:
    names = sorted(grads)
    flat = torch.cat([grads[k].reshape(-1) for k in names])
    dist.all_reduce(flat)
    flat /= world
    out, offset = {}, 0
    for k in names:
        out[k] = flat[offset : offset + grads[k].numel()].reshape(grads[k].shape).clone()
        offset += grads[k].numel()
    return out


def traffic(counts: Counter[str]) -> list[float]:
    """Bytes by kind of traffic, in the order of TRAFFIC (weights count as factors)."""
    out = [0.0] * len(TRAFFIC)
    for key, n in counts.items():
        kind = "factors" if key.startswith("weights") else key.split(" ")[0]
        out[TRAFFIC.index(kind)] += n
    return out


def bench_strategy(
    args: argparse.Namespace,
    layers: kf.LayerTable,
    grads: dict[str, torch.Tensor],
    caps: kf.Captures,
    world: int,
    fraction: DistributedStrategy,
    kinds: list[Kind],
) -> dict[str, Any]:
    plan = kf.distributed.make_plan(
        layers,
        world,
        grad_worker_fraction=fraction,
        compute_method="eigen",
        compute_eigenvalue_outer_product=True,
    )
    comm = kf.distributed.Communicator(
        plan, bucket_cap_mb=args.bucket_cap_mb, symmetry_aware=args.symmetry_aware
    )
    state = kf.init(layers, compute_method="eigen", compute_eigenvalue_outer_product=True)

    def step(kind: Kind) -> tuple[float, list[float]]:
        nonlocal state
        before = Counter(comm.bytes)
        dist.barrier()
        t0 = time.perf_counter()
        _, state = kf.distributed.update_distributed(
            state,
            grads,
            captures=caps,
            plan=plan,
            comm=comm,
            update_factors=kind[0],
            update_inverses=kind[1],
            **HYPER,
        )
        elapsed = time.perf_counter() - t0
        return elapsed, traffic(comm.bytes - before)

    for _ in range(args.warmup):
        for kind in kinds:
            step(kind)
    times: dict[Kind, list[float]] = {k: [] for k in kinds}
    sent: dict[Kind, list[float]] = {}
    for rep in range(args.reps):
        for kind in kinds if rep % 2 == 0 else kinds[::-1]:
            elapsed, sent[kind] = step(kind)  # bytes are the same on every step of a kind
            times[kind].append(elapsed)
    # a step lasts as long as its slowest rank; bytes: mean over ranks
    t = torch.tensor([times[k] for k in kinds], dtype=torch.float64)
    b = torch.tensor([sent[k] for k in kinds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    dist.all_reduce(b)
    return {
        "strategy": plan.strategy.name,
        "ms": {KIND_NAMES[k]: 1e3 * statistics.median(t[i].tolist()) for i, k in enumerate(kinds)},
        "bytes": {KIND_NAMES[k]: (b[i] / world).tolist() for i, k in enumerate(kinds)},
    }


def rank_main(rank: int, world: int, tmp: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{tmp}/store",
        rank=rank,
        world_size=world,
        timeout=timedelta(minutes=10),
    )
    try:
        data = torch.load(Path(tmp, "data.pt"), weights_only=False)
        layers = kf.register(make_mlp(args.widths, args.classes))
        grads = ddp_average(data["grads"][rank], world)
        kinds = sorted({k for iv in args.intervals for k in kind_weights(iv)}, reverse=True)
        rows = [
            bench_strategy(args, layers, grads, data["captures"][rank], world, s, kinds)
            for s in strategies(world)
        ]
        if rank == 0:
            Path(tmp, "rows.json").write_text(json.dumps(rows))
    finally:
        dist.destroy_process_group()


def run_world(args: argparse.Namespace, world: int) -> tuple[list[dict[str, Any]], float]:
    with tempfile.TemporaryDirectory() as tmp:
        torch.save(make_data(args, world), Path(tmp, "data.pt"))
        t0 = time.perf_counter()
        mp.start_processes(
            rank_main,
            args=(world, tmp, args),
            nprocs=world,
            join=True,
            start_method=args.start_method,
        )
        wall = time.perf_counter() - t0
        return json.loads(Path(tmp, "rows.json").read_text()), wall


# --------------------------------------------------------------------------- report


def amortized(row: dict[str, Any], weights: dict[Kind, float]) -> tuple[float, list[float]]:
    """Step time (ms) and bytes by kind of traffic, weighted by the share of each kind."""
    ms = sum(w * row["ms"][KIND_NAMES[k]] for k, w in weights.items())
    sent = [
        sum(w * row["bytes"][KIND_NAMES[k]][j] for k, w in weights.items())
        for j in range(len(TRAFFIC))
    ]
    return ms, sent


def table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [headers, *rows]) for i in range(len(headers))]
    lines = [
        "  ".join(
            h.rjust(w) if i > 2 else h.ljust(w) for i, (h, w) in enumerate(zip(headers, widths))
        )
    ]
    lines.append("  ".join("-" * w for w in widths))
    for r in rows:
        lines.append(
            "  ".join(
                c.rjust(w) if i > 2 else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))
            )
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for world in args.worlds:
        for s in strategies(world):
            resolve_grad_workers(s, world)  # fail early on an impossible world size
    model = make_mlp(args.widths, args.classes)
    shapes = ", ".join(
        f"{m.in_features}->{m.out_features}" for m in model if isinstance(m, nn.Linear)
    )
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(
        "kfac_func distributed benchmark: kf.distributed.update_distributed over gloo "
        "(KAISA strategies)"
    )
    print(
        f"torch {torch.__version__} | kfac_func {kf.__version__} | python "
        f"{platform.python_version()} | {platform.machine()} | 1 thread per rank | "
        f"{affinity} cores available to all ranks together"
    )
    if args.quick:
        print("QUICK MODE: narrow MLP and 3 repetitions; a smoke test, not a measurement")
    print(
        f"model: MLP Linear {shapes} (ReLU between), float32; local batch {args.batch} per rank; "
        f"eigen with eigenvalue outer product; bucket cap {args.bucket_cap_mb:g} MB; "
        f"symmetry_aware={args.symmetry_aware}; ranks started by {args.start_method}"
    )
    print(
        f"step time: median of {args.reps} kf.distributed.update_distributed calls of each kind "
        f"(slowest rank, capture excluded) after {args.warmup} warm-up calls; amortized over the "
        "intervals F/I by kind frequency"
    )
    print(
        f"NOTE: all ranks share the same {affinity} cores, so with more ranks than cores the "
        "CPU is oversubscribed and step times grow for that reason alone; the bytes are the "
        "portable number (per rank per step, ring model of Communicator.bytes)."
    )
    print(flush=True)

    if args.start_method == "forkserver":
        multiprocessing.set_forkserver_preload(["torch", "torch.distributed", "kfac_func"])
    results: dict[int, list[dict[str, Any]]] = {}
    for world in args.worlds:
        rows, wall = run_world(args, world)
        results[world] = rows
        print(f"world {world}: spawned and measured in {wall:.1f} s", flush=True)

    headers = [
        "world",
        "strategy",
        "F/I",
        "step ms",
        "ratio",
        "factors KiB",
        "decomp KiB",
        "grads KiB",
        "total KiB",
    ]
    out: list[list[str]] = []
    for iv in args.intervals:
        weights = kind_weights(iv)

        base = amortized(results[1][0], weights)[0] if 1 in results else float("nan")
        for world, rows in results.items():
            for row in rows:
                ms, sent = amortized(row, weights)
                out.append(
                    [
                        str(world),
                        row["strategy"],
                        f"{iv[0]}/{iv[1]}",
                        f"{ms:.1f}",
                        f"{ms / base:.2f}",
                        *(f"{v / 1024:.1f}" for v in sent),
                        f"{sum(sent) / 1024:.1f}",
                    ]
                )
    print()
    print(table(headers, out))
    print("ratio: step time / 1-rank step time with the same intervals")
    return 0


if __name__ == "__main__":
    sys.exit(main())
