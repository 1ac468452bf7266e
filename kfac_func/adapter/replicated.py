"""State dicts of sharded models that ``torch.distributed.checkpoint`` saves and reshards.

``torch.distributed.checkpoint`` (DCP) writes each plain tensor of a state dict once (ranks
holding the same key hold copies of one value) and loads *into* the tensors of a state
dict the new run builds, so both need every rank to name the same tensors. For a model
with DTensor parameters (FSDP2, tensor parallelism) the preconditioner's
:meth:`~kfac_func.KFACPreconditioner.state_dict` therefore gives every rank every layer's
factors (from their owners, as under ``MEM_OPT`` always) and every layer's decomposition
as its first grad worker holds it, with ``"decomposed": 1``; a layer without one yet gets
zeros of the decomposition's shapes and ``"decomposed": 0``. A fresh preconditioner's
state dict is then a template DCP loads into, on any world size; on load each rank keeps
the decompositions of its grad-worker layers only (:func:`entry_for_rank`).

The running moments that the preconditioner's settings keep for each layer (the
eigenbasis moments' ``basis_moment`` and, with
``moment_beta1 > 0``, ``basis_momentum``, with their ``moment_count``, or the
orthogonalized step's ``ortho_momentum`` on the layers taking it; see
:func:`kept_moments`) travel the same way: every layer's, from its first grad worker,
zeros of the gradient matrix's shape where that rank has none yet, and
``"moments_held": {moment: 1 or 0}`` saying which are real. A layer carries only the
moments its own step keeps (a layer on the orthogonalized step no eigenbasis moments):
which those are follows from its spec and the settings, the same on every rank, so the
structure DCP needs is uniform without them. A preconditioner with these settings thus
saves them and its template asks DCP for them (a checkpoint without them is then refused
by ``dcp.load`` as missing keys instead of restarting the moments silently); on load each
rank keeps its grad-worker layers' moments.

The adaptive step (one process) keeps the previous update; its entry
(:func:`adaptive_entry`) holds zeros of the parameters' shapes before the first step and
``"previous_held": 0``, so that a fresh preconditioner's state dict is a template DCP loads
the saved update into (:func:`adaptive_fields` drops what is not held).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from kfac_func.blocks import LayerSpec
from kfac_func.distributed.communicator import Communicator
from kfac_func.distributed.plan import Plan
from kfac_func.state import MOMENT_FIELDS, AdaptiveState, KFACState, LayerState
from kfac_func.step.decompose import decompose_layer
from kfac_func.step.orthogonal import takes_orthogonal

__all__ = [
    "adaptive_entry",
    "adaptive_fields",
    "complete_entries",
    "entry_for_rank",
    "kept_moments",
    "warn_missing_moments",
]


def _fields(
    ls: LayerState, config: Any, made: dict[Any, dict[str, torch.Tensor]] | None = None
) -> dict[str, torch.Tensor]:
    """The decomposition's tensors (this rank's, or zeros of the shapes and layouts a
    decomposition of this layer has under ``config``: those of a decomposition of zero
    factors, made once per kind of layer in ``made``)."""
    dec = ls.decomposition
    if dec is not None:
        return {k: v for k, v in vars(dec).items() if isinstance(v, torch.Tensor)}
    a, g, spec = ls.a_factor, ls.g_factor, ls.spec
    key = (a.shape, g.shape, a.dtype, a.device, spec.diagonal, spec.placeholder)
    made = {} if made is None else made
    if key not in made:
        zero = ls.replace(a_factor=torch.zeros_like(a), g_factor=torch.zeros_like(g))
        dec = decompose_layer(zero, 1.0, config)
        made[key] = {k: v for k, v in vars(dec).items() if isinstance(v, torch.Tensor)}
    return {k: torch.zeros_like(v) for k, v in made[key].items()}


def kept_moments(settings: Any, spec: LayerSpec) -> tuple[str, ...]:
    """The running moments (of :data:`~kfac_func.state.MOMENT_FIELDS`) that a
    preconditioner with these settings keeps for the layer of ``spec``: ``ortho_momentum``
    alone on a layer that takes the orthogonalized step (``orthogonal``, see
    :func:`~kfac_func.step.orthogonal.takes_orthogonal`); on the others ``basis_moment``
    under ``eigenbasis_moments`` and ``basis_momentum`` with ``moment_beta1 > 0`` too.

    Example:
        >>> from types import SimpleNamespace
        >>> from torch import nn
        >>> import kfac_func as kf
        >>> spec = kf.register(nn.Linear(4, 3))[""]
        >>> kept_moments(SimpleNamespace(eigenbasis_moments=True, moment_beta1=0.9), spec)
        ('basis_moment', 'basis_momentum')
        >>> kept_moments(SimpleNamespace(eigenbasis_moments=True,
        ...                              orthogonal=kf.Orthogonal(wider_than=4)), spec)
        ('ortho_momentum',)
    """
    orthogonal = getattr(settings, "orthogonal", None)
    if orthogonal is not None and takes_orthogonal(spec, orthogonal):
        return ("ortho_momentum",)
    if not getattr(settings, "eigenbasis_moments", False):
        return ()
    if float(getattr(settings, "moment_beta1", 0.0)) > 0:
        return ("basis_moment", "basis_momentum")
    return ("basis_moment",)


def _moments(ls: LayerState, moments: Sequence[str]) -> tuple[list[torch.Tensor], list[float]]:
    """This rank's running moments of the layer (zeros where it holds none) and which it
    holds (1.0 or 0.0)."""
    values, held = [], []
    for moment in moments:
        t = getattr(ls, moment)
        held.append(float(t is not None))
        if t is None:
            t = ls.a_factor.new_zeros(ls.spec.matrix_shape)
        values.append(t)
    return values, held


def complete_entries(
    entries: dict[str, dict[str, Any]],
    state: KFACState,
    plan: Plan,
    comm: Communicator,
    settings: Any = None,
) -> None:
    """Give every layer entry (in place) its decomposition and the running moments that
    ``settings`` keep for it (:func:`kept_moments`; None: none) from the layer's first
    grad worker, the ``"decomposed"`` and ``"moments_held"`` markers and the moments'
    count, equal on every rank (a collective: every rank calls it, layers in the plan's
    order). On one process the entries hold the state's own tensors (nothing is copied);
    on several, what the broadcasts return."""
    everyone = tuple(range(comm.world_size))
    made: dict[Any, dict[str, torch.Tensor]] = {}  # zero decompositions, by kind of layer

    def send(values: list[torch.Tensor], src: int) -> list[torch.Tensor]:
        if comm.world_size == 1:
            return values
        return list(comm.broadcast(values, src=src, ranks=everyone, kind="checkpoint").wait())

    for name in plan.layers:
        ls = state.layers[name]
        moments = kept_moments(settings, ls.spec) if settings is not None else ()
        src = plan.layers[name].grad_workers[0]
        fields = _fields(ls, state.config, made)
        kept, held = _moments(ls, moments)
        first = next(iter(fields.values()))
        marks = [float(ls.decomposition is not None), *held, float(ls.moment_count)]
        got = send([torch.tensor(marks, dtype=torch.float64, device=first.device)], src)
        flags = [round(v) for v in got[0].tolist()]
        entry = entries[name]
        decomposition = send(list(fields.values()), src)
        entry["decomposition"] = dict(zip(fields, decomposition, strict=True))
        entry["decomposed"] = flags[0]
        for moment in MOMENT_FIELDS:
            entry.pop(moment, None)  # this rank's own, replaced by the first grad worker's
        entry.pop("moment_count", None)
        if moments:
            for moment, t in zip(moments, send(kept, src), strict=True):
                entry[moment] = t
            entry["moments_held"] = dict(zip(moments, flags[1:-1], strict=True))
            if "basis_moment" in moments:
                entry["moment_count"] = flags[-1]


def entry_for_rank(entry: dict[str, Any], worker: bool) -> dict[str, Any]:
    """A layer entry as this rank loads it: without the ``"decomposed"`` and
    ``"moments_held"`` markers, without the decomposition where its marker is 0 or this
    rank is no grad worker of the layer, and without the moments that are not held or
    that a rank which is no grad worker does not keep. Entries without the markers pass
    as they are.

    Example:
        >>> import torch
        >>> entry = {"A": torch.eye(2), "G": torch.eye(2), "decomposed": 0,
        ...          "decomposition": {}, "basis_moment": torch.zeros(2, 2),
        ...          "moment_count": 0, "moments_held": {"basis_moment": 0}}
        >>> sorted(entry_for_rank(entry, worker=True))
        ['A', 'G']
    """
    if "decomposed" not in entry and "moments_held" not in entry:
        return entry
    out = {k: v for k, v in entry.items() if k not in ("decomposed", "moments_held")}
    if "decomposed" in entry and (not int(entry["decomposed"]) or not worker):
        out.pop("decomposition", None)
    for moment, held in dict(entry.get("moments_held", {})).items():
        if not int(held) or not worker:
            out.pop(moment, None)
            if moment == "basis_moment":
                out.pop("moment_count", None)
    return out


def adaptive_entry(adaptive: AdaptiveState, params: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """The state dict's ``"adaptive"`` entry: the fields of ``adaptive``, its previous
    update (zeros like ``params`` before the first step) and ``"previous_held"``.

    Example:
        >>> import torch
        >>> from kfac_func.state import AdaptiveState
        >>> entry = adaptive_entry(AdaptiveState(damping=0.1), {"w": torch.ones(2)})
        >>> entry["previous"], entry["previous_held"]
        ({'w': tensor([0., 0.])}, 0)
        >>> adaptive_fields(entry)["previous"] is None
        True
    """
    entry = dataclasses.asdict(adaptive)
    entry["previous_held"] = int(adaptive.previous is not None)
    if adaptive.previous is None:
        entry["previous"] = {k: torch.zeros_like(p.detach()) for k, p in params.items()}
    return entry


def adaptive_fields(entry: Any) -> Any:
    """The fields of :class:`~kfac_func.state.AdaptiveState` in an ``"adaptive"`` entry
    (None and entries without the marker pass as they are)."""
    if not isinstance(entry, Mapping) or "previous_held" not in entry:
        return entry
    out = {k: v for k, v in entry.items() if k != "previous_held"}
    if not int(entry["previous_held"]):
        out["previous"] = None
    return out


def warn_missing_moments(
    layers: Mapping[str, Any] | None, moments: Mapping[str, Sequence[str]], steps: int
) -> None:
    """Warn (a RuntimeWarning naming the layers) when a state dict of a run that took
    ``steps > 0`` steps lacks running moments that this rank keeps, ``moments``
    (``{layer this rank preconditions: its moments}``, see :func:`kept_moments`), so that
    they would restart: a state dict saved without them (by a preconditioner without
    these settings, or before they were kept in sharded state dicts). Moments the state
    dict marks as not held yet are no restart.

    Example:
        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as seen:
        ...     warnings.simplefilter("always")
        ...     warn_missing_moments({"0": {"A": None}}, {"0": ("basis_moment",)}, steps=3)
        >>> "restart" in str(seen[0].message)
        True
    """
    if not layers or steps <= 0:
        return
    missing: dict[str, list[str]] = {}
    for name, kept in moments.items():
        entry = layers.get(name, {})
        held = entry.get("moments_held", {})
        for moment in kept:
            if moment not in entry and moment not in held:
                missing.setdefault(moment, []).append(name)
    if missing:
        lines = "; ".join(f"{m} of layers {names}" for m, names in missing.items())
        warnings.warn(
            f"the state_dict (after {steps} steps) holds no {lines}: their running moments "
            "restart from zero (it was saved without them)",
            RuntimeWarning,
            stacklevel=3,
        )
