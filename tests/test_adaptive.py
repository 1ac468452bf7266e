"""The adaptive step: exact curvature products, the 2×2 model, Levenberg–Marquardt damping.

Oracles are dense: the Jacobian of the outputs with respect to the flattened parameters
(``torch.func.jacrev``) and the Hessian of the loss with respect to the outputs
(``torch.func.hessian``) give the Gauss–Newton matrix, from which the quadratic model,
its minimiser and its value are computed directly, in float64.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import optree
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

import kfac_func as kf
from kfac_func.adapter.adaptive import AdaptiveStepper
from kfac_func.checkpoint.state_format import META_KEY
from kfac_func.core.output_hessian import cross_entropy_hvp, loss_hvp, mse_hvp

Params = dict[str, torch.Tensor]
DT = torch.float64


# --------------------------------------------------------------------------- helpers


def _mlp(d_in: int = 3, hidden: int = 5, d_out: int = 4, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d_in, hidden), nn.Tanh(), nn.Linear(hidden, d_out)).to(DT)


def _params(model: nn.Module) -> Params:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _flat(tensors: Params, names: list[str]) -> torch.Tensor:
    return torch.cat([tensors[k].reshape(-1) for k in names])


def _random_like(params: Params, seed: int) -> Params:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(p.shape, generator=g, dtype=DT) for k, p in params.items()}


def _dense(
    model: nn.Module,
    params: Params,
    x: torch.Tensor,
    loss_of_outputs: Callable[[torch.Tensor], torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """The dense Gauss–Newton matrix ``JᵀHJ`` and the gradient, over flattened parameters."""
    names = list(params)
    sizes = [params[k].numel() for k in names]

    def unflat(flat: torch.Tensor) -> Params:
        return {k: t.reshape(params[k].shape) for k, t in zip(names, flat.split(sizes))}

    def outputs(flat: torch.Tensor) -> torch.Tensor:
        return functional_call(model, unflat(flat), (x,))

    theta = _flat(params, names)
    y = outputs(theta)
    jac = torch.func.jacrev(outputs)(theta).reshape(y.numel(), theta.numel())
    hess = torch.func.hessian(lambda out: loss_of_outputs(out.reshape(y.shape)))(y.reshape(-1))
    grad = torch.func.grad(lambda t: loss_of_outputs(outputs(t)))(theta)
    return jac.T @ hess @ jac, grad, names


def _gram(vectors: list[torch.Tensor], matrix: torch.Tensor) -> torch.Tensor:
    v = torch.stack(vectors, dim=1)
    return v.T @ matrix @ v


# --------------------------------------------------------------------------- (a) curvature


def _ce(t: torch.Tensor, reduction: str = "mean") -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda out: F.cross_entropy(
        out.reshape(-1, out.shape[-1]), t.reshape(-1), reduction=reduction
    )


CASES: dict[str, tuple[Any, str, Callable[..., Callable[[torch.Tensor], torch.Tensor]]]] = {
    "ce-mean": ("cross_entropy", "mean", lambda t: _ce(t)),
    "ce-sum": ("cross_entropy", "sum", lambda t: _ce(t, "sum")),
    "mse-mean": ("mse", "mean", lambda y: lambda out: F.mse_loss(out, y)),
    "mse-sum": ("mse", "sum", lambda y: lambda out: F.mse_loss(out, y, reduction="sum")),
    "generic": (None, "mean", lambda t: _ce(t)),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("positions", [False, True])
def test_curvature_gram_matches_dense_ggn(case: str, positions: bool) -> None:
    kind, reduction, make = CASES[case]
    model = _mlp()
    params = _params(model)
    g = torch.Generator().manual_seed(1)
    shape = (6, 3, 3) if positions else (6, 3)  # (batch, positions, features)
    x = torch.randn(shape, generator=g, dtype=DT)
    out_shape = (*shape[:-1], 4)
    targets = (
        torch.randint(0, 4, out_shape[:-1], generator=g)
        if case.startswith("ce") or case == "generic"
        else torch.randn(out_shape, generator=g, dtype=DT)
    )
    loss_fn = make(targets)
    loss = loss_fn if kind is None else kind
    v, w = _random_like(params, 2), _random_like(params, 3)
    got = kf.step.curvature_gram(model, params, x, [v, w], loss=loss, loss_reduction=reduction)
    ggn, _, names = _dense(model, params, x, loss_fn)
    want = _gram([_flat(v, names), _flat(w, names)], ggn)
    assert got.dtype == DT and got.shape == (2, 2)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


class _Attention(nn.Module):
    """Causal self-attention through ``F.scaled_dot_product_attention``, whose fused CPU
    kernel has no forward-mode derivative."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(4)
        self.qkv = nn.Linear(4, 12).to(DT)
        self.head = nn.Linear(4, 5).to(DT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return self.head(F.scaled_dot_product_attention(q, k, v, is_causal=True))


def test_curvature_gram_through_attention() -> None:
    model = _Attention()
    params = _params(model)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 6, 4, generator=g, dtype=DT)
    loss_fn = _ce(torch.randint(0, 5, (3, 6), generator=g))
    v, w = _random_like(params, 6), _random_like(params, 7)
    got = kf.step.curvature_gram(model, params, x, [v, w])
    ggn, _, names = _dense(model, params, x, loss_fn)
    want = _gram([_flat(v, names), _flat(w, names)], ggn)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_output_hvps_match_dense_hessians() -> None:
    g = torch.Generator().manual_seed(4)
    y = torch.randn(5, 2, 3, generator=g, dtype=DT)
    v = torch.randn(5, 2, 3, generator=g, dtype=DT)
    t = torch.randint(0, 3, (5, 2), generator=g)
    cases: list[tuple[Callable[..., torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]] = [
        (lambda y, v: cross_entropy_hvp(y, v), _ce(t)),
        (
            lambda y, v: mse_hvp(y, v, reduction="sum"),
            lambda o: F.mse_loss(o, y * 0, reduction="sum"),
        ),
        (lambda y, v: loss_hvp(_ce(t), y, v), _ce(t)),
    ]
    for hvp, fn in cases:
        hess = torch.func.hessian(lambda flat, fn=fn: fn(flat.reshape(y.shape)))(y.reshape(-1))
        torch.testing.assert_close(
            hvp(y, v).reshape(-1), hess @ v.reshape(-1), rtol=1e-12, atol=1e-12
        )


# --------------------------------------------------------------------------- (b), (c) the model


def _problem(
    previous: bool = True, seed: int = 0
) -> tuple[nn.Module, Params, torch.Tensor, Callable[[torch.Tensor], torch.Tensor], kf.KFACState]:
    model = _mlp(seed=seed)
    params = _params(model)
    g = torch.Generator().manual_seed(10 + seed)
    x = torch.randn(7, 3, generator=g, dtype=DT)
    t = torch.randint(0, 4, (7,), generator=g)
    state = kf.step.init_adaptive(kf.init(kf.register(model), factor_dtype=DT), damping=0.3)
    if previous:
        delta = {k: 0.1 * d for k, d in _random_like(params, 20 + seed).items()}
        state = state.replace(adaptive=state.adaptive.replace(previous=delta))
    return model, params, x, _ce(t), state


def _model_value(ggn: torch.Tensor, grad: torch.Tensor, lam: float, x: torch.Tensor) -> float:
    return float(0.5 * x @ (ggn @ x + lam * x) + grad @ x)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_alpha_mu_minimise_the_dense_quadratic_model(seed: int) -> None:
    model, params, x, loss_fn, state = _problem(seed=seed)
    ggn, grad, names = _dense(model, params, x, loss_fn)
    sizes = [params[k].numel() for k in names]
    grads = {k: t.reshape(params[k].shape) for k, t in zip(names, grad.split(sizes))}
    directions = _random_like(params, 30 + seed)
    updates, new, info = kf.step.adaptive_step(
        state, params, grads, directions, model=model, args=x, loss="cross_entropy", l2_reg=0.05
    )
    lam = 0.3 + 0.05
    v1 = -_flat(directions, names)
    v2 = _flat(state.adaptive.previous, names)
    damped = ggn + lam * torch.eye(len(grad), dtype=DT)
    q = _gram([v1, v2], damped)
    b = torch.stack([grad @ v1, grad @ v2])
    alpha, mu = torch.linalg.solve(q, -b).tolist()
    assert info.method == "alpha_mu" and info.damping == lam
    assert math.isclose(info.alpha, alpha, rel_tol=1e-9) and math.isclose(info.mu, mu, rel_tol=1e-9)
    torch.testing.assert_close(info.q, q, rtol=1e-10, atol=1e-12)
    # the update is α·(−Δ) + μ·δ, and the model's value there is the predicted change
    xs = _flat(updates, names)
    torch.testing.assert_close(xs, alpha * v1 + mu * v2, rtol=1e-9, atol=1e-12)
    best = _model_value(ggn, grad, lam, xs)
    assert math.isclose(info.predicted, best, rel_tol=1e-9) and best < 0
    for da in (-1e-3, 0.0, 1e-3):
        for dm in (-1e-3, 0.0, 1e-3):
            if da or dm:
                other = (alpha + da) * v1 + (mu + dm) * v2
                assert _model_value(ggn, grad, lam, other) > best
    # the state keeps the update as the next δ, and the coefficients
    ad = new.adaptive
    assert ad.steps == 1 and ad.alpha == info.alpha and ad.mu == info.mu
    assert all(torch.equal(ad.previous[k], updates[k]) for k in names)
    assert ad.damping == 0.3


def test_first_step_solves_alpha_only() -> None:
    model, params, x, loss_fn, state = _problem(previous=False)
    ggn, grad, names = _dense(model, params, x, loss_fn)
    sizes = [params[k].numel() for k in names]
    grads = {k: t.reshape(params[k].shape) for k, t in zip(names, grad.split(sizes))}
    directions = _random_like(params, 5)
    updates, _, info = kf.step.adaptive_step(state, params, grads, directions, model=model, args=x)
    v1 = -_flat(directions, names)
    q11 = float(v1 @ (ggn @ v1) + 0.3 * v1 @ v1)
    alpha = -float(grad @ v1) / q11
    assert info.method == "alpha" and info.mu == 0.0 and info.q.shape == (1, 1)
    assert math.isclose(info.alpha, alpha, rel_tol=1e-10)
    assert math.isclose(info.predicted, _model_value(ggn, grad, 0.3, alpha * v1), rel_tol=1e-10)
    torch.testing.assert_close(_flat(updates, names), alpha * v1)


def test_parallel_previous_update_falls_back_to_alpha() -> None:
    model, params, x, loss_fn, state = _problem(previous=False)
    _, grads, _ = kf.capture(model, params, x, loss_fn)
    directions = _random_like(params, 6)
    parallel = {k: -2.0 * d for k, d in directions.items()}
    state = state.replace(adaptive=state.adaptive.replace(previous=parallel))
    _, _, info = kf.step.adaptive_step(state, params, grads, directions, model=model, args=x)
    assert info.method == "alpha" and info.mu == 0.0 and info.predicted < 0


def test_solve_quadratic_fallbacks() -> None:
    assert (
        kf.core.solve_quadratic([[1.0, 2.0], [2.0, 1.0]], [-1.0, 0.0]).method == "alpha"
    )  # indefinite
    assert (
        kf.core.solve_quadratic([[1.0, 1.0], [1.0, 1.0]], [-1.0, -1.0]).method == "alpha"
    )  # singular
    assert kf.core.solve_quadratic([[0.0, 0.0], [0.0, 0.0]], [0.0, 0.0]) == (0.0, 0.0, 0.0, "none")
    assert kf.core.solve_quadratic([[math.nan, 0.0], [0.0, 1.0]], [1.0, 0.0]).method == "nonfinite"
    s = kf.core.solve_quadratic(torch.tensor([[4.0]]), torch.tensor([-2.0]))
    assert (s.alpha, s.mu, s.predicted, s.method) == (0.5, 0.0, -0.5, "alpha")


def test_nonfinite_model_skips_or_raises() -> None:
    model, params, x, loss_fn, state = _problem()
    _, grads, _ = kf.capture(model, params, x, loss_fn)
    directions = _random_like(params, 7)
    directions["0.weight"][0, 0] = math.nan
    with pytest.warns(RuntimeWarning, match="non-finite"):
        updates, _, info = kf.step.adaptive_step(
            state, params, grads, directions, model=model, args=x
        )
    assert info.method == "nonfinite" and all(not u.any() for u in updates.values())
    with pytest.raises(kf.NonFiniteError):
        kf.step.adaptive_step(
            state, params, grads, directions, model=model, args=x, nonfinite="raise"
        )


# --------------------------------------------------------------------------- (d) damping


def test_lm_rule() -> None:
    w = 0.95**5
    assert kf.core.lm_damping(1.0, 0.8, omega=w) == w
    assert kf.core.lm_damping(1.0, 0.2, omega=w) == 1.0 / w
    assert kf.core.lm_damping(1.0, 0.5, omega=w) == 1.0
    assert kf.core.lm_damping(1.0, None, omega=w) == 1.0
    assert kf.core.lm_damping(1.0, math.nan, omega=w) == 1.0 / w
    assert kf.core.lm_damping(1.0, 0.9, omega=0.5, min_damping=0.8) == 0.8
    assert kf.core.lm_damping(1.0, -3.0, omega=0.5, max_damping=1.2) == 1.2


def _after_step(state: kf.KFACState, steps: int, predicted: float = -1.0) -> kf.KFACState:
    ad = state.adaptive.replace(steps=steps, predicted=predicted, alpha=1.0, mu=0.0)
    return state.replace(adaptive=ad)


def test_adapt_damping_every_interval_steps() -> None:
    state = kf.step.init_adaptive(kf.init(kf.register(nn.Linear(2, 2))), damping=1.0)
    w = 0.95**5
    dampings = []
    for step in range(1, 11):
        state = _after_step(state, step)
        due = kf.step.damping_due(state, interval=5)
        assert due == (step % 5 == 0)
        state = kf.step.adapt_damping(state, 0.1, 1.0, interval=5)  # ρ = 0.9: shrink when due
        assert state.adaptive.rho == pytest.approx(0.9)
        dampings.append(state.adaptive.damping)
    assert dampings == [1.0] * 4 + [w] * 5 + [w * w]
    # ρ < 1/4 grows, the new loss may be left out when no adaptation is due
    state = kf.step.adapt_damping(_after_step(state, 11), None, None, interval=5)
    state = kf.step.adapt_damping(_after_step(state, 15), 0.9, 1.0, interval=5)  # ρ = 0.1
    assert state.adaptive.damping == pytest.approx(w)
    # clamping at both ends
    low = kf.step.adapt_damping(_after_step(state, 20), 0.0, 1.0, interval=5, min_damping=0.9)
    assert low.adaptive.damping == 0.9
    high = kf.step.adapt_damping(_after_step(state, 20), 5.0, 1.0, interval=5, max_damping=0.8)
    assert high.adaptive.damping == 0.8
    # a non-finite new loss is a failed step
    bad = kf.step.adapt_damping(_after_step(state, 20), math.inf, 1.0, interval=5)
    assert bad.adaptive.rho == -math.inf and bad.adaptive.damping == pytest.approx(1.0)
    # history: bounded, the latest last
    assert len(state.adaptive.history) == 12
    assert state.adaptive.history[-1] == kf.state.AdaptiveRecord(
        15, state.adaptive.damping, 1.0, 0.0, -1.0, pytest.approx(0.1)
    )
    with pytest.raises(ValueError, match="new_loss"):
        kf.step.adapt_damping(_after_step(state, 25), None, 1.0, interval=5)
    with pytest.raises(ValueError, match="already called"):
        kf.step.adapt_damping(state, 0.5, 1.0, interval=5)


# --------------------------------------------------------------------------- (e) checkpoints


def _trained(steps: int = 3) -> tuple[nn.Module, kf.KFACState]:
    model = _mlp(seed=3)
    g = torch.Generator().manual_seed(3)
    x, t = torch.randn(16, 3, generator=g, dtype=DT), torch.randint(0, 4, (16,), generator=g)
    params = _params(model)
    state = kf.step.init_adaptive(
        kf.init(kf.register(model), factor_dtype=DT, inv_dtype=DT), damping=1.0
    )
    for _ in range(steps):
        params, state, _ = _loop_step(model, params, state, x, _ce(t), "cross_entropy", 1)
    return model, state


def _same_adaptive(a: kf.state.AdaptiveState | None, b: kf.state.AdaptiveState | None) -> None:
    assert a is not None and b is not None
    for f in dataclasses.fields(a):
        if f.name != "previous":
            assert getattr(a, f.name) == getattr(b, f.name), f.name
    assert (a.previous is None) == (b.previous is None)
    if a.previous is not None and b.previous is not None:
        assert list(a.previous) == list(b.previous)
        for k in a.previous:
            assert torch.equal(a.previous[k], b.previous[k])
            assert a.previous[k].dtype == b.previous[k].dtype


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_round_trip_is_exact(tmp_path: Path, suffix: str) -> None:
    model, state = _trained()
    ad = state.adaptive
    assert (
        ad is not None and ad.previous is not None and len(ad.history) == 3 and ad.rho is not None
    )
    ad = ad.replace(rho=-math.inf, mu=None)  # numbers that JSON has no plain literal for
    state = state.replace(adaptive=ad)
    like = kf.init(kf.register(model), factor_dtype=DT, inv_dtype=DT)
    d = kf.state_to_dict(state)
    assert {f"adaptive.previous.{k}" for k in ad.previous} <= set(d)
    buf = io.BytesIO()
    torch.save(d, buf)
    buf.seek(0)
    _same_adaptive(kf.state_from_dict(torch.load(buf, weights_only=True), like=like).adaptive, ad)
    kf.save_state(state, tmp_path / f"s{suffix}")
    _same_adaptive(kf.load_state(tmp_path / f"s{suffix}", like=like).adaptive, ad)
    # pytrees: the previous update is data, the numbers static
    paths = optree.tree_paths(state)
    assert ("adaptive", "previous", "0.weight") in paths
    doubled = optree.tree_map(lambda t: 2 * t, state)
    assert doubled.adaptive.damping == ad.damping
    assert torch.equal(doubled.adaptive.previous["0.weight"], 2 * ad.previous["0.weight"])


def test_old_format_without_adaptive_part_loads() -> None:
    model, state = _trained(1)
    d = {k: v for k, v in kf.state_to_dict(state).items() if not k.startswith("adaptive.")}
    meta = json.loads(bytes(d[META_KEY].tolist()).decode())
    del meta["adaptive"]
    d[META_KEY] = torch.tensor(list(json.dumps(meta).encode()), dtype=torch.uint8)
    like = kf.init(kf.register(model), factor_dtype=DT, inv_dtype=DT)
    loaded = kf.state_from_dict(d, like=like)
    assert loaded.adaptive is None and loaded.step == state.step
    assert torch.equal(loaded.layers["0"].a_factor, state.layers["0"].a_factor)
    fresh = kf.step.init_adaptive(like, damping=0.5)
    assert kf.state_from_dict(d, like=fresh).adaptive == fresh.adaptive
    # a state without an adaptive part round-trips to none
    plain = kf.state_from_dict(kf.state_to_dict(state.replace(adaptive=None)), like=like)
    assert plain.adaptive is None


def test_malformed_adaptive_metadata_is_refused() -> None:
    model, state = _trained(1)
    d = kf.state_to_dict(state)
    meta = json.loads(bytes(d[META_KEY].tolist()).decode())
    meta["adaptive"]["damping"] = "high"
    d[META_KEY] = torch.tensor(list(json.dumps(meta).encode()), dtype=torch.uint8)
    with pytest.raises(kf.checkpoint.CheckpointFormatError, match="damping"):
        kf.state_from_dict(d, like=kf.init(kf.register(model), factor_dtype=DT, inv_dtype=DT))


# --------------------------------------------------------------------------- (f) end to end


def _loop_step(
    model: nn.Module,
    params: Params,
    state: kf.KFACState,
    x: torch.Tensor,
    loss_fn: Callable[[torch.Tensor], torch.Tensor],
    loss: str,
    interval: int,
) -> tuple[Params, kf.KFACState, float]:
    """The functional loop of kfac_func.step.adaptive's docstring."""
    old, grads, caps = kf.capture(model, params, x, loss_fn)
    directions, state = kf.update(
        state, grads, captures=caps, damping=state.adaptive.damping, kl_clip=None
    )
    updates, state, _ = kf.step.adaptive_step(
        state, params, grads, directions, model=model, args=x, loss=loss
    )
    params = {k: p + updates[k] for k, p in params.items()}
    new = loss_fn(functional_call(model, params, (x,)))
    state = kf.step.adapt_damping(state, new, old, interval=interval)
    return params, state, float(old)


def test_classification_loss_decreases_and_damping_moves() -> None:
    model = _mlp(d_in=4, hidden=8, d_out=3, seed=5)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(64, 4, generator=g, dtype=DT)
    t = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    params = _params(model)
    state = kf.step.init_adaptive(
        kf.init(kf.register(model), factor_dtype=DT, inv_dtype=DT), damping=1.0
    )
    losses = []
    for _ in range(15):
        params, state, loss = _loop_step(model, params, state, x, _ce(t), "cross_entropy", 5)
        losses.append(loss)
    final = float(_ce(t)(functional_call(model, params, (x,))))
    assert final < 0.6 * losses[0]
    ad = state.adaptive
    assert ad.steps == 15 and ad.damping != 1.0
    assert [r.steps for r in ad.history] == list(range(1, 16))
    assert all(r.rho is not None and math.isfinite(r.rho) for r in ad.history)
    assert any(r.mu != 0.0 for r in ad.history)  # momentum was used


def test_stepper_regression_in_place() -> None:
    torch.manual_seed(6)
    model = nn.Sequential(nn.Linear(2, 16), nn.Tanh(), nn.Linear(16, 1)).to(DT)
    x = torch.linspace(-2, 2, 40, dtype=DT).reshape(20, 2)
    y = torch.sin(x.sum(dim=1, keepdim=True))
    loss_fn = lambda out: F.mse_loss(out, y)  # noqa: E731
    state = kf.step.init_adaptive(
        kf.init(kf.register(model), factor_dtype=DT, inv_dtype=DT), damping=10.0
    )
    stepper = AdaptiveStepper(model, loss="mse", interval=2, min_damping=1e-4)
    calls = 0

    def closure() -> torch.Tensor:
        nonlocal calls
        calls += 1
        return loss_fn(model(x))

    first = float(loss_fn(model(x)).detach())
    for _ in range(10):
        params = dict(model.named_parameters())
        old, grads, caps = kf.capture(model, params, x, loss_fn)
        directions, state = kf.update(
            state, grads, captures=caps, damping=state.adaptive.damping, kl_clip=None
        )
        state, _ = stepper.step(
            state, grads, directions, args=x, loss_closure=closure, old_loss=old
        )
    assert calls == 5  # the closure runs only when the damping is due
    assert float(loss_fn(model(x)).detach()) < 0.5 * first
    assert state.adaptive.damping < 10.0


# --------------------------------------------------------------------------- (g) bad input


def test_bad_input_names_the_argument() -> None:
    model, params, x, loss_fn, state = _problem()
    _, grads, _ = kf.capture(model, params, x, loss_fn)
    directions = _random_like(params, 8)
    with pytest.raises(ValueError, match="damping"):
        kf.step.init_adaptive(state, damping=-1.0)
    with pytest.raises(ValueError, match="damping"):
        kf.core.lm_damping(-1.0, 0.5, omega=0.5)
    with pytest.raises(ValueError, match="omega"):
        kf.core.lm_damping(1.0, 0.5, omega=1.5)
    after = _after_step(state, 1)
    with pytest.raises(ValueError, match="interval"):
        kf.step.adapt_damping(after, 0.1, 1.0, interval=0)
    with pytest.raises(ValueError, match="interval"):
        kf.step.damping_due(after, interval=0)
    with pytest.raises(ValueError, match="min_damping"):
        kf.step.adapt_damping(after, 0.1, 1.0, min_damping=2.0, max_damping=1.0)
    with pytest.raises(ValueError, match="damping_decay"):
        kf.step.adapt_damping(after, 0.1, 1.0, damping_decay=1.5)
    with pytest.raises(ValueError, match="adaptive_step"):
        kf.step.adapt_damping(state, 0.1, 1.0)
    with pytest.raises(ValueError, match="new_loss must be a scalar"):
        kf.step.adapt_damping(after, torch.zeros(2), 1.0)
    missing = {k: v for k, v in directions.items() if k != "2.bias"}
    with pytest.raises(ValueError, match=r"directions must have the keys of params.*2\.bias"):
        kf.step.adaptive_step(state, params, grads, missing, model=model, args=x)
    with pytest.raises(ValueError, match="grads"):
        kf.step.adaptive_step(
            state, params, {**grads, "extra": torch.zeros(1)}, directions, model=model, args=x
        )
    wrong = {**directions, "0.weight": directions["0.weight"].T}
    with pytest.raises(ValueError, match="directions: shapes"):
        kf.step.adaptive_step(state, params, grads, wrong, model=model, args=x)
    with pytest.raises(ValueError, match="l2_reg"):
        kf.step.adaptive_step(state, params, grads, directions, model=model, args=x, l2_reg=-1.0)
    with pytest.raises(ValueError, match="loss"):
        kf.step.adaptive_step(state, params, grads, directions, model=model, args=x, loss="hinge")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="init_adaptive"):
        kf.step.adaptive_step(
            state.replace(adaptive=None), params, grads, directions, model=model, args=x
        )


# --------------------------------------------------------------------------- the adapter


def _adaptive_pre(model: nn.Module, interval: int = 2) -> kf.KFACPreconditioner:
    return kf.KFACPreconditioner(
        model,
        settings=kf.Settings(
            scaling="fisher",
            adaptive=AdaptiveStepper(model, loss="cross_entropy", interval=interval),
        ),
        factor_dtype=DT,
        inv_dtype=DT,
        damping=1.0,
        kl_clip=None,
    )


def _adapter_steps(
    model: nn.Module, pre: kf.KFACPreconditioner, batches: range
) -> list[tuple[Params, float]]:
    out = []
    for k in batches:
        g = torch.Generator().manual_seed(k)
        x, t = torch.randn(16, 3, generator=g, dtype=DT), torch.randint(0, 4, (16,), generator=g)
        model.zero_grad()
        loss = F.cross_entropy(model(x), t)
        loss.backward()
        pre.step(inputs=x, loss=loss, loss_closure=lambda x=x, t=t: F.cross_entropy(model(x), t))
        assert pre.state.adaptive is not None
        out.append((_params(model), pre.state.adaptive.damping))
    return out


def test_adapter_equals_the_functional_loop_and_resumes() -> None:
    """``step(inputs=, loss=, loss_closure=)`` updates the parameters as the functional
    loop does (the closure called only when the damping is due); a state dict resumes it."""
    model, ref = _mlp(seed=7), _mlp(seed=7)
    pre = _adaptive_pre(model)
    got = _adapter_steps(model, pre, range(4))
    params = _params(ref)
    state = kf.step.init_adaptive(
        kf.init(kf.register(ref), factor_dtype=DT, inv_dtype=DT), damping=1.0
    )
    for k in range(4):
        g = torch.Generator().manual_seed(k)
        x, t = torch.randn(16, 3, generator=g, dtype=DT), torch.randint(0, 4, (16,), generator=g)
        params, state, _ = _loop_step(ref, params, state, x, _ce(t), "cross_entropy", 2)
        for n in params:
            torch.testing.assert_close(got[k][0][n], params[n], rtol=1e-10, atol=1e-12)
        assert got[k][1] == pytest.approx(state.adaptive.damping, rel=1e-10)
    assert state.adaptive.damping != 1.0
    saved = pre.state_dict()
    again = _mlp(seed=7)
    again.load_state_dict(model.state_dict())
    resumed = _adaptive_pre(again)
    resumed.load_state_dict(saved)
    want = _adapter_steps(model, pre, range(4, 7))
    for (a, da), (b, db) in zip(want, _adapter_steps(again, resumed, range(4, 7))):
        assert da == db
        for n in a:
            torch.testing.assert_close(a[n], b[n], rtol=1e-12, atol=1e-15)
    with pytest.raises(ValueError, match="adaptive part"):
        kf.KFACPreconditioner(
            _mlp(),
            kl_clip=None,
            settings=kf.Settings(scaling="fisher"),
            factor_dtype=DT,
            inv_dtype=DT,
        ).load_state_dict(saved)
    with pytest.raises(ValueError, match="scaling='fisher' in the state_dict"):
        kf.KFACPreconditioner(_mlp(), kl_clip=None).load_state_dict(saved)


def test_adapter_refuses_inconsistent_adaptive_settings() -> None:
    model = _mlp()
    with pytest.raises(ValueError, match="kl_clip=None"):
        kf.KFACPreconditioner(model, settings=kf.Settings(adaptive=AdaptiveStepper(model)))
    with pytest.raises(ValueError, match="same model"):
        kf.KFACPreconditioner(
            model, kl_clip=None, settings=kf.Settings(adaptive=AdaptiveStepper(_mlp()))
        )
    pre = _adaptive_pre(model)
    F.cross_entropy(model(torch.randn(4, 3, dtype=DT)), torch.zeros(4, dtype=torch.long)).backward()
    with pytest.raises(ValueError, match="loss_closure"):
        pre.step(inputs=torch.randn(4, 3, dtype=DT), loss=1.0)
    plain = kf.KFACPreconditioner(model, kl_clip=None)
    with pytest.raises(ValueError, match="need adaptive="):
        plain.step(inputs=torch.randn(4, 3, dtype=DT))
