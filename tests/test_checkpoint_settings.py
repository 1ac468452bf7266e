"""What ``KFACPreconditioner.load_state_dict`` does with the settings of a checkpoint:
hyperparameters are restored with one warning naming each replaced value, and the
settings that decide what the factors mean must match (an error names them)."""

from __future__ import annotations

import io
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from settings_keywords import with_settings
from torch import nn

import kfac_func as kf


def _model(norm: type[nn.Module] = nn.LayerNorm) -> nn.Module:
    torch.manual_seed(0)
    kw = {"bias": False} if norm is nn.LayerNorm else {}
    return nn.Sequential(nn.Linear(4, 5), norm(5, **kw), nn.Tanh(), nn.Linear(5, 3))


def _trained(**kwargs: Any) -> dict[str, Any]:
    model = kwargs.pop("model", None) or _model()
    pre = kf.KFACPreconditioner(model, **with_settings(**kwargs))
    x = torch.randn(8, 2, 4) if kwargs.get("kfac_approx") else torch.randn(8, 4)
    for _ in range(2):
        model.zero_grad()
        model(x).pow(2).mean().backward()
        pre.step()
    buf = io.BytesIO()  # the settings survive a weights-only round trip
    torch.save(pre.state_dict(), buf)
    buf.seek(0)
    sd: dict[str, Any] = torch.load(buf, weights_only=True)
    pre.remove()
    return sd


def _caught(pre: kf.KFACPreconditioner, sd: dict[str, Any]) -> list[str]:
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        pre.load_state_dict(sd)
    return [str(x.message) for x in w if "load_state_dict replaced" in str(x.message)]


def test_replaced_hyperparameters_are_restored_and_named_once() -> None:
    sd = _trained(damping=0.01, factor_update_steps=2)
    pre = kf.KFACPreconditioner(_model(), damping=1e-3, factor_update_steps=3)
    messages = _caught(pre, sd)
    assert len(messages) == 1
    assert "damping 0.001 → 0.01" in messages[0]
    assert "factor_update_steps 3 → 2" in messages[0]
    assert "kl_clip" not in messages[0] and "lr" not in messages[0]
    assert (pre.damping, pre.factor_update_steps) == (0.01, 2)
    same = kf.KFACPreconditioner(_model(), damping=0.01, factor_update_steps=2)
    assert _caught(same, sd) == []


def test_resuming_the_same_construction_after_a_schedule_is_silent() -> None:
    """A scheduler moved kl_clip and damping; the same script, resumed, builds the
    preconditioner as before and gets the scheduled values back without a warning."""
    model = _model()
    pre = kf.KFACPreconditioner(model)
    sched = kf.adapter.LambdaParamScheduler(
        pre, kl_clip_lambda=lambda step: 0.9, damping_lambda=lambda step: 0.5
    )
    for _ in range(2):
        model.zero_grad()
        model(torch.randn(8, 4)).pow(2).mean().backward()
        pre.step()
        sched.step()
    resumed = kf.KFACPreconditioner(_model())
    assert _caught(resumed, pre.state_dict()) == []
    assert (resumed.kl_clip, resumed.damping) == (pre.kl_clip, pre.damping)
    other = kf.KFACPreconditioner(_model(), damping=0.1)  # another construction: named
    (message,) = _caught(other, pre.state_dict())
    assert f"damping 0.1 → {pre.damping!r}" in message and "kl_clip" not in message
    old = {k: v for k, v in pre.state_dict().items() if k != "constructed"}
    (message,) = _caught(kf.KFACPreconditioner(_model()), old)  # an older checkpoint
    assert "damping 0.001 → 0.00025" in message and "kl_clip 0.001 → 0.00081" in message


@pytest.mark.parametrize(
    ("saved", "loading", "named"),
    [
        ({"scaling": "fisher"}, {"scaling": "kfac-pytorch"}, "scaling='fisher'"),
        ({"compute_method": "inverse"}, {"compute_method": "eigen"}, "compute_method='inverse'"),
        ({"eigenbasis_moments": True}, {}, "eigenbasis_moments=True"),
        ({"factor_dtype": torch.float64}, {}, "factor_dtype='float64'"),
        ({"kfac_approx": "reduce"}, {"kfac_approx": "expand"}, "layer '0': kfac_approx='reduce'"),
    ],
)
def test_settings_that_change_the_factors_meaning_must_match(
    saved: dict[str, Any], loading: dict[str, Any], named: str
) -> None:
    sd = _trained(**saved)
    pre = kf.KFACPreconditioner(_model(), **with_settings(**loading))
    before = {k: v.clone() for k, v in pre.state_dict()["layers"]["0"].items() if k in "AG"}
    with pytest.raises(ValueError, match="settings differ") as err:
        pre.load_state_dict(sd)
    assert named in str(err.value)
    assert pre.steps == 0  # nothing changed
    assert torch.equal(pre.state.layers["0"].a_factor, before["A"])
    kf.KFACPreconditioner(_model(), **with_settings(**saved)).load_state_dict(
        sd
    )  # the same settings load


def test_layer_kinds_must_match() -> None:
    sd = _trained(model=_model(nn.RMSNorm))
    pre = kf.KFACPreconditioner(_model(nn.LayerNorm))  # same factor shapes, other kind
    with pytest.raises(ValueError, match="layer '1': kinds='rms_norm' in the state_dict"):
        pre.load_state_dict(sd)


def test_checkpoints_without_settings_still_load() -> None:
    sd = _trained(scaling="fisher")
    del sd["settings"]
    pre = kf.KFACPreconditioner(_model())
    pre.load_state_dict(sd)
    assert pre.steps == 2
    x = torch.randn(8, 4)
    F.mse_loss(pre.model(x), torch.zeros(8, 3)).backward()
    pre.step()
