"""Smoke test of the benchmark scripts: they run and print their table (no timing checks)."""

from __future__ import annotations

import csv
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from scripts import ROOT, run_benchmark


def _run_quick(script: str) -> subprocess.CompletedProcess[str]:
    """Run ``benchmarks/<script> --quick``; it must exit 0."""
    return run_benchmark(script, "--quick")


@pytest.mark.slow
def test_step_time_quick() -> None:
    proc = _run_quick("step_time.py")
    assert "ratio" in proc.stdout
    for model in ("mlp", "cnn"):
        for intervals in ("1/1", "10/100"):
            assert any(
                line.split()[:2] == [model, intervals] for line in proc.stdout.splitlines()
            ), proc.stdout


@pytest.mark.slow
def test_distributed_quick() -> None:
    proc = _run_quick("distributed.py")
    assert "ratio" in proc.stdout and "oversubscribed" in proc.stdout
    # world, strategy, F/I, step ms, ratio, factors, decomp, grads, total (KiB)
    rows = {tuple(line.split()[:3]): line.split()[3:] for line in proc.stdout.splitlines()}
    expected = [
        ("1", "COMM_OPT"),
        ("2", "COMM_OPT"),
        ("2", "MEM_OPT"),
        ("4", "COMM_OPT"),
        ("4", "HYBRID_OPT"),
        ("4", "MEM_OPT"),
    ]
    for intervals in ("1/1", "10/100"):
        for world, strategy in expected:
            assert (world, strategy, intervals) in rows, proc.stdout
        assert rows["1", "COMM_OPT", intervals][1] == "1.00"
        assert float(rows["1", "COMM_OPT", intervals][-1]) == 0.0  # one rank sends nothing
        assert float(rows["4", "COMM_OPT", intervals][4]) == 0.0  # no gradient broadcast
        assert float(rows["4", "MEM_OPT", intervals][3]) == 0.0  # no decomposition broadcast
        assert float(rows["4", "MEM_OPT", intervals][2]) > 0.0


@pytest.mark.slow
def test_vs_reference_quick() -> None:
    proc = _run_quick("vs_reference.py")
    lines = proc.stdout.splitlines()
    for model in ("mlp", "cnn"):
        for intervals in ("1/1", "10/100"):
            for method in ("eigen", "inverse"):
                assert any(line.split()[:3] == [model, intervals, method] for line in lines), (
                    proc.stdout
                )
        # the re-statement of kfac-pytorch agrees with the adapter
        for method in ("eigen", "inverse"):
            line = next(x for x in lines if x.startswith(f"correctness {model} {method}:"))
            assert "OK" in line, line
    assert "adapter/ref" in proc.stdout and "step peak MiB" in proc.stdout


def test_vs_reference_docs_block_is_the_committed_results() -> None:
    """``docs/performance.md``'s drop-in table equals what ``vs_reference.py --tables``
    renders from ``benchmarks/results/vs_reference.json``, every number found in it."""
    from test_docs_numbers import appears, quoted_numbers, result_values

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import race_report as rr
    import vs_reference as vr

    path = ROOT / "benchmarks" / "results" / "vs_reference.json"
    doc = json.loads(path.read_text())
    block = rr.block_between(vr.PAGE.read_text(), vr.MARKS)
    assert block == vr.render(doc), "stale: python benchmarks/vs_reference.py --tables"
    assert not doc["quick"]
    values = result_values([path])
    assert not [n for _, n in quoted_numbers(block) if not appears(n, values)]


@pytest.mark.slow
def test_convergence_quick() -> None:
    proc = _run_quick("convergence.py")
    lines = proc.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("result:"))
    # optimizer, lr, epochs median [min-max], seconds median [min-max], s/epoch
    result = {line.split()[0]: line.split() for line in lines[start + 2 : start + 5]}
    assert sorted(result) == ["Adam", "K-FAC", "SGD"], proc.stdout
    for row in result.values():
        # reached within 4 epochs; seconds print with one decimal (a fast run shows 0.0)
        assert 1 <= float(row[2]) <= 4 and float(row[4]) >= 0 and float(row[6]) > 0, row
    for other in ("SGD", "Adam"):
        assert any(line.startswith(f"K-FAC vs {other}: epochs ratio") for line in lines)
    written = [Path(p) for line in lines if line.startswith("wrote ") for p in line.split()[1::2]]
    assert sorted(p.name for p in written) == [
        "convergence.csv",
        "convergence.png",
        "convergence_curves.csv",
        "convergence_curves.png",
    ], proc.stdout
    try:
        with open(written[0], newline="") as f:
            runs = list(csv.DictReader(f))
        assert len(runs) == 3 * 2  # optimizers x seeds at one learning rate each
        assert all(r["epochs"] and float(r["best_accuracy"]) >= 0.4 for r in runs)
        assert all(p.stat().st_size > 0 for p in written)
    finally:
        shutil.rmtree(written[0].parent)  # the quick mode's temporary folder


@pytest.mark.slow
def test_optimizers_quick() -> None:
    proc = _run_quick("optimizers.py")
    for workload in ("lm", "digits"):
        assert f"{workload}: target = AdamW's final test loss" in proc.stdout, proc.stdout
    for name in ("sgd", "adamw", "muon", "kfac", "kfac-ekfac"):
        assert any(line.split()[:1] == [name] for line in proc.stdout.splitlines()), name


@pytest.mark.slow
def test_tied_lm_quick(tmp_path: Path) -> None:
    """The tied-weight benchmark runs both variants and writes its CSV."""
    run_benchmark("tied_lm.py", "--quick", "--out", str(tmp_path / "tied"))
    rows = list(csv.DictReader((tmp_path / "tied.csv").open()))
    assert {r["variant"] for r in rows} == {"tied", "skip"}
    # the skip variant leaves the shared weight to AdamW: fewer K-FAC parameters
    kfac = {r["variant"]: int(r["kfac_params"]) for r in rows}
    assert kfac["tied"] > kfac["skip"]


def test_compile_model_quick() -> None:
    proc = _run_quick("compile_model.py")
    rows = {" ".join(line.split()[:2]): line.split() for line in proc.stdout.splitlines()}
    for name in ("eager sgd", "eager kfac", "compiled sgd", "compiled kfac"):
        assert name in rows, proc.stdout
    assert int(rows["compiled kfac"][-2]) > int(rows["compiled sgd"][-2]) >= 1  # graph breaks
    assert "ratio compiled kfac / compiled sgd" in proc.stdout


def test_real_models_coverage_table(tmp_path: Path) -> None:
    """The coverage table of the fixture models: every parameter preconditioned."""
    pytest.importorskip("transformers")
    run_benchmark("real_models.py", "--out", str(tmp_path / "c"))
    rows = list(csv.DictReader((tmp_path / "c.csv").open()))
    assert {r["model"] for r in rows} >= {"gpt2", "llama", "llama-tied", "bert", "nanogpt"}
    for r in rows:
        assert r["params_preconditioned"] == r["params"] and not r["skipped"], r


def test_families_table(tmp_path: Path) -> None:
    """The families that failed under the recommended recipe (T5, OPT, Qwen2-MoE: layers on
    flattened rows) run, and the mixture-of-experts families and OPT (its learned
    positions from their recorded lookup) are preconditioned whole."""
    pytest.importorskip("transformers")
    out = tmp_path / "families.json"
    families = ["T5", "OPT", "Qwen2-MoE", "Mixtral"]
    run_benchmark("families.py", "--out", str(out), "--families", *families)
    rows = {r["family"]: r for r in json.loads(out.read_text())["families"]}
    assert all(rows[f]["runs"] for f in families), rows
    for family in ("Qwen2-MoE", "Mixtral"):
        assert rows[family]["preconditioned_pct"] >= 95.0, rows[family]
        assert {"moe", "router"} <= set(rows[family]["kinds"])
    assert "a relative-position table" in " ".join(rows["T5"]["skipped"].values())
    assert rows["OPT"]["preconditioned_pct"] == 100.0 and not rows["OPT"]["skipped"], rows["OPT"]
    assert rows["OPT"]["kinds"]["recorded_embedding"] == 1


@pytest.mark.slow
def test_step_ops_quick(tmp_path: Path) -> None:
    """The step-ops benchmark's JSON has every row, positive operation counts at every
    depth, and times for every row that is timed without compilation."""
    out = tmp_path / "step_ops.json"
    proc = run_benchmark("step_ops.py", "--quick", "--out", str(out))
    result = json.loads(out.read_text())
    depths = [str(d) for d in result["depths"]]
    assert len(depths) == 2 and result["commit"] and result["machine"]["threads"] == 1
    assert result["layers"][depths[1]] > result["layers"][depths[0]] > 0
    rows = {r["name"]: r for r in result["rows"]}
    expected = ["forward+backward", "AdamW step (foreach)", "Muon step (+AdamW on the rest)"]
    for v in ("eigen", "moments"):
        expected += [f"forward+backward, K-FAC {v} hooks {s}" for s in ("idle", "recording")]
        for suffix in ("", " compiled"):
            expected += [
                f"K-FAC {v}{suffix}: {k}"
                for k in ("precondition", "factors", "factors+decomp", "amortized 5/5")
            ]
            expected.append(f"K-FAC {v}{suffix}: amortized 5/5 (whole step)")
    assert sorted(rows) == sorted([*expected, "AdamW: whole step", "Muon: whole step"])
    for name, r in rows.items():
        assert all(r["ops"][d] > 0 for d in depths), name
        assert r["ops"][depths[1]] > r["ops"][depths[0]], name  # deeper: more operations
        if "compiled" in name:  # --quick does not compile
            assert all(r["ms"][d] is None for d in depths), name
        else:
            assert all(r["ms"][d] > 0 for d in depths), name
            assert r["ms_growth"] > 0 and r["ms_vs_adamw"][depths[0]] > 0, name
    # a step that also updates the factors runs more operations than one that does not
    for v in ("eigen", "moments"):
        ops = {k: rows[f"K-FAC {v}: {k}"]["ops"][depths[0]] for k in ("precondition", "factors")}
        assert ops["factors"] > ops["precondition"], v
    assert "AdamW step (foreach)" in proc.stdout and "registered K-FAC layers" in proc.stdout


def test_house_drawing(tmp_path: Path) -> None:
    """The architecture page's pictures come from the imports: both files are drawn, and
    the graph they draw has the arrows the code has (the stage imports the settings it
    takes; blocks import no other package)."""
    pytest.importorskip("matplotlib")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import house_drawing
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    house_drawing.main(["--out-dir", str(tmp_path), "--suffix", "_t"])
    assert (tmp_path / "house_t.png").stat().st_size > 0
    assert (tmp_path / "house_step_t.png").stat().st_size > 0
    deps = house_drawing.imports(ROOT)
    assert "step.layer_step" in deps["step.grouped"] and "step.grouped" in deps["step.update"]
    outside = {d.split(".")[0] for m, ds in deps.items() if m.startswith("blocks") for d in ds}
    assert outside <= {"blocks"}, outside


@pytest.mark.slow
def test_scale_quick(tmp_path: Path) -> None:
    """The scale benchmark on a tiny GPT-2: every optimizer's row (SOAP's where heavyball
    is installed), K-FAC's state by field, every checkpoint time, and the old digest
    beside the new one."""
    import importlib.util

    out = tmp_path / "scale.json"
    proc = run_benchmark("scale.py", "--quick", "--steps", "3", "--out", str(out))
    doc = json.loads(out.read_text())
    names = ["adamw", "muon", "soap", "kfac", "kfac-pytorch"]
    if importlib.util.find_spec("heavyball") is None:
        names.remove("soap")
    assert [r["optimizer"] for r in doc["summary"]] == names, proc.stdout
    kfac = next(r for r in doc["rows"] if r["optimizer"] == "kfac")
    assert {"A", "G", "qa", "basis_moment"} <= set(kfac["state_dict_bytes"])
    assert {"a_factor", "basis_moment"} <= set(kfac["runtime_bytes"])
    for r in doc["summary"]:
        assert r["state_over_params"] > 0 and r["dcp_load_s"] > 0 and r["state_dict_s"] > 0, r
    assert doc["digest"]["gib_s"] > doc["digest"]["old_gib_s"] > 0
    assert set(doc["machine"]["bf16_flags"]) >= {"avx512_bf16", "amx_bf16"}
    assert "| kfac |" in proc.stdout


def test_gram_blocks_quick(tmp_path: Path) -> None:
    out = tmp_path / "gram_blocks.json"
    proc = run_benchmark("gram_blocks.py", "--quick", "--out", str(out))
    assert "triangle/one" in proc.stdout
    doc = json.loads(out.read_text())
    assert doc["quick"] and {r["blocked"] for r in doc["rows"]} == {True, False}
    assert all(r["max_relative_error"] < 1e-2 for r in doc["rows"])
