"""kfac_func: K-FAC for PyTorch as pure functions over immutable state pytrees.

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

from kfac_func.adapter.adaptive import AdaptiveStepper
from kfac_func.adapter.coverage import MissingStatisticsWarning
from kfac_func.adapter.fallback import FallbackWarning
from kfac_func.adapter.optimizer import KFAC
from kfac_func.adapter.preconditioner import ComputeMethod, KFACPreconditioner
from kfac_func.adapter.recipes import RECIPES, Recipe
from kfac_func.adapter.scheduler import LambdaParamScheduler
from kfac_func.blocks import LayerSpec, LayerTable, grads_to_matrix, matrix_to_grads, register
from kfac_func.blocks.examples import BatchSizeError
from kfac_func.captures import Captures, LayerCapture, capture
from kfac_func.checkpoint.atomic_dcp import load_dcp, save_dcp
from kfac_func.checkpoint.errors import (
    CheckpointError,
    CheckpointFormatError,
    CheckpointMismatchError,
)
from kfac_func.checkpoint.factor_dir import load_factor_dir, save_factor_dir
from kfac_func.checkpoint.factor_manifest import layer_file_name, read_factor_manifest
from kfac_func.checkpoint.state_dict import state_from_dict, state_to_dict
from kfac_func.checkpoint.state_files import load_state, save_state
from kfac_func.core.conventions import CONVENTIONS, Convention
from kfac_func.core.decomposition import (
    DecompositionError,
    EigenDecomposition,
    EKFACDecomposition,
    InverseDecomposition,
)
from kfac_func.core.factors import a_factor, g_factor
from kfac_func.core.layer_decomposition import eigen_decompose, inverse_decompose
from kfac_func.core.preconditioning import kl_clip_scale, precondition
from kfac_func.core.quadratic import QuadraticSolution, lm_damping, solve_quadratic
from kfac_func.distributed.communicator import AllreduceMethod, Communicator, RankMismatchError
from kfac_func.distributed.plan import (
    AssignmentStrategy,
    DistributedStrategy,
    LayerPlan,
    Plan,
    make_plan,
)
from kfac_func.distributed.step import update_distributed
from kfac_func.parallel.gpt_neox import ExperimentalFeatureWarning, GPTNeoXKFACPreconditioner
from kfac_func.parallel.plan import ParallelPlan, make_parallel_plan, register_parallel
from kfac_func.parallel.preconditioner import ParallelKFACPreconditioner
from kfac_func.state import AdaptiveRecord, AdaptiveState, KFACConfig, KFACState, LayerState, init
from kfac_func.step.accumulate import accumulate_factors
from kfac_func.step.adaptive import (
    AdaptiveInfo,
    adapt_damping,
    adaptive_step,
    damping_due,
    init_adaptive,
)
from kfac_func.step.curvature import curvature_gram
from kfac_func.step.decompose import decompose
from kfac_func.step.ekfac import correct_eigenvalues
from kfac_func.step.hyper import NonFiniteError, exp_decay_factor_averaging
from kfac_func.step.options import StepOptions
from kfac_func.step.orthogonal import Orthogonal
from kfac_func.step.precondition import precondition_grads
from kfac_func.step.sync_free import report_skipped
from kfac_func.step.update import update

__version__ = "0.1.0"

__all__ = [
    "CONVENTIONS",
    "KFAC",
    "RECIPES",
    "AdaptiveInfo",
    "AdaptiveRecord",
    "AdaptiveState",
    "AdaptiveStepper",
    "AllreduceMethod",
    "AssignmentStrategy",
    "BatchSizeError",
    "Captures",
    "CheckpointError",
    "CheckpointFormatError",
    "CheckpointMismatchError",
    "Communicator",
    "ComputeMethod",
    "Convention",
    "DecompositionError",
    "DistributedStrategy",
    "EKFACDecomposition",
    "EigenDecomposition",
    "ExperimentalFeatureWarning",
    "FallbackWarning",
    "GPTNeoXKFACPreconditioner",
    "InverseDecomposition",
    "KFACConfig",
    "KFACPreconditioner",
    "KFACState",
    "LambdaParamScheduler",
    "LayerCapture",
    "LayerPlan",
    "LayerSpec",
    "LayerState",
    "LayerTable",
    "MissingStatisticsWarning",
    "NonFiniteError",
    "Orthogonal",
    "ParallelKFACPreconditioner",
    "ParallelPlan",
    "Plan",
    "QuadraticSolution",
    "RankMismatchError",
    "Recipe",
    "StepOptions",
    "__version__",
    "a_factor",
    "accumulate_factors",
    "adapt_damping",
    "adaptive_step",
    "capture",
    "correct_eigenvalues",
    "curvature_gram",
    "damping_due",
    "decompose",
    "eigen_decompose",
    "exp_decay_factor_averaging",
    "g_factor",
    "grads_to_matrix",
    "init",
    "init_adaptive",
    "inverse_decompose",
    "kl_clip_scale",
    "layer_file_name",
    "lm_damping",
    "load_dcp",
    "load_factor_dir",
    "load_state",
    "make_parallel_plan",
    "make_plan",
    "matrix_to_grads",
    "precondition",
    "precondition_grads",
    "read_factor_manifest",
    "register",
    "register_parallel",
    "report_skipped",
    "save_dcp",
    "save_factor_dir",
    "save_state",
    "solve_quadratic",
    "state_from_dict",
    "state_to_dict",
    "update",
    "update_distributed",
]
