"""The state of :class:`~kfac_func.KFAC` in ``torch.optim``'s format: a ``state`` view over
the base optimizers' states, and ``state_dict`` / ``load_state_dict`` that carry the base
optimizers' parts and the preconditioner's (under ``param_groups[0]["kfac"]``, where
``torch.distributed.checkpoint`` keeps it)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, MutableMapping
from typing import Any

import torch

from kfac_func.adapter.fallback import DEMOTED_KEY
from kfac_func.adapter.preconditioner import KFACPreconditioner

__all__ = ["KFAC_KEY", "OptimizerStateMixin"]

KFAC_KEY = "kfac"
"""The key of the preconditioner's state dict in ``state_dict()["param_groups"][0]``."""


class _States(MutableMapping[torch.Tensor, Any]):
    """``optimizer.state`` of :class:`KFAC`: the base optimizers' states read as one mapping
    (each parameter belongs to one base optimizer; an item is written to that one's)."""

    def __init__(
        self, optimizers: list[torch.optim.Optimizer], stepped: Callable[[], bool]
    ) -> None:
        self._optimizers = optimizers
        self._stepped = stepped

    def __bool__(self) -> bool:
        """True once K-FAC has stepped (its factors are state too), or while a base
        optimizer keeps state. ``torch.distributed.checkpoint`` reads an empty state as a
        fresh optimizer and steps it with zero gradients to create one, which must not
        count as a K-FAC step."""
        return self._stepped() or len(self) > 0

    def _owner(self, p: torch.Tensor) -> torch.optim.Optimizer:
        for opt in self._optimizers:
            if p in opt.state:
                return opt
        for opt in self._optimizers:
            if any(q is p for g in opt.param_groups for q in g["params"]):
                return opt
        raise KeyError("the tensor is not a parameter of this optimizer")

    def __getitem__(self, p: torch.Tensor) -> Any:
        return self._owner(p).state[p]

    def __setitem__(self, p: torch.Tensor, value: Any) -> None:
        self._owner(p).state[p] = value

    def __delitem__(self, p: torch.Tensor) -> None:
        del self._owner(p).state[p]

    def __contains__(self, p: object) -> bool:
        return any(p in opt.state for opt in self._optimizers)

    def __iter__(self) -> Iterator[torch.Tensor]:
        for opt in self._optimizers:
            yield from opt.state

    def __len__(self) -> int:
        return sum(len(opt.state) for opt in self._optimizers)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self)} parameters with state)"


class OptimizerStateMixin:
    """``state_dict`` / ``load_state_dict`` of :class:`~kfac_func.KFAC` (a base class: the
    optimizer sets the attributes below).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import kfac_func as kf
        >>> opt = kf.KFAC(nn.Sequential(nn.Linear(4, 3)))
        >>> sorted(opt.state_dict()["param_groups"][0]["kfac"])[:2]
        ['checksums', 'constructed']
    """

    preconditioner: KFACPreconditioner
    _optimizers: list[torch.optim.Optimizer]
    param_groups: list[dict[str, Any]]
    _optimizer_state_dict_pre_hooks: Any
    _optimizer_state_dict_post_hooks: Any
    _optimizer_load_state_dict_pre_hooks: Any
    _optimizer_load_state_dict_post_hooks: Any

    def _follow_parameters(self) -> None:
        raise NotImplementedError

    def _follow_demotions(self) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """``torch.optim``'s ``{"state", "param_groups"}`` over :attr:`param_groups` (the
        base optimizers' state dicts, parameter indices offset in group order), with the
        preconditioner's :meth:`~kfac_func.KFACPreconditioner.state_dict` (its tensors'
        checksums included) as ``param_groups[0]["kfac"]``, and an entry in ``"state"``
        for every parameter (``{}`` where its base optimizer keeps none, as SGD without
        momentum). That is where ``torch.distributed.checkpoint``'s ``get_state_dict`` /
        ``set_state_dict`` keep them: the whole state round-trips through them with their
        default strictness. The state-dict hooks of this optimizer run around it, those of
        the base optimizers inside."""
        self._follow_parameters()
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        state: dict[int, Any] = {}
        groups: list[dict[str, Any]] = []
        offset = 0
        for opt in self._optimizers:
            sd = opt.state_dict()
            state.update({int(k) + offset: v for k, v in sd["state"].items()})
            for g in sd["param_groups"]:
                groups.append({**g, "params": [int(i) + offset for i in g["params"]]})
            offset += sum(len(g["params"]) for g in opt.param_groups)
        for i in range(offset):
            state.setdefault(i, {})
        groups[0][KFAC_KEY] = self.preconditioner.state_dict()
        out: dict[str, Any] = {"state": dict(sorted(state.items())), "param_groups": groups}
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, out)
            if result is not None:
                out = result
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`: the preconditioner's part (decompositions as saved,
        none recomputed; the checksums of its tensors verified), then each base
        optimizer's. The group dicts stay the same objects. A ValueError (before anything
        changes) names a missing ``"kfac"`` part, a group structure that differs from this
        optimizer's, or (a :class:`~kfac_func.checkpoint.CheckpointFormatError`) a K-FAC tensor that
        does not match its checksum. A top-level ``"kfac"`` (the format of earlier
        versions) is read too."""
        self._follow_parameters()
        sd = dict(state_dict)
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, sd)
            if result is not None:
                sd = result
        saved = [dict(g) for g in sd["param_groups"]]
        kfac = sd.get(KFAC_KEY)
        for g in saved:
            part = g.pop(KFAC_KEY, None)
            kfac = part if kfac is None else kfac
        if kfac is None:
            raise ValueError(
                "KFAC.load_state_dict: the state dict has no 'kfac' part (the "
                "preconditioner's, in param_groups[0]): was it saved by another optimizer?"
            )
        demoted = kfac.get(DEMOTED_KEY)
        if demoted:  # layers the saved run left to the other optimizer: their groups too
            self.preconditioner.demote(dict(demoted))
            self._follow_demotions()
        sizes = [len(g["params"]) for g in self.param_groups]
        if [len(g["params"]) for g in saved] != sizes:
            raise ValueError(
                "KFAC.load_state_dict: the state dict's parameter groups have "
                f"{[len(g['params']) for g in saved]} parameters, this optimizer's {sizes}"
            )
        parts: list[dict[str, Any]] = []
        start = 0
        for opt in self._optimizers:
            mine = saved[start : start + len(opt.param_groups)]
            start += len(opt.param_groups)
            ids = [i for g in mine for i in g["params"]]
            local = {i: n for n, i in enumerate(ids)}
            parts.append(
                {
                    "state": {local[i]: v for i, v in sd["state"].items() if i in local and v},
                    "param_groups": [
                        {**g, "params": [local[i] for i in g["params"]]} for g in mine
                    ],
                }
            )
        self.preconditioner.load_state_dict(kfac, compute_inverses=False)
        for opt, part in zip(self._optimizers, parts):
            groups, states = opt.param_groups, opt.state
            opt.load_state_dict(part)
            # keep the dicts that schedulers, wrappers and this optimizer hold
            for old, new in zip(groups, opt.param_groups):
                old.clear()
                old.update(new)
            loaded = dict(opt.state)
            states.clear()
            states.update(loaded)
            opt.param_groups, opt.state = groups, states
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)
