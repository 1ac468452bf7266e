"""`kf.KFAC` built before or after the model is sharded (FSDP2's ``fully_shard``, tensor
parallelism's ``parallelize_module``) or wrapped in DDP, on gloo ranks.

``fully_shard`` and ``parallelize_module`` replace the module's parameters by new
``nn.Parameter`` objects holding DTensors; ``kf.KFAC`` built before must follow them, by
name, and train as the one built after (float64, 1e-12), moving every parameter (under
``MEM_OPT`` it keeps only its own layers' factors once the parameters are sharded). An
optimizer that already stepped the old parameters (its momentum belongs to them) must
refuse at the next step, naming them, instead of stepping tensors the model no longer
uses. One spawn per world size (2, then 1), each running every case; on 2 ranks the run
built before ``fully_shard`` also saves a DCP checkpoint after ``CUT`` steps
(``get_state_dict`` and ``kf.save_dcp``), which one rank then loads into a fresh model and
optimizer (built before ``fully_shard`` too, default strictness) and trains to the end: it
must end as the uninterrupted 2-rank run (1e-10; the sums run in another order).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from gloo import gloo_group, record_errors, spawn
from sharded import F64, GLOBAL_BATCH, global_batch, whole
from torch import nn

import kfac_func as kf

fsdp = pytest.importorskip("torch.distributed.fsdp")
if not hasattr(fsdp, "fully_shard"):  # pragma: no cover - torch without FSDP2
    pytest.skip("torch.distributed.fsdp.fully_shard is unavailable", allow_module_level=True)

pytestmark = pytest.mark.slow  # two spawns

STEPS, CUT = 5, 2
SEED = 500  # the global batch of step k: global_batch(SEED + k)
TOL = 1e-12
KFAC_ARGS: dict[str, Any] = {
    "lr": 0.1,
    "base_kwargs": {"momentum": 0.9},
    "damping": 0.01,
    "inv_update_steps": 2,
    "kl_clip": 1e-2,
    "scaling": "fisher",
    "factor_dtype": F64,
    "inv_dtype": F64,
}


def make_model(kind: str) -> nn.Sequential:
    torch.manual_seed(0)
    first = 8 if kind == "tp" else 7  # column- then row-parallel: even widths
    return nn.Sequential(
        nn.Linear(4, first), nn.Tanh(), nn.Linear(first, 4), nn.Tanh(), nn.Linear(4, 3)
    ).to(F64)


def wrap(model: nn.Sequential, kind: str, world: int) -> nn.Module:
    """Shard (``"fsdp"``: per Linear and at the root; ``"tp"``: the first two Linears
    column- and row-parallel) or wrap (``"ddp"``) the model in place; returns the module
    to call."""
    from torch.distributed.device_mesh import init_device_mesh

    if kind == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    mesh = init_device_mesh("cpu", (world,))
    if kind == "tp":
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    else:
        from torch.distributed.fsdp import fully_shard

        for i in (0, 2, 4):
            fully_shard(model[i], mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def build(kind: str, order: str, world: int) -> tuple[nn.Module, nn.Module, kf.KFAC]:
    """(the model, the module to call, the optimizer built ``"before"`` or ``"after"``
    the model is wrapped); ``"fsdp-mem"``: FSDP2 under ``MEM_OPT`` (each rank keeps its
    own layers' factors once the parameters are sharded)."""
    args = dict(KFAC_ARGS)
    if kind == "fsdp-mem":
        kind, args["grad_worker_fraction"] = "fsdp", kf.distributed.DistributedStrategy.MEM_OPT
    model = make_model(kind)
    if order == "before":
        opt = kf.KFAC(model, recipe="kfac-pytorch", **args)
        call = wrap(model, kind, world)
    else:
        call = wrap(model, kind, world)
        opt = kf.KFAC(call, recipe="kfac-pytorch", **args)
    return model, call, opt


def train(call: nn.Module, opt: kf.KFAC, steps: range, rank: int, world: int, kind: str) -> None:
    part = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
    if kind == "tp":  # every rank sees the global batch
        part = slice(None)
    for step in steps:
        x, y = global_batch(SEED + step)
        opt.zero_grad()
        F.cross_entropy(call(x[part]), y[part]).backward()
        opt.step()


def params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: whole(p) for n, p in model.named_parameters()}


def _refusal(world: int) -> str:
    """The message of the step after ``fully_shard`` replaced parameters that the base
    optimizer had already stepped (and whether the parameters stayed as they were)."""
    model = make_model("fsdp")
    opt = kf.KFAC(model, recipe="kfac-pytorch", **KFAC_ARGS)
    x, y = global_batch(SEED)  # every rank: the same batch
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()  # SGD's momentum now belongs to the plain parameters
    wrap(model, "fsdp", world)
    before = params(model)
    try:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    except ValueError as err:
        unchanged = all(torch.equal(before[k], v) for k, v in params(model).items())
        return f"{err} | unchanged={unchanged}"
    return "no error"


def _worker(rank: int, world: int, tmp: str) -> None:
    with (
        gloo_group(rank, world, tmp, store=f"store{world}"),
        record_errors(Path(tmp, f"rank{rank}-{world}.error")),
    ):
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        out: dict[str, Any] = {}
        kinds = ["fsdp", "fsdp-mem", "tp", "ddp"] if world == 2 else ["fsdp"]
        for kind in kinds:
            for order in ("after", "before"):
                model, call, opt = build(kind, order, world)
                start = params(model)
                train(call, opt, range(CUT), rank, world, kind)
                if kind == "fsdp" and order == "before" and world == 2:
                    model_sd, optim_sd = get_state_dict(model, opt)
                    sd = {"model": model_sd, "optim": optim_sd}
                    kf.save_dcp(sd, Path(tmp, "ckpt"))
                train(call, opt, range(CUT, STEPS), rank, world, kind)
                out[f"{kind}-{order}"] = {
                    "start": start,
                    "end": params(model),
                    "steps": opt.preconditioner.steps,
                    "dtensors": sum(type(p).__name__ == "DTensor" for p in model.parameters()),
                    "memory": opt.preconditioner.memory_usage(),
                }
        if world == 1:  # resume the 2-rank checkpoint
            model, call, opt = build("fsdp", "before", world)
            model_sd, optim_sd = get_state_dict(model, opt)  # the template
            sd = {"model": model_sd, "optim": optim_sd}
            kf.load_dcp(sd, Path(tmp, "ckpt"))
            set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
            loaded = opt.preconditioner.steps
            train(call, opt, range(CUT, STEPS), rank, world, "fsdp")
            out["resumed"] = {"end": params(model), "steps_after_load": loaded}
        out["refusal"] = _refusal(world)
        torch.save(out, Path(tmp, f"rank{rank}-{world}.pt"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("kfac_fsdp")
    out = {}
    for world in (2, 1):
        t0 = time.perf_counter()
        spawn(_worker, world, tmp)
        print(f"\nkf.KFAC world {world}: spawn {time.perf_counter() - t0:.1f} s")
        out[world] = torch.load(tmp / f"rank0-{world}.pt", weights_only=False)
    return out


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b)
    return max(float((a[k] - b[k]).abs().max()) for k in a)


CASES = [(2, "fsdp"), (2, "fsdp-mem"), (2, "tp"), (2, "ddp"), (1, "fsdp")]


@pytest.mark.parametrize(("world", "kind"), CASES)
def test_built_before_wrapping_trains_as_built_after(runs: Any, world: int, kind: str) -> None:
    after, before = runs[world][f"{kind}-after"], runs[world][f"{kind}-before"]
    assert before["steps"] == after["steps"] == STEPS
    want = {"fsdp": 6, "fsdp-mem": 6, "tp": 4, "ddp": 0}[kind]
    assert before["dtensors"] == after["dtensors"] == want
    assert before["memory"] == after["memory"]  # MEM_OPT: the same factors released
    moved = {k: float((before["end"][k] - before["start"][k]).abs().max()) for k in before["end"]}
    assert min(moved.values()) > 1e-3, moved  # every parameter moves
    assert max_diff(before["end"], after["end"]) < TOL


def test_a_dcp_checkpoint_of_two_ranks_resumes_on_one(runs: Any) -> None:
    resumed = runs[1]["resumed"]
    assert resumed["steps_after_load"] == CUT
    assert max_diff(resumed["end"], runs[2]["fsdp-before"]["end"]) < 1e-10


@pytest.mark.parametrize("world", [2, 1])
def test_parameters_replaced_after_a_step_are_refused(runs: Any, world: int) -> None:
    message = runs[world]["refusal"]
    assert "'0.weight'" in message and "'4.bias'" in message, message
    assert "stepped them" in message and message.endswith("unchanged=True"), message
