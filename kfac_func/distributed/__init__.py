"""K-FAC across ranks: the plan (who decomposes and preconditions what, pure data), the
communicator that executes it over ``torch.distributed``, and the KAISA step
(:func:`update_distributed`) that composes the math of :mod:`kfac_func.step` with the
communicator.

Example:
    >>> from torch import nn
    >>> import kfac_func as kf
    >>> from kfac_func.distributed import DistributedStrategy, make_plan
    >>> layers = kf.register(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)))
    >>> plan = make_plan(layers, world_size=2, grad_worker_fraction=DistributedStrategy.MEM_OPT)
    >>> sorted(plan.layers)
    ['0', '1']
"""

from kfac_func.distributed.communicator import AllreduceMethod, Communicator, RankMismatchError
from kfac_func.distributed.plan import (
    AssignmentStrategy,
    DistributedStrategy,
    LayerPlan,
    Plan,
    make_plan,
)
from kfac_func.distributed.step import update_distributed

__all__ = [
    "AllreduceMethod",
    "AssignmentStrategy",
    "Communicator",
    "DistributedStrategy",
    "LayerPlan",
    "Plan",
    "RankMismatchError",
    "make_plan",
    "update_distributed",
]
