"""The recipe's stages after the statistics, tried with bfloat16 products: kept or not.

``python benchmarks/basis_precision.py`` trains the recommended recipe (the race's
``kfac-moments-wide``) on ``lm4x`` under bfloat16 autocast, at the setting the committed
bfloat16 race tuned for it (``benchmarks/results/race_lm4x_bf16.json``), on the race's
evaluation seeds, once as the library computes it and once for each stage below with its
matrix products from bfloat16 operands (accumulated in float32, results in float32, as
``torch.autocast`` runs a product), and writes ``benchmarks/results/basis_precision.json``
with each run's final test loss and the seconds of its forward+backward and optimizer
parts. ``--quick`` (the race's tiny model, a few steps, a temporary folder) is the smoke
test of the tests. Refused where the CPU does not multiply bfloat16 natively.

The stages (``lm4x``'s 768-wide MLP layers take Muon's step on K-FAC's input curvature,
the others Adam's step in K-FAC's eigenbasis):

- ``projections``: the gradient into the eigenbasis and the step back out
  (``kfac_func.core.basis_moments.to_basis`` and ``from_basis``), every step;
- ``carry``: the moments carried into a new eigenbasis (``R = Q_newᵀ Q_old`` and the
  products with it, ``basis_moments._overlap`` and ``_sandwich``), at each decomposition;
- ``powers``: the wide layers' damped factor powers ``Q diag(d^-p) Qᵀ``
  (``kfac_func.step.orthogonal.factor_powers``), at each decomposition;
- ``all``: the three together.

The eigendecompositions stay float32 (LAPACK has no bfloat16 ``eigh``). The wide layers'
momentum times their powers and its Newton–Schulz iteration run in bfloat16 already where
the CPU multiplies it natively (``kf.KFAC``'s ``Orthogonal.dtype``, as
``torch.optim.Muon``'s). The variants
replace the library's functions for the length of a run (``bfloat16_stage``); they are
not options of the library. A stage is adopted only where its runs tie the float32 runs
(the min–max ranges of the seeds' final losses overlap) *and* its optimizer part is at
least a twentieth faster; otherwise it stays float32, and the docs say what was tried.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]  # this checkout's kfac_func
import optimizers  # noqa: E402
import race  # noqa: E402
import race_report as rr  # noqa: E402
import race_workloads as rw  # noqa: E402
from stage_arithmetic import bf16_flags  # noqa: E402
from step_time import checked_out  # noqa: E402

import kfac_func.core.basis_moments as basis_moments  # noqa: E402
import kfac_func.step.orthogonal as step_orthogonal  # noqa: E402
from kfac_func.core.orthogonal import FactorPowers, damped_power  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
RECIPE = "kfac-moments-wide"
STAGES = ("projections", "carry", "powers", "all")
FASTER = 0.95
"""A stage is adopted where it ties and its optimizer part takes at most this share of the
float32 one's."""


def product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` from bfloat16 operands, in float32 (what autocast does to a product).

    Example:
        >>> product(torch.ones(2, 3), torch.ones(3, 1)).dtype
        torch.float32
    """
    return (a.to(torch.bfloat16) @ b.to(torch.bfloat16)).float()


def _to_basis(m: torch.Tensor, qa: torch.Tensor | None, qg: torch.Tensor | None) -> torch.Tensor:
    v = m if qg is None else product(qg.mT, m)
    return v if qa is None else product(v, qa)


def _from_basis(v: torch.Tensor, qa: torch.Tensor | None, qg: torch.Tensor | None) -> torch.Tensor:
    out = v if qg is None else product(qg, v)
    return out if qa is None else product(out, qa.mT)


def _overlap(new: torch.Tensor | None, old: torch.Tensor | None) -> torch.Tensor | None:
    if new is None or old is None:
        return basis_moments_originals["_overlap"](new, old)
    return product(new.mT, old)


def _sandwich(m: torch.Tensor, ra: torch.Tensor | None, rg: torch.Tensor | None) -> torch.Tensor:
    out = m if rg is None else product(rg, m)
    return out if ra is None else product(out, ra.mT)


def _factor_powers(
    decomposition: Any, powers: tuple[float, float], damping: float, a_width: int | None = None
) -> FactorPowers:
    def side(q: Any, d: torch.Tensor, power: float, width: int | None = None) -> Any:
        if power == 0:
            return None
        scale = damped_power(d, power, damping, width)
        return scale if q is None else product(q * scale.unsqueeze(-2), q.mT)

    d = decomposition
    return FactorPowers(side(d.qa, d.da, powers[0], a_width), side(d.qg, d.dg, powers[1]))


basis_moments_originals = {
    name: getattr(basis_moments, name) for name in ("to_basis", "from_basis", "_overlap")
}

REPLACED: dict[str, list[tuple[Any, str, Callable[..., Any]]]] = {
    "projections": [
        (basis_moments, "to_basis", _to_basis),
        (basis_moments, "from_basis", _from_basis),
    ],
    "carry": [(basis_moments, "_overlap", _overlap), (basis_moments, "_sandwich", _sandwich)],
    "powers": [
        (step_orthogonal, "factor_powers", _factor_powers),
    ],
}
"""Each stage's library functions and their bfloat16-product replacements."""


@contextlib.contextmanager
def bfloat16_stage(stage: str) -> Iterator[None]:
    """The library's functions of ``stage`` (a key of :data:`REPLACED`, ``"all"``, or
    ``"float32"``: none) replaced by their bfloat16-product versions while it lasts.

    Example:
        >>> with bfloat16_stage("projections"):
        ...     basis_moments.to_basis is _to_basis
        True
        >>> basis_moments.to_basis is _to_basis
        False
    """
    stages = list(REPLACED) if stage == "all" else [s for s in (stage,) if s in REPLACED]
    swaps = [swap for s in stages for swap in REPLACED[s]]
    saved = [(module, name, getattr(module, name)) for module, name, _ in swaps]
    try:
        for module, name, fn in swaps:
            setattr(module, name, fn)
        yield
    finally:
        for module, name, fn in saved:
            setattr(module, name, fn)


def tuned_setting(path: Path) -> tuple[float, dict[str, Any]]:
    """The recipe's learning rate and settings on its evaluation seeds in the race file."""
    runs = json.loads(path.read_text())["runs"]
    run = next(r for r in runs if r["optimizer"] == RECIPE and r["phase"] == "eval")
    return float(run["lr"]), dict(run["settings"])


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row a stage: the seeds' final losses (mean, min, max), the milliseconds per step
    of the forward+backward and the optimizer part, the optimizer part over float32's,
    whether the losses tie float32's, and whether the stage is adopted."""
    rows = []
    for stage in ("float32", *STAGES):
        mine = [r for r in runs if r["stage"] == stage]
        if not mine:
            continue
        finals = [r["final"] for r in mine]
        steps = sum(r["steps"] for r in mine)
        rows.append(
            {
                "stage": stage,
                "final_mean": statistics.fmean(finals),
                "final_min": min(finals),
                "final_max": max(finals),
                "fwd_bwd_ms": 1e3 * sum(r["fwd_bwd_seconds"] for r in mine) / steps,
                "optimizer_ms": 1e3 * sum(r["optimizer_seconds"] for r in mine) / steps,
            }
        )
    base = rows[0]
    for row in rows:
        row["optimizer_over_float32"] = row["optimizer_ms"] / base["optimizer_ms"]
        row["ties_float32"] = (
            row["final_min"] <= base["final_max"] and base["final_min"] <= row["final_max"]
        )
        row["adopted"] = bool(
            row["stage"] != "float32"
            and row["ties_float32"]
            and row["optimizer_over_float32"] <= FASTER
        )
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="smoke test: tiny model, few steps")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3], help="evaluation seeds")
    p.add_argument("--out", default=None, help="the JSON written (default: the results)")
    p.add_argument(
        "--require-clean",
        action="store_true",
        help="refuse to run when tracked files outside the results differ from the commit",
    )
    args = p.parse_args(argv)
    if not optimizers.NATIVE_BF16:
        p.error("this CPU does not multiply bfloat16 natively (no amx_bf16 or avx512_bf16)")
    rr.settle_out(args, RESULTS, "basis_precision.json", p.error)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    checkout = checked_out(("benchmarks/results",), args.require_clean)
    if checkout is None:
        return 2
    lr, settings = tuned_setting(RESULTS / "race_lm4x_bf16.json")
    w = dataclasses.replace(rw.WORKLOADS["lm4x"](args.quick), autocast=True)
    seeds = args.seeds[:1] if args.quick else args.seeds
    runs = []
    previous = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        for stage in ("float32", *STAGES):
            for seed in seeds:
                with bfloat16_stage(stage):
                    rows, split = optimizers.train(RECIPE, lr, w, seed, w.eval_every, settings)
                final = rows[-1]["test_loss"]
                runs.append({"stage": stage, "seed": seed, "final": final, **split})
                print(f"{stage:12s} seed {seed}: final {final:.4f}", flush=True)
    finally:  # a caller in this process (the tests) keeps its thread count
        torch.set_num_threads(previous)
    summary = summarize(runs)
    for row in summary:
        print(
            f"{row['stage']:12s} {row['final_mean']:.4f} ({row['final_min']:.4f}–"
            f"{row['final_max']:.4f})  fwd+bwd {row['fwd_bwd_ms']:.1f} ms  optimizer "
            f"{row['optimizer_ms']:.1f} ms ({row['optimizer_over_float32']:.2f}x)  "
            f"{'tie' if row['ties_float32'] else 'apart'}, "
            f"{'adopted' if row['adopted'] else 'not adopted'}"
        )
    doc = {
        "benchmark": "basis_precision",
        "quick": args.quick,
        "command": "python benchmarks/basis_precision.py " + " ".join(argv or sys.argv[1:]),
        **checkout,
        "machine": race.machine(args.threads),
        "bf16_flags": bf16_flags(),
        "workload": "lm4x_bf16",
        "recipe": RECIPE,
        "lr": lr,
        "settings": settings,
        "seeds": seeds,
        "runs": runs,
        "summary": summary,
        "seconds": time.perf_counter() - started,
    }
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
