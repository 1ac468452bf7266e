"""Plans for model-parallel K-FAC: data × pipeline × tensor (model) parallel training.

Pure data, like :mod:`kfac_func.distributed.plan`: no process group is needed to build or print one.

Vocabulary. A rank has three coordinates: its pipeline *stage*, its position ``d`` in
the data-parallel group and its position ``m`` in the model-parallel group. The *stage
peers* are the ``data × model`` ranks of one stage; they hold the same layers (a
tensor-parallel layer as one shard per model-parallel rank). Each stage registers only
its own layers, so every stage builds its own plan from its own layers.

:func:`register_parallel` finds the layers: ``nn.Linear``/``nn.Conv2d`` as
:func:`kfac_func.register` does (replicated over the model-parallel ranks), and the
Megatron-style ``ColumnParallelLinear`` (weight split on the output dimension) and
``RowParallelLinear`` (split on the input dimension), recognised by class name so that
Megatron's, GPT-NeoX's and :mod:`kfac_func.parallel.layers`'s layers all qualify. Every
layer is described by the :class:`~kfac_func.blocks.LayerSpec` of the *full* (unsharded)
layer: its factors have the full sizes.

:func:`make_parallel_plan` gives each layer one *owner* among the stage peers,
``(owner_data, owner_model)``, by the greedy balancing of :func:`kfac_func.make_plan`
(one rank per grad-worker group, KAISA's ``MEM_OPT``): the owner folds and decomposes the
layer's factors and preconditions its gradient. In every data-parallel replica ``d`` the
rank ``(d, owner_model)`` is the layer's *primary*: the model-parallel ranks send it their
shards of inputs and output-gradients, it builds the replica's full batch factors, and
the factors of the replicas are summed over the data-parallel group of ``owner_model``
to the owner.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

from torch import nn

from kfac_func.blocks import LayerSpec, LayerTable, register
from kfac_func.blocks.linear import LinearBlock
from kfac_func.blocks.mapped import KindMap
from kfac_func.distributed.plan import (
    AssignmentStrategy,
    CostFn,
    DistributedStrategy,
    LayerPlan,
    Plan,
    make_plan,
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

Split = Literal["column", "row"]

COLUMN_PARALLEL_CLASSES = ("ColumnParallelLinear",)
"""Class names of linears whose weight is split on the output dimension."""

ROW_PARALLEL_CLASSES = ("RowParallelLinear",)
"""Class names of linears whose weight is split on the input dimension."""


def split_of(module: nn.Module) -> Split | None:
    """``"column"``, ``"row"`` or None (not a tensor-parallel linear), by class name."""
    names = {c.__name__ for c in type(module).__mro__}
    if names & set(COLUMN_PARALLEL_CLASSES):
        return "column"
    if names & set(ROW_PARALLEL_CLASSES):
        return "row"
    return None


def _tp_spec(name: str, module: nn.Module, split: Split, parts: int) -> LayerSpec:
    prefix = f"{name}." if name else ""
    weight = module.get_parameter("weight")
    if weight.dim() != 2:
        raise ValueError(f"layer {name!r}: expected a 2-d weight, got shape {tuple(weight.shape)}")
    rows, cols = weight.shape
    out_dim, in_dim = (rows * parts, cols) if split == "column" else (rows, cols * parts)
    for attr, full in (("input_size", in_dim), ("output_size", out_dim)):
        given = getattr(module, attr, None)
        if isinstance(given, int) and given != full:
            raise ValueError(
                f"layer {name!r} ({type(module).__name__}): {attr}={given}, but a weight "
                f"shard of shape {tuple(weight.shape)} over {parts} model-parallel ranks "
                f"makes {full} (is model_parallel_size right?)"
            )
    bias = getattr(module, "bias", None)
    bias_name = f"{prefix}bias" if isinstance(bias, nn.Parameter) else None
    return LayerSpec(name, LinearBlock.kind, f"{prefix}weight", bias_name, in_dim, out_dim)


def register_parallel(
    model: nn.Module,
    model_parallel_size: int = 1,
    skip_layers: Iterable[str] | str | None = None,
    *,
    include_plain: bool = True,
    kinds: KindMap | None = None,
) -> tuple[LayerTable, dict[str, Split | None]]:
    """The layers of ``model`` (one pipeline stage) that K-FAC preconditions.

    Returns ``(table, splits)``: ``table`` maps names to the specs of the full layers (in
    module order; unsupported modules are listed in ``table.skipped``), ``splits`` maps
    names to ``"column"``, ``"row"`` or None (replicated on every model-parallel rank).
    ``include_plain=False`` keeps only the column- and row-parallel linears (the other
    layers are listed as skipped). ``kinds`` maps module classes of the model's own to
    registered kinds (see :func:`kfac_func.register`).

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
    """
    if not isinstance(model_parallel_size, int) or model_parallel_size < 1:
        raise ValueError(f"model_parallel_size must be a positive int, got {model_parallel_size!r}")
    base = register(model, skip_layers, kinds=kinds)
    specs: list[LayerSpec] = []
    splits: dict[str, Split | None] = {}
    skipped = dict(base.skipped)
    unsupported = {s.module: s.kind for s in base.values() if not s.block.model_parallel}
    for module_name, kind in unsupported.items():
        skipped[module_name] = f"{kind}: not supported by the model-parallel preconditioner"
    for name, module in model.named_modules():
        if name in base:
            if not base[name].block.model_parallel:
                continue
            if not include_plain:
                skipped[name] = "not a column- or row-parallel linear (include_plain=False)"
                continue
            specs.append(base[name])
            splits[name] = None
            continue
        split = split_of(module)
        reason = skipped.get(name, "")
        if split is None or not reason.startswith("unsupported kind"):
            continue  # not a tensor-parallel linear, or skipped by skip_layers
        if not module.get_parameter("weight").requires_grad:
            skipped[name] = "weight does not require grad"
            continue
        del skipped[name]
        specs.append(_tp_spec(name, module, split, model_parallel_size))
        splits[name] = split
    return LayerTable(specs, skipped), splits


@dataclass(frozen=True)
class ParallelLayerPlan:
    """One layer's assignment within its stage.

    Attributes:
        name: layer name.
        split: ``"column"``, ``"row"`` or None (replicated over model-parallel ranks).
        a_size, g_size: sides of the full layer's factors.
        owner_data, owner_model: coordinates of the owner among the stage peers.
    """

    name: str
    split: Split | None
    a_size: int
    g_size: int
    owner_data: int
    owner_model: int


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

    def fingerprint(self) -> str:
        """Short hash of the plan; equal on the stage peers that built the same plan."""
        return hashlib.sha256(str(self).encode()).hexdigest()[:16]

    def __str__(self) -> str:
        head = (
            f"model-parallel K-FAC plan: stage {self.stage}, data {self.data_parallel_size} x "
            f"model {self.model_parallel_size}"
        )
        rows = [("layer", "split", "A", "G", "owner (data, model)")]
        for lp in self.layers.values():
            rows.append(
                (
                    lp.name,
                    lp.split or "-",
                    str(lp.a_size),
                    str(lp.g_size),
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
    least-loaded peer (ties to the lowest index ``data · model_parallel_size + model``).
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
        out[name] = ParallelLayerPlan(
            name,
            splits[name],
            spec.a_dim,
            spec.g_dim,
            owner // model_parallel_size,
            owner % model_parallel_size,
        )
    return ParallelPlan(data_parallel_size, model_parallel_size, stage, out, base.load)


def global_plan(
    layers: Mapping[str, LayerSpec], owner_rank: Mapping[str, int], world_size: int
) -> Plan:
    """The layers of every stage as one KAISA ``MEM_OPT`` :class:`~kfac_func.Plan` over the
    whole world, each layer owned by its owner's global rank: the plan under which
    :func:`kfac_func.save_factor_dir` writes each layer's file from its owner and
    :func:`kfac_func.load_factor_dir` (``only_owned=True``) reads it back.

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
