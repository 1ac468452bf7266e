"""The K-FAC step as pure stages over a :class:`~kfac_func.state.KFACState`.

``update`` (:mod:`kfac_func.step.update`) = accumulate (:mod:`~kfac_func.step.accumulate`)
→ decompose (:mod:`~kfac_func.step.decompose`) → precondition
(:mod:`~kfac_func.step.precondition`, after the gradient checks of
:mod:`~kfac_func.step.checks`). Shared hyperparameter handling is in
:mod:`~kfac_func.step.hyper`. The public names are re-exported by :mod:`kfac_func`.
"""
