"""Smoke test of ``benchmarks/stages.py``: it runs, prints every row and writes the JSON
that describes its run (no timing checks), and its helpers count what they say."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
from scripts import run_benchmark

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import stage_arithmetic as sa  # noqa: E402
import stages  # noqa: E402

STAGE_ROWS = [
    "batch factors",
    "fold (running average)",
    "decomposition: eigh",
    "  of which the batched eighs",
    'decomposition: QR refresh ("qr")',
    "carry moments into new bases",
    "powers of the wide layers",
    "precondition stage",
    "  projections in and out",
    "  moments (Adam in the basis)",
    "  wide layers: powers applied",
    "  wide layers: Newton-Schulz",
    "  rest of the precondition stage",
    "write-back to .grad",
    "parameter update",
    "sum of stages, step with eigh",
    "sum of stages, step without eigh",
    "sum of stages, amortized (eigh every 2)",
]
FLOORED = [r for r in STAGE_ROWS if "rest" not in r]
EIGHS, GATHERED = (round(f(2000) * 2000) for f in (stages.eigh_share, stages.statistics_share))
LONG = f"amortized over 2,000 steps ({EIGHS} with eigh, {GATHERED} with statistics)"
OTHERS = [
    "Muon, as the race runs it, + AdamW",
    "Muon, float32 Newton-Schulz + AdamW",
    "SOAP (2-step mean)",
    "AdamW",
]


@pytest.mark.slow
def test_stages_quick(tmp_path: Path) -> None:
    out = tmp_path / "stages.json"
    proc = run_benchmark("stages.py", "--quick", "--out", str(out))
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "stages" and doc["quick"] is True
    assert doc["commit"] and isinstance(doc["dirty"], bool)
    machine = doc["machine"]
    assert machine["cpu"] and machine["threads"] == 1 and machine["torch"] == torch.__version__
    assert set(machine["bf16_flags"]) >= {"avx512_bf16", "amx_bf16"}
    for when in ("before", "after", "used"):
        rates = doc["rates"][when]
        assert rates["matmul_float32_macs_per_s"] > 0 and rates["memory_bytes_per_s"] > 0
        assert rates["matmul_bfloat16_macs_per_s"] > 0
    # the recommended recipe, its wide layers those of the tiny models (stages.QUICK_WIDE)
    assert doc["recipe"]["name"] == "kfac-moments-wide" == stages.rr.RECIPE
    growing = {"growing_interval": {"first": 2, "until": 256, "most": 32}}
    assert doc["recipe"]["settings"]["inv_update_steps"] == growing  # every 2 steps here
    assert doc["recipe"]["settings"]["orthogonal"]["wider_than"] == stages.QUICK_WIDE
    assert sorted(doc["workloads"]) == ["gpt2", "lm", "lm4x"]
    soap = stages.optimizers._heavyball() is not None
    for name, w in doc["workloads"].items():
        rows = {r["name"]: r for r in w["rows"]}
        expected = [
            "plain forward+backward",
            "forward+backward, K-FAC hooks",
            "statistics in the hooks",
            f"  amortized over 2,000 steps ({GATHERED} with statistics)",
            *STAGE_ROWS,
            "step with eigh",
            "step without eigh",
            "amortized (eigh every 2)",
            "  not in a stage row",
            LONG,
            *(o for o in OTHERS if soap or "SOAP" not in o),
        ]
        assert [r for r in rows if not r.startswith(("adamw", "muon", "soap", "K-FAC"))] == (
            expected
        ), name
        whole = [r for r in rows if r.startswith(("adamw", "muon", "soap", "K-FAC"))]
        assert len(whole) == (7 if soap else 6), whole
        for r in w["rows"]:
            assert r["ms"] is not None and math.isfinite(r["ms"]), (name, r)
            assert r["vs_plain"] is not None and r["vs_muon"] is not None, (name, r)
            assert r["source"] and r["section"] in stages.SECTIONS, (name, r)
        for row in [*FLOORED, "statistics in the hooks", "amortized (eigh every 2)"]:
            # a difference of two medians may come out negative: only its presence counts
            assert rows[row]["floor_ms"] > 0 and rows[row]["vs_floor"] is not None, (name, row)
        assert rows["decomposition: eigh"]["floor_macs"] > 0
        # the wide layers' products: their powers, applied, iterated
        for row in ("powers of the wide layers", "  wide layers: Newton-Schulz"):
            assert rows[row]["floor_macs"] > 0, (name, row)
        # the step at its floors: the plain forward+backward, the statistics' floor and
        # the amortized optimizer part's
        at_floors = rows["K-FAC's whole step at the floors"]["ms"]
        assert at_floors == pytest.approx(
            rows["plain forward+backward"]["ms"]
            + rows["statistics in the hooks"]["floor_ms"]
            + rows["amortized (eigh every 2)"]["floor_ms"]
        )
        assert rows["fold (running average)"]["floor_macs"] == 0  # elementwise: bytes only
        assert rows["fold (running average)"]["floor_bytes"] > 0
        assert rows["Muon, as the race runs it, + AdamW"]["vs_muon"] == pytest.approx(1.0)
        assert rows["plain forward+backward"]["vs_plain"] == pytest.approx(1.0)
        kinds = w["kinds"][stages.RECIPE]
        assert len(kinds) == 2 * doc["settings"]["reps"] and any(kinds) and not all(kinds)
        # every printed row is in the table
        for r in rows:
            assert r.strip() in proc.stdout, r
    assert "bf16 flags" in proc.stdout and "GFLOP/s" in proc.stdout


@pytest.mark.slow
@pytest.mark.skipif(not stages.optimizers.NATIVE_BF16, reason="bfloat16 is emulated here")
def test_stages_quick_under_autocast(tmp_path: Path) -> None:
    """``--autocast`` times the recipe before its bfloat16 statistics beside it, and its
    targets are the rows' ratios."""
    out = tmp_path / "stages_bf16.json"
    run_benchmark("stages.py", "--quick", "--autocast", "--workloads", "lm", "--out", str(out))
    doc = json.loads(out.read_text())
    assert doc["settings"]["autocast"] is True
    w = doc["workloads"]["lm"]
    ms = {r["key"]: r["ms"] for r in w["rows"] if r["key"]}
    assert {"before fb", "before", "before whole", "kfac long", "kfac long whole"} <= set(ms)
    t = w["targets"]
    assert t["hooks_over_plain_before"] == pytest.approx(ms["before fb"] / ms["plain"])
    assert t["whole_over_muon_after"] == pytest.approx(ms["kfac long whole"] / ms["muon whole"])
    # over the long run the steps without statistics take the plain forward+backward
    assert t["hooks_over_plain_after_long"] == pytest.approx(ms["kfac long fb"] / ms["plain"])
    import stages_report

    assert "| `lm` |" in stages_report.render_bf16(doc)


def test_autocast_needs_native_bfloat16(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stages.optimizers, "NATIVE_BF16", False)
    with pytest.raises(SystemExit):
        stages.parse_args(["--autocast"])


def test_quick_results_stay_out_of_the_committed_results() -> None:
    with pytest.raises(SystemExit):
        stages.parse_args(["--quick", "--out", str(stages.RESULTS / "stages.json")])
    assert Path(stages.parse_args(["--quick"]).out).parent != stages.RESULTS


def test_arithmetic_counts() -> None:
    import doctest

    assert doctest.testmod(sa).failed == 0
    assert sa.matmul_macs((4, 2, 3), (3, 5)) == 4 * 2 * 3 * 5
    assert sa.cube_macs(torch.zeros(3, 4, 4), 2.0) == 3 * 2.0 * 64
    assert sa.cube_macs(None, 2.0) == 0.0
    # per iteration of a 2×8 matrix (taken wide): X Xᵀ 32, A·A 8, B·X 32
    assert sa.newton_schulz_macs([(8, 2)], steps=1) == 72


def test_float32_newton_schulz_orthogonalizes() -> None:
    """The written-out iteration is Muon's: it drives the singular values of a matrix
    into the band Muon's coefficients aim at, in float32, and keeps the orientation."""
    g = torch.Generator().manual_seed(0)
    for shape in ((6, 10), (10, 6)):
        m = torch.randn(*shape, generator=g)
        o = sa.orthogonalize_fp32(m, (3.4445, -4.7750, 2.0315), 5, 1e-7)
        assert o.dtype == torch.float32 and o.shape == m.shape
        s = torch.linalg.svdvals(o)
        assert s.min() > 0.5 and s.max() < 1.5, s


def test_muon32_steps_as_torch_muon_but_in_float32() -> None:
    """One step of :class:`sa.Muon32` moves the weights as ``torch.optim.Muon`` does,
    up to the bfloat16 rounding of the latter's iteration."""
    torch.manual_seed(0)
    w0 = torch.randn(8, 12)
    grad = torch.randn(8, 12)
    moved = []
    for cls in (torch.optim.Muon, sa.Muon32):
        p = torch.nn.Parameter(w0.clone())
        opt = cls([p], lr=0.02, adjust_lr_fn="match_rms_adamw")
        p.grad = grad.clone()
        opt.step()
        moved.append(p.detach() - w0)
    ref, mine = moved
    assert torch.allclose(mine, ref, rtol=0.05, atol=0.05 * ref.abs().max().item())


@pytest.mark.parametrize("native", [True, False])
def test_the_race_times_muon_in_float32_where_bfloat16_is_emulated(
    monkeypatch: pytest.MonkeyPatch, native: bool
) -> None:
    """The race's Muon iterates in bfloat16 (``torch.optim.Muon``) only where the CPU
    multiplies it natively; elsewhere in float32 (:class:`sa.Muon32`), and the results
    name which."""
    import optimizers
    import race
    import race_workloads as rw

    monkeypatch.setattr(optimizers, "NATIVE_BF16", native)
    monkeypatch.setattr(optimizers, "MUON_PRECISION", "bfloat16" if native else "float32")
    w = rw.WORKLOADS["digits"](True)
    stepper = optimizers.Stepper("muon", w.make(), 0.02, w, 10)
    assert type(stepper.opts[0]) is (torch.optim.Muon if native else sa.Muon32)
    assert race.machine(1)["muon_newton_schulz"] == ("bfloat16" if native else "float32")


def test_the_docs_stage_table_is_the_committed_results() -> None:
    """``docs/performance.md``'s stage table is what ``benchmarks/stages_report.py``
    renders from ``benchmarks/results/stages.json``; run it after a new run."""
    import stages_report

    results = ROOT / "benchmarks" / "results" / "stages.json"
    if not results.exists():
        pytest.skip("no stage results committed yet")
    doc = json.loads(results.read_text())
    assert doc["quick"] is False
    page = stages_report.PAGE.read_text()
    assert stages_report.block_of(page) == stages_report.render(doc)
    headline = json.loads(stages_report.HEADLINE.read_text())
    floors = stages_report.block_of(page, stages_report.FLOOR_MARKERS)
    assert floors == stages_report.render_floors(doc, headline)
    if stages_report.BF16.exists():  # the run under bfloat16 autocast
        bf16 = json.loads(stages_report.BF16.read_text())
        assert bf16["quick"] is False and bf16["settings"]["autocast"] is True
        block = stages_report.block_of(page, stages_report.BF16_MARKERS)
        assert block == stages_report.render_bf16(bf16)
        floors = stages_report.block_of(page, stages_report.BF16_FLOOR_MARKERS)
        source = stages_report.BF16_SOURCE
        assert floors == stages_report.render_floors(bf16, headline, source, "_bf16")
