"""Layer kinds with diagonal factors (Embedding, a Conv1d and a Linear made diagonal by
``max_factor_dim``, a LayerNorm's per-unit blocks; the Conv1d with ``kfac_approx="reduce"``)
under ``update_distributed`` on 2 gloo ranks: equal to ``kf.update`` on the global batch
(1e-10 in float64) and bit-identical across ranks, for COMM_OPT and MEM_OPT, eigen (with
the eigenvalue outer product) and inverse, with symmetry-aware packing and buckets small
enough to split the layers.

The parent computes each rank's gradients and captures and the reference results (one
``kf.capture`` per slice, as DDP's ranks would), and the ranks replay them.
"""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from gloo import gloo_group, record_errors, spawn
from torch import nn

import kfac_func as kf
from kfac_func.distributed.plan import DistributedStrategy

WORLD = 2
STEPS = 3
LOCAL = 3
VOCAB, WIDTH, CLASSES, T = 11, 4, 15, 5
MAX_DIM = 12  # the Conv1d's A (13) and the head's G (15) become diagonal
APPROX = {"conv": "reduce"}  # the Conv1d reduces over positions, the head expands
HYPER: dict[str, Any] = {"damping": 0.01, "factor_decay": 0.9, "kl_clip": 1e-3, "lr": 0.1}
CONFIGS = [
    (strategy, method, cap)
    for strategy in (DistributedStrategy.COMM_OPT, DistributedStrategy.MEM_OPT)
    for method in ("eigen", "inverse")
    for cap in (25.0, 512 / 2**20)
]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.conv = nn.Conv1d(WIDTH, 6, 3, padding="same")
        self.norm = nn.LayerNorm(6)
        self.head = nn.Linear(6, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.conv(self.emb(x).transpose(1, 2))).transpose(1, 2)
        return self.head(self.norm(h))


def _model() -> Net:
    return Net().double()


def _loss(y: torch.Tensor) -> Any:
    return lambda out: F.cross_entropy(out.reshape(-1, CLASSES), y.reshape(-1))


def _state(table: kf.LayerTable, method: str) -> kf.KFACState:
    return kf.init(
        table, compute_method=method, factor_dtype=torch.float64, inv_dtype=torch.float64
    )


def _data(method: str) -> list[tuple[list[Any], list[Any], dict[str, torch.Tensor]]]:
    model = _model()
    table = kf.register(model, max_factor_dim=MAX_DIM, kfac_approx=APPROX)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    state = _state(table, method)
    steps = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)
        x = torch.randint(0, VOCAB, (LOCAL * WORLD, T), generator=g)
        y = torch.randint(0, CLASSES, (LOCAL * WORLD, T), generator=g)
        _, grads, caps = kf.capture(model, params, x, _loss(y), layers=table)
        ref, state = kf.update(state, grads, captures=caps, **HYPER)
        local = [
            kf.capture(model, params, x[sl], _loss(y[sl]), layers=table)[1:]
            for sl in (slice(r * LOCAL, (r + 1) * LOCAL) for r in range(WORLD))
        ]
        steps.append(([lg for lg, _ in local], [lc for _, lc in local], ref))
        params = {k: params[k] - 0.1 * ref[k] for k in params}
    return steps


def _worker(rank: int, world: int, tmp: str) -> None:
    with (
        gloo_group(rank, world, tmp, timeout=timedelta(seconds=60)),
        record_errors(Path(tmp, f"rank{rank}.error")),
    ):
        data = torch.load(Path(tmp, "data.pt"), weights_only=False)
        table = kf.register(_model(), max_factor_dim=MAX_DIM, kfac_approx=APPROX)
        results = []
        for strategy, method, cap in CONFIGS:
            plan = kf.distributed.make_plan(
                table, world, grad_worker_fraction=strategy, compute_method=method
            )
            comm = kf.distributed.Communicator(plan, bucket_cap_mb=cap, symmetry_aware=True)
            state = _state(table, method)
            err, outs = 0.0, []
            for grads, caps, ref in data[method]:
                avg = {k: v.clone() for k, v in grads[rank].items()}
                for v in avg.values():
                    dist.all_reduce(v)
                    v /= world
                out, state = kf.distributed.update_distributed(
                    state, avg, captures=caps[rank], plan=plan, comm=comm, **HYPER
                )
                err = max(err, *(float((out[k] - ref[k]).abs().max()) for k in ref))
                outs.append(torch.cat([out[k].reshape(-1) for k in sorted(out)]))
            mine = torch.cat(outs)
            gathered = [torch.empty_like(mine) for _ in range(world)]
            dist.all_gather(gathered, mine)
            results.append(
                {
                    "config": f"{strategy.name}/{method}/{cap:g}",
                    "max_err": err,
                    "identical": all(torch.equal(gathered[0], t) for t in gathered),
                }
            )
        Path(tmp, f"rank{rank}.json").write_text(json.dumps(results))


def test_diagonal_kinds_match_one_process(tmp_path: Path) -> None:
    table = kf.register(_model(), max_factor_dim=MAX_DIM, kfac_approx=APPROX)
    assert [s.diagonal for s in table.values()] == [
        (True, False),
        (True, False),
        (True, False),
        (False, True),
    ]
    torch.save({m: _data(m) for m in ("eigen", "inverse")}, tmp_path / "data.pt")
    spawn(_worker, WORLD, tmp_path)
    for rank in range(WORLD):
        for r in json.loads((tmp_path / f"rank{rank}.json").read_text()):
            assert r["max_err"] < 1e-10, r
            assert r["identical"], r
