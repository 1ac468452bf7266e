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
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from kfac_func.adapter.arguments import ComputeMethod, parse_enum
from kfac_func.blocks.mapped import KindMap
from kfac_func.distributed.plan import AssignmentStrategy
from kfac_func.parallel.preconditioner import ParallelKFACPreconditioner
from kfac_func.parallel.splits import ParallelClasses

__all__ = ["ExperimentalFeatureWarning", "GPTNeoXKFACPreconditioner"]

IntOrFn = int | Callable[[int], int]
FloatOrFn = float | Callable[[int], float]


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

    Args:
        model: the ``deepspeed.pipe.PipelineModule`` (this rank's stage of it).
        factor_update_steps: steps between factor updates (positive int or
            ``step -> int`` callable), as in :class:`kfac_func.KFACPreconditioner`.
        inv_update_steps: steps between recomputations of the eigendecompositions.
        damping: Tikhonov damping λ (>= 0, or a callable).
        factor_decay: coefficient of the factors' running averages, in [0, 1].
        kl_clip: the bound of the kl_clip scale (> 0), whose sum runs over every layer
            of every stage; None disables it.
        lr: the learning rate in the ``kl_clip`` scale (keep it equal to the
            optimizer's).
        accumulation_steps: micro-batches per optimizer step (DeepSpeed's
            ``gradient_accumulation_steps``); their statistics form one factor update.
        allreduce_bucket_cap_mb: accepted for compatibility (each collective here
            carries one layer's tensors).
        assignment_strategy: how the layers' factors are balanced over the
            data-parallel ranks: ``"compute"`` (``n³``) or ``"memory"`` (``n²``).
        compute_method: must be eigen (the default; ValueError otherwise, as in
            kfac-pytorch).
        compute_eigenvalue_outer_product: precompute ``1 / (outer(dg, da) + λ)`` when
            decomposing (default False, as kfac-pytorch's GPT-NeoX preconditioner).
        symmetry_aware: accepted for compatibility.
        data_parallel_group: this rank's data-parallel group (None: the grid's, or no
            data parallelism without a grid).
        model_parallel_group: this rank's tensor (model) parallel group (None: the
            grid's slice-parallel group, or none).
        pipeline_parallel_group: this rank's pipeline group, whose rank is the stage
            (None: the grid's, or a single stage).
        grad_scaler: a ``GradScaler`` or a callable returning the loss scale; the
            output-gradients seen by the hooks are divided by it.
        factor_dtype: dtype of the factors (default: the weights' dtype promoted to at
            least float32).
        inv_dtype: dtype the decompositions are stored in.
        factor_checkpoint_dir: with it, :meth:`state_dict` writes the factors to one
            file per layer there (written by the layer's owner;
            :func:`kfac_func.checkpoint.save_factor_dir`'s format) and returns only the step and the
            hyperparameters; :meth:`load_state_dict` reads them back.
        skip_layers: regular expressions searched in module names and class names;
            matching modules are not registered.
        update_factors_in_hook: build each call's Gram statistics in the hooks (True)
            or keep the raw tensors until :meth:`step` (False); the results are the
            same.
        loglevel: the :mod:`logging` level at which construction reports on the
            ``"kfac_func"`` logger: one ``Registered name="...": ...`` line per layer of
            this stage (with the global and pipeline rank), the stage's layer table and
            the assignment. DEBUG (the default) is silent unless that logger shows DEBUG.
        scaling: ``"kfac-pytorch"`` (default) or ``"fisher"`` (see
            :mod:`kfac_func.core.conventions`); ``convention=`` is an alias.
        loss_reduction: ``"mean"`` or ``"sum"``: how the loss reduces the batch.
        loss_divisor: what the backpropagated loss was divided by besides the reduction;
            None (default): ``accumulation_steps``, since DeepSpeed's engine
            backpropagates the loss divided by its gradient accumulation steps.
        include_plain_linear: False (default, as kfac-pytorch): register only the
            column- and row-parallel linears; True: also the pipeline's other supported
            layers (``nn.Linear`` projections and heads, ...).
        kinds: ``{module class: kind}`` for the model's own classes that compute a
            registered kind (see :func:`kfac_func.register`).
        parallel_classes: ``{module class or class name: "column" | "row" | None}`` for
            tensor-parallel linears of other class names (Transformer Engine's, ...); see
            :func:`~kfac_func.parallel.plan.register_parallel`.

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
        if allreduce_bucket_cap_mb < 0:
            raise ValueError(
                f"allreduce_bucket_cap_mb must be >= 0, got {allreduce_bucket_cap_mb!r}"
            )
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
        super().__init__(
            model,
            data_parallel_group=data_parallel_group,
            model_parallel_group=model_parallel_group,
            pipeline_parallel_group=pipeline_parallel_group,
            factor_update_steps=factor_update_steps,
            inv_update_steps=inv_update_steps,
            damping=damping,
            factor_decay=factor_decay,
            kl_clip=kl_clip,
            lr=lr,
            accumulation_steps=accumulation_steps,
            allreduce_bucket_cap_mb=allreduce_bucket_cap_mb,
            assignment_strategy=assignment_strategy,
            compute_method=ComputeMethod.EIGEN,
            compute_eigenvalue_outer_product=compute_eigenvalue_outer_product,
            symmetry_aware=symmetry_aware,
            grad_scaler=grad_scaler,
            factor_dtype=factor_dtype,
            inv_dtype=inv_dtype,
            factor_checkpoint_dir=factor_checkpoint_dir,
            skip_layers=skip_layers,
            update_factors_in_hook=update_factors_in_hook,
            loglevel=loglevel,
            scaling=scaling,
            convention=convention,
            loss_reduction=loss_reduction,
            # DeepSpeed's engine backpropagates loss / gradient_accumulation_steps
            loss_divisor=accumulation_steps if loss_divisor is None else loss_divisor,
            include_plain_linear=include_plain_linear,
            kinds=kinds,
            parallel_classes=parallel_classes,
        )
