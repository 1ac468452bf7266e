"""The race's zero-tuning row (``benchmarks/race_default.py``): ``kf.KFAC(model)`` with no
argument but the model, its default learning rate derived from the committed race results,
a quick run end to end, and its table in ``docs/benchmarks.md``."""

from __future__ import annotations

import doctest
import json
import sys
from pathlib import Path

import pytest
from test_docs_numbers import appears, quoted_numbers, result_values

import kfac_func as kf

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import race_default as rd  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
PAGE = ROOT / "docs" / "benchmarks.md"


def test_the_examples_of_the_module() -> None:
    assert doctest.testmod(rd).failed == 0


def test_the_default_learning_rate_is_the_one_the_race_results_give() -> None:
    """``kf.KFAC(model)``'s learning rate is what ``--derive-lr`` derives from the
    committed tuning runs (a new race that moves it makes this fail)."""
    if not sorted(RESULTS.glob("race_*.json")):
        pytest.skip("no race results committed")
    lr, fractions = rd.derive_lr(RESULTS)
    assert lr == kf.RECIPES["recommended"].lr
    assert len(fractions) == len(rd.rw.WORKLOADS)
    assert max(f[f"{lr:g}"] for f in fractions.values()) < 1


def test_quick_runs_end_to_end_and_merge(tmp_path: Path) -> None:
    """Two tiny workloads run apart, then merged in the race's order; the default takes no
    setting."""
    import optimizers

    for name, folder in (("digits", "b"), ("lm", "a")):
        argv = ["--quick", "--threads", "1", "--workloads", name, "--eval-seeds", "1"]
        assert rd.main([*argv, "--out", str(tmp_path / folder)]) == 0
    doc = rd.merge([tmp_path / "b", tmp_path / "a"])
    assert [w["workload"] for w in doc["workloads"]] == ["lm", "digits"]
    run = doc["workloads"][0]["runs"][0]
    assert run["optimizer"] == "kfac-default" and run["lr"] == kf.RECIPES["recommended"].lr
    assert run["rows"][-1]["step"] == doc["workloads"][0]["steps"]
    assert all("commit" not in w for w in doc["workloads"])  # one commit: said once
    later = json.loads((tmp_path / "a" / rd.FILE).read_text())
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / rd.FILE).write_text(json.dumps({**later, "commit": "f" * 40, "dirty": False}))
    joined = rd.merge([tmp_path / "b", tmp_path / "c"])  # a workload added later
    assert [w["commit"] for w in joined["workloads"]] == ["f" * 40, doc["commit"]]
    assert rd.commits(joined).startswith(f"commit `{'f' * 10}` (lm)")
    with pytest.raises(ValueError, match="appears twice"):
        rd.merge([tmp_path / "a", tmp_path / "a"])
    with pytest.raises(ValueError, match="takes no settings"):
        w = rd.rw.WORKLOADS["digits"](True)
        optimizers.train("kfac-default", 0.1, w, 1, 2, {"damping": 0.1})


def test_the_docs_table_is_the_committed_results() -> None:
    """``docs/benchmarks.md``'s zero-tuning table equals what ``--tables`` renders from
    ``benchmarks/results/race_default.json``, every number found in it."""
    path = RESULTS / rd.FILE
    if not path.exists():
        pytest.skip("no zero-tuning results committed")
    text = PAGE.read_text()
    start, end = rd.MARKERS
    block = text.split(start + "\n", 1)[1].split("\n" + end, 1)[0]
    doc = json.loads(path.read_text())
    assert block == rd.render(doc), "stale table: run python benchmarks/race_default.py --tables"
    values = result_values([path])
    missing = [n for _, n in quoted_numbers(block) if not appears(n, values)]
    assert not missing
    assert [w["workload"] for w in doc["workloads"]] == list(rd.rw.WORKLOADS)


def test_the_one_rate_table_is_the_committed_race_results() -> None:
    """The table of how far one learning rate carries each optimizer equals what
    ``--tables`` renders from the committed race results."""
    if len(rd.race_docs(RESULTS)) != len(rd.rw.WORKLOADS):
        pytest.skip("not every workload's race results are committed")
    start, end = rd.ONE_RATE_MARKERS
    block = PAGE.read_text().split(start + "\n", 1)[1].split("\n" + end, 1)[0]
    assert block == rd.render_one_rate(RESULTS), "stale: python benchmarks/race_default.py --tables"
