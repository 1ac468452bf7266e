"""``benchmarks/gpu.py --quick`` runs on the CPU and writes every part (no timing checks).

The script is meant for the rare moments a GPU is at hand; running its quick mode here
keeps it working between them.
"""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("environment", "tests", "step_time", "stages", "eigh_vs_qr", "process_group")
VARIANTS = {
    ("sgd", "-"),
    ("adamw", "-"),
    ("kfac", "10/100"),
    ("kfac", "1/1"),
    ("kfac-qr", "1/1"),
    ("kfac-moments", "10/100"),
    ("kfac-recommended", "1/2"),
    ("kfac-per-layer", "10/100"),
    ("kfac-sync-free", "10/100"),
    ("kfac-recommended-synced", "1/2"),
    ("kfac-recommended-unbatched", "1/2"),
    ("kfac-compiled", "10/100"),  # skipped by --quick (compiling takes minutes on a CPU)
}


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def test_gpu_script_quick(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "gpu.py"),
            "--quick",
            "--no-tests",
            "--out",
            str(tmp_path / "gpu"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,  # a hang guard only; the quick mode takes seconds
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads((tmp_path / "gpu.json").read_text())
    text = (tmp_path / "gpu.md").read_text()
    assert text in proc.stdout

    for part in PARTS:
        assert part in results, part
    assert results["tests"]["skipped"] == "--no-tests"
    # on the CPU every other part must succeed: an error here is the script rotting
    for part in ("environment", "step_time", "stages", "eigh_vs_qr", "process_group"):
        assert "error" not in results[part] and "skipped" not in results[part], results[part]
    assert results["environment"]["torch"] and results["environment"]["device"] == "cpu"

    rows = results["step_time"]["rows"]
    assert {(r["model"], r["optimizer"], r["intervals"]) for r in rows} == {
        (m, o, i) for m in ("lm", "cnn") for o, i in VARIANTS
    }
    compiled = [r for r in rows if r["optimizer"] == "kfac-compiled"]
    assert [r["skipped"] for r in compiled] == ["--quick: compiling takes minutes on a CPU"] * 2
    for r in rows:
        if r["optimizer"] == "kfac-compiled":
            continue
        assert "error" not in r and "skipped" not in r, r
        assert _finite(r["ms"]) and r["ms"] > 0, r
        assert _finite(r["ms_vs_adamw"]) and _finite(r["final_loss"]), r
        assert r["peak_mib"] is None and r["syncs_per_step"] is None  # CUDA only
        assert r["launches_per_kind"] is None
        assert set(r["ms_per_kind"]) == set(r["kind_weights"]), r
        assert all(_finite(v) for v in r["ms_per_kind"].values()), r
        assert math.isclose(sum(r["kind_weights"].values()), 1.0), r
        if r["optimizer"].startswith("kfac"):
            assert r["kfac_layers"] > 0 and _finite(r["kfac_state_mib"]), r
        if r["optimizer"] == "adamw":
            assert r["ms_vs_adamw"] == 1.0
    # the recipe's variants are what kf.KFAC(model) sets up (on a CPU: batched eigh, no
    # sync_free), each but for the switch it turns off
    settings = {(r["model"], r["optimizer"]): r["kfac_settings"] for r in rows if "ms" in r}
    for model in ("lm", "cnn"):
        recipe = settings[(model, "kfac-recommended")]
        assert recipe["batched_eigh"] == "True" and recipe["scaling"] == "fisher", recipe
        assert recipe["eigenbasis_moments"] == "True" and "sync_free" not in recipe, recipe
        assert settings[(model, "kfac-recommended-synced")] == recipe
        unbatched = settings[(model, "kfac-recommended-unbatched")]
        assert unbatched == {k: v for k, v in recipe.items() if k != "batched_eigh"}
        assert settings[(model, "kfac-per-layer")] == {"grouped": "False"}
        assert settings[(model, "kfac-sync-free")] == {"sync_free": "True"}
    amortized = next(r for r in rows if r["optimizer"] == "kfac" and r["intervals"] == "10/100")
    assert amortized["kind_weights"] == {
        "factors+decomp": 0.01,
        "factors": 0.09,
        "precondition": 0.9,
    }

    eigh = results["eigh_vs_qr"]["rows"]
    assert [r["n"] for r in eigh] == [16, 32]
    for r in eigh:
        assert all(_finite(r[k]) for k in ("eigh_ms", "qr_ms", "eigh_over_qr")), r
        assert r["qr_eigenvalue_rel_error"] < 0.1, r

    # the recommended recipe's stage split (stages.py's smoke test, on the device) and its
    # two tables
    stages = results["stages"]
    assert Path(stages["json"]) == tmp_path / "gpu_stages.json"
    doc = stages["results"]
    assert doc["quick"] is True and sorted(doc["workloads"]) == ["gpt2", "lm", "lm4x"]
    assert "## The recommended recipe's stages" in text
    assert "| K-FAC's whole training step |" in text and "| `lm4x` | Muon |" in text

    pg = results["process_group"]
    assert pg["backend"] == "gloo" and pg["all_reduce_probe"] == 1.0
    assert pg["max_abs_diff"] < 1e-5, pg

    # the markdown table has a row for every model and variant
    table = {
        tuple(c.strip() for c in line.strip("|").split("|")[:3])
        for line in text.splitlines()
        if line.startswith("| lm |") or line.startswith("| cnn |")
    }
    for model in ("lm", "cnn"):
        for optimizer, intervals in VARIANTS:
            assert (model, optimizer, intervals) in table, (model, optimizer, intervals)
    # the switches' table: each switch on each model, against the step without it (the
    # compiled variant, skipped here, leaves its ratio open)
    section = text.split("## The switches that wait for a GPU")[1].split("\n## ")[0]
    lines = [line for line in section.splitlines() if line.startswith("| ")][1:]
    table_rows = {
        (cells[0], cells[1]): cells
        for cells in ([c.strip() for c in line.strip("|").split("|")] for line in lines)
    }
    for model in ("lm", "cnn"):
        for switch, without, with_ in _load_script().SWITCHES:
            row = table_rows[(model, switch)]
            assert row[2:4] == [without, with_], row
            if "compiled" in with_:
                assert row[5:7] == ["n/a", "n/a"], row
            else:
                # (the ratio of the unrounded times; the times are rounded to 0.1 ms)
                assert float(row[6]) == pytest.approx(float(row[5]) / float(row[4]), rel=0.05)
    assert "parts with errors: none" in text


def _load_script() -> Any:
    spec = importlib.util.spec_from_file_location("gpu_benchmark", ROOT / "benchmarks" / "gpu.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_gpu_script_records_failures(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A part or a variant that raises is recorded; the others still run; exit status 1."""
    gpu = _load_script()

    def broken(*args: Any, **kwargs: Any) -> dict[str, Any]:
        raise RuntimeError("broken on purpose")

    time_variant = gpu.time_variant

    def some_broken(wl: Any, v: Any, *args: Any) -> dict[str, Any]:
        if v.optimizer == "kfac-qr":
            raise RuntimeError("variant broken on purpose")
        return time_variant(wl, v, *args)

    monkeypatch.setattr(gpu, "part_process_group", broken)
    # the stage split has its own smoke test (test_gpu_script_quick)
    monkeypatch.setattr(gpu, "part_stages", lambda *a: {"skipped": "not under test"})
    monkeypatch.setattr(gpu, "time_variant", some_broken)
    argv = ["--quick", "--no-tests", "--models", "lm", "--out", str(tmp_path / "gpu")]
    argv += ["--steps", "1", "--warmup", "0", "--sizes", "8"]
    rc = gpu.main([*argv, "--threads", str(torch.get_num_threads())])
    assert rc == 1
    results = json.loads((tmp_path / "gpu.json").read_text())
    assert results["process_group"]["error"] == "RuntimeError: broken on purpose"
    assert "Traceback" in results["process_group"]["traceback"]
    assert [r["n"] for r in results["eigh_vs_qr"]["rows"]] == [8]
    rows = {r["optimizer"] + " " + r["intervals"]: r for r in results["step_time"]["rows"]}
    assert rows["kfac-qr 1/1"]["error"] == "RuntimeError: variant broken on purpose"
    assert _finite(rows["kfac-moments 10/100"]["ms"])  # the variant after it still ran
    text = (tmp_path / "gpu.md").read_text()
    assert "ERROR: RuntimeError: broken on purpose" in text
    assert "parts with errors: process_group, step_time lm kfac-qr 1/1" in text
