"""The numbers and tables of ``benchmarks/race.py``: the tie rule, time to a target, the
summary rows of a results file, and the Markdown tables of ``docs/benchmarks.md``.

Nothing here trains or imports torch: it reads the rows that ``race.py`` writes.

Rules
-----
- **Tie**: two optimizers' final test losses over the evaluation seeds *tie* when their
  ranges (min–max) overlap; otherwise the one whose whole range is lower is *better*.
- **Time to a target**: per evaluation seed, the steps and training seconds of the first
  evaluation at or below the target (evaluations every ``eval_every`` steps); the mean
  over the seeds when every seed gets there, else "never" with how many did.
- **Targets**: AdamW's final test loss (mean over the evaluation seeds) and the best
  optimizer's (the lowest mean); Muon's and SOAP's where they raced.
- **Headline** (:func:`headline`): per workload, the seconds and steps K-FAC's recipe
  takes to the final loss of each competitor (the fastest to its own final among the
  optimizers that are not K-FAC, Muon, SOAP), beside that competitor's whole run:
  the ratio is K-FAC's seconds over the competitor's.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import tempfile
from collections.abc import Callable, Iterable, Sequence
from decimal import ROUND_HALF_EVEN, Decimal
from pathlib import Path
from typing import Any

Row = dict[str, float]
"""One evaluation of a run: ``step``, ``seconds`` (training only), ``test_loss``."""

REFERENCE = "adamw"
"""The optimizer whose final test loss is the first target."""

MUON = "muon"
"""The optimizer whose final test loss the steps to it are also counted for (where it
raced): the yardstick of fewest-steps records."""

SOAP = "soap"
"""The other competitor whose final test loss is a target where it raced."""

RECIPE = "kfac-moments-wide"
"""The K-FAC recipe of the headline (``kf.KFAC``'s recommended recipe)."""
NARROW = "kfac-moments-fresh"
"""What :data:`RECIPE` is exactly on a model with no factor side wider than 512
(``tests/test_orthogonal.py``): the race files' runs of it stand for :data:`RECIPE`'s on
those workloads (:func:`recipe_docs`)."""
WIDE_FILE = "wide_race.json"
"""The results of ``wide_race.py``: :data:`RECIPE` raced, with AdamW, Muon and SOAP in the
same run, on the workloads with a side wider than 512."""

TIE_RULE = (
    "tie: the min-max ranges of the final test loss over the evaluation seeds overlap; "
    "otherwise the optimizer whose whole range is lower is better"
)

PLACEHOLDER = (
    "No results yet: `python benchmarks/race.py --workloads {w} --out benchmarks/results` "
    "writes them."
)
"""What a docs block holds while its workload has no results file."""


def finite(x: float | None) -> float:
    """``x``, or ``inf`` for None (how a results file stores a non-finite loss) and NaN."""
    return math.inf if x is None or not math.isfinite(x) else float(x)


def tie(a: Sequence[float], b: Sequence[float]) -> bool:
    """Whether the ranges of ``a`` and ``b`` (final losses over seeds) overlap.

    Example:
        >>> tie([1.50, 1.52], [1.51, 1.60]), tie([1.50, 1.52], [1.53, 1.60])
        (True, False)
    """
    a, b = [finite(x) for x in a], [finite(x) for x in b]
    if math.isinf(max(a)) and math.isinf(max(b)):
        return True  # both diverged on a seed: neither range is known
    return max(a) >= min(b) and max(b) >= min(a)


def verdict(a: Sequence[float], b: Sequence[float]) -> str:
    """``"better"``, ``"tie"`` or ``"worse"``: ``a``'s final losses against ``b``'s (lower
    is better; :func:`tie` decides a tie).

    Example:
        >>> verdict([1.2, 1.3], [1.4, 1.5]), verdict([1.2, 1.45], [1.4, 1.5])
        ('better', 'tie')
    """
    if tie(a, b):
        return "tie"
    return "better" if max(finite(x) for x in a) < min(finite(x) for x in b) else "worse"


def first_reach(rows: Sequence[Row], target: float) -> tuple[float, float]:
    """``(step, seconds)`` of the first evaluation at or below ``target`` (inf: never)."""
    for r in rows:
        if finite(r["test_loss"]) <= target:
            return r["step"], r["seconds"]
    return math.inf, math.inf


def time_to_target(curves: Sequence[Sequence[Row]], target: float) -> dict[str, Any]:
    """Steps and seconds to ``target`` over the curves of the evaluation seeds: the means
    (None unless every seed reaches it), how many seeds reach it, and the values per seed
    (None: never).

    Example:
        >>> rows = lambda *losses: [
        ...     {"step": 10 * i, "seconds": 1.0 * i, "test_loss": v} for i, v in enumerate(losses)
        ... ]
        >>> t = time_to_target([rows(3, 2, 1), rows(3, 1.5, 1)], 1.5)
        >>> t["steps"], t["seconds"], t["reached"]
        (15, 1.5, 2)
        >>> time_to_target([rows(3, 2, 1), rows(3, 2, 2)], 1.5)["seconds"] is None
        True
    """
    reach = [first_reach(c, target) for c in curves]
    per_steps = [None if math.isinf(s) else s for s, _ in reach]
    per_secs = [None if math.isinf(t) else t for _, t in reach]
    reached = sum(s is not None for s in per_steps)
    every = reached == len(curves) and reached > 0
    return {
        "steps": statistics.mean(per_steps) if every else None,  # type: ignore[arg-type]
        "seconds": statistics.mean(per_secs) if every else None,  # type: ignore[arg-type]
        "reached": reached,
        "seeds": len(curves),
        "steps_per_seed": per_steps,
        "seconds_per_seed": per_secs,
    }


def final_loss(rows: Sequence[Row]) -> float:
    """The last evaluation's test loss (inf where it is not finite)."""
    return finite(rows[-1]["test_loss"])


def run_costs(runs: Sequence[dict[str, Any]]) -> dict[str, float]:
    """The mean cost of ``runs`` (records with ``steps``, ``fwd_bwd_seconds``,
    ``optimizer_seconds`` and evaluation ``rows``): milliseconds per step of the
    forward+backward and of the optimizer, and the whole run's training seconds and steps.

    Example:
        >>> run = {"steps": 10, "fwd_bwd_seconds": 1.0, "optimizer_seconds": 0.5,
        ...        "rows": [{"step": 10, "seconds": 1.5, "test_loss": 1.0}]}
        >>> run_costs([run])
        {'fwd_bwd_ms': 100.0, 'optimizer_ms': 50.0, 'train_seconds': 1.5, 'train_steps': 10}
    """
    steps = [max(1, r["steps"]) for r in runs]
    return {
        "fwd_bwd_ms": statistics.mean(1e3 * r["fwd_bwd_seconds"] / s for r, s in zip(runs, steps)),
        "optimizer_ms": statistics.mean(
            1e3 * r["optimizer_seconds"] / s for r, s in zip(runs, steps)
        ),
        "train_seconds": statistics.mean(r["rows"][-1]["seconds"] for r in runs),
        "train_steps": statistics.mean(steps),
    }


def summarize(runs: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """The targets and one summary row per optimizer of a workload's ``runs`` (the records
    of ``race.py``: ``optimizer``, ``phase`` ``"tune"`` or ``"eval"``, ``lr``, ``settings``,
    ``seed``, ``rows``, ``fwd_bwd_seconds``, ``optimizer_seconds``, ``steps``). The
    evaluation runs of an optimizer are those of its chosen setting; the reference
    (AdamW) must be among them."""
    runs = list(runs)
    names = list(dict.fromkeys(r["optimizer"] for r in runs))
    evals = {n: [r for r in runs if r["optimizer"] == n and r["phase"] == "eval"] for n in names}
    finals = {n: [final_loss(r["rows"]) for r in evals[n]] for n in names}
    means = {
        n: statistics.mean(f) if all(map(math.isfinite, f)) else math.inf for n, f in finals.items()
    }
    best = min(names, key=lambda n: means[n])
    targets = {"reference": REFERENCE, "reference_loss": means[REFERENCE], "best": best}
    targets["best_loss"] = means[best]
    for other in (MUON, SOAP):  # the yardsticks of the per-second targets
        if other in means:
            targets[f"{other}_loss"] = means[other]
    rows = []
    for n in names:
        tuning = [r for r in runs if r["optimizer"] == n and r["phase"] == "tune"]
        lrs = sorted({r["lr"] for r in tuning})
        chosen = evals[n][0]
        curves = [r["rows"] for r in evals[n]]
        f = finals[n]
        cost = run_costs(evals[n])
        to_ref = time_to_target(curves, means[REFERENCE])
        to_best = time_to_target(curves, means[best])
        rows.append(
            {
                "optimizer": n,
                "lr": chosen["lr"],
                "settings": chosen["settings"],
                "tuning_runs": len(tuning),
                "lr_at_grid_edge": len(lrs) > 1 and chosen["lr"] in (lrs[0], lrs[-1]),
                "eval_seeds": [r["seed"] for r in evals[n]],
                "finals": [json_float(x) for x in f],
                "final_mean": json_float(means[n]),
                "final_std": json_float(_std(f)),
                "final_min": json_float(min(f)),
                "final_max": json_float(max(f)),
                "vs_reference": verdict(f, finals[REFERENCE]) if n != REFERENCE else "-",
                "vs_best": "best" if n == best else ("tie" if tie(f, finals[best]) else "worse"),
                **{f"{k}_to_reference": v for k, v in to_ref.items()},
                **{f"{k}_to_best": v for k, v in to_best.items()},
                **{
                    f"{k}_to_{other}": v
                    for other in (MUON, SOAP)
                    if other in means
                    for k, v in time_to_target(curves, means[other]).items()
                },
                "train_seconds": cost["train_seconds"],
                "train_steps": cost["train_steps"],
                "fwd_bwd_ms_per_step": cost["fwd_bwd_ms"],
                "optimizer_ms_per_step": cost["optimizer_ms"],
                "ms_per_step": cost["fwd_bwd_ms"] + cost["optimizer_ms"],
            }
        )
    return {"targets": {k: json_float(v) for k, v in targets.items()}, "rows": rows}


def _std(values: Sequence[float]) -> float:
    """The sample standard deviation (0 for one value, inf where a value is not finite)."""
    if not all(map(math.isfinite, values)):
        return math.inf
    return statistics.stdev(values) if len(values) > 1 else 0.0


def json_float(x: Any) -> Any:
    """Non-finite floats as None (JSON has no infinity)."""
    return None if isinstance(x, float) and not math.isfinite(x) else x


# --------------------------------------------------------------------------- Markdown


def rounded(x: float, places: int) -> str:
    """``x`` to ``places`` decimals, rounded as the docs-numbers test rounds
    (``Decimal(str(x))``, half to even), so that a quoted number is found in the file.

    Example:
        >>> rounded(0.12345, 4), rounded(108.333, 0), rounded(2.5, 0)
        ('0.1234', '108', '2')
    """
    q = Decimal(1).scaleb(-places) if places else Decimal(1)
    return str(Decimal(str(x)).quantize(q, rounding=ROUND_HALF_EVEN))


def run_phrase(label: str, run: dict[str, Any]) -> str:
    """How one run of a results document reads in the docs: its label, seeds, CPU, threads,
    the dtype of Muon's iteration where the run names it, and commit.

    Example:
        >>> run = {"seeds": [1, 2], "machine": {"cpu": "X", "threads": 1}, "commit": "0123456789ab"}
        >>> run_phrase("lm", run)
        '`lm` seeds 1, 2, CPU `X`, 1 thread(s), commit `0123456789`'
        >>> run["machine"]["muon_newton_schulz"] = "float32"
        >>> run_phrase("lm", run)
        '`lm` seeds 1, 2, CPU `X`, 1 thread(s), Muon in float32, commit `0123456789`'
    """
    machine = run["machine"]
    muon = machine.get("muon_newton_schulz")
    return (
        f"`{label}` seeds {', '.join(map(str, run['seeds']))}, CPU `{machine['cpu']}`, "
        f"{machine['threads']} thread(s), {f'Muon in {muon}, ' if muon else ''}"
        f"{commit_phrase(run)}"
    )


def bf16_phrase(machine: dict[str, Any]) -> str:
    """The CPU's bfloat16 flags as the docs name them, where the run recorded them.

    Example:
        >>> bf16_phrase({"bf16_flags": {"avx512_bf16": True, "amx_bf16": False}})
        ' (bfloat16 natively: avx512_bf16)'
        >>> bf16_phrase({"cpu": "X"})
        ''
    """
    flags = machine.get("bf16_flags")
    if flags is None:
        return ""
    named = ", ".join(k for k, v in flags.items() if v and "bf16" in k)
    return f" (bfloat16 natively: {named or 'no'})"


def commit_phrase(doc: dict[str, Any]) -> str:
    """How a results document's commit reads in the docs (``dirty``: said).

    Example:
        >>> commit_phrase({"commit": "0123456789abcdef", "dirty": True})
        'commit `0123456789` with uncommitted changes'
    """
    dirty = " with uncommitted changes" if doc.get("dirty") else ""
    return f"commit `{(doc.get('commit') or 'unknown')[:10]}`{dirty}"


def _setting(row: dict[str, Any]) -> str:
    parts = [f"lr {row['lr']:g}"]
    for k, v in row["settings"].items():
        value = "/".join(f"{b:g}" for b in v) if isinstance(v, (list, tuple)) else f"{v:g}"
        parts.append(f"{k} {value}")
    edge = " (grid edge)" if row["lr_at_grid_edge"] else ""
    return ", ".join(parts) + edge


def _reach(row: dict[str, Any], which: str) -> tuple[str, str]:
    secs, steps = row[f"seconds_to_{which}"], row[f"steps_to_{which}"]
    if secs is None:
        return f"never ({row[f'reached_to_{which}']}/{row[f'seeds_to_{which}']})", "never"
    return rounded(secs, 1), rounded(steps, 0)


def _loss(x: float | None) -> str:
    return "diverged" if x is None else rounded(x, 4)


def render(doc: dict[str, Any], plot: bool = False) -> str:
    """The Markdown of one workload's results ``doc`` (a ``race_<workload>.json``): what
    was run, the table, and the plot when ``plot``."""
    w, s, t = doc["workload"], doc["summary"], doc["summary"]["targets"]
    muon = "muon_loss" in t
    machine = doc["machine"]
    seeds = ", ".join(str(x) for x in doc["tuning"]["eval_seeds"])
    lines = [
        f"Results: `benchmarks/results/race_{w}.json` (`{doc['command']}`).",
        "<!-- settings -->",
        f"{doc['description']}; {doc['steps']} steps, test loss every {doc['eval_every']}. "
        f"CPU `{machine['cpu']}`{bf16_phrase(machine)}, {machine['threads']} thread(s), "
        f"torch `{machine['torch']}`, {commit_phrase(doc)}.",
        "",
        f"Tuning: {doc['tuning']['statement']} Targets: AdamW's final test loss "
        f"{_loss(t['reference_loss'])}, the best's ({t['best']}) {_loss(t['best_loss'])}"
        + (f", Muon's {_loss(t['muon_loss'])}" if muon else "")
        + f" (means over seeds {seeds}). Tie rule: ranges overlap.",
        "",
        "| optimizer | best setting | s to AdamW's | steps | s to best's | steps | "
        + ("steps to Muon's | " if muon else "")
        + "final test loss | min–max | vs AdamW | vs best | fwd+bwd ms/step | opt ms/step |",
        "|---|---|---|---|---|---|" + ("---|" if muon else "") + "---|---|---|---|---|---|",
    ]
    for r in s["rows"]:
        ref_s, ref_n = _reach(r, "reference")
        best_s, best_n = _reach(r, "best")
        spread = (
            "diverged"
            if r["final_mean"] is None
            else f"{rounded(r['final_mean'], 4)} ± {rounded(r['final_std'], 4)}"
        )
        to_muon = f"{_reach(r, 'muon')[1]} | " if muon else ""
        if to_muon == "never | ":
            to_muon = f"never ({r['reached_to_muon']}/{r['seeds_to_muon']}) | "
        lines.append(
            f"| {r['optimizer']} | {_setting(r)} | {ref_s} | {ref_n} | {best_s} | {best_n} | "
            f"{to_muon}{spread} | {_loss(r['final_min'])}–{_loss(r['final_max'])} | "
            f"{r['vs_reference']} | {r['vs_best']} | {rounded(r['fwd_bwd_ms_per_step'], 1)} | "
            f"{rounded(r['optimizer_ms_per_step'], 1)} |"
        )
    if plot:
        lines += ["", f"![{w}: test loss against seconds](../benchmarks/results/race_{w}.png)"]
    return "\n".join(lines)


def headline(docs: Sequence[dict[str, Any]], recipe: str = RECIPE) -> list[dict[str, Any]]:
    """The time-to-target rows of the race's results ``docs`` (one per workload where
    ``recipe`` raced): for every competitor (an optimizer that is not K-FAC), its mean
    final test loss and its whole run (training seconds and steps, means over the
    evaluation seeds), the seconds and steps ``recipe`` takes to that loss (the mean
    over the seeds, None when a seed never gets there) and the ratio of the seconds.
    Competitors come lowest final first.

    Example:
        >>> run = lambda name, losses: {"optimizer": name, "phase": "eval", "lr": 1.0,
        ...     "settings": {}, "seed": 1, "fwd_bwd_seconds": 1.0, "optimizer_seconds": 1.0,
        ...     "steps": 2, "rows": [{"step": i, "seconds": 2.0 * i, "test_loss": x}
        ...                          for i, x in enumerate(losses)]}
        >>> doc = {"workload": "w", "runs": [run("adamw", [3, 2, 1.5]),
        ...                                  run("kfac-moments-wide", [3, 1.4, 1.0])]}
        >>> row = headline([doc])[0]
        >>> row["competitor"], row["kfac_seconds"], row["competitor_seconds"], row["ratio"]
        ('adamw', 2.0, 4.0, 0.5)
    """
    rows = []
    for doc in docs:
        summary = summarize(doc["runs"])["rows"]
        by = {r["optimizer"]: r for r in summary}
        if recipe not in by:
            continue
        ours = [r["rows"] for r in doc["runs"] if r["optimizer"] == recipe and r["phase"] == "eval"]
        others = [r for r in summary if not r["optimizer"].startswith("kfac")]
        for c in sorted(others, key=lambda r: finite(r["final_mean"])):
            reach = time_to_target(ours, finite(c["final_mean"]))
            rows.append(
                {
                    "workload": doc["workload"],
                    "competitor": c["optimizer"],
                    "competitor_final": c["final_mean"],
                    "competitor_seconds": c["train_seconds"],
                    "competitor_steps": c["train_steps"],
                    "kfac_final": by[recipe]["final_mean"],
                    "kfac_seconds": reach["seconds"],
                    "kfac_steps": reach["steps"],
                    "kfac_reached": f"{reach['reached']}/{reach['seeds']}",
                    "ratio": None
                    if reach["seconds"] is None
                    else reach["seconds"] / c["train_seconds"],
                }
            )
    return rows


def render_headline(rows: Sequence[dict[str, Any]], recipe: str = RECIPE) -> str:
    """The Markdown table of :func:`headline`'s ``rows``."""
    lines = [
        f"Time to target of `{recipe}`: `benchmarks/results/race_headline.json` (written by "
        "`python benchmarks/race.py --tables` from the race's results files: "
        f"`{WIDE_FILE}` on the workloads it raced, elsewhere the race's `{NARROW}`, which "
        "is the same recipe there for 256 steps; the runs of more steps, `digits`' 400 and "
        "the CNN's 300, date from before the recipe's statistics thinned from step 256).",
        "",
        f"| workload | competitor | its final | its run: s | steps | {recipe}: s to it | "
        "steps | ratio of seconds |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["kfac_seconds"] is None:
            ours, steps, ratio = f"never ({r['kfac_reached']})", "never", "-"
        else:
            ours, steps = rounded(r["kfac_seconds"], 1), rounded(r["kfac_steps"], 0)
            ratio = rounded(r["ratio"], 2)
        lines.append(
            f"| {r['workload']} | {r['competitor']} | {_loss(r['competitor_final'])} | "
            f"{rounded(r['competitor_seconds'], 1)} | {rounded(r['competitor_steps'], 0)} | "
            f"{ours} | {steps} | {ratio} |"
        )
    return "\n".join(lines)


HEADLINE = ("<!-- race-headline:start -->", "<!-- race-headline:end -->")
"""The comments around the headline table in the docs page."""


def recipe_docs(results: Path, workloads: Sequence[str]) -> list[dict[str, Any]]:
    """The runs of :data:`RECIPE` beside its competitors', per workload of ``workloads``
    that has them, in that order: :data:`WIDE_FILE`'s where it raced the workload (every
    optimizer of that entry ran in one process), else the race file's, with
    :data:`NARROW`'s runs under :data:`RECIPE`'s name.

    Example:
        >>> recipe_docs(Path("/nonexistent"), ["lm"])
        []
    """
    wide_path = results / WIDE_FILE
    wide = json.loads(wide_path.read_text())["workloads"] if wide_path.exists() else {}
    docs = []
    for workload in workloads:
        if workload in wide:
            docs.append({"workload": workload, "runs": wide[workload]["runs"]})
            continue
        path = results / f"race_{workload}.json"
        doc = json.loads(path.read_text()) if path.exists() else {}
        if doc.get("benchmark") == "race" and not doc.get("quick"):
            runs = [
                {**r, "optimizer": RECIPE} if r["optimizer"] == NARROW else r for r in doc["runs"]
            ]
            docs.append({**doc, "runs": runs})
    return docs


def write_headline(page: Path, results: Path) -> bool:
    """Write ``results/race_headline.json`` from :func:`recipe_docs` (the page's order of
    workloads) and the headline table of ``page`` between :data:`HEADLINE`'s comments;
    returns whether the table changed."""
    rows = headline(recipe_docs(results, list(blocks_of(page.read_text()))))
    (results / "race_headline.json").write_text(
        json.dumps({"benchmark": "race_headline", "recipe": RECIPE, "rows": rows}, indent=1) + "\n"
    )
    return replace_block(page, HEADLINE, render_headline(rows))


def block_between(page: str, marks: tuple[str, str]) -> str | None:
    r"""The text of ``page`` between the comments ``marks`` (None without them; an empty
    block is ``""``).

    Example:
        >>> block_between("a\n<!-- s -->\nx\n<!-- e -->\n", ("<!-- s -->", "<!-- e -->"))
        'x'
    """
    start, end = marks
    found = re.search(re.escape(start) + r"\n(.*?)" + re.escape(end), page, re.S)
    return None if found is None else found.group(1).removesuffix("\n")


def replace_block(page: Path, marks: tuple[str, str], new: str) -> bool:
    """Write ``new`` between the comments ``marks`` of the file ``page``; whether the
    block changed. Raises ValueError when the page has no such block."""
    text = page.read_text()
    old = block_between(text, marks)
    if old is None:
        raise ValueError(f"{page}: no {marks[0]} block")
    start, end = marks
    before = f"{start}\n{old}\n{end}" if old else f"{start}\n{end}"
    page.write_text(text.replace(before, f"{start}\n{new}\n{end}"))
    return new != old


def settle_out(
    args: argparse.Namespace, results: Path, name: str, error: Callable[[str], Any]
) -> None:
    """Set ``args.out`` when it was not given: the file ``name`` in ``results`` (the
    committed results), or with ``--quick`` in a temporary folder; refuse quick results
    written into ``results`` (``error``: the parser's ``error``).

    Example:
        >>> args = argparse.Namespace(quick=False, out=None)
        >>> settle_out(args, Path("benchmarks/results"), "x.json", print)
        >>> args.out
        'benchmarks/results/x.json'
    """
    if args.out is None:
        folder = Path(tempfile.mkdtemp()) if args.quick else results
        args.out = str(folder / name)
    if args.quick and Path(args.out).resolve().parent == results.resolve():
        error("--quick results are a smoke test: not into benchmarks/results")


def markers(workload: str) -> tuple[str, str]:
    """The comments that open and close a workload's block in the docs page."""
    return f"<!-- race:{workload}:start -->", f"<!-- race:{workload}:end -->"


def block(results: Path, workload: str) -> str:
    """What the docs block of ``workload`` holds: :func:`render` of
    ``results/race_<workload>.json`` (its plot when ``race_<workload>.png`` is there too),
    or :data:`PLACEHOLDER` while there is none. Quick (smoke-test) results are refused."""
    path = results / f"race_{workload}.json"
    if not path.exists():
        return PLACEHOLDER.format(w=workload)
    doc = json.loads(path.read_text())
    if doc.get("quick"):
        raise ValueError(f"{path}: results of --quick, a smoke test, are not for the docs")
    return render(doc, plot=(results / f"race_{workload}.png").exists())


def blocks_of(page: str) -> dict[str, str]:
    """The workload blocks of a docs page: workload -> the text between its markers."""
    found = re.finditer(r"<!-- race:([\w-]+):start -->\n(.*?)\n<!-- race:\1:end -->", page, re.S)
    return {m.group(1): m.group(2) for m in found}


def write_tables(page: Path, results: Path) -> list[str]:
    """Rewrite every workload block of ``page`` from ``results``; returns the workloads
    whose block changed."""
    text = page.read_text()
    changed = []
    for workload, old in blocks_of(text).items():
        new = block(results, workload)
        if new != old:
            start, end = markers(workload)
            text = text.replace(f"{start}\n{old}\n{end}", f"{start}\n{new}\n{end}")
            changed.append(workload)
    page.write_text(text)
    return changed
