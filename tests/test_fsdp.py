"""`KFACPreconditioner` on FSDP2 models (``fully_shard``) and HSDP on gloo ranks.

One spawn per world size (2 and 4 ranks); inside it every configuration runs: COMM_OPT,
HYBRID_OPT and MEM_OPT x eigen and inverse, FSDP2 on a 1-D mesh and, on 4 ranks, HSDP on a
2 x 2 mesh (replicate x shard). Each rank trains the same float64 model, sharded per
Linear-bearing block and at the root, on its part of every global batch; the parent trains
the dense model with the adapter on one process on the whole global batch. Gradients after
``step()`` (the DTensor shards gathered with ``full_tensor``) and parameters must agree to
1e-6. The workers also record K-FAC's bytes per rank (MEM_OPT: factors only on the owners)
and what the preconditioner sends, and check that refused placements raise errors that
name the layer.
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
from sharded import (
    EXTRA_CONFIGS,
    F64,
    GLOBAL_BATCH,
    METHODS,
    STRATEGIES,
    global_batch,
    make_preconditioner,
    train,
)
from torch import nn

from kfac_func import KFACPreconditioner

fsdp = pytest.importorskip("torch.distributed.fsdp")
if not hasattr(fsdp, "fully_shard"):  # pragma: no cover - torch without FSDP2
    pytest.skip("torch.distributed.fsdp.fully_shard is unavailable", allow_module_level=True)

pytestmark = pytest.mark.slow  # gloo process groups: one spawn per world size

STEPS = 4
SEED = 100  # the global batch of step k: global_batch(SEED + k)
TOL = 1e-6


def configs(world: int) -> list[dict[str, Any]]:
    """Every strategy x eigen and inverse, then EKFAC and eigenbasis moments (with a first
    moment, :data:`sharded.EXTRA_CONFIGS`), per mesh."""
    meshes = ["fsdp"] if world == 2 else ["fsdp", "hsdp"]
    plain = [(s, m, "") for s in STRATEGIES for m in METHODS]
    return [
        {"mesh": mesh, "strategy": s, "method": m, "extra": e}
        for mesh in meshes
        for s, m, e in plain + list(EXTRA_CONFIGS)
    ]


def make_model() -> nn.Sequential:
    """Odd widths, so that some shards are uneven or empty (5 rows over 4 ranks: 2, 2, 1, 0)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(4, 7), nn.Tanh(), nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 3)
    ).to(F64)


def shard(model: nn.Sequential, cfg: dict[str, Any], world: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if cfg["mesh"] == "hsdp":
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    for i in (0, 2, 4):
        fully_shard(model[i], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def refusals(world: int) -> dict[str, str]:
    """Errors of refused placements: FSDP2 parameters sharded along dim 1 whose local
    shapes differ from torch.chunk's, and a gradient of partial sums."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Shard

    out = {}
    mesh = init_device_mesh("cpu", (world,))
    model = make_model()
    x, y = global_batch(SEED)
    pre = KFACPreconditioner(model, factor_dtype=F64)
    F.cross_entropy(model(x), y).backward()
    p = model[2].weight
    # an uneven custom layout: every rank holds one column of the 7
    local = p.grad[:, :1].clone()
    p.grad = DTensor.from_local(local, mesh, [Shard(1)], shape=p.shape, stride=p.stride())
    try:
        pre.step()
    except ValueError as err:
        out["uneven"] = str(err)
    p.grad = DTensor.from_local(torch.ones(p.shape, dtype=F64), mesh, [Partial()])
    try:
        pre.step()
    except ValueError as err:
        out["partial"] = str(err)
    pre.remove()
    return out


def _worker(rank: int, world: int, tmp: str) -> None:
    with (
        gloo_group(rank, world, tmp, timeout=timedelta(seconds=60)),
        record_errors(Path(tmp, f"rank{rank}.error")),
    ):
        t0 = time.perf_counter()
        results = []
        part = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
        for cfg in configs(world):
            model = shard(make_model(), cfg, world)
            pre = make_preconditioner(model, cfg["strategy"], cfg["method"], extra=cfg["extra"])
            results.append(train(model, pre, part, STEPS, SEED))
            pre.remove()
        torch.save(
            {
                "configs": results,
                "refusals": refusals(world),
                "seconds": time.perf_counter() - t0,
            },
            Path(tmp, f"rank{rank}.pt"),
        )


@pytest.fixture(scope="module", params=[2, 4])
def spawned(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    world = request.param
    tmp = tmp_path_factory.mktemp(f"fsdp{world}")
    t0 = time.perf_counter()
    spawn(_worker, world, tmp)
    results = [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(world)]
    print(f"\nFSDP2 world {world}: spawn {time.perf_counter() - t0:.1f} s")
    return world, results


@pytest.fixture(scope="module")
def reference() -> dict[str, dict[str, Any]]:
    """The adapter on one process, dense model, whole global batch, per (strategy, method)."""
    with one_thread():
        out = {}
        for s, m, e in [(s, m, "") for s in STRATEGIES for m in METHODS] + list(EXTRA_CONFIGS):
            model = make_model()
            pre = make_preconditioner(model, s, m, extra=e)
            out[s, m, e] = train(model, pre, None, STEPS, SEED)
        return out


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b)
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_equals_one_process(spawned: Any, reference: dict[str, dict[str, Any]]) -> None:
    world, results = spawned
    worst = 0.0
    for i, cfg in enumerate(configs(world)):
        ref = reference[cfg["strategy"], cfg["method"], cfg["extra"]]
        for r in range(world):
            got = results[r]["configs"][i]
            for step in range(STEPS):
                d = max_diff(got["grads"][step], ref["grads"][step])
                worst = max(worst, d)
                assert d < TOL, (cfg, r, step, d)
            assert max_diff(got["params"], ref["params"]) < TOL, (cfg, r)
        # K-FAC changed the gradients (from the second step on: decompositions exist)
        assert max_diff(ref["grads"][-1], ref["raw"][-1]) > 1e-3
    print(f"\nFSDP2 world {world}: largest gradient difference {worst:.1e}")


def test_strategies_and_traffic(spawned: Any) -> None:
    world, results = spawned
    for i, cfg in enumerate(configs(world)):
        got = results[0]["configs"][i]
        expected = "MEM_OPT" if cfg["strategy"] == "HYBRID_OPT" and world == 2 else cfg["strategy"]
        assert got["strategy"] == expected
        kinds = set(got["bytes"])
        if expected == "COMM_OPT":
            assert "gradient shards (all-gather)" in kinds and not any(
                "scatter" in k for k in kinds
            )
        else:
            assert "gradient shards (gather)" in kinds and "gradient shards (scatter)" in kinds


def test_mem_opt_holds_owned_factors(spawned: Any) -> None:
    world, results = spawned
    i = configs(world).index(
        {"mesh": "fsdp", "strategy": "MEM_OPT", "method": "eigen", "extra": ""}
    )
    comm = configs(world).index(
        {"mesh": "fsdp", "strategy": "COMM_OPT", "method": "eigen", "extra": ""}
    )
    per_rank = [results[r]["configs"][i]["memory"] for r in range(world)]
    full = results[0]["configs"][comm]["memory"]
    factors = [m["a_factors"] + m["g_factors"] for m in per_rank]
    # every layer's factors live on exactly one rank (placeholders count one element)
    assert max(factors) < full["a_factors"] + full["g_factors"]
    decs = [m["decompositions"] for m in per_rank]
    assert sum(decs) == full["decompositions"]


def test_refused_placements_name_the_layer(spawned: Any) -> None:
    _, results = spawned
    refused = results[0]["refusals"]
    assert "layer '2'" in refused["uneven"] and "uneven custom layout" in refused["uneven"]
    assert "Shard(dim=1)" in refused["uneven"]
    assert "partial sums" in refused["partial"]
