"""K-FAC meets Muon: the orthogonal recipes raced per second against Muon, SOAP, AdamW and
the recommended K-FAC recipe.

Muon's step costs little more than AdamW's and reaches the race's finals 1.3–4.4× sooner
in seconds than the recommended K-FAC recipe (Adam's step in K-FAC's eigenbasis), which is
ahead per step. The orthogonal recipes of ``kf.KFAC`` (``kfac_func.RECIPES``) keep Muon's
cheap step and give it K-FAC's curvature: the hidden matrices' Nesterov momentum,
preconditioned by powers of their damped factors, orthogonalized by Newton–Schulz (see
``kfac_func/step/orthogonal.py``). Raced here:

- ``kfac-muon`` (the recipe ``"orthogonal-two-sided"`` with a one-sided
  ``kf.Orthogonal``; the recipe ``"orthogonal"`` until it was retired): one-sided,
  ``U (A + δI)^(-p)``, G not built (diagonal); second knob ``p`` ∈ {1/2, 1};
- ``kfac-muon-two-sided`` (``"orthogonal-two-sided"``): ``(G + δI)^(-q) U (A + δI)^(-q)``,
  second knob ``q`` ∈ {1/4, 1/2};
- ``kfac-muon-kfac-head`` (``"orthogonal-kfac-head"``): the head, embeddings and norms on
  Adam's step in K-FAC's eigenbasis instead of AdamW; second knob its sidedness (one-sided
  ``p`` 1/2, or two-sided 1/4).

``python benchmarks/orthogonal_race.py`` runs the race's ``lm``, ``lm4x``, ``gpt2`` and
``digits`` (``race_workloads.py``'s builders): each recipe with the race's tuning budget
(``race.race``: the same grid, knob and refinement as every raced optimizer) on the tuning
seed, its best setting on the evaluation seeds; AdamW, Muon, SOAP and
``kfac-moments-fresh`` at the settings the committed race tuned
(``benchmarks/results/race_<workload>.json``) on the same evaluation seeds, in the same
process (only ratios from one run compare). It writes
``benchmarks/results/orthogonal_race.json``; ``--tables`` rewrites the table of
``docs/benchmarks.md`` from it. ``--quick`` is the smoke test (tiny models, one seed, a
temporary folder).

Per workload and optimizer: the final test loss (mean, min–max over the seeds), the
forward+backward and optimizer milliseconds per step, the whole step against Muon's, and
the seconds and steps to Muon's and SOAP's mean final loss with the ratio to that
competitor's whole run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import optimizers
import race
import race_report as rr
import race_workloads as rw
import schedules
from step_time import git_commit

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
WORKLOADS = ("lm", "lm4x", "gpt2", "digits")
RECIPES = tuple(optimizers.ORTHOGONAL)
COMPETITORS = ("adamw", "muon", "soap", rr.NARROW)
PAGE = ROOT / "docs" / "benchmarks.md"


@dataclass(frozen=True)
class Challenge:
    """Recipes raced against the committed race's tuned competitors: the results file's
    name (``benchmark``, also the script's), the recipes, the comments around their table
    in ``docs/benchmarks.md`` and the workloads."""

    benchmark: str
    recipes: tuple[str, ...]
    markers: tuple[str, str]
    workloads: tuple[str, ...] = WORKLOADS


ORTHOGONAL_RACE = Challenge(
    "orthogonal_race", RECIPES, ("<!-- orthogonal:start -->", "<!-- orthogonal:end -->")
)
MARKERS = ORTHOGONAL_RACE.markers
"""The comments around the orthogonal recipes' table of ``docs/benchmarks.md``."""


def competitor_runs(wname: str, w: rw.RaceWorkload, seeds: list[int]) -> list[dict[str, Any]]:
    """Each competitor at the committed race's tuned setting, on ``seeds``."""
    runs = []
    for name in COMPETITORS:
        lr, settings = schedules.tuned(RESULTS, wname, name)
        for seed in seeds:
            runs.append(race.run_once(name, lr, settings, w, seed, "eval"))
    return runs


def step_ratios(rows: list[dict[str, Any]]) -> None:
    """Add each row's whole step (forward+backward and optimizer) over Muon's (in place)."""
    muon = next((r for r in rows if r["name"] == "muon"), None)
    if muon is None:
        return
    whole = muon["fwd_bwd_ms"] + muon["optimizer_ms"]
    for r in rows:
        r["step_to_muon"] = (r["fwd_bwd_ms"] + r["optimizer_ms"]) / whole


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The summary rows of one workload's evaluation runs (:func:`schedules.summary`'s,
    with the whole step over Muon's and each recipe's tuned setting)."""
    evals = [{**r, "name": r["optimizer"]} for r in runs if r["phase"] == "eval"]
    rows = schedules.summary(evals)
    step_ratios(rows)
    for r in rows:
        own = next(e for e in evals if e["name"] == r["name"])
        r["lr"], r["settings"] = own["lr"], own["settings"]
    return rows


def print_table(wname: str, rows: list[dict[str, Any]]) -> None:
    """The summary rows of one workload as a text table."""
    schedules.print_table(wname, rows)
    print("whole step / Muon's: " + ", ".join(f"{r['name']} {r['step_to_muon']:.2f}" for r in rows))


def _reach(r: dict[str, Any], c: str) -> str:
    """A cell: the seconds and steps to competitor ``c``'s final, with the ratio."""
    if f"seconds_to_{c}" not in r:
        return "-"
    if r[f"seconds_to_{c}"] is None:
        return f"never ({r[f'reached_to_{c}']})"
    return (
        f"{r[f'seconds_to_{c}']:.1f} s, {r[f'steps_to_{c}']:.0f} steps ({r[f'ratio_to_{c}']:.2f}×)"
    )


def render(doc: dict[str, Any], challenge: Challenge = ORTHOGONAL_RACE) -> str:
    """The Markdown table of a results ``doc``."""
    runs = [rr.run_phrase(w, part["run"]) for w, part in doc["workloads"].items()]
    name = challenge.benchmark
    lines = [
        f"Results: `benchmarks/results/{name}.json` (`python benchmarks/{name}.py`).",
        "<!-- settings -->",
        "; ".join(runs) + ".",
        "",
        "| workload | optimizer | lr, knob | final test loss | min–max | fwd+bwd ms | "
        "optimizer ms | step × Muon's | to Muon's final (× its run) | "
        "to SOAP's final (× its run) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for w, part in doc["workloads"].items():
        for r in part["summary"]:
            knob = ", ".join(f"{k} {v}" for k, v in r["settings"].items())
            lines.append(
                f"| {w} | {r['name']} | {r['lr']:g}, {knob} | {r['final_mean']:.4f} | "
                f"{r['final_min']:.4f}–{r['final_max']:.4f} | {r['fwd_bwd_ms']:.1f} | "
                f"{r['optimizer_ms']:.1f} | {r['step_to_muon']:.2f} | {_reach(r, 'muon')} | "
                f"{_reach(r, 'soap')} |"
            )
    return "\n".join(lines)


def write_table(page: Path, results: Path, challenge: Challenge = ORTHOGONAL_RACE) -> bool:
    """Rewrite the block of ``page`` from ``results``; whether it changed."""
    doc = json.loads(results.read_text())
    return rr.replace_block(page, challenge.markers, render(doc, challenge))


def parse_args(
    argv: list[str] | None = None, challenge: Challenge = ORTHOGONAL_RACE
) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="smoke test: tiny models, one seed")
    p.add_argument(
        "--workloads",
        nargs="+",
        choices=challenge.workloads,
        default=list(challenge.workloads),
        help="the workloads run (default: all); the others already in the results file are kept",
    )
    p.add_argument(
        "--recipes",
        nargs="+",
        choices=challenge.recipes,
        default=list(challenge.recipes),
        help="the recipes raced",
    )
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3], help="evaluation seeds")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    p.add_argument("--out", default=None, help="the JSON written")
    p.add_argument(
        "--tables",
        action="store_true",
        help="rewrite the table of docs/benchmarks.md from the committed results and exit",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.seeds = args.seeds[:1]
    rr.settle_out(args, RESULTS, f"{challenge.benchmark}.json", p.error)
    return args


def main(argv: list[str] | None = None, challenge: Challenge = ORTHOGONAL_RACE) -> int:
    args = parse_args(argv, challenge)
    name = challenge.benchmark
    if args.tables:
        changed = write_table(PAGE, RESULTS / f"{name}.json", challenge)
        print(f"{PAGE}: {name} table {'rewritten' if changed else 'unchanged'}")
        return 0
    started = time.perf_counter()
    checkout = git_commit(race.REWRITTEN)
    previous = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    tuning = race.tuning_budget(
        args.recipes,
        args.seeds,
        2 if args.quick else rw.LR_POINTS,
        1 if args.quick else rw.REFINE_POINTS,
    )

    workloads: dict[str, Any] = {}
    try:
        info = race.machine(args.threads)
        print(f"torch {info['torch']} | {info['cpu']} | threads {args.threads}", flush=True)
        for wname in args.workloads:
            w = rw.WORKLOADS[wname](args.quick)
            runs = race.race(w, tuning, race.print_run) + competitor_runs(wname, w, args.seeds)
            rows = summarize(runs)
            print_table(wname, rows)
            workloads[wname] = {"description": w.description, "summary": rows, "runs": runs}
    finally:
        torch.set_num_threads(previous)
    run = {
        "command": " ".join(
            ["python", f"benchmarks/{name}.py", *(sys.argv[1:] if argv is None else argv)]
        ),
        **checkout,
        "machine": info,
        "seeds": args.seeds,
        "seconds": time.perf_counter() - started,
    }
    out = Path(args.out)
    parts = {w: {**part, "run": run} for w, part in workloads.items()}
    result = schedules.merged(out, parts, args.quick, benchmark=name, order=challenge.workloads)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, allow_nan=False) + "\n")
    print(f"\nwrote {out} ({run['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
