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
"""

from __future__ import annotations

from typing import Any

import torch

from kfac_func.distributed.communicator import Communicator
from kfac_func.distributed.plan import Plan
from kfac_func.state import KFACState, LayerState
from kfac_func.step.decompose import decompose_layer

__all__ = ["complete_entries", "entry_for_rank"]


def _fields(ls: LayerState, config: Any) -> dict[str, torch.Tensor]:
    """The decomposition's tensors (this rank's, or zeros of the shapes a decomposition of
    this layer has under ``config``)."""
    dec = ls.decomposition
    if dec is None:
        a, g = ls.a_factor, ls.g_factor
        zero = ls.replace(a_factor=torch.zeros_like(a), g_factor=torch.zeros_like(g))
        dec = decompose_layer(zero, 1.0, config)
        return {k: torch.zeros_like(v) for k, v in vars(dec).items() if isinstance(v, torch.Tensor)}
    return {k: v for k, v in vars(dec).items() if isinstance(v, torch.Tensor)}


def complete_entries(
    entries: dict[str, dict[str, Any]], state: KFACState, plan: Plan, comm: Communicator
) -> None:
    """Give every layer entry (in place) its decomposition from the layer's first grad
    worker and the ``"decomposed"`` marker, equal on every rank (a collective: every rank
    calls it, layers in the plan's order)."""
    everyone = tuple(range(comm.world_size))
    for name in plan.layers:
        ls = state.layers[name]
        src = plan.layers[name].grad_workers[0]
        fields = _fields(ls, state.config)
        first = next(iter(fields.values()))
        have = torch.full((1,), float(ls.decomposition is not None), dtype=first.dtype)
        values = [*fields.values(), have.to(first.device)]
        if comm.world_size > 1:
            values = comm.broadcast(values, src=src, ranks=everyone, kind="checkpoint").wait()
        entries[name]["decomposition"] = {
            k: v.clone() for k, v in zip(fields, values[:-1], strict=True)
        }
        entries[name]["decomposed"] = int(values[-1].item())


def entry_for_rank(entry: dict[str, Any], worker: bool) -> dict[str, Any]:
    """A layer entry as this rank loads it: without the ``"decomposed"`` marker, and
    without the decomposition where the marker is 0 or this rank is no grad worker of the
    layer. Entries without the marker pass as they are."""
    if "decomposed" not in entry:
        return entry
    out = {k: v for k, v in entry.items() if k != "decomposed"}
    if not int(entry["decomposed"]) or not worker:
        out.pop("decomposition", None)
    return out
