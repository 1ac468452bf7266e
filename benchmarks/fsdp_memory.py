"""K-FAC's memory per rank and bytes sent per step: FSDP2 next to DDP, on 1/2/4 gloo ranks.

For each world size and KAISA strategy, the same float32 MLP (four 256-wide Linear layers)
trains a few steps once under DistributedDataParallel and once sharded with FSDP2
(``fully_shard`` per layer and at the root), with the same :class:`kfac_func.KFACPreconditioner`
settings. Printed per run: the bytes of K-FAC state on each rank (factors and
decompositions, :meth:`~kfac_func.KFACPreconditioner.memory_usage`) and the bytes each
rank sent per step in K-FAC's own collectives (the communicator's count; the gradient
all-reduce of DDP and the reduce-scatter of FSDP2 are not K-FAC's and not counted).
Every number is a byte count, the same on every run of the same code (no timing).

    python benchmarks/fsdp_memory.py                                       # benchmarks/out/
    python benchmarks/fsdp_memory.py --out benchmarks/results/fsdp_memory.json

Writes ``--out`` (default ``benchmarks/out/fsdp_memory.json``, a folder git ignores; the
committed results in ``benchmarks/results/`` are refreshed only when named): the command,
the commit, whether tracked files differed from it, the machine, the settings and one row
per world size, strategy, run and rank.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

import kfac_func as kf

WIDTH, DEPTH, BATCH, STEPS = 256, 4, 32, 3
ROOT = Path(__file__).resolve().parents[1]
COLUMNS = (
    "world",
    "strategy",
    "run",
    "rank",
    "factors_bytes",
    "decompositions_bytes",
    "sent_bytes_per_step",
    "plan",
)


def model() -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(DEPTH):
        layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    return nn.Sequential(*layers)


def run(rank: int, world: int, store: str, queue: mp.Queue) -> None:  # type: ignore[type-arg]
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    for strategy in ("COMM_OPT", "HYBRID_OPT", "MEM_OPT"):
        for kind in ("ddp", "fsdp"):
            m = model()
            if kind == "ddp":
                net: nn.Module = DistributedDataParallel(m)
            else:
                for i in range(0, 2 * DEPTH, 2):
                    fully_shard(m[i], mesh=mesh)
                net = fully_shard(m, mesh=mesh)
            pre = kf.KFACPreconditioner(
                net,
                grad_worker_fraction=kf.distributed.DistributedStrategy[strategy],
                inv_update_steps=1,
            )
            g = torch.Generator().manual_seed(rank)
            for _ in range(STEPS):
                x = torch.randn(BATCH, WIDTH, generator=g)
                F.mse_loss(net(x), torch.zeros_like(x)).backward()
                pre.step()
                net.zero_grad()
            usage = pre.memory_usage()
            queue.put(
                (world, strategy, kind, rank, usage["a_factors"] + usage["g_factors"],
                 usage["decompositions"], pre.comm.sum_bytes() / STEPS, pre.plan.strategy.name)
            )  # fmt: skip
            pre.remove()
    dist.destroy_process_group()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--out",
        default=str(ROOT / "benchmarks" / "out" / "fsdp_memory.json"),
        help="the JSON written (default: benchmarks/out/fsdp_memory.json, untracked; pass "
        "benchmarks/results/fsdp_memory.json to refresh the committed results)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from step_time import cpu_model, git_commit

    provenance = git_commit()  # when the run starts
    ctx = mp.get_context("spawn")
    rows = []
    for world in (1, 2, 4):
        queue = ctx.Queue()
        with tempfile.TemporaryDirectory() as tmp:
            procs = [
                ctx.Process(target=run, args=(r, world, os.path.join(tmp, "s"), queue))
                for r in range(world)
            ]
            for p in procs:
                p.start()
            got = [queue.get() for _ in range(world * 6)]
            for p in procs:
                p.join()
        rows += sorted(got)
    print(f"MLP {DEPTH} x Linear({WIDTH}, {WIDTH}), float32; K-FAC bytes per rank")
    print("world  strategy    plan        run   rank  factors   decomps   sent/step")
    for world, strategy, kind, rank, factors, decs, sent, plan in rows:
        print(
            f"{world:5d}  {strategy:10}  {plan:10}  {kind:4}  {rank:4d}  {factors:8d}  "
            f"{decs:8d}  {sent:10.0f}"
        )
    result = {
        "command": " ".join(["python", "benchmarks/fsdp_memory.py", *(argv or sys.argv[1:])]),
        **provenance,
        "machine": {
            "cpu": cpu_model(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "kfac_func": kf.__version__,
        },
        "settings": {"width": WIDTH, "depth": DEPTH, "batch": BATCH, "steps": STEPS},
        "columns": list(COLUMNS),
        "rows": [
            dict(zip(COLUMNS, (world, strategy, kind, rank, factors, decs, sent, plan)))
            for world, strategy, kind, rank, factors, decs, sent, plan in rows
        ],
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
