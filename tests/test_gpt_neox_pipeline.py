"""`GPTNeoXKFACPreconditioner` inside DeepSpeed's pipeline engine on gloo ranks.

Topologies: pipeline 2 (world 2); pipeline 2 × data 2 and pipeline 2 × model 2 (world
4, both in one spawn). The model is a tiny transformer-like stack as a
``deepspeed.pipe.PipelineModule``: a feature projection, two MLP blocks with residuals
whose halves are :mod:`kfac_func.parallel.layers`'s column- and row-parallel linears (one
block in Megatron's wiring, one with whole activations in between) and a head; each
stage holds two of the four pipeline layers. DeepSpeed trains it with ``train_batch``
(two micro-batches per step, gradients averaged over the data-parallel group) and the
client optimizer runs the preconditioner from a step pre-hook, as a user would write it.

The parent trains the same dense model in one process with
:class:`kfac_func.KFACPreconditioner` on the same micro-batches and compares every
step's loss and preconditioned gradients (DeepSpeed does not reduce float64 gradients, so
the model is float32; the factors and decompositions are float64). Also checked: the
loss falls, and the per-layer factor checkpoint files: written by the layers' owners on
every stage, they hold the reference's factors, and a fresh preconditioner loaded from
them resumes exactly like the uninterrupted run.

DeepSpeed is optional: without it these tests are skipped.
"""

from __future__ import annotations

import itertools
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from gloo import gloo_group, one_thread, record_errors, spawn
from torch import nn

import kfac_func as kf
from kfac_func.parallel.layers import ColumnParallelLinear, RowParallelLinear

pytestmark = pytest.mark.slow  # DeepSpeed and gloo process groups: one spawn per world size

F32, F64 = torch.float32, torch.float64
D, HIDDEN, T, CLASSES = 4, 8, 3, 3
MICRO = 3  # examples per micro-batch
GAS = 2  # micro-batches per step and replica
STEPS = 6
MORE = 2  # steps after the checkpoint, uninterrupted and resumed
LR = 0.3
TOL = 1e-6  # float32 forward/backward, sums in another order than in the dense model
# world -> scenarios (pipeline, data, model)
SCENARIOS = {2: [(2, 1, 1)], 4: [(2, 2, 1), (2, 1, 2)]}
SPLITS = {"1.up": "column", "1.down": "row", "2.up": "column", "2.down": "row"}
HYPER: dict[str, Any] = dict(
    factor_update_steps=2,
    inv_update_steps=3,
    damping=0.01,
    factor_decay=0.9,
    kl_clip=1e-2,
    lr=LR,
    compute_eigenvalue_outer_product=False,  # GPT-NeoX's default; the adapter's is True
    factor_dtype=F64,
    inv_dtype=F64,
)


def label(scenario: tuple[int, int, int]) -> str:
    pp, dp, mp_ = scenario
    return f"pipe{pp}xdata{dp}xmodel{mp_}"


class Block(nn.Module):
    """``x + down(tanh(up(x)))``: an MLP block of a transformer layer."""

    def __init__(self, up: nn.Module, down: nn.Module) -> None:
        super().__init__()
        self.up, self.down = up, down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


def make_layers(tp_group: Any = "dense") -> list[nn.Module]:
    """The four pipeline layers; with a model-parallel group the blocks are split."""
    torch.manual_seed(0)
    embed = nn.Linear(D, D, bias=False)
    blocks = [Block(nn.Linear(D, HIDDEN), nn.Linear(HIDDEN, D)) for _ in range(2)]
    head = nn.Linear(D, CLASSES)
    if tp_group != "dense":
        b0, b1 = blocks
        b0.up = ColumnParallelLinear.from_dense(b0.up, gather_output=False, group=tp_group)
        b0.down = RowParallelLinear.from_dense(b0.down, input_is_parallel=True, group=tp_group)
        b1.up = ColumnParallelLinear.from_dense(b1.up, gather_output=True, group=tp_group)
        b1.down = RowParallelLinear.from_dense(b1.down, input_is_parallel=False, group=tp_group)
    return [embed, *blocks, head]


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, CLASSES), y.reshape(-1))


def micro_batches(data: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The fixed training set: ``GAS`` micro-batches per replica, replica-major."""
    g = torch.Generator().manual_seed(7)
    return [
        (torch.randn(MICRO, T, D, generator=g), torch.randint(0, CLASSES, (MICRO, T), generator=g))
        for _ in range(data * GAS)
    ]


def grads_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


# --- workers -------------------------------------------------------------------


def _deepspeed_environment(rank: int, world: int, tmp: str) -> None:
    """What DeepSpeed reads from a launcher's environment; a build directory per rank."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        TORCH_EXTENSIONS_DIR=os.path.join(tmp, f"extensions{rank}"),
    )


def _start_deepspeed() -> Any:
    """DeepSpeed's communication backend on the default (gloo) process group."""
    import deepspeed

    # On CPU, DeepSpeed's communication backend compiles a shared-memory all-reduce op when
    # it starts (about a minute; builds racing in one cache can hang). The tests run on
    # gloo's collectives, so the op is not built.
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")
    return deepspeed


def _scenario(deepspeed: Any, scenario: tuple[int, int, int], tmp: str) -> dict[str, Any]:
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.pipe.topology import (
        PipelineParallelGrid,
        PipeModelDataParallelTopology,
    )

    from kfac_func.parallel.gpt_neox import ExperimentalFeatureWarning, GPTNeoXKFACPreconditioner

    pp, dp, mp_ = scenario
    topology = PipeModelDataParallelTopology(num_pp=pp, num_mp=mp_, num_dp=dp)
    # the tensor-parallel layers need their group before the pipeline module is built
    # (GPT-NeoX sets up its model-parallel groups from the same topology first)
    tp_group = PipelineParallelGrid(topology=topology).get_slice_parallel_group()
    pipe = PipelineModule(
        make_layers(tp_group), topology=topology, loss_fn=loss_fn, partition_method="uniform"
    )
    grid = pipe._grid
    d = grid.get_data_parallel_rank()
    opt = torch.optim.SGD(pipe.parameters(), lr=LR)
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "train_batch_size": MICRO * GAS * dp,
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(model=pipe, optimizer=opt, config=config)
    mine = micro_batches(dp)[d * GAS : (d + 1) * GAS]
    factor_dir = os.path.join(tmp, f"factors_{label(scenario)}")

    def attach(pre: Any, record: list[dict[str, torch.Tensor]]) -> list[Any]:
        # the whole integration: DeepSpeed averaged the gradients, K-FAC preconditions
        # them, the client optimizer steps
        return [
            opt.register_step_pre_hook(lambda *_: pre.step()),
            opt.register_step_pre_hook(lambda *_: record.append(grads_of(pipe))),
        ]

    def train(steps: int) -> list[float]:
        return [float(engine.train_batch(data_iter=iter(mine))) for _ in range(steps)]

    # the dense reference preconditions every linear: so must the pipeline
    # (GPTNeoXKFACPreconditioner registers only the column/row-parallel ones by default)
    with pytest.warns(ExperimentalFeatureWarning):
        pre = GPTNeoXKFACPreconditioner(
            pipe, factor_checkpoint_dir=factor_dir, include_plain_linear=True, **HYPER
        )
    record: list[dict[str, torch.Tensor]] = []
    handles = attach(pre, record)
    losses = train(STEPS)
    sd = pre.state_dict()  # writes the factor files
    params = {n: p.detach().clone() for n, p in pipe.named_parameters()}
    losses += train(MORE)
    grads, cont = record[:STEPS], record[STEPS:]
    # resume: parameters back, a fresh preconditioner that reads the factor files
    with torch.no_grad():
        for n, p in pipe.named_parameters():
            p.copy_(params[n])
    for h in handles:
        h.remove()
    pre.remove()
    with pytest.warns(ExperimentalFeatureWarning):
        pre2 = GPTNeoXKFACPreconditioner(
            pipe, factor_checkpoint_dir=factor_dir, include_plain_linear=True, **HYPER
        )
    pre2.load_state_dict(sd)
    resumed: list[dict[str, torch.Tensor]] = []
    handles = attach(pre2, resumed)
    train(MORE)
    for h in handles:
        h.remove()
    pre2.remove()
    with pytest.warns(ExperimentalFeatureWarning):
        default = GPTNeoXKFACPreconditioner(pipe, **HYPER)
    default.remove()
    return {
        "stage": grid.get_stage_id(),
        "data": d,
        "model": grid.get_slice_parallel_rank(),
        "losses": losses,
        "grads": grads,
        "layers": sorted(pre.layers),
        "splits": dict(pre.splits),
        "default_layers": sorted(default.layers),
        "sd_keys": sorted(sd),
        "steps_after_load": pre2.steps,
        "resume_diff": max(
            float((a[k] - b[k]).abs().max()) for a, b in zip(cont, resumed) for k in a
        ),
        "factor_dir": factor_dir,
    }


def _worker(rank: int, world: int, tmp: str) -> None:
    # the error file also covers the environment and the group's start
    with record_errors(Path(tmp, f"rank{rank}.error")):
        t0 = time.perf_counter()
        _deepspeed_environment(rank, world, tmp)
        with gloo_group(rank, world, tmp, timeout=timedelta(seconds=120)):
            deepspeed = _start_deepspeed()
            started = time.perf_counter() - t0
            results = {label(s): _scenario(deepspeed, s, tmp) for s in SCENARIOS[world]}
            torch.save(
                {
                    "results": results,
                    "start_seconds": started,
                    "seconds": time.perf_counter() - t0,
                },
                Path(tmp, f"rank{rank}.pt"),
            )


# --- fixtures ------------------------------------------------------------------


@pytest.fixture(scope="module", params=sorted(SCENARIOS), ids=lambda w: f"world{w}")
def spawned(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[int, list[dict[str, Any]]]:
    pytest.importorskip("deepspeed")
    world: int = request.param
    tmp = tmp_path_factory.mktemp(f"gpt_neox{world}")
    t0 = time.perf_counter()
    spawn(_worker, world, tmp)
    results = [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(world)]
    print(
        f"\nDeepSpeed pipeline world {world}: spawn {time.perf_counter() - t0:.1f} s "
        f"(rank 0: DeepSpeed up after {results[0]['start_seconds']:.1f} s, "
        f"done after {results[0]['seconds']:.1f} s)"
    )
    return world, results


@pytest.fixture(scope="module")
def reference() -> dict[int, dict[str, Any]]:
    """The dense model with :class:`kfac_func.KFACPreconditioner` in one process: every
    replica's micro-batches, each loss divided by the micro-batches per replica (as
    DeepSpeed does), the summed gradients averaged over the replicas."""
    with one_thread():
        out = {}
        for data in sorted({dp for runs in SCENARIOS.values() for _, dp, _ in runs}):
            model = nn.Sequential(*make_layers())
            pre = kf.KFACPreconditioner(model, accumulation_steps=data * GAS, **HYPER)
            opt = torch.optim.SGD(model.parameters(), lr=LR)
            batches = micro_batches(data)
            losses, grads = [], []
            state = None
            for step in range(STEPS + MORE):
                opt.zero_grad()
                total = 0.0
                for x, y in batches:
                    loss = loss_fn(model(x), y)
                    (loss / GAS).backward()
                    total += float(loss.detach())
                for p in model.parameters():
                    assert p.grad is not None
                    p.grad /= data
                pre.step()
                grads.append(grads_of(model))
                opt.step()
                losses.append(total / len(batches))
                if step == STEPS - 1:
                    state = pre.state
            out[data] = {"losses": losses, "grads": grads, "state": state}
        return out


def _runs(results: list[dict[str, Any]]) -> list[tuple[str, list[dict[str, Any]]]]:
    return [(name, [r["results"][name] for r in results]) for name in results[0]["results"]]


def _join(
    runs: list[dict[str, Any]], step: int, name: str, mp_: int, data: int
) -> torch.Tensor | None:
    """The full gradient of parameter ``name`` from the ranks of replica ``data``."""
    layer, _, kind = name.rpartition(".")
    have = sorted(
        (r["model"], r["grads"][step][name])
        for r in runs
        if r["data"] == data and name in r["grads"][step]
    )
    if not have:
        return None
    parts = [t for _, t in have]
    assert len(parts) == mp_, name
    split = SPLITS.get(layer) if mp_ > 1 else None
    if split == "column":
        return torch.cat(parts, dim=0)
    if split == "row" and kind == "weight":
        return torch.cat(parts, dim=1)
    for p in parts[1:]:  # replicated over the model-parallel ranks
        assert torch.equal(p, parts[0]), name
    return parts[0]


# --- tests ---------------------------------------------------------------------


def test_preconditioned_gradients_match_dense_model(
    spawned: tuple[int, list[dict[str, Any]]], reference: dict[int, dict[str, Any]]
) -> None:
    world, results = spawned
    for name, runs in _runs(results):
        _, dp, mp_ = next(s for s in SCENARIOS[world] if label(s) == name)
        ref = reference[dp]
        worst, bad = 0.0, []
        for d in range(dp):
            for step in range(STEPS):
                seen = set()
                for pname, g in ref["grads"][step].items():
                    got = _join(runs, step, pname, mp_, d)
                    if got is None:
                        continue
                    seen.add(pname)
                    err = float((got - g).abs().max())
                    worst = max(worst, err)
                    if not err < TOL:
                        bad.append(f"{name} replica {d} step {step} {pname}: {err:.2e}")
                assert seen == set(ref["grads"][step]), name  # every stage reported
        print(f"\n{name}: max |pipeline - dense| gradient = {worst:.2e}")
        assert not bad, "\n".join(bad)


def test_losses_match_dense_model_and_fall(
    spawned: tuple[int, list[dict[str, Any]]], reference: dict[int, dict[str, Any]]
) -> None:
    world, results = spawned
    for name, runs in _runs(results):
        _, dp, _ = next(s for s in SCENARIOS[world] if label(s) == name)
        want = torch.tensor(reference[dp]["losses"])
        for r in runs:  # DeepSpeed returns the step's loss on every rank
            got = torch.tensor(r["losses"])
            assert float((got - want).abs().max()) < TOL, (name, got, want)
        losses = runs[0]["losses"]
        print(f"\n{name}: loss {losses[0]:.4f} -> {losses[-1]:.4f}")
        assert losses[-1] < 0.9 * losses[0], losses
        assert all(b < a for a, b in itertools.pairwise(losses)), losses


def test_each_stage_registers_its_own_layers(spawned: tuple[int, list[dict[str, Any]]]) -> None:
    _, results = spawned
    stage_layers = {0: ["0", "1.down", "1.up"], 1: ["2.down", "2.up", "3"]}
    for name, runs in _runs(results):
        for r in runs:
            assert r["layers"] == stage_layers[r["stage"]], name
            want = {n: SPLITS.get(n) for n in r["layers"]}
            assert r["splits"] == want, name  # split classes are recognised even at mp=1
            # by default only the column- and row-parallel linears
            assert r["default_layers"] == [n for n in stage_layers[r["stage"]] if n in SPLITS]


def test_factor_files_hold_the_reference_factors(
    spawned: tuple[int, list[dict[str, Any]]], reference: dict[int, dict[str, Any]]
) -> None:
    world, results = spawned
    for name, runs in _runs(results):
        _, dp, _ = next(s for s in SCENARIOS[world] if label(s) == name)
        ref = reference[dp]["state"]
        assert "layers" not in runs[0]["sd_keys"]  # the factors went to the files
        directory = runs[0]["factor_dir"]
        manifest = kf.checkpoint.read_factor_manifest(directory)
        writers = {e["name"]: e["writer"] for e in manifest["layers"]}
        assert sorted(writers) == sorted(ref.layers)  # every layer of both stages
        assert set(writers.values()) != {0}, writers  # written by their owners
        got = kf.checkpoint.load_factor_dir(directory, like=ref)
        assert got.step == STEPS
        worst = 0.0
        for lname, ls in ref.layers.items():
            for a, b in ((got.layers[lname].a_factor, ls.a_factor),
                         (got.layers[lname].g_factor, ls.g_factor)):  # fmt: skip
                worst = max(worst, float((a - b).abs().max()))
        print(f"\n{name}: max |factor file - dense factor| = {worst:.2e}")
        assert worst < TOL


def test_resume_from_factor_files_equals_uninterrupted_run(
    spawned: tuple[int, list[dict[str, Any]]],
) -> None:
    _, results = spawned
    for name, runs in _runs(results):
        for r in runs:
            assert r["steps_after_load"] == STEPS + MORE, name
            assert r["resume_diff"] == 0.0, (name, r["resume_diff"])
