"""`torch.distributed.checkpoint` of an FSDP2 model, its optimizer and the preconditioner,
resharded across world sizes (4 -> 2 -> 1), resumes as the uninterrupted run.

Three spawns on gloo, each running every configuration of :data:`CONFIGS`: plain eigen
K-FAC under MEM_OPT, eigenbasis moments under HYBRID_OPT (two grad workers per layer on 4
ranks), EKFAC with eigenbasis moments and a first moment (``moment_beta1 > 0``) under
COMM_OPT, EKFAC under MEM_OPT, and eigenbasis moments with a first moment under tensor
parallelism (MEM_OPT). On 4 ranks the model
(float64, sharded per Linear and at the root) trains with SGD with momentum on
preconditioned gradients (MEM_OPT: each layer's factors and decomposition on its owner
only); after ``SAVE_AT`` steps ``dcp.save`` writes
``{"model", "optim", "kfac": pre.state_dict()}`` and the run goes on uninterrupted. On 2
ranks a fresh model, optimizer and preconditioner load that checkpoint with ``dcp.load``
(their own state dicts as the templates it loads into), train to ``RESAVE_AT`` and save
again; one rank loads that and trains to the end. The resumed gradients and parameters
must equal the uninterrupted run's to 1e-10.
"""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from gloo import gloo_group, record_errors, spawn
from sharded import F64, GLOBAL_BATCH, LR, global_batch, whole
from torch import nn

from kfac_func import KFACPreconditioner, Settings
from kfac_func.adapter import AdaptiveStepper
from kfac_func.distributed import DistributedStrategy

dcp = pytest.importorskip("torch.distributed.checkpoint")
fsdp = pytest.importorskip("torch.distributed.fsdp")
if not hasattr(fsdp, "fully_shard"):  # pragma: no cover - torch without FSDP2
    pytest.skip("torch.distributed.fsdp.fully_shard is unavailable", allow_module_level=True)

pytestmark = pytest.mark.slow  # three spawns

STEPS = 6
SAVE_AT = 2  # saved on 4 ranks after this many steps
RESAVE_AT = 4  # saved on 2 ranks after this many steps
SEED = 300  # the global batch of step k: global_batch(SEED + k)
TOL = 1e-10


def make_model(world: int, mesh_kind: str = "fsdp") -> nn.Sequential:
    """FSDP2 per Linear and at the root, or (``"tp"``) tensor parallelism over every rank:
    the first Linear column-parallel, the second row-parallel (even widths)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world,))
    if mesh_kind == "tp":
        model = nn.Sequential(
            nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4), nn.Tanh(), nn.Linear(4, 3)
        ).to(F64)
        parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        return model
    model = nn.Sequential(
        nn.Linear(4, 7), nn.Tanh(), nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 3)
    ).to(F64)
    for i in (0, 2, 4):
        fully_shard(model[i], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


EPS = 1e-4
"""The moments' epsilon: Adam divides directions the gradient does not reach (the cross
entropy's constant direction of the last layer's G) by it, so rounding noise of 1e-17 there
grows by 1/EPS; 1e-8 would make float64 runs that sum in another order differ by 1e-9."""
CONFIGS: dict[str, dict[str, Any]] = {
    "eigen": {"grad_worker_fraction": DistributedStrategy.MEM_OPT},
    "moments": {
        "grad_worker_fraction": DistributedStrategy.HYBRID_OPT,
        "settings": Settings(scaling="fisher", eigenbasis_moments=True, moment_eps=EPS),
    },
    "ekfac_beta1": {
        "grad_worker_fraction": DistributedStrategy.COMM_OPT,
        "compute_method": "ekfac",
        "settings": Settings(
            scaling="fisher", eigenbasis_moments=True, moment_eps=EPS, moment_beta1=0.9
        ),
    },
    "ekfac": {"grad_worker_fraction": DistributedStrategy.MEM_OPT, "compute_method": "ekfac"},
    "tp_moments": {
        "mesh": "tp",
        "grad_worker_fraction": DistributedStrategy.MEM_OPT,
        "settings": Settings(
            scaling="fisher", eigenbasis_moments=True, moment_beta1=0.9, moment_eps=EPS
        ),
    },
}
"""The preconditioner's arguments per configuration (besides those of :func:`setup`), and
its settings (:func:`setup`'s ``Settings(scaling="fisher")`` where none are given)."""


def setup(
    world: int, cfg: dict[str, Any]
) -> tuple[nn.Module, torch.optim.Optimizer, KFACPreconditioner]:
    cfg = dict(cfg)
    model = make_model(world, cfg.pop("mesh", "fsdp"))
    pre = KFACPreconditioner(
        model,
        factor_update_steps=1,
        inv_update_steps=3,  # the decompositions of steps 0 and 3 are used after a load
        damping=0.01,
        factor_decay=0.9,
        kl_clip=1e-2,
        lr=LR,
        settings=cfg.pop("settings", Settings(scaling="fisher")),
        factor_dtype=F64,
        inv_dtype=F64,
        **cfg,
    )
    return model, torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9), pre


def run(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    pre: KFACPreconditioner,
    steps: range,
    rank: int,
    world: int,
    whole_batch: bool = False,
) -> list[dict[str, torch.Tensor]]:
    grads = []
    part = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
    if whole_batch:  # tensor parallelism: every rank sees the global batch
        part = slice(None)
    for step in steps:
        x, y = global_batch(SEED + step)
        opt.zero_grad()
        F.cross_entropy(model(x[part]), y[part]).backward()
        pre.step()
        grads.append({n: whole(p.grad) for n, p in model.named_parameters()})
        opt.step()
    return grads


def state(model: nn.Module, opt: torch.optim.Optimizer, pre: KFACPreconditioner) -> Any:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)
    return {"model": model_sd, "optim": optim_sd, "kfac": pre.state_dict()}


def load(path: Path, model: nn.Module, opt: torch.optim.Optimizer, pre: KFACPreconditioner) -> None:
    from torch.distributed.checkpoint.state_dict import set_state_dict

    sd = state(model, opt, pre)
    dcp.load(sd, checkpoint_id=str(path))
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    pre.load_state_dict(sd["kfac"])


def _one(rank: int, world: int, tmp: str, name: str) -> dict[str, Any]:
    """One configuration's part of this world size's run (see the module docstring)."""
    model, opt, pre = setup(world, CONFIGS[name])
    tp = CONFIGS[name].get("mesh") == "tp"
    if world == 4:
        grads = run(model, opt, pre, range(SAVE_AT), rank, world, tp)
        dcp.save(state(model, opt, pre), checkpoint_id=str(Path(tmp, f"{name}4")))
        grads += run(model, opt, pre, range(SAVE_AT, STEPS), rank, world, tp)
    elif world == 2:
        load(Path(tmp, f"{name}4"), model, opt, pre)
        steps = pre.steps
        grads = run(model, opt, pre, range(SAVE_AT, RESAVE_AT), rank, world, tp)
        dcp.save(state(model, opt, pre), checkpoint_id=str(Path(tmp, f"{name}2")))
    else:
        load(Path(tmp, f"{name}2"), model, opt, pre)
        steps = pre.steps
        grads = run(model, opt, pre, range(RESAVE_AT, STEPS), rank, world, tp)
    moments = {
        n: int(ls.basis_moment is not None) + 2 * int(ls.basis_momentum is not None)
        for n, ls in pre.state.layers.items()
    }
    pre.remove()
    return {
        "grads": grads,
        "params": {n: whole(p) for n, p in model.named_parameters()},
        "memory": pre.memory_usage(),
        "steps_after_load": steps if world != 4 else None,
        "moments": moments,
    }


def _worker(rank: int, world: int, tmp: str) -> None:
    with (
        gloo_group(rank, world, tmp, store=f"store{world}", timeout=timedelta(seconds=60)),
        record_errors(Path(tmp, f"rank{rank}-{world}.error")),
    ):
        out: dict[str, Any] = {name: _one(rank, world, tmp, name) for name in CONFIGS}
        if world == 1:  # the adaptive step refuses sharded parameters, even on one rank
            model = make_model(world)
            try:
                KFACPreconditioner(
                    model, kl_clip=None, settings=Settings(adaptive=AdaptiveStepper(model))
                )
            except ValueError as err:
                out["adaptive_refused"] = str(err)
        torch.save(out, Path(tmp, f"rank{rank}-{world}.pt"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, list[dict[str, Any]]]:
    tmp = tmp_path_factory.mktemp("dcp")
    out = {}
    for world in (4, 2, 1):
        t0 = time.perf_counter()
        spawn(_worker, world, tmp)
        print(f"\nDCP world {world}: spawn {time.perf_counter() - t0:.1f} s")
        out[world] = [
            torch.load(tmp / f"rank{r}-{world}.pt", weights_only=False) for r in range(world)
        ]
    return out


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b)
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_resume_across_world_sizes_equals_uninterrupted(runs: Any, name: str) -> None:
    full = runs[4][0][name]
    assert runs[2][0][name]["steps_after_load"] == SAVE_AT
    assert runs[1][0][name]["steps_after_load"] == RESAVE_AT
    worst = 0.0
    for r in range(2):
        for i, step in enumerate(range(SAVE_AT, RESAVE_AT)):
            d = max_diff(runs[2][r][name]["grads"][i], full["grads"][step])
            worst = max(worst, d)
            assert d < TOL, (2, r, step, d)
    for i, step in enumerate(range(RESAVE_AT, STEPS)):
        d = max_diff(runs[1][0][name]["grads"][i], full["grads"][step])
        worst = max(worst, d)
        assert d < TOL, (1, step, d)
    assert max_diff(runs[1][0][name]["params"], full["params"]) < TOL
    print(f"\nDCP resume ({name}): largest gradient difference {worst:.1e}")


def test_moments_are_kept(runs: Any) -> None:
    """The configurations with running moments hold them on one rank at the end (and
    those without hold none): the comparison above covers them."""
    kept = {name: set(runs[1][0][name]["moments"].values()) for name in CONFIGS}
    want = {"eigen": {0}, "moments": {1}, "ekfac_beta1": {3}, "ekfac": {0}}
    assert kept == {**want, "tp_moments": {3}}


def test_each_rank_holds_its_layers_after_a_load(runs: Any) -> None:
    """MEM_OPT on 2 ranks after a load: each rank's factors are its own layers' only."""
    two = [m["eigen"]["memory"] for m in runs[2]]
    one = runs[1][0]["eigen"]["memory"]
    for m in two:
        assert m["a_factors"] + m["g_factors"] < one["a_factors"] + one["g_factors"]
    assert sum(m["decompositions"] for m in two) == one["decompositions"]


def test_adaptive_step_refuses_sharded_parameters(runs: Any) -> None:
    """On one FSDP2 rank (several ranks are refused before): a clear error at construction."""
    assert "DTensor parameters" in runs[1][0]["adaptive_refused"]
