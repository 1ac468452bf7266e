"""`KFACPreconditioner`: a stateful drop-in for kfac-pytorch's preconditioner.

The hooks of :mod:`kfac_func.adapter.recording` collect each registered layer's
statistics during the forward and backward passes. ``step()`` hands them
to :func:`kfac_func.update` on one process (donating its state to it, see
:meth:`KFACPreconditioner.step`) or to :func:`kfac_func.distributed.update_distributed` across
ranks, and rewrites ``.grad`` in place. The adapter owns no math and keeps one immutable
:class:`KFACState`, exposed as :attr:`KFACPreconditioner.state`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from typing_extensions import Unpack  # typing.Unpack is Python 3.11's

from kfac_func.adapter.adaptive import check_adaptive
from kfac_func.adapter.arguments import (
    HYPER,
    ComputeMethod,
    SharedArguments,
    log_registered,
    shares_arguments,
)
from kfac_func.adapter.checkpointing import StateDictMixin
from kfac_func.adapter.compiled import uncompiled
from kfac_func.adapter.fallback import FallbackMixin
from kfac_func.adapter.grads import copy_back
from kfac_func.adapter.inspection import InspectionMixin
from kfac_func.adapter.parameter_places import FollowParametersMixin
from kfac_func.adapter.recording import HookRecorder
from kfac_func.adapter.sync_free import SyncFreeMixin
from kfac_func.adapter.wrapped_names import unwrapped
from kfac_func.blocks import register
from kfac_func.blocks.table import no_layers_error
from kfac_func.distributed.communicator import AllreduceMethod, Communicator
from kfac_func.distributed.dtensor import (
    check_packed_parameters,
    describe_parameters,
    is_dtensor,
)
from kfac_func.distributed.plan import DistributedStrategy, make_plan
from kfac_func.distributed.sharded import release_unowned
from kfac_func.distributed.step import update_distributed
from kfac_func.state import KFACState
from kfac_func.step.adaptive import AdaptiveInfo, init_adaptive
from kfac_func.step.basis import BasisMoments
from kfac_func.step.orthogonal import orthogonal_table

__all__ = ["AllreduceMethod", "ComputeMethod", "KFACPreconditioner"]


class KFACPreconditioner(
    HookRecorder,
    StateDictMixin,
    SyncFreeMixin,
    FallbackMixin,
    InspectionMixin,
    FollowParametersMixin,
):
    """K-FAC preconditioner for an ``nn.Module``, with kfac-pytorch's arguments and defaults.

    Call :meth:`step` after ``loss.backward()`` and before ``optimizer.step()``: it
    preconditions the ``.grad`` of the registered layers in place. Under DDP the work is
    spread over the ranks by a KAISA plan (:attr:`plan`), after the ranks checked that they
    agree on it (:class:`kfac_func.distributed.RankMismatchError` otherwise). It takes
    kfac-pytorch 0.4.2's arguments, with its defaults and checks (the keywords of
    :class:`~kfac_func.adapter.SharedArguments`, ``**shared``, documented there), and
    everything kfac-pytorch does not have as one :class:`~kfac_func.Settings` value,
    ``settings=`` (a field given as a keyword of its own still works, with a
    ``DeprecationWarning``). Every hyperparameter may be a number or a ``step -> value``
    callable. Its own:

    Args:
        model: the module (under DDP, its wrapper); its layers are registered with
            :func:`kfac_func.register` (``print(pre.layers)``). ``torch.compile(model)``
            may be passed, or compiled later: the layers are those of the eager module,
            with its names (see :mod:`kfac_func.adapter.compiled`).
        colocate_factors: decompose a layer's A and G on one rank; forced on, with a
            warning, for ``MEM_OPT``.
        grad_worker_fraction: fraction of ranks preconditioning each layer, in [0, 1] (0:
            ``1/world``), or a :class:`~kfac_func.distributed.DistributedStrategy` (``COMM_OPT`` 1,
            ``HYBRID_OPT`` 0.5, ``MEM_OPT`` 1/world), kept as :attr:`distributed_strategy`.

    The settings are kept as :attr:`settings` and, field by field, as attributes
    (``pre.eigenbasis_moments``, ``pre.orthogonal``, ...).

    Raises:
        ValueError: an argument out of range (named), no layer to precondition, or a
            combination kfac-pytorch refuses.
        TypeError: a hyperparameter that is neither a number nor a callable, or a
            keyword that is not an argument.

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

    @shares_arguments()
    def __init__(
        self,
        model: nn.Module,
        *,
        colocate_factors: bool = True,
        grad_worker_fraction: DistributedStrategy | float = DistributedStrategy.COMM_OPT,
        **shared: Unpack[SharedArguments],
    ) -> None:
        model = uncompiled(model)  # layers named as in the eager model
        a = self._set_arguments(model, shared)
        s = self.settings
        self.sync_free, self.compile, self.grouped = s.sync_free, s.compile, s.grouped
        self.batched_eigh = s.batched_eigh

        # named as the model's state dict names them (no checkpoint_wrapper prefixes)
        table = register(
            model, self.skip_layers, max_factor_dim=s.max_factor_dim, kfac_approx=s.kfac_approx,
            kinds=s.kinds,
        )  # fmt: skip
        self.layers = unwrapped(table)
        method = self.compute_method.name.lower()
        orthogonal = s.orthogonal
        if orthogonal is not None:  # the skip pattern reads the names without wrappers
            orthogonal = orthogonal.check(method)
            self.layers = orthogonal_table(self.layers, orthogonal, others=s.eigenbasis_moments)
        self.orthogonal = orthogonal
        self.max_factor_dim, self.kfac_approx = s.max_factor_dim, s.kfac_approx
        if s.eigenbasis_moments:
            BasisMoments(s.moment_beta2, s.moment_eps, s.moment_beta1).check(method)
        self.eigenbasis_moments, self.moment_beta1 = s.eigenbasis_moments, s.moment_beta1
        self.moment_beta2, self.moment_eps = s.moment_beta2, s.moment_eps
        self.adaptive = adaptive = s.adaptive
        if not self.layers:
            raise no_layers_error(self.layers, type(model).__name__)
        check_packed_parameters(model, self.layers)  # the same on every rank: no collective
        weight = model.get_parameter(next(iter(self.layers.values())).weight)
        self.factor_dtype = a["factor_dtype"] or torch.promote_types(weight.dtype, torch.float32)
        comm_world = Communicator.current_world_size()
        self.plan = make_plan(
            self.layers,
            comm_world,
            grad_worker_fraction=grad_worker_fraction,
            assignment_strategy=self.assignment_strategy,
            colocate_factors=colocate_factors,
            compute_method=self.compute_method.name.lower(),
            compute_eigenvalue_outer_product=self.compute_eigenvalue_outer_product,
        )
        check_adaptive(adaptive, model, self.kl_clip, comm_world)
        self.colocate_factors = self.plan.colocate_factors
        self.grad_worker_fraction = self.plan.grad_worker_fraction
        # a strategy asked by name is kept (MEM_OPT on one rank, whose plan is also
        # COMM_OPT's); a fraction is described by the plan it gives
        self.distributed_strategy = (
            grad_worker_fraction
            if isinstance(grad_worker_fraction, DistributedStrategy)
            else self.plan.strategy
        )
        # every rank must agree on these, or its collectives would not match the others'
        agreed = (
            *("accumulation_steps", "scaling", "loss_reduction", "loss_divisor"),
            *("factor_dtype", "inv_dtype", "symmetry_aware"),
        )
        values = {k: getattr(self, k) for k in (*HYPER, *agreed)}
        values.update(
            bucket_cap_mb=self._bucket_cap_mb,
            eigenbasis_refresh=s.eigenbasis_refresh,
            max_factor_dim=s.max_factor_dim,
            kfac_approx=s.kfac_approx,
            eigenbasis_moments=(s.eigenbasis_moments, s.moment_beta2, s.moment_eps, s.moment_beta1),
            orthogonal=orthogonal,
            # FSDP2 / tensor parallelism: every rank must see the same meshes and placements
            parameters=describe_parameters(model, self.layers),
        )
        self.comm = Communicator(
            self.plan,
            bucket_cap_mb=self._bucket_cap_mb,
            symmetry_aware=self.symmetry_aware,
            settings=values,
            timeout=s.collective_timeout,
        )
        self._state = self._first_state(weight.device, eigenbasis_refresh=s.eigenbasis_refresh)
        # sharded models under MEM_OPT hold factors only for the layers each rank owns
        self._sharded = any(is_dtensor(p) for p in model.parameters())
        self._state = release_unowned(self._state, self.plan, self.comm.rank, self._sharded)
        self.last_adaptive: AdaptiveInfo | None = None
        """What the latest adaptive step computed (learning rate, momentum, model change)."""
        if adaptive is not None:
            self._state = init_adaptive(self._state, damping=float(self._value(self.damping)))
        self._micro = []
        self._rows = {}
        self._handles = []
        self._parameter_modules: dict[str, tuple[nn.Module, str]] = {}
        # the parameters the model held at construction: step() notices replaced ones
        self._bound = self._layer_parameters()
        self._damping_checked = False
        # with several ranks and update_factors_in_hook, each layer's factor reduction
        # starts in the backward pass, overlapping communication with computation
        self._stream = self.update_factors_in_hook and self.comm.world_size > 1 and not self._ekfac
        self._reducer = None
        self._init_fallback()
        self._register_hooks()
        self._handles += self._check_hooks(model)  # first calls (kfac_func.blocks.checks)
        log_registered(self.loglevel, model, self.layers, self.plan)

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

    def step(
        self,
        *,
        inputs: Any = None,
        loss: torch.Tensor | float | None = None,
        loss_closure: Callable[[], torch.Tensor | float] | None = None,
        kwargs: dict[str, Any] | None = None,
    ) -> None:
        """Precondition the registered layers' ``.grad`` in place (before ``optimizer.step()``).

        Updates the factors from the statistics collected since the last step (every
        ``factor_update_steps``; all micro-batches of the window form one update) and
        recomputes the decompositions every ``inv_update_steps``.

        With ``adaptive=`` (an :class:`~kfac_func.adapter.adaptive.AdaptiveStepper`), the
        step also *updates the preconditioned parameters itself*: by the learning rate and
        momentum that minimise the quadratic model of this batch (exact curvature products
        through the model called on ``inputs``, and ``kwargs``), and it adapts the damping
        from ``loss`` (this batch's loss before the update) and ``loss_closure`` (the same
        batch's loss at the current parameters, called once every few steps): see
        :func:`kfac_func.step.adaptive_step`. Step an optimizer only over the other parameters
        then (:meth:`kfac_func.LayerTable.split_parameters`).

        On one process the state is donated to :func:`kfac_func.update` (``donate=True``),
        so each layer's old factors and decomposition are freed as soon as their
        replacements exist: the step's peak memory holds one state, not two. A state
        obtained from :attr:`state` before the step is not affected (the donated state is
        a copy with its own ``layers`` dict, and layer states are immutable); it keeps the
        old tensors alive for as long as it is held.
        """
        given = {"inputs": inputs, "loss": loss, "loss_closure": loss_closure}
        if self.adaptive is None and any(v is not None for v in (*given.values(), kwargs)):
            raise ValueError("inputs=, loss=, loss_closure= and kwargs= need adaptive=")
        missing = [k for k, v in given.items() if v is None]
        if self.adaptive is not None and missing:
            raise ValueError(f"adaptive steps need {missing} (see KFACPreconditioner.step)")
        self._follow_parameters()  # fully_shard / parallelize_module after construction
        self._settle()
        if not self._check_collected():  # layers that cannot be preconditioned leave
            return
        captures = self._take_captures() if self._ekfac and self._micro else None
        batch = self._batch_factors() if self._micro and captures is None else {}
        reducer, self._reducer = self._reducer, None
        self._micro = []
        rows = self._take_rows()
        grads = self._layer_grads()
        update_inverses = self.steps % int(self._value(self.inv_update_steps)) == 0
        damping: Any = self.damping
        raw: dict[str, torch.Tensor] = {}
        if self._state.adaptive is not None:
            damping = self._state.adaptive.damping
            raw = {k: g.clone() for k, g in grads.items()}
        factors_now = bool(batch) or reducer is not None or captures is not None
        options = self._step_options(
            damping=damping, update_factors=factors_now, update_inverses=update_inverses
        )
        check = factors_now and self._damping_judged()
        if self.comm.world_size == 1 and reducer is None and not self._sharded:
            # a copy with a dict of its own, so that a state read from .state earlier
            # keeps its layers; once self._state points at the copy nothing else holds
            # the old layer states. If the step raises, each layer of self._state is as
            # it was or as the step left it.
            donated = self._state.replace(layers=dict(self._state.layers))
            self._state = donated
            new_grads, self._state = self._stepper()(
                donated,
                grads,
                captures=captures,
                batch_factors=batch if batch else None,
                rows=rows,
                donate=True,
                options=options,
            )
        else:
            new_grads, self._state = update_distributed(
                self._state,
                grads,
                plan=self.plan,
                comm=self.comm,
                captures=captures,
                batch_factors=batch if batch else None,
                factor_reducer=reducer,
                rows=rows,
                options=options,
            )
        copy_back(grads, new_grads)
        if check:
            self._damping_checked = self._warn_if_damping_dominates(float(self._value(damping)))
        if self.adaptive is not None:
            assert loss_closure is not None and loss is not None
            # the extra forward passes (forward-mode products, the closure) run without
            # autograd, which the torch.func transforms do not need, so the hooks, which
            # collect only with gradients enabled, record nothing of them
            with torch.no_grad():
                self._state, self.last_adaptive = self.adaptive.step(
                    self._state,
                    raw,
                    {k: new_grads[k] for k in raw},
                    args=inputs,
                    loss_closure=loss_closure,
                    old_loss=loss,
                    kwargs=kwargs,
                )
