"""The grouped step (layers of one shape preconditioned together) against the per-layer
step, on model code this project did not write (the fixtures of :mod:`test_real_models`)
and on deep stacks: the same gradients and states (float64 1e-12, float32 1e-6), the
same warnings, and operations per step that do not grow with depth."""

from __future__ import annotations

import warnings
from collections import Counter
from typing import Any

import pytest
import torch
from fixture_models import FIXTURES, Fixture, T
from numerics import (
    assert_close_where_determined,
    assert_same_states,
    damped_rtol,
    moments_tolerance,
)
from settings_keywords import with_settings
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import kfac_func as kf
from kfac_func.core.stacks import stacked
from kfac_func.step.grouping import grouped_here, plan_groups

pytest.importorskip("transformers")

F64 = torch.float64
SETTINGS: dict[str, dict[str, Any]] = {
    "eigen": {"kl_clip": 1e-2},
    "eigen-damped-later": {"kl_clip": None, "damping": lambda k: 0.01 * (k + 1)},
    "moments": {"eigenbasis_moments": True, "moment_beta1": 0.9, "kl_clip": None},
    "eigen-sync-free": {"sync_free": True, "kl_clip": 1e-2},
    "moments-sync-free": {"eigenbasis_moments": True, "sync_free": True, "kl_clip": None},
}
METHODS = ("eigen", "inverse", "ekfac")
TOL: dict[str, float] = {"rel": 1e-9, "rtol": 1e-12, "atol": 1e-14}
"""float64: K-FAC's damped step is a continuous function of its inputs; compared where A's
and G's eigenvalues exceed 1e-9 of the largest (above the rounding noise of a null
direction, about 1e-16 of the largest) to a few hundred units of rounding, raised by
:func:`damped_tolerance` to what the conditioning of the damped preconditioner allows."""


def damped_tolerance(state: kf.KFACState) -> dict[str, float]:
    """:data:`TOL` with ``atol`` (relative to the step's largest entry) raised to
    :func:`numerics.damped_rtol` of ``state`` at the smallest damping of :data:`SETTINGS`
    (0.01): a rounding ``u`` of the factors comes out of ``(G ⊗ A + λI)⁻¹`` (eigen, inverse
    and EKFAC alike) as up to ``u · κ``, ``κ = (λ_max(G)·λ_max(A) + λ) / λ``. Measured on an
    AMD EPYC CPU's BLAS: GPT-2's first attention projection, ``κ = 2.0e3``, differs by
    1.5e-13 of its largest entry, where ``64 · u · κ`` allows 1.4e-11 (an absolute 1e-14
    did not). A damping 1% off moves the step by about 1e-4 of it, a missing layer by all
    of it."""
    return {**TOL, "atol": max(TOL["atol"], damped_rtol(state, 0.01, F64))}


def _register(fx: Fixture, model: nn.Module) -> kf.LayerTable:
    return kf.register(model, **({} if fx.kinds is None else {"kinds": fx.kinds}))


def _steps(
    fx: Fixture, dtype: torch.dtype, method: str, setting: dict[str, Any], grouped: bool
) -> list[tuple[dict[str, torch.Tensor], kf.KFACState]]:
    """Three steps of ``kf.update`` on the fixture: two that update the factors (the first
    takes the batch's, the second averages) and the decompositions, then one that only
    preconditions (with the moments of the second)."""
    model = fx.build(dtype)
    table = _register(fx, model)
    state = kf.init(table, compute_method=method, factor_dtype=dtype, inv_dtype=dtype)
    params = {k: v.detach() for k, v in model.named_parameters()}
    out = []
    for step in range(3):
        batch = fx.batch(step, 4)
        _, grads, caps = kf.capture(
            model, params, (), fx.loss, layers=table, kwargs=batch, loss_divisor=T
        )
        new, state = kf.update(
            state,
            grads,
            captures=caps,
            update_factors=step < 2,
            update_inverses=step < 2,
            lr=0.1,
            grouped=grouped,
            **{"damping": 0.01, **setting},
        )
        out.append((new, state))
    return out


@pytest.mark.parametrize("setting", sorted(SETTINGS))
@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_grouped_equals_per_layer_on_fixture_models(name: str, setting: str) -> None:
    fx = FIXTURES[name]
    methods = ("eigen",) if SETTINGS[setting].get("eigenbasis_moments") else METHODS
    for method in methods if setting == "eigen" else ("eigen",):
        grouped = _steps(fx, F64, method, SETTINGS[setting], grouped=True)
        per_layer = _steps(fx, F64, method, SETTINGS[setting], grouped=False)
        for (g1, s1), (g2, s2) in zip(grouped, per_layer):
            # Adam's step in an eigenbasis (the moments) is unique only where the factors
            # determine it (see numerics): compared there, the rest entry by entry
            if SETTINGS[setting].get("eigenbasis_moments"):
                tol = moments_tolerance(s2, F64)
            else:
                tol = damped_tolerance(s2)
            assert_close_where_determined(g1, g2, s2, **tol)
            assert_same_states(s1, s2, **tol)
        # the fixture has groups: the step did not fall back to one layer at a time
        state = grouped[-1][1]
        grads = grouped[-1][0]
        plan = plan_groups(state.layers, list(state.layers), grads)
        assert max(len(g) for g in plan) >= 2, plan


def test_grouped_equals_per_layer_in_float32() -> None:
    """In float32 Adam's step in an eigenbasis turns the rounding noise of a null direction
    into a step as large as any other (see numerics): the comparison is of the moments
    where the factors determine the step (eigenvalues above 1e-3 of the largest, many
    float32 units of rounding away from the noise), at float32's tolerance, raised to what
    the rounding of the eigenvectors allows (:func:`numerics.moments_tolerance`)."""
    fx = FIXTURES["gpt2"]
    setting = SETTINGS["moments"]
    grouped = _steps(fx, torch.float32, "eigen", setting, grouped=True)
    per_layer = _steps(fx, torch.float32, "eigen", setting, grouped=False)
    for (g1, _), (g2, s2) in zip(grouped, per_layer):
        tol = moments_tolerance(s2, torch.float32, rel=1e-3, gap=1e-2)
        assert_close_where_determined(g1, g2, s2, **{**tol, "rtol": 1e-4})


def _deep(depth: int) -> nn.Module:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8)) for _ in range(depth)]
    return nn.Sequential(nn.Linear(4, 8), *blocks, nn.LayerNorm(8), nn.Linear(8, 3))


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def _precondition_ops(depth: int, grouped: bool, **kw: Any) -> Counter[str]:
    model = _deep(depth)
    params = {k: v.detach() for k, v in model.named_parameters()}
    state = kf.init(kf.register(model))
    x, y = torch.randn(32, 4), torch.randn(32, 3)
    _, grads, caps = kf.capture(model, params, x, lambda out: (out - y).pow(2).mean())
    _, state = kf.update(state, grads, captures=caps, **kw)
    with _Ops() as counter:
        kf.update(state, grads, update_factors=False, update_inverses=False, grouped=grouped, **kw)
    return counter.ops


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"sync_free": True},
        {"eigenbasis_moments": True, "moment_beta1": 0.9, "kl_clip": None},
        {"eigenbasis_moments": True, "sync_free": True, "kl_clip": None},
    ],
    ids=["eigen", "sync-free", "moments", "moments-sync-free"],
)
def test_operations_of_the_grouped_step_do_not_grow_with_depth(kw: dict[str, Any]) -> None:
    shallow, deep = _precondition_ops(2, True, **kw), _precondition_ops(8, True, **kw)
    assert shallow == deep
    # what grouping saves: layer by layer, a model of 16 blocks takes more than twice the
    # operations of the grouped step (the same at every depth, as asserted above)
    per_layer = _precondition_ops(16, False, **kw)
    assert sum(per_layer.values()) > 2 * sum(deep.values())


def _adapter_ops(depth: int, **kw: Any) -> int:
    """The operations of the adapter's second, precondition-only step on ``_deep(depth)``."""
    model = _deep(depth)
    pre = kf.KFACPreconditioner(
        model, factor_update_steps=5, inv_update_steps=5, **with_settings(**kw)
    )
    for _ in range(2):
        model.zero_grad()
        model(torch.randn(32, 4)).pow(2).mean().backward()
        with _Ops() as counter:
            pre.step()
    return sum(counter.ops.values())


def test_adapter_step_operations_do_not_grow_with_depth() -> None:
    assert _adapter_ops(2, grouped=True) == _adapter_ops(8, grouped=True)
    assert _adapter_ops(2, grouped=True, sync_free=True) == _adapter_ops(
        8, grouped=True, sync_free=True
    )


def test_layers_group_by_default_on_accelerators_only() -> None:
    layers = kf.register(nn.Linear(2, 2))
    cpu, meta = kf.init(layers).layers, kf.init(layers, device="meta").layers
    assert (grouped_here(None, cpu), grouped_here(None, meta)) == (False, True)
    assert (grouped_here(True, cpu), grouped_here(False, meta)) == (True, False)
    assert _adapter_ops(8) > 2 * _adapter_ops(2)  # on a CPU, layer by layer


def test_a_non_finite_layer_of_a_group_is_skipped_alone() -> None:
    model = _deep(3)
    params = {k: v.detach() for k, v in model.named_parameters()}
    state = kf.init(kf.register(model))
    x, y = torch.randn(32, 4), torch.randn(32, 3)
    _, grads, caps = kf.capture(model, params, x, lambda out: (out - y).pow(2).mean())
    _, state = kf.update(state, grads, captures=caps, eigenbasis_moments=True, kl_clip=None)
    bad = dict(grads)
    bad["2.0.weight"] = grads["2.0.weight"].clone()
    bad["2.0.weight"][0, 0] = float("nan")
    kw: dict[str, Any] = {
        "update_factors": False,
        "update_inverses": False,
        "eigenbasis_moments": True,
        "kl_clip": None,
    }
    results = {}
    for grouped in (True, False):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            results[grouped] = kf.update(state, bad, grouped=grouped, **kw)
        assert [str(w.message).split(":")[0] for w in caught] == ["layer '2.0'"]
    (g1, s1), (g2, s2) = results[True], results[False]
    assert g1["2.0.weight"] is bad["2.0.weight"]  # passed unchanged
    for k in g1:
        torch.testing.assert_close(g1[k], g2[k], rtol=1e-6, atol=1e-7, equal_nan=True)
    assert [ls.moment_count for ls in s1.layers.values()] == [
        ls.moment_count for ls in s2.layers.values()
    ]
    assert s1.layers["2.0"].moment_count == state.layers["2.0"].moment_count
    assert s1.layers["1.0"].moment_count == state.layers["1.0"].moment_count + 1
    # without host synchronisation the layer is counted, the others are not
    _, s3 = kf.update(state, bad, sync_free=True, **kw)
    skips = {n: int(ls.grad_skips) for n, ls in s3.layers.items() if ls.grad_skips is not None}
    assert skips["2.0"] == 1 and sum(skips.values()) == 1


def test_a_group_is_stacked_once_and_then_reused() -> None:
    model = _deep(3)
    params = {k: v.detach() for k, v in model.named_parameters()}
    state = kf.init(kf.register(model))
    x, y = torch.randn(32, 4), torch.randn(32, 3)
    _, grads, caps = kf.capture(model, params, x, lambda out: (out - y).pow(2).mean())
    _, state = kf.update(state, grads, captures=caps, grouped=False)
    names = ["1.0", "2.0", "3.0"]
    qa = [state.layers[n].decomposition.qa for n in names]  # type: ignore[union-attr]
    assert stacked(qa)[1]  # decomposed one layer at a time: a fresh stack
    kw: dict[str, Any] = {"update_factors": False, "update_inverses": False, "grouped": True}
    g1, once = kf.update(state, grads, **kw)
    qa = [once.layers[n].decomposition.qa for n in names]  # type: ignore[union-attr]
    slab, fresh = stacked(qa)
    assert not fresh and slab.shape[0] == 3  # now views of one stack: no copy
    for n in names:  # the same values
        torch.testing.assert_close(
            once.layers[n].decomposition.qa,  # type: ignore[union-attr]
            state.layers[n].decomposition.qa,  # type: ignore[union-attr]
            rtol=0,
            atol=0,
        )
    g2, _ = kf.update(once, grads, **kw)
    for k in g1:
        assert torch.equal(g1[k], g2[k])


def test_a_non_finite_batch_factor_of_a_group_skips_that_layer_alone() -> None:
    model = _deep(3)
    params = {k: v.detach() for k, v in model.named_parameters()}
    state = kf.init(kf.register(model))
    x, y = torch.randn(32, 4), torch.randn(32, 3)
    _, grads, caps = kf.capture(model, params, x, lambda out: (out - y).pow(2).mean())
    _, state = kf.update(state, grads, captures=caps)
    batch = {
        n: (torch.eye(ls.a_factor.shape[0]), torch.eye(ls.g_factor.shape[0]), 1.0)
        for n, ls in state.layers.items()
        if not any(ls.spec.diagonal)
    }
    batch["2.0"] = (torch.full_like(batch["2.0"][0], float("nan")), batch["2.0"][1], 1.0)
    got = {}
    for grouped in (True, False):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _, got[grouped] = kf.update(
                state, grads, batch_factors=dict(batch), update_inverses=False, grouped=grouped
            )
        assert [str(w.message).split(":")[0] for w in caught] == ["layer '2.0'"]
    for n, ls in got[True].layers.items():
        other = got[False].layers[n]
        assert (ls.factor_updates, ls.skipped_updates) == (
            other.factor_updates,
            other.skipped_updates,
        )
        assert torch.equal(ls.a_factor, other.a_factor) and torch.equal(ls.g_factor, other.g_factor)
    assert got[True].layers["2.0"].skipped_updates == 1
    assert torch.equal(got[True].layers["2.0"].a_factor, state.layers["2.0"].a_factor)


@pytest.mark.slow
def test_compiled_grouped_steps_equal_eager_as_the_counters_change() -> None:
    """The compiled precondition-only step of the adapter (grouped, under vmap) follows
    the step counter and the moments' counts from call to call, equal to eager."""
    kw: dict[str, Any] = {"factor_update_steps": 3, "inv_update_steps": 3, "kl_clip": None}
    settings = kf.Settings(
        scaling="fisher", sync_free=True, eigenbasis_moments=True, moment_beta1=0.9
    )
    models = [_deep(3), _deep(3)]
    pres = [
        kf.KFACPreconditioner(models[0], settings=settings.replace(compile=True), **kw),
        kf.KFACPreconditioner(models[1], settings=settings, **kw),
    ]
    gen = torch.Generator().manual_seed(3)
    for _ in range(7):
        x = torch.randn(32, 4, generator=gen)
        grads = []
        for model, pre in zip(models, pres):
            model.zero_grad()
            model(x).pow(2).mean().backward()
            pre.step()
            grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
        for a, b in zip(*grads):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        with torch.no_grad():  # the same update, so that both runs stay together
            for pa, pb in zip(models[0].parameters(), models[1].parameters()):
                pa.add_(pa.grad, alpha=-0.01)
                pb.add_(pa.grad, alpha=-0.01)


def test_batch_factors_built_together_equal_each_layers_own() -> None:
    """The batch factors of equal-shaped layers, scaled (by different scales) and
    symmetrised as stacks, are each layer's own bit for bit; a layer with two calls or two
    micro-batches takes its own path, one that saw nothing is left out."""
    from kfac_func.blocks import Gram
    from kfac_func.step.batch_factors import (
        MicroBatchStats,
        build_batch_factors,
        factors_from_stats,
    )

    gen = torch.Generator().manual_seed(0)

    def gram(n: int, rows: int, spatial: int = 1) -> Gram:
        x = torch.randn(rows, n, generator=gen)
        return Gram(x.T @ x + 1e-3 * torch.randn(n, n, generator=gen), rows, spatial)

    config = kf.init(kf.register(nn.Linear(2, 2))).config
    wide = kf.register(nn.Linear(4, 3))[""]  # factors of 5 and 3 columns
    narrow = kf.register(nn.Linear(3, 3))[""]
    stats = {
        "a": [MicroBatchStats([gram(5, 8)], [gram(3, 8)], 8, 0.125)],
        "b": [MicroBatchStats([gram(5, 12, 3)], [gram(3, 12, 3)], 4, 0.25)],
        "c": [MicroBatchStats([gram(5, 6)], [gram(3, 6)], 6, 1.0)],
        "two calls": [MicroBatchStats([gram(5, 4), gram(5, 4)], [gram(3, 4), gram(3, 4)], 4, 0.25)],
        "two batches": [
            MicroBatchStats([gram(5, 4)], [gram(3, 4)], 4, 0.25),
            MicroBatchStats([gram(5, 4)], [gram(3, 4)], 4, 0.25),
        ],
        "alone": [MicroBatchStats([gram(4, 4)], [gram(3, 4)], 4, 0.25)],
        "unseen": [MicroBatchStats([], [], 4, 0.25)],
    }
    specs = {n: narrow if n == "alone" else wide for n in stats}
    asked: list[str] = []

    def stats_of(name: str) -> list[MicroBatchStats]:
        asked.append(name)
        return stats[name]

    got = build_batch_factors(specs, stats_of, config)
    assert sorted(asked) == sorted(stats)  # each layer's statistics asked for once
    assert sorted(got) == sorted(set(stats) - {"unseen"})
    for name, (a, g, w, rows) in got.items():
        ref = factors_from_stats(name, stats[name], config)
        assert ref is not None
        assert torch.equal(a, ref.a) and torch.equal(g, ref.g) and w == ref.weight, name
        assert rows == ref.rows, name
    assert got["a"][0]._base is got["c"][0]._base  # one stack
