"""`ParallelKFACPreconditioner`: K-FAC for data × pipeline × tensor-parallel models.

The stateful preconditioner of one pipeline stage (or of a whole model without
pipelining), with kfac-pytorch's arguments plus the three process groups. Forward hooks
and gradient hooks collect each registered layer's inputs and output-gradients;
``step()`` (after the gradients were averaged over the data-parallel ranks, before
``optimizer.step()``) runs, under a :class:`~kfac_func.parallel.plan.ParallelPlan`:

1. in each data-parallel replica, the model-parallel ranks send the *primary* of each
   tensor-parallel layer their shards of its inputs (row-parallel) or output-gradients
   (column-parallel); tensors that every model-parallel rank holds whole travel nowhere;
   the primary builds the replica's batch factors of the full layer;
2. the batch factors of the replicas are summed over the data-parallel group of the
   primaries to the layer's owner, which folds them into its running averages and
   decomposes them (the owner alone holds a layer's current factors, as under KAISA's
   ``MEM_OPT``);
3. the owner gathers the gradient shards of its model-parallel group, preconditions the
   full gradient matrix (bias as the last column), scales it by the kl_clip factor summed
   over every layer of every rank, and sends every model-parallel rank its part back (a
   scatter of the split weight and of a column-parallel bias; a broadcast of a
   row-parallel bias and of replicated layers); each part is then broadcast over the
   data-parallel group, so every replica ends with identical gradients.

The math is that of :mod:`kfac_func.step.update` and :mod:`kfac_func.core.factors` on the full
layer, so the result equals K-FAC on the unsharded model. Megatron's layers do not work
inside ``torch.func``; this path uses autograd hooks only.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from kfac_func.adapter.preconditioner import ComputeMethod, KFACArguments
from kfac_func.blocks import Gram, LayerSpec, a_gram, g_gram, grads_to_matrix, matrix_to_grads
from kfac_func.checkpoint.factor_dir import load_factor_dir, save_factor_dir
from kfac_func.core.decomposition import EigenDecomposition, InverseDecomposition
from kfac_func.core.preconditioning import precondition
from kfac_func.distributed.plan import AssignmentStrategy, Plan
from kfac_func.parallel.comm import ParallelCommunicator
from kfac_func.parallel.plan import (
    ParallelPlan,
    Split,
    global_plan,
    make_parallel_plan,
    register_parallel,
)
from kfac_func.parallel.shards import is_shard, kl_clip_from_terms, kl_clip_terms
from kfac_func.state import KFACState, LayerState, init
from kfac_func.step.accumulate import MicroBatchStats, factors_from_stats, fold_checked
from kfac_func.step.checks import grads_finite
from kfac_func.step.decompose import decompose_layer, needs_decomposition

__all__ = ["ParallelKFACPreconditioner"]

logger = logging.getLogger("kfac_func")

IntOrFn = int | Callable[[int], int]
FloatOrFn = float | Callable[[int], float]
Group = Any


@dataclass
class _Micro:
    """One forward/backward (micro-batch): per layer, the captured items (raw tensors,
    or Grams of whole tensors) and whether the raw ones are model-parallel shards."""

    batch_size: int
    a: dict[str, list[Any]] = field(default_factory=dict)
    g: dict[str, list[Any]] = field(default_factory=dict)
    a_shard: dict[str, bool] = field(default_factory=dict)
    g_shard: dict[str, bool] = field(default_factory=dict)


class ParallelKFACPreconditioner(KFACArguments):
    """K-FAC preconditioner for one pipeline stage of a data × model-parallel model.

    Arguments are kfac-pytorch's (see :class:`kfac_func.KFACPreconditioner`) plus:

    Args:
        data_parallel_group: this rank's data-parallel group (None: no data parallelism).
        model_parallel_group: this rank's tensor (model) parallel group (None: none).
        pipeline_parallel_group: this rank's pipeline group; its rank is the stage.
        factor_checkpoint_dir: with it, :meth:`state_dict` writes the factors to one file
            per layer there (:func:`kfac_func.save_factor_dir`) instead of returning them,
            and :meth:`load_state_dict` reads them back.

    Every rank of the world constructs it at the same point, and calls :meth:`step`,
    :meth:`state_dict` and :meth:`load_state_dict` together (they are collectives).
    Gradients must be averaged over the data-parallel group before :meth:`step`.
    ``allreduce_bucket_cap_mb`` and ``symmetry_aware`` are accepted for compatibility;
    each collective here carries one layer's tensors.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from kfac_func.parallel.layers import ColumnParallelLinear, RowParallelLinear
        >>> model = nn.Sequential(ColumnParallelLinear(4, 8, gather_output=False), nn.Tanh(),
        ...                       RowParallelLinear(8, 2, input_is_parallel=True))
        >>> pre = ParallelKFACPreconditioner(model, damping=0.01)  # one process
        >>> model(torch.randn(5, 4)).pow(2).mean().backward()
        >>> pre.step()
        >>> pre.steps, pre.splits
        (1, {'0': 'column', '2': 'row'})
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        data_parallel_group: Group = None,
        model_parallel_group: Group = None,
        pipeline_parallel_group: Group = None,
        factor_update_steps: IntOrFn = 1,
        inv_update_steps: IntOrFn = 1,
        damping: FloatOrFn = 0.001,
        factor_decay: FloatOrFn = 0.95,
        kl_clip: FloatOrFn | None = 0.001,
        lr: FloatOrFn = 0.1,
        accumulation_steps: int = 1,
        allreduce_bucket_cap_mb: float = 25.0,
        assignment_strategy: AssignmentStrategy | str = AssignmentStrategy.COMPUTE,
        compute_method: ComputeMethod | str = ComputeMethod.EIGEN,
        compute_eigenvalue_outer_product: bool = False,
        symmetry_aware: bool = False,
        grad_scaler: Any = None,
        factor_dtype: torch.dtype | None = None,
        inv_dtype: torch.dtype = torch.float32,
        factor_checkpoint_dir: str | None = None,
        skip_layers: list[str] | None = None,
        update_factors_in_hook: bool = True,
        loglevel: int = logging.DEBUG,
        scaling: str = "kfac-pytorch",
        loss_reduction: str = "mean",
    ) -> None:
        self._set_arguments(
            model,
            factor_update_steps=factor_update_steps,
            inv_update_steps=inv_update_steps,
            damping=damping,
            factor_decay=factor_decay,
            kl_clip=kl_clip,
            lr=lr,
            accumulation_steps=accumulation_steps,
            allreduce_bucket_cap_mb=allreduce_bucket_cap_mb,
            assignment_strategy=assignment_strategy,
            compute_method=compute_method,
            compute_eigenvalue_outer_product=compute_eigenvalue_outer_product,
            symmetry_aware=symmetry_aware,
            grad_scaler=grad_scaler,
            inv_dtype=inv_dtype,
            skip_layers=skip_layers,
            update_factors_in_hook=update_factors_in_hook,
            loglevel=loglevel,
            scaling=scaling,
            loss_reduction=loss_reduction,
        )
        self.factor_checkpoint_dir = factor_checkpoint_dir
        self.data_parallel_group = data_parallel_group
        self.model_parallel_group = model_parallel_group
        self.pipeline_parallel_group = pipeline_parallel_group

        self.comm = ParallelCommunicator(data_parallel_group, model_parallel_group)
        pipe = ParallelCommunicator(pipeline_parallel_group, None)
        self.stage = pipe.dp_rank
        self.layers, self.splits = register_parallel(model, self.comm.mp_size, self.skip_layers)
        self.plan: ParallelPlan = make_parallel_plan(
            self.layers,
            self.splits,
            data_parallel_size=self.comm.dp_size,
            model_parallel_size=self.comm.mp_size,
            stage=self.stage,
            assignment_strategy=self.assignment_strategy,
        )
        params = [model.get_parameter(s.weight) for s in self.layers.values()]
        weight = params[0] if params else next(model.parameters(), torch.empty(0))
        self.factor_dtype = factor_dtype or torch.promote_types(weight.dtype, torch.float32)
        self._state = init(
            self.layers,
            convention=scaling,  # type: ignore[arg-type]
            compute_method=self.compute_method.name.lower(),
            compute_eigenvalue_outer_product=compute_eigenvalue_outer_product,
            factor_dtype=self.factor_dtype,
            inv_dtype=inv_dtype,
            device=weight.device,
        )
        self._directory()
        self._micro: list[_Micro] = []
        self._handles: list[Any] = []
        self._register_hooks()
        logger.log(loglevel, "K-FAC registered layers (stage %d):\n%s", self.stage, self.layers)
        logger.log(loglevel, "%s", self.plan)

    def _directory(self) -> None:
        """Learn every rank's stage, coordinates and layers (one object all-gather)."""
        comm = self.comm
        mine = {
            "stage": self.stage,
            "coords": (comm.dp_rank, comm.mp_rank),
            "fingerprint": self.plan.fingerprint(),
            "specs": list(self.layers.values()),
            "owned": self.plan.owned_by(comm.dp_rank, comm.mp_rank),
        }
        infos = comm.all_gather_object(mine)
        prints = {(i["stage"], i["fingerprint"]) for i in infos}
        stages = {s for s, _ in prints}
        if len(prints) != len(stages):
            raise ValueError(
                "ranks of one pipeline stage registered different layers or built different "
                f"plans (rank {comm.rank}, stage {self.stage}):\n{self.plan}"
            )
        self.all_specs: dict[str, LayerSpec] = {}
        seen: dict[str, int] = {}
        for info in sorted(infos, key=lambda i: i["stage"]):
            for spec in info["specs"]:
                if seen.setdefault(spec.name, info["stage"]) != info["stage"]:
                    raise ValueError(f"layer {spec.name!r} is registered on two pipeline stages")
                self.all_specs[spec.name] = spec
        if not self.all_specs:
            raise ValueError(f"no layer of {type(self.model).__name__} can be preconditioned")
        self.owner_rank = {n: r for r, i in enumerate(infos) for n in i["owned"]}
        self.world_plan: Plan = global_plan(self.all_specs, self.owner_rank, comm.world_size)

    # --- hyperparameters ---------------------------------------------------------

    @property
    def steps(self) -> int:
        """Number of :meth:`step` calls so far."""
        return self._state.step

    @property
    def state(self) -> KFACState:
        """This rank's K-FAC state (current for the layers it owns)."""
        return self._state

    def _value(self, v: Any) -> Any:
        return v(self.steps) if callable(v) else v

    def _collecting(self) -> bool:
        return (
            self.model.training
            and torch.is_grad_enabled()
            and self.steps % int(self._value(self.factor_update_steps)) == 0
        )

    def _owner(self, name: str) -> bool:
        lp = self.plan.layers[name]
        return (self.comm.dp_rank, self.comm.mp_rank) == (lp.owner_data, lp.owner_model)

    def _primary(self, name: str) -> bool:
        return self.comm.mp_rank == self.plan.layers[name].owner_model

    # --- hooks -------------------------------------------------------------------

    def _register_hooks(self) -> None:
        self._handles.append(self.model.register_forward_pre_hook(self._start_micro_batch))
        for name, spec in self.layers.items():
            module = self.model.get_submodule(name)
            hook = self._forward_hook(spec, self.splits[name])
            self._handles.append(module.register_forward_hook(hook))

    def _start_micro_batch(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if not self._collecting():
            return
        flat = list(args[0]) if len(args) == 1 and isinstance(args[0], (tuple, list)) else args
        first = next((a for a in flat if isinstance(a, torch.Tensor) and a.dim() > 0), None)
        self._micro.append(_Micro(int(first.shape[0]) if first is not None else 1))

    def _keep(self, spec: LayerSpec, t: torch.Tensor, shard: bool, kind: str) -> Any:
        """What to store of a captured tensor on this rank (None: nothing)."""
        if shard:
            return t  # every model-parallel rank sends its shard to the primary
        if not self._primary(spec.name):
            return None
        if not self.update_factors_in_hook:
            return t
        with torch.autocast(t.device.type, enabled=False):
            gram = a_gram if kind == "a" else g_gram
            return gram(spec, t, self.factor_dtype)

    def _forward_hook(self, spec: LayerSpec, split: Split | None) -> Callable[..., None]:
        parts = self.comm.mp_size

        def hook(module: nn.Module, args: tuple[Any, ...], out: Any) -> None:
            if not self._collecting() or not args or not isinstance(args[0], torch.Tensor):
                return
            x = args[0].detach()
            if not self._micro:
                self._micro.append(_Micro(int(x.shape[0]) if x.dim() > 1 else 1))
            micro = self._micro[-1]
            shard = is_shard(spec, split, parts, x.shape[-1], "a")
            micro.a_shard[spec.name] = shard
            micro.a.setdefault(spec.name, [])
            item = self._keep(spec, x, shard, "a")
            if item is not None:
                micro.a[spec.name].append(item)
            y = out[0] if isinstance(out, (tuple, list)) else out
            if isinstance(y, torch.Tensor) and y.requires_grad:
                y.register_hook(self._grad_hook(spec, split, micro))  # type: ignore[no-untyped-call]

        return hook

    def _grad_hook(
        self, spec: LayerSpec, split: Split | None, micro: _Micro
    ) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            gy = grad.detach()
            if self.grad_scaler is not None:
                scaler = self.grad_scaler
                scale = scaler.get_scale() if hasattr(scaler, "get_scale") else scaler()
                gy = gy.to(self.factor_dtype) / float(scale)
            shard = is_shard(spec, split, self.comm.mp_size, gy.shape[-1], "g")
            micro.g_shard[spec.name] = shard
            item = self._keep(spec, gy, shard, "g")
            lst = micro.g.setdefault(spec.name, [])
            if item is not None:
                lst.append(item)

        return hook

    # --- step --------------------------------------------------------------------

    def _local_factors(
        self, micro: list[_Micro]
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
        """This replica's batch factors of the full layers, on each layer's primary."""
        cfg = self._state.config
        out = {}
        for name, spec in self.layers.items():
            lp = self.plan.layers[name]
            seen = [mb for mb in micro if name in mb.a]
            a_shard = any(mb.a_shard.get(name, False) for mb in seen)
            g_shard = any(mb.g_shard.get(name, False) for mb in seen)
            a_items = [list(mb.a[name]) for mb in seen]
            g_items = [list(mb.g.get(name, [])) for mb in seen]
            sent = [x for items in a_items for x in items] if a_shard else []
            sent += [r for items in g_items for r in items] if g_shard else []
            if sent:
                full = self.comm.gather_shards(sent, dims=[-1] * len(sent), dst=lp.owner_model)
                if full is not None:
                    it = iter(full)
                    if a_shard:
                        a_items = [[next(it) for _ in items] for items in a_items]
                    if g_shard:
                        g_items = [[next(it) for _ in items] for items in g_items]
            if not self._primary(name) or not seen:
                continue
            stats = []
            for mb, a, g in zip(seen, a_items, g_items):
                a = [x if isinstance(x, Gram) else a_gram(spec, x, cfg.factor_dtype) for x in a]
                g = [r if isinstance(r, Gram) else g_gram(spec, r, cfg.factor_dtype) for r in g]
                scale = 1.0 / mb.batch_size if self.loss_reduction == "mean" else 1.0
                stats.append(MicroBatchStats(a, g, mb.batch_size, scale))
            factors = factors_from_stats(name, stats, cfg)
            if factors is not None:
                out[name] = factors
        return out

    def _fold(
        self,
        layers: dict[str, LayerState],
        local: Mapping[str, tuple[torch.Tensor, torch.Tensor, float]],
    ) -> dict[str, LayerState]:
        """Sum the replicas' factors on the owners and fold them into the running averages."""
        cfg = self._state.config
        decay = float(self._value(self.factor_decay))
        for name, ls in self._state.layers.items():
            if not self._primary(name):
                continue
            lp = self.plan.layers[name]
            if name in local:
                a, g, w = local[name]
                sent = [w * a, w * g, torch.full((1,), w, dtype=a.dtype, device=a.device)]
            else:
                zero = torch.zeros(1, dtype=ls.a_factor.dtype, device=ls.a_factor.device)
                sent = [torch.zeros_like(ls.a_factor), torch.zeros_like(ls.g_factor), zero]
            wa, wg, total = self.comm.reduce_data(sent, dst=lp.owner_data)
            if not self._owner(name):
                continue
            w = float(total[0])
            if w != 0.0:
                layers[name] = fold_checked(ls, wa / w, wg / w, decay, cfg, "skip")
        return layers

    def _layer_grads(self, spec: LayerSpec) -> tuple[torch.Tensor, torch.Tensor | None]:
        grads = []
        for pname in spec.param_names():
            p = self.model.get_parameter(pname)
            if p.grad is None:
                raise RuntimeError(
                    f"layer {spec.name!r}: parameter {pname!r} has no gradient; call "
                    "backward before step()"
                )
            grads.append(p.grad)
        return grads[0], grads[1] if len(grads) > 1 else None

    def _full_grads(
        self, name: str, spec: LayerSpec
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The whole gradient of a layer on its owner (gathered from the model-parallel
        group of the owner's replica); None on other ranks."""
        lp = self.plan.layers[name]
        w, b = self._layer_grads(spec)
        if self.comm.dp_rank != lp.owner_data:
            return None
        if lp.split is None or self.comm.mp_size == 1:
            return (w, b) if self._primary(name) else None
        sent, dims = [w], [0 if lp.split == "column" else -1]
        if b is not None and lp.split == "column":
            sent.append(b)
            dims.append(0)
        full = self.comm.gather_shards(sent, dims=dims, dst=lp.owner_model)
        if full is None:
            return None
        return full[0], (full[1] if lp.split == "column" and b is not None else b)

    def _distribute(
        self, name: str, spec: LayerSpec, new: tuple[torch.Tensor, torch.Tensor | None] | None
    ) -> list[torch.Tensor]:
        """This rank's part of the owner's new gradients (weight, then bias if any)."""
        lp = self.plan.layers[name]
        w, b = self._layer_grads(spec)
        like = [w] if b is None else [w, b]
        parts: list[torch.Tensor] = like
        if self.comm.dp_rank == lp.owner_data:
            full = None if new is None else [t for t in new if t is not None]
            if lp.split is None:
                dims: list[int | None] = [None] * len(like)
            else:
                dims = [0 if lp.split == "column" else 1]
                if b is not None:
                    dims.append(0 if lp.split == "column" else None)
            parts = self.comm.scatter_shards(full, like, dims=dims, src=lp.owner_model)
        return self.comm.broadcast_data(parts, src=lp.owner_data)

    def step(self) -> None:
        """Precondition the registered layers' ``.grad`` in place (before ``optimizer.step()``)."""
        micro, self._micro = self._micro, []
        state = self._state
        cfg = state.config
        lam = float(self._value(self.damping))
        layers = dict(state.layers)
        if micro:
            layers = self._fold(layers, self._local_factors(micro))
        update_inverses = self.steps % int(self._value(self.inv_update_steps)) == 0
        for name, ls in layers.items():
            if self._owner(name) and needs_decomposition(ls, cfg, update_inverses=update_inverses):
                layers[name] = ls.replace(decomposition=decompose_layer(ls, lam, cfg))

        full: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
        done: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for name, spec in self.layers.items():
            got = self._full_grads(name, spec)
            if got is None:
                continue
            full[name] = got
            dec = layers[name].decomposition
            m = grads_to_matrix(spec, *got)
            if dec is not None and grads_finite(name, spec, m, "skip"):
                done[name] = (precondition(m, dec, lam), m)
        scale = None
        if self.kl_clip is not None:
            total = self.comm.all_reduce_world(kl_clip_terms(list(done.values())))
            scale = kl_clip_from_terms(
                total, float(self._value(self.kl_clip)), float(self._value(self.lr))
            )
        for name, spec in self.layers.items():
            new: tuple[torch.Tensor, torch.Tensor | None] | None = full.get(name)
            if name in done:
                p = done[name][0]
                if scale is not None:
                    p = p * scale.to(p.dtype)
                w, b = matrix_to_grads(spec, p)
                assert new is not None
                new = (
                    w.to(new[0].dtype),
                    None if b is None or new[1] is None else b.to(new[1].dtype),
                )
            parts = self._distribute(name, spec, new)
            with torch.no_grad():
                for pname, t in zip(spec.param_names(), parts):
                    grad = self.model.get_parameter(pname).grad
                    assert grad is not None
                    if t is not grad:
                        grad.copy_(t)
        self._state = state.replace(layers=layers, step=state.step + 1)

    # --- state -------------------------------------------------------------------

    _HYPER = ("factor_update_steps", "inv_update_steps", "damping", "factor_decay", "kl_clip", "lr")

    def state_dict(self, include_factors: bool = True) -> dict[str, Any]:
        """kfac-pytorch's shape, gathered across ranks: every rank returns ``steps``, the
        non-callable hyperparameters and ``layers: {name: {"A", "G", ...}}`` of every layer
        of every stage (each from its owner). With ``factor_checkpoint_dir`` the factors
        go to one file per layer there instead (see :meth:`save_factors_to_dir`). A
        collective: every rank calls it."""
        sd: dict[str, Any] = {"steps": self.steps}
        for key in self._HYPER:
            value = getattr(self, key)
            if not callable(value):
                sd[key] = value
        if not include_factors:
            return sd
        if self.factor_checkpoint_dir is not None:
            self.save_factors_to_dir()
            return sd
        mine = {}
        for name, ls in self._state.layers.items():
            if not self._owner(name):
                continue
            entry: dict[str, Any] = {
                "A": ls.a_factor.cpu(),
                "G": ls.g_factor.cpu(),
                "factor_updates": ls.factor_updates,
            }
            if ls.decomposition is not None:
                entry["decomposition"] = {
                    k: v.cpu()
                    for k, v in vars(ls.decomposition).items()
                    if isinstance(v, torch.Tensor)
                }
            mine[name] = entry
        merged: dict[str, Any] = {}
        for part in self.comm.all_gather_object(mine):
            merged.update(part)
        sd["layers"] = {name: merged[name] for name in self.all_specs}
        return sd

    def load_state_dict(self, state_dict: dict[str, Any], compute_inverses: bool = True) -> None:
        """Restore :meth:`state_dict` (of any rank); with ``factor_checkpoint_dir`` the
        factors come from there. Owners recompute missing decompositions with
        ``compute_inverses``. A collective: every rank calls it."""
        sd = dict(state_dict)
        steps = int(sd.pop("steps"))
        layers_sd = sd.pop("layers", None)
        for key in self._HYPER:
            if key in sd and not callable(getattr(self, key)):
                setattr(self, key, sd[key])
        self._state = self._state.replace(step=steps)
        if self.factor_checkpoint_dir is not None:
            self.load_factors_from_dir(compute_inverses)
            return
        if layers_sd is None:
            return
        missing = sorted(set(self.layers) - set(layers_sd))
        if missing:
            raise ValueError(
                f"state_dict has no factors for layers {missing} (rank {self.comm.rank})"
            )
        cfg = self._state.config
        layers = dict(self._state.layers)
        for name, ls in layers.items():
            entry = layers_sd[name]
            a, g = entry["A"], entry["G"]
            a_shape, g_shape = ls.spec.factor_shapes
            if tuple(a.shape) != a_shape or tuple(g.shape) != g_shape:
                raise ValueError(
                    f"layer {name!r}: state_dict factors have shapes {tuple(a.shape)} and "
                    f"{tuple(g.shape)}, expected {a_shape} and {g_shape}"
                )
            dev = ls.a_factor.device
            new = ls.replace(
                a_factor=a.to(dev, cfg.factor_dtype, copy=True),
                g_factor=g.to(dev, cfg.factor_dtype, copy=True),
                factor_updates=int(entry.get("factor_updates", max(1, ls.factor_updates))),
                decomposition=None,
            )
            dec = entry.get("decomposition")
            if dec is not None:
                cls = EigenDecomposition if cfg.compute_method == "eigen" else InverseDecomposition
                new = new.replace(decomposition=cls(**{k: v.to(dev) for k, v in dec.items()}))
            elif compute_inverses and self._owner(name):
                new = new.replace(
                    decomposition=decompose_layer(new, float(self._value(self.damping)), cfg)
                )
            layers[name] = new
        self._state = self._state.replace(layers=layers)

    def _world_state(self) -> KFACState:
        """This rank's state widened to every layer of every stage (others' entries are
        empty placeholders), as the factor-file functions expect."""
        empty = torch.empty(0, dtype=self.factor_dtype)
        layers = {
            name: self._state.layers.get(name) or LayerState(empty, empty, None, spec)
            for name, spec in self.all_specs.items()
        }
        return self._state.replace(layers=layers)

    def save_factors_to_dir(self) -> None:
        """Write one checkpoint file per layer (by its owner) and a manifest to
        ``factor_checkpoint_dir`` (:func:`kfac_func.save_factor_dir`). A collective."""
        if self.factor_checkpoint_dir is None:
            raise ValueError("factor_checkpoint_dir is None")
        save_factor_dir(
            self._world_state(),
            self.factor_checkpoint_dir,
            plan=self.world_plan,
            include_decompositions=True,
        )

    def load_factors_from_dir(self, compute_inverses: bool = True) -> None:
        """Read the owned layers' factors from ``factor_checkpoint_dir``. A collective.

        As in kfac-pytorch, a ``factor_checkpoint_dir`` that is not a directory (no
        checkpoint was saved yet) only warns and keeps the current factors; a directory
        without a complete checkpoint raises
        :class:`~kfac_func.checkpoint.state_files.CheckpointFormatError`.
        """
        if self.factor_checkpoint_dir is None:
            raise ValueError("factor_checkpoint_dir is None")
        if not os.path.isdir(self.factor_checkpoint_dir):
            warnings.warn(
                f"factor_checkpoint_dir={self.factor_checkpoint_dir!r} is not a directory; "
                "the K-FAC factors are not loaded",
                stacklevel=2,
            )
            return
        loaded = load_factor_dir(
            self.factor_checkpoint_dir,
            like=self._world_state(),
            plan=self.world_plan,
            only_owned=True,
        )
        cfg = self._state.config
        layers = dict(self._state.layers)
        for name in layers:
            if not self._owner(name):
                continue
            ls = loaded.layers[name]
            if ls.decomposition is None and compute_inverses:
                ls = ls.replace(
                    decomposition=decompose_layer(ls, float(self._value(self.damping)), cfg)
                )
            layers[name] = ls
        self._state = self._state.replace(layers=layers, step=loaded.step)

    # --- housekeeping ------------------------------------------------------------

    def remove(self) -> None:
        """Detach every hook and drop collected statistics."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self._micro = []

    def __repr__(self) -> str:
        hyper = ", ".join(f"{k}={getattr(self, k)!r}" for k in self._HYPER)
        return (
            f"{type(self).__name__}({len(self.layers)} layers on stage {self.stage}, {hyper}, "
            f"data={self.comm.dp_size}, model={self.comm.mp_size}, "
            f"compute_method={self.compute_method.name.lower()}, scaling={self.scaling!r})"
        )
