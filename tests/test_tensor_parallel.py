"""Megatron-style column/row-parallel linears on 2 gloo ranks match the dense layers.

One spawn for the module. Each rank builds the same dense two-layer block, splits it
(column-parallel then row-parallel, in every combination of ``gather_output`` /
``input_is_parallel``, with and without bias) and runs forward and backward on the same
batch. The parent checks, against the dense block in float64, the outputs, the input
gradients, and every rank's weight and bias gradient shards.
"""

from __future__ import annotations

import itertools
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from gloo import gloo_group, record_errors, spawn
from torch import nn

from kfac_func.parallel.layers import ColumnParallelLinear, RowParallelLinear

WORLD = 2
pytestmark = pytest.mark.slow  # gloo process groups: one spawn per world size

F64 = torch.float64
CONFIGS = list(itertools.product((False, True), (True, False)))  # (gather_output, bias)


def dense_block(bias: bool) -> nn.Sequential:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(5, 6, bias=bias), nn.Tanh(), nn.Linear(6, 4, bias=bias)).to(F64)


def batch() -> torch.Tensor:
    return torch.randn(7, 3, 5, generator=torch.Generator().manual_seed(1), dtype=F64)


def run(model: nn.Module, x: torch.Tensor) -> dict[str, Any]:
    x = x.clone().requires_grad_(True)
    out = model(x)
    (out.sin().sum()).backward()
    assert x.grad is not None
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return {"out": out.detach(), "x_grad": x.grad.clone(), "grads": grads}


def _worker(rank: int, world: int, tmp: str) -> None:
    with (
        gloo_group(rank, world, tmp, timeout=timedelta(seconds=60)),
        record_errors(Path(tmp, f"rank{rank}.error")),
    ):
        results = []
        for gather, bias in CONFIGS:
            dense = dense_block(bias)
            col = ColumnParallelLinear.from_dense(dense[0], gather_output=gather)
            row = RowParallelLinear.from_dense(dense[2], input_is_parallel=not gather)
            results.append(run(nn.Sequential(col, nn.Tanh(), row), batch()))
        # a freshly initialised pair: the shards of one full nn.Linear-style weight
        torch.manual_seed(11)
        fresh = ColumnParallelLinear(5, 6, gather_output=False)
        try:
            ColumnParallelLinear(4, 5)
            uneven = ""
        except ValueError as e:
            uneven = str(e)
        torch.save(
            {"configs": results, "fresh": fresh.weight.detach(), "uneven": uneven},
            Path(tmp, f"rank{rank}.pt"),
        )


@pytest.fixture(scope="module")
def spawned(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("tensor_parallel")
    t0 = time.perf_counter()
    spawn(_worker, WORLD, tmp)
    print(f"\ntensor-parallel layers world {WORLD}: {time.perf_counter() - t0:.1f} s")
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.mark.parametrize("i", range(len(CONFIGS)), ids=[f"gather={g}-bias={b}" for g, b in CONFIGS])
def test_split_block_matches_dense(spawned: list[dict[str, Any]], i: int) -> None:
    bias = CONFIGS[i][1]
    ref = run(dense_block(bias), batch())
    for rank, res in enumerate(r["configs"][i] for r in spawned):
        torch.testing.assert_close(res["out"], ref["out"], rtol=0, atol=1e-12)
        torch.testing.assert_close(res["x_grad"], ref["x_grad"], rtol=0, atol=1e-12)
        g = ref["grads"]
        rows = slice(3 * rank, 3 * (rank + 1))  # 6 hidden features over 2 ranks
        torch.testing.assert_close(
            res["grads"]["0.weight"], g["0.weight"][rows], atol=1e-12, rtol=0
        )
        torch.testing.assert_close(
            res["grads"]["2.weight"], g["2.weight"][:, rows], atol=1e-12, rtol=0
        )
        if bias:
            torch.testing.assert_close(
                res["grads"]["0.bias"], g["0.bias"][rows], atol=1e-12, rtol=0
            )
            # the row-parallel bias is whole on every rank
            torch.testing.assert_close(res["grads"]["2.bias"], g["2.bias"], atol=1e-12, rtol=0)
        else:
            assert set(res["grads"]) == {"0.weight", "2.weight"}


def test_fresh_layers_hold_slices_of_one_full_weight(spawned: list[dict[str, Any]]) -> None:
    torch.manual_seed(11)
    full = ColumnParallelLinear(5, 6).weight.detach()  # one process: the whole weight
    assert torch.equal(torch.cat([r["fresh"] for r in spawned]), full)


def test_single_process_layers_are_plain_linears() -> None:
    dense = dense_block(True)
    col = ColumnParallelLinear.from_dense(dense[0], gather_output=False)
    row = RowParallelLinear.from_dense(dense[2], input_is_parallel=True)
    x = batch()
    torch.testing.assert_close(row(torch.tanh(col(x))), dense(x), rtol=0, atol=1e-12)
    h = torch.tanh(col(x))
    out, b = RowParallelLinear.from_dense(dense[2], skip_bias_add=True)(h)
    assert b is dense[2].bias or torch.equal(b, dense[2].bias)
    torch.testing.assert_close(out + b, dense(x), rtol=0, atol=1e-12)


def test_uneven_split_is_refused(spawned: list[dict[str, Any]]) -> None:
    for r in spawned:
        assert "output_size=5 is not divisible by the model-parallel size 2" in r["uneven"]
