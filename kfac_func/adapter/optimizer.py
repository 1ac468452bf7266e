"""`KFAC`: K-FAC as a ``torch.optim.Optimizer``, for trainers that call only optimizers.

Hugging Face's ``Trainer``, Lightning and accelerate step a ``torch.optim.Optimizer``;
none of them calls a preconditioner between ``backward()`` and ``optimizer.step()``.
:class:`KFAC` is a :class:`~kfac_func.KFACPreconditioner` and base optimizers behind one
optimizer face: ``step(closure)`` runs the closure, preconditions, then steps the base
optimizers. It owns no math (and no optimizer rule of its own): its parameter groups are
the base optimizers' groups (the same dicts), its ``state`` reads theirs, and its
``state_dict`` is theirs in ``torch.optim``'s format plus the preconditioner's under
``"kfac"``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from kfac_func.adapter.arguments import FloatOrFn
from kfac_func.adapter.describe import counted, describe_schedule, describe_step
from kfac_func.adapter.optimizer_state import OptimizerStateMixin, _States
from kfac_func.adapter.parameter_places import ParameterPlaces
from kfac_func.adapter.preconditioner import KFACPreconditioner
from kfac_func.adapter.recipes import Recipe, recipe_named
from kfac_func.adapter.settings import SETTINGS, Settings, settings_from_keywords
from kfac_func.core.hardware import native_bf16

__all__ = ["KFAC"]

OptimizerFactory = Callable[..., torch.optim.Optimizer]
_FIELDS = (*SETTINGS, "convention")  # scaling's alias


class KFAC(OptimizerStateMixin, torch.optim.Optimizer):
    """K-FAC as a ``torch.optim.Optimizer``: a :class:`~kfac_func.KFACPreconditioner` of
    ``model`` in front of base optimizers, for trainers that only call optimizers.

    ``kf.KFAC(model)`` with no other argument is the recommended recipe
    (:data:`kfac_func.RECIPES` ``["recommended"]``, the optimizer race's
    ``kfac-moments-wide``): Adam's step in K-FAC's eigenbasis (``eigenbasis_moments``
    with ``betas`` (0.9, 0.95), no KL clip, ``"fisher"`` scaling, factor statistics every
    step with decay 0.9, every other step with decay 0.81 from step 256, every 4th with
    decay 0.6561 from step 512 (:data:`~kfac_func.adapter.recipes.STATISTICS`),
    eigenbases every 2 steps, then fewer as the run grows long:
    :class:`~kfac_func.step.GrowingInterval`), except on the layers with a factor side
    wider than 512, which take Muon's step on K-FAC's input curvature
    (``Orthogonal(wider_than=512, block=512)``: their A factors, where wider than 512, in
    diagonal blocks of at most 512), in front of SGD without momentum, AdamW with the same
    learning rate, betas and weight decay on the parameters K-FAC does not precondition,
    learning rate 0.014, no weight decay. The library chooses the performance switches
    (layers of one shape computed together, batched decompositions, ``sync_free`` on one
    CUDA process, and the statistics' products and the orthogonalized step in bfloat16
    where the device multiplies it natively, for float32 models: ``gram_dtype``,
    ``Orthogonal.dtype``). ``recipe="kfac-pytorch"`` is kfac-pytorch's
    recipe instead: its preconditioner defaults (eigen, ``kl_clip=0.001``, its factor
    scaling) in front of plain SGD, AdamW with torch's defaults on the others, learning
    rate 0.001, no switch chosen for the user.

    Any argument given replaces the recipe's. The parameters of the layers K-FAC
    preconditions get ``base`` (default SGD: K-FAC's step is the preconditioned gradient;
    with ``eigenbasis_moments`` the moments are kept by the preconditioner); the others
    (skipped or unsupported modules, tied parameters; see
    :meth:`kfac_func.LayerTable.split_parameters`) get ``others`` (default AdamW). Both
    take ``lr`` unless their kwargs name one. :meth:`step` runs the closure (with
    gradients enabled), then ``preconditioner.step()``, then the decoupled weight decay,
    then each base optimizer's ``step()``, and returns the closure's loss.

    - :attr:`param_groups` are the base optimizers' groups themselves (K-FAC's first):
      learning-rate schedulers drive them, and the preconditioner's ``lr`` (its KL clip's)
      reads ``param_groups[0]["lr"]`` at every step unless ``kfac_lr`` is given. They hold
      the parameters the model holds now (see below).
    - :attr:`state` maps each parameter to its base optimizer's state.
    - :meth:`state_dict` / :meth:`load_state_dict`: the base optimizers' and the
      preconditioner's state, whole through ``torch.distributed.checkpoint`` (see
      :func:`kfac_func.save_dcp`); a resumed run equals an uninterrupted one.
    - :meth:`add_param_group` adds to the ``others`` optimizer (K-FAC's layers are
      registered at construction).
    - A layer that training shows K-FAC cannot precondition is demoted with a warning
      naming it (see :mod:`kfac_func.adapter.fallback`): its parameters move to the
      ``others`` optimizer's first group (a new ``others`` optimizer when there was none,
      which a learning-rate scheduler made before does not drive).
    - ``zero_grad``, step hooks (``register_step_pre_hook``, ...) and state-dict hooks
      are ``torch.optim.Optimizer``'s; the base optimizers' own hooks run in their steps.
    - ``print(opt)`` shows the recipe, the learning rate it was built with and the
      current one, the step in words (read from the preconditioner's settings: see
      :func:`~kfac_func.adapter.describe.describe_step`), when it gathers statistics and
      decomposes, the base optimizers and their parameter counts, then the table of the
      layers K-FAC preconditions
      (``opt.preconditioner.layers``).

    Build it on the model before or after wrapping it in DDP or sharding it with FSDP2
    (``fully_shard``) or tensor parallelism (``parallelize_module``): those two replace
    the module's parameters by DTensor ones, and the optimizer follows them (by name,
    when :attr:`param_groups` is read and at every step) as long as its base optimizers
    keep no state of the old ones; parameters replaced after a step are refused with a
    ValueError naming them, before anything moves.

    Args:
        model: the module whose layers K-FAC preconditions.
        lr: learning rate of both base optimizers (unless their kwargs name one); None:
            the recipe's (0.014 recommended, 0.001 kfac-pytorch).
        recipe: ``"recommended"`` (default), ``"kfac-pytorch"``, or a
            :class:`~kfac_func.Recipe`: the defaults of every other argument.
        betas: ``(β₁, β₂)`` of the eigenbasis moments (``moment_beta1``,
            ``moment_beta2``) and of AdamW on the other parameters; None: the recipe's
            ((0.9, 0.95) recommended; kfac-pytorch: the preconditioner's and AdamW's own).
        weight_decay: decoupled weight decay, AdamW's meaning: ``p ← p − lr·wd·p`` on every
            parameter the optimizer steps (K-FAC's included), before the step; None: the
            recipe's (0 recommended; kfac-pytorch: torch's AdamW default 0.01 on the
            others, none on K-FAC's parameters).
        base: the optimizer class (or factory ``(params, **kwargs)``) of the preconditioned
            parameters.
        base_kwargs: its keyword arguments (``lr`` defaults to ``lr``; with SGD the
            recipe's first: no momentum in the recommended recipe).
        others: the optimizer of the other parameters; None: ``base`` (with
            ``base_kwargs``).
        others_kwargs: its keyword arguments (``lr`` defaults to ``lr``, and for AdamW
            ``betas`` and ``weight_decay`` to the ones above).
        kfac_lr: the preconditioner's ``lr`` (a number or ``step -> value``); None: the
            first group's current learning rate.
        **kfac_kwargs: the other arguments of :class:`~kfac_func.KFACPreconditioner`
            (``damping``, ``skip_layers``, ``factor_update_steps``, ...), replacing the
            recipe's; ``settings=`` (a :class:`~kfac_func.Settings`) replaces the recipe's
            settings value, and the fields of :class:`~kfac_func.Settings` are taken as
            keywords of their own too (``scaling="kfac-pytorch"``,
            ``eigenbasis_moments=False``, ...), each replacing that field alone, without
            the preconditioner's ``DeprecationWarning``: the face reads them as overrides
            of its recipe (a field given both ways is a ValueError).

    Raises:
        ValueError: an unknown recipe, a negative ``lr`` or ``weight_decay``, ``betas``
            outside ``[0, 1)``, ``betas`` together with a different ``moment_beta1`` /
            ``moment_beta2``, an invalid preconditioner argument, or no layer to
            precondition.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import kfac_func as kf
        >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
        <torch._C.Generator object at ...>
        >>> model = nn.Sequential(nn.Embedding(10, 4), nn.Flatten(), nn.Linear(8, 3))
        >>> opt = kf.KFAC(model, skip_layers=["Embedding"])
        >>> [type(o).__name__ for o in opt.optimizers], opt.param_groups[0]["lr"]
        (['SGD', 'AdamW'], 0.014)
        >>> sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5**step)
        >>> x, y = torch.randint(0, 10, (16, 2)), torch.randint(0, 3, (16,))
        >>> def closure():
        ...     opt.zero_grad()
        ...     loss = nn.functional.cross_entropy(model(x), y)
        ...     loss.backward()
        ...     return loss
        >>> loss = opt.step(closure)
        >>> sched.step()
        >>> opt.preconditioner.steps, [g["lr"] for g in opt.param_groups]
        (1, [0.007, 0.007])
        >>> old = kf.KFAC(nn.Linear(4, 2), recipe="kfac-pytorch")  # kfac-pytorch's recipe
        >>> old.preconditioner.kl_clip, old.param_groups[0]["lr"]
        (0.001, 0.001)
    """

    def __init__(
        self,
        model: nn.Module,
        lr: float | None = None,
        *,
        recipe: str | Recipe = "recommended",
        betas: tuple[float, float] | None = None,
        weight_decay: float | None = None,
        base: OptimizerFactory = torch.optim.SGD,
        base_kwargs: Mapping[str, Any] | None = None,
        others: OptimizerFactory | None = torch.optim.AdamW,
        others_kwargs: Mapping[str, Any] | None = None,
        kfac_lr: FloatOrFn | None = None,
        **kfac_kwargs: Any,
    ) -> None:
        self.recipe = recipe_named(recipe)
        """The :class:`~kfac_func.Recipe` whose defaults this optimizer took."""
        r = self.recipe
        lr = _check_number("lr", r.lr if lr is None else lr)
        betas_given = betas is not None
        betas = _check_betas(r.betas if betas is None else betas)
        wd = r.weight_decay if weight_decay is None else weight_decay
        self.weight_decay = None if wd is None else _check_number("weight_decay", wd)
        """The decoupled weight decay (None: the base optimizers' own)."""
        # the settings the user chose: given as keywords, or named in settings=
        user = kfac_kwargs.get("settings")
        named = {"scaling" if k == "convention" else k for k in kfac_kwargs if k in _FIELDS}
        named |= user.named() if isinstance(user, Settings) else set()
        settings = settings_from_keywords(kfac_kwargs, "KFAC", base=r.settings, warn=False)
        kfac_kwargs = {**r.kfac_kwargs, **kfac_kwargs}
        if betas is not None and settings.eigenbasis_moments:
            for key, beta in (("moment_beta1", betas[0]), ("moment_beta2", betas[1])):
                given = getattr(settings, key) if key in named else beta
                if given != beta and betas_given:
                    raise ValueError(
                        f"KFAC: betas={betas} and {key}={given} disagree: give one of them"
                    )
                settings = settings.replace(**{key: given})
        if r.automatic:
            native = _native_bf16(model)
            auto: dict[str, Any] = {"batched_eigh": True, "sync_free": _one_cuda_process(model)}
            if native and _single_precision(model, kfac_kwargs.get("factor_dtype")):
                auto["gram_dtype"] = torch.bfloat16
            settings = settings.replace(**{k: v for k, v in auto.items() if k not in named})
            ortho = settings.orthogonal
            if ortho is not None and ortho.dtype is None and native:
                settings = settings.replace(orthogonal=ortho._replace(dtype=torch.bfloat16))
        base_defaults = dict(r.base_kwargs) if base is torch.optim.SGD else {}
        if base is torch.optim.AdamW and self.weight_decay is not None:
            base_defaults["weight_decay"] = self.weight_decay
        self._base_kwargs = {"lr": lr, **base_defaults, **dict(base_kwargs or {})}
        if others is None:
            others, self._others_kwargs = base, dict(self._base_kwargs)
        else:
            adamw = others in (torch.optim.AdamW, torch.optim.Adam)
            defaults: dict[str, Any] = {"lr": lr}
            if adamw and betas is not None:
                defaults["betas"] = betas
            if others is torch.optim.AdamW and self.weight_decay is not None:
                defaults["weight_decay"] = self.weight_decay
            self._others_kwargs = {**defaults, **dict(others_kwargs or {})}
        self._others_factory: OptimizerFactory = others
        # AdamW decays its own parameters (weight_decay above); the face decays the
        # parameters of any other base optimizer itself (decoupled)
        self._decays = (base is not torch.optim.AdamW, others is not torch.optim.AdamW)
        ref = weakref.ref(self)

        def follow(step: int) -> float:
            opt = ref()
            return float(opt.param_groups[0]["lr"]) if opt is not None else 0.0

        self.preconditioner = KFACPreconditioner(
            model, lr=follow if kfac_lr is None else kfac_lr, settings=settings, **kfac_kwargs
        )
        """The :class:`~kfac_func.KFACPreconditioner` (its ``state``, ``layers``, ``steps``)."""
        mine, rest = self.preconditioner.layers.split_parameters(model)
        self._optimizers: list[torch.optim.Optimizer] = [base(mine, **self._base_kwargs)]
        self._has_others = bool(rest)
        if rest:
            self._optimizers.append(others(rest, **self._others_kwargs))
        self._followed = 0  # demoted parameters moved to the others (see _follow_demotions)
        self._ready = False
        self.built_lr = float(self._optimizers[0].param_groups[0]["lr"])
        """The learning rate K-FAC's parameter group was built with (schedulers and
        ``load_state_dict`` change ``param_groups[0]["lr"]``, not this)."""
        groups = [g for opt in self._optimizers for g in opt.param_groups]
        super().__init__(groups, dict(self._optimizers[0].defaults))
        self._ready = True
        pre = self.preconditioner
        self.state = _States(self._optimizers, lambda: pre.steps > 0)  # type: ignore[assignment]
        self._places = ParameterPlaces(model, (p for g in groups for p in g["params"]))

    @property
    def optimizers(self) -> tuple[torch.optim.Optimizer, ...]:
        """The base optimizers: K-FAC's, then (if any parameter is left) the others'."""
        return tuple(self._optimizers)

    @property
    def kfac_optimizer(self) -> torch.optim.Optimizer:
        """The base optimizer of the parameters K-FAC preconditions."""
        return self._optimizers[0]

    @property
    def others_optimizer(self) -> torch.optim.Optimizer | None:
        """The base optimizer of the other parameters (None when there are none)."""
        return self._optimizers[1] if self._has_others else None

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group to the ``others`` optimizer (made now if there was none); its
        parameters are not preconditioned. A ValueError names a parameter already in a
        group (K-FAC's included)."""
        if not getattr(self, "_ready", True):  # construction: the base groups themselves
            self.param_groups.append(param_group)
            return
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        known = {id(p) for g in self.param_groups for p in g["params"]}
        if any(id(p) in known for p in params):
            raise ValueError(
                "KFAC.add_param_group: some parameters appear in more than one parameter "
                "group (the K-FAC layers' parameters are in param_groups[0] already)"
            )
        group = {**param_group, "params": params}
        self._places.add(params)
        if self._has_others:
            others = self._optimizers[1]
            others.add_param_group(group)
        else:
            kwargs = {**self._others_kwargs, **{k: v for k, v in group.items() if k != "params"}}
            others = self._others_factory(params, **kwargs)
            self._optimizers.append(others)
            self._has_others = True
        self.param_groups.append(others.param_groups[-1])

    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        """The base optimizers' groups, holding the parameters the model holds now."""
        groups: list[dict[str, Any]] = self.__dict__["_param_groups"]
        if "_places" in self.__dict__:
            self._follow(groups)
        return groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self.__dict__["_param_groups"] = groups

    def _follow(self, groups: list[dict[str, Any]]) -> None:
        """Put the parameters the model holds now in ``groups`` (``fully_shard`` or
        ``parallelize_module`` applied after construction replaced them); a ValueError
        names those that cannot be followed (see
        :class:`~kfac_func.adapter.parameter_places.ParameterPlaces`)."""

        def has_state(p: torch.Tensor) -> bool:
            return any(bool(opt.state.get(p)) for opt in self._optimizers)

        self._places.follow(groups, has_state)

    def _follow_parameters(self) -> None:
        self._follow(self.__dict__["_param_groups"])

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Run ``closure`` (with gradients enabled) if given, precondition the K-FAC
        layers' ``.grad``, step every base optimizer; return the closure's loss.

        The parameters are the ones the model holds now (see :class:`KFAC`). A step with
        every learning rate 0 before K-FAC has seen any statistics (what
        ``torch.distributed.checkpoint`` does to a fresh optimizer to create its state)
        steps the base optimizers only: it moves no parameter, and K-FAC's first step
        stays the first one with statistics."""
        self._follow_parameters()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        pre = self.preconditioner
        idle = pre.steps == 0 and not pre._micro and not pre.reductions_in_flight
        if not (idle and all(float(g.get("lr", 1.0)) == 0.0 for g in self.param_groups)):
            pre.step()
            self._follow_demotions()
        self._decay()
        for opt in self._optimizers:
            opt.step()
        return loss

    def _follow_demotions(self) -> None:
        """Move the parameters of the layers the preconditioner left to the other
        optimizer (:mod:`kfac_func.adapter.fallback`) from K-FAC's base optimizer (its
        groups and state) into the others' first group, or a new others optimizer when
        there was none."""
        demoted = {id(p) for p in self.preconditioner.demoted_parameters}
        if len(demoted) == self._followed:
            return
        self._followed = len(demoted)
        kfac = self._optimizers[0]
        moved: list[torch.Tensor] = []
        for group in kfac.param_groups:
            moved += [p for p in group["params"] if id(p) in demoted]
            group["params"][:] = [p for p in group["params"] if id(p) not in demoted]
        for p in moved:
            kfac.state.pop(p, None)
        if not moved:
            return
        if self._has_others:
            self._optimizers[1].param_groups[0]["params"].extend(moved)
            return
        others = self._others_factory(moved, **self._others_kwargs)
        self._optimizers.append(others)
        self._has_others = True
        self.param_groups.append(others.param_groups[0])

    @torch.no_grad()
    def _decay(self) -> None:
        """The decoupled weight decay, ``p ← p − lr·wd·p``, of the parameters with a
        gradient whose base optimizer does not decay them itself (all but AdamW's)."""
        if not self.weight_decay:
            return
        for i, opt in enumerate(self._optimizers):
            if not self._decays[min(i, 1)]:
                continue
            for group in opt.param_groups:
                factor = 1.0 - float(group["lr"]) * self.weight_decay
                for p in group["params"]:
                    if p.grad is not None:
                        p.mul_(factor)

    def __repr__(self) -> str:
        """The recipe, the learning rate it was built with and the current one, the step
        in words (:func:`~kfac_func.adapter.describe.describe_step`), its schedule
        (:func:`~kfac_func.adapter.describe.describe_schedule`), where the parameters go,
        then the table of the layers (``opt.preconditioner.layers``)."""
        table = self.preconditioner.layers
        kfac = sum(len(g["params"]) for g in self._optimizers[0].param_groups)
        where = (
            f"K-FAC preconditions {counted(len(table), 'layer')}: "
            f"{type(self._optimizers[0]).__name__} on their {counted(kfac, 'parameter')}"
        )
        if self._has_others:
            n = sum(len(g["params"]) for g in self._optimizers[1].param_groups)
            where += f"; {type(self._optimizers[1]).__name__} on {counted(n, 'other parameter')}"
        head = (
            f"{type(self).__name__}(recipe={self.recipe.name!r}, lr={self.built_lr:g}, "
            f"current lr={float(self.param_groups[0]['lr']):g})"
        )
        step, when = describe_step(self.preconditioner), describe_schedule(self.preconditioner)
        return f"{head}\n  step: {step}\n  schedule: {when}\n  {where}\n{table}"


def _check_number(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"KFAC: {name} must be a number, got {value!r}")
    if not value >= 0:
        raise ValueError(f"KFAC: {name} must be >= 0, got {value!r}")
    return float(value)


def _check_betas(betas: tuple[float, float] | None) -> tuple[float, float] | None:
    if betas is None:
        return None
    ok = isinstance(betas, (tuple, list)) and len(betas) == 2
    if not ok or not all(isinstance(b, (int, float)) and 0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"KFAC: betas must be two numbers in [0, 1), got {betas!r}")
    return (float(betas[0]), float(betas[1]))


def _native_bf16(model: nn.Module) -> bool:
    """Whether the device of ``model``'s parameters multiplies bfloat16 natively
    (:func:`~kfac_func.core.hardware.native_bf16`), where Muon's iteration runs in
    bfloat16 at about twice float32's speed.

    Example:
        >>> isinstance(_native_bf16(nn.Linear(2, 2)), bool)
        True
    """
    p = next(model.parameters(), None)
    return p is not None and native_bf16(p.device)


def _single_precision(model: nn.Module, factor_dtype: torch.dtype | None) -> bool:
    """Whether the factors of ``model`` are float32 (its weights float32 or narrower, no
    wider ``factor_dtype`` asked for): where the statistics' products may take bfloat16
    operands (a float64 run asks for float64 arithmetic throughout).

    Example:
        >>> narrow, wide = nn.Linear(2, 2), nn.Linear(2, 2).double()
        >>> _single_precision(narrow, None), _single_precision(wide, None)
        (True, False)
    """
    p = next(model.parameters(), None)
    wide = p is not None and p.dtype == torch.float64
    return not wide and factor_dtype in (None, torch.float32)


def _one_cuda_process(model: nn.Module) -> bool:
    """Whether ``model`` is on a CUDA device and trained by one process (``sync_free``
    then saves the host synchronisations of every step)."""
    on_cuda = any(p.is_cuda for p in model.parameters())
    distributed = (
        torch.distributed.is_available()
        and torch.distributed.is_initialized()
        and torch.distributed.get_world_size() > 1
    )
    return on_cuda and not distributed
