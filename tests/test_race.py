"""The optimizer race (``benchmarks/race.py``): its rules on synthetic rows, a quick run end
to end, and the tables of ``docs/benchmarks.md`` against the committed results files."""

from __future__ import annotations

import itertools
import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
from test_docs_numbers import appears, quoted_numbers, result_values

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import race_report as rr  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
PAGE = ROOT / "docs" / "benchmarks.md"


def curve(*losses: float, every: int = 10, per_step: float = 0.1) -> list[dict[str, float]]:
    """Evaluation rows at steps 0, every, 2·every, ... with ``per_step`` seconds a step."""
    return [
        {"step": every * i, "seconds": per_step * every * i, "test_loss": v}
        for i, v in enumerate(losses)
    ]


def record(name: str, phase: str, seed: int, rows: list[dict[str, float]], lr: float = 0.1) -> dict:
    """A run as ``race.py`` records it (one step per row step, 1 s of each kind)."""
    return {
        "optimizer": name,
        "phase": phase,
        "lr": lr,
        "settings": {"momentum": 0.9},
        "seed": seed,
        "rows": rows,
        "fwd_bwd_seconds": 1.0,
        "optimizer_seconds": 2.0,
        "steps": int(rows[-1]["step"]),
    }


# --------------------------------------------------------------------------- rules


def test_the_tie_rule_is_overlapping_ranges() -> None:
    assert rr.tie([1.0, 1.2], [1.2, 1.4])  # touching ranges tie
    assert rr.tie([1.0, 1.5], [1.1, 1.2])  # one inside the other
    assert not rr.tie([1.0, 1.19], [1.2, 1.4])
    assert rr.verdict([1.0, 1.1], [1.2, 1.3]) == "better"
    assert rr.verdict([1.2, 1.3], [1.0, 1.1]) == "worse"
    assert rr.verdict([1.0, 1.25], [1.2, 1.3]) == "tie"
    assert rr.verdict([1.0, math.inf], [1.2, 1.3]) == "tie"  # a diverged seed spans all
    assert rr.verdict([1.0, None], [1.2, 1.3]) == "tie"  # None: a loss stored as non-finite


def test_time_to_target_is_the_first_evaluation_at_or_below_it() -> None:
    a, b = curve(3.0, 2.0, 1.0), curve(3.0, 1.0, 0.5)
    t = rr.time_to_target([a, b], 2.0)  # at or below: both at step 10
    assert (t["steps"], t["seconds"], t["reached"]) == (10, 1.0, 2)
    t = rr.time_to_target([a, b], 1.0)
    assert (t["steps"], t["seconds"]) == (15.0, 1.5)
    assert t["steps_per_seed"] == [20, 10] and t["seconds_per_seed"] == [2.0, 1.0]


def test_a_seed_that_never_reaches_the_target_makes_it_never() -> None:
    t = rr.time_to_target([curve(3.0, 2.0), curve(3.0, 1.0)], 1.5)
    assert t["steps"] is None and t["seconds"] is None
    assert t["reached"] == 1 and t["seconds_per_seed"] == [None, 1.0]
    t = rr.time_to_target([curve(3.0, math.nan), curve(3.0, None)], 1.5)  # type: ignore[arg-type]
    assert t["reached"] == 0 and t["steps"] is None


def _synthetic_runs() -> list[dict[str, Any]]:
    runs = []
    for lr, end in ((0.1, 2.0), (0.2, 1.9)):
        runs.append(record("adamw", "tune", 0, curve(3.0, 2.5, end), lr))
    runs += [record("adamw", "eval", s, curve(3.0, 2.5, e), 0.2) for s, e in ((1, 1.9), (2, 2.1))]
    for lr, end in ((0.1, 1.0), (0.2, 1.2)):
        runs.append(record("kfac", "tune", 0, curve(3.0, 1.5, end), lr))
    runs += [record("kfac", "eval", s, curve(3.0, 1.8, e), 0.1) for s, e in ((1, 1.0), (2, 1.2))]
    return runs


def test_summary_targets_verdicts_and_step_costs() -> None:
    s = rr.summarize(_synthetic_runs())
    t = s["targets"]
    assert t["reference"] == "adamw" and t["best"] == "kfac"
    assert t["reference_loss"] == pytest.approx(2.0) and t["best_loss"] == pytest.approx(1.1)
    adamw, kfac = s["rows"]
    assert (adamw["vs_reference"], adamw["vs_best"]) == ("-", "worse")
    assert (kfac["vs_reference"], kfac["vs_best"]) == ("better", "best")
    assert kfac["lr"] == 0.1 and kfac["tuning_runs"] == 2 and kfac["lr_at_grid_edge"]
    assert kfac["finals"] == [1.0, 1.2] and kfac["final_min"] == 1.0
    assert kfac["final_std"] == pytest.approx(math.sqrt(0.02))
    # kfac: 1.8 at step 10 on both seeds reaches AdamW's 2.0; adamw: seed 2 ends above it
    assert (kfac["steps_to_reference"], kfac["seconds_to_reference"]) == (10, 1.0)
    assert adamw["seconds_to_reference"] is None and adamw["reached_to_reference"] == 1
    assert kfac["seconds_to_best"] is None and kfac["reached_to_best"] == 1
    assert kfac["fwd_bwd_ms_per_step"] == pytest.approx(1e3 / 20)
    assert kfac["optimizer_ms_per_step"] == pytest.approx(2e3 / 20)


def test_steps_to_muons_final_loss_are_counted_where_muon_raced() -> None:
    """The fewest-steps yardstick: every optimizer's steps to Muon's mean final loss, in
    the summary and as a column of the table (absent where Muon did not race)."""
    runs = []
    for name, losses in (
        ("adamw", (3.0, 2.0, 1.5)),
        ("muon", (3.0, 1.5, 1.0)),
        ("kfac-moments", (3.0, 1.0, 0.5)),
    ):
        runs.append(record(name, "tune", 0, curve(*losses)))
        runs += [record(name, "eval", seed, curve(*losses)) for seed in (1, 2)]
    s = rr.summarize(runs)
    assert s["targets"]["muon_loss"] == 1.0
    rows = {r["optimizer"]: r for r in s["rows"]}
    assert rows["kfac-moments"]["steps_to_muon"] == 10 and rows["muon"]["steps_to_muon"] == 20
    assert rows["adamw"]["steps_to_muon"] is None and rows["adamw"]["reached_to_muon"] == 0
    doc = {
        "workload": "w",
        "summary": s,
        "machine": {"cpu": "c", "threads": 1, "torch": "t"},
        "tuning": {"eval_seeds": [1, 2], "statement": "x."},
        "commit": "abc",
        "command": "python benchmarks/race.py",
        "description": "d",
        "steps": 20,
        "eval_every": 10,
    }
    text = rr.render(doc)
    assert "| steps to Muon's |" in text and "Muon's 1.0000" in text
    assert "| never (0/2) | 1.5000" in text  # AdamW's row
    without = rr.summarize([r for r in runs if r["optimizer"] != "muon"])
    assert "muon_loss" not in without["targets"]
    assert "Muon" not in rr.render({**doc, "summary": without})


def test_a_diverged_optimizer_is_never_best() -> None:
    runs = _synthetic_runs()
    for r in runs:
        if r["optimizer"] == "kfac" and r["phase"] == "eval" and r["seed"] == 2:
            r["rows"][-1]["test_loss"] = None
    s = rr.summarize(runs)
    assert s["targets"]["best"] == "adamw"
    kfac = s["rows"][1]
    assert kfac["final_mean"] is None and kfac["final_max"] is None
    json.dumps(s, allow_nan=False)  # a results file holds no NaN or Infinity


def test_the_examples_of_the_race_modules() -> None:
    import doctest

    import race_workloads as rw

    for module in (rr, rw):
        assert doctest.testmod(module).failed == 0, module.__name__


def test_the_grid_is_equal_for_every_optimizer() -> None:
    import race_workloads as rw

    for builder, per in ((rw.race_lm, 8), (rw.race_digits, 4)):
        w = builder(True)
        sizes = {name: len(rw.grid(name, w)) for name in rw.OPTIMIZERS}
        assert set(sizes.values()) == {per}, sizes
        lrs = sorted({lr for lr, _ in rw.grid("adamw", w)})
        assert len(lrs) == 4 and all(1.9 < b / a < 2.1 for a, b in itertools.pairwise(lrs))
    assert {tuple(s["betas"]) for _, s in rw.grid("adamw", rw.race_lm(True))} == {
        (0.9, 0.95),
        (0.9, 0.999),
    }


def test_the_two_moments_variants_differ_in_the_schedule_only() -> None:
    """docs/benchmarks.md reads the distance of the two ``kfac-moments`` rows as the cost
    of a stale eigenbasis: everything but the update intervals and the factor decay is
    the same recipe, learning-rate grid and second knob."""
    import optimizers
    import race_workloads as rw

    lazy, fresh = (list(optimizers.KFAC[n]) for n in ("kfac-moments", "kfac-moments-fresh"))
    assert lazy[4] == (5, 5) and fresh[4] == (1, 2)
    assert (lazy[5], fresh[5]) == (0.8, 0.9)
    del lazy[4:6], fresh[4:6]
    assert lazy == fresh
    assert optimizers.LRS["kfac-moments"] == optimizers.LRS["kfac-moments-fresh"]
    assert rw.KNOBS["kfac-moments"] == rw.KNOBS["kfac-moments-fresh"]


def test_the_refinement_brackets_the_best_learning_rate() -> None:
    """Two more rates for every optimizer: beyond a best at either edge of its grid,
    halfway to its neighbours inside, never one already tried."""
    import race_workloads as rw

    grid = [0.1, 0.2, 0.4, 0.8]
    assert rw.refine(grid, 0.8) == [1.6, 3.2]
    assert rw.refine(grid, 0.1) == [0.05, 0.025]
    assert rw.refine(grid, 0.4) == [0.57, 0.28]
    assert rw.refine([0.1], 0.1) == [0.14, 0.071]  # one point: both sides
    for best in grid:
        got = rw.refine(grid, best)
        assert len(got) == rw.REFINE_POINTS and not set(got) & set(grid)


def test_rounding_matches_the_docs_numbers_test() -> None:
    from decimal import Decimal

    for x, places in ((0.12345, 4), (2.675, 2), (108.5, 0), (1.25e-3, 4)):
        assert appears(rr.rounded(x, places), [Decimal(str(x))])


# --------------------------------------------------------------------------- end to end


def _quick(tmp_path: Path, workloads: list[str], optimizers: list[str]) -> dict[str, Any]:
    import race
    import torch

    threads = torch.get_num_threads()
    argv = ["--quick", "--threads", "1", "--workloads", *workloads, "--optimizers", *optimizers]
    assert race.main([*argv, "--out", str(tmp_path), "-q"]) == 0
    assert torch.get_num_threads() == threads  # restored
    return {w: json.loads((tmp_path / f"race_{_ran_as(w)}.json").read_text()) for w in workloads}


def _ran_as(workload: str) -> str:
    """The name a workload races under on this CPU (``lm_long_f32`` without native bf16)."""
    import optimizers
    import race_workloads as rw

    return rw.precision_named(rw.WORKLOADS[workload](True), optimizers.NATIVE_BF16).name


def _check(doc: dict[str, Any], tmp_path: Path, optimizers: list[str]) -> None:
    w = doc["workload"]
    assert (tmp_path / f"race_{w}.png").stat().st_size > 0
    assert doc["quick"] and doc["commit"] and isinstance(doc["dirty"], bool)
    assert doc["machine"]["threads"] == 1 and doc["machine"]["cpu"]
    per = doc["tuning"]["runs_per_optimizer"]
    assert per == 2 * (2 if doc["tuning"]["tune_knob"] else 1) + 1  # --quick: 1 refinement
    names = [r["optimizer"] for r in doc["summary"]["rows"]]
    assert names == optimizers
    for name in names:
        mine = [r for r in doc["runs"] if r["optimizer"] == name]
        assert len([r for r in mine if r["phase"] == "tune"]) == per  # equal budgets
        evals = [r for r in mine if r["phase"] == "eval"]
        assert [r["seed"] for r in evals] == [1, 2]
        best = min(
            (r for r in mine if r["phase"] == "tune"), key=lambda r: rr.final_loss(r["rows"])
        )
        assert all((r["lr"], r["settings"]) == (best["lr"], best["settings"]) for r in evals)
        assert all(r["fwd_bwd_seconds"] > 0 and r["optimizer_seconds"] > 0 for r in mine)
        assert all(r["rows"][-1]["step"] == doc["steps"] for r in mine)
    # every number the table quotes is in the results file (the docs-numbers rule)
    text = rr.render(doc, plot=True)
    values = result_values([tmp_path / f"race_{w}.json"])
    missing = [n for _, n in quoted_numbers(text) if not appears(n, values)]
    assert not missing, text
    assert text.count("\n| ") == len(names) + 1  # header and a row per optimizer


def test_quick_race_end_to_end(tmp_path: Path) -> None:
    """Two tiny workloads (one tuning the second knob), two optimizers, into ``tmp_path``."""
    optimizers = ["adamw", "kfac-moments"]
    docs = _quick(tmp_path, ["lm", "digits"], optimizers)
    assert docs["lm"]["tuning"]["tune_knob"] and not docs["digits"]["tuning"]["tune_knob"]
    for doc in docs.values():
        _check(doc, tmp_path, optimizers)
    with pytest.raises(ValueError, match="quick"):  # smoke tests are not for the docs
        rr.block(tmp_path, "lm")
    results = tmp_path / "results"
    results.mkdir()
    (results / "race_lm.json").write_text(json.dumps({**docs["lm"], "quick": False}))
    page = tmp_path / "page.md"
    start, end = rr.markers("lm")
    page.write_text(f"# x\n\n{start}\nold\n{end}\n")
    assert rr.write_tables(page, results) == ["lm"]
    assert rr.blocks_of(page.read_text())["lm"] == rr.render({**docs["lm"], "quick": False})
    assert rr.write_tables(page, results) == []  # drift-free now
    assert rr.write_tables(page, tmp_path / "none") == ["lm"]
    assert rr.blocks_of(page.read_text())["lm"] == rr.PLACEHOLDER.format(w="lm")


def test_a_race_in_parts_joins_into_one(tmp_path: Path) -> None:
    """``--part`` races only the optimizers named (no AdamW, no summary); ``--merge``
    joins the parts into the results a whole race writes, and refuses parts of other races
    or an optimizer raced twice."""
    import race

    a, b, joined = tmp_path / "a", tmp_path / "b", tmp_path / "joined"
    quick = ["--quick", "--threads", "1", "--workloads", "digits", "-q"]
    assert race.main([*quick, "--optimizers", "adamw", "--out", str(a)]) == 0
    assert race.main([*quick, "--optimizers", "kfac-moments", "--part", "--out", str(b)]) == 0
    part = json.loads((b / "race_digits.json").read_text())
    assert part["summary"] is None and {r["optimizer"] for r in part["runs"]} == {"kfac-moments"}
    files = [str(a / "race_digits.json"), str(b / "race_digits.json")]
    assert race.main(["--merge", *files, "--out", str(joined)]) == 0
    doc = json.loads((joined / "race_digits.json").read_text())
    _check(doc, joined, ["adamw", "kfac-moments"])
    assert "--merge" in doc["command"] and len(doc["parts"]) == 2
    with pytest.raises(SystemExit, match="both"):
        race.merge_parts([Path(files[0]), Path(files[0])], joined)
    with pytest.raises(SystemExit, match="AdamW"):
        race.merge_parts([Path(files[1])], joined)
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**part, "steps": part["steps"] + 1}))
    with pytest.raises(SystemExit, match="steps"):
        race.merge_parts([Path(files[0]), other], joined)


@pytest.mark.slow
def test_quick_race_every_workload_and_optimizer(tmp_path: Path) -> None:
    """Every workload (GPT-2 through ``kf.KFAC``, the CNN, the autoencoder) with every
    optimizer of the default race."""
    import race_workloads as rw

    optimizers = list(rw.DEFAULT_OPTIMIZERS)
    docs = _quick(tmp_path, list(rw.WORKLOADS), optimizers)
    for doc in docs.values():
        _check(doc, tmp_path, optimizers)
        assert all(r["final_mean"] is not None for r in doc["summary"]["rows"]), doc["workload"]


def test_the_default_output_is_untracked_and_quick_stays_out_of_results() -> None:
    import race

    assert Path(race.parse_args([]).out) == ROOT / "benchmarks" / "out"
    with pytest.raises(SystemExit):
        race.parse_args(["--quick", "--out", str(RESULTS)])


# --------------------------------------------------------------------------- the docs


def test_the_docs_page_has_a_block_per_workload() -> None:
    import race_workloads as rw

    names = list(rr.blocks_of(PAGE.read_text()))
    assert [n for n in names if not n.endswith(("_bf16", "_f32"))] == list(rw.WORKLOADS)
    # the others: workloads raced under bfloat16 autocast (race.py --autocast), and one
    # under autocast by itself raced in float32 where bfloat16 is not native
    assert all(n.removesuffix("_bf16").removesuffix("_f32") in rw.WORKLOADS for n in names)
    assert "benchmarks.md" in (ROOT / "mkdocs.yml").read_text()


def test_the_docs_tables_are_the_committed_results() -> None:
    """``docs/benchmarks.md`` equals what ``race.py --tables`` renders from
    ``benchmarks/results/race_*.json``; run ``python benchmarks/race.py --tables``."""
    if not sorted(RESULTS.glob("race_*.json")):
        pytest.skip("no race results committed yet (benchmarks/results/race_*.json)")
    blocks = rr.blocks_of(PAGE.read_text())
    drifted = [w for w, text in blocks.items() if text != rr.block(RESULTS, w)]
    assert not drifted, f"stale tables in docs/benchmarks.md: {drifted}; run race.py --tables"


# --------------------------------------------------------------------------- headline


def test_the_headline_times_the_recipe_to_each_competitors_final_loss() -> None:
    """Per competitor (not K-FAC): the recipe's seconds and steps to its mean final loss
    over the competitor's whole run; "never" (None) when a seed does not get there; the
    lowest final first; K-FAC's other variants are not competitors."""
    runs = []
    for name, losses in (
        ("adamw", (3.0, 2.0, 1.5)),  # its whole run: 20 steps, 2 s
        ("muon", (3.0, 1.5, 1.0)),
        ("soap", (3.0, 1.2, 0.4)),
        ("kfac-moments", (3.0, 0.1, 0.1)),
        (rr.RECIPE, (3.0, 1.0, 0.5)),
    ):
        runs += [record(name, "eval", seed, curve(*losses)) for seed in (1, 2)]
    rows = rr.headline([{"workload": "w", "runs": runs}])
    assert [r["competitor"] for r in rows] == ["soap", "muon", "adamw"]
    by = {r["competitor"]: r for r in rows}
    assert (by["muon"]["kfac_steps"], by["muon"]["kfac_seconds"]) == (10, 1.0)
    assert by["muon"]["competitor_seconds"] == 2.0 and by["muon"]["ratio"] == 0.5
    assert by["soap"]["kfac_seconds"] is None and by["soap"]["kfac_reached"] == "0/2"
    table = rr.render_headline(rows)
    assert "| w | soap | 0.4000 | 2.0 | 20 | never (0/2) | never | - |" in table
    assert "| w | muon | 1.0000 | 2.0 | 20 | 1.0 | 10 | 0.50 |" in table


def test_the_headline_is_the_committed_results() -> None:
    """``benchmarks/results/race_headline.json`` and the headline of
    ``docs/benchmarks.md`` are what ``race.py --tables`` computes from the committed
    race results; run ``python benchmarks/race.py --tables``."""
    saved = json.loads((RESULTS / "race_headline.json").read_text())
    page = PAGE.read_text()
    docs = rr.recipe_docs(RESULTS, list(rr.blocks_of(page)))
    assert [d["workload"] for d in docs] == list(rr.blocks_of(page))
    rows = rr.headline(docs)
    assert json.loads(json.dumps(rows)) == saved["rows"]
    start, end = rr.HEADLINE
    assert f"{start}\n{rr.render_headline(rows)}\n{end}" in page
