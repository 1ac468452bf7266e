"""Device-generic checks: checkpoints saved on one device and loaded on another, and a
self-check of the ``device`` fixture (tests/conftest.py).

Checkpoints: a state file (both formats) and the adapter's ``state_dict`` are written from
a run on ``device`` (``cuda`` when a GPU is present), loaded on the CPU and back again;
every tensor lands on the device of the state or model it is loaded into, with the same
values, and training resumed from it continues exactly as the run that was saved.

The self-check runs the device-parametrized tests of the suite in a subprocess, selected
with ``-k cuda``: without a GPU each of them must be reported skipped, not failed or in
error; with one, they must exist (the suite itself runs them).
"""

from __future__ import annotations

import copy
import io
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kfac_func as kf

ROOT = Path(__file__).resolve().parent.parent
CPU = torch.device("cpu")


def net(device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 5 * 5, 8),
        nn.Tanh(),
        nn.Linear(8, 3),
    ).to(device)


def batches(device: torch.device, steps: int, seed: int = 1) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(6, 3, 5, 5, generator=g).to(device),
            torch.randint(0, 3, (6,), generator=g).to(device),
        )
        for _ in range(steps)
    ]


def tensors_of(state: kf.KFACState) -> dict[str, torch.Tensor]:
    """Every tensor of the state's layers, by ``layer.field``."""
    out = {}
    for name, ls in state.layers.items():
        for field in ("a_factor", "g_factor", "basis_moment", "basis_momentum"):
            t = getattr(ls, field, None)
            if isinstance(t, torch.Tensor):
                out[f"{name}.{field}"] = t
        if ls.decomposition is not None:
            for k, v in vars(ls.decomposition).items():
                if isinstance(v, torch.Tensor):
                    out[f"{name}.decomposition.{k}"] = v
    return out


def assert_same_on(got: kf.KFACState, want: kf.KFACState, device: torch.device) -> None:
    """The same tensors (values, dtypes, counters), ``got``'s all on ``device``."""
    a, b = tensors_of(got), tensors_of(want)
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].device.type == device.type, (k, a[k].device)
        assert a[k].dtype == b[k].dtype, k
        assert torch.equal(a[k].cpu(), b[k].cpu()), k
    assert got.step == want.step
    for name, ls in got.layers.items():
        other = want.layers[name]
        assert (ls.factor_updates, ls.decomposition_failures) == (
            other.factor_updates,
            other.decomposition_failures,
        ), name


def functional_steps(
    model: nn.Module, state: kf.KFACState, data: list[tuple[torch.Tensor, ...]]
) -> tuple[kf.KFACState, list[dict[str, torch.Tensor]]]:
    """``capture`` + ``update`` (factors every step, decompositions every 2), SGD steps."""
    outs = []
    for x, y in data:
        params = dict(model.named_parameters())
        _, grads, caps = kf.capture(model, params, x, lambda o, y=y: F.cross_entropy(o, y))
        out, state = kf.update(
            state,
            grads,
            captures=caps,
            damping=1e-2,
            eigenbasis_moments=True,
            kl_clip=None,
            update_inverses=state.step % 2 == 0,
        )
        with torch.no_grad():
            for k, p in params.items():
                p -= 0.05 * out[k]
        outs.append(out)
    return state, outs


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_state_file_from_device_loads_on_cpu_and_back(
    device: torch.device, suffix: str, tmp_path: Path
) -> None:
    model = net(device)
    layers = kf.register(model)
    data = batches(device, 5)
    full, want = functional_steps(copy.deepcopy(model), kf.init(layers, device=device), data)
    state, _ = functional_steps(model, kf.init(layers, device=device), data[:3])
    assert any(ls.basis_moment is not None for ls in state.layers.values())
    path = tmp_path / f"state{suffix}"
    kf.save_state(state, path, include_decompositions=True)
    on_cpu = kf.load_state(path, like=kf.init(layers, device=CPU))
    assert_same_on(on_cpu, state, CPU)
    # and back: written from the CPU, read into a state on the device
    back_path = tmp_path / f"back{suffix}"
    kf.save_state(on_cpu, back_path, include_decompositions=True)
    back = kf.load_state(back_path, like=kf.init(layers, device=device))
    assert_same_on(back, state, device)
    _, got = functional_steps(model, back, data[3:])
    for i, (g, w) in enumerate(zip(got, want[3:])):
        for k in w:
            assert g[k].device.type == device.type
            assert torch.equal(g[k], w[k]), (i, k)
    assert full.step == back.step + 2


def adapter_run(
    model: nn.Module, data: list[tuple[torch.Tensor, ...]], pre: kf.KFACPreconditioner
) -> list[dict[str, torch.Tensor]]:
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    out = []
    for x, y in data:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        pre.step()
        out.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        opt.step()
    return out


KW: dict[str, Any] = dict(damping=1e-2, factor_update_steps=1, inv_update_steps=2, lr=0.05)


def test_adapter_state_dict_from_device_loads_on_cpu_and_back(device: torch.device) -> None:
    data = batches(device, 5)
    full_model = net(device)
    full = adapter_run(full_model, data, kf.KFACPreconditioner(full_model, **KW))
    model = net(device)
    pre = kf.KFACPreconditioner(model, **KW)
    adapter_run(model, data[:3], pre)
    buf = io.BytesIO()
    torch.save(pre.state_dict(), buf)
    # on the CPU: from the file (read onto the CPU) and from the dict itself (tensors on
    # the device it was saved on), into a preconditioner of a model on the CPU
    buf.seek(0)
    from_file = torch.load(buf, map_location="cpu", weights_only=True)
    for sd in (from_file, pre.state_dict()):
        cpu_pre = kf.KFACPreconditioner(net(CPU), **KW)
        cpu_pre.load_state_dict(sd)
        assert cpu_pre.steps == 3
        assert_same_on(cpu_pre.state, pre.state, CPU)
    # and back: the CPU preconditioner's state dict into a model on the device
    resumed_model = net(device)
    resumed_model.load_state_dict(model.state_dict())
    resumed = kf.KFACPreconditioner(resumed_model, **KW)
    resumed.load_state_dict(cpu_pre.state_dict())
    assert_same_on(resumed.state, pre.state, device)
    # training goes on as the run that was saved (the optimizer has no state: plain SGD)
    got = adapter_run(resumed_model, data[3:], resumed)
    for i, (g, w) in enumerate(zip(got, full[3:])):
        for k in w:
            assert g[k].device.type == device.type
            assert torch.equal(g[k], w[k]), (i, k)


# ------------------------------------------------------------------- self-check

# the modules whose tests take the ``device`` fixture
DEVICE_MODULES = (
    "tests/test_oracle_linear.py",
    "tests/test_decomposition.py",
    "tests/test_adapter.py",
    "tests/test_reliability.py",
    "tests/test_device.py",
    "tests/test_decompose_gpu.py",
)


@pytest.mark.slow
def test_device_cases_are_reported_skipped_without_a_gpu(tmp_path: Path) -> None:
    """Every ``cuda`` case of the device-parametrized modules is collected; without a GPU
    each is reported skipped (reason: no CUDA device), none failed or in error."""
    report = tmp_path / "report.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "cuda"]
    cmd += ["--junitxml", str(report), *DEVICE_MODULES]
    if torch.cuda.is_available():
        cmd.append("--collect-only")  # the suite runs them; here they only must exist
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)
    tail = proc.stdout[-3000:] + proc.stderr[-2000:]
    assert proc.returncode in (0, 5) or torch.cuda.is_available(), tail
    cases = ET.parse(report).getroot().iter("testcase")
    by_module: dict[str, int] = {}
    outcomes: dict[str, list[str]] = {"skipped": [], "failure": [], "error": [], "passed": []}
    for case in cases:
        name = f"{case.get('classname')}::{case.get('name')}"
        assert "cuda" in name, name
        module = str(case.get("classname")).split(".")[1]
        by_module[module] = by_module.get(module, 0) + 1
        kinds = [child.tag for child in case if child.tag in ("skipped", "failure", "error")]
        outcome = kinds[0] if kinds else "passed"
        outcomes[outcome].append(name)
        if outcome == "skipped" and not torch.cuda.is_available():
            (skip,) = [c for c in case if c.tag == "skipped"]
            assert "no CUDA device" in str(skip.get("message")), (name, skip.get("message"))
    if torch.cuda.is_available():
        assert proc.returncode == 0, tail
        total = len(list(ET.parse(report).getroot().iter("testcase")))
        # --collect-only writes no test cases to the report: count the ids it printed
        printed = [line for line in proc.stdout.splitlines() if "[" in line and "cuda" in line]
        assert total or printed, tail
        return
    assert not outcomes["failure"] and not outcomes["error"], outcomes
    assert not outcomes["passed"], outcomes["passed"]
    # every module has cuda cases (the fixture is in use where it should be)
    expected = {Path(m).stem for m in DEVICE_MODULES}
    assert set(by_module) == expected, by_module
    assert len(outcomes["skipped"]) >= 100, len(outcomes["skipped"])
