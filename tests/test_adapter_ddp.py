"""`KFACPreconditioner` under DistributedDataParallel on 2 gloo ranks.

One spawn for the module (a module-scoped fixture); inside it every configuration runs:
each KAISA strategy (the presets and float fractions, which at world 2 all resolve to
COMM_OPT or MEM_OPT) x compute method, plus split factor owners, symmetry-aware packing,
unbucketed all-reduces and factors built at ``step()``. Each rank trains the same model on
its half of every global batch with the adapter, exactly as a kfac-pytorch user would
(DDP averages the gradients in ``backward``). The parent trains the same configuration
with the adapter on one process on the whole global batch; the preconditioned gradients
and parameters must agree to 1e-6 (float64) and be bit-identical on the two ranks.

Workers write one ``torch.save`` file per rank; the parent asserts on them. An exception in
a worker makes ``spawn`` raise with the worker's traceback, which fails the tests.
"""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from gloo import gloo_group, one_thread, record_errors, spawn
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from kfac_func import KFACPreconditioner, Settings
from kfac_func.distributed import DistributedStrategy
from kfac_func.distributed.plan import resolve_grad_workers

WORLD = 2
STEPS = 5
LOCAL_BATCH = 3  # examples per rank (not a power of two)
LR = 0.1
TOL = 1e-6
F64 = torch.float64
METHODS = (("eigen", True), ("eigen", False), ("inverse", False))
FRACTIONS: tuple[DistributedStrategy | float, ...] = (
    DistributedStrategy.COMM_OPT,
    DistributedStrategy.MEM_OPT,
    DistributedStrategy.HYBRID_OPT,  # 0.5 of 2 ranks: groups of one, i.e. MEM_OPT
    0.5,
    1.0,
    0.0,  # 1/world_size
)


def configs() -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for fraction in FRACTIONS:
        for method, outer in METHODS:
            out.append(
                dict(
                    grad_worker_fraction=fraction,
                    compute_method=method,
                    compute_eigenvalue_outer_product=outer,
                )
            )
    # A and G decomposed on different ranks (needs no eigenvalue outer product)
    out.append(dict(colocate_factors=False, compute_eigenvalue_outer_product=False))
    out.append(
        dict(
            colocate_factors=False, compute_method="inverse", compute_eigenvalue_outer_product=False
        )
    )
    out.append(dict(symmetry_aware=True, allreduce_bucket_cap_mb=0))
    out.append(dict(grad_worker_fraction=DistributedStrategy.MEM_OPT, symmetry_aware=True))
    out.append(dict(update_factors_in_hook=False))
    out.append(dict(grad_worker_fraction=0.0, update_factors_in_hook=False))
    return out


CONFIGS = configs()


def label(cfg: dict[str, Any]) -> str:
    parts = []
    for k, v in cfg.items():
        parts.append(f"{k}={v.name if isinstance(v, DistributedStrategy) else v}")
    return ", ".join(parts)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, groups=2),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(4 * 4 * 4, 8),
        nn.ReLU(),
        nn.Linear(8, 3),
    ).double()


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    n = LOCAL_BATCH * WORLD
    return torch.randn(n, 2, 6, 6, generator=g, dtype=F64), torch.randint(0, 3, (n,), generator=g)


def make_preconditioner(model: nn.Module, cfg: dict[str, Any]) -> KFACPreconditioner:
    return KFACPreconditioner(
        model,
        factor_update_steps=2,
        inv_update_steps=3,
        damping=0.01,
        factor_decay=0.9,
        kl_clip=1e-2,
        lr=LR,
        settings=Settings(scaling="fisher"),
        factor_dtype=F64,
        inv_dtype=F64,
        **cfg,
    )


def train(model: nn.Module, pre: KFACPreconditioner, rank: int | None) -> dict[str, Any]:
    """STEPS steps of SGD on preconditioned gradients; ``rank`` None: the whole batch."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    grads = []
    in_flight = []
    for step in range(STEPS):
        x, y = global_batch(step)
        if rank is not None:
            sl = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
            x, y = x[sl], y[sl]
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        in_flight.append(pre.reductions_in_flight)
        pre.step()
        grads.append({strip(n): p.grad.detach().clone() for n, p in model.named_parameters()})
        opt.step()
    sd = pre.state_dict()
    return {
        "grads": grads,
        "in_flight": in_flight,
        "in_hook": pre.update_factors_in_hook,
        "params": {strip(n): p.detach().clone() for n, p in model.named_parameters()},
        "factors": {strip(n): (e["A"].clone(), e["G"].clone()) for n, e in sd["layers"].items()},
        "steps": pre.steps,
        "world_size": pre.plan.world_size,
        "strategy": pre.plan.strategy.name,
        "colocate": pre.plan.colocate_factors,
        "layers": [strip(n) for n in pre.layers],
    }


def strip(name: str) -> str:
    return name.removeprefix("module.")


def _worker(rank: int, world: int, tmp: str) -> None:
    with (
        gloo_group(rank, world, tmp, timeout=timedelta(seconds=60)),
        record_errors(Path(tmp, f"rank{rank}.error")),
    ):
        t0 = time.perf_counter()
        results = []
        for cfg in CONFIGS:
            ddp = DistributedDataParallel(make_model())
            pre = make_preconditioner(ddp, cfg)
            results.append(train(ddp, pre, rank))
            pre.remove()
        torch.save(
            {"rank": rank, "configs": results, "seconds": time.perf_counter() - t0},
            Path(tmp, f"rank{rank}.pt"),
        )


@pytest.fixture(scope="module")
def spawned(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("adapter_ddp")
    t0 = time.perf_counter()
    spawn(_worker, WORLD, tmp)
    results = [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    print(
        f"\nadapter DDP world {WORLD}: spawn {time.perf_counter() - t0:.1f} s "
        f"(rank 0 after start: {results[0]['seconds']:.1f} s)"
    )
    return results


@pytest.fixture(scope="module")
def reference() -> list[dict[str, Any]]:
    """The adapter on one process (no process group) on the whole global batch."""
    with one_thread():
        out = []
        for cfg in CONFIGS:
            model = make_model()
            out.append(train(model, make_preconditioner(model, cfg), None))
        return out


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b)
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_every_configuration_ran_with_a_world_2_plan(spawned: list[dict[str, Any]]) -> None:
    strategies = set()
    for r in spawned:
        assert len(r["configs"]) == len(CONFIGS)
        for cfg, res in zip(CONFIGS, r["configs"]):
            assert res["world_size"] == WORLD, label(cfg)  # the default process group's
            assert res["steps"] == STEPS
            fraction = cfg.get("grad_worker_fraction", DistributedStrategy.COMM_OPT)
            expected = resolve_grad_workers(fraction, WORLD)[2]
            assert res["strategy"] == expected.name, label(cfg)
            strategies.add(res["strategy"])
    assert strategies == {"COMM_OPT", "MEM_OPT"}
    assert {res["colocate"] for res in spawned[0]["configs"]} == {True, False}


def test_ddp_training_matches_single_process_adapter(
    spawned: list[dict[str, Any]], reference: list[dict[str, Any]]
) -> None:
    bad, worst = [], 0.0
    for r in spawned:
        for cfg, res, ref in zip(CONFIGS, r["configs"], reference):
            assert res["layers"] == ref["layers"]
            err = max(max_diff(g, h) for g, h in zip(res["grads"], ref["grads"]))
            err = max(err, max_diff(res["params"], ref["params"]))
            worst = max(worst, err)
            if not err < TOL:
                bad.append(f"rank {r['rank']} {label(cfg)}: {err:.3e}")
    print(f"\nmax |DDP adapter - single-process adapter| = {worst:.2e}")
    assert not bad, "\n".join(bad)


def test_ranks_hold_identical_parameters_and_gradients(spawned: list[dict[str, Any]]) -> None:
    r0, r1 = spawned
    for cfg, a, b in zip(CONFIGS, r0["configs"], r1["configs"]):
        for k in a["params"]:
            assert torch.equal(a["params"][k], b["params"][k]), (label(cfg), k)
        for step, (ga, gb) in enumerate(zip(a["grads"], b["grads"])):
            for k in ga:
                assert torch.equal(ga[k], gb[k]), (label(cfg), step, k)


def test_rank0_state_dict_holds_the_global_factors(
    spawned: list[dict[str, Any]], reference: list[dict[str, Any]]
) -> None:
    """kfac-pytorch users save checkpoints on rank 0 only: its ``state_dict()`` must hold
    every layer's current factors, whichever rank owns the layer's decomposition."""
    bad = []
    for cfg, res, ref in zip(CONFIGS, spawned[0]["configs"], reference):
        for name, (a, g) in ref["factors"].items():
            a0, g0 = res["factors"][name]
            err = max(float((a0 - a).abs().max()), float((g0 - g).abs().max()))
            if not err < TOL:
                bad.append(f"{label(cfg)} [{res['strategy']}] layer {name!r}: {err:.3e}")
    assert not bad, "\n".join(bad)


def test_factor_reductions_start_in_the_backward_pass(spawned: list[dict[str, Any]]) -> None:
    """With update_factors_in_hook, every layer's reduction is launched from the hooks on
    factor-update steps (overlapping the backward pass); otherwise none is."""
    for r in spawned:
        for c in r["configs"]:
            for step, names in enumerate(c["in_flight"]):
                if c["in_hook"] and step % 2 == 0:  # factor_update_steps=2
                    assert [strip(n) for n in names] == c["layers"]
                else:
                    assert names == []
