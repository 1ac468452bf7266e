"""Recording of layer statistics in module hooks, for :class:`KFACPreconditioner`.

Forward hooks (and gradient hooks on each call's output) collect each registered layer's
statistics during the forward and backward passes: Gram matrices at once with
``update_factors_in_hook``, else the raw tensors until ``step()``. Each forward of the
model starts a micro-batch; the micro-batches of an accumulation window become one batch
factor per layer (:meth:`HookRecorder._batch_factors`). A micro-batch's batch size is what
its layers' calls say (:class:`~kfac_func.blocks.examples.CallExamples`), never a guess
from the model's arguments; a forward re-run in the backward pass (activation
checkpointing) counts as :mod:`kfac_func.adapter.recompute` says. On one rank, layers whose kind has
rows also keep each call's rows for the low-rank preconditioning path. With several ranks,
a layer's factor reduction may start in the backward pass, once its window is complete.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from kfac_func.adapter.arguments import ComputeMethod, PreconditionerBase
from kfac_func.adapter.compiled import eager_forward, forget_compiled_code, opaque
from kfac_func.adapter.coverage import warn_uncollected, watch_gradients
from kfac_func.adapter.recompute import in_backward
from kfac_func.blocks import (
    Gram,
    LayerSpec,
    LayerTable,
    Rows,
    a_gram,
    call_grams,
    g_gram,
    joint_grams,
)
from kfac_func.blocks.examples import BatchSizeError, CallExamples
from kfac_func.blocks.taps import Site, call_sites, tap_hooks, tapped
from kfac_func.captures import Captures, LayerCapture
from kfac_func.distributed.communicator import Communicator
from kfac_func.distributed.dtensor import whole_input, whole_output_grad
from kfac_func.distributed.kaisa import offer_factors, start_factor_reduction
from kfac_func.distributed.plan import Plan
from kfac_func.distributed.reducer import OrderedReducer
from kfac_func.step.autocast import autocast_off
from kfac_func.step.batch_factors import (
    LayerFactors,
    MicroBatchStats,
    build_batch_factors,
    factors_from_stats,
)
from kfac_func.step.checks import rows_cheaper_count
from kfac_func.step.grouping import grouped_here

__all__ = ["HookRecorder", "remove_handles"]

_WHAT_TO_DO = (
    "Keep the examples on the leading dimension of every registered layer's input "
    "(batch_first=True for torch.nn.Transformer layers), or leave the layers that do not "
    "out (skip_layers=[...]); the K-FAC state is unchanged"
)


@dataclass
class _MicroBatch:
    """Statistics of one forward/backward (a micro-batch), per layer; ``batch_size`` is
    set from ``examples`` when the statistics are used (:meth:`HookRecorder._settle`)."""

    batch_size: int = 0
    a: dict[str, list[Any]] = field(default_factory=dict)
    g: dict[str, list[Any]] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)
    examples: CallExamples = field(default_factory=CallExamples)
    # the last call's input statistics: (what they depend on, the input, its Gram); the
    # input is held so that its memory is not another tensor's while the key names it
    last_a: tuple[Any, torch.Tensor, Gram] | None = None

    def empty(self) -> bool:
        return not (self.a or self.g or self.calls)


class HookRecorder(PreconditionerBase):
    """The hooks of a preconditioner and the statistics they collect (a base class: the
    preconditioner sets the attributes below and calls :meth:`_register_hooks`)."""

    layers: LayerTable
    plan: Plan
    comm: Communicator
    factor_dtype: torch.dtype
    gram_dtype: torch.dtype | None
    _micro: list[_MicroBatch]
    _rows: dict[str, list[list[torch.Tensor | None]]]
    _handles: list[Any]
    _stream: bool
    _reducer: OrderedReducer | None
    _dropped: set[str]
    _fall_back: Callable[[set[str], bool], set[str]]  # kfac_func.adapter.fallback
    _refuse: Callable[[str, str], None]  # kfac_func.adapter.fallback

    @property
    def reductions_in_flight(self) -> list[str]:
        """Layers whose factor reduction has started in the backward pass (cleared by
        :meth:`step`); empty on one process or without ``update_factors_in_hook``."""
        if self._reducer is None:
            return []
        return [name for name in self.layers if self._reducer.offered(name)]

    def _register_hooks(self) -> None:
        # the hooks hold the preconditioner weakly: a preconditioner that is dropped
        # without remove() is still collected, and its hooks are detached then.
        # Their bodies are opaque to torch.compile (see kfac_func.adapter.compiled).
        ref = weakref.ref(self)
        self._grads_seen: set[str] = set()

        @opaque
        def pre_hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            pre = ref()
            if pre is not None:
                pre._start_micro_batch(module, args)

        def forward_hook(spec: LayerSpec) -> Callable[..., Any]:
            @opaque
            def hook(module: nn.Module, args: tuple[Any, ...], out: Any) -> Any:
                pre = ref()
                new = out if pre is None else pre._on_forward(spec, args, out)
                return None if new is out else new

            return hook

        @opaque
        def record(spec: LayerSpec, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
            pre = ref()
            return out if pre is None else pre._on_forward(spec, (x,), out)

        def site() -> Site | None:
            pre = ref()
            return record if pre is not None and pre._collecting() else None

        def refuse(layer: str, why: str) -> None:  # a tap's verdict on a call
            pre = ref()
            if pre is not None:
                pre._refuse(layer, why)

        def grads_seen() -> set[str] | None:
            pre = ref()
            return pre._grads_seen if pre is not None and pre._watching() else None

        self._handles.append(self.model.register_forward_pre_hook(pre_hook))
        for module, specs in call_sites(self.model, self.layers).values():
            if tapped(specs):
                self._handles += tap_hooks(module, specs, site, wrap=opaque, refuse=refuse)
                self._handles.append(eager_forward(module))
            else:
                self._handles.append(module.register_forward_hook(forward_hook(specs[0])))
        # kept to watch the weights again if the model replaces them (see
        # kfac_func.adapter.parameter_places)
        self._seen_fn = grads_seen
        self._watch_handles = watch_gradients(self.model, self.layers, grads_seen)
        self._handles += self._watch_handles
        weakref.finalize(self, remove_handles, self._handles)
        forget_compiled_code()  # compiled without these hooks, it would bypass them

    def _watching(self) -> bool:
        """Whether gradients arriving now belong to a step that collects statistics (the
        backward pass runs without grad mode: the forward's is not asked)."""
        return self.model.training and self.steps % int(self._value(self.factor_update_steps)) == 0

    def _check_collected(self) -> bool:
        """Demote the layers that cannot be preconditioned (refused by their first call's
        check, without a gradient, or, on a factor-update step, with gradients and no
        statistics while other layers got theirs: see :mod:`kfac_func.adapter.fallback`),
        and warn naming the layers whose weights received gradients on this factor-update
        step but got no statistics when no layer got any (see
        :mod:`kfac_func.adapter.coverage`). False when no layer is left: the step then
        only counts itself."""
        seen, self._grads_seen = self._grads_seen, set()
        left = self._fall_back(seen, bool(seen))
        if left:
            collected = {name for mb in self._micro for name in mb.g}
            warn_uncollected(left, collected, self.steps)
        if not self.layers:  # every layer left: nothing to precondition
            self._micro, self._rows, self._reducer = [], {}, None
            self._state = self._state.replace(step=self._state.step + 1)
        return bool(self.layers)

    @property
    def _gram(self) -> torch.dtype:
        """The dtype of the Gram products' operands (``gram_dtype``, else the factors')."""
        return self.gram_dtype or self.factor_dtype

    def _start_micro_batch(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if not self._collecting():
            return
        if self._micro and self._micro[-1].empty():
            self._micro.pop()  # a forward that saw nothing (a recomputation that counted none)
        self._micro.append(_MicroBatch())

    def _settle(self) -> None:
        """Drop the micro-batches that count for nothing and set each one's batch size
        from its layers' calls (at the start of ``step()``, before any statistic is used:
        a :class:`~kfac_func.blocks.examples.BatchSizeError` leaves everything as it was).
        The batch size enters the factors with ``scaling="fisher"`` and EKFAC's
        eigenvalues; otherwise calls that disagree are no error."""
        self._drop_forward_only()
        self._micro = [mb for mb in self._micro if not mb.empty()]
        required = self.scaling == "fisher" or self._ekfac
        for mb in self._micro:
            mb.batch_size = mb.examples.batch_size(required, _WHAT_TO_DO)

    @property
    def _ekfac(self) -> bool:
        """EKFAC needs each call's raw input and output-gradient at ``step()``."""
        return self.compute_method is ComputeMethod.EKFAC

    def _paired(self, spec: LayerSpec) -> bool:
        """Whether a call's input is kept until its gradient arrives and stored with it
        (joint statistics, EKFAC's per-example rows)."""
        return spec.block.joint or self._ekfac

    def _drop_forward_only(self) -> None:
        """Forget the micro-batches whose forward pass had no backward pass (a loss
        evaluated in training mode with gradients enabled): they contributed nothing to
        the gradients, so they contribute nothing to the factors either. A micro-batch
        that got some output-gradients is kept whole (an incomplete one is an error
        later, naming the layer)."""
        if any(not mb.g and (mb.a or mb.calls) for mb in self._micro):
            self._micro = [mb for mb in self._micro if mb.g or not (mb.a or mb.calls)]

    def _take_captures(self) -> list[Captures]:
        """The micro-batches' raw inputs and output-gradients as :class:`Captures` (for
        EKFAC), taken out of the micro-batches."""
        out = []
        for mb in self._micro:
            layers = {
                name: LayerCapture(tuple(mb.a.pop(name)), tuple(mb.g.pop(name, [])))
                for name in list(mb.a)
            }
            out.append(Captures(layers, mb.batch_size, self._loss_scale(mb.batch_size)))
        return out

    def _keeps_rows(self, spec: LayerSpec) -> bool:
        """Linear layers on one rank keep each call's rows for :meth:`step`: their
        gradient is the rows' product, which preconditions with fewer dense products
        (see :func:`kfac_func.step.precondition.precondition_layer`)."""
        return (
            spec.block.has_rows
            and not any(spec.diagonal)
            and not self.eigenbasis_moments  # which needs the gradient in the eigenbasis
            and getattr(self, "orthogonal", None) is None  # which needs it too
            and not getattr(self, "sync_free", False)  # which decides nothing on the host
            and self.comm.world_size == 1
            and self.model.training
            and torch.is_grad_enabled()
        )

    def _on_forward(self, spec: LayerSpec, args: tuple[Any, ...], out: Any) -> Any:
        """Record one call of ``spec``; returns its output, expanded to the batch for a
        call that serves every example from one input (see
        :meth:`~kfac_func.blocks.LayerBlock.broadcast_call`)."""
        if spec.name in self._dropped:  # refused by its first call's check, or demoted
            return out
        collect, keep = self._collecting(), self._keeps_rows(spec)
        if keep and isinstance(args[0], torch.Tensor) and args[0].dim() > 0:
            # rows that would not make the preconditioning cheaper are not kept: a call
            # adds rows, so one call's too many are too many for the step
            keep = rows_cheaper_count(spec, args[0].numel() // max(args[0].shape[-1], 1))
        if not (collect or keep):
            return out
        # tensor parallelism hands the hook a DTensor: its shards are gathered (over the
        # mesh it came on, which also gathers a column-parallel output-gradient); a plain
        # tensor is taken as it is
        x, mesh = args[0].detach(), None
        if type(x) is not torch.Tensor:
            x, mesh = whole_input(x)
        # a call inside the backward pass (a recomputation) counts once its
        # output-gradient arrives (see kfac_func.adapter.recompute)
        late = in_backward()
        micro = None
        if collect:
            if not self._micro:
                self._micro.append(_MicroBatch())
            micro = self._micro[-1]
            n = micro.examples.known()
            wide = spec.block.broadcast_call(spec, x, out, n) if n else None
            if wide is not None:
                x, out = wide
            if not late:
                self._count_call(spec, micro, x)
        pair: list[torch.Tensor | None] | None = None
        if keep:
            pair = [x, None]
            if not late:
                self._rows.setdefault(spec.name, []).append(pair)
        if isinstance(out, torch.Tensor) and out.requires_grad:
            # a hook on this call's output sees its gradient even when later ops
            # modify the output in place (and needs no input that requires grad)
            joint_input = x if micro is not None and self._paired(spec) else None
            hook = self._grad_hook(spec, micro, pair, joint_input, mesh, x if late else None)
            out.register_hook(hook)  # type: ignore[no-untyped-call]
        return out

    def _count_call(self, spec: LayerSpec, micro: _MicroBatch, x: torch.Tensor) -> None:
        """One call of ``spec`` on the input ``x`` in ``micro``: its examples, and its input
        statistics unless they wait for the output-gradient (paired)."""
        micro.calls[spec.name] = micro.calls.get(spec.name, 0) + 1
        micro.examples.add(spec, x)
        if not self._paired(spec):
            item = self._input_gram(spec, micro, x) if self.update_factors_in_hook else x
            micro.a.setdefault(spec.name, []).append(item)

    def _input_gram(self, spec: LayerSpec, micro: _MicroBatch, x: torch.Tensor) -> Gram:
        """The input statistics of one call, in the Gram dtype (the hook runs inside the
        user's autocast region: not in the autocast dtype). A call that reads the same
        tensor as the micro-batch's previous call, unchanged since, with the same
        statistics (:meth:`~kfac_func.blocks.LayerBlock.a_gram_key`) reuses its Gram:
        an attention's query, key and value projections, or an MLP's gate and up
        projections, read one input."""
        kind = spec.block.a_gram_key(spec)
        key = None
        if kind is not None and _has_storage(x):
            key = (kind, x.device, x.dtype, x.data_ptr(), x.shape, x.stride(), x._version)
            last = micro.last_a
            if last is not None and last[0] == key:
                return last[2]
        with autocast_off(x.device.type):
            gram = a_gram(spec, x, self._gram)
        micro.last_a = None if key is None else (key, x, gram)
        return gram

    def _grad_hook(
        self,
        spec: LayerSpec,
        micro: _MicroBatch | None,
        pair: list[torch.Tensor | None] | None,
        joint_input: torch.Tensor | None = None,
        mesh: Any = None,
        late_input: torch.Tensor | None = None,
    ) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            if late_input is not None:  # a recomputed call whose gradient flows: it counts
                if pair is not None:
                    self._rows.setdefault(spec.name, []).append(pair)
                if micro is not None:
                    self._count_call(spec, micro, late_input)
            gy = grad.detach()
            if mesh is not None or type(gy) is not torch.Tensor:
                gy = whole_output_grad(spec, gy, mesh)
            if self.grad_scaler is not None:
                # unscaled, as the gradients are when step() runs (after unscale_)
                gy = gy.to(self.factor_dtype) / self._grad_scale()
            if pair is not None:
                pair[1] = gy
            if micro is None:
                return
            a_item: Any = joint_input
            item: Any = gy
            if self.update_factors_in_hook and not self._ekfac:
                with autocast_off(gy.device.type):
                    if joint_input is not None:
                        a_item, item = joint_grams(spec, joint_input, gy, self._gram)
                    else:
                        item = g_gram(spec, gy, self._gram)
            if joint_input is not None:  # the call's input and gradient, kept as a pair
                micro.a.setdefault(spec.name, []).append(a_item)
            micro.g.setdefault(spec.name, []).append(item)
            if self._stream:
                self._offer_if_complete(spec, micro)

        return hook

    def _take_rows(self) -> dict[str, Rows]:
        """The kept rows of layers whose every call got its output-gradient.

        The pairs are emptied: the gradient hooks of the graph (alive as long as the
        caller's loss) hold them, and must not keep the rows alive after the step.
        """
        kept, self._rows = self._rows, {}
        out: dict[str, Rows] = {}
        for name, pairs in kept.items():
            xs = [x for x, _ in pairs if x is not None]
            gys = [gy for _, gy in pairs if gy is not None]
            if pairs and len(gys) == len(xs) == len(pairs):
                spec = self.layers[name]
                out[name] = spec.block.rows(spec, xs, gys)
            for pair in pairs:
                pair[0] = pair[1] = None
        return out

    def _offer_if_complete(self, spec: LayerSpec, micro: _MicroBatch) -> None:
        """Start the layer's factor reduction from the backward pass once its window is
        complete: the last micro-batch, and as many output-gradients as forward calls."""
        name = spec.name
        if (
            micro is not self._micro[-1]
            or len(self._micro) < int(self.accumulation_steps)
            or len(micro.g[name]) != micro.calls.get(name, 0)
            or (self._reducer is not None and self._reducer.offered(name))
        ):
            return
        required = self.scaling == "fisher" or self._ekfac
        try:
            micro.batch_size = micro.examples.batch_size(required, _WHAT_TO_DO)
        except BatchSizeError:
            return  # step() raises it
        if self._reducer is None:
            self._reducer = start_factor_reduction(self._state, self.plan, self.comm)
        with autocast_off(micro.g[name][0].gram.device.type):
            batch = self._layer_factors(name, spec)
        offer_factors(self._reducer, self._state.layers[name], batch)

    def _grad_scale(self) -> float:
        scaler = self.grad_scaler
        scale = scaler.get_scale() if hasattr(scaler, "get_scale") else scaler()
        return float(scale)

    def remove(self) -> None:
        """Detach every hook and drop collected statistics (call it on every rank: a
        factor reduction already started in the hooks is completed and discarded)."""
        remove_handles(self._handles)
        self._handles = []
        self._watch_handles = []
        self._micro = []
        self._rows = {}
        self._grads_seen = set()
        if self._reducer is not None:
            for name, ls in self._state.layers.items():
                if not self._reducer.offered(name):
                    offer_factors(self._reducer, ls, None)
            self._reducer.finish(lambda name: [])
            self._reducer = None

    def _layer_factors(self, name: str, spec: LayerSpec) -> LayerFactors | None:
        return factors_from_stats(name, self._layer_stats(name, spec), self._state.config)

    def _layer_stats(self, name: str, spec: LayerSpec) -> list[MicroBatchStats]:
        """The layer's statistics of every micro-batch of the window."""
        stats = []
        for mb in self._micro:
            a = mb.a.get(name, [])
            g = mb.g.get(name, [])
            if not self.update_factors_in_hook:
                a, g = call_grams(spec, a, g, self._gram)
            stats.append(MicroBatchStats(a, g, mb.batch_size, self._loss_scale(mb.batch_size)))
        return stats

    def _batch_factors(self) -> dict[str, LayerFactors]:
        """Local factors of the layers whose reduction has not started in the hooks.

        Takes the statistics out of the micro-batches: each layer's are dropped once its
        factors exist (the gradient hooks of the graph, alive as long as the caller's
        loss, hold the micro-batches and must not keep them alive after the step).
        """
        out = {}
        for mb in self._micro:
            mb.last_a = None
        together = grouped_here(getattr(self, "grouped", False), self._state.layers)
        together = together and self.comm.world_size == 1
        stats: dict[str, list[MicroBatchStats]] = {}
        for name, spec in self.layers.items():
            if self._reducer is None or not self._reducer.offered(name):
                if together:  # made below, the layers of one shape together
                    stats[name] = self._layer_stats(name, spec)
                else:
                    factors = self._layer_factors(name, spec)
                    if factors is not None:
                        out[name] = factors
            for mb in self._micro:
                mb.a.pop(name, None)
                mb.g.pop(name, None)
        if together:
            specs = {name: self.layers[name] for name in stats}
            out = build_batch_factors(specs, stats.pop, self._state.config)
        return out


def _has_storage(x: torch.Tensor) -> bool:
    """Whether ``x`` has memory of its own to name (not a tensor of ``torch.func``'s
    transforms or a fake one)."""
    try:
        x.data_ptr()
    except RuntimeError:
        return False
    return True


def remove_handles(handles: list[Any]) -> None:
    for h in handles:
        h.remove()
