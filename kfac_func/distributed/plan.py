"""The sharding plan (KAISA): who decomposes which factor, who preconditions which layer.

A :class:`Plan` is pure data built from layer sizes and a world size; building or
printing it needs no process group, and it is identical on every rank (no randomness,
ties broken by layer name, not by dict order).

Vocabulary (KAISA): the ranks split into ``world / k`` *grad-worker groups* of ``k``
contiguous ranks (``k = round(world · grad_worker_fraction)``) and into ``k`` strided
*receiver groups* (ranks with the same position in their worker group). Each layer is
owned by one worker group: the *owners* of its A and G factors (ranks of that group)
decompose them, the group's ranks (*grad workers*) receive the decompositions and
precondition the layer's gradient, and every other rank receives the preconditioned
gradient from the grad worker of its receiver group.

- ``COMM_OPT`` (fraction 1): one group of all ranks; decompositions are broadcast to
  everyone, no gradient is broadcast.
- ``MEM_OPT`` (fraction 1/world): groups of one rank; the owner preconditions and
  broadcasts the gradient to all ranks; no decomposition is sent.
- ``HYBRID_OPT`` (in between): both, within groups.
"""

from __future__ import annotations

import enum
import hashlib
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from kfac_func.blocks import LayerSpec

__all__ = [
    "AssignmentStrategy",
    "DistributedStrategy",
    "LayerPlan",
    "Plan",
    "make_plan",
    "resolve_grad_workers",
]


class DistributedStrategy(enum.Enum):
    """KAISA presets for ``grad_worker_fraction``."""

    COMM_OPT = 1
    MEM_OPT = 2
    HYBRID_OPT = 3


class AssignmentStrategy(enum.Enum):
    """Cost of decomposing an ``n x n`` factor: ``COMPUTE`` n³, ``MEMORY`` n²."""

    COMPUTE = 1
    MEMORY = 2


CostFn = Callable[[int], float]


@dataclass(frozen=True)
class LayerPlan:
    """One layer's assignment.

    Attributes:
        name: layer name.
        a_size, g_size: factor sides; ``groups`` blocks of each (grouped convolutions).
        a_cost, g_cost: decomposition costs used for balancing.
        a_owner, g_owner: ranks that decompose A and G.
        grad_workers: ranks that precondition this layer (the owners' worker group).
    """

    name: str
    a_size: int
    g_size: int
    groups: int
    a_cost: float
    g_cost: float
    a_owner: int
    g_owner: int
    grad_workers: tuple[int, ...]


@dataclass(frozen=True)
class Plan:
    """Assignment of every layer's work to ranks; see the module docstring.

    Example:
        >>> plan = make_plan({"fc1": (785, 256), "fc2": (257, 10)}, world_size=4,
        ...                  grad_worker_fraction=0.5)
        >>> plan.strategy, plan.worker_groups, plan.receiver_groups
        (<DistributedStrategy.HYBRID_OPT: 3>, ((0, 1), (2, 3)), ((0, 2), (1, 3)))
        >>> plan.layers["fc1"].grad_workers, plan.src_of("fc1", 3)
        ((0, 1), 1)
    """

    world_size: int
    grad_worker_fraction: float
    strategy: DistributedStrategy
    colocate_factors: bool
    worker_groups: tuple[tuple[int, ...], ...]
    receiver_groups: tuple[tuple[int, ...], ...]
    layers: dict[str, LayerPlan]
    load: tuple[float, ...]

    @property
    def broadcast_decompositions(self) -> bool:
        """Whether decompositions travel (some worker group has more than one rank)."""
        return len(self.worker_groups[0]) > 1

    @property
    def broadcast_gradients(self) -> bool:
        """Whether preconditioned gradients travel (more than one worker group)."""
        return len(self.worker_groups) > 1

    def worker_group_of(self, rank: int) -> tuple[int, ...]:
        """The grad-worker group that ``rank`` belongs to."""
        return self.worker_groups[rank // len(self.worker_groups[0])]

    def receiver_group_of(self, rank: int) -> tuple[int, ...]:
        """The receiver group that ``rank`` belongs to."""
        return self.receiver_groups[rank % len(self.worker_groups[0])]

    def is_grad_worker(self, name: str, rank: int) -> bool:
        return rank in self.layers[name].grad_workers

    def src_of(self, name: str, rank: int) -> int:
        """The grad worker of ``name`` whose preconditioned gradient ``rank`` uses."""
        workers = self.layers[name].grad_workers
        return workers[rank % len(workers)]

    def owned_by(self, rank: int) -> list[tuple[str, str]]:
        """``(layer, "A"|"G")`` pairs that ``rank`` decomposes, in layer-name order."""
        out = []
        for name, lp in self.layers.items():
            if lp.a_owner == rank:
                out.append((name, "A"))
            if lp.g_owner == rank:
                out.append((name, "G"))
        return out

    def fingerprint(self) -> str:
        """Short hash of the whole plan; equal on ranks that built the same plan."""
        return hashlib.sha256(str(self).encode()).hexdigest()[:16]

    def __str__(self) -> str:
        head = (
            f"KAISA plan: world {self.world_size}, {self.strategy.name} "
            f"(grad_worker_fraction {self.grad_worker_fraction:g}), "
            f"colocate_factors={self.colocate_factors}"
        )
        rows = [("layer", "A", "G", "A owner", "G owner", "grad workers")]
        for lp in self.layers.values():
            blocks = f"{lp.groups}x" if lp.groups > 1 else ""
            rows.append(
                (
                    lp.name,
                    f"{blocks}{lp.a_size}",
                    f"{blocks}{lp.g_size}",
                    str(lp.a_owner),
                    str(lp.g_owner),
                    ",".join(map(str, lp.grad_workers)),
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = [head]
        lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        lines.insert(2, "  ".join("-" * w for w in widths))
        total = sum(self.load) or 1.0
        lines.append(
            "load per rank: " + ", ".join(f"{r}: {v / total:.1%}" for r, v in enumerate(self.load))
        )
        return "\n".join(lines)


def resolve_grad_workers(
    grad_worker_fraction: DistributedStrategy | float, world_size: int
) -> tuple[float, int, DistributedStrategy]:
    """``(fraction, workers per group, strategy)``, validated as kfac-pytorch does.

    Example:
        >>> resolve_grad_workers(DistributedStrategy.MEM_OPT, 8)
        (0.125, 1, <DistributedStrategy.MEM_OPT: 2>)
        >>> resolve_grad_workers(0.0, 4)
        (0.25, 1, <DistributedStrategy.MEM_OPT: 2>)
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if isinstance(grad_worker_fraction, DistributedStrategy):
        fraction = {
            DistributedStrategy.COMM_OPT: 1.0,
            DistributedStrategy.HYBRID_OPT: 0.5,
            DistributedStrategy.MEM_OPT: 1.0 / world_size,
        }[grad_worker_fraction]
    else:
        fraction = float(grad_worker_fraction)
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"grad_worker_fraction must be in [0, 1], got {grad_worker_fraction}")
        if fraction == 0.0:
            fraction = 1.0 / world_size
    workers = max(1, round(world_size * fraction))
    if world_size % workers != 0:
        raise ValueError(
            f"grad_worker_fraction={fraction:g} with world_size={world_size} gives groups of "
            f"{workers} grad workers, which do not divide {world_size} ranks into equal groups"
        )
    # all ranks grad workers: COMM_OPT (on one rank too: the later key wins); one: MEM_OPT
    named = {1: DistributedStrategy.MEM_OPT, world_size: DistributedStrategy.COMM_OPT}
    return fraction, workers, named.get(workers, DistributedStrategy.HYBRID_OPT)


def _cost_fn(assignment_strategy: AssignmentStrategy | str | CostFn) -> CostFn:
    if callable(assignment_strategy) and not isinstance(assignment_strategy, AssignmentStrategy):
        return assignment_strategy
    if isinstance(assignment_strategy, str):
        try:
            assignment_strategy = AssignmentStrategy[assignment_strategy.upper()]
        except KeyError:
            raise ValueError(
                f"assignment_strategy must be 'compute', 'memory' or a callable, "
                f"got {assignment_strategy!r}"
            ) from None
    if assignment_strategy is AssignmentStrategy.COMPUTE:
        return lambda n: float(n) ** 3
    return lambda n: float(n) ** 2


def _sizes(layer: LayerSpec | tuple[int, int]) -> tuple[int, int, int, tuple[bool, bool], int]:
    """``(A side, G side, groups, diagonal, A blocks)`` of a layer."""
    if isinstance(layer, LayerSpec):
        return layer.a_dim, layer.g_dim, layer.groups, layer.diagonal, layer.a_blocks
    a, g = layer
    return int(a), int(g), 1, (False, False), 1


def make_plan(
    layers: Mapping[str, LayerSpec | tuple[int, int]],
    world_size: int,
    *,
    grad_worker_fraction: DistributedStrategy | float = DistributedStrategy.COMM_OPT,
    assignment_strategy: AssignmentStrategy | str | CostFn = AssignmentStrategy.COMPUTE,
    colocate_factors: bool = True,
    compute_method: str = "eigen",
    compute_eigenvalue_outer_product: bool = False,
) -> Plan:
    """Assign factor decompositions and preconditioning to ranks.

    Factors are placed by greedy longest-processing-time balancing: layers (or, without
    ``colocate_factors``, single factors) in decreasing cost, ties by name, each to the
    least-loaded rank (ties to the lowest rank). Without ``colocate_factors`` the G
    factor goes to the least-loaded rank of the A owner's worker group, so that one group
    holds both decompositions.

    Args:
        layers: ``{name: LayerSpec}`` (from :func:`kfac_func.register`) or
            ``{name: (a_size, g_size)}``.
        world_size: number of ranks.
        grad_worker_fraction: a :class:`DistributedStrategy` or a float in [0, 1]
            (0 means ``1/world_size``).
        assignment_strategy: ``"compute"`` (n³), ``"memory"`` (n²) or ``size -> cost``.
        colocate_factors: decompose A and G of a layer on the same rank. Forced on
            (with a warning) for ``MEM_OPT``, whether it is asked by name (also on one
            rank) or results from the fraction.
        compute_method, compute_eigenvalue_outer_product: the eigenvalue outer product
            is computed where both factors are, so it needs ``colocate_factors``
            (ValueError when ``colocate_factors=False``, before ``MEM_OPT`` forces it).

    Example:
        >>> print(make_plan({"a": (3, 2), "b": (5, 4)}, world_size=2))
        KAISA plan: world 2, COMM_OPT (grad_worker_fraction 1), colocate_factors=True
        layer  A  G  A owner  G owner  grad workers
        -----  -  -  -------  -------  ------------
        a      3  2  1        1        0,1
        b      5  4  0        0        0,1
        load per rank: 0: 84.4%, 1: 15.6%
    """
    fraction, k, strategy = resolve_grad_workers(grad_worker_fraction, world_size)
    # checked as asked, before MEM_OPT turns colocation on
    if compute_method == "eigen" and compute_eigenvalue_outer_product and not colocate_factors:
        raise ValueError("colocate_factors must be True to use compute_eigenvalue_outer_product")
    # MEM_OPT asked by name counts on one rank too, where the groups are also COMM_OPT's
    mem_opt = strategy is DistributedStrategy.MEM_OPT or (
        grad_worker_fraction is DistributedStrategy.MEM_OPT
    )
    if mem_opt and not colocate_factors:
        warnings.warn(
            "grad_worker_fraction=1/world_size (MEM_OPT) requires colocate_factors=True; "
            "enabling colocate_factors",
            UserWarning,
            stacklevel=2,
        )
        colocate_factors = True
    cost = _cost_fn(assignment_strategy)

    worker_groups = tuple(tuple(range(i, i + k)) for i in range(0, world_size, k))
    receiver_groups = tuple(tuple(range(i, world_size, k)) for i in range(k))
    load = [0.0] * world_size

    def least_loaded(ranks: tuple[int, ...]) -> int:
        return min(ranks, key=lambda r: (load[r], r))

    sizes = {name: _sizes(layer) for name, layer in sorted(layers.items())}

    def side_cost(n: int, diagonal: bool) -> float:
        return float(n) if diagonal else cost(n)  # a diagonal factor costs O(n)

    costs = {  # a blocked A: its blocks' decompositions
        n: (g * k * side_cost(-(-a // k), da), g * side_cost(gs, dg))
        for n, (a, gs, g, (da, dg), k) in sizes.items()
    }
    owners: dict[str, tuple[int, int]] = {}
    everyone = tuple(range(world_size))
    for name in sorted(costs, key=lambda n: (-(costs[n][0] + costs[n][1]), n)):
        a_cost, g_cost = costs[name]
        if colocate_factors:
            r = least_loaded(everyone)
            load[r] += a_cost + g_cost
            owners[name] = (r, r)
            continue
        # the larger factor by global LPT, the smaller within the same worker group
        r1 = least_loaded(everyone)
        load[r1] += max(a_cost, g_cost)
        r2 = least_loaded(worker_groups[r1 // k])
        load[r2] += min(a_cost, g_cost)
        owners[name] = (r1, r2) if a_cost >= g_cost else (r2, r1)

    plans = {}
    for name, (a, g, groups, _, _) in sizes.items():
        a_owner, g_owner = owners[name]
        plans[name] = LayerPlan(
            name,
            a,
            g,
            groups,
            costs[name][0],
            costs[name][1],
            a_owner,
            g_owner,
            worker_groups[a_owner // k],
        )
    return Plan(
        world_size,
        fraction,
        strategy,
        colocate_factors,
        worker_groups,
        receiver_groups,
        plans,
        tuple(load),
    )
