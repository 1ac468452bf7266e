"""The benchmark scripts that tests run end to end, started one way.

The test files import this module by name (pytest puts the test directory on
``sys.path``, as for ``gloo.py``).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

__all__ = ["ROOT", "run_benchmark"]

ROOT = Path(__file__).resolve().parents[1]


def run_benchmark(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``python benchmarks/<script> <args>`` from the repository root, which must exit 0
    (its output is the failure's message); returns the finished process. The timeout is
    a hang guard only: the quick runs take seconds.
    """
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc
