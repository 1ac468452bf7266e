"""The orthogonal recipes' step, split into its stages, beside Muon's with its iteration in
bfloat16 (as the race runs it) and in float32, on the same model and batches.

``python benchmarks/orthogonal_stages.py`` times the race's language models (``lm``,
``lm4x``, ``gpt2``: ``race_workloads.py``'s builders) and writes
``benchmarks/results/orthogonal_stages.json``; ``--tables`` rewrites the table of
``docs/performance.md`` from it; ``--quick`` (tiny models, a temporary folder) is the
smoke test. Only ratios from one run compare.

Whole steps
-----------
Each optimizer (``muon``; ``muon-fp32``: the same step with the Newton–Schulz iteration in
float32, ``stage_arithmetic.Muon32``; the orthogonal recipes of ``optimizers.ORTHOGONAL``)
runs ``--warmup`` steps, then rounds of ``--steps`` training steps, the optimizers taking
turns round by round; a row is the median over the rounds of each round's mean
forward+backward and optimizer milliseconds per step (over a round of 20 steps: the
recipes' statistics on every other step and their powers once or twice, amortized).
Learning rates are the first of each optimizer's sweep (timing does not depend on them).

Stages of a recipe
------------------
On the recipe's state after the warm-up, each stage its own library call, timed apart over
the layers that take the orthogonalized step, stacked by shape as the step stacks them
(medians of ``--reps``):

- ``statistics``: the recipe's forward+backward minus Muon's (the hooks that build the
  factors' Grams, on the steps that update them);
- ``powers (per refresh)``: ``torch.linalg.eigh`` of the dense factors the step uses
  (batched by shape) and ``core.orthogonal.factor_powers``; ``amortized``: over the
  recipe's ``inv_update_steps``;
- ``powers applied``: ``core.orthogonal.apply_powers`` on the momenta's shapes, in the
  iteration's dtype;
- ``Newton–Schulz``: ``core.orthogonal.newton_schulz`` on the same stacks;
- ``rest``: the optimizer part minus the three above (momenta, gradients to matrices and
  back, stacking, the base optimizers, AdamW on the other parameters).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import optimizers
import race
import race_report as rr
import race_workloads as rw
from stage_arithmetic import float32_muon
from step_time import git_commit

from kfac_func.core.orthogonal import FactorPowers, apply_powers, factor_powers, newton_schulz

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
WORKLOADS = ("lm", "lm4x", "gpt2")
MARKERS = ("<!-- orthogonal-stages:start -->", "<!-- orthogonal-stages:end -->")
PAGE = ROOT / "docs" / "performance.md"
NAMES = ("muon", "muon-fp32", *optimizers.ORTHOGONAL)


def stepper(name: str, base: torch.nn.Module, w: rw.RaceWorkload) -> optimizers.Stepper:
    """The race's stepper of ``name`` on a copy of ``base`` (``muon-fp32``: Muon's, its
    matrices' optimizer replaced by ``stage_arithmetic.Muon32``)."""
    recipe = "muon" if name == "muon-fp32" else name
    st = optimizers.Stepper(recipe, copy.deepcopy(base), optimizers.LRS[recipe][0], w, 10**6)
    if name == "muon-fp32":
        float32_muon(st)
    return st


def train_steps(
    st: optimizers.Stepper, w: rw.RaceWorkload, gen: torch.Generator, n: int
) -> tuple[float, float]:
    """``n`` training steps: the mean forward+backward and optimizer milliseconds."""
    fb = opt = 0.0
    for _ in range(n):
        x, y = w.batch(gen)
        start = time.perf_counter()
        st.zero_grad()
        loss = w.loss(st.model(x), y)
        loss.backward()
        middle = time.perf_counter()
        st.step(x, y, loss.detach())
        end = time.perf_counter()
        fb, opt = fb + middle - start, opt + end - middle
    return 1e3 * fb / n, 1e3 * opt / n


def median_ms(fn: Callable[[], Any], reps: int) -> float:
    """The median milliseconds of ``fn()`` over ``reps`` calls (after one untimed)."""
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def recipe_stages(st: optimizers.Stepper, reps: int) -> dict[str, float]:
    """The stages of one recipe's step timed apart (see the module docstring)."""
    pre = st.pre
    assert pre is not None and pre.orthogonal is not None
    o = pre.orthogonal
    mine = [ls for ls in pre.state.layers.values() if ls.ortho_power is not None]
    shapes: dict[tuple[int, ...], list[Any]] = {}
    for ls in mine:
        shapes.setdefault(tuple(ls.spec.matrix_shape), []).append(ls)
    dtype = o.dtype or pre.factor_dtype

    def refresh() -> None:
        for group in shapes.values():
            for side in ("a_factor", "g_factor"):
                f = torch.stack([getattr(ls, side) for ls in group])
                if f.dim() == 3:
                    torch.linalg.eigh(f)
            for ls in group:
                factor_powers(ls.decomposition, o.powers, o.damping)

    def stack(ts: list[torch.Tensor | None]) -> torch.Tensor | None:
        return None if ts[0] is None else torch.stack(ts).to(dtype)  # type: ignore[arg-type]

    stacks = {
        s: (
            torch.randn(len(g), *s, dtype=dtype),
            FactorPowers(
                stack([ls.ortho_power.a for ls in g]), stack([ls.ortho_power.g for ls in g])
            ),
        )
        for s, g in shapes.items()
    }

    def applied() -> None:
        for m, powers in stacks.values():
            apply_powers(m, powers)

    def orthogonalized() -> None:
        for m, _ in stacks.values():
            newton_schulz(m, o.steps)

    per_refresh = median_ms(refresh, reps)
    return {
        "powers_per_refresh_ms": per_refresh,
        "powers_ms": per_refresh / pre.inv_update_steps,
        "powers_applied_ms": median_ms(applied, reps),
        "newton_schulz_ms": median_ms(orthogonalized, reps),
    }


def time_workload(w: rw.RaceWorkload, args: argparse.Namespace) -> dict[str, Any]:
    """Whole steps of every optimizer of :data:`NAMES` and the stages of each recipe."""
    torch.manual_seed(args.seed)
    base = w.make()
    steppers = {name: stepper(name, base, w) for name in NAMES}
    gens = {name: torch.Generator().manual_seed(args.seed) for name in NAMES}
    for name, st in steppers.items():
        train_steps(st, w, gens[name], args.warmup)
    rounds: dict[str, list[tuple[float, float]]] = {name: [] for name in NAMES}
    for _ in range(args.rounds):
        for name, st in steppers.items():
            rounds[name].append(train_steps(st, w, gens[name], args.steps))
    rows = []
    for name in NAMES:
        fb = statistics.median(r[0] for r in rounds[name])
        opt = statistics.median(r[1] for r in rounds[name])
        rows.append({"name": name, "fwd_bwd_ms": fb, "optimizer_ms": opt, "whole_ms": fb + opt})
    whole = {r["name"]: r["whole_ms"] for r in rows}
    for r in rows:
        r["to_muon"] = r["whole_ms"] / whole["muon"]
        r["to_muon_fp32"] = r["whole_ms"] / whole["muon-fp32"]
    muon_fb = next(r["fwd_bwd_ms"] for r in rows if r["name"] == "muon")
    for r in rows:
        if r["name"] in optimizers.ORTHOGONAL:
            stages = recipe_stages(steppers[r["name"]], args.reps)
            stages["statistics_ms"] = r["fwd_bwd_ms"] - muon_fb
            parts = ("powers_ms", "powers_applied_ms", "newton_schulz_ms")
            stages["rest_ms"] = r["optimizer_ms"] - sum(stages[k] for k in parts)
            r["stages"] = stages
    return {"description": w.description, "rows": rows}


def render(doc: dict[str, Any]) -> str:
    """The Markdown table of a results ``doc``."""
    run = doc["run"]
    lines = [
        "Results: `benchmarks/results/orthogonal_stages.json` "
        "(`python benchmarks/orthogonal_stages.py`).",
        "<!-- settings -->",
        f"CPU `{run['machine']['cpu']}`, {run['machine']['threads']} thread(s), "
        f"{run['steps']} steps a round, {run['rounds']} rounds, {rr.commit_phrase(run)}.",
        "",
        "| workload | optimizer | fwd+bwd ms | optimizer ms | whole ms | × Muon's | "
        "× Muon's (float32) | statistics | powers (per refresh) | powers applied | "
        "Newton–Schulz | rest |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for w, part in doc["workloads"].items():
        for r in part["rows"]:
            st = r.get("stages")
            cells = (
                ["-"] * 5
                if st is None
                else [
                    f"{st['statistics_ms']:.1f}",
                    f"{st['powers_ms']:.1f} ({st['powers_per_refresh_ms']:.1f})",
                    f"{st['powers_applied_ms']:.1f}",
                    f"{st['newton_schulz_ms']:.1f}",
                    f"{st['rest_ms']:.1f}",
                ]
            )
            lines.append(
                f"| {w} | {r['name']} | {r['fwd_bwd_ms']:.1f} | {r['optimizer_ms']:.1f} | "
                f"{r['whole_ms']:.1f} | {r['to_muon']:.2f} | {r['to_muon_fp32']:.2f} | "
                + " | ".join(cells)
                + " |"
            )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="smoke test: tiny models, few steps")
    p.add_argument(
        "--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS),
        help="the race's language models to time (default: all three)",
    )  # fmt: skip
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    p.add_argument("--warmup", type=int, default=12, help="untimed steps first (default 12)")
    p.add_argument("--steps", type=int, default=20, help="training steps a round (default 20)")
    p.add_argument("--rounds", type=int, default=3, help="rounds, median taken (default 3)")
    p.add_argument("--reps", type=int, default=5, help="repetitions of a stage (default 5)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and batches")
    p.add_argument("--out", default=None, help="the JSON written")
    p.add_argument(
        "--tables", action="store_true",
        help="rewrite the table of docs/performance.md from the committed results and exit",
    )  # fmt: skip
    args = p.parse_args(argv)
    if args.quick:
        args.warmup, args.steps, args.rounds, args.reps = 2, 2, 1, 1
    if args.out is None:
        folder = Path(tempfile.mkdtemp()) if args.quick else RESULTS
        args.out = str(folder / "orthogonal_stages.json")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.tables:
        doc = json.loads((RESULTS / "orthogonal_stages.json").read_text())
        changed = rr.replace_block(PAGE, MARKERS, render(doc))
        print(f"{PAGE}: orthogonal stages table {'rewritten' if changed else 'unchanged'}")
        return 0
    checkout = git_commit(race.REWRITTEN)
    previous = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    try:
        info = race.machine(args.threads)
        workloads = {}
        for wname in args.workloads:
            workloads[wname] = time_workload(rw.WORKLOADS[wname](args.quick), args)
            print(wname, json.dumps(workloads[wname]["rows"], indent=1), flush=True)
    finally:
        torch.set_num_threads(previous)
    run = {
        "command": " ".join(
            ["python", "benchmarks/orthogonal_stages.py", *(sys.argv[1:] if argv is None else argv)]
        ),
        **checkout,
        "machine": info,
        "steps": args.steps,
        "rounds": args.rounds,
        "seconds": time.perf_counter() - started,
    }
    doc = {
        "benchmark": "orthogonal_stages",
        "quick": args.quick,
        "run": run,
        "workloads": workloads,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1, allow_nan=False) + "\n")
    print(render(doc))
    print(f"\nwrote {out} ({run['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
