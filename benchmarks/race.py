"""A fair race of optimizers: equal tuning budgets, several seeds, wall time to a target.

``python benchmarks/race.py --workloads lm`` races the optimizers on one workload and
writes ``race_lm.json`` and ``.png`` into ``benchmarks/out/`` (a folder git ignores);
``--out benchmarks/results`` writes the committed results, from which ``--tables``
rewrites the tables of ``docs/benchmarks.md``. ``--quick`` is a smoke test (tiny
models, a few steps, a temporary folder), ``--estimate`` times one run per optimizer of
each workload and projects the full run's time; a long race can run in parts, one a core
(``--part`` races only the optimizers named), joined by ``--merge``. Built on
``benchmarks/optimizers.py`` (its ``Stepper`` recipes, schedule and K-FAC variants,
imported); the workloads and the grid are in ``race_workloads.py``, the rules and tables
in ``race_report.py``. The zero-tuning row (``kf.KFAC(model)`` with no argument but the
model, evaluated only) is ``race_default.py``'s, written beside these results without
rerunning them. ``--autocast`` runs every optimizer's forward and loss under bfloat16
autocast (where the CPU multiplies bfloat16 natively), each workload ``W`` as ``W_bf16``
with a results file of its own. A workload that runs under autocast by itself (``lm_long``)
runs in float32 on a CPU without native bfloat16, as ``W_f32``
(``race_workloads.precision_named``), so that neither precision's results replace the
other's.

Tuning budget (the same for every optimizer of a workload)
----------------------------------------------------------
4 learning rates a factor of 2 apart, centred on the two values of ``optimizers.LRS``
(``race_workloads.lr_grid``); on the LM workloads (``lm``, ``lm4x``, ``gpt2``) each with
both values of the optimizer's second knob (``race_workloads.KNOBS``: AdamW's betas
(0.9, 0.999) and (0.9, 0.95), SOAP's betas, SGD's and Muon's momentum, PSGD-Kron's
momentum, K-FAC's damping, the ``kfac-moments`` variants' second-moment decay), on the others the
recipe's value; then 2 more learning rates around the best of those (``race_workloads.refine``:
beyond it at a grid edge, halfway to its neighbours inside): 10 runs per
optimizer on the LMs, 6 on the others (on ``autoencoder`` every grid is
centred on twice those values: ``RaceWorkload.lr_scale``). The runs are on the tuning seed
(0); the setting with the lowest final test loss is then run on the evaluation seeds (1,
2, 3). Every optimizer has the same schedule (linear warm-up over a tenth of the steps,
cosine decay to 10 %), initialisation and batches per seed.

What is reported
----------------
Per workload and optimizer, over the evaluation seeds: the training seconds and steps to
reach AdamW's mean final test loss and the best optimizer's ("never (k/n)" when a seed
does not: k of n did), the final test loss (mean ± sample std, min–max), whether it is
better than, tied with or worse than AdamW's and the best's (tie: the min–max ranges
overlap), and the step's cost split into forward+backward (K-FAC's statistics hooks run
there) and the optimizer's own milliseconds per step (``time.perf_counter`` around each;
batches and evaluations are not timed). The results file holds the command, commit
(flagged ``dirty`` when tracked files outside the results differ from it), machine,
every run with its curve, and the summary rows.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import optimizers
import race_report
import race_workloads as rw
from stage_arithmetic import bf16_flags
from step_time import checked_out, cpu_model, git_commit

import kfac_func as kf

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
OUT = ROOT / "benchmarks" / "out"
DOCS_PAGE = ROOT / "docs" / "benchmarks.md"
REWRITTEN = ("examples/results", "benchmarks/results", "docs/benchmarks.md")
"""Paths a run (or ``--tables``) rewrites: changes there do not make the tree dirty."""


def tuning_statement(
    w: rw.RaceWorkload, points: int, seed: int, eval_seeds: list[int], refine: int
) -> str:
    """The tuning budget of ``w`` in words (in the results file and the docs)."""
    per = points * (2 if w.tune_knob else 1) + refine
    knob = (
        " × both values of its second knob (AdamW: betas 0.9/0.999 and 0.9/0.95)"
        if w.tune_knob
        else ", its second knob at the recipe's value"
    )
    scale = "" if w.lr_scale == 1 else f"{w.lr_scale:g}× "
    seeds = ", ".join(map(str, eval_seeds))
    return (
        f"{per} runs per optimizer on seed {seed}: {points} learning rates a factor of 2 "
        f"apart around {scale}optimizers.py's{knob}, then {refine} more around the best of "
        "those (beyond it at a grid edge, halfway to its neighbours inside); the lowest "
        f"final test loss is run on seeds {seeds}."
    )


def run_once(
    name: str, lr: float, settings: dict[str, Any], w: rw.RaceWorkload, seed: int, phase: str
) -> dict[str, Any]:
    """One training run as a results record (its curve, split seconds, wall time)."""
    start = time.perf_counter()
    rows, split = optimizers.train(name, lr, w, seed, w.eval_every, dict(settings))
    return {
        "optimizer": name,
        "phase": phase,
        "lr": lr,
        "settings": settings,
        "seed": seed,
        "rows": [{**r, "test_loss": race_report.json_float(r["test_loss"])} for r in rows],
        **split,
        "wall_seconds": time.perf_counter() - start,
    }


def tuning_budget(
    optimizers: list[str], eval_seeds: list[int], lr_points: int, refine_points: int
) -> argparse.Namespace:
    """The settings :func:`race` reads: the optimizers, their grid and refinement sizes,
    tuning seed 0 and the evaluation seeds."""
    return argparse.Namespace(
        optimizers=optimizers,
        lr_points=lr_points,
        refine_points=refine_points,
        tuning_seed=0,
        eval_seeds=eval_seeds,
    )


def print_run(r: dict[str, Any]) -> None:
    """One run's line: optimizer, phase, setting, seed, final test loss, wall seconds."""
    final = race_report.final_loss(r["rows"])
    print(f"  {r['optimizer']:22s} {r['phase']} lr {r['lr']:<8g} {r['settings']} "
          f"seed {r['seed']}: {final:.4f} ({r['wall_seconds']:.1f} s)", flush=True)  # fmt: skip


def race(w: rw.RaceWorkload, args: argparse.Namespace, log: Any) -> list[dict[str, Any]]:
    """Every run of the workload: each optimizer's grid on the tuning seed, then, seed by
    seed, every optimizer's best setting on that evaluation seed (in an order reversed
    every other seed). The evaluation runs of all optimizers thus follow each other within
    minutes: a machine whose speed drifts over a long race moves their seconds alike,
    where each optimizer's evaluations run back to back would each meet another speed."""
    runs: list[dict[str, Any]] = []
    best: dict[str, dict[str, Any]] = {}
    for name in args.optimizers:
        tuning = []
        for lr, settings in rw.grid(name, w, args.lr_points):
            tuning.append(run_once(name, lr, settings, w, args.tuning_seed, "tune"))
            log(tuning[-1])
        top = min(tuning, key=lambda r: race_report.final_loss(r["rows"]))
        tried = [r["lr"] for r in tuning if r["settings"] == top["settings"]]
        for lr in rw.refine(tried, top["lr"], args.refine_points):  # around the best
            tuning.append(run_once(name, lr, top["settings"], w, args.tuning_seed, "tune"))
            log(tuning[-1])
        best[name] = min(tuning, key=lambda r: race_report.final_loss(r["rows"]))
        runs += tuning
    for k, seed in enumerate(args.eval_seeds):
        for name in args.optimizers if k % 2 == 0 else args.optimizers[::-1]:
            b = best[name]
            runs.append(run_once(name, b["lr"], b["settings"], w, seed, "eval"))
            log(runs[-1])
    return runs


def plot(path: Path, doc: dict[str, Any]) -> None:
    """Test loss against training seconds: each optimizer's best setting on the first
    evaluation seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seed = doc["tuning"]["eval_seeds"][0]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in doc["runs"]:
        if r["phase"] == "eval" and r["seed"] == seed:
            xs = [p["seconds"] for p in r["rows"] if p["test_loss"] is not None]
            ys = [p["test_loss"] for p in r["rows"] if p["test_loss"] is not None]
            ax.plot(xs, ys, label=r["optimizer"])
    ax.set_xlabel("training seconds")
    ax.set_ylabel("test loss")
    ax.set_title(f"{doc['workload']}: best setting, seed {seed}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def machine(threads: int) -> dict[str, Any]:
    """CPU, cores, threads and versions of this run."""
    info: dict[str, Any] = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "threads": threads,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "kfac_func": kf.__version__,
        "muon_newton_schulz": optimizers.MUON_PRECISION,
        "native_bf16": optimizers.NATIVE_BF16,
        "bf16_flags": bf16_flags(),
    }
    # heavyball has no __version__: its installed distribution's
    info["heavyball"] = _version("heavyball") if optimizers._heavyball() is not None else None
    return info


def _version(distribution: str) -> str | None:
    """The installed version of ``distribution`` (None when it is not installed)."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def estimate(w: rw.RaceWorkload, args: argparse.Namespace) -> float:
    """Time one run per optimizer (its grid's first setting, the tuning seed) and print
    the projected time of the full race of ``w``; returns the projection in seconds."""
    total = 0.0
    for name in args.optimizers:
        grid = rw.grid(name, w, args.lr_points)
        lr, settings = grid[len(grid) // 2]
        r = run_once(name, lr, settings, w, args.tuning_seed, "tune")
        runs = len(grid) + args.refine_points + len(args.eval_seeds)
        total += runs * r["wall_seconds"]
        print(
            f"{w.name:>12} {name:>16}: one run {r['wall_seconds']:6.1f} s wall "
            f"({r['fwd_bwd_seconds'] + r['optimizer_seconds']:.1f} s training), "
            f"final {race_report.final_loss(r['rows']):.4f}; x{runs} runs",
            flush=True,
        )
    print(f"{w.name:>12}: projected full race {total / 60:.1f} min", flush=True)
    return total


def bf16_workload(w: rw.RaceWorkload) -> rw.RaceWorkload:
    """``w`` with every forward and loss under bfloat16 autocast, as ``W_bf16`` (its own
    results file; a workload that runs so already is returned as it is).

    Example:
        >>> bf16_workload(rw.WORKLOADS["lm"](True)).name
        'lm_bf16'
    """
    if w.autocast:
        return w
    return dataclasses.replace(
        w,
        name=f"{w.name}_bf16",
        autocast=True,
        description=f"{w.description}; forward and loss under bfloat16 autocast",
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="smoke test: tiny models, few steps")
    p.add_argument(
        "--workloads",
        nargs="+",
        choices=list(rw.WORKLOADS),
        default=list(rw.WORKLOADS),
        help="workloads to race, each writing its own results file (default: all)",
    )
    p.add_argument(
        "--optimizers",
        nargs="+",
        choices=rw.OPTIMIZERS,
        default=list(rw.DEFAULT_OPTIMIZERS),
        help="optimizers (default: %(default)s; adamw, the reference, is always added)",
    )
    p.add_argument("--lr-points", type=int, default=rw.LR_POINTS, help="learning rates per grid")
    p.add_argument(
        "--refine-points",
        type=int,
        default=rw.REFINE_POINTS,
        help="learning rates added around the best of the grid (default %(default)s)",
    )
    p.add_argument("--tuning-seed", type=int, default=0, help="seed of the tuning runs")
    p.add_argument("--eval-seeds", type=int, nargs="+", default=[1, 2, 3], help="evaluation seeds")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    p.add_argument(
        "--out",
        default=None,
        help="folder of race_<workload>.json/.png (default benchmarks/out, untracked; "
        "--quick: a temporary folder); benchmarks/results refreshes the committed results",
    )
    p.add_argument(
        "--require-clean",
        action="store_true",
        help="refuse to run when tracked files outside the results differ from the commit",
    )
    p.add_argument(
        "--estimate", action="store_true", help="time one run per optimizer; project the race"
    )
    p.add_argument(
        "--tables",
        action="store_true",
        help="rewrite the tables of docs/benchmarks.md from the results files and exit",
    )
    p.add_argument(
        "--resummarize",
        action="store_true",
        help="recompute the summary of every results file from its runs (with this "
        "commit's rules, recorded as summarized_by) and exit",
    )
    p.add_argument("--results", default=str(RESULTS), help="results folder read by --tables")
    p.add_argument("--docs", default=str(DOCS_PAGE), help="docs page written by --tables")
    p.add_argument(
        "--steps", type=int, help="training steps of every run (default: the workload's)"
    )
    p.add_argument(
        "--eval-every", type=int, help="steps between test losses (default: the workload's)"
    )
    p.add_argument(
        "--autoencoder-widths",
        type=int,
        nargs="+",
        default=list(rw.AUTOENCODER),
        help="the autoencoder's encoder widths (default %(default)s: the paper's "
        f"{' '.join(map(str, rw.PAPER_AUTOENCODER))} halved; the decoder mirrors them)",
    )
    p.add_argument(
        "--part",
        action="store_true",
        help="race only the optimizers named (AdamW, the reference, is not added): a part "
        "of a race, to be joined with --merge",
    )
    p.add_argument(
        "--merge",
        nargs="+",
        metavar="FILE",
        help="join the results files of parts of one workload's race (same commit, steps "
        "and tuning rules; each optimizer in one part) into --out and exit",
    )
    p.add_argument(
        "--autocast",
        action="store_true",
        help="every optimizer's forward and loss under bfloat16 autocast (refused where the "
        "CPU does not multiply bfloat16 natively); a workload W races as W_bf16, into "
        "race_W_bf16.json",
    )
    p.add_argument("-q", "--silent", action="store_true", help="no line per run")
    args = p.parse_args(argv)
    if args.autocast and not optimizers.NATIVE_BF16:
        p.error("--autocast: this CPU does not multiply bfloat16 natively (no amx_bf16 or "
                "avx512_bf16); the race would time the emulation")  # fmt: skip
    if args.quick:
        args.lr_points, args.eval_seeds, args.refine_points = 2, args.eval_seeds[:2], 1
    if args.out is None:
        args.out = str(Path(tempfile.mkdtemp()) if args.quick else OUT)
    if args.quick and Path(args.out).resolve() == RESULTS.resolve():
        p.error("--quick results are a smoke test: not into benchmarks/results")
    if "adamw" not in args.optimizers and not args.part:
        args.optimizers = ["adamw", *args.optimizers]  # the reference
    if args.tuning_seed in args.eval_seeds or args.lr_points < 1:
        p.error("the evaluation seeds exclude the tuning seed; --lr-points >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.resummarize:
        for path in sorted(Path(args.results).glob("race_*.json")):
            doc = json.loads(path.read_text())
            if doc.get("benchmark") != "race":  # race_default.json: race_default.py's
                continue
            doc["summary"] = race_report.summarize(doc["runs"])
            doc["summarized_by"] = git_commit(REWRITTEN)["commit"]
            path.write_text(json.dumps(doc, indent=1, allow_nan=False) + "\n")
            print(f"{path}: summary recomputed from its runs")
        return 0
    if args.merge:
        path = merge_parts([Path(f) for f in args.merge], Path(args.out))
        print(f"wrote {path}")
        return 0
    if args.tables:
        changed = race_report.write_tables(Path(args.docs), Path(args.results))
        if race_report.write_headline(Path(args.docs), Path(args.results)):
            changed.append("headline")
        print(f"{args.docs}: {', '.join(changed) or 'no'} table(s) rewritten")
        return 0
    started = time.perf_counter()
    command = " ".join(["python", "benchmarks/race.py", *(sys.argv[1:] if argv is None else argv)])
    checkout = checked_out(REWRITTEN, args.require_clean)
    if checkout is None:
        return 2
    previous = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        if optimizers._heavyball() is None:
            missing = [o for o in args.optimizers if o in ("soap", "kron")]
            if missing:
                print(f"heavyball is not installed: {missing} skipped (pip install heavyball)")
            args.optimizers = [o for o in args.optimizers if o not in ("soap", "kron")]
        info = machine(args.threads)
        print(f"torch {info['torch']} | {info['cpu']} | threads {args.threads}", flush=True)
        rw.AUTOENCODER = tuple(args.autoencoder_widths)
        for wname in args.workloads:
            w = rw.WORKLOADS[wname](args.quick)
            if args.steps is not None:
                w = dataclasses.replace(w, steps=args.steps)
            if args.eval_every is not None:
                w = dataclasses.replace(w, eval_every=args.eval_every)
            if args.autocast:
                w = bf16_workload(w)
            w = rw.precision_named(w, optimizers.NATIVE_BF16)
            if args.estimate:
                estimate(w, args)
                continue
            out = race_workload(w, args, command, checkout, info)
            if not args.part:
                print(race_report.render(json.loads(out.read_text())), flush=True)
    finally:
        torch.set_num_threads(previous)
    print(f"done in {time.perf_counter() - started:.0f} s")
    return 0


#: what the parts of one race must share to be joined
SHARED = ("benchmark", "workload", "quick", "commit", "dirty", "steps", "eval_every", "tie_rule")


def merge_parts(files: list[Path], out: Path) -> Path:
    """Join the results files of a race run in parts (``--part``: e.g. side by side, one
    part a core) into one ``race_<workload>.json`` in ``out``: the parts must agree on
    :data:`SHARED`, the machine's CPU and the tuning rules; each optimizer's runs come from
    one part, AdamW's (the reference) from one of them; the summary is recomputed."""
    docs = [json.loads(f.read_text()) for f in files]
    first = docs[0]
    for f, doc in zip(files, docs):
        differs = [k for k in SHARED if doc.get(k) != first.get(k)]
        if doc["machine"]["cpu"] != first["machine"]["cpu"]:
            differs.append("machine")
        rules = {k: v for k, v in doc["tuning"].items() if k != "grids"}
        if rules != {k: v for k, v in first["tuning"].items() if k != "grids"}:
            differs.append("tuning")
        if differs:
            raise SystemExit(f"{f} is not a part of {files[0]}'s race: {', '.join(differs)} differ")
    owner: dict[str, Path] = {}
    for f, doc in zip(files, docs):
        for name in doc["tuning"]["grids"]:
            if name in owner:
                raise SystemExit(f"{name} was raced in both {owner[name]} and {f}")
            owner[name] = f
    if "adamw" not in owner:
        raise SystemExit("no part holds AdamW's runs (the reference)")
    runs = [r for doc in docs for r in doc["runs"]]
    doc = {
        **first,
        "command": " && ".join(d["command"] for d in docs)
        + " && python benchmarks/race.py --merge "
        + " ".join(str(f) for f in files),
        "parts": [{"command": d["command"], "seconds": d["seconds"]} for d in docs],
        "tuning": {
            **first["tuning"],
            "grids": {n: g for d in docs for n, g in d["tuning"]["grids"].items()},
        },
        "summary": race_report.summarize(runs),
        "runs": runs,
        "seconds": max(d["seconds"] for d in docs),
    }
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"race_{first['workload']}.json"
    path.write_text(json.dumps(doc, indent=1, allow_nan=False) + "\n")
    plot(out / f"race_{first['workload']}.png", doc)
    return path


def race_workload(
    w: rw.RaceWorkload,
    args: argparse.Namespace,
    command: str,
    checkout: dict[str, Any],
    info: dict[str, Any],
) -> Path:
    """Race ``w``; write ``race_<workload>.json`` and ``.png`` into ``args.out``."""
    started = time.perf_counter()

    def log(r: dict[str, Any]) -> None:
        if not args.silent:
            print(
                f"{w.name} {r['optimizer']:>16} {r['phase']} seed {r['seed']} lr {r['lr']:g} "
                f"{r['settings']}: final {race_report.final_loss(r['rows']):.4f} "
                f"({r['wall_seconds']:.1f} s)",
                flush=True,
            )

    runs = race(w, args, log)
    doc = {
        "benchmark": "race",
        "workload": w.name,
        "quick": args.quick,
        "command": command,
        **checkout,
        "machine": info,
        "description": (
            "smoke test (--quick: tiny model and data, not these sizes); " if args.quick else ""
        )
        + w.description,
        "steps": w.steps,
        "eval_every": w.eval_every,
        "tuning": {
            "seed": args.tuning_seed,
            "eval_seeds": args.eval_seeds,
            "lr_points": args.lr_points,
            "tune_knob": w.tune_knob,
            "lr_scale": w.lr_scale,
            "grids": {n: rw.grid(n, w, args.lr_points) for n in args.optimizers},
            "refine_points": args.refine_points,
            "runs_per_optimizer": args.lr_points * (2 if w.tune_knob else 1) + args.refine_points,
            "knobs": {n: {"name": rw.KNOBS[n][0], "values": rw.KNOBS[n][1]} for n in rw.KNOBS},
            "statement": tuning_statement(
                w, args.lr_points, args.tuning_seed, args.eval_seeds, args.refine_points
            ),
            "rule": "lowest final test loss on the tuning seed",
        },
        "tie_rule": race_report.TIE_RULE,
        # a part without the reference is summarized when the parts are joined
        "summary": race_report.summarize(runs) if not args.part else None,
        "runs": runs,
        "seconds": time.perf_counter() - started,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"race_{w.name}.json"
    path.write_text(json.dumps(doc, indent=1, allow_nan=False) + "\n")
    if not args.part:
        plot(out / f"race_{w.name}.png", doc)
    print(
        f"wrote {path}{'' if args.part else ' and its plot'} ({doc['seconds']:.0f} s)", flush=True
    )
    return path


if __name__ == "__main__":
    sys.exit(main())
