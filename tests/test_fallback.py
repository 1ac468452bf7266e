"""Layers left to the other optimizer once training shows K-FAC cannot precondition them
(:mod:`kfac_func.adapter.fallback`): a registered module the configuration never calls (no
gradient), parameters used outside their module's calls (gradients and no statistics,
as Mamba's ``F.conv1d(x, conv1d.weight)``), and the state dicts that carry the move.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from gloo import gloo_group, record_errors, spawn
from numerics import named
from torch import nn

import kfac_func as kf

DT = torch.float64


class Net(nn.Module):
    """``unused`` is registered and never called; ``side``'s weight is used through
    ``F.linear``, outside a call of ``side``, by a name the registration does not read
    (``self.side.weight`` in the forward would feed the layer from this forward:
    :mod:`kfac_func.blocks.used_weights`)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(3, 4, dtype=DT)
        self.side = nn.Linear(4, 4, dtype=DT)
        self.unused = nn.Linear(4, 4, dtype=DT)
        self.fc2 = nn.Linear(4, 2, dtype=DT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc1(x))
        side = self.side
        h = h + F.linear(h, side.weight, side.bias)
        return self.fc2(h)


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(8, 3, generator=g, dtype=DT), torch.randn(8, 2, generator=g, dtype=DT)


def _closure(opt: torch.optim.Optimizer, model: nn.Module, seed: int):  # type: ignore[no-untyped-def]
    x, y = _batch(seed)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        return loss

    return closure


def test_layers_without_gradients_or_statistics_go_to_the_other_optimizer() -> None:
    model = Net()
    opt = kf.KFAC(model, lr=0.01, damping=0.01)
    assert opt.others_optimizer is None  # every layer registered
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step(_closure(opt, model, 0))
    fallback = [w for w in caught if issubclass(w.category, kf.FallbackWarning)]
    missing = [w for w in caught if issubclass(w.category, kf.MissingStatisticsWarning)]
    assert len(fallback) == 1 and "['unused'] received no gradient" in str(fallback[0].message)
    assert len(missing) == 1 and "layers ['side'] received gradients and no statistics" in str(
        missing[0].message
    )
    pre = opt.preconditioner
    assert list(pre.layers) == ["fc1", "fc2"] and sorted(pre.demoted) == ["side", "unused"]
    assert "received no gradient in step 0" in pre.layers.skipped["unused"]
    assert "no statistics" in pre.layers.skipped["side"]
    # the table's split and the optimizers agree: preconditioned vs the others (AdamW)
    mine, rest = pre.layers.split_parameters(model)
    assert opt.others_optimizer is not None
    assert isinstance(opt.others_optimizer, torch.optim.AdamW)
    assert {id(p) for p in opt.others_optimizer.param_groups[0]["params"]} == {id(p) for p in rest}
    assert {id(p) for p in opt.kfac_optimizer.param_groups[0]["params"]} == {id(p) for p in mine}
    assert len(opt.param_groups) == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one warning each: none at the next steps
        for seed in (1, 2):
            opt.step(_closure(opt, model, seed))
    assert pre.steps == 3


def test_the_side_layer_gets_adams_step_not_sgds() -> None:
    model = Net()
    opt = kf.KFAC(model, lr=0.01, damping=0.01)
    x, y = _batch(0)
    F.mse_loss(model(x), y).backward()
    grad = model.side.weight.grad.clone()
    before = model.side.weight.detach().clone()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt.step()
    # AdamW's first step, without weight decay (the recommended recipe's weight_decay=0)
    want = before - 0.01 * grad / (grad.abs() + 1e-8)
    torch.testing.assert_close(model.side.weight.detach(), want, rtol=0, atol=1e-12)


def test_a_step_without_any_gradient_still_asks_for_backward() -> None:
    model = Net()
    pre = kf.KFACPreconditioner(model)
    with pytest.raises(RuntimeError, match=r"has no gradient; call loss.backward\(\) before step"):
        pre.step()
    assert len(pre.layers) == 4 and not pre.demoted


def test_state_dicts_carry_the_demotions() -> None:
    """A run resumed from a state dict saved after layers were demoted has the same layers
    and parameter groups, and continues as the uninterrupted run."""
    model, resumed_model = Net(), Net()
    opt = kf.KFAC(model, lr=0.01, damping=0.01)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt.step(_closure(opt, model, 0))
    saved = copy.deepcopy(opt.state_dict())  # as written to a file: tensors of its own
    resumed_model.load_state_dict(model.state_dict())
    resumed = kf.KFAC(resumed_model, lr=0.01, damping=0.01)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the demotions load without warnings
        resumed.load_state_dict(saved)
    assert resumed.preconditioner.demoted == opt.preconditioner.demoted
    assert list(resumed.preconditioner.layers) == ["fc1", "fc2"]
    assert [len(g["params"]) for g in resumed.param_groups] == [4, 4]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for seed in (1, 2):
            opt.step(_closure(opt, model, seed))
            resumed.step(_closure(resumed, resumed_model, seed))
    for (name, p), q in zip(model.named_parameters(), resumed_model.parameters()):
        torch.testing.assert_close(q, p, rtol=0, atol=0, msg=named(name))


def test_a_preconditioner_alone_passes_their_gradients_unchanged() -> None:
    model = Net()
    pre = kf.KFACPreconditioner(model, damping=0.01)
    x, y = _batch(0)
    F.mse_loss(model(x), y).backward()
    raw = model.side.weight.grad.clone()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pre.step()
    assert torch.equal(model.side.weight.grad, raw)
    assert model.unused.weight.grad is None
    sd = pre.state_dict()
    again = kf.KFACPreconditioner(Net(), damping=0.01)
    again.load_state_dict(sd)
    assert again.demoted == pre.demoted and list(again.layers) == list(pre.layers)


class _Doubled(nn.Linear):
    """A Linear subclass whose forward uses twice its weight: refused on its first call."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, 2 * self.weight, self.bias)


def _ranks_worker(rank: int, world: int, tmp: str) -> None:
    with gloo_group(rank, world, tmp), record_errors(Path(tmp, f"rank{rank}.error")):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 4), _Doubled(4, 4), nn.Linear(4, 2))
        pre = kf.KFACPreconditioner(model)
        x = torch.randn(4, 3)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", kf.FallbackWarning)
            model(x).pow(2).mean().backward()
        try:
            pre.step()
        except RuntimeError as err:
            Path(tmp, f"rank{rank}.txt").write_text(str(err))
        pre.remove()
        # left out from the start, the rest is preconditioned on every rank
        pre = kf.KFACPreconditioner(model, skip_layers=["^1$"])
        model.zero_grad()
        model(x).pow(2).mean().backward()
        pre.step()
        assert list(pre.layers) == ["0", "2"]


def test_on_several_processes_a_layer_to_demote_is_an_error_naming_it(tmp_path: Path) -> None:
    spawn(_ranks_worker, 2, tmp_path)
    for rank in range(2):
        message = Path(tmp_path, f"rank{rank}.txt").read_text()
        assert "_Doubled overrides forward" in message and "skip_layers=['^1$']" in message
