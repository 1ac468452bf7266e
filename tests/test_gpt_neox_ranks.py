"""GPT-NeoX K-FAC on four gloo ranks: the model-parallel helpers, layer registration of
``nn.Linear`` stand-ins by class, and who owns, reduces and broadcasts what.

One spawn of four ranks runs three parts:

1. :func:`kfac_func.parallel.comm.gather_from_model_parallel_region` (kfac-pytorch's
   ``mpu`` gather: to one global rank, ``fp32_allreduce``, ``dim``) on the world group, on
   a subgroup and on a group of one rank;
2. a four-stage ``deepspeed.pipe.PipelineModule`` of Megatron stand-ins that subclass
   ``nn.Linear`` (as kfac-pytorch's tests write them: one ``ColumnParallelLinear``, five
   ``RowParallelLinear``), a plain ``nn.Linear`` and a frozen ``RowParallelLinear``: the
   stages together register the six trainable stand-ins, and a stage without one is
   allowed;
3. one stage over data 2 × model 2 of stand-ins that hold one shard each: the layers are
   registered with the full layer's sizes (never as replicated linears of the shard's
   sizes), the plan's owners are the DeepSpeed topology's global ranks, only a layer's
   owner holds its decompositions after a step, every data-parallel replica ends the
   step with the gradients of its model position in the owner's replica (the broadcast
   groups), the gathered ``state_dict`` holds every layer, ``load_state_dict`` leaves
   decompositions to the owners (recomputed with ``compute_inverses``, none without),
   and a factor directory with a missing layer file is refused on every rank.

DeepSpeed is optional: without it parts 2 and 3 are skipped.
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from gloo import gloo_group, record_errors, spawn
from torch import nn

import kfac_func as kf

pytestmark = pytest.mark.slow  # one spawn of four gloo ranks, with DeepSpeed when installed

WORLD = 4
HIDDEN = 8


class ColumnParallelLinear(nn.Linear):
    """kfac-pytorch's test stand-in: a Megatron class name on an ``nn.Linear`` (one shard)."""


class RowParallelLinear(nn.Linear):
    """kfac-pytorch's test stand-in for Megatron's row-parallel linear (one shard)."""


# --- 1. the gather of kfac-pytorch's mpu ----------------------------------------


def _gathers(rank: int) -> dict[str, Any]:
    from kfac_func.parallel.comm import gather_from_model_parallel_region as gather

    out: dict[str, Any] = {}
    world = dist.new_group(list(range(WORLD)))
    shard = torch.full((4, 4, 4), float(rank))
    out["world"] = gather(shard, 0, world)
    # a subgroup, bfloat16 sent as float32, joined along dim 0 on global rank 3
    pair = dist.new_group([1, 3])
    if rank in (1, 3):
        x = torch.full((2, 3), 0.5 + rank, dtype=torch.bfloat16)
        out["pair"] = gather(x, 3, pair, fp32_allreduce=True, dim=0)
        try:
            gather(x, 0, pair)
        except ValueError as e:
            out["pair_dst_error"] = str(e)
    alone = [dist.new_group([r]) for r in range(WORLD)][rank]  # every rank creates each
    x = torch.arange(3.0)
    out["alone_is_input"] = gather(x, 0, alone) is x
    return out


# --- 2. and 3. DeepSpeed ----------------------------------------------------------


def _start_deepspeed(rank: int, tmp: str) -> Any:
    import deepspeed

    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(WORLD),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(WORLD),
        TORCH_EXTENSIONS_DIR=os.path.join(tmp, f"extensions{rank}"),
    )
    # DeepSpeed's CPU backend would compile a shared-memory all-reduce op (about a
    # minute); these tests use gloo's collectives, so the op is not built
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")
    return deepspeed


def _pipeline(layers: list[nn.Module], pp: int, dp: int, mp_: int) -> Any:
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    topology = PipeModelDataParallelTopology(num_pp=pp, num_mp=mp_, num_dp=dp)
    return PipelineModule(layers, topology=topology, partition_method="uniform")


def _preconditioner(pipe: Any, **kwargs: Any) -> Any:
    from kfac_func.parallel.gpt_neox import ExperimentalFeatureWarning, GPTNeoXKFACPreconditioner

    with pytest.warns(ExperimentalFeatureWarning):
        return GPTNeoXKFACPreconditioner(pipe, **kwargs)


def _four_stages() -> dict[str, Any]:
    """kfac-pytorch's registration check: six stand-ins, a plain linear, a frozen one."""
    torch.manual_seed(0)
    layers: list[nn.Module] = [ColumnParallelLinear(HIDDEN, HIDDEN)]
    layers += [RowParallelLinear(HIDDEN, HIDDEN) for _ in range(5)]
    frozen = RowParallelLinear(HIDDEN, HIDDEN)
    frozen.requires_grad_(False)
    layers += [nn.Linear(HIDDEN, HIDDEN), frozen]
    pipe = _pipeline(layers, 4, 1, 1)
    pre = _preconditioner(pipe, allreduce_bucket_cap_mb=0)
    out = {
        "stage": pipe._grid.get_stage_id(),
        "layers": list(pre.layers),
        "splits": dict(pre.splits),
        "skipped": dict(pre.layers.skipped),
    }
    pre.remove()
    return out


def _data2_model2(tmp: str) -> dict[str, Any]:
    """One stage over data 2 × model 2 of stand-ins holding one shard each."""
    torch.manual_seed(0)
    half = HIDDEN // 2
    layers: list[nn.Module] = [
        ColumnParallelLinear(HIDDEN, half),  # a 8 -> 8 layer split on its outputs
        RowParallelLinear(half, HIDDEN),  # an 8 -> 8 layer split on its inputs
        ColumnParallelLinear(HIDDEN, half, bias=False),
        RowParallelLinear(half, 3),
    ]
    pipe = _pipeline(layers, 1, 2, 2)
    grid, topology = pipe._grid, pipe._topo
    d, m = grid.get_data_parallel_rank(), grid.get_slice_parallel_rank()
    pre = _preconditioner(pipe, damping=0.1, kl_clip=None)
    specs = {n: (s.in_dim, s.out_dim, s.a_dim, s.g_dim) for n, s in pre.layers.items()}
    parts = {n: (lp.split_dim, lp.a_part, lp.g_part) for n, lp in pre.plan.layers.items()}
    # each data-parallel replica its own batch; the gradients are not averaged, so the
    # replicas' gradients differ until the step broadcasts the owner replica's
    g = torch.Generator().manual_seed(10 + d)
    pipe(torch.randn(5, HIDDEN, generator=g)).pow(2).mean().backward()
    before = {n: p.grad.clone() for n, p in pipe.named_parameters()}
    pre.step()
    after = {n: p.grad.clone() for n, p in pipe.named_parameters()}
    owners = {n: pre.owner_rank[n] for n in pre.layers}
    coords = {n: (lp.owner_data, lp.owner_model) for n, lp in pre.plan.layers.items()}
    topology_rank = {
        n: topology.get_rank(pipe=0, data=od, model=om) for n, (od, om) in coords.items()
    }
    decomposed = {n: ls.decomposition is not None for n, ls in pre.state.layers.items()}
    sd = pre.state_dict()
    no_factors = sorted(pre.state_dict(include_factors=False))
    pre.remove()
    # kfac-pytorch's state dict checks: factors without decompositions, loaded with and
    # without recomputing them; a factor directory with a missing layer file
    fresh = _preconditioner(pipe, damping=0.1, kl_clip=None)
    bare = {
        **sd,
        "layers": {
            n: {k: v for k, v in e.items() if k != "decomposition"} for n, e in sd["layers"].items()
        },
    }
    fresh.load_state_dict(bare, compute_inverses=False)
    loaded_without = {n: ls.decomposition is not None for n, ls in fresh.state.layers.items()}
    fresh.load_state_dict(bare)
    loaded_with = {n: ls.decomposition is not None for n, ls in fresh.state.layers.items()}
    fresh.load_state_dict(sd)  # the owners' decompositions travel in the state dict
    loaded_sd = {n: ls.decomposition is not None for n, ls in fresh.state.layers.items()}
    fresh.remove()
    factor_dir = os.path.join(tmp, "factors")
    files = _preconditioner(pipe, damping=0.1, kl_clip=None, factor_checkpoint_dir=factor_dir)
    files.state_dict()
    written = sorted(f for f in os.listdir(factor_dir) if f.startswith("layer."))
    dist.barrier()
    if dist.get_rank() == 0:
        os.remove(os.path.join(factor_dir, written[-1]))
    dist.barrier()
    try:
        files.load_state_dict(files.state_dict(include_factors=False))
        missing_file = ""
    except kf.checkpoint.CheckpointFormatError as e:
        missing_file = str(e)
    files.remove()
    return {
        "rank": dist.get_rank(),
        "data": d,
        "model": m,
        "specs": specs,
        "splits": dict(pre.splits),
        "parts": parts,
        "coords": coords,
        "owners": owners,
        "topology_rank": topology_rank,
        "decomposed": decomposed,
        "factor_group": {n: pre.plan.factor_group(n) for n in pre.layers},
        "grad_source": {n: pre.plan.grad_source(n, d, m) for n in pre.layers},
        "before": before,
        "after": after,
        "sd_layers": {
            n: tuple(e["A"].shape) + tuple(e["G"].shape) for n, e in sd["layers"].items()
        },
        "no_factors": no_factors,
        "loaded_without": loaded_without,
        "loaded_with": loaded_with,
        "loaded_sd": loaded_sd,
        "written": written,
        "missing_file": missing_file,
    }


def _worker(rank: int, world: int, tmp: str) -> None:
    with record_errors(Path(tmp, f"rank{rank}.error")):
        t0 = time.perf_counter()
        with gloo_group(rank, world, tmp, timeout=timedelta(seconds=120)):
            results: dict[str, Any] = {"gather": _gathers(rank)}
            try:
                import deepspeed  # noqa: F401
            except ImportError:
                pass
            else:
                _start_deepspeed(rank, tmp)
                results["four_stages"] = _four_stages()
                results["data2_model2"] = _data2_model2(tmp)
            results["seconds"] = time.perf_counter() - t0
            torch.save(results, Path(tmp, f"rank{rank}.pt"))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("gpt_neox_ranks")
    t0 = time.perf_counter()
    spawn(_worker, WORLD, tmp)
    results = [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    print(f"\n{WORLD} ranks: spawn {time.perf_counter() - t0:.1f} s")
    return results


def _deepspeed_part(ranks: list[dict[str, Any]], part: str) -> list[dict[str, Any]]:
    if part not in ranks[0]:
        pytest.skip("DeepSpeed is not installed")
    return [r[part] for r in ranks]


# --- 1. -----------------------------------------------------------------------------


def test_gather_joins_the_shards_on_dst_only(ranks: list[dict[str, Any]]) -> None:
    got = ranks[0]["gather"]["world"]
    assert got.shape == (4, 4, 16) and got.dtype == torch.float32
    for r in range(WORLD):  # rank r's shard is the r-th part of the last dimension
        assert torch.equal(got[..., 4 * r : 4 * (r + 1)], torch.full((4, 4, 4), float(r)))
    assert all(ranks[r]["gather"]["world"] is None for r in (1, 2, 3))


def test_gather_on_a_subgroup_in_fp32_along_dim0(ranks: list[dict[str, Any]]) -> None:
    got = ranks[3]["gather"]["pair"]
    assert got.dtype == torch.bfloat16 and got.shape == (4, 3)
    want = torch.cat([torch.full((2, 3), 1.5), torch.full((2, 3), 3.5)]).bfloat16()
    assert torch.equal(got, want)
    assert ranks[1]["gather"]["pair"] is None
    for r in (1, 3):  # dst is a global rank: 0 is not in the group [1, 3]
        assert (
            "dst=0 is not a rank of the model-parallel group [1, 3]"
            in (ranks[r]["gather"]["pair_dst_error"])
        )


def test_gather_on_a_group_of_one_returns_the_input(ranks: list[dict[str, Any]]) -> None:
    assert all(r["gather"]["alone_is_input"] for r in ranks)


# --- 2. -----------------------------------------------------------------------------


def test_four_stages_register_the_six_stand_ins(ranks: list[dict[str, Any]]) -> None:
    runs = _deepspeed_part(ranks, "four_stages")
    # kfac-pytorch's check: the stages together hold the six trainable stand-ins
    assert sum(len(r["layers"]) for r in runs) == 6
    by_stage = {r["stage"]: r for r in runs}
    assert by_stage[0]["splits"] == {"0": "column", "1": "row"}
    assert by_stage[1]["splits"] == {"2": "row", "3": "row"}
    assert by_stage[2]["splits"] == {"4": "row", "5": "row"}
    # the last stage holds no preconditioned layer: the plain linear is not registered
    # by default, the frozen stand-in is skipped
    assert by_stage[3]["layers"] == []
    assert by_stage[3]["skipped"]["7"] == "weight does not require grad"
    assert "include_plain=False" in by_stage[3]["skipped"]["6"]


# --- 3. -----------------------------------------------------------------------------


def test_stand_in_shards_have_the_full_layers_factors(ranks: list[dict[str, Any]]) -> None:
    runs = _deepspeed_part(ranks, "data2_model2")
    for r in runs:
        # (in, out, A side, G side) of the full layers, not the shards' (8, 4) or (4, 8)
        assert r["specs"] == {
            "0": (8, 8, 9, 8),
            "1": (8, 8, 9, 8),
            "2": (8, 8, 8, 8),
            "3": (8, 3, 9, 3),
        }
        assert r["splits"] == {"0": "column", "1": "row", "2": "column", "3": "row"}
        # split weight dimension, and the factor sides one rank's shard covers
        assert r["parts"] == {
            "0": (0, 9, 4),
            "1": (1, 4, 8),
            "2": (0, 8, 4),
            "3": (1, 4, 3),
        }
        assert r["sd_layers"] == {
            "0": (9, 9, 8, 8),
            "1": (9, 9, 8, 8),
            "2": (8, 8, 8, 8),
            "3": (9, 9, 3, 3),
        }


def test_owners_are_the_topologys_ranks_and_alone_hold_decompositions(
    ranks: list[dict[str, Any]],
) -> None:
    runs = _deepspeed_part(ranks, "data2_model2")
    first = runs[0]
    assert all(r["coords"] == first["coords"] for r in runs)  # one plan on every peer
    # the plan's (data, model) owner is DeepSpeed's global rank of that coordinate
    assert first["owners"] == first["topology_rank"]
    assert len(set(first["owners"].values())) == 4  # four layers, one on each peer
    for r in runs:
        for name, owner in first["owners"].items():
            assert r["decomposed"][name] == (r["rank"] == owner), (r["rank"], name)


def test_replicas_end_with_the_owner_replicas_gradients(ranks: list[dict[str, Any]]) -> None:
    runs = _deepspeed_part(ranks, "data2_model2")
    at = {(r["data"], r["model"]): r for r in runs}
    for name, (od, om) in runs[0]["coords"].items():
        params = [p for p in runs[0]["after"] if p.startswith(f"{name}.")]
        for m in range(2):
            # the factors of the layer are summed over the owner's model position
            assert at[(0, m)]["factor_group"][name] == ((0, om), (1, om))
            for d in range(2):
                assert at[(d, m)]["grad_source"][name] == (od, m)
            for p in params:
                # different batches: the replicas' gradients differed before the step
                assert not torch.equal(at[(0, m)]["before"][p], at[(1, m)]["before"][p])
                # after it, both hold what the owner's replica broadcast
                assert torch.equal(at[(0, m)]["after"][p], at[(1, m)]["after"][p]), (name, p)
                assert not torch.equal(at[(od, m)]["after"][p], at[(od, m)]["before"][p])


def test_state_dicts_and_factor_files(ranks: list[dict[str, Any]]) -> None:
    runs = _deepspeed_part(ranks, "data2_model2")
    owners = runs[0]["owners"]
    for r in runs:
        assert "layers" not in r["no_factors"] and "steps" in r["no_factors"]
        # every layer's factors on every rank; decompositions only where the layer's
        # owner recomputes them (compute_inverses) or receives them in the state dict
        assert set(r["sd_layers"]) == set(owners)
        assert not any(r["loaded_without"].values())
        mine = {n: r["rank"] == o for n, o in owners.items()}
        assert r["loaded_with"] == mine
        assert r["loaded_sd"] == mine
        # one file per layer; a missing one is refused on every
        # rank (kfac-pytorch would load the others and skip it)
        assert len(r["written"]) == len(owners)
        assert f"file {r['written'][-1]!r} is missing" in r["missing_file"]
