"""Data-parallel training with DistributedDataParallel and K-FAC (KAISA strategies).

A small CNN classifies scikit-learn's handwritten digits (1,797 8x8 images that ship with
scikit-learn; 80 % train, 20 % test), once with SGD with momentum and once with SGD on
gradients preconditioned by :class:`kfac_func.KFACPreconditioner` for each strategy given
to ``--strategy`` (one, or several separated by commas). Every run starts from the same
weights. Each rank reads its share of every epoch through a ``DistributedSampler``;
DDP averages the gradients, and the preconditioner spreads its work over the ranks with
the KAISA strategy picked by ``--strategy``:

- ``comm-opt`` (``grad_worker_fraction=1``): every rank preconditions every layer; the
  decompositions are broadcast,
- ``mem-opt`` (``1/world``): each layer's factors live on one rank, which preconditions
  its gradient and broadcasts it,
- ``hybrid-opt`` (``0.5``): groups of half the ranks (on 2 ranks this is ``mem-opt``).

The learning rates (SGD 0.1; 0.05 under K-FAC, with ``scaling="fisher"`` and damping 0.1)
come from a short sweep on one process. On 2 ranks ``comm-opt`` and ``mem-opt`` train the
same numbers: they distribute the same computation differently.

Launch with torchrun (gloo on CPU, NCCL when CUDA is available), or run it as a plain
script for a single process:

    torchrun --nproc-per-node 2 examples/ddp_train.py --strategy mem-opt
    torchrun --nproc-per-node 2 examples/ddp_train.py --strategy comm-opt,mem-opt
    python examples/ddp_train.py

Rank 0 shows the progress bar, prints the per-epoch table (training loss averaged over
all ranks, test loss and accuracy evaluated on all ranks' shares of the test set) and
writes ``OUT.csv`` and ``OUT.png`` with the curves and ``OUT.json`` with the command, the
commit and the machine.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from kfac_func import KFACPreconditioner, Settings

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    OUT_HELP,
    HelpFormatter,
    ImageData,
    format_table,
    load_images,
    progress,
    save_curves,
    save_provenance,
)

OPTIMIZERS = ("sgd", "kfac")
STRATEGIES = ("comm-opt", "mem-opt", "hybrid-opt")
HEADER = "      optimizer  epoch  train_loss  test_loss  test_accuracy  seconds"
ROW = (
    "{0:>15}  {epoch:5d}  {train_loss:10.4f}  {test_loss:9.4f}  {test_accuracy:13.4f}"
    "  {seconds:7.2f}"
)


def grad_worker_fraction(strategy: str, world_size: int) -> float:
    """The ``grad_worker_fraction`` of a ``--strategy`` name at ``world_size`` ranks."""
    fractions = {"comm-opt": 1.0, "mem-opt": 1.0 / world_size, "hybrid-opt": 0.5}
    return fractions[strategy]


def make_model(classes: int) -> nn.Module:
    """Two 3x3 convolutions and two linear layers for 1x8x8 images."""
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 4 * 4, 64),
        nn.ReLU(),
        nn.Linear(64, classes),
    )


def init_distributed() -> tuple[int, int, torch.device]:
    """``(rank, world_size, device)``: a process group when launched by torchrun (NCCL on
    CUDA, else gloo), otherwise a single process without one."""
    cuda = torch.cuda.is_available()
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return 0, 1, torch.device("cuda" if cuda else "cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if cuda:
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size(), device


def all_sum(values: list[float], device: torch.device, world_size: int) -> list[float]:
    """Element-wise sum of ``values`` over the ranks."""
    if world_size == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


@torch.no_grad()
def evaluate(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, rank: int, world_size: int
) -> tuple[float, float]:
    """Test loss and accuracy: each rank evaluates every ``world_size``-th example."""
    model.eval()
    xs, ys = x[rank::world_size], y[rank::world_size]
    out = model(xs)
    sums = [float(F.cross_entropy(out, ys, reduction="sum")), float((out.argmax(-1) == ys).sum())]
    model.train()
    loss, correct = all_sum(sums, x.device, world_size)
    return loss / len(y), correct / len(y)


def run_name(name: str, strategy: str) -> str:
    """How a run is called in the table, the CSV and the plot."""
    return f"kfac {strategy}" if name == "kfac" else name


def train(
    name: str,
    strategy: str,
    args: argparse.Namespace,
    data: ImageData,
    rank: int,
    world_size: int,
    device: torch.device,
) -> list[dict[str, float]]:
    """Train one model with optimizer ``name`` (K-FAC with KAISA ``strategy``); one row of
    metrics per epoch (every rank gets the same rows)."""
    run = run_name(name, strategy)
    torch.manual_seed(args.seed)  # the same initial weights on every rank and for both runs
    net = make_model(data.classes).to(device)
    model: nn.Module = net
    if world_size > 1:
        model = DistributedDataParallel(net, device_ids=[device] if device.type == "cuda" else None)
    lr = args.kfac_lr if name == "kfac" else args.lr
    optimizer = torch.optim.SGD(
        model.parameters(), lr=lr, momentum=args.momentum, weight_decay=args.weight_decay
    )
    preconditioner = None
    if name == "kfac":
        preconditioner = KFACPreconditioner(
            model,
            factor_update_steps=args.factor_update_steps,
            inv_update_steps=args.inv_update_steps,
            damping=args.damping,
            kl_clip=args.kl_clip if args.kl_clip > 0 else None,
            lr=lambda step: optimizer.param_groups[0]["lr"],
            grad_worker_fraction=grad_worker_fraction(strategy, world_size),
            settings=Settings(scaling=args.scaling),
        )
        if rank == 0:
            print(preconditioner.plan)
    if rank == 0:
        print(HEADER)
    steps_per_epoch = math.ceil(len(data.y_train) / args.batch_size)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(
        optimizer, T_max=args.epochs * steps_per_epoch, eta_min=0.1 * lr
    )

    train_set = TensorDataset(data.x_train, data.y_train)
    sampler = DistributedSampler(
        train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed
    )
    loader = DataLoader(train_set, batch_size=args.batch_size // world_size, sampler=sampler)
    x_test, y_test = data.x_test.to(device), data.y_test.to(device)

    rows: list[dict[str, float]] = []
    elapsed = 0.0
    for epoch in range(1, args.epochs + 1):
        sampler.set_epoch(epoch)
        start = time.perf_counter()
        total, count = 0.0, 0
        # a bar on rank 0 only: the other ranks create none (a tqdm bar draws when created)
        batches = (
            progress(loader, total=len(loader), desc=f"{run} epoch {epoch}")
            if rank == 0
            else loader
        )
        for x, y in batches:
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            if preconditioner is not None:
                preconditioner.step()
            optimizer.step()
            scheduler.step()
            total += loss.item() * len(y)
            count += len(y)
        elapsed += time.perf_counter() - start
        total, count = all_sum([total, float(count)], device, world_size)
        test_loss, test_accuracy = evaluate(net, x_test, y_test, rank, world_size)
        row = {
            "epoch": epoch,
            "train_loss": total / count,
            "test_loss": test_loss,
            "test_accuracy": test_accuracy,
            "seconds": elapsed,
        }
        rows.append(row)
        if rank == 0:
            print(ROW.format(run, **row), flush=True)
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=HelpFormatter,
    )
    add = parser.add_argument
    add("--optimizers", default=",".join(OPTIMIZERS), help=f"comma-separated, from {OPTIMIZERS}")
    add(
        "--strategy",
        default="comm-opt",
        help=f"KAISA strategy of K-FAC, one of {STRATEGIES} (grad_worker_fraction 1, "
        "1/world, 0.5), or several separated by commas to train K-FAC once with each",
    )
    add("--epochs", type=int, default=10, help="epochs of each run (the cosine schedule spans all)")
    add("--batch-size", type=int, default=64, help="global batch, split over the ranks")
    add("--samples", type=int, default=None, help="use only this many train/test images")
    add("--lr", type=float, default=0.1, help="SGD learning rate")
    add("--kfac-lr", type=float, default=0.05, help="learning rate of SGD under K-FAC")
    add("--momentum", type=float, default=0.9, help="SGD momentum (both runs)")
    add("--weight-decay", type=float, default=5e-4, help="SGD weight decay (both runs)")
    add("--damping", type=float, default=0.1, help="K-FAC damping, relative to --scaling")
    add("--kl-clip", type=float, default=0.001, help="0 disables the KL clip")
    add("--factor-update-steps", type=int, default=1, help="update K-FAC's factors every N steps")
    add("--inv-update-steps", type=int, default=10, help="decompose the factors every N steps")
    add(
        "--scaling",
        default="fisher",
        choices=("kfac-pytorch", "fisher"),
        help="factor convention of the preconditioner (damping is relative to it)",
    )
    add("--threads", type=int, default=1, help="CPU threads per process (0: PyTorch's default)")
    add("--seed", type=int, default=0, help="seed of the initial weights and the batch order")
    add("--out", default="ddp_train", help=f"{OUT_HELP}; rank 0 writes them")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.optimizers.split(",") if n.strip()]
    unknown = sorted(set(names) - set(OPTIMIZERS))
    if unknown or not names:
        parser.error(f"--optimizers: unknown {unknown}; choose from {OPTIMIZERS}")
    args.optimizers = names
    args.strategies = [s.strip() for s in args.strategy.split(",") if s.strip()]
    bad = sorted(set(args.strategies) - set(STRATEGIES))
    if bad or not args.strategies:
        parser.error(f"--strategy: unknown {bad}; choose from {STRATEGIES}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    rank, world_size, device = init_distributed()
    if args.batch_size % world_size:
        raise SystemExit(f"--batch-size {args.batch_size} is not divisible by {world_size} ranks")
    data = load_images("digits", samples=args.samples)
    if rank == 0:
        backend = dist.get_backend() if world_size > 1 else "none"
        print(
            f"{data.describe()}; {world_size} rank(s) (backend {backend}, {device}), "
            f"global batch {args.batch_size}"
        )
    results = {}
    for name in args.optimizers:
        for strategy in args.strategies if name == "kfac" else [""]:
            rows = train(name, strategy, args, data, rank, world_size, device)
            results[run_name(name, strategy)] = rows
    if rank == 0:
        columns = ["optimizer", "epoch", "train_loss", "test_loss", "test_accuracy", "seconds"]
        table = [{"optimizer": n, **rows[-1]} for n, rows in results.items()]
        print("\nfinal epoch\n" + format_table(table, columns))
        title = f"digits, DDP on {world_size} rank(s)"
        csv_path, png_path = save_curves(results, args.out, title=title)
        json_path = save_provenance(csv_path, __file__, sys.argv[1:] if argv is None else argv)
        print(f"wrote {csv_path}, {png_path} and {json_path}")
    if world_size > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
