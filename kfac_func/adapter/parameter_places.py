"""Following the parameters a module holds now, by name.

``fully_shard`` (FSDP2) and ``parallelize_module`` (tensor parallelism) replace a module's
parameters by new ``nn.Parameter`` objects holding DTensors. An optimizer built before
keeps the old objects: it would step tensors the model no longer uses, and the model would
not move. :class:`ParameterPlaces` remembers where each parameter of an optimizer's groups
lives in the model (its module and attribute, found by name once) and, before a step,
puts the parameters the modules hold now in the groups' places, or raises a ValueError
naming the parameters it cannot follow: those with optimizer state (it belongs to the old
tensors) and those whose place holds no parameter any more.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kfac_func.adapter.adaptive import check_adaptive
from kfac_func.adapter.coverage import watch_gradients
from kfac_func.distributed.dtensor import check_packed_parameters, is_dtensor
from kfac_func.distributed.sharded import release_unowned

__all__ = ["ParameterPlaces", "Replaced"]


@dataclass(frozen=True)
class Replaced:
    """One parameter that its module replaced: ``params[index]`` is ``old``, the module
    holds ``new`` (None: no parameter)."""

    name: str
    params: list[torch.Tensor]
    index: int
    old: torch.Tensor
    new: nn.Parameter | None


class ParameterPlaces:
    """Where each parameter of some groups lives in ``model``: its name, module and
    attribute (parameters that are not the model's are not followed).

    Example:
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(2, 2))
        >>> groups = [{"params": list(model.parameters())}]
        >>> places = ParameterPlaces(model, model.parameters())
        >>> model[0].weight = nn.Parameter(model[0].weight.detach().clone())
        >>> [r.name for r in places.follow(groups, has_state=lambda p: False)]
        ['0.weight']
        >>> groups[0]["params"][0] is model[0].weight
        True
    """

    def __init__(self, model: nn.Module, params: Iterable[torch.Tensor]) -> None:
        self._model = model
        self._names = {id(p): name for name, p in model.named_parameters()}
        self._places: dict[int, tuple[str, nn.Module, str]] = {}
        self.add(params)

    def add(self, params: Iterable[torch.Tensor]) -> None:
        """Remember the places of ``params`` (those that are parameters of the model)."""
        for p in params:
            name = self._names.get(id(p))
            if name is not None:
                prefix, _, attr = name.rpartition(".")
                self._places[id(p)] = (name, self._model.get_submodule(prefix), attr)

    def replaced(self, groups: Sequence[dict[str, Any]]) -> list[Replaced]:
        """The parameters of ``groups`` whose module now holds another object (not those
        that are DTensors: FSDP2 puts their unsharded forms in the modules for a while)."""
        out = []
        for group in groups:
            params = group["params"]
            for i, p in enumerate(params):
                place = self._places.get(id(p))
                if place is None:
                    continue
                name, module, attr = place
                now = module._parameters.get(attr)
                if now is not p and not is_dtensor(p):
                    out.append(Replaced(name, params, i, p, now))
        return out

    def follow(
        self,
        groups: Sequence[dict[str, Any]],
        has_state: Callable[[torch.Tensor], bool],
        owner: str = "KFAC",
    ) -> list[Replaced]:
        """Put the parameters the modules hold now in the places of those they replaced
        (in the group lists themselves); returns what was replaced.

        Raises a ValueError, changing nothing, naming the parameters whose place holds no
        parameter any more and those for which ``has_state`` is true (an optimizer's state
        of the old tensor cannot be carried to the new one).
        """
        found = self.replaced(groups)
        if not found:
            return found
        gone = [r.name for r in found if r.new is None]
        kept = [r.name for r in found if r.new is not None and has_state(r.old)]
        if gone or kept:
            why = []
            if gone:
                why.append(f"{gone} are no longer parameters of their modules")
            if kept:
                why.append(
                    f"{kept} were replaced after the base optimizers stepped them (their "
                    "state belongs to the old tensors)"
                )
            raise ValueError(
                f"{owner}: the model's parameters {'; '.join(why)}. Apply fully_shard / "
                f"parallelize_module before the first step (or build {owner} after it); "
                "nothing was stepped"
            )
        for r in found:
            assert r.new is not None
            r.params[r.index] = r.new
            place = self._places.pop(id(r.old))
            self._places[id(r.new)] = place
        return found


class FollowParametersMixin:
    """The preconditioner's side of following replaced parameters (a base class of
    :class:`~kfac_func.KFACPreconditioner`, which sets the attributes below).

    The preconditioner reads each registered layer's ``.grad`` through its module at every
    step, so it uses the parameters the model holds now; what it decided from the
    parameters at construction is decided again when they change (:meth:`_follow_parameters`,
    at the start of every step): whether they are DTensors (the step then gathers and
    scatters their shards; under ``MEM_OPT`` each rank keeps its own layers' factors only),
    the check of packed parameters, the refusal of adaptive steps, and the hooks that see
    the weights' gradients.
    """

    model: nn.Module
    layers: Any
    plan: Any
    comm: Any
    adaptive: Any
    _state: Any
    _sharded: bool
    _handles: list[Any]
    _watch_handles: list[Any]
    _bound: dict[str, nn.Parameter]
    _seen_fn: Callable[[], set[str] | None]

    def _parameter(self, name: str) -> nn.Parameter:  # pragma: no cover - InspectionMixin's
        raise NotImplementedError

    def _layer_parameters(self) -> dict[str, nn.Parameter]:
        """The registered layers' parameters in the model now, by name, in layer order."""
        return {p: self._parameter(p) for spec in self.layers.values() for p in spec.param_names()}

    def _follow_parameters(self) -> None:
        """Notice registered layers' parameters that the model replaced since the last
        step (``fully_shard`` or ``parallelize_module`` applied after construction) and
        adapt to them; a ValueError names what cannot be followed. Once the parameters
        are DTensors nothing changes any more (FSDP2 puts their unsharded forms in the
        modules for a while). Afterwards :attr:`_bound` holds the parameters as they are now
        (what the rest of a step reads)."""
        now = self._layer_parameters()
        bound = self._bound.values()
        if len(now) == len(bound) and all(a is b for a, b in zip(now.values(), bound)):
            return
        if not self._sharded and any(is_dtensor(p) for p in now.values()):
            check_packed_parameters(self.model, self.layers)
            if self.adaptive is not None:
                check_adaptive(self.adaptive, self.model, None, self.comm.world_size)
            self._sharded = True
            self._state = release_unowned(self._state, self.plan, self.comm.rank, True)
        if self._handles:  # hooks still attached (not remove()d): watch the new weights
            for h in self._watch_handles:
                h.remove()
                self._handles.remove(h)
            self._watch_handles = watch_gradients(self.model, self.layers, self._seen_fn)
            self._handles += self._watch_handles
        self._bound = now
