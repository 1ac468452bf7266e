"""Every step kind compiled whole: factor steps, decomposition steps and precondition-only
steps of ``sync_free=True`` run through ``torch.compile(fullgraph=True)`` (eigh inside the
graph) and equal the eager step; eagerly they read nothing on the host.

``fullgraph=True`` fails on any graph break, so a host read inside the step (``.item()``,
``.tolist()``, ``bool(t)``) would fail these tests; the eager sync-free steps are counted
with :class:`tests.test_host_syncs.SyncCount` (a dispatch mode, which compiled code does
not run under).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from numerics import (
    assert_close_to_scale,
    assert_close_where_determined,
    damped_rtol,
    eigenvector_sensitivity,
    moments_tolerance,
)
from test_host_syncs import SyncCount
from torch import nn

import kfac_func as kf

NAN = float("nan")

# (update_factors, update_inverses) of the steps: every kind, twice, from the first step
SCHEDULE = [
    (True, True),
    (False, False),
    (True, False),
    (False, True),
    (True, True),
    (False, False),
]


def _mlp(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
        nn.Linear(8, 3),
    ).to(dtype)  # fmt: skip


CASES = {
    "eigen": ({}, {}),
    "inverse": ({"compute_method": "inverse"}, {}),
    "ekfac": ({"compute_method": "ekfac"}, {}),
    "moments-qr": (
        {"eigenbasis_refresh": "qr"},
        {"eigenbasis_moments": True, "moment_beta1": 0.9, "kl_clip": None},
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_every_step_kind_compiles_whole_and_equals_eager(case: str) -> None:
    torch._dynamo.reset()
    init_kw, step_kw = CASES[case]
    model = _mlp(torch.float64)
    layers = kf.register(model)
    states = [
        kf.init(layers, factor_dtype=torch.float64, inv_dtype=torch.float64, **init_kw)
        for _ in range(2)
    ]
    params = dict(model.named_parameters())
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(32, 6, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 3, (32,), generator=gen)
    compiled = torch.compile(kf.update, fullgraph=True)
    for i, (factors, inverses) in enumerate(SCHEDULE):
        _, grads, caps = kf.capture(
            model, params, x * (1 + 0.1 * i), lambda out: F.cross_entropy(out, y)
        )
        kw: dict[str, Any] = {
            "captures": caps if factors else None,
            "update_factors": factors,
            "update_inverses": inverses,
            "damping": 1e-2,
            "sync_free": True,
            **step_kw,
        }
        with SyncCount() as sc:
            ref, states[0] = kf.update(states[0], grads, **kw)
        assert sc.count == 0, (i, factors, inverses)
        got, states[1] = compiled(states[1], grads, **kw)
        # the compiled kernels round otherwise: Adam's step in the eigenbasis compared
        # where the factors determine it (softmax's gradient sums to zero: G of the head
        # has a null direction; the eigenvectors' rounding as moments_tolerance derives),
        # the damped steps to their condition number
        if step_kw.get("eigenbasis_moments"):
            tol = moments_tolerance(states[0], torch.float64)
            assert_close_where_determined(got, ref, states[0], **tol)
        else:
            rtol = damped_rtol(states[0], 1e-2, torch.float64)
            if init_kw.get("compute_method") == "ekfac":
                rtol *= eigenvector_sensitivity(states[0])
            assert_close_to_scale(got, ref, rtol=min(rtol, 1e-6))
        assert not torch.equal(got["0.weight"], grads["0.weight"])
    for name, ls in states[1].layers.items():
        other = states[0].layers[name]
        torch.testing.assert_close(ls.a_factor, other.a_factor, rtol=1e-12, atol=1e-14)
        assert ls.factor_updates == other.factor_updates == 3


def _adapter_run(compile: bool, nan_at: int | None = None) -> tuple[list[list[torch.Tensor]], Any]:
    model = _mlp(torch.float32)
    pre = kf.KFACPreconditioner(
        model,
        factor_update_steps=2,
        inv_update_steps=4,
        settings=kf.Settings(sync_free=True, compile=compile),
    )
    gen = torch.Generator().manual_seed(2)
    x, y = torch.randn(32, 6, generator=gen), torch.randint(0, 3, (32,), generator=gen)
    out = []
    stats = torch._dynamo.utils.counters["stats"]
    for i in range(10):
        if i == 6:
            graphs = stats["unique_graphs"]
        if i == nan_at:  # a NaN input: the batch factors of layer 0 hold NaN this step
            x_i = x.clone()
            x_i[0, 0] = NAN
            loss = F.cross_entropy(model(x_i), y)
        else:
            loss = F.cross_entropy(model(x * (1 + 0.05 * i)), y)
        loss.backward()
        for p in model.parameters():
            p.grad = torch.nan_to_num(p.grad)  # type: ignore[arg-type]
        pre.step()
        out.append([p.grad.clone() for p in model.parameters()])  # type: ignore[union-attr]
        model.zero_grad()
    # every step kind was met by step 6: nothing compiles after it
    assert stats["unique_graphs"] == graphs
    return out, pre


@pytest.mark.slow
def test_the_adapter_compiles_every_step_kind_and_equals_eager() -> None:
    """``compile=True`` runs factor, decomposition and precondition-only steps compiled
    (float32: 1e-6), a batch whose factors hold NaN included: skipped on the device
    there, counted and reported as the eager sync-free step reports it."""
    torch._dynamo.reset()
    for nan_at in (None, 4):
        ref, pre_ref = _adapter_run(False, nan_at)
        got, pre_got = _adapter_run(True, nan_at)
        for a, b in zip(ref, got):
            for x, y in zip(a, b):
                torch.testing.assert_close(y, x, rtol=1e-6, atol=1e-6)
        if nan_at is not None:
            for pre in (pre_ref, pre_got):
                with pytest.warns(RuntimeWarning, match=r"layer '0'.* batch factors of 1"):
                    pre.report_skipped()
                assert pre.state.layers["0"].skipped_updates == 1
                assert pre.state.layers["0"].factor_updates == 4


def test_sync_free_adapter_reads_nothing_in_any_step_kind() -> None:
    model = _mlp(torch.float32)
    pre = kf.KFACPreconditioner(
        model, factor_update_steps=2, inv_update_steps=4, settings=kf.Settings(sync_free=True)
    )
    gen = torch.Generator().manual_seed(2)
    x, y = torch.randn(32, 6, generator=gen), torch.randint(0, 3, (32,), generator=gen)
    counts = []
    for i in range(9):  # factors at even steps, decompositions every fourth
        F.cross_entropy(model(x * (1 + 0.05 * i)), y).backward()
        with SyncCount() as sc:
            pre.step()
        counts.append(sc.count)
        model.zero_grad()
    assert counts == [0] * 9


def test_a_batch_skipped_on_the_device_equals_the_default_skip() -> None:
    """The first factor update of a ``"fisher"`` layer is all NaN: the default step skips
    it with a warning; the sync-free step keeps the (zero) factors on the device, leaves
    the layer's gradient unchanged (its decomposition is not ``usable``) and takes the
    next batch as its first. Both then give the same gradients, factors and counters."""
    model = _mlp(torch.float64)
    layers = kf.register(model)
    params = dict(model.named_parameters())
    states = {
        sf: kf.init(layers, factor_dtype=torch.float64, inv_dtype=torch.float64)
        for sf in (False, True)
    }
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(32, 6, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 3, (32,), generator=gen)
    for i, grouped in enumerate([True, False, True, True]):
        _, grads, caps = kf.capture(
            model, params, x * (1 + 0.1 * i), lambda out: F.cross_entropy(out, y)
        )
        if i == 0:
            lc = caps.layers["2"]
            poisoned = tuple(torch.full_like(t, NAN) for t in lc.inputs)
            caps.layers["2"] = dataclasses.replace(lc, inputs=poisoned)
        outs = {}
        for sf in (False, True):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                outs[sf], states[sf] = kf.update(
                    states[sf], grads, captures=caps, sync_free=sf, grouped=grouped, damping=1e-2
                )
            assert any("layer '2'" in str(w.message) for w in caught) == (i == 0 and not sf)
        for k in grads:
            torch.testing.assert_close(outs[True][k], outs[False][k], rtol=1e-12, atol=1e-14)
        if i == 0:
            assert torch.equal(outs[True]["2.weight"], grads["2.weight"])
            assert not bool(states[True].layers["2"].usable)
    with pytest.warns(RuntimeWarning, match=r"layer '2'.* batch factors of 1 factor update"):
        _, settled = kf.step.report_skipped(states[True])
    for name, ls in settled.layers.items():
        other = states[False].layers[name]
        assert (ls.factor_updates, ls.skipped_updates) == (
            other.factor_updates,
            other.skipped_updates,
        )
        torch.testing.assert_close(ls.a_factor, other.a_factor, rtol=1e-12, atol=1e-14)


def test_a_decomposition_that_is_not_finite_keeps_the_previous_one() -> None:
    """A finite factor whose eigenvalues overflow float32: the sync-free decomposition
    step keeps the layer's previous decomposition (and its preconditioning); a layer
    without one is not ``usable`` and its gradient passes unchanged. A later default
    step drops the unusable decomposition (as the checked step never made one)."""
    model = _mlp(torch.float32)
    layers = kf.register(model)
    state = kf.init(layers, convention="kfac-pytorch")
    params = dict(model.named_parameters())
    x, y = torch.randn(32, 6), torch.randint(0, 3, (32,))
    _, grads, _ = kf.capture(model, params, x, lambda out: F.cross_entropy(out, y))
    huge = torch.full_like(state.layers["0"].a_factor, 3e38)
    fresh = state.replace(layers={**state.layers, "0": state.layers["0"].replace(a_factor=huge)})
    out, new = kf.update(fresh, grads, update_factors=False, sync_free=True, damping=1e-2)
    assert not bool(new.layers["0"].usable) and bool(new.layers["2"].usable)
    assert torch.equal(out["0.weight"], grads["0.weight"])
    assert not torch.equal(out["2.weight"], grads["2.weight"])
    plain = kf.step.precondition_grads(new, grads, damping=1e-2)  # checked on the host: the same
    assert torch.equal(plain["0.weight"], grads["0.weight"])
    assert not torch.equal(plain["2.weight"], grads["2.weight"])
    _, good = kf.update(state, grads, update_factors=False, sync_free=True, damping=1e-2)
    bad = good.replace(layers={**good.layers, "0": good.layers["0"].replace(a_factor=huge)})
    out, kept = kf.update(bad, grads, update_factors=False, sync_free=True, damping=1e-2)
    ref, _ = kf.update(good, grads, update_factors=False, update_inverses=False, sync_free=True)
    assert bool(kept.layers["0"].usable)
    assert torch.equal(kept.layers["0"].decomposition.qa, good.layers["0"].decomposition.qa)  # type: ignore[union-attr]
    torch.testing.assert_close(out["0.weight"], ref["0.weight"], rtol=1e-6, atol=0)
    with pytest.warns(RuntimeWarning, match="layer '0': could not decompose"):
        # the checked step decomposes the layer again, and fails as the device did
        _, settled = kf.update(new, grads, update_factors=False, update_inverses=False)
    assert settled.layers["0"].decomposition is None and settled.layers["0"].usable is None


def test_device_decisions_survive_save_and_load(tmp_path: Any) -> None:
    model = _mlp(torch.float32)
    layers = kf.register(model)
    params = dict(model.named_parameters())
    x, y = torch.randn(32, 6), torch.randint(0, 3, (32,))
    _, grads, caps = kf.capture(model, params, x, lambda out: F.cross_entropy(out, y))
    _, state = kf.update(kf.init(layers), grads, captures=caps, sync_free=True)
    flat = kf.state_to_dict(state, include_decompositions=True)
    back = kf.state_from_dict(flat, like=kf.init(layers))
    for name, ls in state.layers.items():
        for field in ("factor_skips", "usable"):
            a, b = getattr(ls, field), getattr(back.layers[name], field)
            assert a is not None and b is not None and torch.equal(a, b), (name, field)
    pre = kf.KFACPreconditioner(model, settings=kf.Settings(sync_free=True))
    F.cross_entropy(model(x), y).backward()
    pre.step()
    other = kf.KFACPreconditioner(_mlp(torch.float32), settings=kf.Settings(sync_free=True))
    other.load_state_dict(pre.state_dict())
    for name, ls in pre.state.layers.items():
        assert torch.equal(ls.usable, other.state.layers[name].usable)  # type: ignore[arg-type]
