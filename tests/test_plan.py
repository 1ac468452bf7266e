"""The KAISA plan (:mod:`kfac_func.distributed.plan`): pure data, no process group.

Property tests draw random layer tables and world sizes and check the invariants of the
sharding; example tests pin down validation, warnings and the cost functions.
"""

from __future__ import annotations

import math
import random
import warnings
from collections.abc import Mapping

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kfac_func as kf
from kfac_func.blocks import LayerSpec
from kfac_func.distributed.plan import DistributedStrategy, Plan, make_plan, resolve_grad_workers

Layers = dict[str, LayerSpec | tuple[int, int]]

# --------------------------------------------------------------------------- strategies


@st.composite
def layer_entries(draw: st.DrawFn, name: str) -> LayerSpec | tuple[int, int]:
    """A layer as an ``(a, g)`` tuple, a Linear LayerSpec or a grouped Conv2d LayerSpec."""
    kind = draw(st.sampled_from(["tuple", "linear", "conv"]))
    bias = draw(st.booleans())
    if kind == "tuple":
        return (draw(st.integers(1, 600)), draw(st.integers(1, 600)))
    if kind == "linear":
        return LayerSpec(
            name,
            "linear",
            f"{name}.weight",
            f"{name}.bias" if bias else None,
            in_dim=draw(st.integers(1, 599)),
            out_dim=draw(st.integers(1, 600)),
        )
    groups = draw(st.integers(1, 8))
    k = draw(st.integers(1, 3))
    per_group_in = draw(st.integers(1, 599 // (k * k)))
    return LayerSpec(
        name,
        "conv2d",
        f"{name}.weight",
        f"{name}.bias" if bias else None,
        in_dim=groups * per_group_in,
        out_dim=groups * draw(st.integers(1, 600 // groups)),
        groups=groups,
        kernel_size=(k, k),
        stride=(1, 1),
        dilation=(1, 1),
        padding=(0, 0, 0, 0),
    )


@st.composite
def layer_tables(draw: st.DrawFn) -> Layers:
    names = draw(
        st.lists(
            st.text("abcdefgh.0123456789", min_size=1, max_size=6),
            min_size=1,
            max_size=12,
            unique=True,
        )
    )
    return {name: draw(layer_entries(name)) for name in names}


@st.composite
def worlds(draw: st.DrawFn) -> tuple[int, DistributedStrategy | float, int]:
    """``(world_size, grad_worker_fraction, expected grad workers per group)``."""
    world = draw(st.integers(1, 16))
    options: list[tuple[DistributedStrategy | float, int]] = [
        (DistributedStrategy.COMM_OPT, world),
        (DistributedStrategy.MEM_OPT, 1),
        (0.0, 1),  # 0 means 1/world_size
    ]
    if world == 1:
        options.append((DistributedStrategy.HYBRID_OPT, 1))
    elif world % 2 == 0:
        options.append((DistributedStrategy.HYBRID_OPT, world // 2))
    options += [(k / world, k) for k in range(1, world + 1) if world % k == 0]
    fraction, k = draw(st.sampled_from(options))
    return world, fraction, k


def sides(entry: LayerSpec | tuple[int, int]) -> tuple[int, int, int]:
    if isinstance(entry, LayerSpec):
        return entry.a_dim, entry.g_dim, entry.groups
    return entry[0], entry[1], 1


def build(layers: Mapping[str, LayerSpec | tuple[int, int]], world: int, **kw: object) -> Plan:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # MEM_OPT forcing colocate_factors
        return make_plan(layers, world, **kw)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- properties


@settings(max_examples=150, deadline=None)
@given(layers=layer_tables(), wf=worlds(), colocate=st.booleans())
def test_plan_invariants(
    layers: Layers, wf: tuple[int, DistributedStrategy | float, int], colocate: bool
) -> None:
    world, fraction, k = wf
    plan = build(layers, world, grad_worker_fraction=fraction, colocate_factors=colocate)
    ranks = set(range(world))
    expected_strategy = (
        DistributedStrategy.COMM_OPT
        if k == world
        else DistributedStrategy.MEM_OPT
        if k == 1
        else DistributedStrategy.HYBRID_OPT
    )
    assert plan.strategy is expected_strategy
    assert plan.world_size == world
    # MEM_OPT forces colocation, also when asked by name on one rank (a COMM_OPT plan there)
    mem_opt = DistributedStrategy.MEM_OPT in (expected_strategy, fraction)
    assert plan.colocate_factors == (colocate or mem_opt)

    # groups: worker groups and receiver groups both partition the ranks, and cross once
    assert all(len(g) == k for g in plan.worker_groups)
    assert all(len(g) == world // k for g in plan.receiver_groups)
    for partition in (plan.worker_groups, plan.receiver_groups):
        flat = [r for g in partition for r in g]
        assert sorted(flat) == sorted(ranks)
    for rg in plan.receiver_groups:
        for wg in plan.worker_groups:
            assert len(set(rg) & set(wg)) == 1
    for r in ranks:
        assert r in plan.worker_group_of(r) and r in plan.receiver_group_of(r)
    assert plan.broadcast_decompositions == (k > 1)
    assert plan.broadcast_gradients == (k < world)

    # every factor has exactly one owner, in range
    assert sorted(plan.layers) == sorted(layers)
    owned = [pair for r in sorted(ranks) for pair in plan.owned_by(r)]
    assert sorted(owned) == sorted((n, f) for n in layers for f in ("A", "G"))
    load = [0.0] * world
    for name, lp in plan.layers.items():
        a, g, groups = sides(layers[name])
        assert (lp.name, lp.a_size, lp.g_size, lp.groups) == (name, a, g, groups)
        assert (lp.a_cost, lp.g_cost) == (groups * float(a) ** 3, groups * float(g) ** 3)
        assert lp.a_owner in ranks and lp.g_owner in ranks
        assert (name, "A") in plan.owned_by(lp.a_owner)
        assert (name, "G") in plan.owned_by(lp.g_owner)
        if plan.colocate_factors:
            assert lp.a_owner == lp.g_owner
        # grad workers: the worker group that holds both owners
        group = plan.worker_group_of(lp.a_owner)
        assert lp.grad_workers == group
        assert lp.g_owner in group
        if plan.strategy is DistributedStrategy.MEM_OPT:
            assert lp.grad_workers == (lp.a_owner,)
        if plan.strategy is DistributedStrategy.COMM_OPT:
            assert lp.grad_workers == tuple(range(world))
        for r in ranks:
            src = plan.src_of(name, r)
            assert src in lp.grad_workers and src in plan.receiver_group_of(r)
            assert plan.is_grad_worker(name, r) == (r in lp.grad_workers)
            if r in lp.grad_workers:
                assert src == r
        load[lp.a_owner] += lp.a_cost
        load[lp.g_owner] += lp.g_cost

    # per-rank load is the sum of owned costs (integers below 2**53: exact)
    assert list(plan.load) == load

    # greedy (list scheduling) bound
    if plan.colocate_factors or plan.strategy is DistributedStrategy.COMM_OPT:
        if plan.colocate_factors:
            jobs = [lp.a_cost + lp.g_cost for lp in plan.layers.values()]
        else:
            jobs = [c for lp in plan.layers.values() for c in (lp.a_cost, lp.g_cost)]
        bound = sum(jobs) / world + max(jobs)
        assert max(plan.load) <= bound * (1 + 1e-12)


@settings(max_examples=60, deadline=None)
@given(
    layers=layer_tables(),
    wf=worlds(),
    colocate=st.booleans(),
    seed=st.integers(0, 2**16),
    method=st.sampled_from(["eigen", "inverse"]),
    cost=st.sampled_from(["compute", "memory"]),
)
def test_plan_is_independent_of_dict_order(
    layers: Layers,
    wf: tuple[int, DistributedStrategy | float, int],
    colocate: bool,
    seed: int,
    method: str,
    cost: str,
) -> None:
    world, fraction, _ = wf
    items = list(layers.items())
    random.Random(seed).shuffle(items)
    kw = dict(
        grad_worker_fraction=fraction,
        colocate_factors=colocate,
        compute_method=method,
        assignment_strategy=cost,
    )
    plan, shuffled = build(layers, world, **kw), build(dict(items), world, **kw)
    assert plan == shuffled
    assert str(plan) == str(shuffled)
    assert plan.fingerprint() == shuffled.fingerprint()
    assert list(plan.layers) == sorted(layers)  # rows in name order, whatever the input order

    text = str(plan)
    lines = text.splitlines()
    assert lines[-1].startswith("load per rank: ")
    assert all(f"{r}: " in lines[-1] for r in range(world))
    body = lines[3:-1]  # head, column names, rule, one row per layer, load
    assert len(body) == len(layers)
    for row, lp in zip(body, plan.layers.values()):
        cells = row.split()
        assert cells[0] == lp.name
        assert cells[-1] == ",".join(map(str, lp.grad_workers))
        assert cells[-3:-1] == [str(lp.a_owner), str(lp.g_owner)]


def test_fingerprint_changes_with_the_plan() -> None:
    layers = {"a": (30, 20), "b": (50, 40), "c": (10, 10)}
    plans = [
        make_plan(layers, 4),
        make_plan(layers, 4, grad_worker_fraction=0.5),
        make_plan(layers, 2),
        make_plan({**layers, "c": (11, 10)}, 4),
    ]
    assert len({p.fingerprint() for p in plans}) == len(plans)
    assert (
        make_plan(layers, 4).fingerprint()
        == make_plan(dict(reversed(layers.items())), 4).fingerprint()
    )


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize("fraction", [-0.1, 1.5, float("nan")])
def test_fraction_outside_unit_interval(fraction: float) -> None:
    with pytest.raises(ValueError, match=r"grad_worker_fraction must be in \[0, 1\]"):
        make_plan({"a": (2, 2)}, 4, grad_worker_fraction=fraction)


@pytest.mark.parametrize(
    ("world", "fraction", "workers"),
    [(6, 0.7, 4), (10, 0.3, 3), (8, 0.375, 3), (3, 0.5, 2)],
)
def test_fraction_giving_unequal_groups(world: int, fraction: float, workers: int) -> None:
    assert world % workers != 0 and round(world * fraction) == workers
    with pytest.raises(ValueError) as info:
        make_plan({"a": (2, 2)}, world, grad_worker_fraction=fraction)
    msg = str(info.value)
    assert f"grad_worker_fraction={fraction:g}" in msg
    assert f"world_size={world}" in msg
    assert f"groups of {workers} grad workers" in msg


def test_hybrid_on_an_odd_world_is_rejected() -> None:
    with pytest.raises(ValueError, match="world_size=5"):
        make_plan({"a": (2, 2)}, 5, grad_worker_fraction=DistributedStrategy.HYBRID_OPT)


@pytest.mark.parametrize("world", [0, -1, 2.0])
def test_bad_world_size(world: object) -> None:
    with pytest.raises(ValueError, match="world_size must be a positive int"):
        make_plan({"a": (2, 2)}, world)  # type: ignore[arg-type]


def test_resolve_grad_workers() -> None:
    assert resolve_grad_workers(DistributedStrategy.COMM_OPT, 8) == (
        1.0,
        8,
        DistributedStrategy.COMM_OPT,
    )
    assert resolve_grad_workers(DistributedStrategy.HYBRID_OPT, 8) == (
        0.5,
        4,
        DistributedStrategy.HYBRID_OPT,
    )
    assert resolve_grad_workers(0.25, 8) == (0.25, 2, DistributedStrategy.HYBRID_OPT)
    assert resolve_grad_workers(1.0, 1)[2] is DistributedStrategy.COMM_OPT
    assert resolve_grad_workers(DistributedStrategy.MEM_OPT, 1)[2] is DistributedStrategy.COMM_OPT


def test_mem_opt_without_colocation_warns_and_colocates() -> None:
    layers = {f"l{i}": (10 * i + 3, 50 - 4 * i) for i in range(6)}
    with pytest.warns(UserWarning, match="colocate_factors"):
        plan = make_plan(
            layers, 4, grad_worker_fraction=DistributedStrategy.MEM_OPT, colocate_factors=False
        )
    assert plan.colocate_factors
    assert plan.strategy is DistributedStrategy.MEM_OPT
    for lp in plan.layers.values():
        assert lp.a_owner == lp.g_owner
        assert lp.grad_workers == (lp.a_owner,)
    # the same as asking for colocation in the first place
    assert plan == make_plan(layers, 4, grad_worker_fraction=DistributedStrategy.MEM_OPT)


def test_no_warning_when_colocation_is_asked_for() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make_plan({"a": (3, 2)}, 4, grad_worker_fraction=DistributedStrategy.MEM_OPT)
        make_plan({"a": (3, 2)}, 4, colocate_factors=False)


def test_eigenvalue_outer_product_needs_colocation() -> None:
    with pytest.raises(ValueError, match="colocate_factors must be True"):
        make_plan(
            {"a": (3, 2)},
            4,
            compute_method="eigen",
            compute_eigenvalue_outer_product=True,
            colocate_factors=False,
        )
    # fine with colocation, or without the outer product, or with inverses
    make_plan({"a": (3, 2)}, 4, compute_eigenvalue_outer_product=True)
    make_plan({"a": (3, 2)}, 4, compute_eigenvalue_outer_product=False, colocate_factors=False)
    make_plan(
        {"a": (3, 2)},
        4,
        compute_method="inverse",
        compute_eigenvalue_outer_product=True,
        colocate_factors=False,
    )


def test_colocation_split_keeps_both_factors_in_one_worker_group() -> None:
    # one huge layer and one tiny one: without colocation the big layer's factors split
    layers = {"big": (100, 90), "small": (3, 2)}
    plan = make_plan(layers, 4, grad_worker_fraction=0.5, colocate_factors=False)
    big = plan.layers["big"]
    assert (big.a_owner, big.g_owner) == (0, 1)  # A to rank 0 (LPT), G to the rest of (0, 1)
    assert big.grad_workers == (0, 1)
    small = plan.layers["small"]
    assert (small.a_owner, small.g_owner) == (2, 3)
    assert small.grad_workers == (2, 3)


@pytest.mark.parametrize("bad", ["speed", "", "flops"])
def test_bad_assignment_strategy(bad: str) -> None:
    with pytest.raises(ValueError, match="assignment_strategy must be") as info:
        make_plan({"a": (3, 2)}, 2, assignment_strategy=bad)
    assert repr(bad) in str(info.value)


def test_cost_functions_change_the_assignment() -> None:
    # compute (n³): x=1024, y=z=432, w=250; memory (n²): x=128, y=z=72, w=50
    layers = {"x": (8, 8), "y": (6, 6), "z": (6, 6), "w": (5, 5)}

    def owners(plan: Plan) -> dict[str, int]:
        return {n: lp.a_owner for n, lp in plan.layers.items()}

    compute = make_plan(layers, 2, assignment_strategy="compute")
    assert compute == make_plan(layers, 2)  # the default
    assert compute == make_plan(
        layers, 2, assignment_strategy=kf.distributed.AssignmentStrategy.COMPUTE
    )
    # x -> 0 (1024); y -> 1 (432); z -> 1 (432 < 1024); w -> 1 (864 < 1024)
    assert owners(compute) == {"x": 0, "y": 1, "z": 1, "w": 1}
    assert compute.load == (2 * 512.0, 4 * 216.0 + 2 * 125.0)
    assert compute.layers["x"].a_cost == 512.0

    memory = make_plan(layers, 2, assignment_strategy="MEMORY")
    # x -> 0 (128); y -> 1 (72); z -> 1 (72 < 128); w -> 0 (128 < 144)
    assert owners(memory) == {"x": 0, "y": 1, "z": 1, "w": 0}
    assert memory.load == (128.0 + 50.0, 144.0)
    assert memory == make_plan(
        layers, 2, assignment_strategy=kf.distributed.AssignmentStrategy.MEMORY
    )

    # a callable: every factor costs the same, so layers go round-robin in name order
    flat = make_plan(layers, 2, assignment_strategy=lambda n: 1.0)
    assert owners(flat) == {"w": 0, "x": 1, "y": 0, "z": 1}
    assert flat.load == (4.0, 4.0)
    assert all(lp.a_cost == lp.g_cost == 1.0 for lp in flat.layers.values())

    # a callable that favours small factors reverses the order of placement
    inverse = make_plan(layers, 2, assignment_strategy=lambda n: 1.0 / n)
    assert inverse.layers["w"].a_cost == pytest.approx(0.2)
    assert owners(inverse)["w"] == 0


def test_grouped_layers_cost_per_block() -> None:
    spec = LayerSpec(
        "conv",
        "conv2d",
        "conv.weight",
        "conv.bias",
        in_dim=8,
        out_dim=12,
        groups=4,
        kernel_size=(3, 3),
        stride=(1, 1),
        dilation=(1, 1),
        padding=(0, 0, 0, 0),
    )
    plan = make_plan({"conv": spec, "fc": (19, 3)}, 2)
    lp = plan.layers["conv"]
    assert (lp.a_size, lp.g_size, lp.groups) == (19, 3, 4)
    assert lp.a_cost == 4 * 19.0**3 and lp.g_cost == 4 * 27.0
    assert "4x19" in str(plan) and "4x3" in str(plan)
    assert math.isclose(sum(plan.load), 5 * (19.0**3 + 27.0))


def test_plan_from_register_matches_tuples() -> None:
    from torch import nn

    model = nn.Sequential(nn.Conv2d(4, 6, 3, groups=2), nn.Flatten(), nn.Linear(6, 5))
    layers = kf.register(model)
    plan = make_plan(layers, 2)
    assert plan.layers["0"].groups == 2
    assert plan.layers["0"].a_size == 2 * 9 + 1
    assert plan.layers["2"].a_size == 7 and plan.layers["2"].g_size == 5
