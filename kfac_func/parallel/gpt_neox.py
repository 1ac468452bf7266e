"""`GPTNeoXKFACPreconditioner`: K-FAC for DeepSpeed pipeline models (GPT-NeoX, Megatron).

:class:`~kfac_func.parallel.preconditioner.ParallelKFACPreconditioner` with kfac-pytorch's GPT-NeoX
arguments and checks: the model must be a ``deepspeed.pipe.PipelineModule`` (each
pipeline stage registers only its own layers), the compute method is eigen, and the
feature is experimental. The process groups default to those of the module's DeepSpeed
grid. DeepSpeed is imported only when the class is used; install it with
``pip install "kfac_func[deepspeed]"`` (on a machine without CUDA:
``DS_BUILD_OPS=0 pip install --no-build-isolation "kfac_func[deepspeed]"``).

Usage with DeepSpeed's pipeline engine. ``engine.train_batch`` runs the forward and
backward passes of every micro-batch, averages the gradients over the data-parallel
group and then calls ``step()`` of the client optimizer; a step pre-hook on that
optimizer runs the preconditioner at exactly that point, on every rank::

    import deepspeed
    import torch
    from deepspeed.pipe import PipelineModule
    from kfac_func.parallel import GPTNeoXKFACPreconditioner

    pipe = PipelineModule(layers, topology=topology, loss_fn=loss_fn)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
    engine, *_ = deepspeed.initialize(model=pipe, optimizer=optimizer, config=config)
    preconditioner = GPTNeoXKFACPreconditioner(pipe, lr=0.1, damping=0.003)
    optimizer.register_step_pre_hook(lambda *_: preconditioner.step())
    for _ in range(steps):
        loss = engine.train_batch(data_iter=batches)

Each stage registers the column- and row-parallel linears it holds
(``include_plain_linear=True`` adds its other supported layers), under the module's names
(the global layer index, then the path inside the layer: ``"3.mlp.dense_h_to_4h"``), so
the names do not depend on how the layers are partitioned into stages.
:meth:`~GPTNeoXKFACPreconditioner.state_dict` and
:meth:`~GPTNeoXKFACPreconditioner.load_state_dict` are collectives of every rank; with
``factor_checkpoint_dir`` the factors go to one file per layer there, written by the
layer's owner, and ``state_dict`` holds only the step and the hyperparameters.

Limitations: training in float32 with the client optimizer stepping the model's own
parameters (DeepSpeed's ZeRO and its fp16/bf16 optimizer wrappers step master copies of
the gradients that the hook does not see); gradient clipping configured in DeepSpeed
runs before the hook, so K-FAC preconditions the clipped gradients; activation
checkpointing (which re-runs the forward pass of a stage inside its backward pass) and
tied layers are untested.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import torch
from torch import nn

from kfac_func.adapter.arguments import (
    ComputeMethod,
    FloatOrFn,
    IntOrFn,
    arguments_of,
    check_bucket_cap,
    parse_enum,
)
from kfac_func.blocks.mapped import KindMap
from kfac_func.distributed.plan import AssignmentStrategy
from kfac_func.parallel.preconditioner import ParallelKFACPreconditioner
from kfac_func.parallel.splits import ParallelClasses

__all__ = ["ExperimentalFeatureWarning", "GPTNeoXKFACPreconditioner"]


class ExperimentalFeatureWarning(UserWarning):
    """A feature whose interface or behaviour may still change."""


def _pipeline_module() -> type:
    try:
        from deepspeed.pipe import PipelineModule  # type: ignore[import-untyped,unused-ignore]
    except ImportError as e:
        raise ImportError(
            'GPTNeoXKFACPreconditioner needs DeepSpeed: pip install "kfac_func[deepspeed]" '
            f"(import failed: {e})"
        ) from e
    return PipelineModule  # type: ignore[no-any-return]


class GPTNeoXKFACPreconditioner(ParallelKFACPreconditioner):
    """K-FAC for a ``deepspeed.pipe.PipelineModule`` under data × pipeline × model parallelism.

    kfac-pytorch's GPT-NeoX preconditioner: each pipeline stage registers and
    preconditions its own layers (see
    :class:`~kfac_func.parallel.preconditioner.ParallelKFACPreconditioner` for the step).
    Call :meth:`step` after DeepSpeed averaged the gradients and before the optimizer
    steps: from a step pre-hook of the optimizer given to ``deepspeed.initialize`` (see
    the module docstring). Every rank constructs it, and calls :meth:`step`,
    :meth:`state_dict` and :meth:`load_state_dict`, at the same point (they are
    collectives). Warns :class:`ExperimentalFeatureWarning` at construction.

    The arguments are :class:`~kfac_func.parallel.preconditioner.ParallelKFACPreconditioner`'s,
    in kfac-pytorch's GPT-NeoX order, with its defaults (those shared with
    :class:`kfac_func.KFACPreconditioner` are documented there) but for ``loss_divisor`` and
    ``include_plain_linear``. ``accumulation_steps`` is DeepSpeed's
    ``gradient_accumulation_steps``; the ``kl_clip`` sum runs over every layer of every
    stage. Here:

    Args:
        model: the ``deepspeed.pipe.PipelineModule`` (this rank's stage of it).
        compute_method: must be eigen (the default; ValueError otherwise, as in
            kfac-pytorch).
        data_parallel_group, model_parallel_group, pipeline_parallel_group: this rank's
            groups (None: the module's DeepSpeed grid's data-parallel, slice-parallel and
            pipeline groups, or none without a grid); the pipeline group's rank is the
            stage.
        loss_divisor: what the backpropagated loss was divided by besides the reduction;
            None (default): ``accumulation_steps``, since DeepSpeed's engine
            backpropagates the loss divided by its gradient accumulation steps.
        include_plain_linear: False (default, as kfac-pytorch): register only the
            column- and row-parallel linears; True: also the pipeline's other supported
            layers (``nn.Linear`` projections and heads, ...).

    Raises:
        ImportError: DeepSpeed is not installed.
        ValueError: ``model`` is not a ``PipelineModule`` ("model must be an instance of
            deepspeed.pipe.PipelineModule. Got an instance of ..."),
            ``allreduce_bucket_cap_mb`` is negative, ``compute_method`` is inverse
            ("Inverse method not supported with GPT NeoX.") or otherwise not eigen, a
            module looks tensor-parallel but cannot be placed, or no stage holds a layer
            to precondition. The messages begin as kfac-pytorch's do.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        factor_update_steps: IntOrFn = 1,
        inv_update_steps: IntOrFn = 1,
        damping: FloatOrFn = 0.001,
        factor_decay: FloatOrFn = 0.95,
        kl_clip: FloatOrFn | None = 0.001,
        lr: FloatOrFn = 0.1,
        accumulation_steps: int = 1,
        allreduce_bucket_cap_mb: float = 25.0,
        assignment_strategy: AssignmentStrategy | str = AssignmentStrategy.COMPUTE,
        compute_method: ComputeMethod | str = ComputeMethod.EIGEN,
        compute_eigenvalue_outer_product: bool = False,
        symmetry_aware: bool = False,
        data_parallel_group: Any = None,
        model_parallel_group: Any = None,
        pipeline_parallel_group: Any = None,
        grad_scaler: Any = None,
        factor_dtype: torch.dtype | None = None,
        inv_dtype: torch.dtype = torch.float32,
        factor_checkpoint_dir: str | None = None,
        skip_layers: list[str] | None = None,
        update_factors_in_hook: bool = True,
        loglevel: int = logging.DEBUG,
        scaling: str | None = None,
        loss_reduction: str = "mean",
        loss_divisor: float | None = None,
        include_plain_linear: bool = False,
        kinds: KindMap | None = None,
        convention: str | None = None,
        parallel_classes: ParallelClasses | None = None,
    ) -> None:
        pipeline_module = _pipeline_module()
        # kfac-pytorch's wording, which users and tests match
        warnings.warn(
            "KFAC support for GPT-NeoX training is experimental.",
            ExperimentalFeatureWarning,
            stacklevel=2,
        )
        if not isinstance(model, pipeline_module):
            raise ValueError(
                "model must be an instance of deepspeed.pipe.PipelineModule. "
                f"Got an instance of {type(model)}."
            )
        check_bucket_cap(allreduce_bucket_cap_mb)  # before compute_method's, as kfac-pytorch
        method = parse_enum(ComputeMethod, compute_method, "compute_method")
        if method is ComputeMethod.INVERSE:
            raise ValueError(
                "Inverse method not supported with GPT NeoX. (compute_method="
                f"{compute_method!r}; GPTNeoXKFACPreconditioner computes eigendecompositions)"
            )
        if method is not ComputeMethod.EIGEN:
            raise ValueError(
                f"compute_method={compute_method!r} is not supported with GPT NeoX; "
                "GPTNeoXKFACPreconditioner computes eigendecompositions"
            )
        grid = getattr(model, "_grid", None)
        if grid is not None:
            if data_parallel_group is None:
                data_parallel_group = grid.get_data_parallel_group()
            if model_parallel_group is None:
                model_parallel_group = grid.get_slice_parallel_group()
            if pipeline_parallel_group is None:
                pipeline_parallel_group = grid.get_pipe_parallel_group()
        compute_method = method  # eigen, checked above
        if loss_divisor is None:  # DeepSpeed's engine backpropagates loss / its accumulation
            loss_divisor = accumulation_steps
        super().__init__(**arguments_of(super().__init__, locals()))
