"""Stateful drop-ins for ordinary training loops: :class:`KFACPreconditioner` (module
hooks feed the pure step; ``step()`` rewrites ``.grad``), its kfac-pytorch arguments, the
optimizer face :class:`KFAC` with its recipes, :class:`Settings` (everything the
preconditioners take beyond kfac-pytorch's arguments), :class:`LambdaParamScheduler`, and
:class:`AdaptiveStepper` (the adaptive step on a module's own parameters). The adapter owns
no math.

:class:`KFAC`, :class:`KFACPreconditioner`, :class:`Settings` and their recipes and
warnings are also at the top level (``kf.KFAC``, ...); :class:`LambdaParamScheduler`,
:class:`AdaptiveStepper` and the keywords every preconditioner class shares,
:class:`SharedArguments` with their defaults :data:`KFAC_PYTORCH_DEFAULTS`, are here.

Example:
    >>> from torch import nn
    >>> from kfac_func.adapter import KFACPreconditioner, LambdaParamScheduler
    >>> precond = KFACPreconditioner(nn.Linear(4, 2), damping=0.1)
    >>> scheduler = LambdaParamScheduler(precond, damping_lambda=lambda step: 0.5)
    >>> scheduler.step()
    >>> precond.damping
    0.05
"""

from kfac_func.adapter.adaptive import AdaptiveStepper
from kfac_func.adapter.arguments import KFAC_PYTORCH_DEFAULTS, SharedArguments
from kfac_func.adapter.coverage import MissingStatisticsWarning
from kfac_func.adapter.fallback import FallbackWarning
from kfac_func.adapter.optimizer import KFAC
from kfac_func.adapter.preconditioner import ComputeMethod, KFACPreconditioner
from kfac_func.adapter.recipes import RECIPES, Recipe
from kfac_func.adapter.scheduler import LambdaParamScheduler
from kfac_func.adapter.settings import Settings

__all__ = [
    "KFAC",
    "KFAC_PYTORCH_DEFAULTS",
    "RECIPES",
    "AdaptiveStepper",
    "ComputeMethod",
    "FallbackWarning",
    "KFACPreconditioner",
    "LambdaParamScheduler",
    "MissingStatisticsWarning",
    "Recipe",
    "Settings",
    "SharedArguments",
]
