"""Smoke test of the benchmark scripts: they run and print their table (no timing checks)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_step_time_quick() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "step_time.py"), "--quick"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,  # a hang guard only; the script takes seconds
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ratio" in proc.stdout
    for model in ("mlp", "cnn"):
        for intervals in ("1/1", "10/100"):
            assert any(
                line.split()[:2] == [model, intervals] for line in proc.stdout.splitlines()
            ), proc.stdout
