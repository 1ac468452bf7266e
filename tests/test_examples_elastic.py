"""``examples/elastic_train.py`` under ``torchrun --max-restarts``: rank 1 is killed in
the middle of step 3 of 6 (checkpoints after steps 2 and 4), torchrun restarts both
workers, they resume from the checkpoint of step 2 and end with the parameters of the run
that was never interrupted (FSDP2 on 2 gloo ranks, float64, `kf.KFAC` built before
``fully_shard``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

pytest.importorskip("torch.distributed.fsdp")
pytestmark = pytest.mark.slow  # two torchruns of 2 processes, one restarted


def torchrun(tmp: Path, name: str, kill_at: int) -> tuple[str, dict[str, torch.Tensor]]:
    args = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc-per-node", "2", "--max-restarts", "1", "--monitor-interval", "1",
        str(ROOT / "examples" / "elastic_train.py"), "--steps", "6", "--save-every", "2",
        "--ckpt", str(tmp / name / "latest"), "--out", str(tmp / f"{name}.pt"),
        "--kill-at", str(kill_at),
    ]  # fmt: skip
    # restarted workers on gloo must not reuse the first attempt's store (a torch issue)
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        args, cwd=tmp, env=env, capture_output=True, text=True, timeout=400, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout, torch.load(tmp / f"{name}.pt", weights_only=True)


def test_a_killed_rank_resumes_from_the_last_checkpoint(tmp_path: Path) -> None:
    out, straight = torchrun(tmp_path, "straight", kill_at=-1)
    assert "resumed" not in out
    out, killed = torchrun(tmp_path, "killed", kill_at=3)
    assert "resumed from step 2" in out, out
    assert [line.split()[1] for line in out.splitlines() if line.startswith("step ")] == [
        "0", "1", "2", "2", "3", "4", "5",
    ]  # fmt: skip
    assert sorted(killed) == sorted(straight)
    worst = max(float((killed[k] - straight[k]).abs().max()) for k in straight)
    assert worst < 1e-12, worst
    assert sorted(p.name for p in (tmp_path / "killed").iterdir()) == ["latest"]
