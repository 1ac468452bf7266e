"""Tensor-parallel K-FAC on gloo ranks equals K-FAC on the unsharded model in one process.

Topologies: model-parallel 2 (world 2) and model-parallel 2 × data-parallel 2 (world 4),
one spawn per world size. The model is a tiny transformer-like stack (token features
through two column→row MLP blocks with residuals, each block in one of Megatron's two
wirings, and a replicated head). Every rank builds the same dense model, splits its
tensor-parallel layers with ``from_dense``, trains a few SGD steps on its data-parallel
share of each global batch (gradients averaged over the data-parallel group, as DDP or
DeepSpeed would) with :class:`ParallelKFACPreconditioner`, and saves its gradient shards.
The parent joins the shards and compares, in float64, every step's preconditioned
gradients and the final parameters with :class:`kfac_func.KFACPreconditioner` on the dense
model and the whole global batch (tolerance 1e-6). Also checked: identical gradients on
every data-parallel replica, the plan's owners, the gathered ``state_dict`` against the
reference factors, a ``load_state_dict`` round trip that resumes exactly, and the
per-layer factor checkpoint files (written by the layers' owners, holding the reference
factors, read back by a fresh preconditioner that resumes exactly).
"""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from gloo import gloo_group, one_thread, record_errors, spawn
from torch import nn

import kfac_func as kf
from kfac_func.parallel.layers import ColumnParallelLinear, RowParallelLinear
from kfac_func.parallel.preconditioner import ParallelKFACPreconditioner

F64 = torch.float64
D, HIDDEN, T, CLASSES = 4, 8, 3, 3
LOCAL_BATCH = 3
STEPS = 4
LR = 0.1
TOL = 1e-6
TOPOLOGIES = {2: (1, 2), 4: (2, 2)}  # world -> (data, model)
HYPER_KEYS = ("damping", "factor_decay", "factor_update_steps", "inv_update_steps", "kl_clip", "lr")
CONFIGS: list[dict[str, Any]] = [
    dict(compute_method="eigen", compute_eigenvalue_outer_product=False),
    dict(compute_method="eigen", compute_eigenvalue_outer_product=True),
    # the flag has no effect on the inverse method, but the factor files record it (the
    # two preconditioners' defaults differ, as kfac-pytorch's do)
    dict(
        compute_method="inverse",
        compute_eigenvalue_outer_product=False,
        update_factors_in_hook=False,
    ),
]
# column-parallel layers split the weight's rows (and bias), row-parallel its columns
SPLITS = {
    "blocks.0.up": "column",
    "blocks.0.down": "row",
    "blocks.1.up": "column",
    "blocks.1.down": "row",
}


class Block(nn.Module):
    """``x + down(tanh(up(x)))``: an MLP block of a transformer layer."""

    def __init__(self, up: nn.Module, down: nn.Module) -> None:
        super().__init__()
        self.up, self.down = up, down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


def make_model(tp_group: Any = "dense") -> nn.Module:
    torch.manual_seed(0)
    blocks = [Block(nn.Linear(D, HIDDEN), nn.Linear(HIDDEN, D)) for _ in range(2)]
    model = nn.Sequential()
    model.add_module("embed", nn.Linear(D, D, bias=False))
    model.add_module("blocks", nn.Sequential(*blocks))
    model.add_module("head", nn.Linear(D, CLASSES))
    model = model.to(F64)
    if tp_group != "dense":
        b0, b1 = model.blocks
        # block 0: the Megatron MLP wiring (no gather between the halves)
        b0.up = ColumnParallelLinear.from_dense(b0.up, gather_output=False, group=tp_group)
        b0.down = RowParallelLinear.from_dense(b0.down, input_is_parallel=True, group=tp_group)
        # block 1: whole activations in between
        b1.up = ColumnParallelLinear.from_dense(b1.up, gather_output=True, group=tp_group)
        b1.down = RowParallelLinear.from_dense(b1.down, input_is_parallel=False, group=tp_group)
    return model


def global_batch(step: int, data: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    n = LOCAL_BATCH * data
    return torch.randn(n, T, D, generator=g, dtype=F64), torch.randint(
        0, CLASSES, (n, T), generator=g
    )


def hyper(cfg: dict[str, Any]) -> dict[str, Any]:
    return dict(
        factor_update_steps=2,
        inv_update_steps=3,
        damping=0.01,
        factor_decay=0.9,
        kl_clip=1e-2,
        lr=LR,
        settings=kf.Settings(scaling="fisher"),
        factor_dtype=F64,
        inv_dtype=F64,
        **cfg,
    )


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, CLASSES), y.reshape(-1))


def train(
    model: nn.Module, pre: Any, data: int, d: int | None, dp_group: Any, steps: int
) -> list[dict[str, torch.Tensor]]:
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    out = []
    for step in range(pre.steps, pre.steps + steps):
        x, y = global_batch(step, data)
        if d is not None:
            x, y = (
                x[d * LOCAL_BATCH : (d + 1) * LOCAL_BATCH],
                y[d * LOCAL_BATCH : (d + 1) * LOCAL_BATCH],
            )
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        if d is not None and data > 1:
            for p in model.parameters():
                dist.all_reduce(p.grad, group=dp_group)
                p.grad /= data
        pre.step()
        out.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        opt.step()
    return out


def _groups(world: int) -> tuple[int, int, int, int, Any, Any]:
    data, model = TOPOLOGIES[world]
    rank = dist.get_rank()
    d, m = divmod(rank, model)
    dp_group = mp_group = None
    for mm in range(model):  # every rank creates every group, in the same order
        g = dist.new_group([dd * model + mm for dd in range(data)])
        if mm == m:
            dp_group = g
    for dd in range(data):
        g = dist.new_group([dd * model + mm for mm in range(model)])
        if dd == d:
            mp_group = g
    return data, model, d, m, dp_group, mp_group


def _worker(rank: int, world: int, tmp: str) -> None:
    with (
        gloo_group(rank, world, tmp, timeout=timedelta(seconds=60)),
        record_errors(Path(tmp, f"rank{rank}.error")),
    ):
        t0 = time.perf_counter()
        data, _, d, m, dp_group, mp_group = _groups(world)
        results = []
        for i, cfg in enumerate(CONFIGS):
            model = make_model(mp_group)
            pre = ParallelKFACPreconditioner(
                model, data_parallel_group=dp_group, model_parallel_group=mp_group, **hyper(cfg)
            )
            grads = train(model, pre, data, d, dp_group, STEPS)
            sd = pre.state_dict()
            params = {n: p.detach().clone() for n, p in model.named_parameters()}
            # resume: a fresh preconditioner loaded from the gathered state dict continues
            # exactly like the uninterrupted one
            twin = make_model(mp_group)
            twin.load_state_dict(model.state_dict())
            pre2 = ParallelKFACPreconditioner(
                twin, data_parallel_group=dp_group, model_parallel_group=mp_group, **hyper(cfg)
            )
            pre2.load_state_dict(sd)
            # the same state, the factors as one file per layer written by its owner
            factor_dir = str(Path(tmp, f"factors{i}"))
            pre.factor_checkpoint_dir = factor_dir
            files_sd = pre.state_dict()
            pre.factor_checkpoint_dir = None
            twin3 = make_model(mp_group)
            twin3.load_state_dict(model.state_dict())
            pre3 = ParallelKFACPreconditioner(
                twin3,
                data_parallel_group=dp_group,
                model_parallel_group=mp_group,
                factor_checkpoint_dir=factor_dir,
                **hyper(cfg),
            )
            pre3.load_state_dict(files_sd)
            cont = train(model, pre, data, d, dp_group, 2)
            resumed = train(twin, pre2, data, d, dp_group, 2)
            from_files = train(twin3, pre3, data, d, dp_group, 2)
            results.append(
                {
                    "grads": grads,
                    "params": params,
                    "factors": {n: (e["A"], e["G"]) for n, e in sd["layers"].items()},
                    "owners": {
                        n: (lp.owner_data, lp.owner_model) for n, lp in pre.plan.layers.items()
                    },
                    "splits": dict(pre.splits),
                    "resume_diff": max(
                        float((a[k] - b[k]).abs().max()) for a, b in zip(cont, resumed) for k in a
                    ),
                    "files_sd": sorted(files_sd),
                    "files_resume_diff": max(
                        float((a[k] - b[k]).abs().max())
                        for a, b in zip(cont, from_files)
                        for k in a
                    ),
                    "factor_dir": factor_dir,
                }
            )
            for p in (pre, pre2, pre3):
                p.remove()
        torch.save(
            {"rank": rank, "d": d, "m": m, "configs": results, "seconds": time.perf_counter() - t0},
            Path(tmp, f"rank{rank}.pt"),
        )


@pytest.fixture(
    scope="module",
    params=sorted(TOPOLOGIES),
    ids=[f"data{TOPOLOGIES[w][0]}xmodel{TOPOLOGIES[w][1]}" for w in sorted(TOPOLOGIES)],
)
def spawned(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[int, list[dict[str, Any]]]:
    world: int = request.param
    tmp = tmp_path_factory.mktemp(f"parallel_kfac{world}")
    t0 = time.perf_counter()
    spawn(_worker, world, tmp)
    results = [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(world)]
    print(
        f"\nparallel K-FAC world {world}: spawn {time.perf_counter() - t0:.1f} s "
        f"(rank 0 after start: {results[0]['seconds']:.1f} s)"
    )
    return world, results


@pytest.fixture(scope="module")
def reference() -> dict[int, list[dict[str, Any]]]:
    """The stateful adapter on the dense model, one process, whole global batches."""
    with one_thread():
        out: dict[int, list[dict[str, Any]]] = {}
        for data in sorted({t[0] for t in TOPOLOGIES.values()}):
            runs = []
            for cfg in CONFIGS:
                model = make_model()
                pre = kf.KFACPreconditioner(model, **hyper(cfg))
                grads = train(model, pre, data, None, None, STEPS)
                sd = pre.state_dict()
                runs.append(
                    {
                        "grads": grads,
                        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
                        "factors": {n: (e["A"], e["G"]) for n, e in sd["layers"].items()},
                        "state": pre.state,
                    }
                )
            out[data] = runs
        return out


def join(
    tensors: list[dict[str, torch.Tensor]], name: str, ranks_of_replica: list[int]
) -> torch.Tensor:
    """The full tensor from the model-parallel shards of one replica."""
    layer, _, kind = name.rpartition(".")
    split = SPLITS.get(layer)
    parts = [tensors[r][name] for r in ranks_of_replica]
    if split == "column":
        return torch.cat(parts, dim=0)
    if split == "row" and kind == "weight":
        return torch.cat(parts, dim=1)
    for p in parts[1:]:  # replicated: every model-parallel rank holds the same tensor
        assert torch.equal(p, parts[0]), name
    return parts[0]


@pytest.mark.slow  # gloo process groups: one spawn per world size
def test_matches_unsharded_single_process(
    spawned: tuple[int, list[dict[str, Any]]], reference: dict[int, list[dict[str, Any]]]
) -> None:
    world, results = spawned
    data, model = TOPOLOGIES[world]
    worst, bad = 0.0, []
    for i, cfg in enumerate(CONFIGS):
        ref = reference[data][i]
        for d in range(data):
            ranks = [d * model + m for m in range(model)]
            for step in range(STEPS):
                shards = [results[r]["configs"][i]["grads"][step] for r in range(world)]
                for name, g in ref["grads"][step].items():
                    err = float((join(shards, name, ranks) - g).abs().max())
                    worst = max(worst, err)
                    if not err < TOL:
                        bad.append(f"{cfg} replica {d} step {step} {name}: {err:.2e}")
            params = [results[r]["configs"][i]["params"] for r in range(world)]
            for name, p in ref["params"].items():
                err = float((join(params, name, ranks) - p).abs().max())
                worst = max(worst, err)
                if not err < TOL:
                    bad.append(f"{cfg} replica {d} params {name}: {err:.2e}")
    print(f"\nworld {world}: max |parallel - unsharded| = {worst:.2e}")
    assert not bad, "\n".join(bad)


@pytest.mark.slow  # gloo process groups: one spawn per world size
def test_replicas_hold_identical_gradients(spawned: tuple[int, list[dict[str, Any]]]) -> None:
    world, results = spawned
    data, model = TOPOLOGIES[world]
    for m in range(model):
        base = results[m]["configs"]
        for d in range(1, data):
            other = results[d * model + m]["configs"]
            for a, b in zip(base, other):
                for ga, gb in zip(a["grads"], b["grads"]):
                    assert all(torch.equal(ga[k], gb[k]) for k in ga)


@pytest.mark.slow  # gloo process groups: one spawn per world size
def test_plan_and_registration(spawned: tuple[int, list[dict[str, Any]]]) -> None:
    world, results = spawned
    data, model = TOPOLOGIES[world]
    res = results[0]["configs"][0]
    assert {n: s for n, s in res["splits"].items() if s} == SPLITS
    assert set(res["splits"]) == {"embed", *SPLITS, "head"}
    owners = set(res["owners"].values())
    assert owners <= {(d, m) for d in range(data) for m in range(model)}
    assert len(owners) == min(len(res["owners"]), data * model)  # spread over the peers
    for r in results:  # every rank built the same plan
        assert r["configs"][0]["owners"] == res["owners"]


@pytest.mark.slow  # gloo process groups: one spawn per world size
def test_gathered_state_dict_holds_the_reference_factors(
    spawned: tuple[int, list[dict[str, Any]]], reference: dict[int, list[dict[str, Any]]]
) -> None:
    world, results = spawned
    data = TOPOLOGIES[world][0]
    for i in range(len(CONFIGS)):
        for r in results:  # every rank returns every layer's factors
            got = r["configs"][i]["factors"]
            ref = reference[data][i]["factors"]
            assert sorted(got) == sorted(ref)
            for name, (a, g) in ref.items():
                assert float((got[name][0] - a).abs().max()) < TOL, name
                assert float((got[name][1] - g).abs().max()) < TOL, name


@pytest.mark.slow  # gloo process groups: one spawn per world size
def test_load_state_dict_resumes_exactly(spawned: tuple[int, list[dict[str, Any]]]) -> None:
    _, results = spawned
    for r in results:
        for c in r["configs"]:
            assert c["resume_diff"] < 1e-12


@pytest.mark.slow  # gloo process groups: one spawn per world size
def test_factor_files_round_trip(
    spawned: tuple[int, list[dict[str, Any]]], reference: dict[int, list[dict[str, Any]]]
) -> None:
    """One file per layer, written by the layer's owner on each rank: the files hold the
    unsharded reference's factors, and a fresh preconditioner that reads them continues
    exactly like the uninterrupted one."""
    world, results = spawned
    data = TOPOLOGIES[world][0]
    for i in range(len(CONFIGS)):
        ref = reference[data][i]["state"]
        for r in results:
            c = r["configs"][i]
            # no factors inline; the settings and the constructed hyperparameters
            assert c["files_sd"] == sorted(["steps", "settings", "constructed", *HYPER_KEYS])
            assert c["files_resume_diff"] == 0.0, c["files_resume_diff"]
        directory = results[0]["configs"][i]["factor_dir"]
        manifest = kf.checkpoint.read_factor_manifest(directory)
        owners = results[0]["configs"][i]["owners"]
        _, model = TOPOLOGIES[world]
        for e in manifest["layers"]:
            d, m = owners[e["name"]]
            assert e["writer"] == d * model + m, e
        got = kf.checkpoint.load_factor_dir(directory, like=ref)
        assert got.step == STEPS
        for name, ls in ref.layers.items():
            assert float((got.layers[name].a_factor - ls.a_factor).abs().max()) < TOL, name
            assert float((got.layers[name].g_factor - ls.g_factor).abs().max()) < TOL, name
            assert got.layers[name].decomposition is not None, name


def test_one_process_factor_files_and_a_missing_directory(tmp_path: Path) -> None:
    """Without a process group: the files round-trip, and a factor directory that does not
    exist (no checkpoint saved yet) warns and keeps the current factors, as kfac-pytorch."""
    cfg = hyper(CONFIGS[0])
    x, y = global_batch(0, 1)
    model = make_model(None)
    pre = ParallelKFACPreconditioner(model, factor_checkpoint_dir=str(tmp_path / "f"), **cfg)
    loss_fn(model(x), y).backward()
    pre.step()
    sd = pre.state_dict()
    assert "layers" not in sd and sd["steps"] == 1
    pre2 = ParallelKFACPreconditioner(
        make_model(None), factor_checkpoint_dir=str(tmp_path / "f"), **cfg
    )
    pre2.load_state_dict(sd)
    for name, ls in pre.state.layers.items():
        assert torch.equal(pre2.state.layers[name].a_factor, ls.a_factor), name
        assert torch.equal(pre2.state.layers[name].g_factor, ls.g_factor), name
    fresh = ParallelKFACPreconditioner(
        make_model(None), factor_checkpoint_dir=str(tmp_path / "none"), **cfg
    )
    before = {n: ls.a_factor.clone() for n, ls in fresh.state.layers.items()}
    with pytest.warns(UserWarning, match="is not a directory"):
        fresh.load_state_dict(sd)
    assert fresh.steps == 1
    assert all(torch.equal(fresh.state.layers[n].a_factor, a) for n, a in before.items())
