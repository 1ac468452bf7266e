"""`KFACPreconditioner`: a stateful drop-in for kfac-pytorch's preconditioner.

Forward hooks (and gradient hooks on each call's output) collect each registered layer's
statistics during the forward and backward passes: Gram matrices at once with
``update_factors_in_hook``, else the raw tensors until ``step()``. ``step()`` hands them
to :func:`kfac_func.step.update` on one process (donating its state to it, see
:meth:`KFACPreconditioner.step`) or to :func:`kfac_func.update_distributed` across
ranks, and rewrites ``.grad`` in place. The adapter owns no math and keeps one immutable
:class:`KFACState`, exposed as :attr:`KFACPreconditioner.state`.
"""

from __future__ import annotations

import enum
import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
from torch import nn

from kfac_func.blocks import Gram, LayerSpec, Rows, a_gram, g_gram, register
from kfac_func.core.decomposition import EigenDecomposition, InverseDecomposition, all_finite
from kfac_func.distributed.communicator import Communicator, OrderedReducer
from kfac_func.distributed.kaisa import offer_factors, start_factor_reduction, update_distributed
from kfac_func.distributed.plan import AssignmentStrategy, DistributedStrategy, make_plan
from kfac_func.state import KFACState, LayerState, init
from kfac_func.step.accumulate import MicroBatchStats, factors_from_stats
from kfac_func.step.decompose import redecompose
from kfac_func.step.update import update

__all__ = ["ComputeMethod", "KFACPreconditioner"]

logger = logging.getLogger("kfac_func")

IntOrFn = int | Callable[[int], int]
FloatOrFn = float | Callable[[int], float]


class ComputeMethod(enum.Enum):
    """How the curvature is inverted: eigendecomposition or damped inverses."""

    EIGEN = 1
    INVERSE = 2


def _enum(cls: type[enum.Enum], value: Any, arg: str) -> Any:
    if isinstance(value, cls):
        return value
    if isinstance(value, str) and value.upper() in cls.__members__:
        return cls[value.upper()]
    names = ", ".join(m.lower() for m in cls.__members__)
    raise ValueError(f"{arg} must be one of {names} (or {cls.__name__}), got {value!r}")


def _check_number(name: str, value: Any, ok: Callable[[float], bool], expected: str) -> None:
    if callable(value):
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
        raise ValueError(f"{name} must be {expected}, got {value!r}")


class KFACArguments:
    """kfac-pytorch's preconditioner arguments, validated and stored as attributes (numbers
    may also be ``step -> value`` callables); shared by the preconditioner classes."""

    model: nn.Module
    factor_update_steps: IntOrFn
    inv_update_steps: IntOrFn
    damping: FloatOrFn
    factor_decay: FloatOrFn
    kl_clip: FloatOrFn | None
    lr: FloatOrFn
    accumulation_steps: int
    allreduce_bucket_cap_mb: float
    assignment_strategy: AssignmentStrategy
    compute_method: ComputeMethod
    compute_eigenvalue_outer_product: bool
    symmetry_aware: bool
    grad_scaler: Any
    inv_dtype: torch.dtype
    skip_layers: list[str]
    update_factors_in_hook: bool
    loglevel: int
    scaling: str
    loss_reduction: str

    def _set_arguments(
        self,
        model: nn.Module,
        *,
        factor_update_steps: IntOrFn,
        inv_update_steps: IntOrFn,
        damping: FloatOrFn,
        factor_decay: FloatOrFn,
        kl_clip: FloatOrFn | None,
        lr: FloatOrFn,
        accumulation_steps: int,
        allreduce_bucket_cap_mb: float,
        assignment_strategy: AssignmentStrategy | str,
        compute_method: ComputeMethod | str,
        compute_eigenvalue_outer_product: bool,
        symmetry_aware: bool,
        grad_scaler: Any,
        inv_dtype: torch.dtype,
        skip_layers: list[str] | None,
        update_factors_in_hook: bool,
        loglevel: int,
        scaling: str,
        loss_reduction: str,
    ) -> None:
        if allreduce_bucket_cap_mb < 0:
            raise ValueError("allreduce_bucket_cap_mb must be >= 0")
        method = _enum(ComputeMethod, compute_method, "compute_method")
        strategy = _enum(AssignmentStrategy, assignment_strategy, "assignment_strategy")
        for name, value in (
            ("factor_update_steps", factor_update_steps),
            ("inv_update_steps", inv_update_steps),
            ("accumulation_steps", accumulation_steps),
        ):
            _check_number(name, value, lambda v: int(v) == v and v > 0, "a positive int")
        _check_number("damping", damping, lambda v: v >= 0, ">= 0")
        _check_number("factor_decay", factor_decay, lambda v: 0 < v <= 1, "in (0, 1]")
        _check_number("lr", lr, lambda v: v >= 0, ">= 0")
        if kl_clip is not None:
            _check_number("kl_clip", kl_clip, lambda v: v > 0, "> 0 (or None to disable)")
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")

        self.model = model
        self.factor_update_steps = factor_update_steps
        self.inv_update_steps = inv_update_steps
        self.damping = damping
        self.factor_decay = factor_decay
        self.kl_clip = kl_clip
        self.lr = lr
        self.accumulation_steps = accumulation_steps
        self.allreduce_bucket_cap_mb = allreduce_bucket_cap_mb
        self.assignment_strategy = strategy
        self.compute_method = method
        self.compute_eigenvalue_outer_product = compute_eigenvalue_outer_product
        self.symmetry_aware = symmetry_aware
        self.grad_scaler = grad_scaler
        self.inv_dtype = inv_dtype
        self.skip_layers = [] if skip_layers is None else list(skip_layers)
        self.update_factors_in_hook = update_factors_in_hook
        self.loglevel = loglevel
        self.scaling = scaling
        self.loss_reduction = loss_reduction


@dataclass
class _MicroBatch:
    """Statistics of one forward/backward (a micro-batch), per layer."""

    batch_size: int
    a: dict[str, list[Any]] = field(default_factory=dict)
    g: dict[str, list[Any]] = field(default_factory=dict)


class KFACPreconditioner(KFACArguments):
    """K-FAC preconditioner for an ``nn.Module``, with kfac-pytorch's arguments and defaults.

    Call :meth:`step` after ``loss.backward()`` and before ``optimizer.step()``: it
    preconditions the gradients of the registered layers in place. Every hyperparameter
    may be a number or a ``step -> value`` callable. ``kl_clip=None`` disables clipping.
    ``scaling`` picks the factor convention (``"kfac-pytorch"``, the default, so tuned
    hyperparameters carry over, or ``"fisher"``); ``loss_reduction`` tells the
    ``"fisher"`` convention how the loss reduces the batch.

    Under DistributedDataParallel (gradients averaged across ranks) the work is spread
    over the ranks by a KAISA plan (``grad_worker_fraction``, ``colocate_factors``,
    ``assignment_strategy``); without a process group it runs on one process. At
    construction the ranks verify that they built the same plan with the same
    hyperparameters (:class:`kfac_func.distributed.communicator.RankMismatchError` on every rank
    otherwise); ``collective_timeout`` bounds each of the preconditioner's collectives.
    ``eigenbasis_refresh="qr"`` replaces the exact eigendecompositions after the first
    by one warm-started QR iteration each (approximate, much cheaper; see
    :func:`kfac_func.core.decomposition.refresh_eigh`).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from kfac_func import KFACPreconditioner
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> pre = KFACPreconditioner(model, damping=0.01)
        >>> loss = model(torch.randn(16, 4)).pow(2).mean()
        >>> loss.backward()
        >>> pre.step()
        >>> opt.step()
        >>> pre.steps
        1
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        factor_update_steps: IntOrFn = 1,
        inv_update_steps: IntOrFn = 1,
        damping: FloatOrFn = 0.001,
        factor_decay: FloatOrFn = 0.95,
        kl_clip: FloatOrFn | None = 0.001,
        lr: FloatOrFn = 0.1,
        accumulation_steps: int = 1,
        allreduce_bucket_cap_mb: float = 25.0,
        assignment_strategy: AssignmentStrategy | str = AssignmentStrategy.COMPUTE,
        colocate_factors: bool = True,
        compute_method: ComputeMethod | str = ComputeMethod.EIGEN,
        compute_eigenvalue_outer_product: bool = True,
        grad_worker_fraction: DistributedStrategy | float = DistributedStrategy.COMM_OPT,
        symmetry_aware: bool = False,
        grad_scaler: Any = None,
        factor_dtype: torch.dtype | None = None,
        inv_dtype: torch.dtype = torch.float32,
        skip_layers: list[str] | None = None,
        update_factors_in_hook: bool = True,
        loglevel: int = logging.DEBUG,
        scaling: str = "kfac-pytorch",
        loss_reduction: str = "mean",
        collective_timeout: timedelta | None = None,
        eigenbasis_refresh: str = "eigh",
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

        self.layers = register(model, self.skip_layers)
        if not self.layers:
            raise ValueError(
                f"no layer of {type(model).__name__} can be preconditioned:\n{self.layers}"
            )
        weight = model.get_parameter(next(iter(self.layers.values())).weight)
        self.factor_dtype = factor_dtype or torch.promote_types(weight.dtype, torch.float32)
        comm_world = Communicator.current_world_size()
        self.plan = make_plan(
            self.layers,
            comm_world,
            grad_worker_fraction=grad_worker_fraction,
            assignment_strategy=self.assignment_strategy,
            colocate_factors=colocate_factors,
            compute_method=self.compute_method.name.lower(),
            compute_eigenvalue_outer_product=compute_eigenvalue_outer_product,
        )
        self.colocate_factors = self.plan.colocate_factors
        self.grad_worker_fraction = self.plan.grad_worker_fraction
        self.distributed_strategy = self.plan.strategy
        # every rank must agree on these, or its collectives would not match the others'
        agreed = ("accumulation_steps", "scaling", "loss_reduction", "factor_dtype")
        settings = {k: getattr(self, k) for k in (*self._HYPER, *agreed)}
        settings.update(
            inv_dtype=inv_dtype,
            symmetry_aware=symmetry_aware,
            eigenbasis_refresh=eigenbasis_refresh,
        )
        self.comm = Communicator(
            self.plan,
            bucket_cap_mb=allreduce_bucket_cap_mb,
            symmetry_aware=symmetry_aware,
            settings=settings,
            timeout=collective_timeout,
        )
        self._state = init(
            self.layers,
            convention=scaling,  # type: ignore[arg-type]
            compute_method=self.compute_method.name.lower(),
            compute_eigenvalue_outer_product=compute_eigenvalue_outer_product,
            factor_dtype=self.factor_dtype,
            inv_dtype=inv_dtype,
            device=weight.device,
            eigenbasis_refresh=eigenbasis_refresh,
        )
        self._micro: list[_MicroBatch] = []
        self._rows: dict[str, list[list[torch.Tensor | None]]] = {}
        self._handles: list[Any] = []
        # with several ranks and update_factors_in_hook, each layer's factor reduction
        # starts in the backward pass, overlapping communication with computation
        self._stream = update_factors_in_hook and self.comm.world_size > 1
        self._reducer: OrderedReducer | None = None
        self._register_hooks()
        logger.log(loglevel, "K-FAC registered layers:\n%s", self.layers)
        logger.log(loglevel, "%s", self.plan)

    # --- hyperparameters ---------------------------------------------------------

    @property
    def steps(self) -> int:
        """Number of :meth:`step` calls so far."""
        return self._state.step

    @property
    def state(self) -> KFACState:
        """The immutable K-FAC state (save it with :func:`kfac_func.save_state`)."""
        return self._state

    @state.setter
    def state(self, value: KFACState) -> None:
        if set(value.layers) != set(self.layers):
            raise ValueError(
                f"state layers {sorted(value.layers)} differ from the preconditioner's "
                f"{sorted(self.layers)}"
            )
        self._state = value

    @property
    def reductions_in_flight(self) -> list[str]:
        """Layers whose factor reduction has started in the backward pass (cleared by
        :meth:`step`); empty on one process or without ``update_factors_in_hook``."""
        if self._reducer is None:
            return []
        return [name for name in self.layers if self._reducer.offered(name)]

    def _value(self, v: Any) -> Any:
        return v(self.steps) if callable(v) else v

    def _collecting(self) -> bool:
        return (
            self.model.training
            and torch.is_grad_enabled()
            and (self.steps % int(self._value(self.factor_update_steps)) == 0)
        )

    # --- hooks -------------------------------------------------------------------

    def _register_hooks(self) -> None:
        # the hooks hold the preconditioner weakly: a preconditioner that is dropped
        # without remove() is still collected, and its hooks are detached then
        ref = weakref.ref(self)

        def pre_hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            pre = ref()
            if pre is not None:
                pre._start_micro_batch(module, args)

        def forward_hook(spec: LayerSpec) -> Callable[..., None]:
            def hook(module: nn.Module, args: tuple[Any, ...], out: Any) -> None:
                pre = ref()
                if pre is not None:
                    pre._on_forward(spec, args, out)

            return hook

        self._handles.append(self.model.register_forward_pre_hook(pre_hook))
        for name, spec in self.layers.items():
            module = self.model.get_submodule(name)
            self._handles.append(module.register_forward_hook(forward_hook(spec)))
        weakref.finalize(self, _remove_handles, self._handles)

    def _start_micro_batch(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if not self._collecting():
            return
        first = next((a for a in args if isinstance(a, torch.Tensor) and a.dim() > 0), None)
        self._micro.append(_MicroBatch(int(first.shape[0]) if first is not None else 1))

    def _keeps_rows(self, spec: LayerSpec) -> bool:
        """Linear layers on one rank keep each call's rows for :meth:`step`: their
        gradient is the rows' product, which preconditions with fewer dense products
        (see :func:`kfac_func.step.update.precondition_layer`)."""
        return (
            spec.block.has_rows
            and self.comm.world_size == 1
            and self.model.training
            and torch.is_grad_enabled()
        )

    def _on_forward(self, spec: LayerSpec, args: tuple[Any, ...], out: Any) -> None:
        collect, keep = self._collecting(), self._keeps_rows(spec)
        if not (collect or keep):
            return
        x = args[0].detach()
        micro = None
        if collect:
            if not self._micro:
                self._micro.append(_MicroBatch(int(x.shape[0]) if x.dim() > 1 else 1))
            micro = self._micro[-1]
            item: Any = x
            if self.update_factors_in_hook:
                # the hook runs inside the user's autocast region: build the Gram in
                # factor_dtype, not in the autocast dtype
                with torch.autocast(x.device.type, enabled=False):
                    item = a_gram(spec, x, self.factor_dtype)
            micro.a.setdefault(spec.name, []).append(item)
        pair: list[torch.Tensor | None] | None = None
        if keep:
            pair = [x, None]
            self._rows.setdefault(spec.name, []).append(pair)
        if isinstance(out, torch.Tensor) and out.requires_grad:
            # a hook on this call's output sees its gradient even when later ops
            # modify the output in place (and needs no input that requires grad)
            out.register_hook(self._grad_hook(spec, micro, pair))  # type: ignore[no-untyped-call]

    def _grad_hook(
        self,
        spec: LayerSpec,
        micro: _MicroBatch | None,
        pair: list[torch.Tensor | None] | None,
    ) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            gy = grad.detach()
            if self.grad_scaler is not None:
                # unscaled, as the gradients are when step() runs (after unscale_)
                gy = gy.to(self.factor_dtype) / self._grad_scale()
            if pair is not None:
                pair[1] = gy
            if micro is None:
                return
            item: Any = gy
            if self.update_factors_in_hook:
                with torch.autocast(gy.device.type, enabled=False):
                    item = g_gram(spec, gy, self.factor_dtype)
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
            or len(micro.g[name]) != len(micro.a.get(name, []))
            or (self._reducer is not None and self._reducer.offered(name))
        ):
            return
        if self._reducer is None:
            self._reducer = start_factor_reduction(self._state, self.plan, self.comm)
        with torch.autocast(micro.g[name][0].gram.device.type, enabled=False):
            batch = self._layer_factors(name, spec)
        offer_factors(self._reducer, self._state.layers[name], batch)

    def _grad_scale(self) -> float:
        scaler = self.grad_scaler
        scale = scaler.get_scale() if hasattr(scaler, "get_scale") else scaler()
        return float(scale)

    # --- step --------------------------------------------------------------------

    def _layer_factors(
        self, name: str, spec: LayerSpec
    ) -> tuple[torch.Tensor, torch.Tensor, float] | None:
        cfg = self._state.config
        stats = []
        for mb in self._micro:
            a = mb.a.get(name, [])
            g = mb.g.get(name, [])
            if not self.update_factors_in_hook:
                a = [a_gram(spec, x, cfg.factor_dtype) for x in a]
                g = [g_gram(spec, r, cfg.factor_dtype) for r in g]
            scale = 1.0 / mb.batch_size if self.loss_reduction == "mean" else 1.0
            stats.append(MicroBatchStats(a, g, mb.batch_size, scale))
        return factors_from_stats(name, stats, cfg)

    def _batch_factors(self) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
        """Local factors of the layers whose reduction has not started in the hooks.

        Takes the statistics out of the micro-batches: each layer's are dropped once its
        factors exist (the gradient hooks of the graph, alive as long as the caller's
        loss, hold the micro-batches and must not keep them alive after the step).
        """
        out = {}
        for name, spec in self.layers.items():
            if self._reducer is None or not self._reducer.offered(name):
                factors = self._layer_factors(name, spec)
                if factors is not None:
                    out[name] = factors
            for mb in self._micro:
                mb.a.pop(name, None)
                mb.g.pop(name, None)
        return out

    def step(self) -> None:
        """Precondition the registered layers' ``.grad`` in place (before ``optimizer.step()``).

        Updates the factors from the statistics collected since the last step (every
        ``factor_update_steps``; all micro-batches of the window form one update) and
        recomputes the decompositions every ``inv_update_steps``.

        On one process the state is donated to :func:`kfac_func.step.update` (``donate=True``),
        so each layer's old factors and decomposition are freed as soon as their
        replacements exist: the step's peak memory holds one state, not two. A state
        obtained from :attr:`state` before the step is not affected (the donated state is
        a copy with its own ``layers`` dict, and layer states are immutable); it keeps the
        old tensors alive for as long as it is held.
        """
        batch = self._batch_factors() if self._micro else {}
        reducer, self._reducer = self._reducer, None
        self._micro = []
        rows = self._take_rows()
        grads: dict[str, torch.Tensor] = {}
        for name, spec in self.layers.items():
            for pname in spec.param_names():
                p = self.model.get_parameter(pname)
                if p.grad is None:
                    raise RuntimeError(
                        f"layer {name!r}: parameter {pname!r} has no gradient; call "
                        "loss.backward() before step()"
                    )
                grads[pname] = p.grad
        update_inverses = self.steps % int(self._value(self.inv_update_steps)) == 0
        if self.comm.world_size == 1 and reducer is None:
            # a copy with a dict of its own, so that a state read from .state earlier
            # keeps its layers; once self._state points at the copy nothing else holds
            # the old layer states. If the step raises, each layer of self._state is as
            # it was or as the step left it.
            donated = self._state.replace(layers=dict(self._state.layers))
            self._state = donated
            new_grads, self._state = update(
                donated,
                grads,
                batch_factors=batch if batch else None,
                rows=rows,
                damping=self.damping,
                factor_decay=self.factor_decay,
                kl_clip=self.kl_clip,
                lr=self.lr,
                update_factors=bool(batch),
                update_inverses=update_inverses,
                donate=True,
            )
        else:
            new_grads, self._state = update_distributed(
                self._state,
                grads,
                plan=self.plan,
                comm=self.comm,
                batch_factors=batch if batch else None,
                factor_reducer=reducer,
                damping=self.damping,
                factor_decay=self.factor_decay,
                kl_clip=self.kl_clip,
                lr=self.lr,
                update_factors=bool(batch) or reducer is not None,
                update_inverses=update_inverses,
                rows=rows,
            )
        with torch.no_grad():
            for pname, g in grads.items():
                if new_grads[pname] is not g:
                    g.copy_(new_grads[pname])

    # --- state -------------------------------------------------------------------

    _HYPER = (
        "factor_update_steps",
        "inv_update_steps",
        "damping",
        "factor_decay",
        "kl_clip",
        "lr",
    )

    def state_dict(self, include_factors: bool = True) -> dict[str, Any]:
        """kfac-pytorch's shape: ``steps``, the non-callable hyperparameters and, with
        ``include_factors``, ``layers: {name: {"A", "G"}}`` (plus this rank's decomposition
        and update counter, so a resumed run is bit-exact)."""
        sd: dict[str, Any] = {"steps": self.steps}
        for key in self._HYPER:
            value = getattr(self, key)
            if not callable(value):
                sd[key] = value
        if include_factors:
            layers = {}
            for name, ls in self._state.layers.items():
                a, g, updates = ls.a_factor, ls.g_factor, ls.factor_updates
                if self.plan.strategy is DistributedStrategy.MEM_OPT and self.comm.world_size > 1:
                    # factors were reduced to their owner only: fetch the current ones
                    # (a collective: every rank calls state_dict, as in kfac-pytorch)
                    count = torch.tensor([float(updates)], dtype=a.dtype, device=a.device)
                    a, g, count = self.comm.broadcast(
                        [a, g, count],
                        src=self.plan.layers[name].a_owner,
                        ranks=tuple(range(self.comm.world_size)),
                        kind="checkpoint",
                    ).wait()
                    updates = int(count.item())
                entry: dict[str, Any] = {"A": a, "G": g, "factor_updates": updates}
                if ls.decomposition is not None:
                    entry["decomposition"] = {
                        k: v
                        for k, v in vars(ls.decomposition).items()
                        if isinstance(v, torch.Tensor)
                    }
                layers[name] = entry
            sd["layers"] = layers
        return sd

    def load_state_dict(self, state_dict: dict[str, Any], compute_inverses: bool = True) -> None:
        """Restore :meth:`state_dict`; decompositions missing from it are recomputed (with
        ``compute_inverses``) on this rank's grad-worker layers, else at the next step."""
        sd = dict(state_dict)
        steps = int(sd.pop("steps"))
        layers_sd = sd.pop("layers", None)
        old = {key: getattr(self, key) for key in self._HYPER}
        for key in self._HYPER:
            if key in sd and not callable(getattr(self, key)):
                setattr(self, key, sd[key])
        layers = dict(self._state.layers)
        try:
            if layers_sd is not None:
                unknown = sorted(set(layers_sd) - set(layers))
                missing = sorted(set(layers) - set(layers_sd))
                if unknown or missing:
                    raise ValueError(
                        f"state_dict layers do not match the model: missing {missing}, "
                        f"unknown {unknown}"
                    )
                for name, entry in layers_sd.items():
                    layers[name] = self._load_layer(layers[name], entry, compute_inverses)
        except Exception:
            for key, value in old.items():  # a refused state dict changes nothing
                setattr(self, key, value)
            raise
        self._state = self._state.replace(layers=layers, step=steps)

    def _load_layer(self, ls: LayerState, entry: dict[str, Any], compute: bool) -> LayerState:
        a_shape, g_shape = ls.spec.factor_shapes
        a, g = entry["A"], entry["G"]
        if tuple(a.shape) != a_shape or tuple(g.shape) != g_shape:
            raise ValueError(
                f"layer {ls.spec.name!r}: state_dict factors have shapes {tuple(a.shape)} and "
                f"{tuple(g.shape)}, expected {a_shape} and {g_shape}"
            )
        for which, f in (("A", a), ("G", g)):
            if not all_finite(f):
                raise ValueError(f"layer {ls.spec.name!r}: state_dict factor {which} holds NaN/Inf")
        cfg = self._state.config
        new = ls.replace(
            a_factor=a.to(cfg.factor_dtype, copy=True).contiguous(),
            g_factor=g.to(cfg.factor_dtype, copy=True).contiguous(),
            factor_updates=int(entry.get("factor_updates", max(1, ls.factor_updates))),
            decomposition=None,
        )
        dec = entry.get("decomposition")
        if dec is not None:
            kind = type(ls.decomposition) if ls.decomposition is not None else None
            cls = kind or _decomposition_class(cfg.compute_method)
            fields = {k: v.clone() for k, v in dec.items()}
            return new.replace(decomposition=cls(**fields))
        if compute and self.comm.rank in self.plan.layers[ls.spec.name].grad_workers:
            lam = self._value(self.damping)
            return redecompose(new, lam, cfg)
        return new

    # --- housekeeping ------------------------------------------------------------

    def memory_usage(self) -> dict[str, int]:
        """Bytes held, per category, and their total."""

        def nbytes(t: Any) -> int:
            if isinstance(t, Gram):
                t = t.gram
            return int(t.numel() * t.element_size()) if isinstance(t, torch.Tensor) else 0

        usage = {"a_factors": 0, "g_factors": 0, "decompositions": 0, "hook_buffers": 0}
        for ls in self._state.layers.values():
            usage["a_factors"] += nbytes(ls.a_factor)
            usage["g_factors"] += nbytes(ls.g_factor)
            if ls.decomposition is not None:
                usage["decompositions"] += sum(nbytes(v) for v in vars(ls.decomposition).values())
        for mb in self._micro:
            for items in (*mb.a.values(), *mb.g.values()):
                usage["hook_buffers"] += sum(nbytes(i) for i in items)
        usage["total"] = sum(usage.values())
        return usage

    def remove(self) -> None:
        """Detach every hook and drop collected statistics (call it on every rank: a
        factor reduction already started in the hooks is completed and discarded)."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self._micro = []
        self._rows = {}
        if self._reducer is not None:
            for name, ls in self._state.layers.items():
                if not self._reducer.offered(name):
                    offer_factors(self._reducer, ls, None)
            self._reducer.finish(lambda name: [])
            self._reducer = None

    def __repr__(self) -> str:
        hyper = ", ".join(f"{k}={getattr(self, k)!r}" for k in self._HYPER)
        return (
            f"KFACPreconditioner({len(self.layers)} layers, {hyper}, "
            f"accumulation_steps={self.accumulation_steps}, "
            f"compute_method={self.compute_method.name.lower()}, "
            f"distributed_strategy={self.distributed_strategy.name}, scaling={self.scaling!r})"
        )


def _remove_handles(handles: list[Any]) -> None:
    for h in handles:
        h.remove()


def _decomposition_class(method: str) -> Any:
    return EigenDecomposition if method == "eigen" else InverseDecomposition
