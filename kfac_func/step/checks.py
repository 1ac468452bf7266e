"""Checks of the gradients before they are preconditioned.

Every layer's gradients must be present with the layer's shapes (an error names the layer
otherwise); whether rows are worth using instead of the gradient matrix. The checks of
the values themselves (finiteness, rows reproducing the gradient) are the preconditioning
stage's, computed on the device (:mod:`kfac_func.step.grouped`).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from kfac_func.blocks import LayerSpec, Rows, grads_to_matrix
from kfac_func.core.attempts import all_finite
from kfac_func.state import LayerState
from kfac_func.step.hyper import NonFinite, non_finite

__all__ = [
    "check_grads_mapping",
    "grads_finite",
    "layer_grads",
    "layer_matrix",
    "rows_cheaper",
    "rows_cheaper_count",
    "validate_grads",
]


def layer_grads(
    spec: LayerSpec, grads: Mapping[str, torch.Tensor], checked: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The layer's ``(weight, bias)`` gradients; errors name the layer, missing keys and
    shapes unless ``checked`` (by :func:`validate_grads`; see
    :meth:`kfac_func.blocks.LayerBlock.param_grads`)."""
    return spec.block.param_grads(spec, grads, checked)


def layer_matrix(ls: LayerState, grads: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The layer's gradient matrix; errors name the layer, missing keys and shapes."""
    return grads_to_matrix(ls.spec, *layer_grads(ls.spec, grads))


def rows_cheaper(spec: LayerSpec, rows: Rows | None) -> bool:
    """Whether a layer's rows make preconditioning cheaper than its matrix:
    ``n(d_out² + d_in² + d_out·d_in) < d_out·d_in(d_out + d_in)`` for ``n`` rows."""
    if not rows:
        return False
    return rows_cheaper_count(spec, sum(a.shape[0] for a, _ in rows))


def rows_cheaper_count(spec: LayerSpec, n: int) -> bool:
    """:func:`rows_cheaper` for ``n`` rows in all.

    Example:
        >>> from torch import nn
        >>> from kfac_func.blocks import register
        >>> spec = register(nn.Linear(256, 256, bias=False))[""]
        >>> rows_cheaper_count(spec, 64), rows_cheaper_count(spec, 512)
        (True, False)
    """
    if not spec.block.has_rows or any(spec.diagonal):
        return False
    o, i = spec.g_dim, spec.a_dim
    return n * (o * o + i * i + o * i) < o * i * (o + i)


def check_grads_mapping(grads: object) -> None:
    """Raise a TypeError unless ``grads`` is a mapping (``{parameter name: tensor}``)."""
    if not isinstance(grads, Mapping):
        raise TypeError(
            "grads must be a mapping of parameter name -> gradient tensor (as "
            f"kfac_func.capture returns it), got {type(grads).__name__}"
        )


def validate_grads(layers: Mapping[str, LayerState], grads: Mapping[str, torch.Tensor]) -> None:
    """Raise a ValueError naming the layer unless ``grads`` holds every layer's gradients
    with the layer's shapes (no computation, no host synchronisation); a TypeError unless
    ``grads`` is a mapping."""
    check_grads_mapping(grads)
    for ls in layers.values():
        layer_grads(ls.spec, grads)


def grads_finite(name: str, spec: LayerSpec, m: torch.Tensor, mode: NonFinite) -> bool:
    """True if the gradient matrix is finite; else warn (``"skip"``) or raise."""
    if all_finite(m):
        return True
    non_finite(name, f"the gradients of {list(spec.param_names())}", mode)
    return False
