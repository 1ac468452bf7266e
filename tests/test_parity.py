"""Behaviour that code written for kfac-pytorch 0.4.2 relies on.

- ``allreduce_method`` (:class:`kfac_func.distributed.AllreduceMethod`): derived from
  ``allreduce_bucket_cap_mb`` unless given; on 2 gloo ranks both methods give the same
  preconditioned gradients, ``ALLREDUCE`` with one collective per factor tensor.
- :func:`kfac_func.step.exp_decay_factor_averaging`: its values and its checks.
- ``DistributedStrategy.MEM_OPT`` on one process: kept, colocation forced with a warning;
  the eigenvalue outer product without colocation refused first.
- :class:`kfac_func.parallel.GPTNeoXKFACPreconditioner` registers only the column- and
  row-parallel linears unless ``include_plain_linear=True``.
- one log line per registered layer at ``loglevel``, and the assignment line.
- :class:`kfac_func.adapter.LambdaParamScheduler` warns once per interval it keeps at 1.
"""

from __future__ import annotations

import logging
import math
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from gloo import gloo_group, record_errors, spawn
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import kfac_func as kf
from kfac_func import KFACPreconditioner
from kfac_func.adapter import LambdaParamScheduler
from kfac_func.distributed import AllreduceMethod, DistributedStrategy
from kfac_func.parallel.layers import ColumnParallelLinear, RowParallelLinear
from kfac_func.step import exp_decay_factor_averaging

F64 = torch.float64


def small() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()


def backward(model: nn.Module, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 4, generator=g, dtype=F64)
    y = torch.randint(0, 3, (8,), generator=g)
    F.cross_entropy(model(x), y).backward()


# --------------------------------------------------------------------------- allreduce_method


def test_allreduce_method_follows_the_bucket_cap_by_default() -> None:
    pre = KFACPreconditioner(small())
    assert pre.allreduce_method is AllreduceMethod.ALLREDUCE_BUCKETED
    assert pre.comm.bucket_cap_bytes == 25 * 1024 * 1024
    pre = KFACPreconditioner(small(), allreduce_bucket_cap_mb=0)
    assert pre.allreduce_method is AllreduceMethod.ALLREDUCE
    assert pre.comm.bucket_cap_bytes == 0


@pytest.mark.parametrize("method", [AllreduceMethod.ALLREDUCE, "allreduce", "ALLREDUCE"])
def test_allreduce_method_unbuckets_whatever_the_cap(method: Any) -> None:
    pre = KFACPreconditioner(small(), settings=kf.Settings(allreduce_method=method))
    assert pre.allreduce_method is AllreduceMethod.ALLREDUCE
    assert pre.allreduce_bucket_cap_mb == 25.0  # as given
    assert pre.comm.bucket_cap_bytes == 0  # one collective per tensor


def test_allreduce_method_checks() -> None:
    with pytest.raises(ValueError, match="ALLREDUCE_BUCKETED needs allreduce_bucket_cap_mb > 0"):
        KFACPreconditioner(
            small(),
            settings=kf.Settings(allreduce_method=AllreduceMethod.ALLREDUCE_BUCKETED),
            allreduce_bucket_cap_mb=0,
        )
    with pytest.raises(ValueError, match="allreduce_method must be one of allreduce, allreduce_"):
        KFACPreconditioner(small(), settings=kf.Settings(allreduce_method="ring"))


WORLD, STEPS = 2, 3
N_LAYERS = 3
TENSORS_PER_LAYER = 3  # w·A, w·G and w (see kfac_func.distributed.kaisa)


def ddp_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)
    ).double()


def _allreduce_worker(rank: int, world: int, tmp: str) -> None:
    with (
        gloo_group(rank, world, tmp, timeout=timedelta(seconds=60)),
        record_errors(Path(tmp, f"rank{rank}.error")),
    ):
        out: dict[str, Any] = {}
        for method in AllreduceMethod:
            ddp = DistributedDataParallel(ddp_model())
            pre = KFACPreconditioner(
                ddp,
                settings=kf.Settings(allreduce_method=method),
                damping=0.01,
                factor_decay=0.9,
                factor_dtype=F64,
                inv_dtype=F64,
            )
            opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
            grads = []
            for step in range(STEPS):
                opt.zero_grad()
                backward(ddp, seed=10 * step + rank)
                pre.step()
                grads.append({n: p.grad.detach().clone() for n, p in ddp.named_parameters()})
                opt.step()
            factor_calls = sum(c for k, c in pre.comm.calls.items() if k.startswith("factors"))
            out[method.name] = {"grads": grads, "factor_calls": factor_calls}
            pre.remove()
        torch.save(out, Path(tmp, f"rank{rank}.pt"))


@pytest.mark.slow
def test_allreduce_methods_on_two_ranks(tmp_path: Path) -> None:
    spawn(_allreduce_worker, WORLD, tmp_path)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    for res in ranks:
        single, bucketed = res["ALLREDUCE"], res["ALLREDUCE_BUCKETED"]
        # one collective per factor tensor and step, against one bucket per step
        assert single["factor_calls"] == STEPS * N_LAYERS * TENSORS_PER_LAYER
        assert bucketed["factor_calls"] == STEPS
        for a, b in zip(single["grads"], bucketed["grads"]):
            for name in a:
                torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-12)
    # and the ranks agree
    for a, b in zip(ranks[0]["ALLREDUCE"]["grads"], ranks[1]["ALLREDUCE"]["grads"]):
        assert all(torch.equal(a[n], b[n]) for n in a)


# --------------------------------------------------------------------------- factor averaging


def test_exp_decay_factor_averaging_values() -> None:
    decay = exp_decay_factor_averaging()
    assert decay(0) == 0.0  # step 0 counts as step 1
    assert decay(1) == 0.0
    assert decay(2) == 0.5
    assert decay(10) == pytest.approx(0.9)
    assert decay(20) == pytest.approx(0.95)  # 1 - 1/20 reaches the default 0.95
    assert decay(1000) == 0.95
    tight = exp_decay_factor_averaging(min_value=0.5)
    assert [tight(k) for k in (1, 2, 3, 100)] == [0.0, 0.5, 0.5, 0.5]
    loose = exp_decay_factor_averaging(min_value=1.0)
    assert loose(4) == 0.75
    with pytest.raises(ValueError, match="step must be >= 0"):
        decay(-1)


@pytest.mark.parametrize("bad", [0, 0.0, -0.5, math.nan])
def test_exp_decay_factor_averaging_refuses_bad_min_value(bad: float) -> None:
    with pytest.raises(ValueError, match="min_value must be greater than 0"):
        exp_decay_factor_averaging(min_value=bad)


def test_exp_decay_factor_averaging_drives_a_preconditioner() -> None:
    model = small()
    pre = KFACPreconditioner(model, factor_decay=exp_decay_factor_averaging(0.9))
    backward(model)
    pre.step()  # decay 0 at step 0: the batch factors replace the initial ones
    first = {n: ls.a_factor.clone() for n, ls in pre.state.layers.items()}
    model.zero_grad()
    backward(model, seed=1)
    pre.step()  # decay 0 again at step 1
    model.zero_grad()
    backward(model, seed=1)
    pre.step()  # decay 0.5 at step 2: the mean of the last two (equal) batches
    for n, ls in pre.state.layers.items():
        assert not torch.equal(ls.a_factor, first[n])
    assert kf.step.exp_decay_factor_averaging is exp_decay_factor_averaging


# --------------------------------------------------------------------------- MEM_OPT


def test_mem_opt_on_one_process_warns_and_colocates() -> None:
    with pytest.warns(UserWarning, match=r"MEM_OPT\) requires colocate_factors=True"):
        pre = KFACPreconditioner(
            small(),
            grad_worker_fraction=DistributedStrategy.MEM_OPT,
            colocate_factors=False,
            compute_eigenvalue_outer_product=False,
        )
    assert pre.distributed_strategy is DistributedStrategy.MEM_OPT
    assert pre.colocate_factors is True
    assert pre.grad_worker_fraction == 1.0
    # with colocation asked for: kept as MEM_OPT, silently
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pre = KFACPreconditioner(small(), grad_worker_fraction=DistributedStrategy.MEM_OPT)
    assert pre.distributed_strategy is DistributedStrategy.MEM_OPT
    backward(pre.model)
    pre.step()  # runs as on one rank


def test_mem_opt_with_inverse_and_outer_product_only_warns() -> None:
    with pytest.warns(UserWarning, match="colocate_factors"):
        pre = KFACPreconditioner(
            small(),
            grad_worker_fraction=DistributedStrategy.MEM_OPT,
            colocate_factors=False,
            compute_method="inverse",
            compute_eigenvalue_outer_product=True,
        )
    assert pre.colocate_factors is True


@pytest.mark.parametrize("method", [kf.ComputeMethod.EIGEN, "eigen", "EIGEN"])
@pytest.mark.parametrize(
    "fraction", [DistributedStrategy.MEM_OPT, DistributedStrategy.COMM_OPT, 0.0, 1.0]
)
def test_outer_product_without_colocation_is_refused(method: Any, fraction: Any) -> None:
    with (
        warnings.catch_warnings(),
        pytest.raises(ValueError, match="colocate_factors must be True to use compute_eigen"),
    ):
        warnings.simplefilter("error")  # refused before any MEM_OPT warning
        KFACPreconditioner(
            small(),
            grad_worker_fraction=fraction,
            colocate_factors=False,
            compute_method=method,
            compute_eigenvalue_outer_product=True,
        )


def test_mem_opt_rules_at_any_world_size() -> None:
    layers = {"a": (3, 2), "b": (5, 4)}
    cases: list[tuple[int, DistributedStrategy | float]] = [
        (4, DistributedStrategy.MEM_OPT),
        (4, 0.25),
        (1, DistributedStrategy.MEM_OPT),
    ]
    for world, fraction in cases:
        with pytest.warns(UserWarning, match="colocate_factors"):
            plan = kf.distributed.make_plan(
                layers, world, grad_worker_fraction=fraction, colocate_factors=False
            )
        assert plan.colocate_factors
        with pytest.raises(ValueError, match="colocate_factors must be True"):
            kf.distributed.make_plan(
                layers,
                world,
                grad_worker_fraction=fraction,
                colocate_factors=False,
                compute_eigenvalue_outer_product=True,
            )
    # a fraction that is 1 on one process is COMM_OPT: no warning, no colocation forced
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pre = KFACPreconditioner(
            small(),
            grad_worker_fraction=0.0,
            colocate_factors=False,
            compute_eigenvalue_outer_product=False,
        )
    assert pre.distributed_strategy is DistributedStrategy.COMM_OPT
    assert pre.colocate_factors is False


# --------------------------------------------------------------------------- GPT-NeoX


def pipeline_stage() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(3, 4),
        ColumnParallelLinear(4, 8, gather_output=False),
        nn.Tanh(),
        RowParallelLinear(8, 4, input_is_parallel=True),
        nn.Linear(4, 2),
    )


def test_gpt_neox_registers_only_parallel_linears_by_default(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import kfac_func.parallel.gpt_neox as gn

    # stand in for PipelineModule: building a real one needs a DeepSpeed process group
    monkeypatch.setattr(gn, "_pipeline_module", lambda: nn.Sequential)
    caplog.set_level(logging.INFO, logger="kfac_func")
    with pytest.warns(gn.ExperimentalFeatureWarning):
        pre = gn.GPTNeoXKFACPreconditioner(pipeline_stage(), loglevel=logging.INFO)
    assert list(pre.layers) == ["1", "3"]
    assert pre.splits == {"1": "column", "3": "row"}
    assert {"0", "4"} <= set(pre.layers.skipped)
    assert "include_plain" in pre.layers.skipped["0"]
    registered = [r.getMessage() for r in caplog.records if "Registered name=" in r.getMessage()]
    assert registered == [
        f'Registered name="{n}": {cls}, linear, A {a}x{a}, G {g}x{g} '
        "on global-rank=0 and pipeline-rank=0"
        for n, cls, a, g in (("1", "ColumnParallelLinear", 5, 8), ("3", "RowParallelLinear", 9, 4))
    ]
    with pytest.warns(gn.ExperimentalFeatureWarning):
        pre = gn.GPTNeoXKFACPreconditioner(pipeline_stage(), include_plain_linear=True)
    assert list(pre.layers) == ["0", "1", "3", "4"]
    assert pre.splits == {"0": None, "1": "column", "3": "row", "4": None}
    # the parallel preconditioner itself keeps plain layers by default
    assert list(kf.parallel.ParallelKFACPreconditioner(pipeline_stage()).layers) == [
        "0",
        "1",
        "3",
        "4",
    ]


# --------------------------------------------------------------------------- logging


def test_registration_is_logged_per_layer_at_loglevel(caplog: pytest.LogCaptureFixture) -> None:
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.Flatten(), nn.Linear(12, 2))
    caplog.set_level(logging.INFO, logger="kfac_func")
    KFACPreconditioner(model, loglevel=logging.INFO)
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert messages[:2] == [
        'Registered name="0": Conv2d, conv2d, A 19x19, G 3x3',
        'Registered name="2": Linear, linear, A 13x13, G 2x2',
    ]
    assert any(m.startswith("K-FAC registered layers:") for m in messages)
    assert any(m.startswith("K-FAC layer assignments: KAISA plan: world 1") for m in messages)
    # below the logger's level (the default loglevel is DEBUG): nothing
    caplog.clear()
    KFACPreconditioner(model)
    assert not [r for r in caplog.records if "Registered name=" in r.getMessage()]


# --------------------------------------------------------------------------- scheduler


def test_scheduler_warns_once_per_interval_kept_at_one() -> None:
    pre = KFACPreconditioner(small(), factor_update_steps=2, inv_update_steps=2)
    sched = LambdaParamScheduler(
        pre,
        factor_update_steps_lambda=lambda s: 0,
        inv_update_steps_lambda=lambda s: 0.5,
        damping_lambda=lambda s: 0,  # a float may reach 0: no clamp, no warning
    )
    with pytest.warns(UserWarning) as record:
        sched.step()
    messages = sorted(str(w.message) for w in record)
    assert len(messages) == 1
    assert "factor_update_steps_lambda took factor_update_steps to 0" in messages[0]
    assert "kept at 1" in messages[0]
    assert (pre.factor_update_steps, pre.inv_update_steps, pre.damping) == (1, 1, 0)
    with pytest.warns(UserWarning, match="inv_update_steps") as record:
        sched.step()  # inv_update_steps 1 → 0.5: its first clamp
    assert len(record) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            sched.step()  # both already warned about
    assert (pre.factor_update_steps, pre.inv_update_steps) == (1, 1)
