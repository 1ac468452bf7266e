"""K-FAC in a custom training loop with the pure functional API.

A small MLP learns a random teacher network's classes (data generated here, nothing is
downloaded). The same model, initialisation and batches are trained with plain SGD and
with SGD on K-FAC-preconditioned gradients; the script prints both losses per epoch.

    python examples/functional_loop.py --epochs 5
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
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


def train(args: argparse.Namespace, use_kfac: bool) -> list[float]:
    x, y = make_data(args.samples, args.dim, args.classes, args.seed)
    model = make_model(args.dim, args.classes, args.seed)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    state = kf.init(kf.register(model))
    step, losses = 0, []
    for _epoch in range(args.epochs):
        perm = torch.randperm(args.samples, generator=torch.Generator().manual_seed(step))
        total = 0.0
        for i in range(0, args.samples, args.batch_size):
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
        losses.append(total / args.samples)
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--dim", type=int, default=20)
    parser.add_argument("--classes", type=int, default=5)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--damping", type=float, default=1e-2)
    parser.add_argument("--factor-every", type=int, default=1)
    parser.add_argument("--inverse-every", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    sgd = train(args, use_kfac=False)
    kfac = train(args, use_kfac=True)
    print(f"{'epoch':>5}  {'SGD loss':>9}  {'K-FAC loss':>10}")
    for epoch, (a, b) in enumerate(zip(sgd, kfac), start=1):
        print(f"{epoch:>5}  {a:>9.4f}  {b:>10.4f}")


if __name__ == "__main__":
    main()
