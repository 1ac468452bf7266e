"""Model parallelism: Megatron-style column/row-parallel linears, the per-stage plan, the
collectives over data- and model-parallel groups, :class:`ParallelKFACPreconditioner`
and the GPT-NeoX (DeepSpeed pipeline) preconditioner. Builds on
:mod:`kfac_func.adapter` and :mod:`kfac_func.distributed`.

Example:
    >>> from kfac_func.parallel import ParallelKFACPreconditioner
    >>> ParallelKFACPreconditioner.__name__
    'ParallelKFACPreconditioner'
"""

from kfac_func.parallel.gpt_neox import ExperimentalFeatureWarning, GPTNeoXKFACPreconditioner
from kfac_func.parallel.plan import ParallelPlan, make_parallel_plan, register_parallel
from kfac_func.parallel.preconditioner import (
    PARALLEL_DEFAULTS,
    ParallelArguments,
    ParallelKFACPreconditioner,
)

__all__ = [
    "PARALLEL_DEFAULTS",
    "ExperimentalFeatureWarning",
    "GPTNeoXKFACPreconditioner",
    "ParallelArguments",
    "ParallelKFACPreconditioner",
    "ParallelPlan",
    "make_parallel_plan",
    "register_parallel",
]
