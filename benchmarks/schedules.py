"""What the recommended recipe's schedule buys: cheaper schedules raced against it.

The recommended K-FAC recipe (``kfac-moments-fresh``: factor statistics every step,
an ``eigh`` of every factor every other step) costs several times Muon's step on the
race's language models. Most of that is the statistics and the decompositions, and the
obvious ways to make them cheaper are schedules: fewer decompositions, statistics on
fewer steps. This benchmark measures what each costs in loss and
saves in seconds, against Muon and SOAP run in the same process on the same seeds.

``python benchmarks/schedules.py`` runs the race's ``lm``, ``lm4x`` and ``gpt2``
(``race_workloads.py``'s builders) with every optimizer at the setting the committed race
tuned (``benchmarks/results/race_<workload>.json``: learning rate and second knob; the
schedules use the recipe's), on the race's evaluation seeds, and writes
``benchmarks/results/schedules.json``. ``--quick`` is the smoke test (tiny models, one
seed, a temporary folder). Only ratios from one run compare.

The schedules (each replaces settings of the recipe's preconditioner, nothing else):

- ``recipe``: the recipe as the race runs it;
- ``eigh every 4`` / ``eigh every 10``: ``inv_update_steps`` 4 or 10 (the eigenbases two
  to five times as old, on average);
- ``statistics every 2 steps``: ``factor_update_steps=2`` with ``factor_decay=0.81``
  (the same memory in steps as 0.9 every step; the hooks build no statistics on the
  other steps).

The committed results also hold ``statistics from a quarter of the rows``: ``factor_rows``
a quarter of each call's rows (every 4th position, scaled), a setting since retired; the
table renders it as it was run.

Per workload and schedule: the final test loss over the seeds (mean, min–max), the
forward+backward and optimizer milliseconds per step, and the training seconds and
steps to Muon's and SOAP's mean final loss of this run, with the ratio to that
competitor's whole run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import optimizers
import race
import race_report as rr
import race_workloads as rw
from step_time import git_commit

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
WORKLOADS = ("lm", "lm4x", "gpt2")
COMPETITORS = ("muon", "soap")


def schedules() -> dict[str, dict[str, Any]]:
    """The schedules raced: name -> the preconditioner settings replacing the recipe's.

    Example:
        >>> schedules()["eigh every 4"]
        {'inv_update_steps': 4}
    """
    return {
        "recipe": {},
        "eigh every 4": {"inv_update_steps": 4},
        "eigh every 10": {"inv_update_steps": 10},
        "statistics every 2 steps": {"factor_update_steps": 2, "factor_decay": 0.81},
    }


def tuned(results: Path, workload: str, name: str) -> tuple[float, dict[str, Any]]:
    """The learning rate and settings the committed race chose for ``name``."""
    doc = json.loads((results / f"race_{workload}.json").read_text())
    row = next(r for r in doc["summary"]["rows"] if r["optimizer"] == name)
    settings = {k: tuple(v) if isinstance(v, list) else v for k, v in row["settings"].items()}
    return row["lr"], settings


def summary(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per schedule and competitor of one workload's ``runs``."""
    finals: dict[str, list[float]] = {}
    for r in runs:
        finals.setdefault(r["name"], []).append(rr.final_loss(r["rows"]))
    targets = {c: statistics.mean(finals[c]) for c in COMPETITORS if c in finals}
    mine = {name: [r for r in runs if r["name"] == name] for name in finals}
    costs = {name: rr.run_costs(own) for name, own in mine.items()}
    out = []
    for name, f in finals.items():
        cost = costs[name]
        row: dict[str, Any] = {
            "name": name,
            "final_mean": rr.json_float(statistics.mean(f)),
            "final_min": rr.json_float(min(f)),
            "final_max": rr.json_float(max(f)),
            "fwd_bwd_ms": cost["fwd_bwd_ms"],
            "optimizer_ms": cost["optimizer_ms"],
            "train_seconds": cost["train_seconds"],
        }
        for c, target in targets.items():
            if c == name:  # a competitor against its own mean: not a target
                continue
            reach = rr.time_to_target([r["rows"] for r in mine[name]], target)
            row[f"seconds_to_{c}"] = reach["seconds"]
            row[f"steps_to_{c}"] = reach["steps"]
            row[f"reached_to_{c}"] = f"{reach['reached']}/{reach['seeds']}"
            whole = costs[c]["train_seconds"]
            row[f"ratio_to_{c}"] = None if reach["seconds"] is None else reach["seconds"] / whole
        out.append(row)
    return out


def print_table(workload: str, rows: list[dict[str, Any]]) -> None:
    """The summary rows of one workload as a text table."""
    print(f"\n{workload}")
    head = f"{'schedule':40s} {'final':>7s} {'min-max':>15s} {'fb ms':>7s} {'opt ms':>7s}"
    head += "".join(f" {'s to ' + c:>9s} {'x its run':>9s}" for c in COMPETITORS)
    print(head)
    for r in rows:
        line = (
            f"{r['name']:40s} {r['final_mean']:7.4f} {r['final_min']:7.4f}-{r['final_max']:.4f}"
            f" {r['fwd_bwd_ms']:7.1f} {r['optimizer_ms']:7.1f}"
        )
        for c in COMPETITORS:
            if f"seconds_to_{c}" not in r:  # the competitor itself
                line += f" {'-':>9s} {'-':>9s}"
                continue
            s, q = r[f"seconds_to_{c}"], r[f"ratio_to_{c}"]
            line += f" {'never' if s is None else f'{s:.1f}':>9s}"
            line += f" {'-' if q is None else f'{q:.2f}':>9s}"
        print(line, flush=True)


MARKERS = ("<!-- schedules:start -->", "<!-- schedules:end -->")
"""The comments around the table of ``docs/performance.md`` that ``--tables`` rewrites."""
PAGE = ROOT / "docs" / "performance.md"


def render(doc: dict[str, Any]) -> str:
    """The Markdown table of a results ``doc``: per workload and schedule, the final test
    loss (mean, min–max), the milliseconds per step, and the seconds to Muon's and SOAP's
    final loss with the ratio to their whole run."""
    runs = [rr.run_phrase(w, part.get("run", doc)) for w, part in doc["workloads"].items()]
    lines = [
        "Results: `benchmarks/results/schedules.json` (`python benchmarks/schedules.py`).",
        "<!-- settings -->",
        "; ".join(runs) + ".",
        "",
        "| workload | schedule | final test loss | min–max | fwd+bwd ms | optimizer ms | "
        "s to Muon's final (× its run) | s to SOAP's final (× its run) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for w, part in doc["workloads"].items():
        for r in part["summary"]:
            cells = []
            for c in COMPETITORS:
                if f"seconds_to_{c}" not in r:
                    cells.append("-")
                elif r[f"seconds_to_{c}"] is None:
                    cells.append(f"never ({r[f'reached_to_{c}']})")
                else:
                    cells.append(f"{r[f'seconds_to_{c}']:.1f} ({r[f'ratio_to_{c}']:.2f}×)")
            lines.append(
                f"| {w} | {r['name']} | {r['final_mean']:.4f} | {r['final_min']:.4f}–"
                f"{r['final_max']:.4f} | {r['fwd_bwd_ms']:.1f} | {r['optimizer_ms']:.1f} | "
                + " | ".join(cells)
                + " |"
            )
    return "\n".join(lines)


def block_of(page: str) -> str | None:
    """The text between :data:`MARKERS` in ``page`` (None without them)."""
    return rr.block_between(page, MARKERS)


def write_table(page: Path, results: Path) -> bool:
    """Rewrite the block of ``page`` from ``results``; whether it changed."""
    return rr.replace_block(page, MARKERS, render(json.loads(results.read_text())))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="smoke test: tiny models, one seed")
    p.add_argument(
        "--workloads",
        nargs="+",
        choices=WORKLOADS,
        default=list(WORKLOADS),
        help="the race's language models to run (default: all three); the others already "
        "in the results file are kept",
    )
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3], help="the seeds run")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    p.add_argument("--out", default=None, help="the JSON written")
    p.add_argument(
        "--tables",
        action="store_true",
        help="rewrite the table of docs/performance.md from the committed results and exit",
    )
    p.add_argument(
        "--resummarize",
        action="store_true",
        help="recompute the summaries of the committed results from their runs (with this "
        "commit's rules, recorded as summarized_by) and exit",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.seeds = args.seeds[:1]
    rr.settle_out(args, RESULTS, "schedules.json", p.error)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.resummarize:
        path = RESULTS / "schedules.json"
        doc = json.loads(path.read_text())
        for part in doc["workloads"].values():
            part["summary"] = summary(part["runs"])
        doc["summarized_by"] = git_commit(race.REWRITTEN)["commit"]
        path.write_text(json.dumps(doc, indent=1, allow_nan=False) + "\n")
        print(f"{path}: summaries recomputed from its runs")
        return 0
    if args.tables:
        changed = write_table(PAGE, RESULTS / "schedules.json")
        print(f"{PAGE}: schedules table {'rewritten' if changed else 'unchanged'}")
        return 0
    started = time.perf_counter()
    checkout = git_commit(race.REWRITTEN)
    previous = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    workloads: dict[str, Any] = {}
    try:
        info = race.machine(args.threads)
        print(f"torch {info['torch']} | {info['cpu']} | threads {args.threads}", flush=True)
        for wname in args.workloads:
            w = rw.WORKLOADS[wname](args.quick)
            lr, base = tuned(RESULTS, wname, rr.NARROW)
            plan = [(c, *tuned(RESULTS, wname, c), c) for c in COMPETITORS]
            for name, extra in schedules().items():
                plan.append((name, lr, {**base, **extra}, rr.NARROW))
            runs = []
            for name, rate, settings, optimizer in plan:
                for seed in args.seeds:
                    rows, split = optimizers.train(
                        optimizer, rate, w, seed, w.eval_every, dict(settings)
                    )
                    runs.append(
                        {
                            "name": name,
                            "optimizer": optimizer,
                            "lr": rate,
                            "settings": settings,
                            "seed": seed,
                            "rows": [
                                {**r, "test_loss": rr.json_float(r["test_loss"])} for r in rows
                            ],
                            **split,
                        }
                    )
            rows = summary(runs)
            print_table(wname, rows)
            workloads[wname] = {"description": w.description, "summary": rows, "runs": runs}
    finally:
        torch.set_num_threads(previous)
    run = {
        "command": " ".join(
            ["python", "benchmarks/schedules.py", *(sys.argv[1:] if argv is None else argv)]
        ),
        **checkout,
        "machine": info,
        "seeds": args.seeds,
        "seconds": time.perf_counter() - started,
    }
    out = Path(args.out)
    result = merged(out, {w: {**part, "run": run} for w, part in workloads.items()}, args.quick)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**result, **run}, indent=1, allow_nan=False) + "\n")
    print(f"\nwrote {out} ({run['seconds']:.0f} s)")
    return 0


def merged(
    out: Path,
    workloads: dict[str, Any],
    quick: bool,
    *,
    benchmark: str = "schedules",
    order: tuple[str, ...] = WORKLOADS,
) -> dict[str, Any]:
    """The results document of ``benchmark`` with ``workloads`` (each with its own
    ``run``: command, commit, machine, seeds, seconds) in place of those of the same name
    in ``out``, the other workloads of ``out`` kept, in ``order`` (a rerun of one workload
    replaces it alone; a file written before workloads carried their run lends them its
    own)."""
    kept: dict[str, Any] = {}
    if out.exists():
        old = json.loads(out.read_text())
        if old.get("benchmark") == benchmark and old.get("quick") == quick:
            keys = ("command", "commit", "dirty", "machine", "seeds", "seconds")
            own = {k: old[k] for k in keys if k in old}
            kept = {w: {"run": own, **part} for w, part in old["workloads"].items()}
    names = [w for w in order if w in kept or w in workloads]
    both = {**kept, **workloads}
    return {"benchmark": benchmark, "quick": quick, "workloads": {w: both[w] for w in names}}


if __name__ == "__main__":
    sys.exit(main())
