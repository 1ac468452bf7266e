"""``benchmarks/basis_precision.py``: its bfloat16-product stages compute what the library's
do, to bfloat16's rounding, and are put back after a run; its smoke run writes a row a
stage."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

import kfac_func.core.basis_moments as basis_moments
import kfac_func.step.orthogonal as step_orthogonal
from kfac_func.core.layer_decomposition import eigen_decompose

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import basis_precision as bp  # noqa: E402

U = 2.0**-8
"""bfloat16's unit roundoff."""


def _orthogonal(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.linalg.qr(torch.randn(n, n, generator=g))[0]


def _both(stage: str, fn: str, *args: object) -> tuple[torch.Tensor, torch.Tensor]:
    """``fn`` of the module that holds it, with the stage's bfloat16 products and without."""
    module = step_orthogonal if fn == "factor_powers" else basis_moments
    with bp.bfloat16_stage(stage):
        got = getattr(module, fn)(*args)
    return got, getattr(module, fn)(*args)


def test_the_bfloat16_stages_compute_the_library_stages() -> None:
    g = torch.Generator().manual_seed(0)
    m, moment = torch.randn(6, 9, generator=g), torch.rand(6, 9, generator=g)
    old, new = (_orthogonal(9, 1), _orthogonal(6, 2)), (_orthogonal(9, 3), _orthogonal(6, 4))
    f = torch.randn(9, 20, generator=g)
    dec = eigen_decompose(f @ f.T / 20, torch.eye(6), 0.0)
    pairs = [
        _both("projections", "to_basis", m, *old),
        _both("projections", "from_basis", m, *old),
        _both("carry", "carry_moment", moment, old, new),
        _both("carry", "rotate_moment", m, old, new),
    ]
    got, want = _both("powers", "factor_powers", dec, (0.5, 0.0), 1e-3)
    pairs.append((got.a, want.a))
    for got, want in pairs:
        assert got.dtype == want.dtype == torch.float32
        # each operand rounded once to 8 bits, two products of 6 to 9 terms of norm ~1
        assert float((got - want).abs().max()) <= 16 * U * float(want.abs().max())
        assert not torch.equal(got, want)  # and bfloat16 in truth: its rounding shows
    assert basis_moments.to_basis is bp.basis_moments_originals["to_basis"]  # put back


@pytest.mark.skipif(not bp.optimizers.NATIVE_BF16, reason="this CPU has no native bfloat16")
def test_the_smoke_run_writes_a_row_a_stage(tmp_path: Path) -> None:
    out = tmp_path / "basis_precision.json"
    threads = torch.get_num_threads()
    assert bp.main(["--quick", "--threads", "1", "--out", str(out)]) == 0
    assert torch.get_num_threads() == threads  # the tests after it keep theirs
    doc = json.loads(out.read_text())
    rows = {r["stage"]: r for r in doc["summary"]}
    assert list(rows) == ["float32", *bp.STAGES]
    assert rows["float32"]["optimizer_over_float32"] == 1.0
    assert not rows["float32"]["adopted"]
    for row in rows.values():
        assert row["final_min"] <= row["final_mean"] <= row["final_max"]
        assert isinstance(row["adopted"], bool)
    assert doc["bf16_flags"] and doc["machine"]["cpu"]
    assert basis_moments.to_basis is bp.basis_moments_originals["to_basis"]
