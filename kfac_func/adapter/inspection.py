"""What the adapter reads of its model and state besides the step itself: the gradients
of the registered layers, the bytes it holds, and the warning about a damping that drowns
the factors. A mixin of :class:`~kfac_func.adapter.preconditioner.KFACPreconditioner`;
the arithmetic is :mod:`kfac_func.step.diagnostics`'.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from kfac_func.adapter.arguments import PreconditionerBase
from kfac_func.blocks import Gram, LayerTable
from kfac_func.state import MOMENT_FIELDS
from kfac_func.step.diagnostics import DOMINANCE, JUDGE_LIMIT, damping_dominance, judged_at
from kfac_func.step.options import StepOptions
from kfac_func.step.orthogonal import TABLE_SETTINGS

__all__ = ["InspectionMixin"]

# the preconditioner's attributes a step passes on as they are (see _step_options)
_STEP_ATTRS = (
    "factor_decay", "kl_clip", "lr",
    "eigenbasis_moments", "moment_beta2", "moment_eps", "moment_beta1",
    "sync_free", "batched_eigh", "grouped",
)  # fmt: skip


class InspectionMixin(PreconditionerBase):
    """Reads of the model and the state, and the keyword arguments the step passes on,
    for a preconditioner that keeps its state in ``_state`` (a base class: the
    preconditioner sets the attributes below).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import kfac_func as kf
        >>> pre = kf.KFACPreconditioner(nn.Sequential(nn.Linear(4, 3)))
        >>> pre.memory_usage()["a_factors"]  # one 5 x 5 float32 factor (with the bias)
        100
    """

    layers: LayerTable
    _micro: list[Any]
    _damping_checked: bool
    adaptive: Any
    _parameter_modules: dict[str, tuple[nn.Module, str]]
    _bound: dict[str, nn.Parameter]  # (see ParameterPlaces._follow_parameters)
    orthogonal: Any
    sync_free: bool
    distributed_strategy: Any

    def _layer_grads(self) -> dict[str, torch.Tensor]:
        """The ``.grad`` of every registered layer's parameters, by parameter name (a
        RuntimeError names the layer and the parameter without one), as the step found
        them (:meth:`_follow_parameters`)."""
        grads: dict[str, torch.Tensor] = {}
        for name, spec in self.layers.items():
            for pname in spec.param_names():
                p = self._bound[pname]
                if p.grad is None:
                    raise RuntimeError(
                        f"layer {name!r}: parameter {pname!r} has no gradient; call "
                        "loss.backward() before step()"
                    )
                grads[pname] = p.grad
        return grads

    def _damping_judged(self) -> bool:
        """Whether a factor step may judge the damping (once the factors settle, see
        :meth:`_warn_if_damping_dominates`): the adaptive step tunes the damping itself,
        the eigenbasis moments set the step without it, and the judgement reads the
        factors on the host, which a sync-free step does not."""
        return (
            not self._damping_checked
            and self.adaptive is None
            and not self.eigenbasis_moments
            and self.orthogonal is None
            and not self.sync_free
        )

    def _warn_if_damping_dominates(self, damping: float) -> bool:
        """Judge the damping at the factor updates of
        :func:`~kfac_func.step.diagnostics.judged_at`, and warn when it drowns the curvature
        of every layer's running factors, which the step divides by (see
        :func:`~kfac_func.step.diagnostics.damping_dominance`). Returns whether judging is
        over (warned, or past the last update judged)."""
        updates = [ls.factor_updates for ls in self._state.layers.values() if ls.factor_updates]
        k = min(updates, default=0)
        if not judged_at(k):
            return k > JUDGE_LIMIT
        found = damping_dominance(self._state, damping)
        if found is None:
            return k >= JUDGE_LIMIT
        layer, curvature = found
        fix = (
            "pass scaling='fisher' (with loss_reduction=) or a smaller damping"
            if self.scaling == "kfac-pytorch"
            else "lower the damping"
        )
        inverse = self._state.config.compute_method == "inverse"
        what = "each side's mean curvature" if inverse else "the mean curvature"
        rate = (
            "lr / damping² (the inverse method damps A and G each)" if inverse else ("lr / damping")
        )
        warnings.warn(
            f"damping {damping:g} exceeds {what} of every layer's factors more than "
            f"{DOMINANCE:g}-fold (largest: {curvature:.3g}, layer {layer!r}): K-FAC now "
            f"steps as SGD with learning rate {rate}. With scaling={self.scaling!r} on a "
            "loss averaged over many rows (tokens, pixels) the factors shrink with the row "
            f"count; {fix}. (Warned once.)",
            UserWarning,
            stacklevel=3,
        )
        return True

    def _parameter(self, name: str) -> nn.Parameter:
        """The model's parameter ``name``. Its module is looked up once (lookups by dotted
        name are a noticeable part of a small model's step; the hooks hold the modules
        too), the parameter itself every time (it may have been replaced): from the
        module's parameters, where ``getattr`` would find it after a slower search, else
        by ``getattr`` (a parametrized weight, say, which the assertion then refuses)."""
        place = self._parameter_modules.get(name)
        if place is None:
            prefix, _, attr = name.rpartition(".")
            place = self._parameter_modules[name] = (self.model.get_submodule(prefix), attr)
        p = place[0]._parameters.get(place[1])
        if p is None:
            p = getattr(place[0], place[1])
        assert isinstance(p, nn.Parameter), name
        return p

    def memory_usage(self) -> dict[str, int]:
        """Bytes held, per category, and their total: the running factors, the
        decompositions, the running moments (:data:`~kfac_func.state.MOMENT_FIELDS`), the
        orthogonalized step's factor powers (derived from the decompositions, recomputed
        after a load rather than saved) and the statistics the hooks hold until
        :meth:`step`.

        Example:
            >>> import torch
            >>> import kfac_func as kf
            >>> pre = kf.KFACPreconditioner(torch.nn.Linear(3, 2))
            >>> pre.memory_usage()["a_factors"]  # a 4 x 4 factor in float32
            64
        """

        def nbytes(t: Any) -> int:
            if isinstance(t, Gram):
                t = t.gram
            if not isinstance(t, torch.Tensor):
                return 0
            held = 1 if t.numel() and 0 in t.stride() else t.numel()  # released: expanded
            return int(held * t.element_size())

        usage = dict.fromkeys(
            ("a_factors", "g_factors", "decompositions", "moments", "powers", "hook_buffers"), 0
        )
        for ls in self._state.layers.values():
            usage["a_factors"] += nbytes(ls.a_factor)
            usage["g_factors"] += nbytes(ls.g_factor)
            if ls.decomposition is not None:
                usage["decompositions"] += sum(nbytes(v) for v in vars(ls.decomposition).values())
            usage["moments"] += sum(nbytes(getattr(ls, m)) for m in MOMENT_FIELDS)
            if ls.ortho_power is not None:
                usage["powers"] += sum(nbytes(v) for v in vars(ls.ortho_power).values())
        for mb in self._micro:
            for items in (*mb.a.values(), *mb.g.values()):
                usage["hook_buffers"] += sum(nbytes(i) for i in items)
        usage["total"] = sum(usage.values())
        return usage

    def _step_options(self, **this_step: Any) -> StepOptions:
        """The settings of a step (:class:`kfac_func.StepOptions`): the preconditioner's
        attributes as they are now, with ``this_step``'s values (its damping, whether it
        updates the factors and the decompositions)."""
        return StepOptions(
            **{k: getattr(self, k) for k in _STEP_ATTRS}, **self._orthogonal_options(), **this_step
        )

    def _orthogonal_options(self) -> dict[str, Any]:
        """The :class:`kfac_func.StepOptions` fields of :attr:`orthogonal`."""
        o = self.orthogonal
        if o is None:
            return {}
        step = {k: v for k, v in o._asdict().items() if k not in TABLE_SETTINGS}
        return {"orthogonal": True, **{f"ortho_{k}": v for k, v in step.items()}}

    def __repr__(self) -> str:
        return self._repr(
            "KFACPreconditioner",
            "",
            f"accumulation_steps={self.accumulation_steps}",
            f"compute_method={self.compute_method.name.lower()}",
            f"distributed_strategy={self.distributed_strategy.name}",
        )
