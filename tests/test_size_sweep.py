"""``benchmarks/size_sweep.py``: its sizes are the models they name, a quick run and a
merge end to end (no timing checks), and the committed results file and docs table
against their own runs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from scripts import ROOT, run_benchmark

sys.path.insert(0, str(ROOT / "benchmarks"))

import orthogonal_race as challenge
import race_report as rr
import size_sweep

RESULTS = ROOT / "benchmarks" / "results" / "size_sweep.json"


@pytest.mark.parametrize("size", list(size_sweep.SIZES))
def test_each_size_is_the_model_it_names(size: str) -> None:
    d_model, blocks = size_sweep.SIZES[size]
    w = size_sweep.workload(size, quick=False)
    model = w.make()
    assert model.head.in_features == d_model and len(model.blocks) == blocks
    assert (w.steps, w.tune_knob) == (size_sweep.STEPS, False)  # the same tokens per size
    assert size_sweep.parameters(w) == sum(p.numel() for p in model.parameters())


@pytest.mark.slow
def test_size_sweep_quick_and_merge(tmp_path: Path) -> None:
    a, b, merged = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "m.json"
    run_benchmark("size_sweep.py", "--quick", "--sizes", "d64x4", "--out", str(a))
    run_benchmark("size_sweep.py", "--quick", "--sizes", "d32", "--out", str(b))
    run_benchmark("size_sweep.py", "--merge", str(a), str(b), "--out", str(merged))
    doc = json.loads(merged.read_text())
    assert doc["benchmark"] == "size_sweep" and list(doc["workloads"]) == ["d32", "d64x4"]
    for part in doc["workloads"].values():
        assert {r["name"] for r in part["summary"]} == set(size_sweep.OPTIMIZERS)
        assert part["run"]["seeds"] == [1]
    assert "| d64x4 |" in size_sweep.render(doc) and merged.with_suffix(".png").exists()


def test_the_committed_results_and_the_docs_table_are_their_runs() -> None:
    if not RESULTS.exists():
        pytest.skip("no size sweep committed yet")
    doc = json.loads(RESULTS.read_text())
    assert doc["quick"] is False and list(doc["workloads"]) == list(size_sweep.SIZES)
    for size, part in doc["workloads"].items():
        assert part["run"]["seeds"] == [1, 2, 3], size
        assert json.loads(json.dumps(challenge.summarize(part["runs"]))) == part["summary"], size
    block = rr.block_between(size_sweep.PAGE.read_text(), size_sweep.MARKS)
    assert block == size_sweep.render(doc)
