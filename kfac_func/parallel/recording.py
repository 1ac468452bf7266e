"""Recording of layer statistics in module hooks, for the parallel preconditioner.

A forward pre-hook on the model starts a micro-batch; a forward hook on each registered
layer keeps the call's input and hangs a hook on its output for the output-gradient. A
model-parallel shard is kept raw on every rank (the layer's primary gathers the shards
in ``step()``); a whole tensor is kept by the primary only: its Gram with
``update_factors_in_hook``, else the raw tensor. A call re-run in the backward pass
(activation checkpointing) counts once its output-gradient arrives
(:mod:`kfac_func.adapter.recompute`); the batch size is what the calls' inputs say.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from kfac_func.adapter.recompute import in_backward
from kfac_func.adapter.recording import remove_handles
from kfac_func.blocks import LayerSpec, a_gram, g_gram
from kfac_func.parallel.base import MicroBatchRecord, ParallelBase
from kfac_func.parallel.plan import Split
from kfac_func.parallel.shards import is_shard
from kfac_func.step.autocast import autocast_off

__all__ = ["ParallelHookRecorder"]


class ParallelHookRecorder(ParallelBase):
    """The hooks of the parallel preconditioner and the micro-batches they record (a base
    class: the preconditioner sets ``_micro`` and ``_handles`` and calls
    :meth:`_register_hooks`)."""

    def _register_hooks(self) -> None:
        self._handles.append(self.model.register_forward_pre_hook(self._start_micro_batch))
        for name, spec in self.layers.items():
            module = self.model.get_submodule(name)
            hook = self._forward_hook(spec, self.splits[name])
            self._handles.append(module.register_forward_hook(hook))

    def _start_micro_batch(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if self._collecting():
            self._micro.append(MicroBatchRecord())

    def _keep(self, spec: LayerSpec, t: torch.Tensor, shard: bool, kind: str) -> Any:
        """What to store of a captured tensor on this rank (None: nothing)."""
        if shard:
            return t  # every model-parallel rank sends its shard to the primary
        if not self._primary(spec.name):
            return None
        if not self.update_factors_in_hook:
            return t
        with autocast_off(t.device.type):
            gram = a_gram if kind == "a" else g_gram
            return gram(spec, t, self.gram_dtype or self.factor_dtype)

    def _forward_hook(self, spec: LayerSpec, split: Split | None) -> Callable[..., None]:

        def hook(module: nn.Module, args: tuple[Any, ...], out: Any) -> None:
            if not self._collecting() or not args or not isinstance(args[0], torch.Tensor):
                return
            x = args[0].detach()
            if not self._micro:
                self._micro.append(MicroBatchRecord())
            micro = self._micro[-1]
            # a call inside the backward pass (a recomputation) counts once its
            # output-gradient arrives (see kfac_func.adapter.recompute)
            late = in_backward()
            if not late:
                self._record(spec, split, micro, x, "a")
            y = out[0] if isinstance(out, (tuple, list)) else out
            if isinstance(y, torch.Tensor) and y.requires_grad:
                grad_hook = self._grad_hook(spec, split, micro, x if late else None)
                y.register_hook(grad_hook)  # type: ignore[no-untyped-call]

        return hook

    def _record(
        self, spec: LayerSpec, split: Split | None, mb: MicroBatchRecord, t: torch.Tensor, kind: str
    ) -> None:
        """Record the layer's input (``kind`` "a", with the call's examples) or its
        output-gradient ("g") in ``mb``: what this rank keeps of it (:meth:`_keep`)."""
        if kind == "a":
            mb.examples.add(spec, t)
        shard = is_shard(spec, split, self.comm.mp_size, t.shape[-1], kind)
        (mb.a_shard if kind == "a" else mb.g_shard)[spec.name] = shard
        kept = (mb.a if kind == "a" else mb.g).setdefault(spec.name, [])
        item = self._keep(spec, t, shard, kind)
        if item is not None:
            kept.append(item)

    def _grad_hook(
        self,
        spec: LayerSpec,
        split: Split | None,
        micro: MicroBatchRecord,
        late_input: torch.Tensor | None = None,
    ) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            if late_input is not None:  # a recomputed call whose gradient flows: it counts
                self._record(spec, split, micro, late_input, "a")
            gy = grad.detach()
            if self.grad_scaler is not None:
                scaler = self.grad_scaler
                scale = scaler.get_scale() if hasattr(scaler, "get_scale") else scaler()
                gy = gy.to(self.factor_dtype) / float(scale)
            self._record(spec, split, micro, gy, "g")

        return hook

    def remove(self) -> None:
        """Detach every hook and drop collected statistics."""
        remove_handles(self._handles)
        self._handles = []
        self._micro = []
