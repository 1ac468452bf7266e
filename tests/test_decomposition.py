"""Decompositions that fail: retries in float64 and with jitter, and what the step does
when every retry fails (the layer keeps its previous decomposition, training goes on)."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kfac_func as kf
from kfac_func.core.attempts import DecompositionError, condition_estimate
from kfac_func.core.decomposition import damped_inverse, eigh_factor, refresh_eigh
from kfac_func.core.layer_decomposition import eigen_decompose, inverse_decompose
from kfac_func.core.preconditioning import precondition

_EIGH = torch.linalg.eigh
_INV = torch.linalg.inv


def _spd(n: int, seed: int = 0, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2 * n, n, generator=g, dtype=dtype)
    return x.T @ x / (2 * n)


@contextmanager
def _failing(
    monkeypatch: pytest.MonkeyPatch, name: str, fails: Callable[[torch.Tensor, int], bool]
) -> Iterator[list[torch.dtype]]:
    """Make ``torch.linalg.<name>`` raise when ``fails(input, call_index)``; yields the
    dtypes of all calls."""
    real = {"eigh": _EIGH, "inv": _INV}[name]
    calls: list[torch.dtype] = []

    def fake(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        calls.append(x.dtype)
        if fails(x, len(calls) - 1):
            raise torch.linalg.LinAlgError(f"linalg.{name}: injected failure")
        return real(x, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(torch.linalg, name, fake)
        yield calls


def test_eigh_retries_in_float64(monkeypatch: pytest.MonkeyPatch, device: torch.device) -> None:
    f = _spd(6, dtype=torch.float32).to(device)
    with _failing(monkeypatch, "eigh", lambda x, i: x.dtype == torch.float32) as calls:
        q, d = eigh_factor(f, dtype=torch.float32)
    assert calls == [torch.float32, torch.float64]
    d64 = _EIGH(f.double())[0]
    assert q.dtype == d.dtype == torch.float32
    assert q.device == d.device == f.device
    torch.testing.assert_close(d, d64.float())
    torch.testing.assert_close(q @ torch.diag(d) @ q.T, f, rtol=1e-5, atol=1e-6)


def test_eigh_retries_with_jitter_and_removes_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first two attempts (float32, float64) fail; the jittered one's eigenvalues are
    shifted back, so the reconstruction is the factor to float64 accuracy."""
    f = _spd(6)
    with _failing(monkeypatch, "eigh", lambda x, i: i < 1) as calls:
        q, d = eigh_factor(f, dtype=torch.float64)
    assert calls == [torch.float64, torch.float64]  # float64 itself, then with jitter
    torch.testing.assert_close(q @ torch.diag(d) @ q.T, f, rtol=0, atol=1e-12)
    torch.testing.assert_close(d, _EIGH(f)[0].clamp(min=0), rtol=0, atol=1e-12)


def test_real_singular_inverse_is_retried_with_jitter(device: torch.device) -> None:
    """A genuinely singular factor with zero damping: inv raises in float32 and float64;
    the jittered retry returns a finite inverse of ``F + εI``."""
    f = torch.zeros(3, 3, device=device)
    f[0, 0] = 2.0
    with pytest.raises(torch.linalg.LinAlgError):
        _INV(f)
    inv = damped_inverse(f, 0.0, dtype=torch.float32)
    assert torch.isfinite(inv).all() and inv.device == f.device
    jitter = 1e-10 * float(f.diagonal().abs().mean())
    expected = _INV(f.double() + jitter * torch.eye(3, dtype=torch.float64, device=device))
    torch.testing.assert_close(inv, expected.float())


def test_every_attempt_failing_names_factor_attempts_and_condition(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    a, g = _spd(4, seed=1, dtype=torch.float32), _spd(3, seed=2, dtype=torch.float32)
    with (
        _failing(monkeypatch, "eigh", lambda x, i: x.shape[-1] == 3) as calls,
        pytest.raises(DecompositionError) as err,
    ):
        eigen_decompose(a, g, 1e-3)
    msg = str(err.value)
    assert msg.startswith("the G factor: eigh failed (float32: linalg.eigh: injected failure; ")
    assert "float64 + " in msg and "condition estimate " in msg
    assert f"{condition_estimate(g):.3g}" in msg
    assert calls.count(torch.float64) == 3  # float64, then two jitters


@pytest.mark.parametrize("fail", [None, "A", "G"])
def test_a_layers_two_factors_are_checked_together_each_attempt_made_once(
    monkeypatch: pytest.MonkeyPatch, fail: str | None
) -> None:
    """A layer's two dense factors: their first attempts are made once each and read
    together; where one raised, that one alone is retried (in float64), from its own
    outcome, and the other keeps its first attempt, bit for bit the one-factor results."""
    a, g = _spd(5, seed=1, dtype=torch.float32), _spd(3, seed=2, dtype=torch.float32)
    side = {"A": 5, "G": 3}.get(fail or "", 0)
    expected = [eigh_factor(f, dtype=torch.float32) for f in (a, g)]
    with _failing(monkeypatch, "eigh", lambda x, i: i < 2 and x.shape[-1] == side) as calls:
        eig = eigen_decompose(a, g, 1e-3, outer_product=True)
    assert calls == [torch.float32] * 2 + [torch.float64] * (fail is not None)
    got = [(eig.qa, eig.da), (eig.qg, eig.dg)]
    for name, (q, d), (q_ref, d_ref) in zip("AG", got, expected):
        if name == fail:  # the float64 retry, rounded to float32
            torch.testing.assert_close(q.abs(), q_ref.abs(), rtol=0, atol=1e-5)
            torch.testing.assert_close(d, d_ref, rtol=1e-5, atol=1e-6)
        else:
            assert torch.equal(q, q_ref) and torch.equal(d, d_ref)
    with _failing(monkeypatch, "inv", lambda x, i: i == 1) as inv_calls:
        inv = inverse_decompose(a, g, 1e-3)
    assert inv_calls == [torch.float32, torch.float32, torch.float64]
    assert torch.equal(inv.a_inv, damped_inverse(a, 1e-3, dtype=torch.float32))
    torch.testing.assert_close(inv.g_inv, damped_inverse(g, 1e-3, dtype=torch.float32))
    assert inv.a_inv.is_contiguous() and inv.g_inv.is_contiguous()


def test_eigh_results_whose_sum_overflows_are_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """eigh's results are checked by the sum of their sums first; a sum that overflows
    with every entry finite goes to the exact checks, which keep the first attempt."""
    f = torch.diag(torch.tensor([3e38, 2e38, 1.0]))  # finite; its sum overflows float32
    with _failing(monkeypatch, "eigh", lambda x, i: False) as calls:
        q, d = eigh_factor(f, dtype=torch.float32)
    assert calls == [torch.float32]  # no retry
    torch.testing.assert_close(d, torch.tensor([1.0, 2e38, 3e38]), rtol=1e-6, atol=0)
    assert torch.equal(q.abs(), torch.eye(3).flip(1))


@pytest.mark.parametrize("raises", [False, True], ids=["nan-result", "solver-error"])
def test_nonfinite_factor_is_refused_without_retries(
    monkeypatch: pytest.MonkeyPatch, raises: bool
) -> None:
    """A factor holding NaN is refused once its first attempt fails, whether the solver
    returned NaN or raised: no float64 or jittered retry."""
    f = _spd(3)
    f[1, 2] = float("nan")
    with (
        _failing(monkeypatch, "inv", lambda x, i: raises) as calls,
        pytest.raises(DecompositionError, match="the factor holds NaN/Inf"),
    ):
        damped_inverse(f, 1e-3, dtype=torch.float32)
    assert calls == [torch.float32]


def test_condition_estimate() -> None:
    assert condition_estimate(torch.diag(torch.tensor([4.0, 0.5]))) == pytest.approx(8.0)
    assert condition_estimate(torch.zeros(2, 2)) == float("inf")
    assert condition_estimate(torch.full((2, 2), float("inf"))) != condition_estimate(torch.eye(2))
    batched = torch.stack([torch.eye(2), torch.diag(torch.tensor([1.0, 0.01]))])
    assert condition_estimate(batched) == pytest.approx(100.0)


# --- the step ------------------------------------------------------------------------


CPU = torch.device("cpu")


def _problem(
    seed: int = 0, device: torch.device = CPU
) -> tuple[nn.Module, dict[str, torch.Tensor], kf.Captures]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 7)).double().to(device)
    x, y = torch.randn(8, 3, dtype=torch.float64), torch.randint(0, 7, (8,))
    x, y = x.to(device), y.to(device)
    _, grads, caps = kf.capture(
        model, dict(model.named_parameters()), x, lambda o: F.cross_entropy(o, y)
    )
    return model, grads, caps


def _fail_width(n: int) -> Callable[[torch.Tensor, int], bool]:
    return lambda x, i: x.shape[-1] == n  # only layer "2"'s G factor is 7×7


@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_failed_decomposition_keeps_the_previous_one(
    monkeypatch: pytest.MonkeyPatch, method: str, device: torch.device
) -> None:
    model, grads, caps = _problem(device=device)
    state = kf.init(
        kf.register(model), compute_method=method, inv_dtype=torch.float64, device=device
    )
    _, state = kf.update(state, grads, captures=caps, damping=1e-2)
    before = state.layers["2"].decomposition
    assert before is not None
    fn = "eigh" if method == "eigen" else "inv"
    with _failing(monkeypatch, fn, _fail_width(7)), pytest.warns(RuntimeWarning) as rec:
        out, new = kf.update(state, grads, captures=caps, damping=1e-2)
    messages = [str(w.message) for w in rec]
    assert len(messages) == 1
    assert messages[0].startswith("layer '2': could not decompose the G factor: ")
    assert "keeping the previous decomposition" in messages[0]
    assert "condition estimate" in messages[0]
    assert new.layers["2"].decomposition is before  # kept, not recomputed
    assert new.layers["2"].decomposition_failures == 1
    assert new.layers["0"].decomposition is not state.layers["0"].decomposition
    assert new.layers["0"].decomposition_failures == 0
    # layer 2 is still preconditioned with its previous decomposition
    expected, _ = kf.update(
        new.replace(step=state.step), grads, captures=caps, update_inverses=False, damping=1e-2
    )
    torch.testing.assert_close(out["2.weight"], expected["2.weight"], rtol=0, atol=0)
    # warned once per layer: a second failure only counts
    with _failing(monkeypatch, fn, _fail_width(7)), warnings.catch_warnings():
        warnings.simplefilter("error")
        _, newer = kf.update(new, grads, captures=caps, damping=1e-2)
    assert newer.layers["2"].decomposition_failures == 2


def test_failure_before_the_first_decomposition_passes_gradients(
    monkeypatch: pytest.MonkeyPatch, device: torch.device
) -> None:
    model, grads, caps = _problem(device=device)
    state = kf.init(kf.register(model), inv_dtype=torch.float64, device=device)
    with (
        _failing(monkeypatch, "eigh", lambda x, i: True),
        pytest.warns(RuntimeWarning, match="keeping no preconditioning"),
    ):
        out, new = kf.update(state, grads, captures=caps, kl_clip=None)
    for name in ("0", "2"):
        assert new.layers[name].decomposition is None
        assert new.layers[name].decomposition_failures == 1
        assert torch.equal(out[f"{name}.weight"], grads[f"{name}.weight"])
    # the next step retries (the layer has no decomposition yet) and succeeds
    _, newer = kf.update(new, grads, captures=caps, update_inverses=False)
    assert newer.layers["0"].decomposition is not None


def test_failure_under_update_distributed_without_process_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The distributed path's owners report failure to the grad workers with a flag;
    on one rank it must do what update() does."""
    model, grads, caps = _problem()
    layers = kf.register(model)
    plan = kf.distributed.make_plan(layers, world_size=1)
    comm = kf.distributed.Communicator(plan)
    state = kf.init(layers, inv_dtype=torch.float64)
    _, state = kf.update(state, grads, captures=caps)
    with _failing(monkeypatch, "eigh", _fail_width(7)), pytest.warns(RuntimeWarning) as rec:
        out_d, new_d = kf.distributed.update_distributed(
            state, grads, captures=caps, plan=plan, comm=comm
        )
    with _failing(monkeypatch, "eigh", _fail_width(7)), pytest.warns(RuntimeWarning):
        out_u, new_u = kf.update(state, grads, captures=caps)
    assert [str(w.message)[:40] for w in rec] == ["layer '2': could not decompose the G fac"]
    assert new_d.layers["2"].decomposition is state.layers["2"].decomposition
    assert new_d.layers["2"].decomposition_failures == new_u.layers["2"].decomposition_failures
    for k in grads:
        torch.testing.assert_close(out_d[k], out_u[k], rtol=0, atol=0)


def test_failure_counter_survives_a_checkpoint(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    model, grads, caps = _problem()
    state = kf.init(kf.register(model), inv_dtype=torch.float64)
    with _failing(monkeypatch, "eigh", _fail_width(7)), pytest.warns(RuntimeWarning):
        _, state = kf.update(state, grads, captures=caps)
    kf.save_state(state, tmp_path / "s.safetensors")
    like = kf.init(kf.register(model), inv_dtype=torch.float64)
    loaded = kf.load_state(tmp_path / "s.safetensors", like=like)
    assert loaded.layers["2"].decomposition_failures == 1
    assert loaded.layers["0"].decomposition_failures == 0


# --- approximate eigenbasis refresh ---------------------------------------------------


def test_refresh_is_exact_from_the_eigenvectors(device: torch.device) -> None:
    f = _spd(6).to(device)
    d, q = _EIGH(f)
    # any order and signs of the exact eigenvectors: the refresh returns them back
    perm = torch.tensor([3, 0, 5, 1, 4, 2], device=device)
    signs = torch.tensor([1.0, -1.0, 1.0, -1.0, -1.0, 1.0], dtype=torch.float64, device=device)
    qn, dn = refresh_eigh(f, q[:, perm] * signs, dtype=torch.float64)
    assert qn.device == f.device
    torch.testing.assert_close(dn, d.flip(0), rtol=1e-12, atol=1e-14)  # largest first
    torch.testing.assert_close(qn @ torch.diag(dn) @ qn.T, f, rtol=0, atol=1e-12)
    eye = torch.eye(6, dtype=torch.float64, device=device).flip(0)
    torch.testing.assert_close((qn.T @ q).abs(), eye)


def test_refresh_keeps_null_directions_out_of_the_basis() -> None:
    """A rank-deficient factor (zero eigenvalues, as G of a cross-entropy head): the
    refresh from the exact eigenvectors is exact, whatever the order they come in."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 7, generator=g, dtype=torch.float64)
    x = x - x.mean(1, keepdim=True)  # rows sum to zero: one null direction
    f = x.T @ x / 8
    q, d = eigh_factor(f, dtype=torch.float64)  # ascending: the null direction first
    qn, dn = refresh_eigh(f, q, dtype=torch.float64)
    torch.testing.assert_close(dn, d.flip(0), rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(qn @ torch.diag(dn) @ qn.T, f, rtol=0, atol=1e-13)


def _precondition_error(f_a: torch.Tensor, f_g: torch.Tensor, eig: Any, m: torch.Tensor) -> float:
    exact = eigen_decompose(f_a, f_g, 1e-3, dtype=torch.float64)
    want = precondition(m, exact, 1e-3)
    return float((precondition(m, eig, 1e-3) - want).norm() / want.norm())


def test_repeated_refreshes_converge_to_eigh() -> None:
    """Refreshing a fixed factor is orthogonal iteration: it converges to the exact
    eigendecomposition (distinct eigenvalues)."""
    g = torch.Generator().manual_seed(0)
    q0, _ = torch.linalg.qr(torch.randn(8, 8, generator=g, dtype=torch.float64))
    f_a = q0 @ torch.diag(torch.linspace(1.0, 8.0, 8, dtype=torch.float64)) @ q0.T
    f_g = _spd(5, seed=3)
    m = torch.randn(5, 8, generator=g, dtype=torch.float64)
    eig = eigen_decompose(torch.eye(8, dtype=torch.float64), torch.eye(5, dtype=torch.float64), 0.0)
    errors = []
    for _ in range(200):
        eig = eigen_decompose(f_a, f_g, 1e-3, dtype=torch.float64, warm_start=eig)
        errors.append(_precondition_error(f_a, f_g, eig, m))
    assert errors[0] > 1e-2 and errors[-1] < 1e-10, (errors[0], errors[-1])


def test_refresh_tracks_a_drifting_running_average() -> None:
    """The use case: factors that change slowly (running averages, decay 0.95) refreshed
    at every update from an exact start. Measured error of the preconditioned gradient
    against exact eigh: stays below 5 % (about 1–2 % on this problem)."""
    g = torch.Generator().manual_seed(1)
    d_in, d_out, n = 48, 24, 64
    mix_a = torch.randn(d_in, d_in, generator=g, dtype=torch.float64) / d_in**0.5
    mix_g = torch.randn(d_out, d_out, generator=g, dtype=torch.float64) / d_out**0.5
    scale_a = torch.linspace(0.1, 3.0, d_in, dtype=torch.float64)
    scale_g = torch.linspace(0.1, 3.0, d_out, dtype=torch.float64)

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(n, d_in, generator=g, dtype=torch.float64) @ (mix_a + torch.eye(d_in))
        y = torch.randn(n, d_out, generator=g, dtype=torch.float64) @ (mix_g + torch.eye(d_out))
        x, y = x * scale_a, y * scale_g
        return x.T @ x / n, y.T @ y / n

    f_a, f_g = batch()
    eig = eigen_decompose(f_a, f_g, 1e-3, dtype=torch.float64)
    errors = []
    for _ in range(40):
        b_a, b_g = batch()
        f_a, f_g = 0.95 * f_a + 0.05 * b_a, 0.95 * f_g + 0.05 * b_g
        eig = eigen_decompose(f_a, f_g, 1e-3, dtype=torch.float64, warm_start=eig)
        m = torch.randn(d_out, d_in, generator=g, dtype=torch.float64)
        errors.append(_precondition_error(f_a, f_g, eig, m))
    print(f"\nrefresh error: first {errors[0]:.3g}, max {max(errors):.3g}, last {errors[-1]:.3g}")
    assert max(errors) < 0.05


def test_qr_refresh_in_update_decomposes_exactly_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first decomposition is exact (eigh); later ones never call eigh, and on one
    rank update_distributed does the same bit for bit."""
    model, grads, caps = _problem()
    layers = kf.register(model)
    state = kf.init(layers, inv_dtype=torch.float64, eigenbasis_refresh="qr")
    exact = kf.init(layers, inv_dtype=torch.float64)
    out, state = kf.update(state, grads, captures=caps)
    out_exact, exact = kf.update(exact, grads, captures=caps)
    for k in grads:
        assert torch.equal(out[k], out_exact[k])
    plan = kf.distributed.make_plan(layers, world_size=1)
    comm = kf.distributed.Communicator(plan)
    with _failing(monkeypatch, "eigh", lambda x, i: True) as calls:
        out2, new = kf.update(state, grads, captures=caps)
        out3, _ = kf.distributed.update_distributed(
            state, grads, captures=caps, plan=plan, comm=comm
        )
    assert calls == []
    assert new.layers["0"].decomposition is not state.layers["0"].decomposition
    assert new.layers["0"].decomposition_failures == 0
    for k in grads:
        assert torch.equal(out2[k], out3[k])
        torch.testing.assert_close(out2[k], out_exact[k], rtol=1e-5, atol=1e-6)


def test_bad_eigenbasis_refresh_is_refused() -> None:
    with pytest.raises(ValueError, match="eigenbasis_refresh must be one of"):
        kf.init(kf.register(nn.Linear(2, 2)), eigenbasis_refresh="power")


def test_eigh_reads_the_upper_triangle_and_keeps_lapacks_layout() -> None:
    """A factor symmetric only up to rounding is decomposed as its upper triangle,
    mirrored; the eigenvectors are column-major as LAPACK returns them, and of an exactly
    symmetric factor the same bits as ``eigh`` of the factor itself."""
    f = _spd(9, dtype=torch.float32)
    f = (f + f.mT) / 2  # exactly symmetric, whatever the kernels rounded in XᵀX
    q, d = eigh_factor(f, dtype=torch.float32)
    d_ref, q_ref = _EIGH(f)
    assert q.mT.is_contiguous() and not q.is_contiguous()
    assert torch.equal(q, q_ref) and torch.equal(d, d_ref.clamp(min=0.0))
    lower = torch.tril(torch.ones(9, 9, dtype=torch.bool), diagonal=-1)
    skewed = torch.where(lower, f + 1e-3, f)  # only the lower triangle moved
    q2, d2 = eigh_factor(skewed, dtype=torch.float32)
    assert torch.equal(q2, q) and torch.equal(d2, d)


def test_damped_inverse_is_row_major() -> None:
    """The damped inverse comes back row-major (the transpose of LAPACK's column-major
    result of the factor's transpose, a view), equal to ``inv(F + λI)``."""
    f = _spd(7, dtype=torch.float64)
    inv = damped_inverse(f, 0.1, dtype=torch.float64)
    assert inv.is_contiguous()
    torch.testing.assert_close(inv, _INV(f + 0.1 * torch.eye(7, dtype=torch.float64)))
