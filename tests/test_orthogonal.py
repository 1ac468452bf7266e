"""Orthogonalized steps on K-FAC's curvature (Muon's step, preconditioned by powers of the
damped factors) against a float64 reference written out here: the factor powers by
``eigh`` of the state's factors, the Newton–Schulz iteration as its scalar polynomial on
the singular values, on the fixture models; the recipes of the optimizer face; the state
through checkpoints and the distributed plan."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from fixture_models import FIXTURES, Fixture, T
from numerics import assert_close_where_determined, moments_tolerance
from settings_keywords import with_settings
from torch import nn

import kfac_func as kf
from kfac_func.adapter.describe import describe_step
from kfac_func.adapter.recipes import HEAD_NAMES
from kfac_func.blocks import grads_to_matrix
from kfac_func.core.orthogonal import newton_schulz
from kfac_func.step.orthogonal import Orthogonal, orthogonal_layers, orthogonal_table

F64 = torch.float64
A, B, C = 3.4445, -4.7750, 2.0315  # Muon's quintic, as published


def _ns_reference(x: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """The iteration through the SVD: ``U f(S / ‖x‖_F) Vᵀ`` with ``f`` the scalar map
    ``s ← a s + b s³ + c s⁵`` applied ``steps`` times."""
    u, s, vh = torch.linalg.svd(x.to(F64), full_matrices=False)
    f = s / (torch.linalg.matrix_norm(x.to(F64))[..., None] + 1e-7)
    for _ in range(steps):
        f = A * f + B * f**3 + C * f**5
    return (u * f[..., None, :]) @ vh


@pytest.mark.parametrize("shape", [(6, 10), (10, 6), (3, 5, 7)])
def test_newton_schulz_is_its_scalar_polynomial_near_uvt(shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    x = torch.randn(shape, dtype=F64)
    got = newton_schulz(x)
    torch.testing.assert_close(got, _ns_reference(x), rtol=0, atol=1e-12)
    # the iteration's known error: singular values above 0.3 % of the norm end in
    # [0.68, 1.21], so the result is within 0.32 of U Vᵀ in the spectral norm
    u, s, vh = torch.linalg.svd(x, full_matrices=False)
    assert bool((s / torch.linalg.matrix_norm(x)[..., None] > 3e-3).all())
    sv = torch.linalg.svdvals(got)
    assert bool(((sv > 0.68) & (sv < 1.21)).all()), sv
    assert float(torch.linalg.matrix_norm(got - u @ vh, ord=2).max()) <= 0.32


def _power(factor: torch.Tensor, p: float, delta: float) -> torch.Tensor:
    """``(F + δ·mean(eig F)·I)^(-p)`` of a dense factor or a diagonal one (a vector)."""
    f = factor.to(F64)
    if p == 0:
        return torch.eye(f.shape[-1], dtype=F64) if f.dim() == 2 else torch.ones_like(f)
    if f.dim() == 1:
        d = f.clamp(min=0)
        return (d + delta * d.mean()) ** -p
    d, q = torch.linalg.eigh(f)
    d = d.clamp(min=0)
    return (q * (d + delta * d.mean()) ** -p) @ q.T


def _side(p: torch.Tensor, m: torch.Tensor, left: bool) -> torch.Tensor:
    if p.dim() == 1:
        return p[:, None] * m if left else m * p
    return p @ m if left else m @ p


def _reference(
    state: kf.KFACState,
    matrices: list[dict[str, torch.Tensor]],
    names: list[str],
    o: Orthogonal,
) -> dict[str, torch.Tensor]:
    """Each of ``names``' last step from its gradient matrices of every step so far and
    the factors of ``state``."""
    out = {}
    for name in names:
        ls = state.layers[name]
        b = torch.zeros_like(matrices[0][name])
        for ms in matrices:
            b = o.beta * b + ms[name]
        u = matrices[-1][name] + o.beta * b
        pa = _power(ls.a_factor, o.powers[0], o.damping)
        pg = _power(ls.g_factor, o.powers[1], o.damping)
        p = _side(pg, _side(pa, u, left=False), left=True)
        out[name] = _ns_reference(p) * 0.2 * max(u.shape[-2:]) ** 0.5
    return out


def _matrices(state: kf.KFACState, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for name, ls in state.layers.items():
        s = ls.spec
        out[name] = grads_to_matrix(s, grads[s.weight], grads.get(s.bias) if s.bias else None)
    return out


SETTINGS: dict[str, dict[str, Any]] = {
    "one-sided-half": {"ortho_powers": (0.5, 0.0)},
    "one-sided-newton": {"ortho_powers": (1.0, 0.0), "grouped": False},
    "two-sided": {"ortho_powers": (0.25, 0.25), "sync_free": True},
    "kfac-head": {"ortho_powers": (0.5, 0.0), "ortho_skip": "head", "eigenbasis_moments": True},
    # the layers with a side wider than 24 (the MLPs', a packed projection's); the others
    # on Adam's step in the eigenbasis
    "wide": {"ortho_powers": (0.5, 0.0), "ortho_wider_than": 24, "eigenbasis_moments": True},
}


@pytest.mark.parametrize("setting", sorted(SETTINGS))
@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_steps_equal_the_float64_reference_on_fixture_models(name: str, setting: str) -> None:
    pytest.importorskip("transformers")
    fx: Fixture = FIXTURES[name]
    s = {"orthogonal": True, "kl_clip": None, "damping": 0.01, **SETTINGS[setting]}
    o = Orthogonal(
        s["ortho_powers"], skip=s.get("ortho_skip"), wider_than=s.get("ortho_wider_than")
    )
    model = fx.build(F64)
    table = kf.register(model, **({} if fx.kinds is None else {"kinds": fx.kinds}))
    table = orthogonal_table(table, o, others=True)
    state = kf.init(table, factor_dtype=F64, inv_dtype=F64)
    names = orthogonal_layers(state.layers, o)
    assert names and (o.skip is o.wider_than is None or len(names) < len(state.layers))
    if o.wider_than is not None:  # the layers with a wide side, and only those
        wide = [n for n, ls in state.layers.items() if ls.spec.block.orthogonalizable]
        wide = [n for n in wide if max(table[n].a_dim, table[n].g_dim) > o.wider_than]
        assert names == wide
    params = {k: v.detach() for k, v in model.named_parameters()}
    seen: list[dict[str, torch.Tensor]] = []
    for step in range(3):
        _, grads, caps = kf.capture(
            model, params, (), fx.loss, layers=table, kwargs=fx.batch(step, 4), loss_divisor=T
        )
        seen.append(_matrices(state, grads))
        new, state = kf.update(state, grads, captures=caps, update_inverses=step != 1, **s)
        if step == 1:  # the decomposition of step 0 with the factors of step 1
            continue
        got = _matrices(state, new)
        want = _reference(state, seen, names, o)
        for n in names:
            scale = float(want[n].abs().max())
            torch.testing.assert_close(got[n], want[n], rtol=0, atol=1e-10 * scale, msg=n)
        if "eigenbasis_moments" in s:  # the other layers: Adam's step in the eigenbasis
            others = [n for n in state.layers if n not in names]
            assert others and all(state.layers[n].basis_moment is not None for n in others)
            assert all(state.layers[n].basis_moment is None for n in names)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 12), nn.LayerNorm(12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(),
        nn.Linear(12, 4),
    ).double()  # fmt: skip


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(16, 6, generator=g, dtype=F64), torch.randint(0, 4, (16,), generator=g)


ORTHO = Orthogonal(powers=(0.25, 0.25), skip=r"(^|\.)5$")  # DDP names it module.5


def _adapter(model: nn.Module, **kw: Any) -> kf.KFACPreconditioner:
    return kf.KFACPreconditioner(
        model,
        **with_settings(
            settings=kf.Settings(scaling="fisher", eigenbasis_moments=True),
            **{"orthogonal": ORTHO, **kw},
        ),
        kl_clip=None,
        damping=0.01,
        inv_update_steps=2,
        factor_dtype=F64,
        inv_dtype=F64,
    )


def _train(
    model: nn.Module, pre: kf.KFACPreconditioner, steps: range, rank: int | None = None
) -> list[dict[str, torch.Tensor]]:
    """Steps of SGD on ``pre``'s gradients; with ``rank``, that rank's half of each batch."""
    out = []
    for step in steps:
        x, y = _batch(step)
        if rank is not None:
            x, y = x[rank * 8 : (rank + 1) * 8], y[rank * 8 : (rank + 1) * 8]
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        pre.step()
        out.append(
            {
                n.removeprefix("module."): p.grad.detach().clone()
                for n, p in model.named_parameters()
            }
        )
        with torch.no_grad():
            for p in model.parameters():
                p.add_(p.grad, alpha=-0.05)
    return out


def test_adapter_equals_update_and_resumes_from_checkpoints() -> None:
    model, ref = _model(), _model()
    pre = _adapter(model)
    assert [n for n, ls in pre.state.layers.items() if ls.spec.g_diagonal] == []  # two-sided
    table = kf.register(ref)
    state = kf.init(table, factor_dtype=F64, inv_dtype=F64)
    plan = kf.distributed.make_plan(table, 1)
    comm = kf.distributed.Communicator(plan)
    dstate = state
    params = {k: v.detach().clone() for k, v in ref.named_parameters()}
    kw = {
        "kl_clip": None,
        "damping": 0.01,
        "orthogonal": True,
        "ortho_powers": ORTHO.powers,
        "ortho_skip": ORTHO.skip,
        "eigenbasis_moments": True,
    }
    got = _train(model, pre, range(3))
    for step in range(3):
        x, y = _batch(step)
        _, grads, caps = kf.capture(ref, params, x, lambda o, y=y: F.cross_entropy(o, y))
        every = step % 2 == 0
        out, state = kf.update(state, grads, captures=caps, update_inverses=every, **kw)
        dout, dstate = kf.distributed.update_distributed(
            dstate, grads, captures=caps, plan=plan, comm=comm, update_inverses=every, **kw
        )
        for n in out:
            torch.testing.assert_close(got[step][n], out[n], rtol=1e-12, atol=1e-15)
        # the distributed step decomposes layer by layer (the single one, grouped): the
        # eigenbasis moments of the head differ where the factors leave them undetermined
        assert_close_where_determined(dout, out, state, **moments_tolerance(state, F64))
        params = {k: v.add(out[k], alpha=-0.05) for k, v in params.items()}
    assert [n for n, ls in state.layers.items() if ls.ortho_momentum is not None] == ["0", "3"]
    back = kf.state_from_dict(kf.state_to_dict(state, include_decompositions=True), like=state)
    for n, ls in state.layers.items():
        if ls.ortho_momentum is None:
            assert back.layers[n].ortho_momentum is None
        else:
            assert torch.equal(back.layers[n].ortho_momentum, ls.ortho_momentum)
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


def test_wider_than_steps_the_wide_layers_and_leaves_the_rest_exact() -> None:
    """``wider_than=12``: the two layers with a 13-wide side (their A) take the one-sided
    orthogonalized step (their G diagonal), as on the functional path; the first layer
    (7 × 12) keeps Adam's step in its eigenbasis. Wider than every layer, the option
    leaves the eigenbasis-moment steps bit for bit."""
    wide = Orthogonal(powers=(0.5, 0.0), wider_than=12)
    model, ref = _model(), _model()
    pre = _adapter(model, orthogonal=wide)
    assert [pre.layers[n].diagonal for n in ("0", "3", "5")] == [
        (False, False),
        (False, True),
        (False, True),
    ]
    table = orthogonal_table(kf.register(ref), wide, others=True)
    state = kf.init(table, factor_dtype=F64, inv_dtype=F64)
    params = {k: v.detach().clone() for k, v in ref.named_parameters()}
    kw = {"kl_clip": None, "damping": 0.01, "eigenbasis_moments": True, "orthogonal": True}
    got = _train(model, pre, range(3))
    for step in range(3):
        x, y = _batch(step)
        _, grads, caps = kf.capture(ref, params, x, lambda o, y=y: F.cross_entropy(o, y))
        out, state = kf.update(
            state, grads, captures=caps, update_inverses=step % 2 == 0,
            ortho_powers=(0.5, 0.0), ortho_wider_than=12, **kw,
        )  # fmt: skip
        for n in out:
            torch.testing.assert_close(got[step][n], out[n], rtol=1e-12, atol=1e-15)
        params = {k: v.add(out[k], alpha=-0.05) for k, v in params.items()}
    assert [n for n, ls in state.layers.items() if ls.ortho_momentum is not None] == ["3", "5"]
    assert state.layers["0"].basis_moment is not None
    plain, narrow = _model(), _model()
    want = _train(plain, _adapter(plain, orthogonal=None), range(3))
    got = _train(narrow, _adapter(narrow, orthogonal=wide._replace(wider_than=13)), range(3))
    assert all(torch.equal(a[n], b[n]) for a, b in zip(want, got) for n in a)


ONE_SIDED = Orthogonal(powers=(0.5, 0.0), skip=HEAD_NAMES)
"""Muon's step on K-FAC's input curvature, the head left to AdamW: the two-sided recipe
made one-sided (what the retired recipe ``"orthogonal"`` was)."""


def test_recipes_of_the_optimizer_face() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Embedding(10, 8), nn.Flatten(), nn.Linear(16, 16), nn.LayerNorm(16), nn.ReLU(),
    )  # fmt: skip
    model.add_module("head", nn.Linear(16, 3))
    with pytest.raises(ValueError, match="recipe must be one of"):
        kf.KFAC(model, recipe="orthogonal")  # retired: it never led its family's race
    muon = kf.KFAC(model, recipe="orthogonal-two-sided", orthogonal=ONE_SIDED)
    pre = muon.preconditioner
    assert list(pre.layers) == ["2"]  # the hidden matrix; embedding, norm and head: AdamW
    assert pre.layers["2"].g_diagonal and set(pre.layers.skipped) >= {"0", "3", "head"}
    assert [type(o).__name__ for o in muon.optimizers] == ["SGD", "AdamW"]
    both = kf.KFAC(model, recipe="orthogonal-two-sided").preconditioner
    assert list(both.layers) == ["2"] and not both.layers["2"].g_diagonal
    head = kf.KFAC(model, recipe="orthogonal-kfac-head").preconditioner
    assert set(head.layers) == {"0", "2", "3", "head"}
    x, y = torch.randint(0, 10, (32, 2)), torch.randint(0, 3, (32,))
    losses = []
    for _ in range(30):
        muon.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        muon.step()
        losses.append(float(loss))
    assert losses[-1] < 0.5 * losses[0]
    assert pre.state.layers["2"].ortho_momentum is not None
    # the face's state dict carries the momentum: a resumed face steps as the first
    resumed = kf.KFAC(model, recipe="orthogonal-two-sided", orthogonal=ONE_SIDED)
    resumed.load_state_dict(muon.state_dict())
    assert torch.equal(
        resumed.preconditioner.state.layers["2"].ortho_momentum,
        pre.state.layers["2"].ortho_momentum,
    )


def test_refused_settings() -> None:
    with pytest.raises(ValueError, match="compute_method 'eigen'"):
        kf.KFACPreconditioner(
            _model(), compute_method="inverse", settings=kf.Settings(orthogonal=Orthogonal())
        )
    with pytest.raises(ValueError, match="ortho_powers"):
        kf.StepOptions(orthogonal=True, ortho_powers=(0.5, 2.0))
    with pytest.raises(ValueError, match="ortho_steps"):
        kf.StepOptions(orthogonal=True, ortho_steps=0)
    with pytest.raises(ValueError, match="ortho_beta"):
        kf.KFACPreconditioner(_model(), settings=kf.Settings(orthogonal=Orthogonal(beta=1.0)))
    state = kf.init(kf.register(_model()), compute_method="inverse")
    with pytest.raises(ValueError, match="compute_method 'eigen'"):
        kf.update(state, {}, update_factors=False, orthogonal=True)


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
        trained = _train(model, pre, range(4), rank)
        saved = pre.state_dict()  # the momenta gathered from their grad workers
        torch.save((trained, saved), Path(tmp, f"rank{rank}.pt"))


@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_ddp_two_ranks_equal_one_process(tmp_path: Path, fraction: float) -> None:
    from gloo import one_thread, spawn

    spawn(_worker, 2, tmp_path, fraction)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    with one_thread():
        model = _model()
        pre = _adapter(model)
        reference = _train(model, pre, range(4))
        one = pre.state_dict()
        marked = [n for n, ls in pre.state.layers.items() if ls.ortho_momentum is not None]
        assert marked == ["0", "3"]
    for step, want in enumerate(reference):
        for got, _ in ranks:
            err = max(float((got[step][n] - want[n]).abs().max()) for n in want)
            assert err < 1e-6, (fraction, step, err)
    kept = []  # each rank saves the momenta of the layers it preconditions
    for _, saved in ranks:
        layers = {k.removeprefix("module."): v for k, v in saved["layers"].items()}
        kept += [n for n in layers if "ortho_momentum" in layers[n]]
        for name in (n for n in ("0", "3") if "ortho_momentum" in layers[n]):
            torch.testing.assert_close(
                    layers[name]["ortho_momentum"], one["layers"][name]["ortho_momentum"],
                    rtol=1e-6, atol=1e-9,
                )  # fmt: skip
    assert set(kept) == {"0", "3"}


def test_every_holds_the_wide_layers_decompositions_between_its_multiples() -> None:
    """``every=3``: on steps that decompose every layer, the two wide layers keep their
    decomposition and powers (the same tensors) except on steps 0, 3, 6, while the narrow
    layer gets a new one each step; the distributed step on one rank holds the same
    layers and returns the same gradients."""
    wide = Orthogonal(powers=(0.5, 0.0), wider_than=12, every=3)
    model = _model()
    table = orthogonal_table(kf.register(model), wide, others=True)
    state = kf.init(table, factor_dtype=F64, inv_dtype=F64)
    dist = state
    plan = kf.distributed.make_plan(table, world_size=1)
    comm = kf.distributed.Communicator(plan)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    kw = {
        "kl_clip": None, "damping": 0.01, "eigenbasis_moments": True, "orthogonal": True,
        "ortho_powers": (0.5, 0.0), "ortho_wider_than": 12, "ortho_every": 3,
    }  # fmt: skip
    for step in range(7):
        x, y = _batch(step)
        _, grads, caps = kf.capture(model, params, x, lambda o, y=y: F.cross_entropy(o, y))
        old = state.layers
        out, state = kf.update(state, grads, captures=caps, **kw)
        got, dist = kf.distributed.update_distributed(
            dist, grads, captures=caps, plan=plan, comm=comm, **kw
        )
        for n in out:
            torch.testing.assert_close(got[n], out[n], rtol=1e-12, atol=1e-15)
        kept = {n for n, ls in state.layers.items() if ls.decomposition is old[n].decomposition}
        assert kept == (set() if step % 3 == 0 else {"3", "5"}), step
        if step:  # the powers go with the decompositions
            assert all(
                (state.layers[n].ortho_power is old[n].ortho_power) == (n in kept)
                for n in ("3", "5")
            )
        params = {k: v.add(out[k], alpha=-0.05) for k, v in params.items()}
    with pytest.raises(ValueError, match="ortho_every must be a positive int"):
        kf.StepOptions(orthogonal=True, ortho_every=0).orthogonal_settings("eigen")
    pre = _adapter(_model(), orthogonal=wide)  # the adapter hands the setting to its step
    assert pre._step_options().ortho_every == 3
    assert "their powers renewed at most every 3 steps: 2 layers here" in describe_step(pre)
