"""The K-FAC step as pure stages over a :class:`~kfac_func.state.KFACState`.

``update`` (:mod:`kfac_func.step.update`) = accumulate (:mod:`~kfac_func.step.accumulate`)
→ decompose (:mod:`~kfac_func.step.decompose`) → precondition
(:mod:`~kfac_func.step.precondition`, after the gradient checks of
:mod:`~kfac_func.step.checks`). Shared hyperparameter handling is in
:mod:`~kfac_func.step.hyper`. This package exports the stages, for loops that run them
apart, and the adaptive step's functions (:mod:`~kfac_func.step.adaptive`);
:class:`StepOptions`, :class:`Orthogonal`, :class:`GrowingInterval` and
:class:`NonFiniteError` are also at the top
level. ``update`` and ``decompose`` are at the top level only (``kf.update``,
``kf.decompose``): a name of this package never shadows one of its modules, so that
``import kfac_func.step.decompose as m`` gives the module.

Example:
    >>> import torch
    >>> from torch import nn
    >>> import kfac_func as kf
    >>> from kfac_func.step import accumulate_factors, precondition_grads
    >>> model = nn.Linear(4, 3)
    >>> state = kf.init(kf.register(model))
    >>> params = dict(model.named_parameters())
    >>> x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    >>> loss, grads, caps = kf.capture(model, params, x,
    ...                                lambda out: nn.functional.cross_entropy(out, y))
    >>> state = accumulate_factors(state, caps)
    >>> state = kf.decompose(state, damping=1e-2)
    >>> sorted(precondition_grads(state, grads, damping=1e-2))
    ['bias', 'weight']
"""

from kfac_func.step.accumulate import accumulate_factors
from kfac_func.step.adaptive import (
    AdaptiveInfo,
    adapt_damping,
    adaptive_step,
    damping_due,
    init_adaptive,
)
from kfac_func.step.curvature import curvature_gram
from kfac_func.step.ekfac import correct_eigenvalues
from kfac_func.step.hyper import (
    DecayPerStep,
    GrowingInterval,
    NonFiniteError,
    exp_decay_factor_averaging,
)
from kfac_func.step.options import StepOptions
from kfac_func.step.orthogonal import Orthogonal
from kfac_func.step.precondition import precondition_grads
from kfac_func.step.sync_free import report_skipped

__all__ = [
    "AdaptiveInfo",
    "DecayPerStep",
    "GrowingInterval",
    "NonFiniteError",
    "Orthogonal",
    "StepOptions",
    "accumulate_factors",
    "adapt_damping",
    "adaptive_step",
    "correct_eigenvalues",
    "curvature_gram",
    "damping_due",
    "exp_decay_factor_averaging",
    "init_adaptive",
    "precondition_grads",
    "report_skipped",
]
