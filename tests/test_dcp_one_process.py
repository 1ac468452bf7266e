"""`torch.distributed.checkpoint` on one process: the adaptive step's state and the
running moments of eigenbasis moments, and the warning when a state dict lacks
the moments a preconditioner keeps.

DCP loads *into* the tensors of a template state dict (a fresh preconditioner's), so the
template must already name every tensor a trained one holds: the adaptive step's previous
update, the decompositions and the running moments. A checkpoint saved after some steps
and loaded into a fresh preconditioner must resume as the uninterrupted run (float64,
equal to 1e-10). The adaptive step runs on one process with plain parameters (it refuses
several ranks and DTensor parameters at construction; tests/test_dcp.py checks the
refusal under FSDP2).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from settings_keywords import with_settings
from torch import nn

from kfac_func import KFACPreconditioner, Settings
from kfac_func.adapter import AdaptiveStepper
from kfac_func.adapter.checkpoint_settings import SETTINGS_KEY

dcp = pytest.importorskip("torch.distributed.checkpoint")

F64 = torch.float64
STEPS, SAVE_AT = 6, 3
TOL = 1e-10


def setup() -> tuple[nn.Module, KFACPreconditioner]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 7), nn.Tanh(), nn.Linear(7, 3)).to(F64)
    pre = KFACPreconditioner(
        model,
        kl_clip=None,
        damping=0.1,
        inv_update_steps=2,
        factor_dtype=F64,
        inv_dtype=F64,
        settings=Settings(scaling="fisher", adaptive=AdaptiveStepper(model, interval=2)),
    )
    return model, pre


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(8, 4, generator=g, dtype=F64), torch.randint(0, 3, (8,), generator=g))
        for _ in range(STEPS)
    ]


def run(model: nn.Module, pre: KFACPreconditioner, data: list[Any]) -> list[list[torch.Tensor]]:
    out = []
    for x, y in data:
        model.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        closure = lambda x=x, y=y: F.cross_entropy(model(x), y)  # noqa: E731
        pre.step(inputs=x, loss=loss.detach(), loss_closure=closure)
        out.append([p.detach().clone() for p in model.parameters()])
    return out


def test_adaptive_state_resumes_through_dcp(tmp_path: Path) -> None:
    data = batches()
    model, pre = setup()
    full = run(model, pre, data)
    model, pre = setup()
    run(model, pre, data[:SAVE_AT])
    saved = pre.state.adaptive
    assert saved is not None and saved.previous is not None
    with warnings.catch_warnings():  # DCP warns that it runs without a process group
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": model.state_dict(), "kfac": pre.state_dict()}, checkpoint_id=tmp_path)
        model, pre = setup()
        template = {"model": model.state_dict(), "kfac": pre.state_dict()}
        assert template["kfac"]["adaptive"]["previous_held"] == 0
        dcp.load(template, checkpoint_id=tmp_path)
    model.load_state_dict(template["model"])
    pre.load_state_dict(template["kfac"])
    got = pre.state.adaptive
    assert got is not None and got.previous is not None
    assert (got.damping, got.steps, got.history) == (saved.damping, saved.steps, saved.history)
    for k, v in saved.previous.items():
        assert torch.equal(got.previous[k], v), k
    rest = run(model, pre, data[SAVE_AT:])
    worst = max(
        float((a - b).abs().max()) for r, f in zip(rest, full[SAVE_AT:]) for a, b in zip(r, f)
    )
    assert worst < TOL


def test_a_fresh_adaptive_state_dict_loads_as_fresh() -> None:
    """The template's zeros are not an update: a state dict of a fresh preconditioner
    loads without a previous update."""
    _, pre = setup()
    _, other = setup()
    other.load_state_dict(pre.state_dict())
    assert other.state.adaptive is not None and other.state.adaptive.previous is None


def moments_setup(moments: bool = True) -> tuple[nn.Module, KFACPreconditioner]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 7), nn.Tanh(), nn.Linear(7, 3)).to(F64)
    extra: dict[str, Any] = {}
    if moments:
        extra = {"eigenbasis_moments": True, "moment_beta1": 0.9}
    pre = KFACPreconditioner(
        model,
        damping=0.01,
        inv_update_steps=2,
        kl_clip=1e-2,
        factor_dtype=F64,
        inv_dtype=F64,
        **with_settings(settings=Settings(scaling="fisher", moment_eps=1e-4), **extra),
    )
    return model, pre


def plain_run(
    model: nn.Module, pre: KFACPreconditioner, data: list[Any]
) -> list[list[torch.Tensor]]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for x, y in data:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        pre.step()
        out.append([p.grad.detach().clone() for p in model.parameters()])
        opt.step()
    return out


def test_moments_resume_through_dcp(tmp_path: Path) -> None:
    """The moments (and the decomposition of step 2, used at step 3) come back from DCP:
    the resumed gradients equal the uninterrupted run's."""
    data = batches()
    model, pre = moments_setup()
    full = plain_run(model, pre, data)
    model, pre = moments_setup()
    plain_run(model, pre, data[:SAVE_AT])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": model.state_dict(), "kfac": pre.state_dict()}, checkpoint_id=tmp_path)
        model, pre = moments_setup()
        template = {"model": model.state_dict(), "kfac": pre.state_dict()}
        dcp.load(template, checkpoint_id=tmp_path)
    model.load_state_dict(template["model"])
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # nothing restarts
        pre.load_state_dict(template["kfac"])
    assert all(ls.basis_momentum is not None for ls in pre.state.layers.values())
    rest = plain_run(model, pre, data[SAVE_AT:])
    worst = max(
        float((a - b).abs().max()) for r, f in zip(rest, full[SAVE_AT:]) for a, b in zip(r, f)
    )
    assert worst < TOL


def test_a_state_dict_without_the_moments_warns() -> None:
    """Moments that would restart from zero are named, not restarted silently."""
    data = batches()
    model, pre = moments_setup(moments=False)
    plain_run(model, pre, data[:SAVE_AT])
    _, other = moments_setup()
    with pytest.raises(ValueError, match="eigenbasis_moments=False in the state_dict"):
        other.load_state_dict(pre.state_dict())  # the settings say so first
    old = pre.state_dict()
    del old[SETTINGS_KEY]  # a checkpoint from before the settings were saved
    with pytest.warns(RuntimeWarning, match=r"basis_moment of layers \['0', '2'\].*restart"):
        other.load_state_dict(old)
    _, fresh = moments_setup()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a fresh state dict: nothing to keep
        other.load_state_dict(fresh.state_dict())
