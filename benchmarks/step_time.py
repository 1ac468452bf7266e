"""Step time of plain SGD and of the kfac_func functional K-FAC path, side by side.

Run ``python benchmarks/step_time.py`` (a few minutes on a 2-core CPU with the defaults)
or ``--quick`` (tiny models, two repetitions, seconds: a smoke test, not a measurement).

What one step is
----------------
- SGD: ``zero_grad`` + forward + cross-entropy + ``loss.backward()`` + ``optimizer.step()``
  with ``torch.optim.SGD(lr, momentum=0.9)``.
- K-FAC: ``kf.capture`` (forward + VJP through ``torch.func``) + ``kf.update`` + writing the
  preconditioned gradients into ``p.grad`` + the same ``SGD.step()``. ``capture`` gets
  ``layers=`` (the table from ``kf.register``, built once) and is called every step, as in
  the README loop; ``update`` gets ``update_factors=step % F == 0`` and
  ``update_inverses=step % I == 0`` for intervals ``F/I``.

Both paths use their own copy of the same initial model and draw a fresh random batch
(Gaussian inputs, uniform random labels, cross-entropy; nothing is downloaded) before the
clock starts on every step, so the loss cannot be driven to zero by memorising a few
batches (vanishing gradients would make the timings unrepresentative).

Models
------
- ``mlp``: 4 Linear layers with ReLU between, input dimension ``--width`` (1024): three
  ``width x width`` layers and a 4th Linear ``width -> --mlp-out`` head (10 classes; pass
  ``--mlp-out 1024`` to make all four layers 1024 x 1024). Batch ``--mlp-batch`` (256).
- ``cnn``: CIFAR-sized, 3x32x32 inputs, batch ``--cnn-batch`` (128):
  conv3x3 3->32, ReLU, maxpool2 -> conv3x3 32->64, ReLU, maxpool2 -> conv3x3 64->128, ReLU,
  global average pool -> Linear 128->10. All four layers are K-FAC layers.

How the time is measured
------------------------
Every kind of K-FAC step is timed separately: steps that update the factors and recompute
the decompositions, steps that only update the factors, steps that only recompute the
decompositions, and steps that only precondition. Intervals ``F/I`` fix how often each kind
occurs in one cycle of ``lcm(F, I)`` steps (1/1: every step is "factors+decomp"; 10/100:
1 "factors+decomp", 9 "factors", 90 "precondition" steps out of 100). The amortized K-FAC
step time is the weighted mean of the per-kind medians with those weights, so the
decomposition steps count exactly in proportion to how often they occur. Capture and
update times are amortized in the same way.

After warm-up (which also computes the first factors and decompositions), each repetition
times one K-FAC step of every kind the intervals need, each directly preceded by one SGD
step; the order is reversed on every other repetition, so machine noise hits SGD and K-FAC
alike. Reported times are medians over the repetitions (``--reps``); SGD's median is over all
its interleaved samples. The state and parameters keep evolving through all timed steps, as
in training.

``--method consecutive`` cross-checks the weighting: each repetition times a block of
consecutive steps (a multiple of ``lcm(F, I)``, at least ``--block`` steps) of SGD and of
K-FAC following the schedule from the start of a cycle, and takes the mean per step; the
table reports the median of those means. It is much slower for 10/100 (100-step blocks).

``--profile`` adds a cProfile of a few K-FAC steps of each kind (where the time goes).

No timing is asserted anywhere; the numbers are printed for people to read.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import importlib.util
import io
import math
import os
import platform
import pstats
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

try:
    import kfac_func as kf
except ImportError:  # a checkout without `pip install -e .`: use the repository's copy
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import kfac_func as kf

Kind = tuple[bool, bool]  # (update_factors, update_inverses)

KIND_NAMES: dict[Kind, str] = {
    (True, True): "factors+decomp",
    (True, False): "factors",
    (False, True): "decomp",
    (False, False): "precondition",
}


# --------------------------------------------------------------------------- workloads


def make_mlp(width: int, out: int) -> nn.Module:
    dims = [width, width, width, width, out]
    mods: list[nn.Module] = []
    for i in range(4):
        mods.append(nn.Linear(dims[i], dims[i + 1]))
        if i < 3:
            mods.append(nn.ReLU())
    return nn.Sequential(*mods)


def make_cnn(classes: int = 10) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(64, 128, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(128, classes),
    )


@dataclass
class Workload:
    name: str
    description: str
    make: Callable[[], nn.Module]
    input_shape: tuple[int, ...]
    classes: int


def workloads(args: argparse.Namespace) -> list[Workload]:
    w, o = args.width, args.mlp_out
    all_ = {
        "mlp": Workload(
            "mlp",
            f"MLP: Linear {w}x{w} x3 + Linear {w}->{o} head, ReLU between; batch {args.mlp_batch}",
            lambda: make_mlp(w, o),
            (args.mlp_batch, w),
            min(o, 10),
        ),
        "cnn": Workload(
            "cnn",
            "CNN: conv3x3 3->32, pool, conv3x3 32->64, pool, conv3x3 64->128, global avg "
            f"pool, Linear 128->10; 3x32x32 inputs, batch {args.cnn_batch}",
            make_cnn,
            (args.cnn_batch, 3, 32, 32),
            10,
        ),
    }
    return [all_[m] for m in args.models]


# --------------------------------------------------------------------------- schedules


def parse_intervals(text: str) -> tuple[int, int]:
    try:
        f, i = (int(v) for v in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"intervals must look like 10/100, got {text!r}") from None
    if f < 1 or i < 1:
        raise argparse.ArgumentTypeError(f"intervals must be positive, got {text!r}")
    return f, i


def schedule(intervals: tuple[int, int]) -> list[Kind]:
    """The kind of each step of one cycle of ``lcm(F, I)`` steps (as the README loop)."""
    f, i = intervals
    return [(s % f == 0, s % i == 0) for s in range(math.lcm(f, i))]


def kind_weights(intervals: tuple[int, int]) -> dict[Kind, float]:
    cycle = schedule(intervals)
    return {k: cycle.count(k) / len(cycle) for k in KIND_NAMES if k in cycle}


# --------------------------------------------------------------------------- the two loops


@dataclass
class KFACTimes:
    total: float
    capture: float
    update: float


class Pair:
    """One workload trained side by side by SGD and by K-FAC (own model copies)."""

    def __init__(self, wl: Workload, args: argparse.Namespace, seed: int) -> None:
        torch.manual_seed(seed)
        self.wl = wl
        self.args = args
        base = wl.make()
        self.sgd_model = base
        self.kfac_model = copy.deepcopy(base)
        self.sgd_opt = torch.optim.SGD(self.sgd_model.parameters(), lr=args.lr, momentum=0.9)
        self.kfac_opt = torch.optim.SGD(self.kfac_model.parameters(), lr=args.lr, momentum=0.9)
        self.layers = kf.register(self.kfac_model)
        self.state = kf.init(self.layers)
        self.sgd_loss = float("nan")
        self.kfac_loss = float("nan")

    def _batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """A fresh random batch (drawn before the clock starts), so labels are never memorised."""
        shape = self.wl.input_shape
        return torch.randn(shape), torch.randint(0, self.wl.classes, (shape[0],))

    def sgd_step(self) -> float:
        x, y = self._batch()
        t0 = time.perf_counter()
        self.sgd_opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(self.sgd_model(x), y)
        loss.backward()
        self.sgd_opt.step()
        t1 = time.perf_counter()
        self.sgd_loss = loss.item()
        return t1 - t0

    def kfac_step(self, kind: Kind) -> KFACTimes:
        x, y = self._batch()
        a = self.args
        t0 = time.perf_counter()
        params = dict(self.kfac_model.named_parameters())
        loss, grads, caps = kf.capture(
            self.kfac_model,
            params,
            x,
            lambda out: F.cross_entropy(out, y),
            layers=self.layers,
        )
        t1 = time.perf_counter()
        grads, self.state = kf.update(
            self.state,
            grads,
            captures=caps,
            damping=a.damping,
            factor_decay=0.95,
            kl_clip=1e-3,
            lr=a.lr,
            update_factors=kind[0],
            update_inverses=kind[1],
        )
        t2 = time.perf_counter()
        for name, p in params.items():
            p.grad = grads[name]
        self.kfac_opt.step()
        t3 = time.perf_counter()
        self.kfac_loss = loss.item()
        return KFACTimes(t3 - t0, t1 - t0, t2 - t1)


# --------------------------------------------------------------------------- measurement


@dataclass
class Samples:
    sgd: list[float] = field(default_factory=list)
    kfac: dict[Kind, list[KFACTimes]] = field(default_factory=dict)


def median_ms(values: list[float]) -> float:
    return 1e3 * statistics.median(values)


def iqr_ms(values: list[float]) -> float:
    if len(values) < 2:
        return 0.0
    q = statistics.quantiles(values, n=4)
    return 1e3 * (q[2] - q[0])


def warm_up(pair: Pair, kinds: list[Kind], steps: int) -> None:
    pair.kfac_step((True, True))  # first factors and decompositions
    for _ in range(steps):
        pair.sgd_step()
        for k in kinds:
            pair.kfac_step(k)


def measure_weighted(
    pair: Pair, kinds: list[Kind], reps: int, log: Callable[[str], None]
) -> Samples:
    s = Samples(kfac={k: [] for k in kinds})
    for rep in range(reps):
        seq: list[Kind | None] = []
        for k in kinds:
            seq += [None, k]  # None: one SGD step, directly before each K-FAC step
        if rep % 2:
            seq.reverse()
        for item in seq:
            if item is None:
                s.sgd.append(pair.sgd_step())
            else:
                s.kfac[item].append(pair.kfac_step(item))
        log(f"  {pair.wl.name}: repetition {rep + 1}/{reps}")
    return s


@dataclass
class Row:
    model: str
    intervals: str
    sgd_ms: float
    kfac_ms: float
    capture_ms: float
    update_ms: float

    @property
    def ratio(self) -> float:
        return self.kfac_ms / self.sgd_ms


def rows_weighted(pair: Pair, s: Samples, intervals: list[tuple[int, int]]) -> list[Row]:
    sgd = median_ms(s.sgd)
    rows = []
    for iv in intervals:
        w = kind_weights(iv)
        tot = sum(wk * median_ms([t.total for t in s.kfac[k]]) for k, wk in w.items())
        cap = sum(wk * median_ms([t.capture for t in s.kfac[k]]) for k, wk in w.items())
        upd = sum(wk * median_ms([t.update for t in s.kfac[k]]) for k, wk in w.items())
        rows.append(Row(pair.wl.name, f"{iv[0]}/{iv[1]}", sgd, tot, cap, upd))
    return rows


def measure_consecutive(
    pair: Pair, iv: tuple[int, int], reps: int, min_block: int, log: Callable[[str], None]
) -> Row:
    cycle = schedule(iv)
    block = cycle * max(1, math.ceil(min_block / len(cycle)))
    sgd_means: list[float] = []
    kfac_means: list[tuple[float, float, float]] = []

    def run_sgd() -> None:
        sgd_means.append(sum(pair.sgd_step() for _ in block) / len(block))

    def run_kfac() -> None:
        ts = [pair.kfac_step(k) for k in block]
        n = len(block)
        kfac_means.append(
            (
                sum(t.total for t in ts) / n,
                sum(t.capture for t in ts) / n,
                sum(t.update for t in ts) / n,
            )
        )

    for rep in range(reps):
        for fn in (run_sgd, run_kfac) if rep % 2 == 0 else (run_kfac, run_sgd):
            fn()
        log(f"  {pair.wl.name} {iv[0]}/{iv[1]}: block {rep + 1}/{reps} ({len(block)} steps)")
    return Row(
        pair.wl.name,
        f"{iv[0]}/{iv[1]}",
        median_ms(sgd_means),
        median_ms([m[0] for m in kfac_means]),
        median_ms([m[1] for m in kfac_means]),
        median_ms([m[2] for m in kfac_means]),
    )


def profile_kinds(pair: Pair, kinds: list[Kind], steps: int, top: int) -> None:
    """cProfile ``steps`` K-FAC steps of each kind; print where the time goes."""
    for k in kinds:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(steps):
            pair.kfac_step(k)
        prof.disable()
        print(f"\n--- cProfile: {pair.wl.name}, {KIND_NAMES[k]} steps (x{steps}) ---")
        for title, order, restrict in (
            ("kfac_func functions by cumulative time", "cumulative", ("kfac_func", top)),
            ("all functions by own time (torch ops show as built-ins)", "tottime", (top,)),
        ):
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats(order).print_stats(*restrict)
            print(f"{title}:")
            print(_trim_pstats(out.getvalue()))


def _trim_pstats(text: str) -> str:
    keep = []
    for line in text.splitlines():
        s = line.strip()
        if not s or s.startswith(("Ordered by", "List reduced", "Function was")):
            continue
        if "function calls" in s and "seconds" in s:
            continue
        keep.append(line.rstrip())
    return "\n".join(keep)


# --------------------------------------------------------------------------- output


def load_example(name: str) -> ModuleType:
    """The module of ``examples/<name>.py`` (registered in ``sys.modules`` under ``name``),
    so that benchmarks use the examples' data, models and schedules instead of copies."""
    path = Path(__file__).resolve().parents[1] / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def cpu_model() -> str:
    """The CPU's model name, as the examples' results record it (``examples/common.py``)."""
    return str(load_example("common").cpu_model()) or "unknown"


def git_commit(exclude: Sequence[str] = ("examples/results",)) -> dict[str, Any]:
    """``{"commit": HEAD, "dirty": whether tracked files differ from it}`` of this
    checkout, as the examples' results record it (``examples/common.py``; the paths of
    ``exclude``, results a run rewrites, do not count)."""
    commit, dirty = load_example("common").checkout(exclude)
    return {"commit": commit or None, "dirty": bool(dirty)}


def checked_out(exclude: Sequence[str], require_clean: bool) -> dict[str, Any] | None:
    """:func:`git_commit`, with a warning when the tree is dirty; None when it is and
    ``require_clean`` says to refuse the run."""
    checkout = git_commit(exclude)
    if checkout["dirty"]:
        print("WARNING: tracked files differ from the commit; the results say dirty")
        if require_clean:
            return None
    return checkout


def print_table(headers: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    fmt = "  ".join(f"{{:{'<' if i == 0 else '>'}{w}}}" for i, w in enumerate(widths))
    print(fmt.format(*headers))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print(fmt.format(*r))


METHOD_WEIGHTED = (
    "per-kind medians weighted by each kind's share of a cycle of lcm(F, I) steps; "
    "K-FAC steps of each kind interleaved with SGD steps (order reversed every other rep)"
)
METHOD_CONSECUTIVE = (
    "median over reps of the mean step time of a block of consecutive steps (a whole number "
    "of lcm(F, I) cycles); SGD and K-FAC blocks alternate (order reversed every other rep)"
)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    pass


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=_HelpFormatter)
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke test in seconds: width 64, MLP batch 16, CNN batch 8, 2 reps, 1 warm-up",
    )
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    p.add_argument(
        "--models", nargs="+", choices=["mlp", "cnn"], default=["mlp", "cnn"], help="workloads"
    )
    p.add_argument(
        "--intervals",
        nargs="+",
        default=["1/1", "10/100"],
        help="factor/decomposition update intervals F/I",
    )
    p.add_argument(
        "--method", choices=["weighted", "consecutive"], default="weighted", help="see above"
    )
    p.add_argument("--reps", type=int, default=15, help="timed repetitions")
    p.add_argument("--warmup", type=int, default=2, help="warm-up steps of each kind")
    p.add_argument("--block", type=int, default=20, help="consecutive: min steps per block")
    p.add_argument("--width", type=int, default=1024, help="MLP input and hidden width")
    p.add_argument("--mlp-out", type=int, default=10, help="MLP head output size (classes)")
    p.add_argument("--mlp-batch", type=int, default=256, help="MLP batch size")
    p.add_argument("--cnn-batch", type=int, default=128, help="CNN batch size")
    p.add_argument("--lr", type=float, default=0.01, help="SGD learning rate (both paths)")
    p.add_argument("--damping", type=float, default=1e-3, help="K-FAC damping")
    p.add_argument("--seed", type=int, default=0, help="torch seed (models and data)")
    p.add_argument("--profile", action="store_true", help="cProfile K-FAC steps of each kind")
    p.add_argument("--profile-steps", type=int, default=3, help="steps per profiled kind")
    p.add_argument("--verbose", action="store_true", help="log progress to stderr")
    args = p.parse_args(argv)
    try:
        args.intervals = [parse_intervals(v) for v in args.intervals]
    except argparse.ArgumentTypeError as e:
        p.error(str(e))
    if args.quick:
        args.width, args.mlp_batch, args.cnn_batch = 64, 16, 8
        args.reps, args.warmup, args.block, args.profile_steps = 2, 1, 2, 1
    if args.reps < 1 or args.warmup < 0 or args.threads < 1:
        p.error("--reps and --threads must be >= 1, --warmup >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)

    def log(msg: str) -> None:
        if args.verbose:
            print(msg, file=sys.stderr, flush=True)

    wls = workloads(args)
    kinds = sorted({k for iv in args.intervals for k in kind_weights(iv)}, reverse=True)
    print("kfac_func step-time benchmark: plain SGD vs kfac_func K-FAC, side by side")
    print(
        f"torch {torch.__version__} | kfac_func {kf.__version__} | python "
        f"{platform.python_version()} | threads {torch.get_num_threads()} | CPU {cpu_model()} "
        f"({platform.machine()}, {torch.get_num_threads()}/{os.cpu_count()} cores used)"
    )
    if args.quick:
        print("QUICK MODE: tiny models and 2 repetitions; a smoke test, not a measurement")
    print(f"method: {METHOD_WEIGHTED if args.method == 'weighted' else METHOD_CONSECUTIVE}")
    print(
        f"reps {args.reps}, warm-up {args.warmup} steps of each kind; SGD lr {args.lr} "
        f"momentum 0.9; K-FAC: kf.init defaults (fisher, eigen), damping {args.damping}, "
        "factor_decay 0.95, kl_clip 1e-3"
    )
    for wl in wls:
        print(f"  {wl.name}: {wl.description}")
    for iv in args.intervals:
        w = kind_weights(iv)
        share = ", ".join(f"{KIND_NAMES[k]} {v:.0%}" for k, v in w.items())
        print(f"  intervals {iv[0]}/{iv[1]}: {share} of K-FAC steps")
    print(flush=True)

    rows: list[Row] = []
    detail: list[list[str]] = []
    pairs = []
    for n, wl in enumerate(wls):
        pair = Pair(wl, args, args.seed + n)
        pairs.append(pair)
        log(f"{wl.name}: warm-up")
        warm_up(pair, kinds, args.warmup)
        if args.method == "weighted":
            s = measure_weighted(pair, kinds, args.reps, log)
            rows += rows_weighted(pair, s, args.intervals)
            sgd = median_ms(s.sgd)
            detail.append(
                [wl.name, "SGD", str(len(s.sgd)), f"{sgd:.1f}", f"{iqr_ms(s.sgd):.1f}", "", ""]
            )
            for k in kinds:
                ts = s.kfac[k]
                tot = [t.total for t in ts]
                detail.append(
                    [
                        wl.name,
                        f"K-FAC {KIND_NAMES[k]}",
                        str(len(ts)),
                        f"{median_ms(tot):.1f}",
                        f"{iqr_ms(tot):.1f}",
                        f"{median_ms([t.capture for t in ts]):.1f}",
                        f"{median_ms([t.update for t in ts]):.1f}",
                    ]
                )
        else:
            for iv in args.intervals:
                rows.append(measure_consecutive(pair, iv, args.reps, args.block, log))

    if detail:
        print("per step kind (medians):")
        print_table(["model", "step", "n", "ms", "IQR ms", "capture ms", "update ms"], detail)
        print()
    print("amortized step time (ms per step):")
    print_table(
        [
            "model",
            "intervals",
            "SGD ms",
            "K-FAC ms",
            "ratio K-FAC/SGD",
            "K-FAC capture ms",
            "K-FAC update ms",
        ],
        [
            [
                r.model,
                r.intervals,
                f"{r.sgd_ms:.1f}",
                f"{r.kfac_ms:.1f}",
                f"{r.ratio:.2f}",
                f"{r.capture_ms:.1f}",
                f"{r.update_ms:.1f}",
            ]
            for r in rows
        ],
    )
    print(
        "K-FAC ms = capture + update + writing p.grad + SGD.step; capture/update are "
        "amortized the same way as the total."
    )
    bad = [p.wl.name for p in pairs if not math.isfinite(p.sgd_loss + p.kfac_loss)]
    for p in pairs:
        print(f"final loss {p.wl.name}: SGD {p.sgd_loss:.4f}, K-FAC {p.kfac_loss:.4f}")
    if bad:
        print(f"WARNING: non-finite loss for {bad}; timings may not be representative")

    if args.profile:
        for pair in pairs:
            profile_kinds(pair, kinds, args.profile_steps, top=12)
    return 0


if __name__ == "__main__":
    sys.exit(main())
