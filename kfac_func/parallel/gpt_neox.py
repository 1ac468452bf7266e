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

import warnings
from typing import Any

from torch import nn
from typing_extensions import Unpack  # typing.Unpack is Python 3.11's

from kfac_func.adapter.arguments import (
    ComputeMethod,
    check_bucket_cap,
    parse_enum,
    shares_arguments,
)
from kfac_func.adapter.settings import PARALLEL_SETTINGS, settings_from_keywords
from kfac_func.parallel.preconditioner import (
    PARALLEL_DEFAULTS,
    ParallelArguments,
    ParallelKFACPreconditioner,
)

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

    The arguments are :class:`~kfac_func.parallel.preconditioner.ParallelKFACPreconditioner`'s
    (the keywords of :class:`~kfac_func.parallel.ParallelArguments`,
    ``**arguments``, are documented there), with its defaults but for
    ``include_plain_linear`` and the settings' ``loss_divisor``. The process groups not
    given are the module's DeepSpeed grid's data-parallel, slice-parallel and pipeline
    groups (none without a grid); the
    pipeline group's rank is the stage. ``compute_method`` must be eigen (the default;
    ValueError otherwise, as in kfac-pytorch). ``accumulation_steps`` is DeepSpeed's
    ``gradient_accumulation_steps``, and ``loss_divisor``, what the backpropagated loss was
    divided by besides the reduction, is by default (None) ``accumulation_steps``, since
    DeepSpeed's engine backpropagates the loss divided by its gradient accumulation steps.
    The ``kl_clip`` sum runs over every layer of every stage. Here:

    Args:
        model: the ``deepspeed.pipe.PipelineModule`` (this rank's stage of it).
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

    @shares_arguments(PARALLEL_DEFAULTS, ParallelArguments)
    def __init__(
        self,
        model: nn.Module,
        *,
        include_plain_linear: bool = False,
        **arguments: Unpack[ParallelArguments],
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
        check_bucket_cap(arguments.get("allreduce_bucket_cap_mb", 25.0))  # as kfac-pytorch: first
        compute_method = arguments.get("compute_method", ComputeMethod.EIGEN)
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
        if grid is not None:  # the groups not given are the grid's
            if arguments.get("data_parallel_group") is None:
                arguments["data_parallel_group"] = grid.get_data_parallel_group()
            if arguments.get("model_parallel_group") is None:
                arguments["model_parallel_group"] = grid.get_slice_parallel_group()
            if arguments.get("pipeline_parallel_group") is None:
                arguments["pipeline_parallel_group"] = grid.get_pipe_parallel_group()
        given: dict[str, Any] = dict(arguments)
        settings = settings_from_keywords(given, type(self).__name__, PARALLEL_SETTINGS)
        if settings.loss_divisor is None:  # DeepSpeed's engine backpropagates loss / k
            settings = settings.replace(loss_divisor=given.get("accumulation_steps", 1))
        super().__init__(
            model, include_plain_linear=include_plain_linear, **given, settings=settings
        )
