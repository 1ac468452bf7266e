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


def test_kfac_pytorch_loop_runs_and_resumes(tmp_path: Path) -> None:
    """Three epochs straight, and two epochs then a restart from the checkpoint: the
    resumed third epoch prints the same row."""

    def run(epochs: int, checkpoint: Path) -> list[list[str]]:
        proc = subprocess.run(
            [
                sys.executable,
                str(ROOT / "examples" / "kfac_pytorch_loop.py"),
                "--epochs",
                str(epochs),
                "--samples",
                "256",
                "--checkpoint",
                str(checkpoint),
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        lines = proc.stdout.splitlines()
        start = lines.index("epoch  loss      accuracy  kl_clip")
        return [line.split() for line in lines[start + 1 :]]

    straight = run(3, tmp_path / "straight.pt")
    assert [r[0] for r in straight] == ["1", "2", "3"]
    assert all(float(v) > 0 for r in straight for v in r[1:])
    assert float(straight[2][1]) < float(straight[0][1])  # the loss goes down
    assert float(straight[2][3]) < float(straight[0][3])  # the scheduler anneals kl_clip
    assert run(2, tmp_path / "resumed.pt") == straight[:2]
    assert run(3, tmp_path / "resumed.pt") == straight[2:]
