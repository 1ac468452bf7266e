"""Examples run end to end on small settings, so they cannot rot."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_functional_loop_runs() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "functional_loop.py"),
            "--epochs",
            "2",
            "--samples",
            "256",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines()[1:]]
    assert [r[0] for r in rows] == ["1", "2"]
    assert all(float(v) > 0 for r in rows for v in r[1:])
