"""One setting, one meaning, in the functional API and in the preconditioner: the range of
``factor_decay`` and the two names of the factors' convention (``convention=`` /
``scaling=``)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kfac_func as kf


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))


@pytest.mark.parametrize("decay", [-0.1, 1.5])
def test_factor_decay_outside_0_1_is_refused_by_both(decay: float) -> None:
    model = _model()
    with pytest.raises(ValueError, match=r"factor_decay must be in \[0, 1\]"):
        kf.KFACPreconditioner(model, factor_decay=decay)
    state = kf.init(kf.register(model))
    x = torch.randn(4, 3)
    _, grads, caps = kf.capture(model, dict(model.named_parameters()), x, lambda o: o.sum())
    with pytest.raises(ValueError, match=r"factor_decay must be in \[0, 1\]"):
        kf.update(state, grads, captures=caps, factor_decay=decay)


def test_factor_decay_zero_keeps_the_latest_batch_factors_in_both() -> None:
    """0 is a value of the range (``exp_decay_factor_averaging`` starts with it): the
    factors are the last batch's, in the preconditioner as in ``update``."""
    assert kf.step.exp_decay_factor_averaging()(1) == 0.0
    model, plain = _model(), _model()  # the capture's forward must not feed the hooks
    pre = kf.KFACPreconditioner(
        model, factor_decay=0.0, settings=kf.Settings(scaling="fisher"), kl_clip=None
    )
    state = kf.init(kf.register(plain))
    for seed in (1, 2):
        x = torch.randn(5, 3, generator=torch.Generator().manual_seed(seed))
        model.zero_grad()
        model(x).pow(2).mean().backward()
        pre.step()
        params = dict(plain.named_parameters())
        _, grads, caps = kf.capture(plain, params, x, lambda o: o.pow(2).mean())
        _, state = kf.update(state, grads, captures=caps, factor_decay=0.0)
    spec = pre.layers["0"]
    want = kf.core.a_factor(spec, [x], convention="fisher")
    torch.testing.assert_close(pre.state.layers["0"].a_factor, want)
    torch.testing.assert_close(state.layers["0"].a_factor, want)
    torch.testing.assert_close(pre.state.layers["2"].g_factor, state.layers["2"].g_factor)


def test_convention_and_scaling_name_the_same_setting_in_both() -> None:
    layers = kf.register(_model())
    assert kf.init(layers).config.convention == "fisher"
    assert kf.init(layers, scaling="kfac-pytorch").config.convention == "kfac-pytorch"
    assert kf.init(layers, convention="fisher", scaling="fisher").config.convention == "fisher"
    with pytest.raises(ValueError, match="name the same setting"):
        kf.init(layers, convention="fisher", scaling="kfac-pytorch")
    with pytest.raises(ValueError, match="convention must be one of"):
        kf.init(layers, scaling="natural")
    pre = kf.KFACPreconditioner(_model())
    assert pre.scaling == "kfac-pytorch" == pre.state.config.convention
    # the preconditioner's alias, a deprecated keyword like the other settings
    with pytest.deprecated_call():
        pre = kf.KFACPreconditioner(_model(), convention="fisher")
    assert pre.scaling == "fisher" == pre.state.config.convention
    with pytest.deprecated_call():
        kf.KFACPreconditioner(_model(), convention="fisher", scaling="fisher")
    # a refused call warns about nothing: the error says what to change
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match="name the same setting"):
            kf.KFACPreconditioner(_model(), convention="fisher", scaling="kfac-pytorch")
        with pytest.raises(ValueError, match="scaling must be one of"):
            kf.KFACPreconditioner(_model(), convention="natural")


def test_the_alias_gives_the_same_steps() -> None:
    model = _model()
    x, y = torch.randn(6, 3), torch.randint(0, 2, (6,))
    out = []
    for kwargs in ({"scaling": "fisher"}, {"convention": "fisher"}):
        m = _model()
        m.load_state_dict(model.state_dict())
        with pytest.deprecated_call():  # the settings' own keywords, still taken
            pre = kf.KFACPreconditioner(m, **kwargs)  # type: ignore[arg-type]
        F.cross_entropy(m(x), y).backward()
        pre.step()
        out.append([p.grad.clone() for p in m.parameters() if p.grad is not None])
    for a, b in zip(*out):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
