"""Distributed faults on real gloo groups: ranks that disagree fail fast, a rank that
dies does not hang the others.

One start per world size (2 and 4 ranks); every scenario runs inside it, in order:

- ``agree``: identical models and hyperparameters (one of them a callable schedule):
  construction and a step succeed;
- ``model``: the last rank's model has a wider hidden layer;
- ``order``: the last rank's state lists the layers in another order (functional API):
  the plan and every collective follow the layer names, so the ranks still agree and
  return bit-identical gradients;
- ``hyper``: the last rank uses another ``lr``;
- ``dead``: the last rank exits after construction (2 ranks) or stalls past the
  collective timeout (4 ranks); the others step and must fail within the timeout (plus
  slack), not hang.

In the two mismatch scenarios every rank must raise :class:`kf.distributed.RankMismatchError`
naming the differing line of the disagreeing rank next to rank 0's.
"""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from gloo import assert_no_errors, gloo_group, record_errors, spawn
from torch import nn

import kfac_func as kf

TIMEOUT_S = 5.0


def make_model(hidden: int = 8) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, hidden), nn.Tanh(), nn.Linear(hidden, 3))


def damping_schedule(step: int) -> float:
    return 0.01 / (1 + step)


def _expect_mismatch(build: Any) -> dict[str, Any]:
    t0 = time.perf_counter()
    try:
        build()
    except kf.distributed.RankMismatchError as e:
        return {"error": str(e), "seconds": time.perf_counter() - t0}
    return {"error": None}


def _step(pre: kf.KFACPreconditioner, model: nn.Module) -> None:
    x = torch.randn(6, 4)
    model(x).pow(2).mean().backward()
    pre.step()


def _worker(rank: int, world: int, tmp: str) -> None:
    with gloo_group(rank, world, tmp, timeout=timedelta(seconds=30)):
        last = rank == world - 1
        out: dict[str, Any] = {}
        # a failure is recorded, never raised: every rank must leave through os._exit
        with record_errors(Path(tmp, f"rank{rank}.error"), reraise=False):
            model = make_model()
            pre = kf.KFACPreconditioner(model, damping=damping_schedule)
            _step(pre, model)
            out["agree"] = {"steps": pre.steps}

            out["model"] = _expect_mismatch(
                lambda: kf.KFACPreconditioner(make_model(9 if last else 8))
            )

            model = make_model()
            layers = kf.register(model)
            if last:
                layers = kf.LayerTable(reversed(list(layers.values())))
            plan = kf.distributed.make_plan(layers, world)
            comm = kf.distributed.Communicator(plan)
            state = kf.init(layers)
            x, y = torch.randn(5, 4), torch.randn(5, 3)
            params = dict(model.named_parameters())
            for _ in range(2):
                _, grads, caps = kf.capture(model, params, x, lambda o: (o - y).pow(2).mean())
                grads, state = kf.distributed.update_distributed(
                    state, grads, captures=caps, plan=plan, comm=comm
                )
            flat = torch.cat([grads[k].reshape(-1) for k in sorted(grads)])
            gathered = [torch.empty_like(flat) for _ in range(world)]
            dist.all_gather(gathered, flat)
            out["order"] = {
                "state_order": list(state.layers),
                "identical": all(torch.equal(g, gathered[0]) for g in gathered),
            }

            out["hyper"] = _expect_mismatch(
                lambda: kf.KFACPreconditioner(make_model(), lr=0.2 if last else 0.1)
            )

            model = make_model()
            pre = kf.KFACPreconditioner(
                model, settings=kf.Settings(collective_timeout=timedelta(seconds=TIMEOUT_S))
            )
            Path(tmp, f"rank{rank}.json").write_text(json.dumps(out))
            # every rank has built its groups (gloo connects them pairwise) before the last
            # one dies: dying sooner closes a connection another rank is still making
            dist.barrier()
            if last:
                if world == 4:  # stalls: only the timeout can tell
                    time.sleep(TIMEOUT_S + 2)
                os._exit(0)  # dies without a word to its peers
            t0 = time.perf_counter()
            try:
                for _ in range(3):
                    _step(pre, model)
                out["dead"] = {"error": None}
            except Exception as e:  # gloo: closed connection or timeout
                out["dead"] = {
                    "error": f"{type(e).__name__}: {e}"[:300],
                    "seconds": time.perf_counter() - t0,
                }
            Path(tmp, f"rank{rank}.json").write_text(json.dumps(out))
        os._exit(0)  # the group is broken: skip its teardown


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def spawned(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    world: int = request.param
    tmp = tmp_path_factory.mktemp(f"faults{world}")
    ctx = spawn(_worker, world, tmp, join=False)
    deadline = time.monotonic() + 120
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"world {world}: ranks still running after 120 s (a hang)")
    assert_no_errors(tmp)
    return world, [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(world)]


def test_agreeing_ranks_step(spawned: Any) -> None:
    _, results = spawned
    assert all(r["agree"] == {"steps": 1} for r in results)


@pytest.mark.parametrize(
    ("scenario", "theirs", "mine"),
    [
        ("model", "layer '0': A 1x5, G 1x9", "layer '0': A 1x5, G 1x8"),
        ("hyper", "lr = 0.2", "lr = 0.1"),
    ],
)
def test_disagreeing_ranks_all_fail_naming_the_difference(
    spawned: Any, scenario: str, theirs: str, mine: str
) -> None:
    world, results = spawned
    for rank, r in enumerate(results):
        msg = r[scenario]["error"]
        assert msg is not None, f"rank {rank}: no RankMismatchError in {scenario!r}"
        assert msg.startswith(
            f"ranks disagree on the K-FAC plan or settings (seen from rank {rank})"
        ), msg
        lines = msg.splitlines()
        assert lines[1].startswith(f"  rank {world - 1}: ") and theirs in lines[1], msg
        assert lines[2].startswith("  rank 0: ") and mine in lines[2], msg
        assert len(lines) == 3, msg  # only the disagreeing rank is listed


def test_layer_order_of_the_state_does_not_matter(spawned: Any) -> None:
    _, results = spawned
    assert results[0]["order"]["state_order"] == ["0", "2"]
    assert results[-1]["order"]["state_order"] == ["2", "0"]
    assert all(r["order"]["identical"] for r in results)


def test_a_dead_rank_fails_the_others_fast(spawned: Any) -> None:
    world, results = spawned
    for rank, r in enumerate(results[:-1]):
        dead = r["dead"]
        assert dead["error"] is not None, f"rank {rank} stepped on with a dead peer"
        assert dead["seconds"] < TIMEOUT_S + 8, dead
        if world == 4:  # a stalled peer: the timeout, not a closed connection
            assert dead["seconds"] > TIMEOUT_S * 0.9, dead
    print(f"\nworld {world}: {[r['dead'] for r in results[:-1]]}")
