"""A check that the statistics hooks saw what the gradients saw.

The preconditioner's statistics come from module hooks; a model whose module calls do
not reach them (code compiled before the hooks existed, a forward that bypasses
``Module.__call__``, hooks removed by other code) would get gradients but no statistics,
and K-FAC would silently precondition with stale factors, or not at all. Gradient
accumulation is seen by the autograd engine whatever ran the forward, so a hook on each
layer's weight (``register_post_accumulate_grad_hook``) notes the layers whose weights
received gradients on a factor-update step; :func:`warn_uncollected` names those that got
no statistics.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Mapping

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from kfac_func.blocks import LayerSpec

__all__ = ["MissingStatisticsWarning", "warn_uncollected", "watch_gradients"]


class MissingStatisticsWarning(RuntimeWarning):
    """Layers received gradients on a factor-update step but no statistics were recorded
    for them (turn it into an error with ``warnings.simplefilter("error", ...)``)."""


def watch_gradients(
    model: nn.Module,
    layers: Mapping[str, LayerSpec],
    seen: Callable[[], set[str] | None],
) -> list[RemovableHandle]:
    """Hooks that add a layer's name to ``seen()`` when its weight accumulates a gradient
    (nothing when ``seen()`` is None: not a step that collects statistics).

    Example:
        >>> from kfac_func.blocks import register
        >>> net = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1))
        >>> names: set[str] = set()
        >>> handles = watch_gradients(net, register(net), lambda: names)
        >>> net(torch.ones(4, 2)).sum().backward()
        >>> sorted(names)
        ['0', '1']
    """

    def hook(name: str) -> Callable[[torch.Tensor], None]:
        def mark(param: torch.Tensor) -> None:
            names = seen()
            if names is not None:
                names.add(name)

        return mark

    handles = []
    for name, spec in layers.items():
        weight = model.get_parameter(spec.weight)
        if weight.is_leaf and weight.requires_grad:
            handles.append(weight.register_post_accumulate_grad_hook(hook(name)))  # type: ignore[no-untyped-call]
    return handles


def warn_uncollected(seen: set[str], collected: Iterable[str], step: int) -> list[str]:
    """Warn (:class:`MissingStatisticsWarning`) naming the layers in ``seen`` (weights that
    received gradients) missing from ``collected`` (layers with statistics); returns them.

    Example:
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     warn_uncollected({"fc1", "fc2"}, ["fc1"], step=4)
        ['fc2']
        >>> print(caught[0].message)  # doctest: +ELLIPSIS
        step 4 updates factors, but layers ['fc2'] received gradients and no statistics: ...
    """
    missing = sorted(seen.difference(collected))
    if missing:
        warnings.warn(
            f"step {step} updates factors, but layers {missing} received gradients and no "
            "statistics: their module calls did not reach the preconditioner's hooks (code "
            "compiled before the preconditioner was built, a forward that bypasses "
            "Module.__call__, or hooks removed); their factors are not updated",
            MissingStatisticsWarning,
            stacklevel=4,  # the caller of step()
        )
    return missing
