"""How K-FAC's lead moves with the model's size: a sweep of width and depth at a fixed
token budget.

The race's per-step lead of the recommended recipe over Muon and SOAP is large on the
narrow language models (``lm``, ``gpt2``: d_model 64) and small on the wide one
(``lm4x``: d_model 192, 4 blocks, a smaller batch); published fair-tuning studies find
matrix optimizers' advantage shrinking with scale. This sweep separates size from the
other differences: the race's character LM (``examples/transformer_lm.py``, context 48,
4 heads, batch 32 windows, 200 steps: the same tokens at every size) at d_model 32, 64,
128 with 2 blocks, and at d_model 64 with 4 blocks, each trained by AdamW, Muon, SOAP
and ``kfac-moments-fresh`` tuned alike: ``race.race``'s budget with the second knob at
each recipe's value (4 learning rates a factor of 2 apart around ``optimizers.py``'s,
then 1 more around the best, on seed 0; the best on seeds 1, 2, 3).

Per size and optimizer: the final test loss (mean, range over seeds), the step's cost
against Muon's, and the seconds and steps to Muon's and SOAP's mean final losses
(``orthogonal_race.summarize``, the race's columns), as one results file
``benchmarks/results/size_sweep.json`` and the plot ``size_sweep.png`` (final loss and
time to Muon's final against the parameters). ``--tables`` rewrites its table in
``docs/benchmarks.md``.

    python benchmarks/size_sweep.py --sizes d128 --out A.json &   # one core each
    python benchmarks/size_sweep.py --sizes d32 d64 d64x4 --out B.json
    python benchmarks/size_sweep.py --merge A.json B.json          # the results file
    python benchmarks/size_sweep.py --quick                        # smoke test

Only ratios from one run compare: the seconds depend on the CPU, its load and the
thread count (one thread per process here).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import optimizers
import orthogonal_race as challenge
import race
import race_report as rr
import race_workloads as rw
import schedules
from step_time import git_commit

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PAGE = ROOT / "docs" / "benchmarks.md"
MARKS = ("<!-- sweep:start -->", "<!-- sweep:end -->")
BENCHMARK = "size_sweep"

SIZES: dict[str, tuple[int, int]] = {"d32": (32, 2), "d64": (64, 2), "d128": (128, 2)}
SIZES["d64x4"] = (64, 4)
"""Size name: (d_model, blocks). Context, heads, batch and steps are the race's ``lm``."""
CONTEXT, HEADS, BATCH, STEPS = 48, 4, 32, 200
OPTIMIZERS = ("adamw", "muon", "soap", "kfac-moments-fresh")
LR_POINTS, REFINE_POINTS = 4, 1


def workload(size: str, quick: bool) -> rw.RaceWorkload:
    """The character LM at ``size`` (``quick``: the race's tiny model whatever the size)."""
    d_model, blocks = SIZES[size]
    w = optimizers.lm_workload(quick, (CONTEXT, d_model, blocks, HEADS), STEPS, size, BATCH)
    return rw.RaceWorkload(
        **{f: getattr(w, f) for f in w.__dataclass_fields__},
        eval_every=2 if quick else 20,
        tune_knob=False,
        description=f"CharTransformer: context {CONTEXT}, d_model {d_model}, {blocks} blocks, "
        f"{HEADS} heads; batch {BATCH} windows, {STEPS} steps; test: 128 windows; loss nats/char",
    )


def parameters(w: rw.RaceWorkload) -> int:
    """The number of parameters of the workload's model."""
    return sum(p.numel() for p in w.make().parameters())


def sweep(args: argparse.Namespace) -> dict[str, Any]:
    """Every size of ``args.sizes``: its runs (tuning and evaluation) and summary rows."""
    lr_points = 2 if args.quick else LR_POINTS
    tuning = race.tuning_budget(list(OPTIMIZERS), args.seeds, lr_points, REFINE_POINTS)

    parts: dict[str, Any] = {}
    for size in args.sizes:
        started = time.perf_counter()
        w = workload(size, args.quick)
        print(f"{size}: {w.description}", flush=True)
        runs = race.race(w, tuning, race.print_run)
        rows = challenge.summarize(runs)
        challenge.print_table(size, rows)
        d_model, blocks = SIZES[size]
        parts[size] = {
            "description": w.description,
            "d_model": d_model,
            "blocks": blocks,
            "parameters": parameters(w),
            "summary": rows,
            "runs": runs,
            "run": {
                "command": " ".join(["python", "benchmarks/size_sweep.py", *args.argv]),
                **git_commit(race.REWRITTEN),
                "machine": race.machine(args.threads),
                "seeds": args.seeds,
                "seconds": time.perf_counter() - started,
            },
        }
    return parts


def render(doc: dict[str, Any]) -> str:
    """The Markdown table of a results ``doc``."""
    runs = [rr.run_phrase(size, part["run"]) for size, part in doc["workloads"].items()]
    lines = [
        f"Results: `benchmarks/results/{BENCHMARK}.json` (`python benchmarks/{BENCHMARK}.py`).",
        "<!-- settings -->",
        "; ".join(runs) + ".",
        "",
        "| size | parameters | optimizer | lr | final test loss | min–max | step × Muon's | "
        "to Muon's final (× its run) | to SOAP's final (× its run) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for size, part in doc["workloads"].items():
        for r in part["summary"]:
            lines.append(
                f"| {size} | {part['parameters']} | {r['name']} | {r['lr']:g} | "
                f"{r['final_mean']:.4f} | {r['final_min']:.4f}–{r['final_max']:.4f} | "
                f"{r['step_to_muon']:.2f} | {challenge._reach(r, 'muon')} | "
                f"{challenge._reach(r, 'soap')} |"
            )
    return "\n".join(lines)


def plot(path: Path, doc: dict[str, Any]) -> None:
    """Final test loss (mean, range over seeds) and seconds to Muon's final (× Muon's
    run) against the parameters, one line per optimizer, for the 2-block sizes; the
    4-block size as single markers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    parts = doc["workloads"]
    for k, name in enumerate(OPTIMIZERS):
        colour = f"C{k}"
        for deep in (False, True):
            sizes = [s for s, p in parts.items() if (p["blocks"] > 2) == deep]
            xs, means, lo, hi, ratio = [], [], [], [], []
            for s in sizes:
                r = next((r for r in parts[s]["summary"] if r["name"] == name), None)
                if r is None:
                    continue
                xs.append(parts[s]["parameters"])
                means.append(r["final_mean"])
                lo.append(r["final_mean"] - r["final_min"])
                hi.append(r["final_max"] - r["final_mean"])
                ratio.append(r.get("ratio_to_muon"))
            style = dict(color=colour, marker="s" if deep else "o", capsize=3)
            label = None if deep else name
            left.errorbar(xs, means, yerr=[lo, hi], linestyle="none" if deep else "-",
                          label=label, **style)  # fmt: skip
            reached = [(x, v) for x, v in zip(xs, ratio) if v is not None]
            if reached and name != "muon":
                right.plot(*zip(*reached), linestyle="none" if deep else "-", label=label,
                           color=colour, marker="s" if deep else "o")  # fmt: skip
    for ax in (left, right):
        ax.set_xscale("log")
        ax.set_xlabel("parameters (squares: 4 blocks, d_model 64)")
    left.set_ylabel("final test loss (nats/char; bars: seeds' range)")
    right.set_ylabel("seconds to Muon's final / Muon's run")
    right.axhline(1.0, color="grey", linewidth=0.8)
    left.legend()
    right.legend()
    fig.suptitle("The character LM at a fixed token budget, each optimizer tuned alike")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_table(page: Path, results: Path) -> bool:
    """Rewrite the table between :data:`MARKS` of ``page``; whether it changed."""
    return rr.replace_block(page, MARKS, render(json.loads(results.read_text())))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="smoke test: tiny models, one seed")
    p.add_argument(
        "--sizes", nargs="+", choices=list(SIZES), default=list(SIZES), help="the sizes run"
    )
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3], help="evaluation seeds")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    p.add_argument("--out", default=None, help="the JSON written (default: the results file)")
    p.add_argument("--merge", nargs="+", default=None, help="results files to combine")
    p.add_argument("--tables", action="store_true", help="rewrite the docs table and exit")
    args = p.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv
    if args.quick:
        args.seeds = args.seeds[:1]
    rr.settle_out(args, RESULTS, f"{BENCHMARK}.json", p.error)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    if args.tables:
        changed = write_table(PAGE, RESULTS / f"{BENCHMARK}.json")
        print(f"{PAGE}: {BENCHMARK} table {'rewritten' if changed else 'unchanged'}")
        return 0
    if args.merge:
        parts = {}
        for f in args.merge:
            parts.update(json.loads(Path(f).read_text())["workloads"])
    else:
        previous = torch.get_num_threads()
        torch.set_num_threads(args.threads)
        try:
            parts = sweep(args)
        finally:
            torch.set_num_threads(previous)
    doc = schedules.merged(out, parts, args.quick, benchmark=BENCHMARK, order=tuple(SIZES))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1, allow_nan=False) + "\n")
    plot(out.with_suffix(".png"), doc)
    print(f"wrote {out} and {out.with_suffix('.png').name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
