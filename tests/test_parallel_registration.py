"""Which layers the model-parallel preconditioner registers, and how the plan places them
(one process, no process group).

Tensor-parallel linears are recognised by class before any single-device kind: Megatron
stand-ins that subclass ``nn.Linear`` get the full layer's factor sizes, look-alikes that
cannot be placed are refused by name, and ``parallel_classes`` places other classes. The
plan's owners are checked against the cases of kfac-pytorch's GPT-NeoX assignment tests
(same topologies; the owners agree except where equal-cost layers tie, which the two
libraries break in opposite name orders).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import kfac_func as kf
from kfac_func.blocks import LayerSpec
from kfac_func.parallel import layers as tp
from kfac_func.parallel.plan import make_parallel_plan, register_parallel
from kfac_func.parallel.splits import looks_parallel, split_of


class ColumnParallelLinear(nn.Linear):
    """kfac-pytorch's test stand-in: Megatron's class name on an ``nn.Linear`` shard."""


class RowParallelLinear(nn.Linear):
    """kfac-pytorch's test stand-in for the row-parallel linear."""


class TEColumnParallelLinear(nn.Linear):
    """A look-alike: its name ends in ``ParallelLinear`` but is no built-in class name."""


class ShardedProjection(nn.Linear):
    """A look-alike by attributes: Megatron's row-parallel ``input_is_parallel``."""

    def __init__(self, i: int, o: int) -> None:
        super().__init__(i, o)
        self.input_is_parallel = True


def kfac_pytorch_model(layers: int = 6, hidden: int = 32) -> nn.Sequential:
    """kfac-pytorch's test model: one column stand-in, then row stand-ins, then a plain
    linear and a frozen row stand-in (neither to be registered)."""
    model = nn.Sequential(ColumnParallelLinear(hidden, hidden))
    for _ in range(layers - 1):
        model.append(RowParallelLinear(hidden, hidden))
    model.append(nn.Linear(hidden, hidden))
    frozen = RowParallelLinear(hidden, hidden)
    frozen.requires_grad_(False)
    model.append(frozen)
    return model


# --- recognition by class ----------------------------------------------------------


def test_kfac_pytorchs_stand_ins_are_registered_by_class() -> None:
    table, splits = register_parallel(kfac_pytorch_model(), include_plain=False)
    assert splits == {"0": "column", **{str(i): "row" for i in range(1, 6)}}
    assert table.skipped == {
        "6": "not a column- or row-parallel linear (include_plain=False)",
        "7": "weight does not require grad",
    }
    table, splits = register_parallel(kfac_pytorch_model(), include_plain=True)
    assert splits["6"] is None and len(table) == 7  # the plain linear, replicated


@pytest.mark.parametrize("mp", [1, 2, 4])
def test_stand_in_shards_get_the_full_layers_sizes(mp: int) -> None:
    # each rank's stand-ins hold one shard of a 16 -> 16 and a 16 -> 6 layer
    model = nn.Sequential(ColumnParallelLinear(16, 16 // mp), RowParallelLinear(16 // mp, 6))
    table, splits = register_parallel(model, mp)
    assert splits == {"0": "column", "1": "row"}
    assert [(s.in_dim, s.out_dim, s.a_dim, s.g_dim) for s in table.values()] == [
        (16, 16, 17, 16),
        (16, 6, 17, 6),
    ]


def test_parallel_classes_win_over_nn_linear_and_names() -> None:
    class Projection(nn.Linear):
        pass

    class Down(Projection):  # a subclass follows its mapped class
        pass

    model = nn.Sequential(Projection(4, 3), Down(3, 4), ColumnParallelLinear(4, 2))
    _, splits = register_parallel(
        model,
        2,
        parallel_classes={Projection: "column", "Down": "row", "ColumnParallelLinear": None},
    )
    assert splits == {"0": "column", "1": "row", "2": None}
    # a mapping to None declares the class replicated: a plain linear, unsplit sizes
    table, _ = register_parallel(model, 2, parallel_classes={ColumnParallelLinear: None})
    assert (table["2"].in_dim, table["2"].out_dim) == (4, 2)


def test_subclasses_of_the_library_layers_are_placed_by_their_base() -> None:
    class Up(tp.ColumnParallelLinear):
        pass

    assert split_of(Up(2, 4)) == "column"
    assert looks_parallel(Up(2, 4)) is None


@pytest.mark.parametrize(
    ("module", "why"),
    [
        (TEColumnParallelLinear(4, 4), "its class name 'TEColumnParallelLinear' ends in"),
        (ShardedProjection(4, 4), "attribute(s) input_is_parallel of a tensor-parallel"),
    ],
)
def test_look_alikes_are_refused_by_name(module: nn.Module, why: str) -> None:
    model = nn.Sequential(nn.Linear(4, 4), module)
    cls = type(module).__name__
    with pytest.raises(
        ValueError, match=rf"layer '1' \(.*{cls}\) looks like a tensor-parallel"
    ) as e:
        register_parallel(model, 2)
    assert why in str(e.value)
    assert f"parallel_classes={{{cls}: 'column' | 'row'}}" in str(e.value)
    # placed once mapped, or left out when skipped
    _, splits = register_parallel(model, 2, parallel_classes={type(module): "row"})
    assert splits["1"] == "row"
    assert "1" in register_parallel(model, 2, skip_layers=[cls])[0].skipped


def test_a_container_named_like_a_parallel_linear_is_judged_by_its_children() -> None:
    class ParallelLinear(nn.Module):  # GPT-NeoX wraps its output layer in this class
        def __init__(self) -> None:
            super().__init__()
            self.final_linear = ColumnParallelLinear(4, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.final_linear(x)
            return out

    table, splits = register_parallel(nn.Sequential(ParallelLinear()), 2)
    assert splits == {"0.final_linear": "column"}
    assert table["0.final_linear"].out_dim == 16


def test_look_alikes_are_refused_even_without_plain_layers() -> None:
    with pytest.raises(ValueError, match="TEColumnParallelLinear"):
        register_parallel(nn.Sequential(TEColumnParallelLinear(2, 2)), include_plain=False)


class _NoWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = None  # Megatron's skip_weight_param_allocation: given at call time


class _Weight3d(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(2, 3, 4))


class _SequenceParallel(nn.Linear):
    sequence_parallel = True


class _WrongBias(nn.Linear):
    def __init__(self) -> None:
        super().__init__(4, 6)
        self.bias = nn.Parameter(torch.zeros(12))


class _WrongSize(nn.Linear):
    def __init__(self) -> None:
        super().__init__(4, 6)
        self.output_size_per_partition = 3


@pytest.mark.parametrize(
    ("module", "message"),
    [
        (_NoWeight(), r"its weight parameter is None, not a 2-d tensor"),
        (_Weight3d(), r"its weight parameter is \(2, 3, 4\), not a 2-d tensor"),
        (_SequenceParallel(4, 6), r"sequence_parallel=True"),
        (_WrongBias(), r"its bias has shape \(12,\), expected \(6,\)"),
        (_WrongSize(), r"output_size_per_partition=3, but a column-parallel weight shard"),
    ],
)
def test_parallel_layers_that_cannot_be_placed_are_refused(module: nn.Module, message: str) -> None:
    model = nn.Sequential(module)
    with pytest.raises(ValueError, match=message) as e:
        register_parallel(model, 2, parallel_classes={type(module): "column"})
    assert "layer '0'" in str(e.value) and type(module).__name__ in str(e.value)


def test_parallel_classes_are_checked() -> None:
    with pytest.raises(ValueError, match=r"parallel_classes\['X'\] must be 'column', 'row'"):
        register_parallel(nn.Linear(2, 2), parallel_classes={"X": "columns"})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match=r"keys must be nn\.Module classes or class names"):
        register_parallel(nn.Linear(2, 2), parallel_classes={1: "row"})  # type: ignore[dict-item]


def test_preconditioner_takes_parallel_classes() -> None:
    model = nn.Sequential(TEColumnParallelLinear(4, 6), nn.Tanh(), RowParallelLinear(6, 2))
    with pytest.raises(ValueError, match="TEColumnParallelLinear"):
        kf.parallel.ParallelKFACPreconditioner(model)
    pre = kf.parallel.ParallelKFACPreconditioner(
        model, parallel_classes={TEColumnParallelLinear: "column"}, damping=0.1
    )
    model(torch.randn(5, 4)).pow(2).mean().backward()
    pre.step()
    assert pre.splits == {"0": "column", "2": "row"}
    assert pre.state.layers["0"].decomposition is not None


# --- the plan: splits, parts, groups ---------------------------------------------------


def test_plan_states_split_dimensions_and_parts() -> None:
    model = nn.Sequential(ColumnParallelLinear(8, 3), RowParallelLinear(3, 5), nn.Linear(5, 2))
    table, splits = register_parallel(model, 2)
    plan = make_parallel_plan(table, splits, data_parallel_size=1, model_parallel_size=2)
    got = {
        n: (lp.split_dim, lp.a_size, lp.g_size, lp.a_part, lp.g_part)
        for n, lp in plan.layers.items()
    }
    assert got == {
        "0": (0, 9, 6, 9, 3),  # 8 -> 6 split on its outputs: 3 per rank
        "1": (1, 7, 5, 3, 5),  # 6 -> 5 split on its inputs: 3 per rank (+ the bias column)
        "2": (None, 6, 2, 6, 2),
    }
    text = str(plan)
    assert "A per rank" in text and "column (dim 0)" in text and "row (dim 1)" in text


def test_plan_refuses_a_side_that_does_not_split() -> None:
    spec = LayerSpec("fc", "linear", "fc.weight", None, 6, 5)
    with pytest.raises(ValueError, match=r"layer 'fc' \(column-parallel\): its output size 5"):
        make_parallel_plan(
            {"fc": spec}, {"fc": "column"}, data_parallel_size=1, model_parallel_size=2
        )


def test_groups_follow_the_owner() -> None:
    specs = {n: LayerSpec(n, "linear", f"{n}.weight", None, 4, 4) for n in ("a", "b", "c", "d")}
    plan = make_parallel_plan(
        specs, dict.fromkeys(specs, "column"), data_parallel_size=2, model_parallel_size=2
    )
    for name, lp in plan.layers.items():
        od, om = lp.owner_data, lp.owner_model
        assert plan.factor_group(name) == ((0, om), (1, om))
        assert plan.grad_workers(name) == ((od, 0), (od, 1))
        for d in range(2):
            for m in range(2):
                assert plan.grad_source(name, d, m) == (od, m)
        for m in range(2):
            receivers = plan.grad_receivers(name, m)
            assert receivers[0] == (od, m) and sorted(receivers) == [(0, m), (1, m)]
    assert sorted(plan.owner_index(n) for n in specs) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match=r"peer \(data=2, model=0\) is outside stage 0"):
        plan.grad_source("a", 2, 0)


# --- kfac-pytorch's GPT-NeoX assignment cases ------------------------------------------


def _work_specs(work: dict[str, dict[str, int]]) -> dict[str, LayerSpec]:
    # a layer of work {"A": a, "G": g} under the cost n -> n: sides a and g
    return {n: LayerSpec(n, "linear", f"{n}.weight", None, f["A"], f["G"]) for n, f in work.items()}


EQUAL = {"l1": {"A": 1, "G": 1}, "l2": {"A": 1, "G": 1}}
UNEQUAL = {"l1": {"A": 10, "G": 10}, "l2": {"A": 1, "G": 1}, "l3": {"A": 1, "G": 1}}


@pytest.mark.parametrize(
    ("work", "ranks", "kfac_pytorch", "ours"),
    [
        ({}, [0, 1], {}, {}),
        (EQUAL, [0], {"l1": 0, "l2": 0}, {"l1": 0, "l2": 0}),
        # equal costs: kfac-pytorch takes l2 first (descending names), we take l1 first
        (EQUAL, [0, 1], {"l1": 1, "l2": 0}, {"l1": 0, "l2": 1}),
        (EQUAL, [0, 1, 2], {"l1": 1, "l2": 0}, {"l1": 0, "l2": 1}),
        (UNEQUAL, [0, 1], {"l1": 0, "l2": 1, "l3": 1}, {"l1": 0, "l2": 1, "l3": 1}),
    ],
)
def test_kfac_pytorchs_assignment_cases(
    work: dict[str, dict[str, int]],
    ranks: list[int],
    kfac_pytorch: dict[str, int],
    ours: dict[str, int],
) -> None:
    # kfac-pytorch's topology PipeModelDataParallelTopology(1, len(ranks), 1): one stage,
    # len(ranks) data-parallel ranks, no model parallelism
    specs = _work_specs(work)
    plan = make_parallel_plan(
        specs,
        dict.fromkeys(specs),
        data_parallel_size=len(ranks),
        model_parallel_size=1,
        assignment_strategy=float,  # cost n -> n: a layer costs A + G, as kfac-pytorch sums
    )
    owners = {n: plan.owner_index(n) for n in specs}
    assert owners == ours
    assert set(plan.layers) == set(work)
    # kfac-pytorch's owners differ only where equal-cost layers tie; the balance is the
    # same either way: the sorted loads agree
    load = {r: 0 for r in ranks}
    for n, r in kfac_pytorch.items():
        load[r] += sum(work[n].values())
    assert sorted(plan.load) == sorted(float(v) for v in load.values())
    for name, owner in owners.items():
        assert owner in ranks
        # MEM-OPT: the owner's model-parallel group (here the owner alone) preconditions
        # the gradient, and every data-parallel peer receives it from the owner
        assert plan.grad_workers(name) == ((owner, 0),)
        assert {plan.grad_source(name, d, 0) for d in range(len(ranks))} == {(owner, 0)}


@pytest.mark.parametrize(("pp", "dp", "mp"), [(1, 2, 2), (2, 2, 2), (2, 1, 2), (4, 1, 1)])
def test_peer_order_is_the_topologys_rank_order(pp: int, dp: int, mp: int) -> None:
    """The plan's peer index ``data · model_parallel_size + model`` orders a stage's peers
    as DeepSpeed's global ranks do, the order of kfac-pytorch's GPT-NeoX assignment."""
    topology_mod: Any = pytest.importorskip("deepspeed.runtime.pipe.topology")
    topology = topology_mod.PipeModelDataParallelTopology(num_pp=pp, num_mp=mp, num_dp=dp)
    for stage in range(pp):
        peers = [r for r in range(topology.world_size()) if topology.get_coord(r).pipe == stage]
        ours = [topology.get_rank(pipe=stage, data=i // mp, model=i % mp) for i in range(dp * mp)]
        assert ours == sorted(peers)
