"""Model code this project did not write (:mod:`fixture_models`: Hugging Face GPT-2, Llama with
untied and tied heads, BERT, a nanoGPT-style GPT), called as its users call it:

- the layer table: which parameters K-FAC preconditions, by tensors and by count; every
  parameter of the GPT-2, Llama and nanoGPT models, tied heads included;
- a few steps of the drop-in preconditioner equal :func:`kfac_func.capture` +
  :func:`kfac_func.update` on the same batches (float64);
- under DistributedDataParallel on 2 gloo ranks, equal to one process on the global batch
  (1e-6, float64).
"""

from __future__ import annotations

import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from fixture_models import FIXTURES, Fixture, T
from gloo import gloo_group, one_thread, record_errors, spawn
from numerics import named
from settings_keywords import with_settings
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import kfac_func as kf

pytest.importorskip("transformers")

F64 = torch.float64
WORLD, LOCAL, STEPS = 2, 2, 3
HYPER: dict[str, Any] = {"damping": 0.01, "kl_clip": 1e-2, "lr": 0.1}

# the parameters each fixture leaves to another optimizer (none: every one preconditioned,
# BERT's head bias, which its tied decoder shares, included)
SKIPPED: dict[str, set[str]] = {name: set() for name in FIXTURES}


def _register(fx: Fixture, model: nn.Module) -> kf.LayerTable:
    kw: dict[str, Any] = {} if fx.kinds is None else {"kinds": fx.kinds}
    return kf.register(model, **kw)


def _preconditioner(fx: Fixture, model: nn.Module, **kw: Any) -> kf.KFACPreconditioner:
    if fx.kinds is not None:
        kw["kinds"] = fx.kinds
    return kf.KFACPreconditioner(
        model,
        factor_dtype=F64,
        inv_dtype=F64,
        **HYPER,
        # the models' losses average over tokens: T per sequence
        **with_settings(settings=kf.Settings(scaling="fisher", loss_divisor=T), **kw),
    )


def coverage(fx: Fixture, model: nn.Module) -> tuple[set[str], int, int]:
    """``(parameters not preconditioned, preconditioned count, total count)``."""
    table = _register(fx, model)
    mine, _ = table.split_parameters(model)
    ids = {id(p) for p in mine}
    params = dict(model.named_parameters())
    left = {n for n, p in params.items() if id(p) not in ids}
    return left, sum(p.numel() for p in mine), sum(p.numel() for p in params.values())


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_layer_table_preconditions_every_parameter(name: str) -> None:
    fx = FIXTURES[name]
    model = fx.build(F64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warned skip left in these models
        left, count, total = coverage(fx, model)
    assert left == SKIPPED[name], (name, left)
    if not SKIPPED[name]:
        assert count == total, (name, count, total)


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        n.removeprefix("module."): p.grad.clone()
        for n, p in model.named_parameters()
        if p.grad is not None
    }


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_adapter_equals_capture_and_update(name: str) -> None:
    fx = FIXTURES[name]
    model, ref = fx.build(F64), fx.build(F64)
    model.train(), ref.train()
    pre = _preconditioner(fx, model)
    table = _register(fx, ref)
    state = kf.init(table, convention="fisher", factor_dtype=F64, inv_dtype=F64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    params = {k: v.detach().clone() for k, v in ref.named_parameters()}
    changed = False
    for step in range(STEPS):
        batch = fx.batch(step, 2 * LOCAL)
        opt.zero_grad()
        fx.loss(model(**batch)).backward()
        raw = _grads(model)
        pre.step()
        _, grads, caps = kf.capture(
            ref, params, (), fx.loss, layers=table, kwargs=batch, loss_divisor=T
        )
        out, state = kf.update(state, grads, captures=caps, **HYPER)
        got = _grads(model)
        for n in got:
            torch.testing.assert_close(got[n], out[n], rtol=1e-12, atol=1e-14, msg=named(n))
            changed |= not torch.allclose(got[n], raw[n])
        opt.step()
        params = {k: v.add(out[k], alpha=-0.1) for k, v in params.items()}  # as SGD
    assert changed  # K-FAC changed the gradients
    for n, ls in pre.state.layers.items():
        torch.testing.assert_close(ls.a_factor, state.layers[n].a_factor, rtol=1e-12, atol=0)
        torch.testing.assert_close(ls.g_factor, state.layers[n].g_factor, rtol=1e-12, atol=0)


def train(fx: Fixture, model: nn.Module, pre: kf.KFACPreconditioner, rank: int | None) -> list:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for step in range(STEPS):
        batch = fx.batch(step, LOCAL * WORLD)
        if rank is not None:
            batch = {k: v[rank * LOCAL : (rank + 1) * LOCAL] for k, v in batch.items()}
        opt.zero_grad()
        fx.loss(model(**batch)).backward()
        pre.step()
        out.append(_grads(model))
        opt.step()
    return out


DDP_FIXTURES = ("gpt2", "llama", "llama-tied", "bert", "nanogpt", "nanogpt-nobias")


def _worker(rank: int, world: int, tmp: str) -> None:
    with (
        gloo_group(rank, world, tmp, timeout=timedelta(seconds=120)),
        record_errors(Path(tmp, f"rank{rank}.error")),
    ):
        results = {}
        for name in DDP_FIXTURES:
            fx = FIXTURES[name]
            ddp = DistributedDataParallel(fx.build(F64))
            pre = _preconditioner(fx, ddp, grad_worker_fraction=0.5)
            results[name] = train(fx, ddp, pre, rank)
            pre.remove()
        torch.save(results, Path(tmp, f"rank{rank}.pt"))


@pytest.mark.slow
def test_ddp_two_ranks_equal_one_process(tmp_path: Path) -> None:
    spawn(_worker, WORLD, tmp_path, preload=("torch", "kfac_func", "transformers"))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    for name in DDP_FIXTURES:
        fx = FIXTURES[name]
        with one_thread():
            model = fx.build(F64)
            reference = train(fx, model, _preconditioner(fx, model), None)
        for step, want in enumerate(reference):
            for got in (r[name][step] for r in ranks):
                err = max(float((got[n] - want[n]).abs().max()) for n in want)
                assert err < 1e-6, (name, step, err)
