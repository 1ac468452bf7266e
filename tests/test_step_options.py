"""`StepOptions`: one frozen value of a step's settings, read by `update`,
`update_distributed`, `precondition_grads` and the preconditioner.

The same settings given as `options=`, as keywords, or as both (keywords override) give
the same step bit for bit; bad settings are refused when the value is made, naming the
setting; step-dependent hyperparameters are resolved and checked at each step.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import kfac_func as kf


@pytest.fixture(autouse=True)
def _float64() -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


def _setup(seed: int = 0) -> tuple[kf.KFACState, dict[str, torch.Tensor], kf.Captures]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    state = kf.init(kf.register(model), factor_dtype=torch.float64, inv_dtype=torch.float64)
    x, y = torch.randn(12, 5), torch.randint(0, 3, (12,))
    _, grads, caps = kf.capture(
        model, dict(model.named_parameters()), x, lambda o: nn.functional.cross_entropy(o, y)
    )
    return state, grads, caps


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


SETTINGS = [
    {"damping": 1e-2, "kl_clip": None},
    {"damping": 3e-3, "kl_clip": 1e-2, "lr": 0.2, "factor_decay": 0.5},
    {"damping": 1e-2, "eigenbasis_moments": True, "moment_beta2": 0.9, "kl_clip": None},
    {"eigenbasis_moments": True, "moment_beta1": 0.9, "moment_beta2": 0.95, "kl_clip": None},
    {"damping": 1e-2, "sync_free": True, "grouped": False},
]


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: "-".join(sorted(s)))
def test_options_and_keywords_give_the_same_steps(settings: dict[str, object]) -> None:
    state, grads, caps = _setup()
    opts = kf.StepOptions(**settings)  # type: ignore[arg-type]
    by_kw, by_opts = state, state
    for _ in range(3):
        out_kw, by_kw = kf.update(by_kw, grads, captures=caps, **settings)
        out_opts, by_opts = kf.update(by_opts, grads, captures=caps, options=opts)
        assert _equal(out_kw, out_opts)
    assert _equal(kf.state_to_dict(by_kw), kf.state_to_dict(by_opts))


def test_keywords_override_the_options() -> None:
    state, grads, caps = _setup()
    opts = kf.StepOptions(damping=1e-2, kl_clip=None, lr=0.3)
    mixed, _ = kf.update(state, grads, captures=caps, options=opts, damping=0.5)
    want, _ = kf.update(state, grads, captures=caps, damping=0.5, kl_clip=None, lr=0.3)
    other, _ = kf.update(state, grads, captures=caps, options=opts)
    assert _equal(mixed, want)
    assert not _equal(mixed, other)  # the damping did change the step


def test_one_options_value_runs_every_step_function() -> None:
    """The same value through update, update_distributed (one rank) and
    precondition_grads: the distributed step equals update, and preconditioning the
    decomposed state equals update's directions."""
    state, grads, caps = _setup()
    opts = kf.StepOptions(damping=1e-2, kl_clip=1e-2, lr=0.2, factor_decay=0.5)
    plan = kf.distributed.make_plan({n: ls.spec for n, ls in state.layers.items()}, world_size=1)
    comm = kf.distributed.Communicator(plan)
    out, new = kf.update(state, grads, captures=caps, options=opts)
    out_d, new_d = kf.distributed.update_distributed(
        state, grads, captures=caps, plan=plan, comm=comm, options=opts
    )
    for k in out:
        torch.testing.assert_close(out_d[k], out[k], rtol=1e-12, atol=1e-14)
    again = kf.step.precondition_grads(new.replace(step=state.step), grads, options=opts)
    for k in out:
        torch.testing.assert_close(again[k], out[k], rtol=1e-12, atol=1e-14)
    assert new_d.step == new.step == 1


@pytest.mark.parametrize(
    ("settings", "error", "names"),
    [
        ({"nonfinite": "ignore"}, ValueError, "nonfinite"),
        ({"grafting": "adam"}, TypeError, "grafting"),
        ({"eigenbasis_moments": True, "moment_beta2": 1.0}, ValueError, "moment_beta2"),
        ({"sync_free": True, "nonfinite": "raise"}, ValueError, "sync_free"),
        ({"grouped": 1}, TypeError, "grouped"),
        ({"eigh_device": "cpu"}, TypeError, "eigh_device"),
    ],
)
def test_bad_settings_are_refused_when_made(
    settings: dict[str, object], error: type[Exception], names: str
) -> None:
    with pytest.raises(error, match=names):
        kf.StepOptions(**settings)  # type: ignore[arg-type]
    state, grads, caps = _setup()
    with pytest.raises(error, match=names):  # the same through the keywords
        kf.update(state, grads, captures=caps, **settings)


def test_unknown_settings_are_named() -> None:
    state, grads, caps = _setup()
    with pytest.raises(TypeError, match=r"unknown step settings \['dampnig'\]"):
        kf.update(state, grads, captures=caps, dampnig=1e-2)
    with pytest.raises(TypeError, match="dampnig"):
        kf.StepOptions().replace(dampnig=1e-2)
    with pytest.raises(TypeError, match=re.escape("options must be a kfac_func.StepOptions")):
        kf.update(state, grads, captures=caps, options={"damping": 1e-2})  # type: ignore[arg-type]


def test_the_options_are_frozen_and_resolve_per_step() -> None:
    opts = kf.StepOptions(lr=lambda k: 0.1 * (k + 1), damping=lambda k: 1e-2 / (k + 1))
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.lr = 0.5  # type: ignore[misc]
    at3 = opts.at(3)
    assert at3.lr == pytest.approx(0.4) and at3.damping == pytest.approx(2.5e-3)
    assert at3.update_factors is True and opts.lr is not at3.lr  # the original unchanged
    bad = kf.StepOptions(lr=lambda k: -1.0)  # a callable is checked at its step
    with pytest.raises(ValueError, match=r"lr must be >= 0, got -1\.0"):
        bad.at(0)
    state, grads, caps = _setup()
    with pytest.raises(ValueError, match="lr must be >= 0"):
        kf.update(state, grads, captures=caps, options=bad)


def test_a_refused_step_loses_no_state() -> None:
    state, grads, caps = _setup()
    before = kf.state_to_dict(state)
    with pytest.raises(TypeError):
        kf.update(state, grads, captures=caps, donate=True, kl_cilp=None)
    assert _equal(kf.state_to_dict(state), before)
    assert state.step == 0


def test_the_preconditioner_steps_with_its_attributes_as_options() -> None:
    """The adapter builds its step's options from its attributes as they are at that step:
    changing ``pre.damping`` between steps changes the next step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    pre = kf.KFACPreconditioner(
        model, damping=1e-2, kl_clip=None, settings=kf.Settings(eigenbasis_moments=True)
    )
    opts = pre._step_options(damping=0.5)
    assert (opts.damping, opts.eigenbasis_moments, opts.kl_clip) == (0.5, True, None)
    pre.eigenbasis_moments = False
    assert pre._step_options().eigenbasis_moments is False
