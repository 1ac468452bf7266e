"""kfac-pytorch-shaped state dicts of :class:`KFACPreconditioner`.

``{"steps", <hyperparameters>, "layers": {name: {"A", "G", "factor_updates",
"decomposition"}}, "settings": {...}}``: what :meth:`KFACPreconditioner.state_dict`
returns and :meth:`KFACPreconditioner.load_state_dict` restores. The hyperparameters are
restored (a warning names those that change); the settings that decide what the factors
mean must match (see :mod:`kfac_func.adapter.checkpoint_settings`). Under ``MEM_OPT`` on
several ranks the current factors live on their owners and are fetched with a broadcast.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from kfac_func.adapter.arguments import HYPER, PreconditionerBase
from kfac_func.adapter.checkpoint_settings import (
    hyperparameter_entries,
    load_hyperparameters,
    meaning_settings,
    warn_replaced,
)
from kfac_func.adapter.fallback import DEMOTED_KEY
from kfac_func.adapter.replicated import (
    adaptive_entry,
    adaptive_fields,
    complete_entries,
    entry_for_rank,
    kept_moments,
    warn_missing_moments,
)
from kfac_func.blocks import LayerSpec
from kfac_func.blocks.spec import diagonal_blocks
from kfac_func.blocks.tied import newly_tied
from kfac_func.checkpoint.checksums import CHECKSUMS_KEY, add_checksums, verify_checksums
from kfac_func.checkpoint.lent import lend
from kfac_func.checkpoint.state_format import _COUNTER_DTYPES
from kfac_func.core.attempts import all_finite
from kfac_func.core.decomposition import DECOMPOSITIONS, decomposition_from_fields
from kfac_func.distributed.communicator import Communicator
from kfac_func.distributed.plan import DistributedStrategy, Plan
from kfac_func.distributed.sharded import release_unowned
from kfac_func.state import (
    MOMENT_FIELDS,
    AdaptiveState,
    KFACConfig,
    KFACState,
    LayerState,
)
from kfac_func.step.decompose import redecompose

__all__ = ["StateDictMixin", "blocks_of_whole", "layer_entries", "load_layer"]


def layer_entries(state: KFACState, plan: Plan, comm: Communicator) -> dict[str, dict[str, Any]]:
    """``{name: {"A", "G", "factor_updates"[, "decomposition", running moments]}}`` of every
    layer (this rank's decomposition and moments). Under ``MEM_OPT`` on several ranks the
    factors are reduced to their owner only, so the current ones are broadcast from it: a
    collective, every rank calls it (as every rank calls ``state_dict`` in kfac-pytorch)."""
    layers = {}
    for name, ls in state.layers.items():
        a, g, updates = ls.a_factor, ls.g_factor, ls.factor_updates
        if plan.strategy is DistributedStrategy.MEM_OPT and comm.world_size > 1:
            count = torch.tensor([float(updates)], dtype=a.dtype, device=a.device)
            a, g, count = comm.broadcast(
                [a, g, count],
                src=plan.layers[name].a_owner,
                ranks=tuple(range(comm.world_size)),
                kind="checkpoint",
            ).wait()
            updates = int(count.item())
        entry: dict[str, Any] = {"A": a, "G": g, "factor_updates": updates}
        for moment in MOMENT_FIELDS:  # the grad workers' running moments
            if getattr(ls, moment) is not None:
                entry[moment] = getattr(ls, moment)
        if ls.basis_moment is not None:
            entry["moment_count"] = ls.moment_count
        for counter in _COUNTER_DTYPES:  # sync_free=True counters and decisions
            if getattr(ls, counter) is not None:
                entry[counter] = getattr(ls, counter)
                if counter == "grad_skips":
                    entry["grad_skips_reported"] = ls.grad_skips_reported
        if ls.decomposition is not None:
            entry["decomposition"] = {
                k: v for k, v in vars(ls.decomposition).items() if isinstance(v, torch.Tensor)
            }
        layers[name] = entry
    return layers


def blocks_of_whole(entry: dict[str, Any], spec: LayerSpec) -> dict[str, Any] | None:
    """A layer entry saved while the layer's A factor was whole (checkpoints of the
    recommended recipe before its wide layers' A factors were blocked, or of
    ``Orthogonal(block=None)``), for a layer whose A is now blocked: its A as the diagonal
    blocks of the saved one (exactly the blocked factor the same statistics give), without
    the saved decomposition of the whole A (recomputed from the blocks). None for any
    other entry.

    Example:
        >>> import dataclasses
        >>> from torch import nn
        >>> import kfac_func as kf
        >>> spec = dataclasses.replace(kf.register(nn.Linear(3, 2))[""], diagonal=(False, True),
        ...                            a_blocks=2)
        >>> entry = {"A": torch.eye(4), "G": torch.ones(2), "decomposition": {}}
        >>> sorted(blocks_of_whole(entry, spec)), blocks_of_whole(entry, spec)["A"].shape
        (['A', 'G'], torch.Size([2, 2, 2]))
    """
    a = entry.get("A")
    whole = (*spec.batch_shape, spec.a_dim, spec.a_dim)
    if spec.a_blocks == 1 or not isinstance(a, torch.Tensor) or tuple(a.shape) != whole:
        return None
    out = {k: v for k, v in entry.items() if k != "decomposition"}
    out["A"] = diagonal_blocks(a, spec.a_blocks)
    return out


def load_layer(
    ls: LayerState, entry: dict[str, Any], config: KFACConfig, damping: float | None
) -> LayerState:
    """``ls`` with the factors (and decomposition) of one state-dict entry: the entry's
    own tensors where they are on the layer's device in the state's dtypes (no copy, as
    ``torch.optim``'s ``load_state_dict``: the step never writes into them).

    Shapes and finiteness are checked first (a ValueError names the layer and the factor).
    Without a decomposition in the entry, one is computed with ``damping`` unless it is
    None (the layer then gets one at its next step).
    """
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
    device = ls.a_factor.device  # the model's: a state dict saved elsewhere comes here
    moments: dict[str, Any] = {}
    for moment in MOMENT_FIELDS:
        t = entry.get(moment)
        if t is None:
            continue
        if tuple(t.shape) != tuple(ls.spec.matrix_shape) or not all_finite(t):
            raise ValueError(
                f"layer {ls.spec.name!r}: state_dict {moment} of shape {tuple(t.shape)} must "
                f"be finite and of shape {tuple(ls.spec.matrix_shape)}"
            )
        moments[moment] = t.to(device, config.factor_dtype).contiguous()
    if "basis_moment" in moments:
        moments["moment_count"] = int(entry.get("moment_count", 1))
    for flag, dtype in _COUNTER_DTYPES.items():
        if entry.get(flag) is not None:
            moments[flag] = torch.as_tensor(entry[flag]).to(device, dtype, copy=True).reshape(())
    if "grad_skips" in moments:
        moments["grad_skips_reported"] = int(entry.get("grad_skips_reported", 0))
    new = ls.replace(
        a_factor=a.to(device, config.factor_dtype).contiguous(),
        g_factor=g.to(device, config.factor_dtype).contiguous(),
        factor_updates=int(entry.get("factor_updates", max(1, ls.factor_updates))),
        decomposition=None,
        **moments,
    )
    dec = entry.get("decomposition")
    if dec is not None:
        kind = type(ls.decomposition) if ls.decomposition is not None else None
        cls = kind or DECOMPOSITIONS[config.compute_method]
        fields = {k: v.to(device) for k, v in dec.items()}
        return new.replace(decomposition=decomposition_from_fields(cls, fields))
    if damping is not None:
        out = redecompose(new, damping, config)
        if out.usable is not None and out.decomposition is not None:  # checked: applied
            out = out.replace(usable=torch.ones_like(out.usable))
        return out
    return new


def _adaptive_from(
    entry: Any, current: AdaptiveState | None, device: torch.device | None = None
) -> AdaptiveState | None:
    """The adaptive state of a state dict's ``"adaptive"`` entry (``current`` without one;
    a ValueError when only one of the two has an adaptive part)."""
    if (entry is None) != (current is None):
        have = "has" if entry is not None else "has no"
        want = "takes" if current is not None else "does not take"
        raise ValueError(
            f"the state_dict {have} an adaptive part, and this preconditioner {want} "
            "adaptive steps (adaptive=)"
        )
    if entry is None:
        return current
    previous = entry.get("previous")
    if previous is not None:
        previous = {k: v.to(device) for k, v in previous.items()}
    return AdaptiveState.restored(entry, previous)


class StateDictMixin(PreconditionerBase):
    """``state_dict`` / ``load_state_dict`` of :class:`KFACPreconditioner` (a base class:
    the preconditioner sets the attributes below)."""

    plan: Plan
    comm: Communicator
    demote: Callable[[Mapping[str, str]], None]  # kfac_func.adapter.fallback

    def state_dict(self, include_factors: bool = True) -> dict[str, Any]:
        """kfac-pytorch's shape: ``steps``, the non-callable hyperparameters and, with
        ``include_factors``, ``layers: {name: {"A", "G"}}`` (plus this rank's decomposition
        and update counter, so a resumed run is bit-exact); ``settings``: what the factors
        mean (scaling, compute method, eigenbasis moments, factor dtype, layer kinds and
        ``kfac_approx``), checked by :meth:`load_state_dict`; ``checksums``: a digest of
        each tensor.

        The tensors are the state's own (no copy, as ``torch.optim``'s state dicts; the
        step makes new ones rather than writing into them, so the dict keeps its values).
        :func:`kfac_func.load_dcp` loads a checkpoint into fresh tensors in their place
        (see :mod:`kfac_func.checkpoint.lent`); a plain ``dcp.load`` into this dict writes
        the live state, as it writes a ``torch.optim`` optimizer's."""
        sd = hyperparameter_entries(self, meaning_settings(self._state, self.eigenbasis_moments))
        if include_factors:
            sd["layers"] = layer_entries(self._state, self.plan, self.comm)
            # a template DCP loads into: the same tensors on every rank (no collective on
            # one process; several DDP ranks keep their own entries)
            if getattr(self, "_sharded", False) or self.comm.world_size == 1:
                complete_entries(sd["layers"], self._state, self.plan, self.comm, self)
        demoted = getattr(self, "_demoted", None)
        if demoted:  # the layers left to the other optimizer (kfac_func.adapter.fallback)
            sd[DEMOTED_KEY] = dict(demoted)
        if self._state.adaptive is not None:  # the adaptive step's damping and history
            names = {p for ls in self._state.layers.values() for p in ls.spec.param_names()}
            params = {p: self.model.get_parameter(p) for p in sorted(names)}
            sd["adaptive"] = adaptive_entry(self._state.adaptive, params)
        # the state's own tensors, no copy (as torch.optim's state dicts); lent, so that
        # kf.load_dcp loads into fresh ones (kfac_func.checkpoint.lent)
        return add_checksums(lend(sd))  # verified by load_state_dict

    def load_state_dict(self, state_dict: dict[str, Any], compute_inverses: bool = True) -> None:
        """Restore :meth:`state_dict`; decompositions missing from it are recomputed (with
        ``compute_inverses``) on this rank's grad-worker layers, else at the next step.

        The state dict's hyperparameters replace the constructor's non-callable ones (as
        in kfac-pytorch), with one UserWarning naming each value that changes where this
        constructor chose another value than the checkpoint's run was built with
        (resuming the same script, whose scheduler moved a value, is silent). A state
        dict whose ``settings`` (scaling, compute method, ...) differ from this
        preconditioner's is refused with a ValueError naming them; nothing changes then
        (but the layers the saved run left to the other optimizer, which are left here
        first: see :mod:`kfac_func.adapter.fallback`).
        """
        sd = dict(state_dict)
        sd.pop(CHECKSUMS_KEY, None)
        demoted = sd.pop(DEMOTED_KEY, None)
        if demoted:  # the saved run's layers left to the other optimizer: left here too
            verify_checksums(state_dict, "K-FAC state_dict")  # before anything changes
            self.demote(dict(demoted))
        settings = meaning_settings(self._state, self.eigenbasis_moments)
        chosen, old = load_hyperparameters(self, sd, settings)
        layers = dict(self._state.layers)
        try:
            steps = int(sd.pop("steps"))
            layers_sd = sd.pop("layers", None)
            device = next(iter(layers.values())).a_factor.device
            adaptive = _adaptive_from(
                adaptive_fields(sd.pop("adaptive", None)), self._state.adaptive, device
            )
            if layers_sd is not None:
                unknown = sorted(set(layers_sd) - set(layers))
                fresh = newly_tied(layers, layers_sd)  # saved when tied pairs were skipped
                missing = sorted(set(layers) - set(layers_sd) - fresh)
                if unknown or missing:
                    raise ValueError(
                        f"state_dict layers do not match the model: missing {missing}, "
                        f"unknown {unknown}"
                    )
                for name, entry in layers_sd.items():
                    ls = layers[name]
                    worker = self.comm.rank in self.plan.layers[name].grad_workers
                    entry = entry_for_rank(entry, worker)
                    whole = blocks_of_whole(entry, ls.spec)  # saved before A was blocked
                    entry = entry if whole is None else whole
                    compute = worker and (compute_inverses or whole is not None)
                    lam = (
                        self._value(self.damping)
                        if compute and "decomposition" not in entry
                        else None
                    )
                    layers[name] = load_layer(ls, entry, self._state.config, lam)
            verify_checksums(state_dict, "K-FAC state_dict")
        except Exception:
            for key, value in old.items():  # a refused state dict changes nothing
                setattr(self, key, value)
            raise
        mine = [
            n
            for n, lp in self.plan.layers.items()
            if self.comm.rank in lp.grad_workers and n in layers
        ]
        kept = {name: kept_moments(self, layers[name].spec) for name in mine}
        warn_missing_moments(layers_sd, kept, steps)
        self._state = self._state.replace(layers=layers, step=steps, adaptive=adaptive)
        warn_replaced(chosen, old, {key: getattr(self, key) for key in HYPER}, stacklevel=2)
        sharded = getattr(self, "_sharded", False)  # MEM_OPT: only the owned factors stay
        self._state = release_unowned(self._state, self.plan, self.comm.rank, sharded)
