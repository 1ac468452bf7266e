"""``examples/hf_trainer.py --quick`` runs end to end: AdamW and ``kfac_func.KFAC`` through
the Hugging Face Trainer, a row per optimizer and epoch, the CSV, PNG and JSON."""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_hf_trainer_quick_runs(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    out = tmp_path / "hf"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "hf_trainer.py"), "--quick", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # no accelerator notice from DeepSpeed (installed for the pipeline tests) on a CPU run
    assert "accelerator" not in (proc.stdout + proc.stderr).lower(), proc.stderr
    lines = proc.stdout.splitlines()
    printed = [
        line.split()
        for line in lines
        if line.split()[:1] in (["adamw"], ["kfac"]) and line.split()[1].isdigit()
    ]
    with open(out.with_suffix(".csv"), newline="") as f:
        rows = list(csv.DictReader(f))
    expected = [(o, str(e)) for o in ("adamw", "kfac") for e in (1, 2)]
    assert [(r["optimizer"], r["epoch"]) for r in rows] == expected
    # the table of each epoch as it ends, then the final epoch again
    assert [(p[0], p[1]) for p in printed] == [*expected, ("adamw", "2"), ("kfac", "2")]
    for r in rows:
        values = [float(r[m]) for m in ("train_loss", "eval_loss", "eval_bits_per_byte")]
        assert all(math.isfinite(v) and v > 0 for v in values), r
        assert float(r["eval_bits_per_byte"]) == pytest.approx(float(r["eval_loss"]) / math.log(2))
    for opt in ("adamw", "kfac"):  # a few steps already lower the held-out loss
        first, second = (float(r["eval_loss"]) for r in rows if r["optimizer"] == opt)
        assert second < first, opt
    # 14 layers, or 15 where the tied embedding and head are preconditioned as one
    done = {
        f"kfac: {n} layers preconditioned, 8 steps, factor updates per layer [2]" for n in (14, 15)
    }
    assert done & set(lines), lines
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    meta = json.loads(out.with_suffix(".json").read_text())
    assert meta["command"].endswith(f"--quick --out {out}")
    assert {"commit", "cpu", "torch", "transformers", "python"} <= set(meta)
