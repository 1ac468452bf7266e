"""The stage table of ``docs/performance.md`` from ``benchmarks/results/stages.json``.

``python benchmarks/stages_report.py`` rewrites the block between
``<!-- stages:start -->`` and ``<!-- stages:end -->`` of ``docs/performance.md`` from the
committed results of ``benchmarks/stages.py``: per stage and workload, the milliseconds
and the ratio to the stage's arithmetic floor. Nothing here imports torch.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import race_report as rr

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "stages.json"
PAGE = ROOT / "docs" / "performance.md"
MARKERS = ("<!-- stages:start -->", "<!-- stages:end -->")

ROWS = (
    ("plain", "plain forward+backward"),
    ("statistics", "statistics in the hooks"),
    ("statistics thin", "… from a quarter of the rows (`factor_rows`)"),
    ("hooks batch", "batch factors"),
    ("fold", "fold"),
    ("eigh", "decomposition: eigh (every 2nd step)"),
    ("qr", "decomposition: QR refresh instead"),
    ("carry", "carry moments (every 2nd step)"),
    ("powers", "powers of the wide layers (every 2nd step)"),
    ("precondition", "precondition stage"),
    ("newton-schulz", "… of which the wide layers' Newton–Schulz"),
    ("kfac", "K-FAC optimizer part, amortized"),
    ("muon", "Muon's optimizer step (bf16 Newton–Schulz)"),
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


def render(doc: dict[str, Any]) -> str:
    """The Markdown of the results ``doc``: one row per stage, one column per workload.

    Example:
        >>> row = {"key": "fold", "ms": 2.0, "vs_floor": 4.0}
        >>> doc = {"workloads": {"lm": {"rows": [row]}}, "machine": {"cpu": "c"},
        ...        "settings": {"threads": 1}, "commit": "abc", "dirty": False}
        >>> "| fold | 2.0 (4.0×) |" in render(doc)
        True
    """
    names = list(doc["workloads"])
    by = {w: {r["key"]: r for r in doc["workloads"][w]["rows"]} for w in names}
    lines = [
        "Results: `benchmarks/results/stages.json` (`python benchmarks/stages.py`); "
        "milliseconds, medians of the repetitions, and in brackets the row's time over "
        "its arithmetic floor.",
        "<!-- settings -->",
        f"CPU `{doc['machine']['cpu']}`, {doc['settings']['threads']} thread(s), "
        f"{rr.commit_phrase(doc)}.",
        "",
        "| row | " + " | ".join(f"`{w}`" for w in names) + " |",
        "|---|" + "---|" * len(names),
    ]
    for key, label in ROWS:
        if all(key not in by[w] for w in names):
            continue
        lines.append(f"| {label} | " + " | ".join(_cell(by[w].get(key)) for w in names) + " |")
    return "\n".join(lines)


def block_of(page: str) -> str | None:
    """The text between the markers of ``page`` (None without them)."""
    return rr.block_between(page, MARKERS)


def main() -> int:
    changed = rr.replace_block(PAGE, MARKERS, render(json.loads(RESULTS.read_text())))
    print(f"{PAGE}: stage table {'rewritten' if changed else 'unchanged'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
