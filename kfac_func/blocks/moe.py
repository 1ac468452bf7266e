"""Mixture-of-experts layers: the experts of one layer as stacked Linear layers with
per-expert factors, and the router as a Linear.

Hugging Face ``transformers`` (5.x: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, ...) stores the
experts of one layer in one module with two 3-d parameters, experts stacked:
``gate_up_proj`` ``(E, 2·I, d)`` (each expert's gate and up projections, concatenated) and
``down_proj`` ``(E, d, I)``, called as ``experts(hidden (S, d), top_k_index (S, k),
top_k_weights (S, k))``. Expert ``e`` maps each token ``t`` routed to it (``e`` among the
token's ``top_k_index``, with weight ``w_te``) to

    h = x_t W_up[e]ᵀ,   u = act(h[:I]) · h[I:],   y = u W_down[e]ᵀ,   out_t += w_te · y.

Each projection is a layer of kind ``"moe"``: ``<experts>.gate_up_proj`` and
``<experts>.down_proj``, with one ``(A, G)`` pair per expert from the tokens routed to it,
stored stacked on a leading dimension of ``E`` (as a grouped convolution's), so that the
grouped step computes the experts of a layer together. Per expert, with the ``"fisher"``
convention, ``A_e = Σ_{t→e} a aᵀ / n_e`` averages the expert's ``n_e`` input rows and
``G_e = Σ_{t→e} r rᵀ / (N c²)`` sums its output-gradient rows over the batch's ``N``
examples, as a Linear's over its positions: for a batch of one token, ``G_e ⊗ A_e`` is the
expert's Fisher block. The output-gradient of the down projection is the gradient of ``y``,
which carries the routing weight: ``∂L/∂y_t = w_te · ∂L/∂out_t``. An expert that no token
reached has ``A_e = 0`` and ``G_e = 0`` in that batch (its gradient is zero). The A
statistics carry each expert's row count, so that several micro-batches (or processes)
pool each expert's A weighted by the rows routed to it there: ``A_e`` is the mean over
all of the expert's rows in the window, however they fall into micro-batches and ranks
(G, a sum over each example's rows, pools by examples as every layer's).

The module's forward (a loop over experts, ``torch._grouped_mm``, batched matmuls: the
``experts_implementation`` of the config) is not observed from inside. While statistics
are collected, a forward hook recomputes the module's output from its inputs the kind's
way (tokens sorted by expert, one product per expert, the module's own gate function),
reporting the two projections' inputs and outputs, and checks it against the module's
output (an error names the module when they differ beyond rounding); the module's values
are returned, its gradient flows through the recomputation. Without statistics the module
runs alone. Layouts other than ``gate_up`` concatenated, not transposed, without biases
and without a norm after the experts are skipped with their reason.

The router (``MixtralTopKRouter``, ``Qwen2MoeTopKRouter``: a ``weight`` ``(E, d)`` used as
``F.linear(x, weight)``, then softmax and top-k) is a Linear (kind ``"router"``, the
statistics of :class:`~kfac_func.blocks.linear.LinearBlock`): its one ``F.linear`` call is
observed while its forward runs, the output-gradient being that of the logits.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kfac_func.blocks.base import JointBlock
from kfac_func.blocks.checks import forward_source
from kfac_func.blocks.linear import LinearBlock
from kfac_func.blocks.registry import register_block
from kfac_func.blocks.spec import Gram, LayerSpec
from kfac_func.blocks.taps import Site

__all__ = ["ExpertsBlock", "RouterBlock"]

_PARTS = ("gate_up_proj", "down_proj")


@register_block
class ExpertsBlock(JointBlock):
    """The fused experts of a mixture-of-experts layer: two stacked projections, per-expert
    factors (see the module docstring).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from kfac_func.blocks import register
        >>> class Experts(nn.Module):
        ...     def __init__(self, e=4, d=6, i=3):
        ...         super().__init__()
        ...         self.num_experts, self.act_fn = e, nn.SiLU()
        ...         self.gate_up_proj = nn.Parameter(torch.randn(e, 2 * i, d))
        ...         self.down_proj = nn.Parameter(torch.randn(e, d, i))
        >>> table = register(Experts())
        >>> [(name, spec.kind) for name, spec in table.items()]
        [('gate_up_proj', 'moe'), ('down_proj', 'moe')]
        >>> [spec.factor_shapes for spec in table.values()]
        [((4, 6, 6), (4, 6, 6)), ((4, 3, 3), (4, 6, 6))]
    """

    kind = "moe"
    routed = True
    orthogonalizable = True
    taps = True
    recomputes = True
    checks_itself = True
    model_parallel = False

    def matches(self, module: nn.Module) -> bool:
        return all(isinstance(module._parameters.get(p), torch.Tensor) for p in _PARTS) and (
            hasattr(module, "act_fn") or callable(getattr(module, "_apply_gate", None))
        )

    def spec(self, name: str, module: nn.Module) -> LayerSpec | str:
        specs = self.specs(name, module)
        return specs if isinstance(specs, str) else specs[0]

    def specs(self, name: str, module: nn.Module) -> list[LayerSpec] | str:
        why = _unsupported_layout(module)
        if why is not None:
            return f"{type(module).__name__}: {why}; its parameters are left to the other optimizer"
        up, down = _weights(module)
        e = up.shape[0]
        prefix = f"{name}." if name else ""
        return [
            LayerSpec(
                f"{prefix}{part}",
                self.kind,
                f"{prefix}{part}",
                None,
                e * w.shape[2],
                e * w.shape[1],
                groups=e,
                options=(("module", name), ("part", part)),
            )
            for part, w in zip(_PARTS, (up, down))
        ]

    def weight_shape(self, spec: LayerSpec) -> tuple[int, ...]:
        e = spec.groups
        return (e, spec.out_dim // e, spec.in_dim // e)

    def notes(self, spec: LayerSpec) -> list[str]:
        return [f"{spec.groups} experts", *super().notes(spec)[1:]]

    def examples(self, spec: LayerSpec, x: torch.Tensor) -> int | None:
        """The routed rows do not tell (the other layers say the batch size)."""
        return None

    def joint_grams(
        self, spec: LayerSpec, x: torch.Tensor, r: torch.Tensor, dtype: torch.dtype
    ) -> tuple[Gram, Gram]:
        """Per-expert statistics of one call: ``x`` holds the routed rows sorted by expert
        with the expert of each row as a last column, ``r`` their output-gradients. The A
        Gram carries each expert's row count (``groups``), its factor being each expert's
        mean over its own rows (:func:`~kfac_func.core.factors.mean_over_rows`).

        Example:
            >>> import torch
            >>> from kfac_func.blocks import register
            >>> spec = register(_example())["gate_up_proj"]
            >>> x = torch.tensor([[1.0, 0, 0, 0, 0, 0, 0], [3, 0, 0, 0, 0, 0, 2]])
            >>> a, g = spec.block.joint_grams(spec, x, torch.ones(2, 6), torch.float64)
            >>> a.gram[[0, 2], 0, 0].tolist(), a.groups.tolist(), g.gram[:3, 0, 0].tolist()
            ([1.0, 9.0], [1.0, 0.0, 1.0, 0.0], [1.0, 0.0, 1.0])
        """
        e = spec.groups
        ids = x[:, -1].round().long()
        rows = x[:, :-1].to(dtype)
        r = r.to(dtype)
        counts = torch.bincount(ids, minlength=e)
        if counts.numel() != e or bool((ids[1:] < ids[:-1]).any()):
            raise ValueError(
                f"layer {spec.name!r} (moe): its rows are not sorted by expert within "
                f"[0, {e}) (the experts' ids did not survive the input's dtype {x.dtype})"
            )
        sizes = counts.tolist()
        total = x.shape[0]
        a = rows.new_zeros(e, rows.shape[1], rows.shape[1])
        g = r.new_zeros(e, r.shape[1], r.shape[1])
        for k, (xe, ge) in enumerate(zip(torch.split(rows, sizes), torch.split(r, sizes))):
            if sizes[k]:
                a[k] = xe.T @ xe
                g[k] = ge.T @ ge
        return Gram(a, total, 1, groups=counts.to(dtype)), Gram(g, total, 1)

    def recompute(
        self,
        module: nn.Module,
        specs: Sequence[LayerSpec],
        site: Site,
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
        out: Any,
    ) -> torch.Tensor:
        """The module's output recomputed the kind's way from its call's inputs, with the
        two projections reported to ``site`` (see the module docstring): the module's
        values, the recomputation's gradient."""
        parts = {spec.option("part"): spec for spec in specs}
        name = specs[0].module
        hidden, index, weights = _routing(name, module, args, kwargs)
        up, down = _weights(module)
        e = up.shape[0]
        if not isinstance(out, torch.Tensor) or out.shape != hidden.shape:
            raise RuntimeError(
                f"layer {name!r} (moe, {type(module).__name__}): its output "
                f"{_shape(out)} is not one row per token of its input {tuple(hidden.shape)}"
            )
        if e > 2 / torch.finfo(hidden.dtype).eps:  # the largest id held exactly
            raise RuntimeError(
                f"layer {name!r} (moe): {e} experts cannot be told apart in {hidden.dtype}"
            )
        k = index.shape[1]
        flat = index.reshape(-1)
        if bool(((flat < 0) | (flat >= e)).any()):
            raise RuntimeError(
                f"layer {name!r} (moe): its top_k_index holds experts outside [0, {e}) "
                "(expert parallelism's placeholders are not supported)"
            )
        order = torch.argsort(flat, stable=True)
        sizes = torch.bincount(flat, minlength=e).tolist()
        token = order // k
        ids = flat[order].to(hidden.dtype)[:, None]
        x = hidden[token]
        h = _per_expert(x, up, sizes)
        h = site(parts["gate_up_proj"], torch.cat([x.detach(), ids], dim=-1), h)
        u = _gate(module, h)
        y = _per_expert(u, down, sizes)
        y = site(parts["down_proj"], torch.cat([u.detach(), ids], dim=-1), y)
        w = weights.reshape(-1)[order, None]
        ours = hidden.new_zeros(hidden.shape).index_add(0, token, (y * w).to(hidden.dtype))
        _check(name, module, ours, out, up.shape[1] + up.shape[2])
        return ours + (out - ours).detach()


def _example() -> nn.Module:
    """The docstrings' experts: 4 experts, d 6, I 3."""
    m = nn.Module()
    m.act_fn = nn.SiLU()
    m.gate_up_proj = nn.Parameter(torch.zeros(4, 6, 6))
    m.down_proj = nn.Parameter(torch.zeros(4, 6, 3))
    return m


def _weights(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """``(gate_up_proj, down_proj)`` as the module holds them now (the tensors a
    functional call substitutes, inside one)."""
    up, down = module.gate_up_proj, module.down_proj
    assert isinstance(up, torch.Tensor) and isinstance(down, torch.Tensor)
    return up, down


def _unsupported_layout(module: nn.Module) -> str | None:
    """Why the experts' layout is not the one the kind computes, or None."""
    up, down = module._parameters["gate_up_proj"], module._parameters["down_proj"]
    assert up is not None and down is not None
    flags = {
        "is_transposed": (False, "its weights are stored transposed"),
        "is_concatenated": (True, "its gate and up rows are interleaved"),
        "has_gate": (True, "it has no gate projection"),
        "has_bias": (False, "its projections have biases"),
        "has_post_expert_norm": (False, "it normalises each expert's output"),
    }
    for attr, (want, why) in flags.items():
        if bool(getattr(module, attr, want)) != want:
            return why
    extra = sorted(set(module._parameters) - set(_PARTS))
    if extra:
        return f"it has parameters besides gate_up_proj and down_proj: {extra}"
    if up.dim() != 3 or down.dim() != 3:
        return f"gate_up_proj {tuple(up.shape)} and down_proj {tuple(down.shape)} are not 3-d"
    e, two_i, d = up.shape
    if two_i % 2 or tuple(down.shape) != (e, d, two_i // 2):
        return (
            f"gate_up_proj {tuple(up.shape)} and down_proj {tuple(down.shape)} are not "
            "(E, 2*I, d) and (E, d, I)"
        )
    n = getattr(module, "num_experts", e)
    if not isinstance(n, int) or n != e:
        return f"num_experts is {n} but its weights hold {e} experts"
    return None


def _routing(
    name: str, module: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(hidden_states, top_k_index, top_k_weights)`` of one call, by position or name."""
    names = ("hidden_states", "top_k_index", "top_k_weights")
    values = list(args[:3]) + [kwargs.get(n) for n in names[len(args[:3]) :]]
    hidden, index, weights = values
    ok = (
        isinstance(hidden, torch.Tensor)
        and isinstance(index, torch.Tensor)
        and isinstance(weights, torch.Tensor)
        and hidden.dim() == 2
        and index.dim() == 2
        and weights.shape == index.shape
        and index.shape[0] == hidden.shape[0]
    )
    if not ok:
        got = ", ".join(_shape(v) for v in values)
        raise RuntimeError(
            f"layer {name!r} (moe, {type(module).__name__}): expected a call "
            "(hidden_states (S, d), top_k_index (S, k), top_k_weights (S, k)), got " + got
        )
    assert isinstance(hidden, torch.Tensor) and isinstance(index, torch.Tensor)
    assert isinstance(weights, torch.Tensor)
    return hidden, index, weights


def _shape(v: Any) -> str:
    return str(tuple(v.shape)) if isinstance(v, torch.Tensor) else type(v).__name__


def _per_expert(x: torch.Tensor, w: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """Rows sorted by expert, each block of ``sizes[e]`` rows times ``w[e]ᵀ``."""
    pieces = [xe @ w[k].T for k, xe in enumerate(torch.split(x, sizes)) if sizes[k]]
    if not pieces:
        return x.new_zeros(0, w.shape[1])
    return torch.cat(pieces, dim=0)


def _gate(module: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """The module's gate between the projections: its ``_apply_gate`` if it has one, else
    ``act_fn(gate) * up`` of the two halves."""
    apply = getattr(module, "_apply_gate", None)
    if callable(apply):
        return apply(h)  # type: ignore[no-any-return]
    gate, up = h.chunk(2, dim=-1)
    return module.act_fn(gate) * up  # type: ignore[operator,no-any-return]


def _check(name: str, module: nn.Module, ours: torch.Tensor, out: torch.Tensor, width: int) -> None:
    """An error naming the module when its output differs from the recomputation by more
    than rounding: ``32·eps·sqrt(width)`` times the output's largest entry (sums of
    ``width``-long products, in another order)."""
    diff = float((out.detach() - ours.detach()).abs().max()) if out.numel() else 0.0
    scale = max(1.0, float(out.detach().abs().max())) if out.numel() else 1.0
    tol = 32 * torch.finfo(out.dtype).eps * math.sqrt(width) * scale
    if not diff <= tol:
        raise RuntimeError(
            f"layer {name!r} ({type(module).__name__}, kind 'moe'): its output differs from "
            f"what the kind computes from its inputs by {diff:.3g} (rounding allows "
            f"{tol:.3g}): it does not compute act(gate)*up of gate_up_proj, then down_proj, "
            "weighted by top_k_weights. Leave it out with skip_layers=[...]"
        )


@register_block
class RouterBlock(LinearBlock):
    """The router of a mixture-of-experts layer (a ``weight`` ``(E, d)`` used as
    ``F.linear(x, weight)`` inside a forward that returns logits, weights and indices): a
    Linear whose call is observed while the forward runs.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import torch.nn.functional as F
        >>> from kfac_func.blocks import register
        >>> class TopKRouter(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.top_k, self.num_experts = 2, 4
        ...         self.weight = nn.Parameter(torch.randn(4, 6))
        ...     def forward(self, x):
        ...         logits = F.linear(x, self.weight)
        ...         return logits, *torch.topk(logits.softmax(-1), self.top_k)
        >>> spec = register(TopKRouter())[""]
        >>> spec.kind, spec.factor_shapes
        ('router', ((6, 6), (4, 4)))
    """

    kind = "router"
    module_types: tuple[type[nn.Module], ...] = ()
    taps = True
    has_rows = False
    tensor_parallel = False
    model_parallel = False
    reducible = False
    mappable = False
    checks_itself = True

    def matches(self, module: nn.Module) -> bool:
        """A module named ``...Router`` whose one parameter is ``weight (E, d)``, ``E`` its
        ``num_experts``, and whose ``forward`` applies ``F.linear`` to it as written
        (``linear(hidden_states, self.weight)``); routers that compute their logits
        otherwise (in another dtype, with a bias or a correction) are not matched."""
        w = module._parameters.get("weight")
        return (
            type(module).__name__.endswith("Router")
            and isinstance(w, torch.Tensor)
            and w.dim() == 2
            and set(module._parameters) == {"weight"}
            and getattr(module, "num_experts", None) == w.shape[0]
            and _linear_on_weight(type(module))
        )

    def spec(self, name: str, module: nn.Module) -> LayerSpec | str:
        w = module._parameters["weight"]
        assert w is not None
        prefix = f"{name}." if name else ""
        e, d = w.shape
        return LayerSpec(name, self.kind, f"{prefix}weight", None, d, e)

    def tap(
        self,
        module: nn.Module,
        specs: Sequence[LayerSpec],
        site: Site,
    ) -> contextlib.AbstractContextManager[None]:
        return _router_tap(module, specs[0], site)


def _linear_on_weight(cls: type[nn.Module]) -> bool:
    """Whether ``cls.forward``'s source calls ``linear(<name>, self.weight)``."""
    pattern = r"\blinear\(\s*\w+\s*,\s*self\.weight\s*\)"
    return re.search(pattern, forward_source(cls)) is not None


@contextlib.contextmanager
def _router_tap(module: nn.Module, spec: LayerSpec, site: Site) -> Iterator[None]:
    """Route the router's ``F.linear`` call on its own weight to ``site``."""
    original = F.linear
    seen = 0

    def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Any:
        nonlocal seen
        y = original(x, weight, bias)
        if weight is not module.weight or bias is not None:
            return y
        seen += 1
        return site(spec, x, y)

    F.linear = linear  # type: ignore[assignment]
    try:
        yield
    finally:
        F.linear = original
    if seen != 1:
        raise RuntimeError(
            f"layer {spec.name!r} ({type(module).__name__}, kind 'router'): its forward made "
            f"{seen} F.linear calls on its weight; K-FAC expects one (the router's logits). "
            "Leave it out with skip_layers=[...]"
        )
