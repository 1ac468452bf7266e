"""`nn.MultiheadAttention` under FSDP2: the q, k and v layers share the packed
``in_proj_weight`` / ``in_proj_bias``, whose shards FSDP2 cuts across the parts.

One spawn of 4 gloo ranks. The model (float64) embeds, attends (self-attention, 2 heads,
packed projections) and classifies; FSDP2 shards it per block and at the root on a 1-D
mesh and as HSDP on a 2 x 2 mesh. The packed weight has 18 rows over 4 ranks (5, 5, 5, 3),
so every shard holds rows of two parts. Each configuration (COMM_OPT, HYBRID_OPT, MEM_OPT;
eigen, and inverse under MEM_OPT) trains on each rank's part of every global batch; the
parent trains the dense model with the adapter on one process on the whole global batch.
Gradients after ``step()`` and the final parameters must agree to 1e-6.
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
from sharded import F64, GLOBAL_BATCH, LR, whole
from torch import nn

from kfac_func import KFACPreconditioner, Settings
from kfac_func.distributed import DistributedStrategy

fsdp = pytest.importorskip("torch.distributed.fsdp")
if not hasattr(fsdp, "fully_shard"):  # pragma: no cover - torch without FSDP2
    pytest.skip("torch.distributed.fsdp.fully_shard is unavailable", allow_module_level=True)

pytestmark = pytest.mark.slow  # one spawn of 4 gloo ranks

WORLD = 4
STEPS = 4
SEED = 400
TOL = 1e-6
DAMPING = 1e-4
CONFIGS = [
    {"mesh": mesh, "strategy": s, "method": "eigen"}
    for mesh in ("fsdp", "hsdp")
    for s in ("COMM_OPT", "HYBRID_OPT", "MEM_OPT")
] + [{"mesh": "fsdp", "strategy": "MEM_OPT", "method": "inverse"}]


class Net(nn.Module):
    """Embedding, self-attention with packed projections, mean over positions, head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 6)
        self.attn = nn.MultiheadAttention(6, 2, batch_first=True)
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(x))
        a, _ = self.attn(h, h, h, need_weights=False)
        return self.head(a.mean(dim=1))


def make_model() -> Net:
    torch.manual_seed(0)
    return Net().to(F64)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(SEED + step)
    return (
        torch.randn(GLOBAL_BATCH, 3, 4, generator=g, dtype=F64),
        torch.randint(0, 3, (GLOBAL_BATCH,), generator=g),
    )


def train(model: nn.Module, pre: KFACPreconditioner, part: slice) -> dict[str, Any]:
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    grads, raw = [], []
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        F.cross_entropy(model(x[part]), y[part]).backward()
        raw.append({n: whole(p.grad) for n, p in model.named_parameters()})
        pre.step()
        grads.append({n: whole(p.grad) for n, p in model.named_parameters()})
        opt.step()
    return {
        "grads": grads,
        "raw": raw,
        "params": {n: whole(p) for n, p in model.named_parameters()},
        "layers": sorted(pre.layers),
    }


def make_preconditioner(model: nn.Module, strategy: str, method: str) -> KFACPreconditioner:
    """Float64 K-FAC in the Fisher scaling, with a damping below the attention
    projections' curvature (their factors are small: 1e-5 and less)."""
    return KFACPreconditioner(
        model,
        factor_update_steps=1,
        inv_update_steps=2,
        damping=DAMPING,
        factor_decay=0.9,
        kl_clip=1e-2,
        lr=LR,
        settings=Settings(scaling="fisher"),
        factor_dtype=F64,
        inv_dtype=F64,
        compute_method=method,
        grad_worker_fraction=DistributedStrategy[strategy],
    )


def shard(model: Net, mesh_kind: str) -> Net:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if mesh_kind == "hsdp":
        mesh = init_device_mesh("cpu", (2, WORLD // 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("shard",))
    for block in (model.embed, model.attn, model.head):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _worker(rank: int, world: int, tmp: str) -> None:
    with (
        gloo_group(rank, world, tmp, timeout=timedelta(seconds=60)),
        record_errors(Path(tmp, f"rank{rank}.error")),
    ):
        part = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
        results = []
        for cfg in CONFIGS:
            model = shard(make_model(), cfg["mesh"])
            local = tuple(model.attn.in_proj_weight.to_local().shape)
            pre = make_preconditioner(model, cfg["strategy"], cfg["method"])
            results.append({**train(model, pre, part), "local": local})
            pre.remove()
        torch.save(results, Path(tmp, f"rank{rank}.pt"))


@pytest.fixture(scope="module")
def spawned(tmp_path_factory: pytest.TempPathFactory) -> list[list[dict[str, Any]]]:
    tmp = tmp_path_factory.mktemp("fsdp_attention")
    t0 = time.perf_counter()
    spawn(_worker, WORLD, tmp)
    print(f"\nFSDP2 attention world {WORLD}: spawn {time.perf_counter() - t0:.1f} s")
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.fixture(scope="module")
def reference() -> dict[tuple[str, str], dict[str, Any]]:
    with one_thread():
        out = {}
        for cfg in CONFIGS:
            key = cfg["strategy"], cfg["method"]
            if key not in out:
                model = make_model()
                out[key] = train(model, make_preconditioner(model, *key), slice(None))
        return out


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b)
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_packed_projections_equal_one_process(spawned: Any, reference: Any) -> None:
    worst = 0.0
    for i, cfg in enumerate(CONFIGS):
        ref = reference[cfg["strategy"], cfg["method"]]
        assert "attn.q_proj" in ref["layers"] and "attn.v_proj" in ref["layers"]
        # K-FAC changed every part of the packed weight's gradient (step 1: preconditioned
        # with the decomposition of step 0)
        new, before = ref["grads"][1]["attn.in_proj_weight"], ref["raw"][1]["attn.in_proj_weight"]
        for rows in (slice(0, 6), slice(6, 12), slice(12, 18)):
            change = float((new[rows] - before[rows]).abs().max())
            assert change > 0.1 * float(before[rows].abs().max()), (cfg, rows)
        for r in range(WORLD):
            got = spawned[r][i]
            assert got["layers"] == ref["layers"]
            for step in range(STEPS):
                d = max_diff(got["grads"][step], ref["grads"][step])
                worst = max(worst, d)
                assert d < TOL, (cfg, r, step, d)
            assert max_diff(got["params"], ref["params"]) < TOL, (cfg, r)
    print(f"\nFSDP2 attention: largest gradient difference {worst:.1e}")


def test_shards_cross_the_parts(spawned: Any) -> None:
    """The packed weight's shards hold rows of two parts (18 rows: 5, 5, 5, 3 on 4 ranks)."""
    fsdp_1d = CONFIGS.index({"mesh": "fsdp", "strategy": "COMM_OPT", "method": "eigen"})
    assert [spawned[r][fsdp_1d]["local"][0] for r in range(WORLD)] == [5, 5, 5, 3]
