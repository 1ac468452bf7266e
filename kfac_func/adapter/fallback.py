"""Layers a preconditioner leaves to the other optimizer once training shows that K-FAC
cannot precondition them.

Registration decides from the model's classes; some facts show only when the model runs:

- a module recognised by its kind whose first call does not compute what the kind
  computes (a subclass that overrides ``forward``; see
  :func:`kfac_func.blocks.checks.check_hooks`): its factors would describe another map;
- a layer whose parameters receive no gradient in a step although others do (a module the
  configuration never calls);
- a layer whose weight receives gradients but whose module calls never reach the hooks on
  a step that collects statistics, while other layers' do (parameters used outside a call
  of their module: Mamba's ``F.conv1d(..., self.conv1d.weight)``, ``dt_proj.weight @``).

Each such layer is *demoted*, with one warning naming it and why: it leaves
:attr:`~kfac_func.KFACPreconditioner.layers` (the table lists it as skipped, with the
reason) and the K-FAC state, its gradients pass :meth:`~kfac_func.KFACPreconditioner.step`
unchanged, and :class:`kfac_func.KFAC` moves its parameters to its other optimizer (AdamW
by default) before that step's update. ``state_dict()`` records the demotions and
``load_state_dict()`` applies them, so a resumed run has the same layers and parameter
groups. On several processes a demotion would change the KAISA plan every rank executes:
there it is a RuntimeError naming the layers (leave them out with ``skip_layers=``).
"""

from __future__ import annotations

import dataclasses
import warnings
import weakref
from collections.abc import Mapping
from typing import Any

from torch import nn

from kfac_func.adapter.compiled import opaque
from kfac_func.adapter.coverage import MissingStatisticsWarning
from kfac_func.adapter.inspection import InspectionMixin
from kfac_func.blocks import LayerTable
from kfac_func.blocks.checks import check_hooks
from kfac_func.distributed.communicator import Communicator
from kfac_func.distributed.plan import Plan

__all__ = ["DEMOTED_KEY", "FallbackMixin", "FallbackWarning"]

DEMOTED_KEY = "demoted"
"""The key of ``{layer: why}`` in a preconditioner's ``state_dict()``."""


class FallbackWarning(UserWarning):
    """A registered layer is left to the other optimizer from now on (its module does not
    compute what its kind computes, or it received no gradient)."""


class FallbackMixin(InspectionMixin):
    """Demotion of registered layers (a base class of
    :class:`~kfac_func.KFACPreconditioner`; see :mod:`kfac_func.adapter.fallback` and the
    example of :meth:`demote`)."""

    layers: LayerTable
    comm: Communicator
    plan: Plan
    _micro: list[Any]
    _rows: dict[str, Any]
    _sharded: bool
    _dropped: set[str]
    _demoted: dict[str, str]
    _refused: dict[str, str]

    def _init_fallback(self) -> None:
        self._dropped = set()
        self._demoted = {}
        self._refused = {}
        self._demoted_parameters: list[nn.Parameter] = []

    @property
    def demoted_parameters(self) -> list[nn.Parameter]:
        """The parameters of the :attr:`demoted` layers, in the order they were demoted
        (what :class:`kfac_func.KFAC` moves to its other optimizer).

        Example:
            >>> import kfac_func as kf
            >>> from torch import nn
            >>> pre = kf.KFACPreconditioner(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)))
            >>> pre.demote({"1": "by hand"})
            >>> [tuple(p.shape) for p in pre.demoted_parameters]
            [(2, 4), (2,)]
        """
        return list(self._demoted_parameters)

    @property
    def demoted(self) -> dict[str, str]:
        """``{layer: why}``: the registered layers left to the other optimizer since the
        preconditioner was built (or restored from a ``state_dict``)."""
        return dict(self._demoted)

    def _check_hooks(self, model: nn.Module) -> list[Any]:
        """The hooks that check the first calls of the modules whose output the layers
        rely on (:func:`~kfac_func.blocks.checks.check_hooks`), refusing a layer whose
        module fails (:meth:`_refuse`); kept out of ``torch.compile``'s graphs, and holding
        the preconditioner weakly, as its other hooks."""
        ref = weakref.ref(self)

        def refuse(layer: str, why: str) -> None:
            pre = ref()
            if pre is not None:
                pre._refuse(layer, why)

        return check_hooks(model, self.layers, refuse=refuse, wrap=opaque)

    def _refuse(self, layer: str, why: str) -> None:
        """A check hook's verdict: ``layer``'s module does not compute what its kind
        computes. Its calls are not recorded from now on; :meth:`step` demotes it."""
        if layer in self._dropped or layer not in self.layers:
            return
        self._dropped.add(layer)
        self._refused[layer] = why
        warnings.warn(
            f"{why}. K-FAC does not precondition layer {layer!r}: its parameters go to the "
            "other optimizer (kf.KFAC's others; with a KFACPreconditioner its gradients "
            "pass step() unchanged)",
            FallbackWarning,
            stacklevel=2,
        )

    def demote(self, layers: Mapping[str, str]) -> None:
        """Leave ``{layer: why}`` to the other optimizer from now on: the layers leave
        :attr:`layers` (listed as skipped, with ``why``) and the state, and :meth:`step`
        passes their gradients unchanged (:class:`kfac_func.KFAC` moves their parameters
        to its other optimizer). Names not registered (or demoted already) are ignored.

        Raises:
            RuntimeError: on several processes (or sharded parameters), where the layers
                are in the plan every rank executes: leave them out with ``skip_layers=``.

        Example:
            >>> from torch import nn
            >>> import kfac_func as kf
            >>> model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
            >>> pre = kf.KFACPreconditioner(model)
            >>> pre.demote({"0": "tried elsewhere"})
            >>> list(pre.layers), pre.demoted
            (['1'], {'0': 'tried elsewhere'})
            >>> print(pre.layers.skipped["0"])
            tried elsewhere
        """
        new = {n: str(why) for n, why in layers.items() if n in self.layers}
        if not new:
            return
        if self.comm.world_size > 1 or getattr(self, "_sharded", False):
            shown = "\n".join(f"  {n}: {why}" for n, why in new.items())
            raise RuntimeError(
                "K-FAC cannot precondition these layers, and on several processes it cannot "
                "leave them to another optimizer during training (every rank executes one "
                f"plan of the layers):\n{shown}\nLeave them out from the start: "
                f"skip_layers={[f'^{n}$' for n in new]!r}"
            )
        for name, why in new.items():
            for pname in self.layers[name].param_names():
                p = self._parameter(pname)
                if all(p is not q for q in self._demoted_parameters):
                    self._demoted_parameters.append(p)
            del self.layers[name]
            self.layers.skipped[name] = why
        self._dropped.update(new)
        self._demoted.update(new)
        kept = {k: v for k, v in self._state.layers.items() if k not in new}
        self._state = self._state.replace(layers=kept)
        # one process: the plan is the list of layers (no rank owns anything else)
        plan = {k: v for k, v in self.plan.layers.items() if k not in new}
        self.plan = self.comm.plan = dataclasses.replace(self.plan, layers=plan)
        for mb in self._micro:
            for part in (mb.a, mb.g, mb.calls):
                for name in new:
                    part.pop(name, None)
        for name in new:
            self._rows.pop(name, None)

    def _fall_back(self, grads_seen: set[str], collecting: bool) -> set[str]:
        """Demote, at the start of :meth:`step`, the layers refused by their first call's
        check, those without a gradient (when others have one), and, on a step that
        collects statistics (``collecting``), those whose weights received gradients
        (``grads_seen``) but no statistics while others got theirs; one warning each.
        Returns the layers of ``grads_seen`` without statistics that stay (no layer got
        statistics: the hooks were bypassed for all, which
        :func:`~kfac_func.adapter.coverage.warn_uncollected` reports)."""
        refused = {n: why for n, why in self._refused.items() if n in self.layers}
        self._refused = {}
        self.demote(refused)
        no_grad: dict[str, list[str]] = {}
        for name, spec in self.layers.items():
            missing = [p for p in spec.param_names() if self._bound[p].grad is None]
            if missing:
                no_grad[name] = missing
        if no_grad and len(no_grad) < len(self.layers):
            whys = {
                name: f"received no gradient in step {self.steps} (parameters {params}; its "
                "module was not called, or its output did not reach the loss)"
                for name, params in no_grad.items()
            }
            warnings.warn(
                f"layers {sorted(no_grad)} received no gradient in step {self.steps} while "
                "the other layers did: K-FAC leaves them to the other optimizer from now on "
                "(kf.KFAC's others; with a KFACPreconditioner their gradients pass step() "
                "unchanged)",
                FallbackWarning,
                stacklevel=4,  # the caller of step()
            )
            self.demote(whys)
        if not collecting:
            return set()
        collected = {name for mb in self._micro for name in mb.g}
        uncollected = {n for n in grads_seen if n in self.layers and n not in collected}
        if not uncollected or not collected:
            return uncollected
        why = (
            f"received gradients and no statistics in step {self.steps}: its parameters are "
            "used outside a call of its module (a functional call on its weight), which "
            "the hooks do not see"
        )
        warnings.warn(
            f"step {self.steps} updates factors, but layers {sorted(uncollected)} received "
            "gradients and no statistics: their parameters are used outside calls of their "
            "modules (as F.conv1d(x, module.weight) or module.weight @ x), which the hooks "
            "do not see. K-FAC leaves them to the other optimizer from now on (kf.KFAC's "
            "others; with a KFACPreconditioner their gradients pass step() unchanged)",
            MissingStatisticsWarning,
            stacklevel=4,  # the caller of step()
        )
        self.demote(dict.fromkeys(sorted(uncollected), why))
        return set()
