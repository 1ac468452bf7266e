"""`KFACPreconditioner` on DTensor tensor parallelism, alone and under FSDP2, on gloo ranks.

``parallelize_module`` makes the first Linear column-parallel and the second row-parallel
(the third stays whole); the hooks see the row-parallel input and the column-parallel
output-gradient as shards, gather them within the tensor-parallel mesh and so build the
factors of the whole layers. One spawn per world size: tensor parallelism over 2 ranks,
and on 4 ranks over all 4 and FSDP2 x TP on a 2 x 2 mesh (data-parallel x tensor-parallel);
every configuration runs COMM_OPT, HYBRID_OPT and MEM_OPT x eigen and inverse. The parent
trains the dense float64 model with the adapter on one process on the whole global batch;
gradients after ``step()`` and parameters must agree to 1e-6.
"""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from gloo import gloo_group, one_thread, record_errors, spawn
from sharded import (
    EXTRA_CONFIGS,
    F64,
    GLOBAL_BATCH,
    METHODS,
    STRATEGIES,
    make_preconditioner,
    train,
)
from torch import nn

tp = pytest.importorskip("torch.distributed.tensor.parallel")
fsdp = pytest.importorskip("torch.distributed.fsdp")
if not hasattr(fsdp, "fully_shard"):  # pragma: no cover - torch without FSDP2
    pytest.skip("torch.distributed.fsdp.fully_shard is unavailable", allow_module_level=True)

pytestmark = pytest.mark.slow  # gloo process groups: one spawn per world size

STEPS = 4
SEED = 200  # the global batch of step k: global_batch(SEED + k)
TOL = 1e-6


def configs(world: int) -> list[dict[str, Any]]:
    """Every strategy x eigen and inverse, then EKFAC and eigenbasis moments (with a first
    moment, :data:`sharded.EXTRA_CONFIGS`), per mesh."""
    meshes = ["tp"] if world == 2 else ["tp", "fsdp_tp"]
    plain = [(s, m, "") for s in STRATEGIES for m in METHODS]
    return [
        {"mesh": mesh, "strategy": s, "method": m, "extra": e}
        for mesh in meshes
        for s, m, e in plain + list(EXTRA_CONFIGS)
    ]


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4), nn.Tanh(), nn.Linear(4, 3)
    ).to(F64)


def parallelize(model: nn.Sequential, cfg: dict[str, Any], world: int, rank: int) -> slice:
    """Shard ``model`` in place; returns this rank's part of the global batch."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
    if cfg["mesh"] == "tp":
        parallelize_module(model, init_device_mesh("cpu", (world,)), plan)
        return slice(None)
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], plan)
    for i in (0, 2, 4):
        fully_shard(model[i], mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    dp = rank // (world // 2)
    return slice(dp * GLOBAL_BATCH // 2, (dp + 1) * GLOBAL_BATCH // 2)


def packed_refusal(world: int) -> str:
    """The error of attention's packed weight sharded over a tensor-parallel mesh by hand
    (torch's parallel styles do not take ``nn.MultiheadAttention``)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from kfac_func import KFACPreconditioner

    model = nn.Sequential(nn.MultiheadAttention(4, 2)).to(F64)
    mesh = init_device_mesh("cpu", (world,))
    w = model[0].in_proj_weight
    model[0].in_proj_weight = nn.Parameter(distribute_tensor(w.detach(), mesh, [Shard(0)]))
    try:
        KFACPreconditioner(model)
    except ValueError as err:
        return str(err)
    return "no error"


def _worker(rank: int, world: int, tmp: str) -> None:
    with (
        gloo_group(rank, world, tmp, timeout=timedelta(seconds=60)),
        record_errors(Path(tmp, f"rank{rank}.error")),
    ):
        results = []
        for cfg in configs(world):
            model = make_model()
            part = parallelize(model, cfg, world, rank)
            pre = make_preconditioner(model, cfg["strategy"], cfg["method"], extra=cfg["extra"])
            results.append(train(model, pre, part, STEPS, SEED))
            pre.remove()
        torch.save(
            {"configs": results, "packed": packed_refusal(world)}, Path(tmp, f"rank{rank}.pt")
        )


@pytest.fixture(scope="module", params=[2, 4])
def spawned(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    world = request.param
    tmp = tmp_path_factory.mktemp(f"tp{world}")
    t0 = time.perf_counter()
    spawn(_worker, world, tmp)
    results = [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(world)]
    print(f"\nDTensor TP world {world}: spawn {time.perf_counter() - t0:.1f} s")
    return world, results


@pytest.fixture(scope="module")
def reference() -> dict[tuple[str, str], dict[str, Any]]:
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


def test_equals_one_process(spawned: Any, reference: dict[tuple[str, str], Any]) -> None:
    world, results = spawned
    worst = 0.0
    for i, cfg in enumerate(configs(world)):
        ref = reference[cfg["strategy"], cfg["method"], cfg["extra"]]
        assert max_diff(ref["grads"][-1], ref["raw"][-1]) > 1e-3  # K-FAC changed them
        for r in range(world):
            got = results[r]["configs"][i]
            for step in range(STEPS):
                d = max_diff(got["grads"][step], ref["grads"][step])
                worst = max(worst, d)
                assert d < TOL, (cfg, r, step, d)
            assert max_diff(got["params"], ref["params"]) < TOL, (cfg, r)
    print(f"\nDTensor TP world {world}: largest gradient difference {worst:.1e}")


def test_strategies(spawned: Any) -> None:
    world, results = spawned
    for i, cfg in enumerate(configs(world)):
        want = "MEM_OPT" if cfg["strategy"] == "HYBRID_OPT" and world == 2 else cfg["strategy"]
        assert results[0]["configs"][i]["strategy"] == want


def test_tensor_parallel_packed_attention_is_refused(spawned: Any) -> None:
    world, results = spawned
    for r in range(world):
        err = results[r]["packed"]
        assert "layer '0.q_proj'" in err and "'0.in_proj_weight'" in err, err
        assert "not tensor-parallel" in err and "Shard(dim=0)" in err, err
