"""kfac-pytorch's getting-started training loop, with only the import line changed.

A small CNN classifies synthetic 8x8 "images" (one noisy random template per class, made
here with a seeded generator, so nothing is downloaded). The loop is the one a kfac-pytorch
user writes: build the model and optimizer, wrap the model in a ``KFACPreconditioner``,
call ``preconditioner.step()`` between ``loss.backward()`` and ``optimizer.step()``,
schedule a K-FAC hyperparameter with ``LambdaParamScheduler``, and checkpoint the model,
optimizer and preconditioner state dicts after every epoch. Run it again with a larger
``--epochs`` and the same ``--checkpoint`` and it resumes where it stopped.

It prints a row per epoch (a progress bar over the batches when stderr is a terminal) and
writes the curves of every epoch so far, those before a resume included, to ``OUT.csv``
and ``OUT.png``, and the command, the commit and the machine to ``OUT.json`` (``--out``).

    python examples/kfac_pytorch_loop.py --epochs 5
    python examples/kfac_pytorch_loop.py --epochs 3 --checkpoint /tmp/kfac.pt  # then 6
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
from common import OUT_HELP, HelpFormatter, progress, save_curves, save_provenance
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

# kfac-pytorch: from kfac.preconditioner import KFACPreconditioner
#               from kfac.scheduler import LambdaParamScheduler
from kfac_func import KFACPreconditioner
from kfac_func.adapter import LambdaParamScheduler


def make_data(
    n: int, classes: int, noise: float, seed: int, split: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` images of shape (1, 8, 8): the template of a random class plus noise. The
    templates depend on ``seed`` only; ``split`` draws other examples of the same task."""
    templates = torch.randn(classes, 1, 8, 8, generator=torch.Generator().manual_seed(seed))
    g = torch.Generator().manual_seed(seed * 1000 + split + 1)
    y = torch.randint(0, classes, (n,), generator=g)
    x = templates[y] + noise * torch.randn(n, 1, 8, 8, generator=g)
    return x, y


def make_model(classes: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(16 * 4 * 4, 32),
        nn.ReLU(),
        nn.Linear(32, classes),
    )


def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    with torch.no_grad():
        accuracy = (model(x).argmax(-1) == y).float().mean().item()
    model.train()
    return accuracy


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--epochs", type=int, default=5, help="total epochs, resumed ones included")
    parser.add_argument("--samples", type=int, default=2048, help="training examples")
    parser.add_argument("--batch-size", type=int, default=64, help="examples per step")
    parser.add_argument("--classes", type=int, default=5, help="classes (one template each)")
    parser.add_argument("--noise", type=float, default=2.0, help="noise std of the images")
    parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (momentum 0.9)")
    parser.add_argument("--damping", type=float, default=0.003, help="K-FAC's damping")
    parser.add_argument(
        "--factor-update-steps", type=int, default=5, help="update the factors every N steps"
    )
    parser.add_argument(
        "--inv-update-steps", type=int, default=20, help="decompose the factors every N steps"
    )
    parser.add_argument(
        "--kl-clip-decay",
        type=float,
        default=0.98,
        help="LambdaParamScheduler multiplies kl_clip by this after every step; kl_clip "
        "bounds the step size of K-FAC, so this anneals it",
    )
    parser.add_argument(
        "--checkpoint",
        default=None,
        help="checkpoint file, written after every epoch and resumed from if it exists "
        "(None: a file in a temporary directory)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the data and the model")
    parser.add_argument("--out", default="kfac_pytorch_loop", help=OUT_HELP)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    x, y = make_data(args.samples, args.classes, args.noise, args.seed, split=0)
    x_val, y_val = make_data(512, args.classes, args.noise, args.seed, split=1)
    shuffle = torch.Generator()
    train_loader = DataLoader(
        TensorDataset(x, y), batch_size=args.batch_size, shuffle=True, generator=shuffle
    )

    model = make_model(args.classes)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    criterion = nn.CrossEntropyLoss()

    # Initialize KFAC
    preconditioner = KFACPreconditioner(
        model,
        factor_update_steps=args.factor_update_steps,
        inv_update_steps=args.inv_update_steps,
        damping=args.damping,
        # a hyperparameter read from elsewhere each step (Option 1 of the guide)
        lr=lambda step: optimizer.param_groups[0]["lr"],
    )
    # a hyperparameter schedule (Option 2 of the guide), stepped like an LR scheduler
    scheduler = LambdaParamScheduler(preconditioner, kl_clip_lambda=lambda step: args.kl_clip_decay)

    checkpoint = args.checkpoint or os.path.join(tempfile.mkdtemp(), "checkpoint.pt")
    start_epoch = 1
    history: list[dict[str, float]] = []  # a row per epoch, for the curves
    if os.path.exists(checkpoint):
        # Restore state from a file
        state = torch.load(checkpoint)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        preconditioner.load_state_dict(state["preconditioner"])
        start_epoch = state["epoch"] + 1
        history = state.get("history", [])
        print(f"resumed from {checkpoint} after epoch {state['epoch']}")

    print("epoch  loss      accuracy  kl_clip")
    for epoch in range(start_epoch, args.epochs + 1):
        shuffle.manual_seed(args.seed + epoch)  # like DistributedSampler.set_epoch(epoch)
        total, count = 0.0, 0
        batches = progress(train_loader, total=len(train_loader), desc=f"epoch {epoch}")
        for data, target in batches:
            optimizer.zero_grad()
            output = model(data)

            loss = criterion(output, target)
            loss.backward()

            # Perform preconditioning before each optimizer step
            preconditioner.step()
            optimizer.step()
            scheduler.step()

            total += loss.item() * len(target)
            count += len(target)

        accuracy = evaluate(model, x_val, y_val)
        kl_clip = preconditioner.kl_clip
        history.append({"epoch": epoch, "train_loss": total / count, "val_accuracy": accuracy})
        # Save state to a file
        state = {
            "epoch": epoch,
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "preconditioner": preconditioner.state_dict(),
            "history": history,
        }
        torch.save(state, checkpoint)
        print(f"{epoch:<5d}  {total / count:<8.4f}  {accuracy:<8.4f}  {kl_clip:.3g}", flush=True)

    csv_path, png_path = save_curves({"SGD + K-FAC": history}, args.out, title="kfac-pytorch loop")
    json_path = save_provenance(csv_path, __file__, sys.argv[1:])
    print(f"wrote {csv_path}, {png_path} and {json_path}")


if __name__ == "__main__":
    main()
