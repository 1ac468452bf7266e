"""Decompositions made ready for GPUs: batched eigh across layers, the retries after a
GPU solver error (cuSOLVER), eigh offloaded to the CPU, and factors kept in float32 when
the forward runs under bfloat16 autocast.

Each runs on the ``device`` fixture (the ``cuda`` cases are skipped without a GPU). The
expected values come from plain ``torch.linalg`` calls on the same factors (per factor,
in float64 where the retry runs in float64) or from the float32 run of the same model.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from numerics import named
from settings_keywords import with_settings
from torch import nn

import kfac_func as kf
from kfac_func.core.attempts import solver_error
from kfac_func.core.decomposition import eigh_factor
from kfac_func.step.decompose_groups import batched_eigenpairs

_EIGH = torch.linalg.eigh
_INV = torch.linalg.inv
# what torch raises when cuSOLVER's syevd refuses a (large) factor
CUSOLVER = (
    "cusolver error: CUSOLVER_STATUS_INVALID_VALUE, when calling `cusolverDnXsyevd( handle, "
    "params, jobz, uplo, n, CUDA_R_32F, A, lda, CUDA_R_32F, W, CUDA_R_32F, bufferOnDevice, "
    "workspaceInBytesOnDevice, bufferOnHost, workspaceInBytesOnHost, info)`"
)


@contextmanager
def patched(
    monkeypatch: pytest.MonkeyPatch, name: str, fails: Callable[[torch.Tensor, int], bool]
) -> Iterator[list[tuple[tuple[int, ...], torch.dtype, torch.device]]]:
    """``torch.linalg.<name>`` recording ``(shape, dtype, device)`` of every call and
    raising the cuSOLVER error where ``fails(input, call_index)``."""
    real = {"eigh": _EIGH, "inv": _INV}[name]
    calls: list[tuple[tuple[int, ...], torch.dtype, torch.device]] = []

    def fake(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        calls.append((tuple(x.shape), x.dtype, x.device))
        if fails(x, len(calls) - 1):
            raise RuntimeError(CUSOLVER)
        return real(x, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(torch.linalg, name, fake)
        yield calls


def mlp(device: torch.device, depth: int = 8) -> nn.Sequential:
    """Linear(6, 16) (A 7×7, G 16×16), ``depth`` Linear(16, 16) without bias (A and G
    16×16: one shape for the batched eigh) and a head Linear(16, 3) (A 17×17, G 3×3)."""
    torch.manual_seed(0)
    mods: list[nn.Module] = [nn.Linear(6, 16)]
    for _ in range(depth):
        mods += [nn.Tanh(), nn.Linear(16, 16, bias=False)]
    mods += [nn.Tanh(), nn.Linear(16, 3)]
    return nn.Sequential(*mods).to(device)


def state_with_factors(
    model: nn.Module, device: torch.device, **init: Any
) -> tuple[kf.KFACState, dict[str, torch.Tensor], kf.Captures]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 6, generator=g).to(device)
    y = torch.randint(0, 3, (64,), generator=g).to(device)
    params = dict(model.named_parameters())
    _, grads, caps = kf.capture(model, params, x, lambda o: F.cross_entropy(o, y))
    state = kf.init(kf.register(model), convention="fisher", device=device, **init)
    return kf.step.accumulate_factors(state, caps, factor_decay=0.0), grads, caps


def assert_eigen_close(
    got: kf.core.EigenDecomposition, want: kf.core.EigenDecomposition, what: str
) -> None:
    """Eigenvalues equal, and the eigenbases span the same directions (column signs and
    the order within clusters of equal eigenvalues may differ between solvers): compared
    through the reconstructions ``Q diag(d) Qᵀ``; the eigenvectors are held column-major,
    as the solver returns them."""
    for q, d, q_ref, d_ref in (
        (got.qa, got.da, want.qa, want.da),
        (got.qg, got.dg, want.qg, want.dg),
    ):
        torch.testing.assert_close(d, d_ref, rtol=1e-5, atol=1e-6, msg=named(what))
        assert q is not None and q_ref is not None and q.mT.is_contiguous()
        torch.testing.assert_close(
            q @ torch.diag(d) @ q.T, q_ref @ torch.diag(d_ref) @ q_ref.T, rtol=1e-5, atol=1e-6
        )


# --------------------------------------------------------------- batched eigh


def test_batched_eigh_equals_the_per_factor_path(device: torch.device) -> None:
    model = mlp(device)
    state, grads, _ = state_with_factors(model, device)
    per = kf.decompose(state, damping=1e-2)
    batched = kf.decompose(state, damping=1e-2, batched_eigh=True)
    assert list(batched.layers) == list(per.layers)
    for name in per.layers:
        got, want = batched.layers[name].decomposition, per.layers[name].decomposition
        assert isinstance(got, kf.core.EigenDecomposition) and isinstance(
            want, kf.core.EigenDecomposition
        )
        assert got.qa is not None and got.qa.device.type == device.type
        assert_eigen_close(got, want, name)
        assert got.dgda is not None and want.dgda is not None
        torch.testing.assert_close(got.dgda, want.dgda, rtol=1e-4, atol=1e-6)
    # the preconditioned gradients, which do not depend on the eigenvectors' signs
    p_batched = kf.step.precondition_grads(batched, grads, damping=1e-2, kl_clip=None)
    p_per = kf.step.precondition_grads(per, grads, damping=1e-2, kl_clip=None)
    for k in grads:
        torch.testing.assert_close(p_batched[k], p_per[k], rtol=1e-4, atol=1e-6, msg=named(k))


def test_batched_eigh_stacks_equal_shapes_into_one_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """The 8 hidden layers' 16 factors and the first layer's G, all 16×16: one eigh of 17
    stacked factors; the factors alone in their shape get one call each."""
    device = torch.device("cpu")
    state, _, _ = state_with_factors(mlp(device), device)
    shapes = sorted(
        {tuple(ls.a_factor.shape) for ls in state.layers.values()}
        | {tuple(ls.g_factor.shape) for ls in state.layers.values()}
    )
    assert shapes == [(3, 3), (7, 7), (16, 16), (17, 17)]
    with patched(monkeypatch, "eigh", lambda x, i: False) as calls:
        kf.decompose(state, batched_eigh=True)
    stacked = [c[0] for c in calls if len(c[0]) == 3]
    single = sorted(c[0] for c in calls if len(c[0]) == 2)
    assert stacked == [(17, 16, 16)], calls
    assert single == [(3, 3), (7, 7), (17, 17)]
    with patched(monkeypatch, "eigh", lambda x, i: False) as calls:
        kf.decompose(state)
    assert len(calls) == 2 * len(state.layers) and all(len(c[0]) == 2 for c in calls)


def test_batched_call_failing_falls_back_to_each_factor(
    monkeypatch: pytest.MonkeyPatch, device: torch.device
) -> None:
    """The stacked call raises (as a solver may on a large batch): every factor is then
    decomposed alone, exactly as without batching."""
    state, _, _ = state_with_factors(mlp(device), device)
    per = kf.decompose(state)
    with (
        patched(monkeypatch, "eigh", lambda x, i: x.dim() == 3) as calls,
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("error")  # the failure of a batch is not the user's
        batched = kf.decompose(state, batched_eigh=True)
    assert sum(len(c[0]) == 3 for c in calls) == 1
    for name, ls in per.layers.items():
        got, want = batched.layers[name].decomposition, ls.decomposition
        for k, v in vars(want).items():
            w = getattr(got, k)
            assert (v is None and w is None) or torch.equal(v, w), (name, k)


def test_a_nonfinite_factor_leaves_its_group_and_its_layer_keeps_the_old_one(
    device: torch.device,
) -> None:
    model = mlp(device)
    state, _, _ = state_with_factors(model, device)
    first = kf.decompose(state)
    ls = first.layers["4"]
    bad = ls.a_factor.clone()
    bad[0, 0] = float("nan")
    poisoned = first.replace(layers={**first.layers, "4": ls.replace(a_factor=bad)})
    with pytest.warns(RuntimeWarning, match="layer '4': could not decompose the A factor"):
        batched = kf.decompose(poisoned, batched_eigh=True)
    assert batched.layers["4"].decomposition is ls.decomposition
    assert batched.layers["4"].decomposition_failures == 1
    for name, other in first.layers.items():
        if name != "4":
            got = batched.layers[name].decomposition
            assert isinstance(got, kf.core.EigenDecomposition)
            assert isinstance(other.decomposition, kf.core.EigenDecomposition)
            assert_eigen_close(got, other.decomposition, name)


def test_batched_eigenpairs_groups_the_sides_of_one_shape() -> None:
    """The 16×16 sides (the hidden layers' A and G, the first layer's G) in one stack, each
    equal to its own eigh; the sides alone in their shape are left to the checked path."""
    state, _, _ = state_with_factors(mlp(torch.device("cpu"), depth=2), torch.device("cpu"))
    sides = [(name, side) for name in state.layers for side in (0, 1)]
    out = batched_eigenpairs(state.layers, state.config, sides)
    wide = [(n, s) for n, s in sides if state.layers[n].spec.factor_shapes[s][0] == 16]
    assert sorted(out) == sorted(wide)
    for (name, side), (q, d) in out.items():
        ls = state.layers[name]
        factor = ls.g_factor if side else ls.a_factor
        _, d_ref = eigh_factor(factor, dtype=torch.float32)
        torch.testing.assert_close(d, d_ref, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(q @ torch.diag(d) @ q.T, factor, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("method", ["ekfac", "inverse"])
def test_batched_eigh_with_other_methods(method: str, device: torch.device) -> None:
    """EKFAC takes the batched eigenbases; the inverse method has no eigh to batch."""
    state, _, _ = state_with_factors(mlp(device), device, compute_method=method)
    per = kf.decompose(state)
    batched = kf.decompose(state, batched_eigh=True)
    for name, ls in per.layers.items():
        got, want = batched.layers[name].decomposition, ls.decomposition
        assert type(got) is type(want)
        if method == "inverse":
            assert isinstance(got, kf.core.InverseDecomposition)
            assert isinstance(want, kf.core.InverseDecomposition)
            assert torch.equal(got.a_inv, want.a_inv) and torch.equal(got.g_inv, want.g_inv)
        else:
            assert isinstance(got, kf.core.EKFACDecomposition)
            assert isinstance(want, kf.core.EKFACDecomposition)
            torch.testing.assert_close(got.scale, want.scale, rtol=1e-4, atol=1e-6)


def test_batched_eigh_in_update_and_update_distributed(device: torch.device) -> None:
    """The same results through ``update`` and, on one rank, ``update_distributed``."""
    model = mlp(device)
    _, grads, caps = state_with_factors(model, device)
    layers = kf.register(model)
    plan = kf.distributed.make_plan(layers, world_size=1)
    comm = kf.distributed.Communicator(plan)
    state = kf.init(layers, device=device)
    want, _ = kf.update(state, grads, captures=caps, kl_clip=None)
    got, new = kf.update(state, grads, captures=caps, kl_clip=None, batched_eigh=True)
    got_d, new_d = kf.distributed.update_distributed(
        state, grads, captures=caps, plan=plan, comm=comm, kl_clip=None, batched_eigh=True
    )
    for k in grads:
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-6, msg=named(k))
        torch.testing.assert_close(got_d[k], got[k], rtol=1e-4, atol=1e-6, msg=named(k))
    assert all(ls.decomposition is not None for ls in new.layers.values())
    assert all(ls.decomposition is not None for ls in new_d.layers.values())


# --------------------------------------------------------------- solver errors


def test_solver_error_recognises_gpu_solver_messages() -> None:
    assert solver_error(RuntimeError(CUSOLVER))
    assert solver_error(
        torch.linalg.LinAlgError("cusolver error: CUSOLVER_STATUS_EXECUTION_FAILED")
    )
    assert solver_error(RuntimeError("MAGMA syevd : Argument 4 : illegal value"))
    assert not solver_error(
        torch.linalg.LinAlgError("linalg.eigh: The algorithm failed to converge")
    )
    assert not solver_error(ValueError("cusolver"))  # not an error torch raises


def test_cusolver_error_is_retried_in_float64_and_names_the_layer(
    monkeypatch: pytest.MonkeyPatch, device: torch.device
) -> None:
    """The first eigh raises cuSOLVER's INVALID_VALUE: the retry (in float64, on the CPU)
    gives exactly the float64 result, and one warning names the layer and the factor."""
    model = mlp(device, depth=1)
    state, _, _ = state_with_factors(model, device)
    first = next(iter(state.layers))  # "0": its A factor is decomposed first
    with (
        patched(monkeypatch, "eigh", lambda x, i: i == 0) as calls,
        pytest.warns(RuntimeWarning) as rec,
    ):
        new = kf.decompose(state)
    messages = [str(w.message) for w in rec]
    assert len(messages) == 1, messages
    assert messages[0].startswith(f"layer {first!r}, the A factor: eigh raised a solver error (")
    assert "CUSOLVER_STATUS_INVALID_VALUE" in messages[0]
    moved = " on the CPU" if device.type != "cpu" else ""
    assert messages[0].endswith(f"the retry in float64{moved} succeeded"), messages[0]
    # the failed call ran in float32 on the factor's device, its retry in float64 on the CPU
    ls = state.layers[first]
    a_calls = [(dt, dev.type) for shape, dt, dev in calls if shape == tuple(ls.a_factor.shape)]
    assert a_calls[:2] == [(torch.float32, device.type), (torch.float64, "cpu")]
    assert calls[0][0] == tuple(ls.a_factor.shape)  # (the G factor's first call comes next)
    q_ref, d_ref = eigh_factor(ls.a_factor.cpu(), dtype=torch.float32, compute_dtype=torch.float64)
    dec = new.layers[first].decomposition
    assert isinstance(dec, kf.core.EigenDecomposition) and dec.qa is not None
    assert dec.qa.device == ls.a_factor.device and dec.qa.dtype == torch.float32
    assert torch.equal(dec.qa.cpu(), q_ref) and torch.equal(dec.da.cpu(), d_ref)
    assert new.layers[first].decomposition_failures == 0
    # the other factors were not affected
    others = kf.decompose(state)
    for name in state.layers:
        if name != first:
            a, b = new.layers[name].decomposition, others.layers[name].decomposition
            assert isinstance(a, kf.core.EigenDecomposition) and isinstance(
                b, kf.core.EigenDecomposition
            )
            assert torch.equal(a.da, b.da) and torch.equal(a.dg, b.dg)


def test_cusolver_error_under_update_distributed_names_the_layer(
    monkeypatch: pytest.MonkeyPatch, device: torch.device
) -> None:
    model = mlp(device, depth=1)
    _, grads, caps = state_with_factors(model, device)
    layers = kf.register(model)
    plan = kf.distributed.make_plan(layers, world_size=1)
    comm = kf.distributed.Communicator(plan)
    state = kf.init(layers, device=device)
    last = list(layers)[-1]
    g_width = layers[last].factor_shapes[1][0]
    with (
        patched(
            monkeypatch, "eigh", lambda x, i: x.shape[-1] == g_width and x.dtype == torch.float32
        ),
        pytest.warns(RuntimeWarning, match=rf"^layer '{last}', the G factor: eigh raised a solver"),
    ):
        out, new = kf.distributed.update_distributed(
            state, grads, captures=caps, plan=plan, comm=comm
        )
    assert new.layers[last].decomposition_failures == 0
    assert all(torch.isfinite(v).all() for v in out.values())


def test_cusolver_error_in_the_inverse_is_retried(
    monkeypatch: pytest.MonkeyPatch, device: torch.device
) -> None:
    model = mlp(device, depth=1)
    state, _, _ = state_with_factors(model, device, compute_method="inverse")
    first = next(iter(state.layers))
    with (
        patched(monkeypatch, "inv", lambda x, i: i == 0),
        pytest.warns(RuntimeWarning, match=rf"^layer '{first}', the A factor: inverse raised a"),
    ):
        new = kf.decompose(state, damping=1e-2)
    a = state.layers[first].a_factor.cpu().double()
    want = _INV(a + 1e-2 * torch.eye(a.shape[0], dtype=torch.float64)).float()
    dec = new.layers[first].decomposition
    assert isinstance(dec, kf.core.InverseDecomposition)
    assert dec.a_inv.device == state.layers[first].a_factor.device
    assert torch.equal(dec.a_inv.cpu(), want)


def test_other_eigh_failures_are_retried_silently(monkeypatch: pytest.MonkeyPatch) -> None:
    """A convergence failure (torch.linalg.LinAlgError without a solver library's name)
    says something about the factor: retried in float64 as before, without a warning."""
    device = torch.device("cpu")
    state, _, _ = state_with_factors(mlp(device, depth=1), device)

    def fake(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if x.dtype == torch.float32:
            raise torch.linalg.LinAlgError("linalg.eigh: The algorithm failed to converge")
        return _EIGH(x, *args, **kwargs)

    monkeypatch.setattr(torch.linalg, "eigh", fake)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        new = kf.decompose(state)
    assert all(ls.decomposition_failures == 0 for ls in new.layers.values())


# --------------------------------------------------------------- batched eigh in the adapter


def test_batched_eigh_reaches_eigh_from_the_adapter(
    monkeypatch: pytest.MonkeyPatch, device: torch.device
) -> None:
    """``Settings(batched_eigh=True)``: the adapter's step stacks the equal-shaped factors
    into one eigh on the factors' device."""
    model = mlp(device, depth=1)
    pre = kf.KFACPreconditioner(model, settings=kf.Settings(batched_eigh=True))
    assert pre.batched_eigh
    x = torch.randn(8, 6, device=device)
    model(x).pow(2).mean().backward()
    with patched(monkeypatch, "eigh", lambda x, i: False) as calls:
        pre.step()
    assert calls and {dev.type for *_, dev in calls} == {device.type}
    assert any(len(shape) == 3 for shape, *_ in calls)  # batched: 16×16 factors stacked
    assert all(ls.decomposition is not None for ls in pre.state.layers.values())
    assert all(p.grad is not None and p.grad.device.type == device.type for p in model.parameters())


def test_retired_eigh_device_is_refused_naming_it() -> None:
    """``eigh_device`` (eigh offloaded to another device) was retired: no measurement
    supported it. Passing it is a TypeError that names it."""
    model = mlp(torch.device("cpu"), depth=1)
    state = kf.init(kf.register(model))
    with pytest.raises(TypeError, match="eigh_device"):
        kf.decompose(state, eigh_device="cpu")  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="eigh_device"):
        kf.Settings(eigh_device="cpu")  # type: ignore[call-arg]


# --------------------------------------------------------------- bf16 autocast


# bfloat16 keeps 8 significant bits (unit roundoff 2**-8); a factor after one or two
# bfloat16 layers differs from the float32 one by a few times that (measured 2e-4 to
# 5e-3 relative here), as in tests/test_adapter.py
BF16_RTOL = 5 * 2.0**-8


@pytest.mark.parametrize("inside", [False, True], ids=["update-outside", "update-inside"])
def test_functional_factors_stay_float32_under_bf16_autocast(
    device: torch.device, inside: bool
) -> None:
    """``kf.capture`` under autocast (the forward in bfloat16): the factors are float32
    and close to those of the float32 forward, also when ``update`` itself is called
    inside the autocast region (its products do not run in bfloat16)."""
    model = mlp(device, depth=1)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(32, 6, generator=g).to(device)
    y = torch.randint(0, 3, (32,), generator=g).to(device)
    params = dict(model.named_parameters())
    layers = kf.register(model)
    loss = lambda o: F.cross_entropy(o.float(), y)  # noqa: E731
    _, grads, caps = kf.capture(model, params, x, loss)
    _, ref = kf.update(kf.init(layers, convention="fisher", device=device), grads, captures=caps)
    state = kf.init(layers, convention="fisher", device=device)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        _, grads16, caps16 = kf.capture(model, params, x, loss)
        assert model(x).dtype == torch.bfloat16  # the forward really runs in bfloat16
        if inside:
            got, new = kf.update(state, grads16, captures=caps16)
    if not inside:
        got, new = kf.update(state, grads16, captures=caps16)
    for name in layers:
        for attr in ("a_factor", "g_factor"):
            f16, f32 = getattr(new.layers[name], attr), getattr(ref.layers[name], attr)
            assert f16.dtype == torch.float32, (name, attr, f16.dtype)
            rel = float((f16.double() - f32.double()).norm() / f32.double().norm())
            assert rel < BF16_RTOL, (name, attr, rel)
        dec = new.layers[name].decomposition
        assert isinstance(dec, kf.core.EigenDecomposition) and dec.qa is not None
        assert dec.qa.dtype == torch.float32
    for k in grads:
        assert got[k].dtype == torch.float32
    # the first layer's input is the float32 batch: its A factor is the float32 one
    assert torch.equal(new.layers["0"].a_factor, ref.layers["0"].a_factor)


def test_adapter_factors_stay_float32_under_bf16_autocast(device: torch.device) -> None:
    """The adapter (hooks) with the forward under autocast on the device, every step."""
    net32, net16 = mlp(device, depth=1), mlp(device, depth=1)
    kw: dict[str, Any] = dict(scaling="fisher", factor_decay=0.5, damping=0.01)
    kw = with_settings(**kw)
    pre32, pre16 = kf.KFACPreconditioner(net32, **kw), kf.KFACPreconditioner(net16, **kw)
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        x = torch.randn(32, 6, generator=g).to(device)
        y = torch.randint(0, 3, (32,), generator=g).to(device)
        F.cross_entropy(net32(x), y).backward()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            out = net16(x)
            assert out.dtype == torch.bfloat16
            loss = F.cross_entropy(out.float(), y)
        loss.backward()
        pre32.step()
        pre16.step()
        for name in pre32.layers:
            for attr in ("a_factor", "g_factor"):
                f32 = getattr(pre32.state.layers[name], attr)
                f16 = getattr(pre16.state.layers[name], attr)
                assert f16.dtype == torch.float32 and f16.device.type == device.type
                rel = float((f16.double() - f32.double()).norm() / f32.double().norm())
                assert rel < BF16_RTOL, (name, attr, rel)
        for net in (net32, net16):
            net.zero_grad()
