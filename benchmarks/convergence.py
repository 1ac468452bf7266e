"""Epochs and wall time to a target test accuracy: SGD, Adam and SGD + K-FAC.

The task is ``examples/image_classification.py``'s: the small CNN on scikit-learn's 8x8
digits (1,438 training / 359 test images, batch 64, weight decay 5e-4), with that
example's model, data, batches and training loop (imported, not copied).

Run ``python benchmarks/convergence.py`` (a few minutes on a 2-core CPU) or ``--quick``
(a few hundred images, one learning rate, two seeds, four epochs: a smoke test, not a
measurement).

What is measured
----------------
For each optimizer and each learning rate of its sweep (three, a factor of about three
apart, around the best value found beforehand) and each seed (initialisation and batch
order; the same seeds for every optimizer), a run trains until the test accuracy after an
epoch reaches ``--target`` or ``--max-epochs`` pass. It records the epochs that took and
the training wall time (evaluation excluded). For each optimizer the learning rate with
the smallest median epochs-to-target (runs that never reach it count as infinitely long;
ties go to the smaller median time) is its result: median and range over seeds of epochs
and seconds to target. K-FAC's ratios are the other optimizer's median divided by
K-FAC's (above 1: K-FAC is faster).

Runs are interleaved (seed by seed, every optimizer and learning rate in turn) so that
load from other processes hits all of them alike; the wall times are still only as steady
as the machine. One intra-op thread (``--threads``).

Outputs (``--out`` prefix, default ``benchmarks/out/convergence``, a folder git ignores;
in quick mode a temporary folder): ``.csv`` (one row per run), ``.png`` (the sweep and the per-seed
epochs and seconds at the chosen learning rates) and ``_curves.csv``/``_curves.png``
(test accuracy and losses per epoch of seed 0 at the chosen learning rates, trained for
``--max-epochs`` without stopping). The committed results in ``benchmarks/results/`` are
refreshed only when asked for by name: ``--out benchmarks/results/convergence``.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import format_table, load_images, progress, save_curves
from image_classification import OPTIMIZERS, Settings, train
from step_time import cpu_model

import kfac_func as kf

ROOT = Path(__file__).resolve().parents[1]
LRS = {"sgd": (0.03, 0.1, 0.3), "adam": (0.003, 0.01, 0.03), "kfac": (0.01, 0.03, 0.1)}
"""Learning-rate sweep per optimizer."""

LABELS = {"sgd": "SGD", "adam": "Adam", "kfac": "K-FAC"}

CONVERGENCE_DAMPING = 0.003
"""K-FAC's damping here, the one of the committed results: the runs stop at the target,
within two epochs, while it is below the output layer's mean curvature (and within 35
times the other layers'). The example's own default is smaller, its run going on while
the curvature falls (see its module docstring)."""


class Run(NamedTuple):
    """One training run until the target (``epochs``/``seconds`` None if never reached)."""

    optimizer: str
    lr: float
    seed: int
    epochs: int | None
    seconds: float | None
    best_accuracy: float


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags; ``--quick`` overrides target, epochs, seeds and images."""
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--quick", action="store_true", help="seconds-long smoke test")
    p.add_argument("--target", type=float, default=0.97, help="test accuracy to reach")
    p.add_argument(
        "--max-epochs", type=int, default=20, help="epochs before a run stops short of the target"
    )
    p.add_argument("--seeds", type=int, default=5, help="seeds 0..N-1 per learning rate")
    p.add_argument("--samples", type=int, default=None, help="training images (default all)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--no-curves", action="store_true", help="skip the per-epoch curve runs")
    p.add_argument(
        "--out",
        default=None,
        help="output prefix of the CSVs and plots (default benchmarks/out/convergence, "
        "untracked; --quick: a temporary folder); pass benchmarks/results/convergence to "
        "refresh the committed results",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.target, args.max_epochs, args.seeds, args.samples = 0.4, 4, 2, 384
    return args


def median(values: list[float | None]) -> float:
    """Median where None (never reached) counts as infinity."""
    return statistics.median(math.inf if v is None else v for v in values)


def spread(values: list[float | None], fmt: str) -> str:
    """``median [min-max]`` of the reached values, with how many did not reach."""
    reached = [v for v in values if v is not None]
    if not reached:
        return "never"
    text = f"{fmt.format(median(values))} [{fmt.format(min(reached))}-{fmt.format(max(reached))}]"
    missed = len(values) - len(reached)
    return text + (f" ({missed} missed)" if missed else "")


def best_lr(runs: list[Run], optimizer: str) -> float:
    """The learning rate of ``optimizer`` with the smallest median epochs (then seconds)."""
    lrs = sorted({r.lr for r in runs if r.optimizer == optimizer})

    def key(lr: float) -> tuple[float, float]:
        mine = [r for r in runs if r.optimizer == optimizer and r.lr == lr]
        return median([r.epochs for r in mine]), median([r.seconds for r in mine])

    return min(lrs, key=key)


def ratio(a: float, b: float) -> str:
    """``a / b`` to two decimals, or ``n/a`` when either never reached the target."""
    return f"{a / b:.2f}" if math.isfinite(a) and math.isfinite(b) and b > 0 else "n/a"


def plot(runs: list[Run], chosen: dict[str, float], target: float, path: Path) -> None:
    """Three panels: median epochs vs learning rate, and per-seed epochs and seconds to
    target at the chosen learning rates."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8), layout="constrained")
    names = list(chosen)
    for name in names:
        lrs = sorted({r.lr for r in runs if r.optimizer == name})
        meds = [
            median([r.epochs for r in runs if r.optimizer == name and r.lr == lr]) for lr in lrs
        ]
        shown = [(lr, m) for lr, m in zip(lrs, meds) if math.isfinite(m)]
        if shown:
            axes[0].plot(*zip(*shown), marker="o", label=LABELS[name])
    axes[0].set_xscale("log")
    axes[0].set_xlabel("learning rate")
    axes[0].set_ylabel(f"median epochs to {target:.0%}")
    axes[0].set_title("learning-rate sweep")
    axes[0].legend()
    for ax, field, unit in ((axes[1], "epochs", "epochs"), (axes[2], "seconds", "seconds")):
        for i, name in enumerate(names):
            vals = [
                getattr(r, field)
                for r in runs
                if r.optimizer == name and r.lr == chosen[name] and getattr(r, field) is not None
            ]
            if vals:
                xs = [i + 0.08 * (j - (len(vals) - 1) / 2) for j in range(len(vals))]
                ax.scatter(xs, vals, alpha=0.7)
                ax.hlines(statistics.median(vals), i - 0.3, i + 0.3, color="black")
        ax.set_xticks(range(len(names)), [f"{LABELS[n]}\nlr {chosen[n]:g}" for n in names])
        ax.set_ylabel(f"{unit} to {target:.0%}")
        ax.set_ylim(bottom=0)
        ax.set_title(f"{unit} to target (dots: seeds, bar: median)")
        ax.grid(axis="y", alpha=0.3)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Run the sweep, print the tables, write the CSVs and plots."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    lrs = {name: LRS[name][1:2] for name in OPTIMIZERS} if args.quick else LRS
    if args.out is not None:
        out = Path(args.out)
    elif args.quick:
        out = Path(tempfile.mkdtemp(prefix="convergence-")) / "convergence"
    else:
        out = ROOT / "benchmarks" / "out" / "convergence"
    out.parent.mkdir(parents=True, exist_ok=True)

    data = load_images("digits", samples=args.samples)
    settings = Settings(damping=CONVERGENCE_DAMPING)
    print("Epochs and seconds to a test accuracy target: SGD, Adam, SGD + K-FAC")
    print(
        f"torch {torch.__version__} | kfac_func {kf.__version__} | python "
        f"{platform.python_version()} | threads {torch.get_num_threads()} | CPU {cpu_model()} "
        f"({os.cpu_count()} cores)"
    )
    if args.quick:
        print("QUICK MODE: few images, one lr, two seeds; a smoke test, not a measurement")
    print(
        f"{data.describe()}; target test accuracy {args.target:.1%}, max {args.max_epochs} epochs"
    )
    print(
        f"batch {settings.batch_size}, momentum {settings.momentum} (SGD), "
        f"{settings.kfac_momentum} (K-FAC), weight decay "
        f"{settings.weight_decay}; K-FAC: scaling {settings.scaling!r}, damping "
        f"{settings.damping}, factor_decay {settings.factor_decay}, kl_clip {settings.kl_clip}, "
        f"factors every {settings.factor_every} step(s), decompositions every "
        f"{settings.inverse_every}"
    )

    jobs = [(seed, name, lr) for seed in range(args.seeds) for name in lrs for lr in lrs[name]]
    runs: list[Run] = []
    start = time.perf_counter()
    for seed, name, lr in progress(jobs, total=len(jobs), desc="runs"):
        rows = train(
            name,
            data,
            epochs=args.max_epochs,
            lr=lr,
            seed=seed,
            settings=settings,
            target=args.target,
            show_progress=False,
        )
        last = rows[-1]
        hit = last["test_accuracy"] >= args.target
        if name == list(lrs)[-1] and lr == lrs[name][-1]:
            print(f"seed {seed} done ({time.perf_counter() - start:.0f} s)", flush=True)
        runs.append(
            Run(
                name,
                lr,
                seed,
                int(last["epoch"]) if hit else None,
                last["seconds"] if hit else None,
                max(r["test_accuracy"] for r in rows),
            )
        )
    print(f"{len(runs)} runs in {time.perf_counter() - start:.0f} s")

    with open(out.parent / (out.name + ".csv"), "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(Run._fields)
        for r in runs:
            writer.writerow(["" if v is None else v for v in r])

    print("\nsweep: median [min-max] over seeds; a run that misses the target counts as infinite")
    sweep = []
    for name in lrs:
        for lr in lrs[name]:
            mine = [r for r in runs if r.optimizer == name and r.lr == lr]
            sweep.append(
                {
                    "optimizer": LABELS[name],
                    "lr": f"{lr:g}",
                    "epochs": spread([r.epochs for r in mine], "{:g}"),
                    "seconds": spread([r.seconds for r in mine], "{:.1f}"),
                    "reached": f"{sum(r.epochs is not None for r in mine)}/{len(mine)}",
                }
            )
    print(format_table(sweep))

    chosen = {name: best_lr(runs, name) for name in lrs}
    med = {
        name: (
            median([r.epochs for r in runs if r.optimizer == name and r.lr == chosen[name]]),
            median([r.seconds for r in runs if r.optimizer == name and r.lr == chosen[name]]),
        )
        for name in lrs
    }
    print(f"\nresult: best learning rate each, {args.seeds} seeds, median [min-max]")
    result = []
    for name in lrs:
        mine = [r for r in runs if r.optimizer == name and r.lr == chosen[name]]
        row = {
            "optimizer": LABELS[name],
            "lr": f"{chosen[name]:g}",
            "epochs to target": spread([r.epochs for r in mine], "{:g}"),
            "seconds to target": spread([r.seconds for r in mine], "{:.1f}"),
            "s/epoch": (
                f"{med[name][1] / med[name][0]:.2f}" if math.isfinite(med[name][1]) else "n/a"
            ),
        }
        result.append(row)
    print(format_table(result))
    for other in ("sgd", "adam"):
        print(
            f"K-FAC vs {LABELS[other]}: epochs ratio {ratio(med[other][0], med['kfac'][0])}, "
            f"seconds ratio {ratio(med[other][1], med['kfac'][1])} (above 1: K-FAC faster)"
        )

    png = out.parent / (out.name + ".png")
    plot(runs, chosen, args.target, png)
    print(f"\nwrote {out.parent / (out.name + '.csv')} and {png}")
    if not args.no_curves:
        curves = {
            f"{LABELS[name]} lr {chosen[name]:g}": train(
                name,
                data,
                epochs=args.max_epochs,
                lr=chosen[name],
                seed=0,
                settings=settings,
                show_progress=False,
            )
            for name in lrs
        }
        paths = save_curves(
            curves,
            out.parent / (out.name + "_curves"),
            title=f"SmallCNN on digits ({len(data.y_train)} train images), seed 0, chosen lrs",
        )
        print(f"wrote {paths[0]} and {paths[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
