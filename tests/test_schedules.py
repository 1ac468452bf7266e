"""``benchmarks/schedules.py``: its summary on synthetic runs, a quick run end to end
(no timing checks), and the committed results file against its own runs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from scripts import run_benchmark

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import schedules  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "schedules.json"


def run(name: str, seed: int, losses: tuple[float, ...], per_step: float = 0.1) -> dict:
    rows = [
        {"step": 10 * i, "seconds": per_step * 10 * i, "test_loss": x} for i, x in enumerate(losses)
    ]
    return {
        "name": name,
        "seed": seed,
        "rows": rows,
        "steps": 10 * (len(losses) - 1),
        "fwd_bwd_seconds": 1.0,
        "optimizer_seconds": 3.0,
    }


def test_the_summary_times_each_schedule_to_the_competitors_final_losses() -> None:
    runs = [
        run(name, seed, losses, per)
        for name, losses, per in (
            ("muon", (3.0, 2.0, 1.0), 0.1),  # its whole run: 2 s, final 1.0
            ("soap", (3.0, 1.5, 0.5), 0.2),  # 4 s, final 0.5
            ("recipe", (3.0, 0.9, 0.6), 0.3),  # Muon's 1.0 at step 10 (3 s); never 0.5
        )
        for seed in (1, 2)
    ]
    rows = {r["name"]: r for r in schedules.summary(runs)}
    recipe = rows["recipe"]
    assert (recipe["steps_to_muon"], recipe["seconds_to_muon"]) == (10, 3.0)
    assert recipe["ratio_to_muon"] == pytest.approx(1.5)
    assert recipe["seconds_to_soap"] is None and recipe["reached_to_soap"] == "0/2"
    assert recipe["fwd_bwd_ms"] == pytest.approx(50.0)  # 1 s over 20 steps
    assert "ratio_to_muon" not in rows["muon"] and rows["muon"]["ratio_to_soap"] is None


def test_the_schedules_replace_only_the_schedule() -> None:
    named = schedules.schedules()
    assert named["recipe"] == {}
    allowed = {"inv_update_steps", "factor_update_steps", "factor_decay"}
    assert all(set(s) <= allowed for s in named.values())


@pytest.mark.slow
def test_schedules_quick(tmp_path: Path) -> None:
    out = tmp_path / "schedules.json"
    run_benchmark("schedules.py", "--quick", "--out", str(out))
    doc = json.loads(out.read_text())
    assert doc["quick"] is True and set(doc["workloads"]) == set(schedules.WORKLOADS)
    names = {r["name"] for r in doc["workloads"]["lm"]["summary"]}
    assert names == {*schedules.COMPETITORS, *schedules.schedules()}


def test_the_committed_results_are_their_runs_summary() -> None:
    if not RESULTS.exists():
        pytest.skip("no schedules results committed yet")
    doc = json.loads(RESULTS.read_text())
    assert doc["quick"] is False
    for w, part in doc["workloads"].items():
        assert json.loads(json.dumps(schedules.summary(part["runs"]))) == part["summary"], w


def test_the_docs_table_is_the_committed_results() -> None:
    """``docs/performance.md``'s schedules table is what ``schedules.py --tables``
    renders from the committed results."""
    if not RESULTS.exists():
        pytest.skip("no schedules results committed yet")
    block = schedules.block_of(schedules.PAGE.read_text())
    assert block == schedules.render(json.loads(RESULTS.read_text()))
