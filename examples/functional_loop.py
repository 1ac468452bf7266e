"""K-FAC in a custom training loop with the pure functional API.

A small MLP learns a random teacher network's classes (data generated here, nothing is
downloaded). The same model, initialisation and batches are trained with plain SGD and
with SGD on K-FAC-preconditioned gradients. Each run prints a line per epoch (a progress
bar over the batches when stderr is a terminal); the script then prints both losses per
epoch in one table and writes them to ``OUT.csv`` and ``OUT.png``, and the command, the
commit and the machine to ``OUT.json`` (``--out``).

    python examples/functional_loop.py --epochs 5
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F
from common import OUT_HELP, HelpFormatter, format_table, progress, save_curves, save_provenance
from torch import nn

import kfac_func as kf


def make_data(n: int, dim: int, classes: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    teacher = torch.randn(dim, 32, generator=g), torch.randn(32, classes, generator=g)
    y = (torch.tanh(x @ teacher[0]) @ teacher[1]).argmax(-1)
    return x, y


def make_model(dim: int, classes: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(dim, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, classes)
    )


def train(args: argparse.Namespace, use_kfac: bool) -> list[dict[str, float]]:
    """Train one run; returns a row per epoch (``epoch``, ``train_loss``, ``seconds``)."""
    run = "K-FAC" if use_kfac else "SGD"
    x, y = make_data(args.samples, args.dim, args.classes, args.seed)
    model = make_model(args.dim, args.classes, args.seed)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    state = kf.init(kf.register(model))
    step, rows = 0, []
    start = time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        perm = torch.randperm(args.samples, generator=torch.Generator().manual_seed(step))
        total = 0.0
        starts = range(0, args.samples, args.batch_size)
        for i in progress(starts, total=len(starts), desc=f"{run} epoch {epoch}"):
            idx = perm[i : i + args.batch_size]
            params = dict(model.named_parameters())
            xb, yb = x[idx], y[idx]
            loss, grads, caps = kf.capture(
                model, params, xb, lambda out, yb=yb: F.cross_entropy(out, yb)
            )
            if use_kfac:
                grads, state = kf.update(
                    state,
                    grads,
                    captures=caps,
                    damping=args.damping,
                    lr=args.lr,
                    update_factors=step % args.factor_every == 0,
                    update_inverses=step % args.inverse_every == 0,
                )
            for name, p in params.items():
                p.grad = grads[name]
            opt.step()
            total += float(loss) * len(idx)
            step += 1
        row = {"epoch": epoch, "train_loss": total / args.samples}
        row["seconds"] = time.perf_counter() - start
        rows.append(row)
        print(f"{run} epoch {epoch}: train loss {row['train_loss']:.4f}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=HelpFormatter,
    )
    add = parser.add_argument
    add("--epochs", type=int, default=10, help="epochs of each run")
    add("--samples", type=int, default=4096, help="training examples")
    add("--batch-size", type=int, default=128, help="examples per step")
    add("--dim", type=int, default=20, help="input features")
    add("--classes", type=int, default=5, help="classes of the teacher network")
    add("--lr", type=float, default=0.05, help="SGD learning rate (momentum 0.9)")
    add("--damping", type=float, default=1e-2, help="K-FAC's damping")
    add("--factor-every", type=int, default=1, help="update the factors every N steps")
    add("--inverse-every", type=int, default=10, help="decompose the factors every N steps")
    add("--seed", type=int, default=0, help="seed of the data, the model and the batches")
    add("--out", default="functional_loop", help=OUT_HELP)
    args = parser.parse_args()

    results = {"SGD": train(args, use_kfac=False), "K-FAC": train(args, use_kfac=True)}
    table = [
        {"epoch": a["epoch"], "SGD_loss": a["train_loss"], "K-FAC_loss": b["train_loss"]}
        for a, b in zip(results["SGD"], results["K-FAC"])
    ]
    print(format_table(table))
    csv_path, png_path = save_curves(results, args.out, title="functional loop: SGD vs K-FAC")
    json_path = save_provenance(csv_path, __file__, sys.argv[1:])
    print(f"wrote {csv_path}, {png_path} and {json_path}")


if __name__ == "__main__":
    main()
