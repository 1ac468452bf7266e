"""The image-classification example as a pure functional loop (``kf.capture`` + ``kf.update``).

Same data, CNN, batches and initialisation as ``image_classification.py``, but no
optimizer object and no hooks: parameters, momentum buffers and the K-FAC state are values
that each step replaces. ``kf.capture`` runs the forward and backward pass through
``torch.func`` and returns the loss, the gradients and the layer statistics;
``kf.update`` returns the preconditioned gradients and a new state; SGD with momentum and
weight decay is three tensor expressions; evaluation uses ``torch.func.functional_call``.

The factors use the library's default ``"fisher"`` convention (per-example Fisher), as
the adapter does in ``image_classification.py``; the hyperparameters are that example's,
K-FAC's step included: no momentum, and a step length whose learning rate follows a
cosine decay to ``--decay-to`` of its first value and whose ``kl_clip`` that decay's
square (that example's module docstring says why).

At the end, a check trains a few steps twice from the same initialisation and batches,
once with this loop and once with
``kf.KFACPreconditioner(..., settings=kf.Settings(scaling="fisher"))`` and
``torch.optim.SGD``, and prints the largest parameter difference (expected: zero or a
few float32 roundings).

    python examples/image_classification_functional.py
    python examples/image_classification_functional.py --dataset mnist5k --epochs 5
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    DATASETS,
    OUT_HELP,
    HelpFormatter,
    ImageData,
    format_table,
    load_images,
    minibatches,
    progress,
    save_curves,
    save_provenance,
)
from image_classification import (
    DEFAULT_LR,
    EPOCHS,
    Settings,
    batch_seed,
    make_model,
    make_optimizer,
    step_decay,
)

import kfac_func as kf

Params = dict[str, torch.Tensor]


def sgd_step(
    params: Params, grads: Params, bufs: Params | None, *, lr: float, momentum: float, wd: float
) -> tuple[Params, Params]:
    """SGD with momentum and weight decay, as ``torch.optim.SGD`` computes it (the first
    step's buffer is the gradient itself); returns new ``(params, momentum buffers)``."""
    new_params, new_bufs = {}, {}
    for name, p in params.items():
        g = torch.add(grads[name], p, alpha=wd) if wd else grads[name]
        buf = g.clone() if bufs is None else bufs[name].mul(momentum).add(g)
        new_bufs[name] = buf
        new_params[name] = torch.add(p, buf, alpha=-lr)
    return new_params, new_bufs


class FunctionalTrainer:
    """Parameters, momentum buffers and K-FAC state of one run, replaced step by step.

    K-FAC's step length decays over ``total_steps`` steps (None: it stays constant), as
    :func:`image_classification.make_optimizer` makes it."""

    def __init__(
        self, model: nn.Module, lr: float, s: Settings, total_steps: int | None = None
    ) -> None:
        self.model, self.lr, self.s = model, lr, s
        self.decay = step_decay(total_steps, s.kfac_decay_to)
        self.layers = kf.register(model)
        self.state = kf.init(self.layers)  # "fisher" convention, float32 factors
        self.params: Params = {n: p.detach() for n, p in model.named_parameters()}
        self.bufs: Params | None = None

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """One training step on ``(x, y)``; returns the batch loss."""
        s, step = self.s, self.state.step
        lr = self.lr * self.decay(step)
        loss, grads, caps = kf.capture(
            self.model, self.params, x, lambda out: F.cross_entropy(out, y), layers=self.layers
        )
        grads, self.state = kf.update(
            self.state,
            grads,
            captures=caps,
            damping=s.damping,
            factor_decay=s.factor_decay,
            kl_clip=s.kl_clip * self.decay(step) ** 2 if s.kl_clip > 0 else None,
            lr=lr,
            update_factors=step % s.factor_every == 0,
            update_inverses=step % s.inverse_every == 0,
        )
        self.params, self.bufs = sgd_step(
            self.params,
            grads,
            self.bufs,
            lr=lr,
            momentum=s.kfac_momentum,
            wd=s.weight_decay,
        )
        return float(loss)

    @torch.no_grad()
    def evaluate(self, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
        """Mean cross-entropy and accuracy with the current parameters."""
        out = functional_call(self.model, self.params, (x,))
        return float(F.cross_entropy(out, y)), float((out.argmax(-1) == y).float().mean())


def train(
    data: ImageData, *, epochs: int, lr: float, seed: int, settings: Settings
) -> list[dict[str, float]]:
    """Per-epoch rows (``epoch``, ``train_loss``, ``test_loss``, ``test_accuracy``,
    ``seconds``) of the functional K-FAC loop."""
    n, rows, seconds = len(data.y_train), [], 0.0
    total_steps = epochs * -(-n // settings.batch_size)
    trainer = FunctionalTrainer(make_model(data, seed), lr, settings, total_steps)
    for epoch in range(1, epochs + 1):
        start = time.perf_counter()
        total = 0.0
        batches = minibatches(n, settings.batch_size, batch_seed(seed, epoch))
        steps = -(-n // settings.batch_size)
        for idx in progress(batches, total=steps, desc=f"functional epoch {epoch}"):
            total += trainer.step(data.x_train[idx], data.y_train[idx]) * len(idx)
        seconds += time.perf_counter() - start
        test_loss, test_acc = trainer.evaluate(data.x_test, data.y_test)
        rows.append(
            {
                "epoch": epoch,
                "train_loss": total / n,
                "test_loss": test_loss,
                "test_accuracy": test_acc,
                "seconds": seconds,
            }
        )
    return rows


def compare_with_adapter(
    data: ImageData, *, steps: int, lr: float, seed: int, settings: Settings
) -> float:
    """Train ``steps`` steps with this loop and with the adapter (``scaling="fisher"``,
    ``torch.optim.SGD``) from the same model and batches, the step length decaying over
    the ``steps``; the largest absolute difference of any parameter afterwards."""
    s = settings
    functional = FunctionalTrainer(make_model(data, seed), lr, s, total_steps=steps)
    model = make_model(data, seed)
    # the adapter as example 1 builds it, with the functional path's convention
    opt, pre = make_optimizer(
        "kfac", model, lr, dataclasses.replace(s, scaling="fisher"), total_steps=steps
    )
    assert pre is not None
    n, done, epoch = len(data.y_train), 0, 0
    while done < steps:
        epoch += 1
        for idx in minibatches(n, s.batch_size, batch_seed(seed, epoch)):
            if done == steps:
                break
            x, y = data.x_train[idx], data.y_train[idx]
            functional.step(x, y)
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            pre.step()
            opt.step()
            done += 1
    return max(
        float((functional.params[name] - p.detach()).abs().max())
        for name, p in model.named_parameters()
    )


def main(argv: list[str] | None = None) -> None:
    """Train with the functional loop, print the table, write CSV and PNG, run the check."""
    s = Settings()
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=HelpFormatter,
    )
    p.add_argument("--dataset", choices=DATASETS, default="digits", help="which images")
    p.add_argument("--data-dir", default=None, help="folder with MNIST IDX / CIFAR-10 binary")
    p.add_argument("--epochs", type=int, default=EPOCHS, help="training epochs (that example's)")
    p.add_argument(
        "--samples",
        type=int,
        default=None,
        help="keep the first N train (and at most N test) images",
    )
    p.add_argument("--lr", type=float, default=DEFAULT_LR["kfac"], help="learning rate")
    p.add_argument("--batch-size", type=int, default=s.batch_size, help="images per step")
    p.add_argument(
        "--momentum", type=float, default=s.kfac_momentum, help="SGD momentum under K-FAC"
    )
    p.add_argument("--weight-decay", type=float, default=s.weight_decay, help="SGD")
    p.add_argument("--damping", type=float, default=s.damping, help="'fisher' convention")
    p.add_argument("--factor-decay", type=float, default=s.factor_decay, help="running average")
    p.add_argument(
        "--kl-clip", type=float, default=s.kl_clip, help="step clipping at the start; 0: none"
    )
    p.add_argument(
        "--decay-to",
        type=float,
        default=s.kfac_decay_to,
        help="final step length, a fraction of the first (cosine); 1 keeps it constant",
    )
    p.add_argument(
        "--factor-every", type=int, default=s.factor_every, help="factor update interval"
    )
    p.add_argument(
        "--inverse-every", type=int, default=s.inverse_every, help="decomposition interval"
    )
    p.add_argument("--seed", type=int, default=0, help="initialisation and batch order")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--check-steps", type=int, default=20, help="steps of the adapter check")
    p.add_argument("--no-check", action="store_true", help="skip the adapter check")
    p.add_argument("--out", default="image_classification_functional", help=OUT_HELP)
    args = p.parse_args(argv)

    torch.set_num_threads(args.threads)
    settings = Settings(
        batch_size=args.batch_size,
        weight_decay=args.weight_decay,
        damping=args.damping,
        factor_decay=args.factor_decay,
        kl_clip=args.kl_clip,
        kfac_momentum=args.momentum,
        kfac_decay_to=args.decay_to,
        factor_every=args.factor_every,
        inverse_every=args.inverse_every,
    )
    data = load_images(args.dataset, args.data_dir, args.samples)
    print(data.describe())
    rows = train(data, epochs=args.epochs, lr=args.lr, seed=args.seed, settings=settings)
    print(format_table([{**r, "epoch": int(r["epoch"])} for r in rows]))
    csv_path, png_path = save_curves(
        {"kfac-functional": rows},
        args.out,
        title=f"functional K-FAC on {args.dataset} ({len(data.y_train)} images)",
    )
    json_path = save_provenance(csv_path, __file__, sys.argv[1:] if argv is None else argv)
    print(f"wrote {csv_path}, {png_path} and {json_path}")
    if not args.no_check:
        diff = compare_with_adapter(
            data, steps=args.check_steps, lr=args.lr, seed=args.seed, settings=settings
        )
        print(
            f"functional vs adapter (scaling='fisher') after {args.check_steps} steps: "
            f"max |parameter difference| = {diff:.3e}"
        )


if __name__ == "__main__":
    main()
