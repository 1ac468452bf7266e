"""Grafting (:mod:`kfac_func.core.grafting`): K-FAC's direction with the norm of SGD's or
Adam's step, per layer, checked in float64 against norms and Adam moments computed here."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kfac_func as kf

DT = torch.float64
B2, EPS = 0.9, 1e-8


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).to(DT)


def _batch(k: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(k)
    return torch.randn(8, 4, generator=g, dtype=DT), torch.randint(0, 3, (8,), generator=g)


def _matrix(table: kf.LayerTable, name: str, grads: dict[str, torch.Tensor]) -> torch.Tensor:
    spec = table[name]
    return kf.blocks.grads_to_matrix(
        spec, grads[spec.weight], grads[spec.bias] if spec.bias else None
    )


@pytest.mark.parametrize("mode", ["sgd", "adam"])
def test_grafted_layers_have_the_norm_of_the_grafted_step(mode: str) -> None:
    model = _model()
    table = kf.register(model)
    plain = kf.init(table, factor_dtype=DT, inv_dtype=DT)
    grafted = kf.init(table, factor_dtype=DT, inv_dtype=DT)
    moments: dict[str, torch.Tensor] = {}
    params = dict(model.named_parameters())
    for step in range(3):
        x, y = _batch(step)
        _, grads, caps = kf.capture(model, params, x, lambda o, y=y: F.cross_entropy(o, y))
        direction, plain = kf.update(plain, grads, captures=caps, damping=0.1, kl_clip=None)
        out, grafted = kf.update(
            grafted,
            grads,
            captures=caps,
            damping=0.1,
            kl_clip=None,
            grafting=mode,
            graft_beta2=B2,
            graft_eps=EPS,
        )
        for name in table:
            m = _matrix(table, name, grads)
            p = _matrix(table, name, direction)
            got = _matrix(table, name, out)
            if mode == "sgd":
                target = m.norm()
            else:
                moments[name] = B2 * moments.get(name, torch.zeros_like(m)) + (1 - B2) * m**2
                v_hat = moments[name] / (1 - B2 ** (step + 1))
                target = (m / (v_hat.sqrt() + EPS)).norm()
                torch.testing.assert_close(
                    grafted.layers[name].graft_moment, moments[name], rtol=1e-12, atol=0
                )
            torch.testing.assert_close(got.norm(), target, rtol=1e-12, atol=0)
            torch.testing.assert_close(got, p * (target / p.norm()), rtol=1e-12, atol=1e-15)


def test_adapter_distributed_step_and_checkpoints() -> None:
    model, ref = _model(), _model()
    table = kf.register(ref)
    pre = kf.KFACPreconditioner(
        model,
        settings=kf.Settings(scaling="fisher", grafting="adam"),
        inv_dtype=DT,
        damping=0.1,
        kl_clip=None,
    )
    state = kf.init(table, factor_dtype=DT, inv_dtype=DT)
    plan = kf.distributed.make_plan(table, 1)
    comm = kf.distributed.Communicator(plan)
    dstate = kf.init(table, factor_dtype=DT, inv_dtype=DT)
    x, y = _batch(5)
    F.cross_entropy(model(x), y).backward()
    pre.step()
    _, grads, caps = kf.capture(
        ref, dict(ref.named_parameters()), x, lambda o: F.cross_entropy(o, y)
    )
    kw = {"damping": 0.1, "kl_clip": None, "grafting": "adam"}
    out, state = kf.update(state, grads, captures=caps, **kw)  # type: ignore[arg-type]
    dout, dstate = kf.distributed.update_distributed(
        dstate, grads, captures=caps, plan=plan, comm=comm, **kw
    )  # type: ignore[arg-type]
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, out[n], rtol=1e-12, atol=1e-15)
        assert torch.equal(dout[n], out[n])
    back = kf.state_from_dict(kf.state_to_dict(state), like=state)
    for n, ls in state.layers.items():
        assert torch.equal(back.layers[n].graft_moment, ls.graft_moment)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="grafting must be one of"):
        kf.update(state, grads, captures=caps, grafting="lion")
    with pytest.raises(ValueError, match="graft_beta2"):
        kf.KFACPreconditioner(_model(), settings=kf.Settings(grafting="adam", graft_beta2=1.0))
