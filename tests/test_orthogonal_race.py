"""``benchmarks/orthogonal_race.py`` and ``wide_race.py`` (its runner, another recipe): the
summary on synthetic runs, quick runs end to end (no timing checks), and the committed
results files and docs tables against their own runs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from scripts import ROOT, run_benchmark

sys.path.insert(0, str(ROOT / "benchmarks"))

import orthogonal_race as ortho
import race_report as rr
import wide_race

RESULTS = ROOT / "benchmarks" / "results" / "orthogonal_race.json"
CHALLENGES = (ortho.ORTHOGONAL_RACE, wide_race.WIDE_RACE)


def run(name: str, seed: int, losses: tuple[float, ...], per_step: float, phase: str) -> dict:
    rows = [
        {"step": 10 * i, "seconds": per_step * 10 * i, "test_loss": x} for i, x in enumerate(losses)
    ]
    steps = 10 * (len(losses) - 1)
    return {
        "optimizer": name,
        "phase": phase,
        "lr": 0.1,
        "settings": {"knob": 1},
        "seed": seed,
        "rows": rows,
        "steps": steps,
        "fwd_bwd_seconds": per_step * steps / 2,
        "optimizer_seconds": per_step * steps / 2,
    }


def test_the_summary_reads_evaluation_runs_and_steps_against_muons() -> None:
    runs = [
        run(name, seed, losses, per, "eval")
        for name, losses, per in (
            ("muon", (3.0, 2.0, 1.0), 0.1),  # whole run 2 s, final 1.0
            ("soap", (3.0, 1.5, 0.5), 0.2),
            ("kfac-muon", (3.0, 0.9, 0.6), 0.15),  # Muon's 1.0 at step 10: 1.5 s
            (rr.RECIPE, (3.0, 2.0, 0.8), 0.3),
        )
        for seed in (1, 2)
    ]
    runs.append(run("kfac-muon", 0, (3.0, 9.0, 9.0), 0.15, "tune"))  # tuning: not counted
    rows = {r["name"]: r for r in ortho.summarize(runs)}
    mine = rows["kfac-muon"]
    assert mine["final_mean"] == pytest.approx(0.6)
    assert (mine["steps_to_muon"], mine["seconds_to_muon"]) == (10, 1.5)
    assert mine["ratio_to_muon"] == pytest.approx(0.75)
    assert mine["step_to_muon"] == pytest.approx(1.5) and rows["muon"]["step_to_muon"] == 1.0
    assert mine["lr"] == 0.1 and mine["settings"] == {"knob": 1}


@pytest.mark.slow
def test_orthogonal_race_quick(tmp_path: Path) -> None:
    out = tmp_path / "orthogonal_race.json"
    run_benchmark("orthogonal_race.py", "--quick", "--workloads", "lm", "digits", "--out", str(out))
    doc = json.loads(out.read_text())
    assert doc["quick"] is True and list(doc["workloads"]) == ["lm", "digits"]
    names = {r["name"] for r in doc["workloads"]["lm"]["summary"]}
    assert names == {*ortho.RECIPES, *ortho.COMPETITORS}
    assert "| digits | kfac-muon |" in ortho.render(doc)


@pytest.mark.slow
@pytest.mark.parametrize("challenge", CHALLENGES[1:], ids=lambda c: c.benchmark)
def test_challenge_quick(tmp_path: Path, challenge: ortho.Challenge) -> None:
    name, recipes, workload = challenge.benchmark, challenge.recipes, challenge.workloads[0]
    out = tmp_path / f"{name}.json"
    run_benchmark(f"{name}.py", "--quick", "--workloads", workload, "--out", str(out))
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == name and list(doc["workloads"]) == [workload]
    names = {r["name"] for r in doc["workloads"][workload]["summary"]}
    assert names == {*recipes, *ortho.COMPETITORS}
    table = ortho.render(doc, challenge)
    assert f"{name}.json" in table
    for recipe in recipes:
        assert f"| {workload} | {recipe} |" in table


@pytest.mark.parametrize("challenge", CHALLENGES, ids=lambda c: c.benchmark)
def test_the_committed_results_and_the_docs_table_are_their_runs(
    challenge: ortho.Challenge,
) -> None:
    results = ROOT / "benchmarks" / "results" / f"{challenge.benchmark}.json"
    if not results.exists():
        pytest.skip(f"no {challenge.benchmark} results committed yet")
    doc = json.loads(results.read_text())
    assert doc["quick"] is False and doc["benchmark"] == challenge.benchmark
    for w, part in doc["workloads"].items():
        assert json.loads(json.dumps(ortho.summarize(part["runs"]))) == part["summary"], w
    block = rr.block_between(ortho.PAGE.read_text(), challenge.markers)
    assert block == ortho.render(doc, challenge)


STAGES = ROOT / "benchmarks" / "results" / "orthogonal_stages.json"


@pytest.mark.slow
def test_orthogonal_stages_quick(tmp_path: Path) -> None:
    import orthogonal_stages

    out = tmp_path / "orthogonal_stages.json"
    run_benchmark("orthogonal_stages.py", "--quick", "--workloads", "lm", "--out", str(out))
    doc = json.loads(out.read_text())
    rows = {r["name"]: r for r in doc["workloads"]["lm"]["rows"]}
    assert set(rows) == set(orthogonal_stages.NAMES) and rows["muon"]["to_muon"] == 1.0
    stages = rows["kfac-muon"]["stages"]
    assert {"statistics_ms", "powers_ms", "newton_schulz_ms", "rest_ms"} <= set(stages)
    assert "| lm | kfac-muon |" in orthogonal_stages.render(doc)


def test_the_committed_stages_and_their_docs_table() -> None:
    import orthogonal_stages

    if not STAGES.exists():
        pytest.skip("no orthogonal stages results committed yet")
    doc = json.loads(STAGES.read_text())
    assert doc["quick"] is False
    block = rr.block_between(orthogonal_stages.PAGE.read_text(), orthogonal_stages.MARKERS)
    assert block == orthogonal_stages.render(doc)
