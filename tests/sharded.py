"""What the tests of sharded models (FSDP2, tensor parallelism, DCP) share: the float64
batches, the preconditioner's settings, gathering a DTensor whole, and the training loop
whose gradients, parameters and traffic they compare with the single-process adapter."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kfac_func import KFACPreconditioner, Settings
from kfac_func.distributed import DistributedStrategy

F64 = torch.float64
LR = 0.1
GLOBAL_BATCH = 8
STRATEGIES = ("COMM_OPT", "HYBRID_OPT", "MEM_OPT")
METHODS = ("eigen", "inverse")


def global_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of one step: 8 float64 inputs of 4 features, 3 classes."""
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(GLOBAL_BATCH, 4, generator=g, dtype=F64),
        torch.randint(0, 3, (GLOBAL_BATCH,), generator=g),
    )


EXTRAS: dict[str, dict[str, Any]] = {
    "": {},
    "moments": {
        "eigenbasis_moments": True,
        "moment_beta1": 0.9,
        "moment_eps": 1e-4,
    },
}
"""Further fields of the preconditioner's ``Settings`` by name: none, or eigenbasis
moments with a first moment (their running moments live on the grad workers; an epsilon
of 1e-4, as Adam divides the directions the gradient does not reach by it, so that
float64 rounding noise there, 1e-17, stays far below the tests' tolerances)."""
EXTRA_CONFIGS = (("MEM_OPT", "ekfac", ""), ("COMM_OPT", "ekfac", "moments"))
EXTRA_CONFIGS += (("HYBRID_OPT", "eigen", "moments"),)
"""(strategy, method, extra) of the sharded tests besides STRATEGIES x METHODS."""


def make_preconditioner(
    model: nn.Module,
    strategy: str,
    method: str = "eigen",
    inv_update_steps: int = 2,
    extra: str = "",
) -> KFACPreconditioner:
    """Float64 K-FAC in the Fisher scaling, factors every step (``extra``: a key of
    :data:`EXTRAS`)."""
    return KFACPreconditioner(
        model,
        factor_update_steps=1,
        inv_update_steps=inv_update_steps,
        damping=0.01,
        factor_decay=0.9,
        kl_clip=1e-2,
        lr=LR,
        settings=Settings(scaling="fisher", **EXTRAS[extra]),
        factor_dtype=F64,
        inv_dtype=F64,
        compute_method=method,
        grad_worker_fraction=DistributedStrategy[strategy],
    )


def whole(t: torch.Tensor) -> torch.Tensor:
    """A (DTensor) tensor's whole value, detached."""
    full = getattr(t, "full_tensor", None)
    return (full() if full is not None else t).detach().clone()


def train(
    model: nn.Module, pre: KFACPreconditioner, part: slice | None, steps: int, seed: int
) -> dict[str, Any]:
    """``steps`` steps of SGD on preconditioned gradients (batches ``seed + step``;
    ``part`` None: the whole batch): the gradients before and after ``pre.step()``, the
    final parameters, K-FAC's memory and the bytes it sent."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    grads, raw, bytes_per_step = [], [], []
    for step in range(steps):
        x, y = global_batch(seed + step)
        if part is not None:
            x, y = x[part], y[part]
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        raw.append({n: whole(p.grad) for n, p in model.named_parameters()})
        before = pre.comm.sum_bytes()
        pre.step()
        bytes_per_step.append(pre.comm.sum_bytes() - before)
        grads.append({n: whole(p.grad) for n, p in model.named_parameters()})
        opt.step()
    return {
        "grads": grads,
        "raw": raw,
        "params": {n: whole(p) for n, p in model.named_parameters()},
        "memory": pre.memory_usage(),
        "bytes": dict(pre.comm.bytes),
        "bytes_per_step": bytes_per_step,
        "strategy": pre.plan.strategy.name,
    }
