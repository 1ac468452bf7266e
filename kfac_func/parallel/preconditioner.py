"""`ParallelKFACPreconditioner`: K-FAC for data × pipeline × tensor-parallel models.

The stateful preconditioner of one pipeline stage (or of a whole model without
pipelining), with kfac-pytorch's arguments plus the three process groups. Forward hooks
and gradient hooks collect each registered layer's inputs and output-gradients;
``step()`` (after the gradients were averaged over the data-parallel ranks, before
``optimizer.step()``) runs, under a :class:`~kfac_func.parallel.plan.ParallelPlan`:

1. in each data-parallel replica, the model-parallel ranks send the *primary* of each
   tensor-parallel layer their shards of its inputs (row-parallel) or output-gradients
   (column-parallel); tensors that every model-parallel rank holds whole travel nowhere;
   the primary builds the replica's batch factors of the full layer;
2. the batch factors of the replicas are summed over the data-parallel group of the
   primaries to the layer's owner, which folds them into its running averages and
   decomposes them (the owner alone holds a layer's current factors, as under KAISA's
   ``MEM_OPT``);
3. the owner gathers the gradient shards of its model-parallel group, preconditions the
   full gradient matrix (bias as the last column), scales it by the kl_clip factor summed
   over every layer of every rank, and sends every model-parallel rank its part back (a
   scatter of the split weight and of a column-parallel bias; a broadcast of a
   row-parallel bias and of replicated layers); each part is then broadcast over the
   data-parallel group, so every replica ends with identical gradients.

The math is that of :mod:`kfac_func.step.update` and :mod:`kfac_func.core.factors` on the full
layer, so the result equals K-FAC on the unsharded model. Megatron's layers do not work
inside ``torch.func``; this path uses autograd hooks only.

The class composes its parts: the hooks that record the statistics
(:mod:`kfac_func.parallel.recording`), the step (:mod:`kfac_func.parallel.stepping`) and
the checkpoints (:mod:`kfac_func.parallel.checkpointing`), on the attributes and role
questions of :mod:`kfac_func.parallel.base`.
"""

from __future__ import annotations

import torch
from torch import nn
from typing_extensions import Unpack  # typing.Unpack is Python 3.11's

from kfac_func.adapter.arguments import (
    ComputeMethod,
    SharedArguments,
    log_registered,
    shares_arguments,
)
from kfac_func.adapter.settings import PARALLEL_SETTINGS
from kfac_func.blocks.checks import check_hooks
from kfac_func.parallel.base import Group
from kfac_func.parallel.checkpointing import ParallelCheckpointing
from kfac_func.parallel.comm import ParallelCommunicator
from kfac_func.parallel.plan import global_plan, make_parallel_plan, register_parallel
from kfac_func.parallel.recording import ParallelHookRecorder
from kfac_func.parallel.splits import ParallelClasses
from kfac_func.parallel.stepping import ParallelStep

__all__ = ["PARALLEL_DEFAULTS", "ParallelArguments", "ParallelKFACPreconditioner"]


class ParallelArguments(SharedArguments, total=False):
    """The keyword arguments of both model-parallel preconditioners: those of
    :class:`~kfac_func.adapter.SharedArguments` and these.

    Attributes:
        data_parallel_group: this rank's data-parallel group (None: no data parallelism).
        model_parallel_group: this rank's tensor (model) parallel group (None: none).
        pipeline_parallel_group: this rank's pipeline group; its rank is the stage.
        factor_checkpoint_dir: with it, ``state_dict()`` writes the factors to one file
            per layer there (:func:`kfac_func.checkpoint.save_factor_dir`; each written by
            the layer's owner) and returns only the step and the hyperparameters, and
            ``load_state_dict()`` reads them back.
        parallel_classes: ``{module class or class name: "column" | "row" | None}`` for
            tensor-parallel linears whose class is not named ``ColumnParallelLinear`` /
            ``RowParallelLinear`` (Transformer Engine's, ...; see
            :func:`~kfac_func.parallel.plan.register_parallel`); a module that looks
            tensor-parallel but is neither raises a ValueError.
    """

    data_parallel_group: Group
    model_parallel_group: Group
    pipeline_parallel_group: Group
    factor_checkpoint_dir: str | None
    parallel_classes: ParallelClasses | None


PARALLEL_DEFAULTS: ParallelArguments = {
    "compute_eigenvalue_outer_product": False,
    "data_parallel_group": None,
    "model_parallel_group": None,
    "pipeline_parallel_group": None,
    "factor_checkpoint_dir": None,
    "parallel_classes": None,
}
"""The defaults of :class:`ParallelArguments` where they are not kfac-pytorch's
preconditioner's (its ``compute_eigenvalue_outer_product``: False, as kfac-pytorch's
GPT-NeoX preconditioner's)."""


class ParallelKFACPreconditioner(ParallelHookRecorder, ParallelStep, ParallelCheckpointing):
    """K-FAC preconditioner for one pipeline stage of a data × model-parallel model.

    It takes the keywords of :class:`ParallelArguments` (``**arguments``, documented
    there): the process groups, and those of
    :class:`~kfac_func.adapter.SharedArguments` with their defaults but
    ``compute_eigenvalue_outer_product=False`` (:data:`PARALLEL_DEFAULTS`, as kfac-pytorch's
    GPT-NeoX preconditioner), ``settings=`` with the fields of
    :data:`~kfac_func.adapter.settings.PARALLEL_SETTINGS` only; ``allreduce_bucket_cap_mb`` and
    ``symmetry_aware`` are accepted for compatibility (each collective here carries one
    layer's tensors); the ``loglevel`` report covers this stage and names the global and
    pipeline rank. Its own:

    Args:
        include_plain_linear: also register the supported layers that are not
            column- or row-parallel (``nn.Linear``, ...); True by default here, False in
            :class:`~kfac_func.parallel.gpt_neox.GPTNeoXKFACPreconditioner`.

    Every rank of the world constructs it at the same point, and calls :meth:`step`,
    :meth:`state_dict` and :meth:`load_state_dict` together (they are collectives).
    Gradients must be averaged over the data-parallel group before :meth:`step`.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from kfac_func.parallel.layers import ColumnParallelLinear, RowParallelLinear
        >>> model = nn.Sequential(ColumnParallelLinear(4, 8, gather_output=False), nn.Tanh(),
        ...                       RowParallelLinear(8, 2, input_is_parallel=True))
        >>> pre = ParallelKFACPreconditioner(model, damping=0.01)  # one process
        >>> model(torch.randn(5, 4)).pow(2).mean().backward()
        >>> pre.step()
        >>> pre.steps, pre.splits
        (1, {'0': 'column', '2': 'row'})
    """

    @shares_arguments(PARALLEL_DEFAULTS, ParallelArguments)
    def __init__(
        self,
        model: nn.Module,
        *,
        include_plain_linear: bool = True,
        **arguments: Unpack[ParallelArguments],
    ) -> None:
        data_parallel_group = arguments.pop("data_parallel_group", None)
        model_parallel_group = arguments.pop("model_parallel_group", None)
        pipeline_parallel_group = arguments.pop("pipeline_parallel_group", None)
        factor_checkpoint_dir = arguments.pop("factor_checkpoint_dir", None)
        parallel_classes = arguments.pop("parallel_classes", None)
        a = self._set_arguments(model, arguments, PARALLEL_DEFAULTS, PARALLEL_SETTINGS)
        if self.compute_method is ComputeMethod.EKFAC:
            raise ValueError(
                "compute_method='ekfac' is not supported by the model-parallel "
                "preconditioner (its per-example statistics are not gathered across shards)"
            )
        self.factor_checkpoint_dir = factor_checkpoint_dir
        self.data_parallel_group = data_parallel_group
        self.model_parallel_group = model_parallel_group
        self.pipeline_parallel_group = pipeline_parallel_group

        self.comm = ParallelCommunicator(data_parallel_group, model_parallel_group)
        pipe = ParallelCommunicator(pipeline_parallel_group, None)
        self.stage = pipe.dp_rank
        self.include_plain_linear = include_plain_linear
        self.layers, self.splits = register_parallel(
            model,
            self.comm.mp_size,
            self.skip_layers,
            include_plain=include_plain_linear,
            kinds=self.settings.kinds,
            parallel_classes=parallel_classes,
        )
        self.plan = make_parallel_plan(
            self.layers,
            self.splits,
            data_parallel_size=self.comm.dp_size,
            model_parallel_size=self.comm.mp_size,
            stage=self.stage,
            assignment_strategy=self.assignment_strategy,
        )
        params = [model.get_parameter(s.weight) for s in self.layers.values()]
        weight = params[0] if params else next(model.parameters(), torch.empty(0))
        self.factor_dtype = a["factor_dtype"] or torch.promote_types(weight.dtype, torch.float32)
        # a pipeline stage may hold no preconditioned layer
        self._state = self._first_state(weight.device, allow_empty=True)
        self._directory()
        self._micro = []
        self._handles = []
        self._register_hooks()
        self._handles += check_hooks(model, self.layers)  # first calls of kinds= modules
        where = f" on global-rank={self.comm.rank} and pipeline-rank={self.stage}"
        title = f"K-FAC registered layers (stage {self.stage})"
        log_registered(self.loglevel, model, self.layers, self.plan, where, title)

    def _directory(self) -> None:
        """Learn every rank's stage, coordinates and layers (one object all-gather)."""
        comm = self.comm
        mine = {
            "stage": self.stage,
            "coords": (comm.dp_rank, comm.mp_rank),
            "fingerprint": self.plan.fingerprint(),
            "specs": list(self.layers.values()),
            "owned": self.plan.owned_by(comm.dp_rank, comm.mp_rank),
        }
        infos = comm.all_gather_object(mine)
        prints = {(i["stage"], i["fingerprint"]) for i in infos}
        stages = {s for s, _ in prints}
        if len(prints) != len(stages):
            raise ValueError(
                "ranks of one pipeline stage registered different layers or built different "
                f"plans (rank {comm.rank}, stage {self.stage}):\n{self.plan}"
            )
        self.all_specs = {}
        seen: dict[str, int] = {}
        for info in sorted(infos, key=lambda i: i["stage"]):
            for spec in info["specs"]:
                if seen.setdefault(spec.name, info["stage"]) != info["stage"]:
                    raise ValueError(f"layer {spec.name!r} is registered on two pipeline stages")
                self.all_specs[spec.name] = spec
        if not self.all_specs:
            raise ValueError(f"no layer of {type(self.model).__name__} can be preconditioned")
        self.owner_rank = {n: r for r, i in enumerate(infos) for n in i["owned"]}
        self.world_plan = global_plan(self.all_specs, self.owner_rank, comm.world_size)

    def __repr__(self) -> str:
        return self._repr(
            type(self).__name__,
            f" on stage {self.stage}",
            f"data={self.comm.dp_size}, model={self.comm.mp_size}",
            f"compute_method={self.compute_method.name.lower()}",
        )
