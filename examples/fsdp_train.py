"""The character-level transformer of ``transformer_lm.py`` under FSDP2, with K-FAC.

Every transformer block, and the model as a whole, is sharded with PyTorch's own
``torch.distributed.fsdp.fully_shard``: each rank holds a shard of every parameter and of
every gradient (DTensors). With ``--tp 2`` the ranks form a 2-D mesh (data-parallel x
tensor-parallel) and ``parallelize_module`` splits each block's MLP over the pairs of the
tensor-parallel dimension (``fc1`` column-parallel, ``fc2`` row-parallel), before FSDP2
shards everything over the data-parallel dimension. The same
:class:`kfac_func.KFACPreconditioner` as on one process preconditions the gradients: its
hooks gather tensor-parallel shards of the layers' inputs and output-gradients, its factors
are averaged over the ranks, and each layer's gradient shards are gathered onto the ranks
that precondition it (the KAISA ``--strategy``) and scattered back into the shards.

Launch with torchrun (gloo on CPU, NCCL when CUDA is available), or run it as a plain
script for one process:

    torchrun --nproc-per-node 2 examples/fsdp_train.py
    torchrun --nproc-per-node 4 examples/fsdp_train.py --tp 2 --strategy mem-opt
    python examples/fsdp_train.py --steps 20

Rank 0 prints the K-FAC plan, the training loss (averaged over the data-parallel ranks)
every ``--log-every`` steps and the K-FAC memory and bytes sent per rank at the end, and
writes the logged losses to ``OUT.csv`` and ``OUT.png`` and the command, the commit and
the machine to ``OUT.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import kfac_func as kf

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import OUT_HELP, save_curves, save_provenance
from transformer_lm import CharData, CharTransformer, lm_loss

STRATEGIES = {
    "comm-opt": kf.distributed.DistributedStrategy.COMM_OPT,
    "mem-opt": kf.distributed.DistributedStrategy.MEM_OPT,
    "hybrid-opt": kf.distributed.DistributedStrategy.HYBRID_OPT,
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200, help="training steps (default 200)")
    p.add_argument("--batch-size", type=int, default=32, help="windows per data-parallel rank")
    p.add_argument("--context", type=int, default=64, help="characters per window (default 64)")
    p.add_argument("--d-model", type=int, default=64, help="model width (default 64)")
    p.add_argument("--layers", type=int, default=2, help="transformer blocks (default 2)")
    p.add_argument("--heads", type=int, default=4, help="attention heads per block (default 4)")
    p.add_argument("--tp", type=int, default=1, choices=(1, 2), help="tensor-parallel ranks")
    p.add_argument(
        "--strategy",
        choices=sorted(STRATEGIES),
        default="comm-opt",
        help="KAISA strategy (default comm-opt: every rank preconditions every layer)",
    )
    p.add_argument(
        "--lr", type=float, default=0.05, help="SGD learning rate (momentum 0.9; default 0.05)"
    )
    p.add_argument("--damping", type=float, default=0.01, help="K-FAC damping (default 0.01)")
    p.add_argument(
        "--log-every", type=int, default=20, help="print the loss every N steps (default 20)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the batches")
    p.add_argument("--out", default="fsdp_train", help=f"{OUT_HELP}; rank 0 writes them")
    return p.parse_args(argv)


class ShardedLM(CharTransformer):
    """The LM example's model returning logits that are no view of another tensor: FSDP2
    warns about a root module's output view (an in-place op on it would skip its backward
    hook), and the head's output on ``(B, T, d)`` inputs is one."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return super().forward(idx).clone()


def init_process_group() -> tuple[int, int, torch.device]:
    """Join torchrun's process group (NCCL on GPUs, gloo on CPU); one process otherwise."""
    if "RANK" not in os.environ:  # a plain script: a group of one
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        return rank, world, torch.device("cuda", torch.cuda.current_device())
    return rank, world, torch.device("cpu")


def shard(model: CharTransformer, world: int, tp: int, device: torch.device) -> int:
    """Apply tensor parallelism (``tp`` > 1) and FSDP2 in place; returns the data-parallel
    coordinate of this rank (which part of the data it reads)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if world % tp:
        raise SystemExit(f"--tp {tp} does not divide {world} processes")
    mesh = init_device_mesh(device.type, (world // tp, tp), mesh_dim_names=("dp", "tp"))
    if tp > 1:
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        for block in model.blocks:
            parallelize_module(
                block, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
            )
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return int(mesh.get_coordinate()[0])  # type: ignore[index]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rank, world, device = init_process_group()
    torch.manual_seed(args.seed)
    data = CharData()
    model = ShardedLM(data.vocab, args.context, args.d_model, args.layers, args.heads)
    model = model.to(device)
    dp_rank = shard(model, world, args.tp, device)
    pre = kf.KFACPreconditioner(
        model,
        factor_update_steps=1,
        inv_update_steps=10,
        damping=args.damping,
        lr=args.lr,
        settings=kf.Settings(scaling="fisher"),  # the loss averages over every token
        skip_layers=["Embedding"],
        grad_worker_fraction=STRATEGIES[args.strategy],
    )
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    if rank == 0:
        print(pre.plan, flush=True)
    gen = torch.Generator().manual_seed(args.seed + 1000 * dp_rank)
    t0 = time.perf_counter()
    rows: list[dict[str, float]] = []
    for step in range(1, args.steps + 1):
        x, y = data.batch(args.batch_size, args.context, gen)
        x, y = x.to(device), y.to(device)
        opt.zero_grad()
        loss = lm_loss(model(x), y)
        loss.backward()
        pre.step()
        opt.step()
        if step % args.log_every == 0 or step == args.steps:
            avg = loss.detach().clone()
            dist.all_reduce(avg)
            seconds = time.perf_counter() - t0
            rows.append({"epoch": step, "train_loss": float(avg) / world, "seconds": seconds})
            if rank == 0:
                print(f"step {step:5d}  loss {float(avg) / world:.4f}  {seconds:.1f} s", flush=True)
    memory = pre.memory_usage()
    sent = pre.comm.sum_bytes() / args.steps
    if rank == 0:
        print(
            f"K-FAC memory on rank 0: {memory['total']} bytes; "
            f"sent per step and rank: {sent:.0f} bytes",
            flush=True,
        )
    if rank == 0:
        label = f"kfac {args.strategy}" + (f" tp{args.tp}" if args.tp > 1 else "")
        csv_path, png_path = save_curves(
            {label: rows}, args.out, title=f"FSDP2 on {world} ranks", xlabel="step"
        )
        json_path = save_provenance(csv_path, __file__, sys.argv[1:] if argv is None else argv)
        print(f"wrote {csv_path}, {png_path} and {json_path}", flush=True)
    pre.remove()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
