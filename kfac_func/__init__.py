"""kfac_func: K-FAC for PyTorch as pure functions over immutable state pytrees.

The top level holds what a training loop needs: the optimizer face (:class:`KFAC` and its
recipes), the drop-in :class:`KFACPreconditioner` and its :class:`Settings`, the
functional loop (:func:`register`, :func:`init`, :func:`capture`, :func:`update`,
:func:`decompose`, :class:`StepOptions`), checkpoints
(:func:`save_state`, :func:`save_dcp`, ...) and the errors and warnings these raise. The
rest is in the subpackages: the step's stages and the adaptive step in
:mod:`kfac_func.step`, the math of one layer in :mod:`kfac_func.core`, plans and
communicators in :mod:`kfac_func.distributed`, model parallelism in
:mod:`kfac_func.parallel`, factor directories in :mod:`kfac_func.checkpoint`, layer kinds
in :mod:`kfac_func.blocks`, the scheduler and the adaptive stepper in
:mod:`kfac_func.adapter`. Their old top-level names still resolve, with a
``DeprecationWarning`` naming the new place (see ``MOVED``).

Example:
    >>> import torch
    >>> from torch import nn
    >>> import kfac_func as kf
    >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    >>> layers = kf.register(model)
    >>> state = kf.init(layers)
    >>> x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    >>> params = dict(model.named_parameters())
    >>> loss, grads, caps = kf.capture(model, params, x,
    ...                                lambda out: nn.functional.cross_entropy(out, y))
    >>> grads, state = kf.update(state, grads, captures=caps, damping=1e-2, lr=0.1)
"""

import importlib
import warnings
from typing import Any

# the subpackages, so that ``kf.distributed.make_plan`` and the like resolve
from kfac_func import adapter as adapter
from kfac_func import blocks as blocks
from kfac_func import captures as captures
from kfac_func import checkpoint as checkpoint
from kfac_func import core as core
from kfac_func import distributed as distributed
from kfac_func import parallel as parallel
from kfac_func import state as state
from kfac_func import step as step
from kfac_func.adapter import (
    KFAC,
    RECIPES,
    ComputeMethod,
    FallbackWarning,
    KFACPreconditioner,
    MissingStatisticsWarning,
    Recipe,
    Settings,
)
from kfac_func.blocks import LayerTable, register
from kfac_func.blocks.examples import BatchSizeError
from kfac_func.captures import Captures, capture
from kfac_func.checkpoint import (
    CheckpointError,
    load_dcp,
    load_state,
    save_dcp,
    save_state,
    state_from_dict,
    state_to_dict,
)
from kfac_func.core import DecompositionError
from kfac_func.state import KFACConfig, KFACState, init
from kfac_func.step import NonFiniteError, Orthogonal, StepOptions
from kfac_func.step.decompose import decompose
from kfac_func.step.update import update

__version__ = "0.1.0"

__all__ = [
    "KFAC",
    "RECIPES",
    "BatchSizeError",
    "Captures",
    "CheckpointError",
    "ComputeMethod",
    "DecompositionError",
    "FallbackWarning",
    "KFACConfig",
    "KFACPreconditioner",
    "KFACState",
    "LayerTable",
    "MissingStatisticsWarning",
    "NonFiniteError",
    "Orthogonal",
    "Recipe",
    "Settings",
    "StepOptions",
    "__version__",
    "capture",
    "decompose",
    "init",
    "load_dcp",
    "load_state",
    "register",
    "save_dcp",
    "save_state",
    "state_from_dict",
    "state_to_dict",
    "update",
]

#: The names that left the top level, each with the module that exports it now. They
#: resolve from ``kfac_func`` for one more release, with a ``DeprecationWarning``.
MOVED: dict[str, str] = {
    "AdaptiveStepper": "kfac_func.adapter",
    "LambdaParamScheduler": "kfac_func.adapter",
    "grads_to_matrix": "kfac_func.blocks",
    "LayerSpec": "kfac_func.blocks",
    "matrix_to_grads": "kfac_func.blocks",
    "LayerCapture": "kfac_func.captures",
    "CheckpointFormatError": "kfac_func.checkpoint",
    "CheckpointMismatchError": "kfac_func.checkpoint",
    "layer_file_name": "kfac_func.checkpoint",
    "load_factor_dir": "kfac_func.checkpoint",
    "read_factor_manifest": "kfac_func.checkpoint",
    "save_factor_dir": "kfac_func.checkpoint",
    "a_factor": "kfac_func.core",
    "Convention": "kfac_func.core",
    "CONVENTIONS": "kfac_func.core",
    "eigen_decompose": "kfac_func.core",
    "EigenDecomposition": "kfac_func.core",
    "EKFACDecomposition": "kfac_func.core",
    "g_factor": "kfac_func.core",
    "inverse_decompose": "kfac_func.core",
    "InverseDecomposition": "kfac_func.core",
    "kl_clip_scale": "kfac_func.core",
    "lm_damping": "kfac_func.core",
    "precondition": "kfac_func.core",
    "QuadraticSolution": "kfac_func.core",
    "solve_quadratic": "kfac_func.core",
    "AllreduceMethod": "kfac_func.distributed",
    "AssignmentStrategy": "kfac_func.distributed",
    "Communicator": "kfac_func.distributed",
    "DistributedStrategy": "kfac_func.distributed",
    "LayerPlan": "kfac_func.distributed",
    "make_plan": "kfac_func.distributed",
    "Plan": "kfac_func.distributed",
    "RankMismatchError": "kfac_func.distributed",
    "update_distributed": "kfac_func.distributed",
    "ExperimentalFeatureWarning": "kfac_func.parallel",
    "GPTNeoXKFACPreconditioner": "kfac_func.parallel",
    "make_parallel_plan": "kfac_func.parallel",
    "ParallelKFACPreconditioner": "kfac_func.parallel",
    "ParallelPlan": "kfac_func.parallel",
    "register_parallel": "kfac_func.parallel",
    "AdaptiveRecord": "kfac_func.state",
    "AdaptiveState": "kfac_func.state",
    "LayerState": "kfac_func.state",
    "accumulate_factors": "kfac_func.step",
    "adapt_damping": "kfac_func.step",
    "adaptive_step": "kfac_func.step",
    "AdaptiveInfo": "kfac_func.step",
    "correct_eigenvalues": "kfac_func.step",
    "curvature_gram": "kfac_func.step",
    "damping_due": "kfac_func.step",
    "exp_decay_factor_averaging": "kfac_func.step",
    "init_adaptive": "kfac_func.step",
    "precondition_grads": "kfac_func.step",
    "report_skipped": "kfac_func.step",
}


def __getattr__(name: str) -> Any:
    """A moved name (``MOVED``), from its new module, with a ``DeprecationWarning``.

    Example:
        >>> import warnings
        >>> import kfac_func as kf
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     plan_maker = kf.make_plan
        >>> plan_maker is kf.distributed.make_plan
        True
        >>> str(caught[0].message).split(";")[0]
        'kfac_func.make_plan moved to kfac_func.distributed.make_plan'
    """
    module = MOVED.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(
        f"kfac_func.{name} moved to {module}.{name}; the top-level name will be removed in "
        "the next release",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    """The module's names and the moved ones (which still resolve, with a warning).

    Example:
        >>> import kfac_func as kf
        >>> "make_plan" in dir(kf) and "update" in dir(kf)
        True
    """
    return sorted({*globals(), *MOVED})
