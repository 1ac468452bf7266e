"""``examples/fsdp_train.py`` under torchrun on 2 gloo ranks, a few steps of a tiny model.

The run shards the LM example's transformer with FSDP2 and splits its MLPs with DTensor
tensor parallelism (``--tp 2``: a 1 x 2 mesh); the test checks the plan and the losses it
prints (finite, and every K-FAC layer in the plan) and that it exits cleanly.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytest.importorskip("torch.distributed.fsdp")
pytestmark = pytest.mark.slow  # a torchrun of 2 processes


def test_fsdp_example_runs_under_torchrun(tmp_path: Path) -> None:
    args = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-port", "29533", str(ROOT / "examples" / "fsdp_train.py"),
        "--steps", "2", "--log-every", "1", "--d-model", "16", "--layers", "1",
        "--heads", "2", "--context", "16", "--batch-size", "4", "--tp", "2",
        "--strategy", "mem-opt",
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "KAISA plan: world 2, MEM_OPT" in out
    for layer in ("blocks.0.fc1", "blocks.0.fc2", "blocks.0.attn.query", "head"):
        assert layer in out
    losses = [float(v) for v in re.findall(r"loss (\S+)", out)]
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses)
    assert "K-FAC memory on rank 0" in out
    assert "returned a view tensor" not in proc.stderr  # FSDP2's warning about the output
    rows = (tmp_path / "fsdp_train.csv").read_text().splitlines()
    assert rows[0].startswith("optimizer,epoch") and len(rows) == 3
    assert (tmp_path / "fsdp_train.png").stat().st_size > 0
