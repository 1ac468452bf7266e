"""An elastic FSDP2 run with `kf.KFAC` that survives a killed rank: torchrun restarts the
workers, and they resume from the last checkpoint.

Run (gloo on CPU; ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` lets restarted workers reach
the rendezvous on gloo)::

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc-per-node 2 \\
        --max-restarts 3 examples/elastic_train.py --steps 6 --ckpt ckpt/latest

Every ``--save-every`` steps all ranks save the model and the optimizer (K-FAC's factors
and decompositions included) with ``get_state_dict`` and ``kf.save_dcp`` (atomic: a rank
killed while saving leaves the previous checkpoint). A worker that starts finds the
checkpoint, loads it into a fresh model and optimizer with ``kf.load_dcp`` and
``set_state_dict``, and goes on from the step it holds. Each step's batch is a function of
the step, so the resumed run equals the uninterrupted one. ``--kill-at K`` (for tests)
kills rank 1 in the middle of step ``K`` (after its backward pass) on the first attempt.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import kfac_func as kf

F64 = torch.float64
BATCH = 8


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's part of step ``step``'s global batch."""
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(BATCH, 4, generator=g, dtype=F64), torch.randint(0, 3, (BATCH,), generator=g)
    part = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    return x[part], y[part]


def build(world: int) -> tuple[nn.Module, kf.KFAC]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)
    ).to(F64)
    opt = kf.KFAC(
        model,
        recipe="kfac-pytorch",
        lr=0.1,
        base_kwargs={"momentum": 0.9},
        damping=0.01,
        inv_update_steps=2,
        scaling="fisher",
        factor_dtype=F64,
        inv_dtype=F64,
    )
    mesh = init_device_mesh("cpu", (world,))
    for i in (0, 2, 4):
        fully_shard(model[i], mesh=mesh)
    fully_shard(model, mesh=mesh)  # after kf.KFAC: it follows the sharded parameters
    return model, opt


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=6, help="train this many steps in all")
    p.add_argument("--save-every", type=int, default=2, help="checkpoint every this many steps")
    p.add_argument("--ckpt", type=Path, default=Path("ckpt/latest"), help="checkpoint directory")
    p.add_argument("--out", type=Path, default=None, help="save the final parameters here")
    p.add_argument("--kill-at", type=int, default=-1, help="kill rank 1 in this step once")
    args = p.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt = build(world)
    model_sd, optim_sd = get_state_dict(model, opt)  # the template DCP loads into
    state = {"model": model_sd, "optim": optim_sd}
    try:
        kf.load_dcp(state, args.ckpt)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        if rank == 0:
            print(f"resumed from step {opt.preconditioner.steps}", flush=True)
    except FileNotFoundError:
        pass  # a fresh start
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    for step in range(opt.preconditioner.steps, args.steps):
        x, y = batch(step, rank, world)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        if step == args.kill_at and rank == 1 and first_attempt:
            os._exit(1)  # killed in the middle of a step
        opt.step()
        if rank == 0:
            print(f"step {step} loss {loss.item():.6f}", flush=True)
        if (step + 1) % args.save_every == 0:
            model_sd, optim_sd = get_state_dict(model, opt)
            kf.save_dcp({"model": model_sd, "optim": optim_sd}, args.ckpt)
    final = {n: p.full_tensor() for n, p in model.named_parameters()}  # a collective
    if rank == 0 and args.out is not None:
        torch.save(final, args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
