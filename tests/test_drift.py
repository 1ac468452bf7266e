"""Eigenbases refreshed when they drift (``refresh_drift``).

Oracles, float64: the drift of a basis is recomputed here from the dense ``QᵀFQ`` (its
off-diagonal mass in the columns of the largest eigenvalues, relative to those columns'
mass); a threshold of 0 must give exactly the step that decomposes every layer, one above
every drift must keep every basis, and a step with a threshold must leave no basis that
drifted past it.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kfac_func as kf
from kfac_func.step.drift import DRIFT_COLUMNS, basis_drift, drifted_layers

DT = torch.float64


def _dense_drift(f: torch.Tensor, q: torch.Tensor, values: torch.Tensor, k: int) -> float:
    """The oracle: ``D = QᵀFQ``; over the columns of the ``k`` largest ``values``, the
    squared off-diagonal entries of ``D`` over all squared entries."""
    d = q.mT @ f @ q
    cols = values.argsort(descending=True)[:k]
    block = d[:, cols]
    off = block.clone()
    off[cols, torch.arange(len(cols))] = 0
    return float(off.square().sum() / block.square().sum())


def _spd(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3 * n, n, generator=g, dtype=DT) * torch.logspace(0, -2, n, dtype=DT)
    return x.mT @ x / n


@pytest.mark.parametrize("n", [5, 16, 40])
def test_drift_against_dense_oracle(n: int) -> None:
    f_old, f_new = _spd(n, 0), 0.8 * _spd(n, 0) + 0.2 * _spd(n, 1)
    values, q = torch.linalg.eigh(f_old)
    assert float(basis_drift(f_old, q, values)) < 1e-24  # an exact eigenbasis
    got = float(basis_drift(f_new, q, values))
    want = _dense_drift(f_new, q, values, min(n, DRIFT_COLUMNS))
    assert got == pytest.approx(want, rel=1e-10)
    assert 1e-6 < got < 1
    # a basis whose columns are permuted and signed is the same basis
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(2))
    signs = torch.where(torch.arange(n) % 2 == 0, 1.0, -1.0).to(DT)
    got2 = float(basis_drift(f_new, q[:, perm] * signs, values[perm]))
    assert got2 == pytest.approx(got, rel=1e-10)
    for k in (1, 3):
        assert float(basis_drift(f_new, q, values, k)) == pytest.approx(
            _dense_drift(f_new, q, values, k), rel=1e-10
        )


def test_drift_of_stacked_bases_is_the_largest() -> None:
    fs = torch.stack([_spd(6, 0), _spd(6, 1)])
    values, q = torch.linalg.eigh(fs)
    moved = torch.stack([fs[0], 0.5 * fs[1] + 0.5 * _spd(6, 3)])
    each = [float(basis_drift(moved[i], q[i], values[i])) for i in range(2)]
    assert each[0] < 1e-24 < each[1]
    assert float(basis_drift(moved, q, values)) == pytest.approx(max(each), rel=1e-12)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(DT)


def _batch(k: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(k)
    return torch.randn(16, 6, generator=g, dtype=DT), torch.randint(0, 3, (16,), generator=g)


_MOMENTS = {"kl_clip": None, "eigenbasis_moments": True, "moment_beta2": 0.9, "moment_beta1": 0.5}


def _run(steps: int, **kw: object) -> tuple[list[dict[str, torch.Tensor]], list[kf.KFACState]]:
    """``steps`` functional steps of plain SGD (lr 0.1) on the preconditioned gradients;
    each step's preconditioned gradients and state."""
    model = _model()
    table = kf.register(model)
    state = kf.init(table, factor_dtype=DT, inv_dtype=DT)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    outs, states = [], []
    for step in range(steps):
        x, y = _batch(step)
        _, grads, caps = kf.capture(model, params, x, lambda o, y=y: F.cross_entropy(o, y))
        out, state = kf.update(state, grads, captures=caps, factor_decay=0.8, **_MOMENTS, **kw)  # type: ignore[arg-type]
        params = {k: v.add(out[k], alpha=-0.1) for k, v in params.items()}
        outs.append(out)
        states.append(state)
    return outs, states


def test_zero_threshold_is_the_exact_step() -> None:
    exact, _ = _run(6)
    gated, _ = _run(6, refresh_drift=0.0)
    for a, b in zip(exact, gated):
        for n in a:
            assert torch.equal(a[n], b[n])


def test_bases_never_left_past_the_threshold() -> None:
    tau = 0.02  # one step of this model moves a basis by 0.0002 to 0.03
    _, states = _run(8, refresh_drift=tau)
    kept = refreshed = 0
    for before, after in itertools.pairwise(states):
        for name, ls in after.layers.items():
            dec = ls.decomposition
            assert isinstance(dec, kf.core.EigenDecomposition)
            for f, q, d in ((ls.a_factor, dec.qa, dec.da), (ls.g_factor, dec.qg, dec.dg)):
                assert float(basis_drift(f, q, d)) <= tau
            same = dec is before.layers[name].decomposition
            kept += same
            refreshed += not same
            if same:  # kept with its moments as they were stepped, not carried
                assert ls.moment_count == before.layers[name].moment_count + 1
    assert kept and refreshed  # the threshold both kept and refreshed bases here


def test_threshold_above_every_drift_keeps_every_basis() -> None:
    _, states = _run(4, refresh_drift=1.0)
    for ls0, ls3 in zip(states[0].layers.values(), states[3].layers.values()):
        assert ls3.decomposition is ls0.decomposition
        assert not torch.equal(ls3.a_factor, ls0.a_factor)  # the factors moved on


def test_gated_training_stays_close_to_the_exact_step() -> None:
    """Refreshing past a small drift only: the loss after 30 steps within 2 % of the
    step that decomposes every layer every step, and well below the start."""

    def loss_after(lr: float = 0.05, **kw: object) -> float:
        model = _model()
        table = kf.register(model)
        state = kf.init(table, factor_dtype=DT, inv_dtype=DT)
        params = {k: v.detach().clone() for k, v in model.named_parameters()}
        g = torch.Generator().manual_seed(9)
        xs = torch.randn(64, 6, generator=g, dtype=DT)
        ys = (xs[:, :3] * 2).argmax(1)
        for _ in range(30):
            idx = torch.randint(0, 64, (16,), generator=g)
            _, grads, caps = kf.capture(
                model, params, xs[idx], lambda o, i=idx: F.cross_entropy(o, ys[i])
            )
            out, state = kf.update(state, grads, captures=caps, factor_decay=0.8, **_MOMENTS, **kw)  # type: ignore[arg-type]
            params = {k: v.add(out[k], alpha=-lr) for k, v in params.items()}
        with torch.no_grad():
            return float(F.cross_entropy(torch.func.functional_call(model, params, (xs,)), ys))

    start = loss_after(lr=0.0)
    exact = loss_after()
    gated = loss_after(refresh_drift=0.01)
    assert gated == pytest.approx(exact, rel=0.02)
    assert gated < 0.5 * start


def test_drifted_layers_reads_each_layer() -> None:
    _, states = _run(2)
    layers = dict(states[-1].layers)
    names = list(layers)
    assert drifted_layers(layers, names, 1e-12) == []  # decomposed from these factors
    # a layer whose factor turned, and one whose factor is not finite, are refreshed
    first, second = names
    ls = layers[first]
    turned = torch.linalg.qr(
        torch.randn(ls.a_factor.shape, dtype=DT, generator=torch.Generator().manual_seed(5))
    )[0]
    layers[first] = ls.replace(a_factor=turned @ ls.a_factor @ turned.mT)
    assert drifted_layers(layers, names, 1e-6) == [first]
    layers[second] = layers[second].replace(
        g_factor=torch.full_like(layers[second].g_factor, float("nan"))
    )
    assert drifted_layers(layers, names, 1e-6) == [first, second]
    # a layer without a decomposition is always decomposed
    layers[second] = layers[second].replace(decomposition=None)
    assert second in drifted_layers(layers, [second], 1.0)


def test_refused_settings() -> None:
    for kw, match in [
        ({"refresh_drift": 0.01}, "needs eigenbasis_moments=True"),
        ({"refresh_drift": -1.0, "eigenbasis_moments": True}, "must be None or a number >= 0"),
        (
            {"refresh_drift": 0.01, "eigenbasis_moments": True, "orthogonal": True},
            "orthogonal=False",
        ),
        (
            {"refresh_drift": 0.01, "eigenbasis_moments": True, "sync_free": True},
            "sync_free=False",
        ),
    ]:
        with pytest.raises(ValueError, match=match):
            kf.StepOptions(**kw)  # type: ignore[arg-type]
    state = kf.init(kf.register(_model()), compute_method="ekfac")
    with pytest.raises(ValueError, match="compute_method 'eigen', not 'ekfac'"):
        kf.update(state, {}, update_factors=False, refresh_drift=0.01, **_MOMENTS)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs eigenbasis_moments=True"):
        kf.KFACPreconditioner(_model(), refresh_drift=0.01)
    table = kf.register(_model())
    plan = kf.distributed.make_plan(table, 1)
    with pytest.raises(ValueError, match="update_distributed decomposes on schedule"):
        kf.distributed.update_distributed(
            kf.init(table),
            {},
            plan=plan,
            comm=kf.distributed.Communicator(plan),
            update_factors=False,
            refresh_drift=0.01,
            **_MOMENTS,  # type: ignore[arg-type]
        )


def test_adapter_with_drift_equals_update_and_resumes() -> None:
    """The adapter's steps with ``refresh_drift`` are the functional ones, and a resumed
    adapter (bases kept in its state dict) continues them exactly."""

    def adapter(model: nn.Module) -> kf.KFACPreconditioner:
        return kf.KFACPreconditioner(
            model, scaling="fisher", factor_dtype=DT, inv_dtype=DT, factor_decay=0.8,
            inv_update_steps=1, refresh_drift=0.02, **_MOMENTS,  # type: ignore[arg-type]
        )  # fmt: skip

    def train(
        model: nn.Module, pre: kf.KFACPreconditioner, ks: range
    ) -> list[dict[str, torch.Tensor]]:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        out = []
        for k in ks:
            x, y = _batch(k)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            pre.step()
            out.append({n: p.grad.clone() for n, p in model.named_parameters()})  # type: ignore[union-attr]
            opt.step()
        return out

    model = _model()
    pre = adapter(model)
    got = train(model, pre, range(5))
    want, _ = _run(5, refresh_drift=0.02)
    for a, b in zip(got, want):
        for n in b:
            torch.testing.assert_close(a[n], b[n], rtol=1e-12, atol=1e-15)
    resumed_model = _model()
    resumed_model.load_state_dict(model.state_dict())
    resumed = adapter(resumed_model)
    resumed.load_state_dict(pre.state_dict())
    for a, b in zip(train(model, pre, range(5, 9)), train(resumed_model, resumed, range(5, 9))):
        for n in a:
            assert torch.equal(a[n], b[n])
