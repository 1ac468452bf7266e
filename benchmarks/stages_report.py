"""The stage tables of ``docs/performance.md`` from ``benchmarks/results/stages.json``.

``python benchmarks/stages_report.py`` rewrites blocks of ``docs/performance.md`` from
the committed results of ``benchmarks/stages.py``: between ``<!-- stages:start -->`` and
``<!-- stages:end -->``, per stage and workload, the milliseconds and the ratio to the
stage's arithmetic floor; between ``<!-- stage-floors:start -->`` and
``<!-- stage-floors:end -->``, what the recipe's step at its floors would make of the
race's time to Muon's and SOAP's final losses (the steps it takes to them from the race's
headline, ``race_headline.json``). From the run under bfloat16 autocast
(``stages_bf16.json``), where it is committed, the same two for it: between
``<!-- stages-bf16:start -->`` and ``<!-- stages-bf16:end -->``, the recipe before and
after; between ``<!-- stage-floors-bf16:start -->`` and ``<!-- stage-floors-bf16:end -->``,
the floors against the bfloat16 races. Nothing here imports torch.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import race_report as rr

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "stages.json"
PAGE = ROOT / "docs" / "performance.md"
MARKERS = ("<!-- stages:start -->", "<!-- stages:end -->")
FLOOR_MARKERS = ("<!-- stage-floors:start -->", "<!-- stage-floors:end -->")
HEADLINE = ROOT / "benchmarks" / "results" / "race_headline.json"
BF16 = ROOT / "benchmarks" / "results" / "stages_bf16.json"
BF16_MARKERS = ("<!-- stages-bf16:start -->", "<!-- stages-bf16:end -->")
BF16_FLOOR_MARKERS = ("<!-- stage-floors-bf16:start -->", "<!-- stage-floors-bf16:end -->")
BF16_ROWS = (
    ("plain", "plain forward+backward"),
    ("before fb", "forward+backward with the hooks, before: float32 statistics"),
    (f"{rr.RECIPE} fb", "… after: bfloat16 statistics"),
    ("kfac long fb", "… after, amortized over 2,000 steps of the schedule at the run's commit"),
    ("kfac-moments-wide-nn fb", "… after, the norm layers on AdamW (tried, not the recipe)"),
    ("before", "K-FAC optimizer part, before: eigenbases every 2 steps"),
    ("kfac", "… after, eigenbases every 2 steps (its first 256 steps)"),
    ("kfac long", "… after, amortized over 2,000 steps"),
    ("muon", "Muon's optimizer step (bfloat16 Newton–Schulz)"),
    ("soap", "SOAP's optimizer step"),
    ("before whole", "K-FAC's whole step, before"),
    (f"{rr.RECIPE} whole", "… after, eigenbases every 2 steps"),
    ("kfac long whole", "… after, amortized over 2,000 steps"),
    ("kfac-moments-wide-nn whole", "… after, the norm layers on AdamW, eigenbases every 2 steps"),
    ("muon whole", "Muon's whole step"),
    ("soap whole", "SOAP's whole step"),
    ("adamw whole", "AdamW's whole step"),
)
"""The rows of the before/after table of an ``--autocast`` run: row key and label."""
COMPETITORS = {"muon": "Muon", "soap": "SOAP"}

ROWS = (
    ("plain", "plain forward+backward"),
    ("statistics", "statistics in the hooks"),
    # factor_rows, retired: the committed results still hold its row
    ("statistics thin", "… from a quarter of the rows (`factor_rows`, retired)"),
    ("hooks batch", "batch factors"),
    ("fold", "fold"),
    ("eigh", "decomposition: eigh (every 2nd step)"),
    ("qr", "decomposition: QR refresh instead"),
    ("carry", "carry moments (every 2nd step)"),
    ("powers", "powers of the wide layers (every 2nd step)"),
    ("precondition", "precondition stage"),
    ("newton-schulz", "… of which the wide layers' Newton–Schulz"),
    ("kfac", "K-FAC optimizer part, amortized"),
    ("muon", "Muon's optimizer step, as the race runs it"),
    ("muon-fp32", "Muon's, float32 Newton–Schulz"),
    ("soap", "SOAP's optimizer step"),
    ("adamw", "AdamW's optimizer step"),
    (f"{rr.RECIPE} whole", "K-FAC's whole training step"),
    ("floor whole", "… at the floors"),
    ("muon whole", "Muon's whole training step"),
    ("soap whole", "SOAP's whole training step"),
    ("adamw whole", "AdamW's whole training step"),
)
"""The rows of the table: the results' row key and its label."""


def _cell(row: dict[str, Any] | None) -> str:
    if row is None:
        return "-"
    ms = f"{row['ms']:.1f}"
    return ms if row["vs_floor"] is None else f"{ms} ({row['vs_floor']:.1f}×)"


def _ms(row: dict[str, Any] | None) -> str:
    return "-" if row is None or row["ms"] is None else f"{row['ms']:.1f}"


def _by_workload(
    doc: dict[str, Any],
    rows: Sequence[tuple[str, str]],
    cell: Callable[[dict[str, Any] | None], str],
) -> list[str]:
    """A Markdown table of ``doc``'s workloads: a column each, a line per ``(key, label)``
    of ``rows`` that some workload has, each workload's row written by ``cell``."""
    names = list(doc["workloads"])
    by = {w: {r["key"]: r for r in doc["workloads"][w]["rows"]} for w in names}
    lines = ["| row | " + " | ".join(f"`{w}`" for w in names) + " |", "|---|" + "---|" * len(names)]
    for key, label in rows:
        if any(key in by[w] for w in names):
            lines.append(f"| {label} | " + " | ".join(cell(by[w].get(key)) for w in names) + " |")
    return lines


def _where(machine: dict[str, Any], settings: dict[str, Any]) -> str:
    """The device the run timed: a GPU by its name, else the CPU and its threads."""
    if machine.get("device"):
        return f"GPU `{machine['device']}`"
    return f"CPU `{machine['cpu']}`, {settings['threads']} thread(s)"


def render(doc: dict[str, Any], source: str = "`benchmarks/results/stages.json`") -> str:
    """The Markdown of the results ``doc`` (read from ``source``): one row per stage, one
    column per workload.

    Example:
        >>> row = {"key": "fold", "ms": 2.0, "vs_floor": 4.0}
        >>> doc = {"workloads": {"lm": {"rows": [row]}}, "machine": {"cpu": "c"},
        ...        "settings": {"threads": 1}, "commit": "abc", "dirty": False}
        >>> "| fold | 2.0 (4.0×) |" in render(doc)
        True
    """
    lines = [
        f"Results: {source} (`python benchmarks/stages.py`); "
        "milliseconds, medians of the repetitions, and in brackets the row's time over "
        "its arithmetic floor.",
        "<!-- settings -->",
        _where(doc["machine"], doc["settings"]) + ", the race's "
        f"Muon in {doc['machine'].get('muon_newton_schulz', 'bfloat16')}, "
        f"{rr.commit_phrase(doc)}.",
        "",
        *_by_workload(doc, ROWS, _cell),
    ]
    return "\n".join(lines)


def render_floors(
    doc: dict[str, Any],
    headline: dict[str, Any],
    source: str = "`benchmarks/results/stages.json`",
    suffix: str = "",
) -> str:
    """The Markdown of the recipe's whole step, measured and at its floors, over Muon's
    and SOAP's whole steps, and times the steps the race's recipe takes to their final
    losses (as a share of their runs' steps): the race's time-to-target ratio as the
    measured step makes it, as the step at its floors would, and as the forward and
    backward passes with the hooks alone would (an optimizer part that cost nothing).
    ``suffix``: the race's workloads are the stage run's with it (``"_bf16"``).

    Example:
        >>> rows = [{"key": k, "ms": v} for k, v in (("r whole", 60.0), ("floor whole",
        ...         30.0), ("hooks", 24.0), ("muon whole", 20.0), ("soap whole", 50.0))]
        >>> doc = {"workloads": {"lm": {"rows": rows}}, "recipe": {"name": "r"}}
        >>> head = {"rows": [{"workload": "lm", "competitor": c, "kfac_steps": 150,
        ...          "competitor_steps": 200, "ratio": 2.0} for c in ("muon", "soap")]}
        >>> "| `lm` | Muon | 60.0 | 30.0 | 20.0 | 0.75 | 2.25× | 1.12× | 0.90× | 2.00× |" in (
        ...     render_floors(doc, head))
        True
    """
    recipe = doc["recipe"]["name"]
    race = {(r["workload"], r["competitor"]): r for r in headline["rows"]}
    lines = [
        f"From {source} (the steps' milliseconds, the stage table above) and "
        "`benchmarks/results/race_headline.json` (the steps the race's recipe takes to each "
        "competitor's mean final loss, as a share of the competitor's run).",
        "",
        "| workload | competitor | K-FAC's step ms | at its floors | competitor's step ms "
        "| steps to its final (share) | time to its final: measured step | at the floors "
        "| forward+backward with the hooks alone | the race's ratio |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for w, body in doc["workloads"].items():
        by = {r["key"]: r for r in body["rows"]}
        step, floor = by[f"{recipe} whole"]["ms"], by["floor whole"]["ms"]
        hooks = by.get(f"{recipe} fb", by["hooks"])["ms"]  # in training steps, where timed
        for c, name in COMPETITORS.items():
            r = race.get((w + suffix, c))
            if r is None or f"{c} whole" not in by or not r["kfac_steps"]:
                continue
            theirs = by[f"{c} whole"]["ms"]
            share = r["kfac_steps"] / r["competitor_steps"]
            ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}×"
            alone = hooks / theirs * share
            lines.append(
                f"| `{w + suffix}` | {name} | {step:.1f} | {floor:.1f} | {theirs:.1f} | "
                f"{share:.2f} | {step / theirs * share:.2f}× | {floor / theirs * share:.2f}× "
                f"| {alone:.2f}× | {ratio} |"
            )
    return "\n".join(lines)


BF16_SOURCE = "`benchmarks/results/stages_bf16.json`"


def render_bf16(doc: dict[str, Any], source: str = BF16_SOURCE) -> str:
    """The Markdown of an ``--autocast`` run: the recipe before and after its bfloat16
    statistics and growing refresh interval, beside Muon, SOAP and AdamW (milliseconds),
    then the issue's two ratios per workload.

    Example:
        >>> rows = [{"key": "plain", "ms": 2.0}, {"key": "before fb", "ms": 4.0}]
        >>> t = {"hooks_over_plain_before": 2.0, "hooks_over_plain_after": 1.5}
        >>> doc = {"workloads": {"lm": {"rows": rows, "targets": t}},
        ...        "machine": {"cpu": "c", "bf16_flags": {"avx512_bf16": True}},
        ...        "settings": {"threads": 1}, "commit": "abc", "dirty": False}
        >>> text = render_bf16(doc)
        >>> "| plain forward+backward | 2.0 |" in text, "| `lm` | 2.00× | 1.50× | - |" in text
        (True, True)
    """
    lines = [
        f"Results: {source} (`python benchmarks/stages.py --autocast`); milliseconds, "
        "medians of the repetitions; every forward and loss under bfloat16 autocast.",
        "<!-- settings -->",
        _where(doc["machine"], doc["settings"])
        + f"{rr.bf16_phrase(doc['machine'])}, {rr.commit_phrase(doc)}.",
        "",
        *_by_workload(doc, BF16_ROWS, _ms),
        "",
        "| workload | forward+backward with the hooks over the plain one: before | after "
        "| after, over 2,000 steps | K-FAC's whole step over Muon's: before | after, every "
        "2 steps | after, over 2,000 steps |",
        "|---|---|---|---|---|---|---|",
    ]
    keys = (
        "hooks_over_plain_before",
        "hooks_over_plain_after",
        "hooks_over_plain_after_long",
        "whole_over_muon_before",
        "whole_over_muon_after_every_2",
        "whole_over_muon_after",
    )
    for w in doc["workloads"]:
        t = doc["workloads"][w].get("targets", {})
        cells = ["-" if t.get(k) is None else f"{t[k]:.2f}×" for k in keys]
        lines.append(f"| `{w}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def block_of(page: str, marks: tuple[str, str] = MARKERS) -> str | None:
    """The text between the markers ``marks`` of ``page`` (None without them)."""
    return rr.block_between(page, marks)


def main() -> int:
    doc = json.loads(RESULTS.read_text())
    changed = rr.replace_block(PAGE, MARKERS, render(doc))
    print(f"{PAGE}: stage table {'rewritten' if changed else 'unchanged'}")
    headline = json.loads(HEADLINE.read_text())
    floors = render_floors(doc, headline)
    changed = rr.replace_block(PAGE, FLOOR_MARKERS, floors)
    print(f"{PAGE}: floor table {'rewritten' if changed else 'unchanged'}")
    if BF16.exists():
        bf16 = json.loads(BF16.read_text())
        changed = rr.replace_block(PAGE, BF16_MARKERS, render_bf16(bf16))
        print(f"{PAGE}: bfloat16 table {'rewritten' if changed else 'unchanged'}")
        floors = render_floors(bf16, headline, BF16_SOURCE, "_bf16")
        changed = rr.replace_block(PAGE, BF16_FLOOR_MARKERS, floors)
        print(f"{PAGE}: bfloat16 floor table {'rewritten' if changed else 'unchanged'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
