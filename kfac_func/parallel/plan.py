"""Plans for model-parallel K-FAC: data × pipeline × tensor (model) parallel training.

Pure data, like :mod:`kfac_func.distributed.plan`: no process group is needed to build or print one.

Vocabulary. A rank has three coordinates: its pipeline *stage*, its position ``d`` in
the data-parallel group and its position ``m`` in the model-parallel group. The *stage
peers* are the ``data × model`` ranks of one stage; they hold the same layers (a
tensor-parallel layer as one shard per model-parallel rank). Each stage registers only
its own layers, so every stage builds its own plan from its own layers.

:func:`register_parallel` finds the layers: first the tensor-parallel linears, by class
(:mod:`kfac_func.parallel.splits`: Megatron-style ``ColumnParallelLinear``, weight split on
the output dimension, and ``RowParallelLinear``, split on the input dimension, by name so
that Megatron's, GPT-NeoX's and :mod:`kfac_func.parallel.layers`'s layers all qualify, and
the classes given in ``parallel_classes``), then ``nn.Linear``/``nn.Conv2d`` as
:func:`kfac_func.register` does (replicated over the model-parallel ranks). Every layer is
described by the :class:`~kfac_func.blocks.LayerSpec` of the *full* (unsharded) layer:
its factors have the full sizes.

:func:`make_parallel_plan` gives each layer one *owner* among the stage peers,
``(owner_data, owner_model)``, by the greedy balancing of :func:`kfac_func.distributed.make_plan`
(one rank per grad-worker group, KAISA's ``MEM_OPT``): the owner folds and decomposes the
layer's factors and preconditions its gradient. In every data-parallel replica ``d`` the
rank ``(d, owner_model)`` is the layer's *primary*: the model-parallel ranks send it their
shards of inputs and output-gradients, it builds the replica's full batch factors, and
the factors of the replicas are summed over the data-parallel group of ``owner_model``
to the owner. The preconditioned gradient goes the other way: the owner scatters it to
the model-parallel ranks of its replica, and each of them broadcasts its part over its
data-parallel group (:meth:`ParallelPlan.factor_group`, :meth:`ParallelPlan.grad_workers`,
:meth:`ParallelPlan.grad_source` and :meth:`ParallelPlan.grad_receivers` say who).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from kfac_func.blocks import LayerSpec, LayerTable, register
from kfac_func.blocks.mapped import KindMap, class_path
from kfac_func.distributed.plan import (
    AssignmentStrategy,
    CostFn,
    DistributedStrategy,
    LayerPlan,
    Plan,
    make_plan,
)
from kfac_func.parallel.splits import (
    COLUMN_PARALLEL_CLASSES,
    ROW_PARALLEL_CLASSES,
    ParallelClasses,
    Split,
    factor_parts,
    looks_parallel,
    parallel_spec,
    parse_parallel_classes,
    split_dim,
    split_of,
)

__all__ = [
    "COLUMN_PARALLEL_CLASSES",
    "ROW_PARALLEL_CLASSES",
    "ParallelLayerPlan",
    "ParallelPlan",
    "Split",
    "global_plan",
    "make_parallel_plan",
    "register_parallel",
]


def _under(name: str, prefixes: Iterable[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def register_parallel(
    model: nn.Module,
    model_parallel_size: int = 1,
    skip_layers: Iterable[str] | str | None = None,
    *,
    include_plain: bool = True,
    kinds: KindMap | None = None,
    parallel_classes: ParallelClasses | None = None,
) -> tuple[LayerTable, dict[str, Split | None]]:
    """The layers of ``model`` (one pipeline stage) that K-FAC preconditions.

    Tensor-parallel linears are recognised first, by class (see
    :mod:`kfac_func.parallel.splits`): ``ColumnParallelLinear`` / ``RowParallelLinear``
    and their subclasses, and the classes mapped by ``parallel_classes``. Each is
    described by the spec of the *full* layer (its shard's sizes times
    ``model_parallel_size`` on the split side), whatever else it is an instance of: a
    stand-in that subclasses ``nn.Linear`` is not a replicated linear. A module that looks
    tensor-parallel but cannot be placed raises a ValueError naming it. The other modules
    are registered as :func:`kfac_func.register` does (replicated over the
    model-parallel ranks).

    Returns ``(table, splits)``: ``table`` maps names to the specs of the full layers (in
    module order; unsupported modules are listed in ``table.skipped``), ``splits`` maps
    names to ``"column"``, ``"row"`` or None (replicated on every model-parallel rank).

    Args:
        model: the model, or this rank's pipeline stage of it.
        model_parallel_size: ranks each tensor-parallel layer is split over.
        skip_layers: regular expressions searched in module names and class names, as
            in :func:`kfac_func.register` (tensor-parallel layers included).
        include_plain: False keeps only the column- and row-parallel linears (the other
            layers are listed as skipped).
        kinds: ``{module class: kind}`` for single-device classes of the model's own
            (see :func:`kfac_func.register`).
        parallel_classes: ``{module class or class name: "column" | "row" | None}`` for
            tensor-parallel linears of other names (Transformer Engine's, a framework's
            own), or None to declare a look-alike class replicated.

    Example:
        >>> from torch import nn
        >>> from kfac_func.parallel.layers import ColumnParallelLinear
        >>> table, splits = register_parallel(nn.Sequential(ColumnParallelLinear(3, 4),
        ...                                                 nn.Linear(4, 2)))
        >>> [(n, s.in_dim, s.out_dim, splits[n]) for n, s in table.items()]
        [('0', 3, 4, 'column'), ('1', 4, 2, None)]
        >>> list(register_parallel(nn.Sequential(ColumnParallelLinear(3, 4), nn.Linear(4, 2)),
        ...                        include_plain=False)[0])
        ['0']

        A stand-in that subclasses ``nn.Linear`` is placed by its class: each of 2 ranks
        holds a ``4 x 3`` shard of a ``3 -> 8`` layer.

        >>> class ColumnParallelLinear(nn.Linear):
        ...     pass
        >>> table, splits = register_parallel(nn.Sequential(ColumnParallelLinear(3, 4)), 2)
        >>> table["0"].in_dim, table["0"].out_dim, splits["0"]
        (3, 8, 'column')
        >>> class TEColumnParallelLinear(nn.Linear):
        ...     pass
        >>> register_parallel(nn.Sequential(TEColumnParallelLinear(3, 4)), 2)
        ... # doctest: +ELLIPSIS +NORMALIZE_WHITESPACE
        Traceback (most recent call last):
        ...
        ValueError: layer '0' (...TEColumnParallelLinear) looks like a tensor-parallel linear
        (its class name 'TEColumnParallelLinear' ends in 'ParallelLinear') ...
    """
    if (
        isinstance(model_parallel_size, bool)
        or not isinstance(model_parallel_size, int)
        or model_parallel_size < 1
    ):
        raise ValueError(f"model_parallel_size must be a positive int, got {model_parallel_size!r}")
    classes = parse_parallel_classes(parallel_classes)
    base = register(model, skip_layers, kinds=kinds)
    skipped = dict(base.skipped)
    by_user = [n for n, why in base.skipped.items() if why.startswith("matched skip_layers")]
    # tensor-parallel linears first, by class, before any single-device kind is considered
    parallel: dict[str, Split] = {}
    for name, module in model.named_modules():
        if _under(name, by_user):
            continue
        split = split_of(module, classes)
        if split is not None:
            parallel[name] = split
            continue
        why = looks_parallel(module, classes)
        if why is not None:
            raise ValueError(
                f"layer {name!r} ({class_path(type(module))}) looks like a tensor-parallel "
                f"linear ({why}) but is not one that K-FAC can place: map its class with "
                f"parallel_classes={{{type(module).__name__}: 'column' | 'row'}} (or None if "
                "it is replicated on every model-parallel rank), or skip it with skip_layers"
            )
    owner_of = {
        id(model.get_parameter(p)): s.name
        for s in base.values()
        for p in s.param_names()
        if s.name not in parallel
    }
    specs: list[LayerSpec] = []
    splits: dict[str, Split | None] = {}
    for s in base.values():
        if not s.block.model_parallel and s.module not in parallel:
            skipped[s.module] = f"{s.kind}: not supported by the model-parallel preconditioner"
    for name, module in model.named_modules():
        if name in parallel:
            split = parallel[name]
            skipped.pop(name, None)
            weight = module._parameters.get("weight")
            if isinstance(weight, torch.Tensor) and not weight.requires_grad:
                skipped[name] = "weight does not require grad"
                continue
            spec = parallel_spec(name, module, split, model_parallel_size)
            taken = owner_of.get(id(model.get_parameter(spec.weight)))
            if taken is not None:
                raise ValueError(
                    f"layer {name!r} ({class_path(type(module))}) is a {split}-parallel "
                    f"linear, but its weight is also registered as part of layer {taken!r}"
                )
            specs.append(spec)
            splits[name] = split
            continue
        if name not in base or not base[name].block.model_parallel:
            continue
        if not include_plain:
            skipped[name] = "not a column- or row-parallel linear (include_plain=False)"
            continue
        specs.append(base[name])
        splits[name] = None
    return LayerTable(specs, skipped), splits


@dataclass(frozen=True)
class ParallelLayerPlan:
    """One layer's assignment within its stage.

    Attributes:
        name: layer name.
        split: ``"column"``, ``"row"`` or None (replicated over model-parallel ranks).
        a_size, g_size: sides of the full layer's factors.
        owner_data, owner_model: coordinates of the owner among the stage peers.
        split_dim: the dimension of the ``(out, in)`` weight split over the
            model-parallel ranks: 0 (column), 1 (row) or None.
        a_part, g_part: the sides of the A and G factors that one model-parallel rank's
            shard covers (see :func:`~kfac_func.parallel.splits.factor_parts`): the
            input features of a row-parallel shard, the outputs of a column-parallel
            shard, the whole side where it is not split.
    """

    name: str
    split: Split | None
    a_size: int
    g_size: int
    owner_data: int
    owner_model: int
    split_dim: int | None
    a_part: int
    g_part: int


@dataclass(frozen=True)
class ParallelPlan:
    """Owners of the layers of one pipeline stage; see the module docstring.

    Example:
        >>> from kfac_func.blocks import LayerSpec
        >>> specs = {n: LayerSpec(n, "linear", f"{n}.weight", None, 8, 8) for n in "abc"}
        >>> plan = make_parallel_plan(specs, {"a": "column", "b": "row", "c": None},
        ...                           data_parallel_size=2, model_parallel_size=2)
        >>> [(lp.name, lp.owner_data, lp.owner_model) for lp in plan.layers.values()]
        [('a', 0, 0), ('b', 0, 1), ('c', 1, 0)]
        >>> [(lp.split_dim, lp.a_part, lp.g_part) for lp in plan.layers.values()]
        [(0, 8, 4), (1, 4, 8), (None, 8, 8)]

        Layer ``b`` is owned by peer ``(0, 1)``: its factors are summed over the
        data-parallel group of model position 1, the owner's model-parallel group
        preconditions its gradient, and peer ``(1, 0)`` receives its part from ``(0, 0)``:

        >>> plan.factor_group("b"), plan.grad_workers("b")
        (((0, 1), (1, 1)), ((0, 0), (0, 1)))
        >>> plan.grad_source("b", data=1, model=0), plan.grad_receivers("b", model=0)
        ((0, 0), ((0, 0), (1, 0)))
    """

    data_parallel_size: int
    model_parallel_size: int
    stage: int
    layers: dict[str, ParallelLayerPlan]
    load: tuple[float, ...]

    def owner_index(self, name: str) -> int:
        """The owner's index among the stage peers, ``owner_data · model + owner_model``."""
        lp = self.layers[name]
        return lp.owner_data * self.model_parallel_size + lp.owner_model

    def owned_by(self, data: int, model: int) -> list[str]:
        """Layers owned by the stage peer ``(data, model)``, in layer order."""
        return [
            n for n, lp in self.layers.items() if (lp.owner_data, lp.owner_model) == (data, model)
        ]

    def factor_group(self, name: str) -> tuple[tuple[int, int], ...]:
        """The peers ``(data, model)`` whose batch factors of layer ``name`` are summed on
        its owner: the layer's primary in every data-parallel replica (the data-parallel
        group of the owner's model position), each having gathered its replica's shards.

        Example:
            >>> from kfac_func.blocks import LayerSpec
            >>> plan = make_parallel_plan({"fc": LayerSpec("fc", "linear", "fc.weight", None,
            ...                                            4, 4)}, {"fc": "row"},
            ...                           data_parallel_size=2, model_parallel_size=2)
            >>> plan.factor_group("fc")
            ((0, 0), (1, 0))
        """
        lp = self.layers[name]
        return tuple((d, lp.owner_model) for d in range(self.data_parallel_size))

    def grad_workers(self, name: str) -> tuple[tuple[int, int], ...]:
        """The peers that take part in preconditioning layer ``name``'s gradient: the
        model-parallel group of the owner's replica (each sends the owner its gradient
        shard and receives its part of the result), KAISA's ``MEM_OPT`` with one owner.

        Example:
            >>> from kfac_func.blocks import LayerSpec
            >>> spec = LayerSpec("fc", "linear", "fc.weight", None, 4, 4)
            >>> plan = make_parallel_plan({"fc": spec}, {"fc": "column"}, data_parallel_size=2,
            ...                           model_parallel_size=2)
            >>> plan.grad_workers("fc")
            ((0, 0), (0, 1))
        """
        lp = self.layers[name]
        return tuple((lp.owner_data, m) for m in range(self.model_parallel_size))

    def grad_source(self, name: str, data: int, model: int) -> tuple[int, int]:
        """The peer that sends peer ``(data, model)`` its part of layer ``name``'s
        preconditioned gradient: the rank at the same model position in the owner's
        replica (a peer of that replica receives it from the owner's scatter, and is its
        own source for the data-parallel broadcast).

        Example:
            >>> from kfac_func.blocks import LayerSpec
            >>> specs = {"fc": LayerSpec("fc", "linear", "fc.weight", None, 4, 4)}
            >>> plan = make_parallel_plan(specs, {"fc": None}, data_parallel_size=3,
            ...                           model_parallel_size=1)
            >>> [plan.grad_source("fc", d, 0) for d in range(3)]
            [(0, 0), (0, 0), (0, 0)]
        """
        self._check_peer(data, model)
        return self.layers[name].owner_data, model

    def grad_receivers(self, name: str, model: int) -> tuple[tuple[int, int], ...]:
        """The peers of the data-parallel group at model position ``model`` that receive
        layer ``name``'s preconditioned gradient part by one broadcast from
        :meth:`grad_source` (its first entry is the source)."""
        self._check_peer(0, model)
        src = self.layers[name].owner_data
        others = [d for d in range(self.data_parallel_size) if d != src]
        return tuple((d, model) for d in [src, *others])

    def _check_peer(self, data: int, model: int) -> None:
        if not (0 <= data < self.data_parallel_size and 0 <= model < self.model_parallel_size):
            raise ValueError(
                f"peer (data={data}, model={model}) is outside stage {self.stage}'s "
                f"data {self.data_parallel_size} x model {self.model_parallel_size} peers"
            )

    def fingerprint(self) -> str:
        """Short hash of the plan; equal on the stage peers that built the same plan."""
        return hashlib.sha256(str(self).encode()).hexdigest()[:16]

    def __str__(self) -> str:
        head = (
            f"model-parallel K-FAC plan: stage {self.stage}, data {self.data_parallel_size} x "
            f"model {self.model_parallel_size}"
        )
        rows = [("layer", "split", "A", "G", "A per rank", "G per rank", "owner (data, model)")]
        for lp in self.layers.values():
            rows.append(
                (
                    lp.name,
                    "-" if lp.split is None else f"{lp.split} (dim {lp.split_dim})",
                    str(lp.a_size),
                    str(lp.g_size),
                    str(lp.a_part),
                    str(lp.g_part),
                    f"({lp.owner_data}, {lp.owner_model})",
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = [head]
        lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        lines.insert(2, "  ".join("-" * w for w in widths))
        total = sum(self.load) or 1.0
        m = self.model_parallel_size
        lines.append(
            "load per peer: "
            + ", ".join(f"({i // m}, {i % m}): {v / total:.1%}" for i, v in enumerate(self.load))
        )
        return "\n".join(lines)


def make_parallel_plan(
    layers: Mapping[str, LayerSpec],
    splits: Mapping[str, Split | None],
    *,
    data_parallel_size: int,
    model_parallel_size: int,
    stage: int = 0,
    assignment_strategy: AssignmentStrategy | str | CostFn = AssignmentStrategy.COMPUTE,
) -> ParallelPlan:
    """Assign every layer of one stage to an owner among its ``data × model`` peers.

    Owners are balanced by the decomposition cost of both factors (``"compute"``: n³,
    ``"memory"``: n², or a callable), largest layer first, ties by name, each to the
    least-loaded peer (ties to the lowest index ``data · model_parallel_size + model``,
    which is the order of the stage's global ranks in DeepSpeed's pipe × data × model
    topology).

    This is kfac-pytorch's GPT-NeoX assignment (one owner per layer, greedy by cost)
    with one difference: layers of equal cost are taken in ascending name order here, in
    descending order there, so two equal layers ``l1``, ``l2`` on two peers are owned
    ``l1: 0, l2: 1`` here and ``l1: 1, l2: 0`` there (the order
    :func:`kfac_func.distributed.make_plan` uses for every strategy; any fixed order balances
    the same load).

    Example:
        >>> from kfac_func.blocks import LayerSpec
        >>> specs = {n: LayerSpec(n, "linear", f"{n}.weight", None, 4, 4) for n in ("l1", "l2")}
        >>> plan = make_parallel_plan(specs, {"l1": None, "l2": None},
        ...                           data_parallel_size=2, model_parallel_size=1)
        >>> [plan.owner_index(n) for n in ("l1", "l2")]
        [0, 1]
    """
    for what, n in (
        ("data_parallel_size", data_parallel_size),
        ("model_parallel_size", model_parallel_size),
    ):
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"{what} must be a positive int, got {n!r}")
    missing = sorted(set(layers) - set(splits))
    if missing:
        raise ValueError(f"no split given for layers {missing}")
    peers = data_parallel_size * model_parallel_size
    base = make_plan(
        layers,
        peers,
        grad_worker_fraction=1.0 / peers,
        assignment_strategy=assignment_strategy,
        colocate_factors=True,
    )
    out = {}
    for name, spec in layers.items():
        owner = base.layers[name].a_owner
        split = splits[name]
        if split is not None and (spec.in_dim if split == "row" else spec.out_dim) % (
            model_parallel_size
        ):
            side = "input" if split == "row" else "output"
            raise ValueError(
                f"layer {name!r} ({split}-parallel): its {side} size "
                f"{spec.in_dim if split == 'row' else spec.out_dim} does not split over "
                f"{model_parallel_size} model-parallel ranks"
            )
        a_part, g_part = factor_parts(spec, split, model_parallel_size)
        out[name] = ParallelLayerPlan(
            name,
            split,
            spec.a_dim,
            spec.g_dim,
            owner // model_parallel_size,
            owner % model_parallel_size,
            split_dim(split),
            a_part,
            g_part,
        )
    return ParallelPlan(data_parallel_size, model_parallel_size, stage, out, base.load)


def global_plan(
    layers: Mapping[str, LayerSpec], owner_rank: Mapping[str, int], world_size: int
) -> Plan:
    """The layers of every stage as one KAISA ``MEM_OPT`` :class:`~kfac_func.distributed.Plan`
    over the whole world, each layer owned by its owner's global rank: the plan under which
    :func:`kfac_func.checkpoint.save_factor_dir` writes each layer's file from its owner and
    :func:`kfac_func.checkpoint.load_factor_dir` (``only_owned=True``) reads it back.

    Example:
        >>> from kfac_func.blocks import LayerSpec
        >>> spec = LayerSpec("fc", "linear", "fc.weight", None, 3, 2)
        >>> global_plan({"fc": spec}, {"fc": 1}, 2).layers["fc"].grad_workers
        (1,)
    """
    missing = sorted(set(layers) - set(owner_rank))
    if missing:
        raise ValueError(f"no owner for layers {missing}")
    load = [0.0] * world_size
    plans = {}
    for name, spec in layers.items():
        r = owner_rank[name]
        a_cost, g_cost = float(spec.a_dim) ** 3, float(spec.g_dim) ** 3
        load[r] += spec.groups * (a_cost + g_cost)
        plans[name] = LayerPlan(
            name, spec.a_dim, spec.g_dim, spec.groups, a_cost, g_cost, r, r, (r,)
        )
    return Plan(
        world_size,
        1.0 / world_size,
        DistributedStrategy.MEM_OPT,
        True,
        tuple((r,) for r in range(world_size)),
        (tuple(range(world_size)),),
        plans,
        tuple(load),
    )
