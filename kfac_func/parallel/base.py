"""The common base of the parts of the parallel preconditioner
(:class:`~kfac_func.parallel.preconditioner.ParallelKFACPreconditioner`).

It declares, once, the attributes that the preconditioner's constructor sets and that the
hook recording (:mod:`kfac_func.parallel.recording`), the step
(:mod:`kfac_func.parallel.stepping`) and the checkpointing
(:mod:`kfac_func.parallel.checkpointing`) read; it holds the record of one micro-batch and
the questions every part asks: the state, and whether this rank owns a layer or is its
primary (the step count and hyperparameter values come from
:class:`~kfac_func.adapter.arguments.PreconditionerBase`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from kfac_func.adapter.arguments import PreconditionerBase
from kfac_func.blocks import LayerSpec, LayerTable
from kfac_func.blocks.examples import CallExamples
from kfac_func.distributed.plan import Plan
from kfac_func.parallel.comm import ParallelCommunicator
from kfac_func.parallel.plan import ParallelPlan, Split
from kfac_func.state import KFACState

__all__ = ["Group", "MicroBatchRecord", "ParallelBase"]

Group = Any


@dataclass
class MicroBatchRecord:
    """One forward/backward (micro-batch): per layer, the captured items (raw tensors,
    or Grams of whole tensors) and whether the raw ones are model-parallel shards;
    ``batch_size`` is set from what the calls say (``examples``) at the step."""

    batch_size: int = 0
    examples: CallExamples = field(default_factory=CallExamples)
    a: dict[str, list[Any]] = field(default_factory=dict)
    g: dict[str, list[Any]] = field(default_factory=dict)
    a_shard: dict[str, bool] = field(default_factory=dict)
    g_shard: dict[str, bool] = field(default_factory=dict)


class ParallelBase(PreconditionerBase):
    """The attributes and the role questions shared by the parts of the parallel
    preconditioner (a base class: the preconditioner's constructor sets the attributes)."""

    factor_checkpoint_dir: str | None
    data_parallel_group: Group
    model_parallel_group: Group
    pipeline_parallel_group: Group
    comm: ParallelCommunicator
    stage: int
    layers: LayerTable
    splits: dict[str, Split | None]
    plan: ParallelPlan
    factor_dtype: torch.dtype
    gram_dtype: torch.dtype | None
    all_specs: dict[str, LayerSpec]
    owner_rank: dict[str, int]
    world_plan: Plan
    _micro: list[MicroBatchRecord]
    _handles: list[Any]

    @property
    def state(self) -> KFACState:
        """This rank's K-FAC state (current for the layers it owns)."""
        return self._state

    def _settle(self) -> None:
        """Set each micro-batch's batch size from what its layers' calls say (see
        :class:`~kfac_func.blocks.examples.CallExamples`; needed with
        ``scaling="fisher"`` only), before the step changes anything."""
        for mb in self._micro:
            mb.batch_size = mb.examples.batch_size(self.scaling == "fisher")

    def _owner(self, name: str) -> bool:
        lp = self.plan.layers[name]
        return (self.comm.dp_rank, self.comm.mp_rank) == (lp.owner_data, lp.owner_model)

    def _primary(self, name: str) -> bool:
        return self.comm.mp_rank == self.plan.layers[name].owner_model
