"""Eigenbasis moments (``eigenbasis_moments=True``): Adam's step in K-FAC's eigenbasis.

Oracles, float64: with every factor side diagonal the eigenbasis is the identity and the
step must be ``torch.optim.Adam``'s (β₁ = 0) on the gradient matrix; with dense factors
the moment and the step are recomputed here from ``torch.linalg.eigh`` of the state's
factors, the moment carried into each new basis as the diagonal of the old diagonal
moment rotated by the dense Kronecker product of the basis changes. The adapter, one-rank
and two-rank (gloo) distributed steps and checkpoints must give the same numbers.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kfac_func as kf
from kfac_func.core.basis_moments import carry_moment

DT = torch.float64
B2, EPS = 0.9, 1e-8


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).to(DT)


def _batch(k: int, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(k)
    return torch.randn(n, 4, generator=g, dtype=DT), torch.randint(0, 3, (n,), generator=g)


def _matrix(spec: kf.blocks.LayerSpec, grads: dict[str, torch.Tensor]) -> torch.Tensor:
    return kf.blocks.grads_to_matrix(
        spec, grads[spec.weight], grads[spec.bias] if spec.bias else None
    )


@pytest.mark.parametrize("beta1", [0.0, 0.8])
def test_identity_basis_is_adam(beta1: float) -> None:
    """All sides diagonal: each layer's step is Adam's (β₁ = ``moment_beta1``) on
    ``[W | b]``."""
    model = _model()
    table = kf.register(model, max_factor_dim=1)
    assert all(ls.diagonal == (True, True) for ls in table.values())
    state = kf.init(table, factor_dtype=DT, inv_dtype=DT)
    params = dict(model.named_parameters())
    mats = {n: torch.zeros_like(_matrix(s, params), requires_grad=True) for n, s in table.items()}
    adam = torch.optim.Adam(mats.values(), lr=1.0, betas=(beta1, B2), eps=EPS)
    for step in range(4):
        x, y = _batch(step)
        _, grads, caps = kf.capture(model, params, x, lambda o, y=y: F.cross_entropy(o, y))
        out, state = kf.update(
            state,
            grads,
            captures=caps,
            kl_clip=None,
            eigenbasis_moments=True,
            moment_beta2=B2,
            moment_eps=EPS,
            moment_beta1=beta1,
        )
        before = {name: m.detach().clone() for name, m in mats.items()}
        for name, spec in table.items():
            mats[name].grad = _matrix(spec, grads)
        adam.step()
        for name, spec in table.items():
            want = before[name] - mats[name].detach()
            torch.testing.assert_close(_matrix(spec, out), want, rtol=1e-12, atol=1e-15)
            assert state.layers[name].moment_count == step + 1
            assert (state.layers[name].basis_momentum is None) == (beta1 == 0)


def _carried_dense(
    v: torch.Tensor, old: tuple[torch.Tensor, torch.Tensor], new: tuple[torch.Tensor, torch.Tensor]
) -> torch.Tensor:
    """diag(K diag(vec v) Kᵀ) with K = (Qg_newᵀ Qg_old) ⊗ (Qa_newᵀ Qa_old)."""
    k = torch.kron(new[1].T @ old[1], new[0].T @ old[0])
    return torch.diagonal(k @ torch.diag(v.reshape(-1)) @ k.T).reshape(v.shape)


def test_carry_is_the_diagonal_of_the_rotated_moment() -> None:
    g = torch.Generator().manual_seed(3)
    v = torch.rand(3, 4, generator=g, dtype=DT)
    qs = [torch.linalg.qr(torch.randn(n, n, generator=g, dtype=DT)).Q for n in (4, 3, 4, 3)]
    old, new = (qs[0], qs[1]), (qs[2], qs[3])
    torch.testing.assert_close(carry_moment(v, old, new), _carried_dense(v, old, new))
    eye = (torch.eye(4, dtype=DT), torch.eye(3, dtype=DT))
    torch.testing.assert_close(carry_moment(v, (None, None), new), _carried_dense(v, eye, new))
    torch.testing.assert_close(carry_moment(v, old, (None, None)), _carried_dense(v, old, eye))
    flip = torch.diag(torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=DT))[[1, 0, 3, 2]]
    torch.testing.assert_close(carry_moment(v, eye, (flip, eye[1])), v[:, [1, 0, 3, 2]])


@pytest.mark.parametrize("beta1", [0.0, 0.7])
def test_dense_bases_against_eigh_and_carried_moments(beta1: float) -> None:
    """The step recomputed here from eigh of the state's factors, decompositions every
    other step (the second moment carried into each new basis). The oracle keeps the first
    moment in the layer's coordinates; the state keeps it in the eigenbasis, rotated into
    each new one: the two agree up to rounding, which the division by small second moments
    amplifies (hence the looser tolerance of the step with a first moment)."""
    model = _model()
    table = kf.register(model)
    state = kf.init(table, factor_dtype=DT, inv_dtype=DT)
    params = dict(model.named_parameters())
    moments: dict[str, torch.Tensor] = {}
    firsts: dict[str, torch.Tensor] = {}
    bases: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for step in range(5):
        x, y = _batch(10 + step)
        _, grads, caps = kf.capture(model, params, x, lambda o, y=y: F.cross_entropy(o, y))
        out, state = kf.update(
            state,
            grads,
            captures=caps,
            kl_clip=None,
            update_inverses=step % 2 == 0,
            eigenbasis_moments=True,
            moment_beta2=B2,
            moment_eps=EPS,
            moment_beta1=beta1,
        )
        for name, spec in table.items():
            ls = state.layers[name]
            if step % 2 == 0:
                new = (torch.linalg.eigh(ls.a_factor)[1], torch.linalg.eigh(ls.g_factor)[1])
                if name in moments:
                    moments[name] = _carried_dense(moments[name], bases[name], new)
                bases[name] = new
            qa, qg = bases[name]
            v = qg.T @ _matrix(spec, grads) @ qa
            moments[name] = B2 * moments.get(name, torch.zeros_like(v)) + (1 - B2) * v**2
            v_hat = moments[name] / (1 - B2 ** (step + 1))
            if beta1 > 0:
                m = _matrix(spec, grads)
                firsts[name] = beta1 * firsts.get(name, torch.zeros_like(m)) + (1 - beta1) * m
                v = qg.T @ (firsts[name] / (1 - beta1 ** (step + 1))) @ qa
                kept = ls.basis_momentum
                assert kept is not None
                torch.testing.assert_close(qg @ kept @ qa.T, firsts[name], rtol=1e-10, atol=1e-13)
            want = qg @ (v / (v_hat.sqrt() + EPS)) @ qa.T
            rtol, atol = (1e-7, 1e-8) if beta1 > 0 else (1e-9, 1e-12)
            torch.testing.assert_close(_matrix(spec, out), want, rtol=rtol, atol=atol)
            torch.testing.assert_close(ls.basis_moment, moments[name], rtol=1e-9, atol=1e-14)


def _adapter(model: nn.Module, **kw: object) -> kf.KFACPreconditioner:
    return kf.KFACPreconditioner(
        model,
        settings=kf.Settings(
            scaling="fisher", eigenbasis_moments=True, moment_beta2=B2, moment_beta1=0.5
        ),
        factor_dtype=DT,
        inv_dtype=DT,
        kl_clip=None,
        inv_update_steps=2,
        **kw,  # type: ignore[arg-type]
    )


def _train(
    model: nn.Module, pre: kf.KFACPreconditioner, batches: range, rank: int | None = None
) -> list[dict[str, torch.Tensor]]:
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    out = []
    for k in batches:
        x, y = _batch(k)
        if rank is not None:
            x, y = x[rank * 4 : (rank + 1) * 4], y[rank * 4 : (rank + 1) * 4]
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        pre.step()
        out.append({n.removeprefix("module."): p.grad.clone() for n, p in model.named_parameters()})  # type: ignore[union-attr]
        opt.step()
    return out


def test_adapter_equals_update_and_resumes_from_checkpoints() -> None:
    model, ref = _model(), _model()
    pre = _adapter(model)
    table = kf.register(ref)
    state = kf.init(table, factor_dtype=DT, inv_dtype=DT)
    plan = kf.distributed.make_plan(table, 1)
    comm = kf.distributed.Communicator(plan)
    dstate = state
    params = {k: v.detach().clone() for k, v in ref.named_parameters()}
    kw = {"kl_clip": None, "eigenbasis_moments": True, "moment_beta2": B2, "moment_beta1": 0.5}
    got = _train(model, pre, range(3))
    for step in range(3):
        x, y = _batch(step)
        _, grads, caps = kf.capture(ref, params, x, lambda o, y=y: F.cross_entropy(o, y))
        every = step % 2 == 0
        out, state = kf.update(state, grads, captures=caps, update_inverses=every, **kw)  # type: ignore[arg-type]
        dout, dstate = kf.distributed.update_distributed(
            dstate,
            grads,
            captures=caps,
            plan=plan,
            comm=comm,
            update_inverses=every,
            **kw,  # type: ignore[arg-type]
        )
        for n in out:
            torch.testing.assert_close(got[step][n], out[n], rtol=1e-12, atol=1e-15)
            assert torch.equal(dout[n], out[n])
        params = {k: v.add(out[k], alpha=-0.05) for k, v in params.items()}
    # the functional state and the adapter's state dict both carry the moments
    back = kf.state_from_dict(kf.state_to_dict(state, include_decompositions=True), like=state)
    for n, ls in state.layers.items():
        assert torch.equal(back.layers[n].basis_moment, ls.basis_moment)  # type: ignore[arg-type]
        assert torch.equal(back.layers[n].basis_momentum, ls.basis_momentum)  # type: ignore[arg-type]
        assert back.layers[n].moment_count == ls.moment_count == 3
    saved = pre.state_dict()
    resumed_model = _model()
    resumed_model.load_state_dict(model.state_dict())
    resumed = _adapter(resumed_model)
    resumed.load_state_dict(saved)
    want = _train(model, pre, range(3, 6))
    again = _train(resumed_model, resumed, range(3, 6))
    for a, b in zip(want, again):
        for n in a:
            torch.testing.assert_close(a[n], b[n], rtol=1e-12, atol=1e-15)


def test_refused_settings() -> None:
    with pytest.raises(ValueError, match="needs an eigenbasis"):
        kf.KFACPreconditioner(
            _model(), compute_method="inverse", settings=kf.Settings(eigenbasis_moments=True)
        )
    with pytest.raises(ValueError, match="moment_beta2"):
        kf.KFACPreconditioner(
            _model(), settings=kf.Settings(eigenbasis_moments=True, moment_beta2=1.0)
        )
    with pytest.raises(ValueError, match="moment_beta1"):
        kf.KFACPreconditioner(
            _model(), settings=kf.Settings(eigenbasis_moments=True, moment_beta1=-0.1)
        )
    state = kf.init(kf.register(_model()), compute_method="inverse")
    with pytest.raises(ValueError, match="needs an eigenbasis"):
        kf.update(state, {}, update_factors=False, eigenbasis_moments=True)


def _worker(rank: int, world: int, tmp: str, fraction: float) -> None:
    from datetime import timedelta

    from gloo import gloo_group, record_errors
    from torch.nn.parallel import DistributedDataParallel

    with (
        gloo_group(rank, world, tmp, timeout=timedelta(seconds=60)),
        record_errors(Path(tmp, f"rank{rank}.error")),
    ):
        model = DistributedDataParallel(_model())
        pre = _adapter(model, grad_worker_fraction=fraction)
        torch.save(_train(model, pre, range(4), rank), Path(tmp, f"rank{rank}.pt"))


@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_ddp_two_ranks_equal_one_process(tmp_path: Path, fraction: float) -> None:
    from gloo import one_thread, spawn

    spawn(_worker, 2, tmp_path, fraction)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    with one_thread():
        model = _model()
        reference = _train(model, _adapter(model), range(4))
    for step, want in enumerate(reference):
        for got in ranks:
            err = max(float((got[step][n] - want[n]).abs().max()) for n in want)
            assert err < 1e-6, (fraction, step, err)
