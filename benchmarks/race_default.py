"""The optimizer race's zero-tuning row: ``kf.KFAC(model)`` with no argument but the model.

``python benchmarks/race_default.py --out benchmarks/results`` trains ``kf.KFAC(model)``
(the recommended recipe at its default learning rate, no argument tuned) on each race
workload (``race_workloads.WORKLOADS``) on the race's evaluation seeds, with the race's
schedule, batches and initialisation (``optimizers.train``, the race's own loop), and
writes ``race_default.json``: every run with its curve, and per workload the final test
losses against AdamW's and the tuned ``kfac-moments-fresh``'s evaluation runs read from
the committed ``race_<workload>.json`` (copied into the file, so that the table quotes
one file). The race's other rows are not rerun. ``--merge A B`` joins the files of
runs made side by side (``--workloads`` split between processes) into one, in the race's
order of workloads. ``--tables`` rewrites the table of ``docs/benchmarks.md`` from the
file; ``--quick`` is a smoke test into a temporary folder. A workload under bfloat16
autocast by itself (``lm_long``) is left out on a CPU without native bfloat16
(:func:`comparable`): its row would compare float32 runs with a bfloat16 race.
Final losses do not depend on the machine's load; seconds do, and are not compared.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import optimizers
import race_report as rr
import race_workloads as rw
from race import RESULTS, REWRITTEN, machine
from step_time import git_commit

import kfac_func as kf

ROOT = Path(__file__).resolve().parents[1]
DOCS_PAGE = ROOT / "docs" / "benchmarks.md"
FILE = "race_default.json"
TUNED = rr.RECIPE
"""The race's row of the same recipe, tuned (learning rate and second-moment decay): its
runs are ``wide_race.json``'s on the workloads with a layer side wider than 512 and, on the
others, the race's runs of ``kfac-moments-fresh``, which it equals there (see
:func:`race_docs`)."""
MARKERS = ("<!-- race-default:start -->", "<!-- race-default:end -->")


def evaluation(race_doc: dict[str, Any], name: str) -> list[float]:
    """The final test losses of ``name``'s evaluation runs in a race results file."""
    runs = [r for r in race_doc["runs"] if r["optimizer"] == name and r["phase"] == "eval"]
    return [rr.final_loss(r["rows"]) for r in sorted(runs, key=lambda r: r["seed"])]


def compare(finals: list[float], adamw: list[float], tuned: list[float]) -> dict[str, Any]:
    """One workload's row: the untuned finals against AdamW's and the tuned recipe's.

    Example:
        >>> row = compare([1.6, 1.7], [2.2, 2.3], [1.55, 1.65])
        >>> row["below_adamw"], row["vs_adamw"], row["vs_tuned"]
        (True, 'better', 'tie')
    """
    mean = statistics.mean(finals)
    return {
        "final_mean": rr.json_float(mean),
        "final_min": rr.json_float(min(finals)),
        "final_max": rr.json_float(max(finals)),
        "adamw_mean": statistics.mean(adamw),
        "adamw_min": min(adamw),
        "adamw_max": max(adamw),
        "tuned_mean": statistics.mean(tuned),
        "tuned_min": min(tuned),
        "tuned_max": max(tuned),
        "below_adamw": mean < statistics.mean(adamw),
        "vs_adamw": rr.verdict(finals, adamw),
        "vs_tuned": rr.verdict(finals, tuned),
    }


def derive_lr(results: Path, beta2: float = 0.95) -> tuple[float, dict[str, dict[str, float]]]:
    """The default learning rate of ``kf.KFAC(model)`` from the race's tuning runs of
    :data:`TUNED` (second-moment decay ``beta2``, the recipe's) in ``results``: among the
    rates every workload's grid tried, the one whose largest *gap fraction* over the
    workloads is smallest, where a rate's gap fraction on a workload is ``(L - L*) / (A -
    L*)`` on the tuning seed (``L`` its final test loss, ``L*`` the tuned recipe's best,
    ``A`` AdamW's best): 0 is the tuned loss, 1 AdamW's. Returns the rate and every
    rate's fractions per workload.

    Example:
        >>> lr, fractions = derive_lr(RESULTS)  # doctest: +SKIP
    """
    fractions: dict[str, dict[str, float]] = {}
    for doc in race_docs(results):
        tune = [r for r in doc["runs"] if r["phase"] == "tune"]
        mine = [r for r in tune if r["optimizer"] == TUNED]
        best = min(rr.final_loss(r["rows"]) for r in mine)
        adamw = min(rr.final_loss(r["rows"]) for r in tune if r["optimizer"] == "adamw")
        at = {
            r["lr"]: rr.final_loss(r["rows"])
            for r in mine
            if r["settings"].get("moment_beta2") == beta2
        }
        fractions[doc["workload"]] = {
            f"{lr:g}": (v - best) / (adamw - best) for lr, v in at.items()
        }
    common = set.intersection(*(set(f) for f in fractions.values()))
    worst = {lr: max(f[lr] for f in fractions.values()) for lr in common}
    return float(min(worst, key=lambda lr: worst[lr])), fractions


ONE_RATE = ("adamw", "muon", "soap", TUNED)
"""The optimizers whose one-learning-rate reach :func:`one_rate` measures."""
ONE_RATE_MARKERS = ("<!-- one-rate:start -->", "<!-- one-rate:end -->")


def one_rate(docs: list[dict[str, Any]], optimizer: str) -> dict[str, Any]:
    """How far one learning rate carries ``optimizer`` over the race's workloads (``docs``:
    their race results), by its tuning runs: a rate *reaches* a workload when its final
    test loss on the tuning seed (the best over the second knob's settings) exceeds the
    tuned rate's, on the same seed, by no more than the spread (max − min) of the tuned
    evaluation runs' finals. Over the rates that every workload's grid tried, returns the
    one reaching most workloads (the smaller on a tie), those workloads, and the count of
    every rate.

    Example:
        >>> def doc(w, finals, spread):
        ...     tune = [{"optimizer": "o", "phase": "tune", "lr": lr, "settings": {},
        ...              "rows": [{"test_loss": v}]} for lr, v in finals.items()]
        ...     ev = [{"optimizer": "o", "phase": "eval", "lr": 0.1, "settings": {}, "seed": i,
        ...            "rows": [{"test_loss": 1.0 + spread * i}]} for i in range(2)]
        ...     return {"workload": w, "runs": tune + ev}
        >>> r = one_rate([doc("a", {0.1: 1.0, 0.2: 1.05}, 0.1),
        ...               doc("b", {0.1: 1.3, 0.2: 1.0}, 0.1)], "o")
        >>> r["lr"], r["reached"], r["counts"]
        (0.2, ['a', 'b'], {'0.1': 1, '0.2': 2})
    """
    at: dict[str, dict[float, float]] = {}
    spread: dict[str, float] = {}
    for doc in docs:
        finals: dict[float, float] = {}
        for r in doc["runs"]:
            if r["optimizer"] == optimizer and r["phase"] == "tune":
                v = rr.final_loss(r["rows"])
                finals[r["lr"]] = min(v, finals.get(r["lr"], v))
        ev = evaluation(doc, optimizer)
        at[doc["workload"]], spread[doc["workload"]] = finals, max(ev) - min(ev)
    rates = sorted(set.intersection(*(set(f) for f in at.values())))

    def reached(lr: float) -> list[str]:
        return [w for w, f in at.items() if f[lr] - min(f.values()) <= spread[w]]

    best = max(rates, key=lambda lr: (len(reached(lr)), -lr))
    counts = {f"{lr:g}": len(reached(lr)) for lr in rates}
    return {"lr": best, "reached": reached(best), "counts": counts}


def race_docs(results: Path) -> list[dict[str, Any]]:
    """The race results files in ``results`` (those present), in the race's order of
    workloads, each with the runs of :data:`TUNED` (``race_report.recipe_docs``'s) added
    where the file does not race it."""
    tuned = {d["workload"]: d["runs"] for d in rr.recipe_docs(results, list(rw.WORKLOADS))}
    docs = []
    for w in rw.WORKLOADS:
        path = results / f"race_{w}.json"
        doc = json.loads(path.read_text()) if path.exists() else {}
        if doc.get("benchmark") != "race":
            continue
        mine = [r for r in tuned.get(w, []) if r["optimizer"] == TUNED]
        docs.append({**doc, "runs": doc["runs"] + mine})
    return docs


def render_one_rate(results: Path) -> str:
    """The Markdown table of :func:`one_rate` for every optimizer of :data:`ONE_RATE`."""
    docs = race_docs(results)
    lines = [
        "From the race's tuning runs (`benchmarks/results/race_<workload>.json`, "
        f"{', '.join(d['workload'] for d in docs)}; {TUNED}'s as in the table above).",
        "",
        "| optimizer | its tuned rates | one rate reaching most | workloads it reaches | "
        "reached per rate |",
        "|---|---|---|---|---|",
    ]
    for name in ONE_RATE:
        r = one_rate(docs, name)
        tuned = sorted(
            x["lr"]
            for d in docs
            for x in d["runs"]
            if (x["optimizer"], x["phase"]) == (name, "eval")
        )
        per = ", ".join(f"{lr}: {n}" for lr, n in r["counts"].items())
        lines.append(
            f"| {name} | {tuned[0]:g}–{tuned[-1]:g} | {r['lr']:g} | "
            f"{len(r['reached'])} of {len(docs)} ({', '.join(r['reached'])}) | {per} |"
        )
    return "\n".join(lines)


def comparable(names: list[str], native_bf16: bool = optimizers.NATIVE_BF16) -> list[str]:
    """The workloads of ``names`` whose zero-tuning row this CPU can compare with their
    race (``race_<workload>.json``): a workload under bfloat16 autocast by itself would run
    in float32 here without native bfloat16 (``race_workloads.precision_named``) and be
    compared with a bfloat16 race, so it is left out, with its reason printed.

    Example:
        >>> comparable(["lm", "lm_long"], native_bf16=False)
        lm_long: left out, this CPU runs it in float32 and its race ran under bfloat16 autocast
        ['lm']
    """
    kept = []
    for name in names:
        if rw.precision_named(rw.WORKLOADS[name](True), native_bf16).name == name:
            kept.append(name)
        else:
            print(
                f"{name}: left out, this CPU runs it in float32 and its race ran under "
                "bfloat16 autocast"
            )
    return kept


def run_workload(name: str, args: argparse.Namespace, log: Any) -> dict[str, Any]:
    """Train ``kf.KFAC(model)`` on workload ``name`` on each evaluation seed."""
    w = rw.WORKLOADS[name](args.quick)
    lr = kf.RECIPES["recommended"].lr
    runs = []
    for seed in args.eval_seeds:
        start = time.perf_counter()
        rows, split = optimizers.train(optimizers.DEFAULT, lr, w, seed, w.eval_every)
        runs.append(
            {
                "optimizer": optimizers.DEFAULT,
                "phase": "eval",
                "lr": lr,
                "settings": {},
                "seed": seed,
                "rows": [{**r, "test_loss": rr.json_float(r["test_loss"])} for r in rows],
                **split,
                "wall_seconds": time.perf_counter() - start,
            }
        )
        log(name, runs[-1])
    out: dict[str, Any] = {"workload": name, "steps": w.steps, "runs": runs}
    found = [d for d in race_docs(Path(args.race_results)) if d["workload"] == name]
    if found and not args.quick:
        race_doc = found[0]
        finals = [rr.final_loss(r["rows"]) for r in runs]
        out["race_commit"] = race_doc.get("commit")
        out["tuned_lr"] = next(
            r["lr"] for r in race_doc["runs"] if r["optimizer"] == TUNED and r["phase"] == "eval"
        )
        out["summary"] = compare(finals, evaluation(race_doc, "adamw"), evaluation(race_doc, TUNED))
    return out


def commits(doc: dict[str, Any]) -> str:
    """The commit of a results document, or of each workload where they differ.

    Example:
        >>> commits({"commit": "0123456789ab", "dirty": False, "workloads": [{}]})
        'commit `0123456789`'
        >>> commits({"workloads": [{"workload": "lm", "commit": "aaaaaaaaaaaa", "dirty": False},
        ...                        {"workload": "x", "commit": "bbbbbbbbbbbb", "dirty": False},
        ...                        {"workload": "y", "commit": "aaaaaaaaaaaa", "dirty": False}]})
        'commit `aaaaaaaaaa` (lm, y), commit `bbbbbbbbbb` (x)'
    """
    if all("commit" not in w for w in doc["workloads"]):
        return rr.commit_phrase(doc)
    by: dict[str, list[str]] = {}
    for w in doc["workloads"]:
        by.setdefault(rr.commit_phrase(w), []).append(w["workload"])
    return ", ".join(f"{phrase} ({', '.join(names)})" for phrase, names in by.items())


def render(doc: dict[str, Any]) -> str:
    """The Markdown table of ``race_default.json``."""

    def loss(x: float, places: int) -> str:
        return rr.rounded(x, places)

    lines = [
        f"Results: `benchmarks/results/{FILE}` (`{doc['command']}`), {commits(doc)}"
        + f"; `kf.KFAC(model)` at its default learning rate {doc['lr']:g}, seeds "
        + ", ".join(map(str, doc["eval_seeds"]))
        + f"; CPU `{doc['machine']['cpu']}`, {doc['machine']['threads']} thread(s). AdamW's "
        "and the tuned recipe's finals are the race's evaluation runs.",
        "",
        "| workload | steps | `kf.KFAC(model)` final | min–max | AdamW tuned | min–max | "
        f"vs AdamW | {TUNED} tuned | min–max | its lr | vs tuned |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for wl in doc["workloads"]:
        s = wl["summary"]
        p = 2 if s["adamw_mean"] > 50 else 4  # the autoencoder's nats per image
        lines.append(
            f"| {wl['workload']} | {wl['steps']} | {loss(s['final_mean'], p)} | "
            f"{loss(s['final_min'], p)}–{loss(s['final_max'], p)} | "
            f"{loss(s['adamw_mean'], p)} | {loss(s['adamw_min'], p)}–{loss(s['adamw_max'], p)} | "
            f"{'below' if s['below_adamw'] else 'above'} ({s['vs_adamw']}) | "
            f"{loss(s['tuned_mean'], p)} | {loss(s['tuned_min'], p)}–{loss(s['tuned_max'], p)} | "
            f"{wl['tuned_lr']:g} | {s['vs_tuned']} |"
        )
    return "\n".join(lines)


def write_table(page: Path, results: Path) -> bool:
    """Rewrite the blocks between :data:`MARKERS` and :data:`ONE_RATE_MARKERS` of ``page``
    from ``results``; whether they changed."""
    doc = json.loads((results / FILE).read_text())
    if doc.get("quick"):
        raise ValueError(f"{results / FILE}: results of --quick are not for the docs")
    changed = rr.replace_block(page, MARKERS, render(doc))
    return rr.replace_block(page, ONE_RATE_MARKERS, render_one_rate(results)) or changed


def merge(folders: list[Path]) -> dict[str, Any]:
    """One ``race_default.json`` document from those in ``folders`` (runs of the same
    learning rate, seeds and thread count, on different workloads), workloads in the race's
    order; ``command`` lists each run's. Runs of different commits (a workload added to
    the race later) keep each workload's commit in its entry, and the table says them.

    Raises:
        ValueError: the documents differ in learning rate, seeds or threads, or share a
            workload.
    """
    docs = [json.loads((f / FILE).read_text()) for f in folders]
    for d in docs[1:]:
        for key in ("lr", "eval_seeds", "quick"):
            if d[key] != docs[0][key]:
                raise ValueError(f"--merge: {key} differs: {docs[0][key]!r} and {d[key]!r}")
        if d["machine"]["threads"] != docs[0]["machine"]["threads"]:
            raise ValueError("--merge: the runs used different thread counts")
    found = [
        {**w, "commit": w.get("commit", d["commit"]), "dirty": w.get("dirty", d["dirty"])}
        for d in docs
        for w in d["workloads"]
    ]
    names = [w["workload"] for w in found]
    if len(set(names)) != len(names):
        raise ValueError(f"--merge: a workload appears twice: {names}")
    order = list(rw.WORKLOADS)
    found.sort(key=lambda w: order.index(w["workload"]))
    if len({(w["commit"], w["dirty"]) for w in found}) == 1:
        found = [{k: v for k, v in w.items() if k not in ("commit", "dirty")} for w in found]
    return {**docs[0], "command": " ; ".join(d["command"] for d in docs), "workloads": found}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="smoke test: tiny models, few steps")
    p.add_argument(
        "--workloads",
        nargs="+",
        choices=list(rw.WORKLOADS),
        default=list(rw.WORKLOADS),
        help="the race's workloads to run (all by default)",
    )
    p.add_argument(
        "--eval-seeds", type=int, nargs="+", default=[1, 2, 3], help="the evaluation seeds"
    )
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument("--out", default=None, help="folder of race_default.json")
    p.add_argument("--race-results", default=str(RESULTS), help="the race's results folder")
    p.add_argument("--tables", action="store_true", help="rewrite the docs table and exit")
    p.add_argument(
        "--derive-lr",
        action="store_true",
        help="print how the default learning rate follows from the race's tuning runs",
    )
    p.add_argument("--merge", nargs="+", help="folders whose race_default.json to join into --out")
    p.add_argument("--docs", default=str(DOCS_PAGE), help="docs page written by --tables")
    args = p.parse_args(argv)
    if args.derive_lr:
        lr, fractions = derive_lr(Path(args.race_results))
        rates = sorted(set.intersection(*(set(f) for f in fractions.values())), key=float)
        print("gap fraction (0: the tuned loss, 1: AdamW's) on the tuning seed, per rate:")
        print(f"{'workload':>12} " + " ".join(f"{r:>7}" for r in rates))
        for w, f in fractions.items():
            print(f"{w:>12} " + " ".join(f"{f[r]:7.2f}" for r in rates))
        print(f"smallest worst fraction: lr {lr:g} (kf.RECIPES: {kf.RECIPES['recommended'].lr:g})")
        return 0
    if args.tables:
        changed = write_table(Path(args.docs), Path(args.race_results))
        print(f"{args.docs}: table {'rewritten' if changed else 'unchanged'}")
        return 0
    if args.out is None:
        args.out = str(Path(tempfile.mkdtemp()) if args.quick else ROOT / "benchmarks" / "out")
    if args.merge:
        doc = merge([Path(f) for f in args.merge])
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / FILE).write_text(json.dumps(doc, indent=1, allow_nan=False) + "\n")
        print(f"wrote {Path(args.out) / FILE}")
        print(render(doc))
        return 0
    if args.quick and Path(args.out).resolve() == RESULTS.resolve():
        p.error("--quick results are a smoke test: not into benchmarks/results")
    command = " ".join(
        ["python", "benchmarks/race_default.py", *(sys.argv[1:] if argv is None else argv)]
    )
    if not args.quick:
        args.workloads = comparable(args.workloads)
    checkout = git_commit(REWRITTEN)
    previous = torch.get_num_threads()
    torch.set_num_threads(args.threads)

    def log(name: str, r: dict[str, Any]) -> None:
        print(
            f"{name} seed {r['seed']}: final {rr.final_loss(r['rows']):.4f} "
            f"({r['steps']} steps, {r['wall_seconds']:.1f} s)",
            flush=True,
        )

    try:
        doc = {
            "benchmark": "race-default",
            "quick": args.quick,
            "command": command,
            **checkout,
            "machine": machine(args.threads),
            "optimizer": "kf.KFAC(model)",
            "recipe": "recommended",
            "lr": kf.RECIPES["recommended"].lr,
            "eval_seeds": args.eval_seeds,
            "tuned": TUNED,
            "tie_rule": rr.TIE_RULE,
            "workloads": [run_workload(n, args, log) for n in args.workloads],
        }
    finally:
        torch.set_num_threads(previous)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / FILE).write_text(json.dumps(doc, indent=1, allow_nan=False) + "\n")
    print(f"wrote {out / FILE}")
    if not args.quick:
        print(render(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
