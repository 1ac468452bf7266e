"""The adapter resumes bit-exactly in a fresh process from its state pytree and the model's
weights (checkpoints with kf.save_state)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import safetensors.torch
import torch

# The training script runs in both processes: steps [start, stop) of one deterministic run.
SCRIPT = textwrap.dedent(
    """
    import sys
    import safetensors.torch
    import torch
    import torch.nn.functional as F
    from torch import nn
    import kfac_func as kf

    torch.set_num_threads(1)
    mode, ckpt, out = sys.argv[1], sys.argv[4], sys.argv[5]
    start, stop = int(sys.argv[2]), int(sys.argv[3])
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(2, 4, 3, groups=2), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 8),
        nn.Tanh(), nn.Linear(8, 3),
    ).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    pre = kf.KFACPreconditioner(
        model, factor_update_steps=2, inv_update_steps=3, damping=0.01,
        factor_dtype=torch.float64, inv_dtype=torch.float64,
    )
    if mode == "resume":
        saved = torch.load(ckpt + ".pt", weights_only=True)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        pre.state = kf.load_state(ckpt + ".safetensors", like=pre.state)
    record = {}
    for step in range(start, stop):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(6, 2, 6, 6, generator=g, dtype=torch.float64)
        y = torch.randint(0, 3, (6,), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        pre.step()
        for name, p in model.named_parameters():
            record[f"{step}.{name}"] = p.grad.clone()
        opt.step()
    for name, p in model.named_parameters():
        record[f"final.{name}"] = p.detach().clone()
    for key, value in kf.state_to_dict(pre.state, include_decompositions=True).items():
        record[f"state.{key}"] = value
    safetensors.torch.save_file(record, out)
    if mode == "save":
        kf.save_state(pre.state, ckpt + ".safetensors", include_decompositions=True)
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, ckpt + ".pt")
    """
)


def _run(tmp: Path, mode: str, start: int, stop: int, out: str) -> dict[str, torch.Tensor]:
    script = tmp / "train.py"
    script.write_text(SCRIPT)
    proc = subprocess.run(
        [
            sys.executable,
            str(script),
            mode,
            str(start),
            str(stop),
            str(tmp / "ckpt"),
            str(tmp / out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    return safetensors.torch.load_file(str(tmp / out))


def test_adapter_resumes_bit_exactly_in_a_fresh_process(tmp_path: Path) -> None:
    # 6 steps straight; or 4 steps, save, and steps 4..5 in a new process. Step 4 updates
    # factors but reuses step 3's decompositions, so they must come from the checkpoint.
    straight = _run(tmp_path, "plain", 0, 6, "straight.safetensors")
    _run(tmp_path, "save", 0, 4, "first.safetensors")
    resumed = _run(tmp_path, "resume", 4, 6, "resumed.safetensors")
    compared = 0
    for key, value in resumed.items():
        if key.startswith(("4.", "5.", "final.", "state.")):
            assert torch.equal(value, straight[key]), key
            compared += 1
    assert compared > 20
    assert any(k.startswith("state.layers.0.decomposition") for k in resumed)
