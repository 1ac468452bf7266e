"""The step of the parallel preconditioner: factors, decompositions, preconditioned gradients.

In each data-parallel replica, the primary of each layer gathers the model-parallel
shards of its inputs or output-gradients and builds the replica's batch factors of the
full layer; the replicas' factors are summed on the layer's owner, which folds them into
its running averages and decomposes them. The owner gathers the layer's gradient shards,
preconditions the full gradient matrix, scales it by the kl_clip factor summed over every
rank, and sends every model-parallel rank its part back, which each replica's rank then
broadcasts over its data-parallel group.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from kfac_func.blocks import Gram, LayerSpec, a_gram, g_gram, grads_to_matrix, matrix_to_grads
from kfac_func.core.preconditioning import precondition
from kfac_func.parallel.base import MicroBatchRecord, ParallelBase
from kfac_func.parallel.shards import kl_clip_from_terms, kl_clip_terms
from kfac_func.state import LayerState
from kfac_func.step.accumulate import fold_checked
from kfac_func.step.batch_factors import (
    LayerFactors,
    MicroBatchStats,
    factors_from_stats,
    from_pooled,
    pooling_terms,
)
from kfac_func.step.checks import grads_finite
from kfac_func.step.decompose import decompose_layer
from kfac_func.step.decompose_groups import needs_decomposition

__all__ = ["ParallelStep"]


class ParallelStep(ParallelBase):
    """:meth:`step` of the parallel preconditioner and its stages (a base class)."""

    # --- step --------------------------------------------------------------------

    def _local_factors(self, micro: list[MicroBatchRecord]) -> dict[str, LayerFactors]:
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
            dtype = self.gram_dtype or cfg.factor_dtype
            for mb, a, g in zip(seen, a_items, g_items):
                a = [x if isinstance(x, Gram) else a_gram(spec, x, dtype) for x in a]
                g = [r if isinstance(r, Gram) else g_gram(spec, r, dtype) for r in g]
                scale = self._loss_scale(mb.batch_size)
                stats.append(MicroBatchStats(a, g, mb.batch_size, scale))
            factors = factors_from_stats(name, stats, cfg)
            if factors is not None:
                out[name] = factors
        return out

    def _fold(
        self,
        layers: dict[str, LayerState],
        local: Mapping[str, LayerFactors],
    ) -> dict[str, LayerState]:
        """Sum the replicas' factors on the owners and fold them into the running averages."""
        cfg = self._state.config
        decay = float(self._value(self.factor_decay))
        for name, ls in self._state.layers.items():
            if not self._primary(name):
                continue
            lp = self.plan.layers[name]
            zeros = None
            if name not in local:
                zeros = (torch.zeros_like(ls.a_factor), torch.zeros_like(ls.g_factor))
            sent = pooling_terms(ls.spec, local.get(name), zeros)
            sums = self.comm.reduce_data(sent, dst=lp.owner_data)
            if not self._owner(name):
                continue
            pooled = from_pooled(sums)
            if pooled is not None:
                layers[name] = fold_checked(ls, pooled.a, pooled.g, decay, cfg, "skip")
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
            dims = [lp.split_dim]  # a column-parallel bias is split like the weight's rows
            if b is not None:
                dims.append(0 if lp.split == "column" else None)
            parts = self.comm.scatter_shards(full, like, dims=dims, src=lp.owner_model)
        return self.comm.broadcast_data(parts, src=lp.owner_data)

    def step(self) -> None:
        """Precondition the registered layers' ``.grad`` in place (before ``optimizer.step()``)."""
        self._settle()
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
