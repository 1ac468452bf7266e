"""Exact products with the Gauss–Newton matrix of a batch, by forward-mode differentiation.

``vᵀ C w`` with ``C = JᵀHJ``: ``Jv`` is a ``torch.func.jvp`` of the model's outputs with
respect to its parameters through ``functional_call`` (buffers are cloned, so BatchNorm
running statistics are not updated by these extra forwards), ``H(Jw)`` a product with the
Hessian of the loss with respect to the outputs (:mod:`kfac_func.core.output_hessian`).
No derivative over the parameters in reverse mode, no matrix over them, is formed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from kfac_func.core.functional import functional_call
from kfac_func.core.output_hessian import OutputLoss, Reduction, output_hvp
from kfac_func.core.quadratic import inner

__all__ = ["Tensors", "curvature_gram", "same_keys"]

Tensors = Mapping[str, torch.Tensor]


def same_keys(name: str, tensors: Tensors, params: Tensors) -> None:
    """Raise a ValueError naming ``name`` unless ``tensors`` matches ``params`` key by key."""
    missing = [k for k in params if k not in tensors]
    extra = [k for k in tensors if k not in params]
    if missing or extra:
        raise ValueError(
            f"{name} must have the keys of params: missing {missing}, unexpected {extra}"
        )
    bad = [k for k, p in params.items() if tensors[k].shape != p.shape]
    if bad:
        raise ValueError(f"{name}: shapes differ from those of params for {bad}")


def curvature_gram(
    model: nn.Module,
    params: Tensors,
    args: Any,
    vectors: Sequence[Tensors],
    *,
    loss: OutputLoss = "cross_entropy",
    loss_reduction: Reduction = "mean",
    kwargs: dict[str, Any] | None = None,
    buffers: Tensors | None = None,
) -> torch.Tensor:
    """``[vᵢᵀ C vⱼ]``: the Gram matrix (k×k, float64) of ``vectors`` under the Gauss–Newton
    matrix ``C = JᵀHJ`` of ``loss`` at ``params`` (one forward-mode pass per vector).

    ``model`` is called as ``functional_call(model, (params, buffers), args, kwargs)`` and
    must return one tensor; ``loss`` is ``"cross_entropy"`` (logits, classes last),
    ``"mse"`` (both as in ``torch.nn.functional`` with ``loss_reduction``) or a callable
    ``outputs -> scalar``. Each vector is keyed like ``params``.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import kfac_func as kf
        >>> model = nn.Linear(3, 2, bias=False)
        >>> params = dict(model.named_parameters())
        >>> v = {"weight": torch.ones(2, 3)}
        >>> g = kf.step.curvature_gram(model, params, torch.ones(4, 3), [v], loss="mse")
        >>> g  # Jv = 3 everywhere on 4×2 outputs, H = 2I/8: 8 · 9 · 2/8
        tensor([[18.]], dtype=torch.float64)
    """
    names = list(params)
    for i, v in enumerate(vectors):
        same_keys(f"vectors[{i}]", v, params)
    primals = {k: p.detach() for k, p in params.items()}
    bufs = dict(model.named_buffers()) if buffers is None else dict(buffers)
    args = args if isinstance(args, tuple) else (args,)

    def forward(p: dict[str, torch.Tensor]) -> torch.Tensor:
        out = functional_call(model, (p, {k: b.clone() for k, b in bufs.items()}), args, kwargs)
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"the model must return one tensor, got {type(out).__name__}")
        return out

    jvs, hvs = [], []
    for v in vectors:
        tangent = {k: v[k].detach().to(primals[k].dtype) for k in names}
        # attention's fused kernels have no forward-mode derivative; its math kernel has
        with sdpa_kernel(SDPBackend.MATH):
            out, jv = torch.func.jvp(forward, (primals,), (tangent,))  # type: ignore[misc]
        jvs.append(jv)
        hvs.append(output_hvp(loss, out.detach(), jv, reduction=loss_reduction))
    k = len(vectors)
    gram = torch.stack([inner([jvs[i]], [hvs[j]]) for i in range(k) for j in range(k)])
    gram = gram.reshape(k, k)
    return (gram + gram.T) / 2
