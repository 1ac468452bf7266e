"""``sync_free=True``: the precondition step decides on the device.

The default mode is the oracle for the decisions (it reads the checks on the host and
is tested against dense float64 solves elsewhere); one test also checks a sync-free
result against a dense float64 solve directly. When every gradient is finite the
numbers must be exactly the default's (dense path); a layer with a NaN is skipped as
the default skips it, and the warning comes at the next factor update or from
``report_skipped``. Sync counts are in ``test_host_syncs.py``; compiled steps in
``test_compile.py``.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from gloo import gloo_group, record_errors, spawn
from numerics import named
from torch import nn

import kfac_func as kf

NAN = float("nan")


def _mlp(width: int = 12) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 3)
    )


def _setup(
    method: str = "eigen", dtype: torch.dtype = torch.float32, moments: bool = False
) -> tuple[kf.KFACState, dict[str, torch.Tensor], Any]:
    model = _mlp().to(dtype)
    layers = kf.register(model)
    state = kf.init(layers, compute_method=method, factor_dtype=dtype, inv_dtype=dtype)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 6, generator=gen, dtype=dtype), torch.randint(0, 3, (64,), generator=gen)
    params = dict(model.named_parameters())
    _, grads, caps = kf.capture(model, params, x, lambda out: F.cross_entropy(out, y))
    _, state = kf.update(state, grads, captures=caps, damping=1e-2, eigenbasis_moments=moments)
    return state, grads, caps


PRECONDITION_ONLY = {"update_factors": False, "update_inverses": False, "damping": 1e-2}


def _assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, equal_nan=True, msg=named(k))


@pytest.mark.parametrize("method", ["eigen", "inverse", "ekfac"])
@pytest.mark.parametrize("kl_clip", [1e-3, None])
@pytest.mark.parametrize("moments", [False, True])
def test_equals_default_exactly_when_finite(
    method: str, kl_clip: float | None, moments: bool
) -> None:
    if moments and method == "inverse":
        pytest.skip("eigenbasis moments need an eigenbasis")
    state, grads, _ = _setup(method, moments=moments)
    kw: dict[str, Any] = {**PRECONDITION_ONLY, "kl_clip": kl_clip, "eigenbasis_moments": moments}
    ref, ref_state = kf.update(state, grads, **kw)
    got, new = kf.update(state, grads, sync_free=True, **kw)
    _assert_equal(ref, got)
    assert any(not torch.equal(got[k], grads[k]) for k in grads)  # it did precondition
    for name, ls in new.layers.items():
        assert int(ls.grad_skips) == 0  # type: ignore[arg-type]
        if moments:
            assert torch.equal(ls.basis_moment, ref_state.layers[name].basis_moment)  # type: ignore[arg-type]
    # precondition_grads too (its own damping and kl_clip)
    lam = None if method == "inverse" else 1e-2  # inverses hold their damping
    _assert_equal(
        kf.step.precondition_grads(state, grads, damping=lam, kl_clip=kl_clip),
        kf.step.precondition_grads(state, grads, damping=lam, kl_clip=kl_clip, sync_free=True),
    )


def test_equals_a_dense_float64_solve() -> None:
    """The oracle: ``(G ⊗ A + λI)⁻¹ vec(M)`` with dense matrices, per layer."""
    state, grads, _ = _setup(dtype=torch.float64)
    got, _ = kf.update(state, grads, kl_clip=None, sync_free=True, **PRECONDITION_ONLY)
    for name, ls in state.layers.items():
        m = kf.blocks.grads_to_matrix(ls.spec, grads[f"{name}.weight"], grads[f"{name}.bias"])
        a, g = ls.a_factor, ls.g_factor
        big = torch.kron(g, a) + 1e-2 * torch.eye(a.shape[0] * g.shape[0], dtype=torch.float64)
        want = torch.linalg.solve(big, m.reshape(-1)).reshape(m.shape)
        p = kf.blocks.grads_to_matrix(ls.spec, got[f"{name}.weight"], got[f"{name}.bias"])
        torch.testing.assert_close(p, want, rtol=1e-9, atol=1e-12)


def test_rows_are_not_used_and_results_match_the_rows_path() -> None:
    """Captured rows (the default's cheaper path for these Linear layers) are ignored: the
    result is the dense path's exactly, and the rows path's up to rounding."""
    state, grads, caps = _setup()
    dense, _ = kf.update(state, grads, **PRECONDITION_ONLY)
    with_rows, _ = kf.update(state, grads, captures=caps, **PRECONDITION_ONLY)
    got, _ = kf.update(state, grads, captures=caps, sync_free=True, **PRECONDITION_ONLY)
    _assert_equal(dense, got)
    for k in got:
        torch.testing.assert_close(got[k], with_rows[k], rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("method", ["eigen", "inverse"])
@pytest.mark.parametrize("kl_clip", [1e-3, None])
@pytest.mark.parametrize("bad", [NAN, float("inf"), -float("inf")])
def test_non_finite_layer_is_skipped_as_in_default(
    method: str, kl_clip: float | None, bad: float
) -> None:
    state, grads, _ = _setup(method)
    grads = dict(grads)
    grads["2.weight"] = grads["2.weight"].clone()
    grads["2.weight"][1, 3] = bad
    with pytest.warns(RuntimeWarning, match="layer '2'"):
        ref, _ = kf.update(state, grads, kl_clip=kl_clip, **PRECONDITION_ONLY)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning: nothing is read on the host
        got, new = kf.update(state, grads, kl_clip=kl_clip, sync_free=True, **PRECONDITION_ONLY)
    for k in ("2.weight", "2.bias"):  # passed unchanged, as in the default mode
        torch.testing.assert_close(got[k], grads[k], rtol=0, atol=0, equal_nan=True)
    for k in ("0.weight", "0.bias", "4.weight", "4.bias"):
        assert not torch.equal(got[k], grads[k])
        # the kl_clip sum holds a zero for the skipped layer: equal up to its rounding
        torch.testing.assert_close(got[k], ref[k], rtol=1e-12, atol=0)
    skips = {n: int(ls.grad_skips) for n, ls in new.layers.items()}  # type: ignore[arg-type]
    assert skips == {"0": 0, "2": 1, "4": 0}


def test_skips_are_reported_once_by_report_and_not_by_a_sync_free_factor_update() -> None:
    state, grads, caps = _setup()
    bad = dict(grads)
    bad["4.bias"] = torch.full_like(grads["4.bias"], NAN)
    for _ in range(3):
        _, state = kf.update(state, bad, sync_free=True, **PRECONDITION_ONLY)
    with pytest.warns(RuntimeWarning, match=r"layer '4'.* on 3 step\(s\)") as caught:
        counts, state = kf.step.report_skipped(state)
    assert counts == {"4": 3} and len(caught) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert kf.step.report_skipped(state)[0] == {}  # already reported
    _, state = kf.update(state, bad, sync_free=True, **PRECONDITION_ONLY)
    # a factor update reads nothing either: the skip stays pending until reported
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, state = kf.update(state, grads, captures=caps, damping=1e-2, sync_free=True)
    assert state.layers["4"].grad_skips_reported == 3
    with pytest.warns(RuntimeWarning, match=r"layer '4'.* on 1 step\(s\)"):
        _, state = kf.step.report_skipped(state)
    assert int(state.layers["4"].grad_skips) == 4  # type: ignore[arg-type]
    assert state.layers["4"].grad_skips_reported == 4
    # a step that checks on the host reports what sync_free steps left
    _, state = kf.update(state, bad, sync_free=True, **PRECONDITION_ONLY)
    with pytest.warns(RuntimeWarning, match=r"layer '4'.* on 1 step\(s\)"):
        _, state = kf.update(state, grads, **PRECONDITION_ONLY)
    with pytest.raises(TypeError, match="KFACState"):
        kf.step.report_skipped({})  # type: ignore[arg-type]


def test_a_running_moment_keeps_its_value_on_a_skipped_step() -> None:
    state, grads, _ = _setup(moments=True)
    bad = dict(grads)
    bad["0.weight"] = torch.full_like(grads["0.weight"], NAN)
    kw: dict[str, Any] = {**PRECONDITION_ONLY, "eigenbasis_moments": True}
    with pytest.warns(RuntimeWarning):
        _, ref = kf.update(state, bad, **kw)
    _, got = kf.update(state, bad, sync_free=True, **kw)
    for name in state.layers:
        a, b = ref.layers[name].basis_moment, got.layers[name].basis_moment
        assert a is not None and b is not None and torch.equal(a, b), name
    assert torch.equal(got.layers["0"].basis_moment, state.layers["0"].basis_moment)  # type: ignore[arg-type]


def test_counters_survive_save_and_load_and_old_files_load(tmp_path: Path) -> None:
    state, grads, _ = _setup()
    bad = dict(grads)
    bad["2.bias"] = torch.full_like(grads["2.bias"], NAN)
    _, state = kf.update(state, bad, sync_free=True, **PRECONDITION_ONLY)
    _, state = kf.update(state, bad, sync_free=True, **PRECONDITION_ONLY)
    with pytest.warns(RuntimeWarning):
        _, state = kf.step.report_skipped(state)
    _, state = kf.update(state, bad, sync_free=True, **PRECONDITION_ONLY)
    like = kf.init(kf.register(_mlp()))
    kf.save_state(state, tmp_path / "s.safetensors")
    back = kf.load_state(tmp_path / "s.safetensors", like=like)
    for name, ls in state.layers.items():
        assert torch.equal(back.layers[name].grad_skips, ls.grad_skips)  # type: ignore[arg-type]
        assert back.layers[name].grad_skips_reported == ls.grad_skips_reported
    assert int(back.layers["2"].grad_skips) == 3 and back.layers["2"].grad_skips_reported == 2  # type: ignore[arg-type]
    with pytest.warns(RuntimeWarning, match=r"on 1 step\(s\)"):
        kf.step.report_skipped(back)
    # a file written before the counters existed: no keys, no metadata fields
    d = kf.state_to_dict(_setup()[0])
    meta = json.loads(bytes(d["__kfac_meta__"].tolist()).decode())
    for entry in meta["layers"]:
        del entry["grad_skips"], entry["grad_skips_reported"]
    d["__kfac_meta__"] = torch.tensor(list(json.dumps(meta).encode()), dtype=torch.uint8)
    old = kf.state_from_dict(d, like=like)
    assert all(ls.grad_skips is None and ls.grad_skips_reported == 0 for ls in old.layers.values())


def test_bad_settings_are_refused() -> None:
    state, grads, _ = _setup()
    with pytest.raises(ValueError, match="nonfinite='skip'"):
        kf.update(state, grads, sync_free=True, nonfinite="raise", **PRECONDITION_ONLY)
    with pytest.raises(TypeError, match="sync_free must be a bool"):
        kf.update(state, grads, sync_free="yes", **PRECONDITION_ONLY)  # type: ignore[arg-type]
    short = {k: v for k, v in grads.items() if k != "2.bias"}
    with pytest.raises(ValueError, match=r"layer '2'.*'2\.bias'"):
        kf.step.precondition_grads(state, short, sync_free=True)
    with pytest.raises(ValueError, match=r"layer '2'.*'2\.bias'"):
        kf.update(state, short, sync_free=True, **PRECONDITION_ONLY)
    with pytest.raises(ValueError, match="sync_free=True as well"):
        kf.KFACPreconditioner(_mlp(), settings=kf.Settings(compile=True))
    with pytest.raises(TypeError, match="compile must be a bool"):
        kf.KFACPreconditioner(_mlp(), settings=kf.Settings(sync_free=True, compile=1))  # type: ignore[arg-type]


def test_update_distributed_one_rank_equals_default() -> None:
    state, grads, _ = _setup()
    plan = kf.distributed.make_plan(kf.register(_mlp()), world_size=1)
    comm = kf.distributed.Communicator(plan)
    kw: dict[str, Any] = {"plan": plan, "comm": comm, **PRECONDITION_ONLY}
    ref, _ = kf.distributed.update_distributed(state, grads, **kw)
    got, _ = kf.distributed.update_distributed(state, grads, sync_free=True, **kw)
    _assert_equal(ref, got)
    bad = dict(grads)
    bad["0.bias"] = torch.full_like(grads["0.bias"], NAN)
    with pytest.warns(RuntimeWarning, match="layer '0'"):
        ref, _ = kf.distributed.update_distributed(state, bad, **kw)
    got, new = kf.distributed.update_distributed(state, bad, sync_free=True, **kw)
    for k in got:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-12, atol=0, equal_nan=True)
    assert int(new.layers["0"].grad_skips) == 1  # type: ignore[arg-type]


def _adapter_run(sync_free: bool, method: str, nan_at: int | None) -> tuple[list[Any], Any]:
    model = _mlp()
    pre = kf.KFACPreconditioner(
        model,
        factor_update_steps=3,
        inv_update_steps=3,
        damping=1e-2,
        compute_method=method,
        settings=kf.Settings(sync_free=sync_free),
    )
    gen = torch.Generator().manual_seed(2)
    x, y = torch.randn(64, 6, generator=gen), torch.randint(0, 3, (64,), generator=gen)
    out = []
    for i in range(5):
        F.cross_entropy(model(x * (1 + 0.1 * i)), y).backward()
        if i == nan_at:
            model[2].weight.grad[0, 0] = NAN  # type: ignore[index]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", RuntimeWarning)
            pre.step()
        out.append(
            ([p.grad.clone() for p in model.parameters()], [str(w.message) for w in caught])  # type: ignore[union-attr]
        )
        model.zero_grad()
    return out, pre


@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_adapter_equals_default_and_skips_the_same_layer(method: str) -> None:
    ref, _ = _adapter_run(False, method, None)
    got, _ = _adapter_run(True, method, None)
    for (a, _), (b, _) in zip(ref, got):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    ref, _ = _adapter_run(False, method, 1)
    got, pre = _adapter_run(True, method, 1)
    assert any("layer '2'" in w for w in ref[1][1])  # the default warns at once
    assert not any("layer '2'" in w for w in got[1][1])
    assert not any("layer '2'" in w for w in got[2][1])
    assert not any("layer '2'" in w for w in got[3][1])  # nor the factor step 3
    grads_ref, grads_got = ref[1][0], got[1][0]
    assert torch.isnan(grads_got[2][0, 0]) and torch.isnan(grads_ref[2][0, 0])
    for x, y in zip(grads_ref, grads_got):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=0, equal_nan=True)
    with pytest.warns(RuntimeWarning, match=r"layer '2'.* on 1 step\(s\)"):
        assert pre.report_skipped() == {"2": 1}
    assert pre.report_skipped() == {}
    assert int(pre.state.layers["2"].grad_skips) == 1  # type: ignore[arg-type]


# ----------------------------------------------------------------- two ranks, gloo


def _worker(rank: int, world: int, tmp: str) -> None:
    with gloo_group(rank, world, tmp), record_errors(Path(tmp, f"rank{rank}.error")):
        _, grads, caps = _setup()
        layers = kf.register(_mlp())
        results = {}
        for strategy in (
            kf.distributed.DistributedStrategy.COMM_OPT,
            kf.distributed.DistributedStrategy.MEM_OPT,
        ):
            plan = kf.distributed.make_plan(layers, world_size=world, grad_worker_fraction=strategy)
            comm = kf.distributed.Communicator(plan)
            _, s = kf.distributed.update_distributed(
                kf.init(layers), grads, plan=plan, comm=comm, captures=caps, damping=1e-2
            )
            kw: dict[str, Any] = {"plan": plan, "comm": comm, **PRECONDITION_ONLY}
            bad = dict(grads)
            bad["4.weight"] = torch.full_like(grads["4.weight"], NAN)
            ref, _ = kf.distributed.update_distributed(s, grads, **kw)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                ref_bad, _ = kf.distributed.update_distributed(s, bad, **kw)
            got, _ = kf.distributed.update_distributed(s, grads, sync_free=True, **kw)
            got_bad, new = kf.distributed.update_distributed(s, bad, sync_free=True, **kw)
            skips = {
                n: None if ls.grad_skips is None else int(ls.grad_skips)
                for n, ls in new.layers.items()
            }
            results[strategy.name] = (ref, ref_bad, got, got_bad, skips, plan.broadcast_gradients)
        torch.save(results, Path(tmp, f"rank{rank}.pt"))


def test_two_ranks_equal_default_with_and_without_broadcast(tmp_path: Path) -> None:
    spawn(_worker, 2, tmp_path)
    for rank in range(2):
        results = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert {r[-1] for r in results.values()} == {False, True}  # both paths ran
        for ref, ref_bad, got, got_bad, skips, _ in results.values():
            _assert_equal(ref, got)
            for k in got_bad:
                torch.testing.assert_close(
                    got_bad[k], ref_bad[k], rtol=1e-12, atol=0, equal_nan=True
                )
            assert torch.isnan(got_bad["4.weight"]).all()
            assert skips["4"] in (1, None)  # counted where the layer was preconditioned


def test_adapter_state_dict_keeps_the_counters() -> None:
    _, pre = _adapter_run(True, "eigen", 1)
    _, fresh = _adapter_run(True, "eigen", None)
    fresh.load_state_dict(pre.state_dict())
    for name, ls in pre.state.layers.items():
        got = fresh.state.layers[name]
        assert torch.equal(got.grad_skips, ls.grad_skips), name  # type: ignore[arg-type]
        assert got.grad_skips_reported == ls.grad_skips_reported
    assert int(fresh.state.layers["2"].grad_skips) == 1  # type: ignore[arg-type]
