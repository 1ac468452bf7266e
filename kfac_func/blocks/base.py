"""The layer-kind protocol: what K-FAC needs to know about one kind of layer.

A :class:`~kfac_func.blocks.spec.LayerSpec` is the static, hashable description of one
registered layer. Its ``kind`` names a :class:`LayerBlock`, a stateless object that knows
everything specific to that kind:

- which modules it handles and the spec of one (:meth:`LayerBlock.spec`);
- the side of each Kronecker factor and the shape of the weight;
- the Gram statistics of one call's inputs and output-gradients
  (:meth:`LayerBlock.a_gram`, :meth:`LayerBlock.g_gram`), from which the conventions of
  :mod:`kfac_func.core.conventions` make the factors;
- the number of examples a call's input holds (:meth:`LayerBlock.examples`), from which
  the adapters and the capture tell a batch's size;
- the gradient as a matrix ``(*batch_shape, g_dim, a_dim)`` and back;
- optionally the rows of each call for the low-rank preconditioning path
  (:attr:`LayerBlock.has_rows`), whether Megatron-style tensor parallelism may split its
  features (:attr:`LayerBlock.tensor_parallel`), statistics of a call's input and
  gradient together (:attr:`LayerBlock.joint`), several layers observed inside one
  module's forward (:attr:`LayerBlock.taps`) and the reduce approximation
  (:attr:`LayerBlock.reducible`).

Blocks register themselves by kind with
:func:`~kfac_func.blocks.registry.register_block`; every module of
:mod:`kfac_func.blocks` is imported when the package is, so adding a kind is one new module
there. Pure tensor functions: no hook, no process group.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Mapping, MutableMapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, ClassVar

import torch
from torch import nn

from kfac_func.blocks.spec import CheckedCall, Gram, LayerSpec, cast, shape_error
from kfac_func.blocks.used_weights import WeightUseTap

__all__ = ["JointBlock", "LayerBlock"]


class LayerBlock(ABC):
    """Everything K-FAC needs to know about one kind of layer (stateless; one instance per
    kind, registered with :func:`register_block`).

    Subclasses set :attr:`kind` and :attr:`module_types` and implement :meth:`spec`,
    :meth:`weight_shape`, :meth:`a_gram` and :meth:`g_gram`; the rest has defaults that
    fit layers whose weight is ``(out, in_per_group, *kernel)`` with an optional bias.
    """

    kind: ClassVar[str]
    """The name stored in :attr:`LayerSpec.kind` (and in checkpoints)."""

    module_types: tuple[type[nn.Module], ...] = ()
    """Module classes (and their subclasses) this kind handles."""

    has_rows: ClassVar[bool] = False
    """Whether :meth:`rows` exists: the gradient is ``Σ gᵀ[a, 1]`` over the calls' rows, so
    preconditioning may use the rows instead of the gradient matrix."""

    tensor_parallel: ClassVar[bool] = False
    """Whether inputs and output-gradients hold the features on their last dimension, so
    that Megatron-style column/row parallelism may split them there."""

    taps: ClassVar[bool] = False
    """Whether the layer's calls happen inside its module's forward, reported by
    :meth:`tap` (attention projections), instead of being the module's own calls."""

    recomputes: ClassVar[bool] = False
    """Whether, with :attr:`taps`, the layers' calls are reported by :meth:`recompute`
    after the module's forward (which it cannot observe from inside: fused experts)."""

    checks_itself: ClassVar[bool] = False
    """Whether the kind checks every observed call itself (:meth:`tap` or
    :meth:`recompute` raise on a call other than the kind's, or a tap refuses it with
    :class:`~kfac_func.blocks.taps.RefusedCall`), so that a module it recognises needs no
    first-call check (:mod:`kfac_func.blocks.checks`)."""

    routed: ClassVar[bool] = False
    """Whether each group of the layer's stacked factors sees only the rows routed to it
    (a mixture's experts, :mod:`kfac_func.blocks.moe`): its A Grams carry the rows of
    each group (:class:`~kfac_func.blocks.spec.Gram`), and windows of several ranks are
    pooled group by group."""

    reducible: ClassVar[bool] = False
    """Whether the kind offers ``kfac_approx="reduce"`` (Eschenhagen et al., 2023): the
    inputs averaged and the output-gradients summed over the positions that share the
    weight, one row per example (see :meth:`reduced`)."""

    orthogonalizable: ClassVar[bool] = False
    """Whether the layer's gradient matrix is one weight matrix (a linear map, a
    convolution's), whose step may be orthogonalized as Muon's (see
    :mod:`kfac_func.step.orthogonal`); embeddings, norms and tied layers are not."""

    model_parallel: ClassVar[bool] = True
    """Whether the model-parallel preconditioner supports the kind."""

    stacked_uses: ClassVar[int] = 0
    """How many uses of one weight the batch factors stack (on a leading dimension) until a
    window's factors are summed and averaged over ranks, to be combined then into the
    layer's (a tied embedding and head: 2); 0: batch factors have the layer's shapes."""

    joint: ClassVar[bool] = False
    """Whether the statistics of a call need its input and its output-gradient together
    (:meth:`joint_grams`; norms: the scale's gradient is the normalised input times the
    output-gradient) instead of one from each (:meth:`a_gram`, :meth:`g_gram`)."""

    mappable: ClassVar[bool] = False
    """Whether ``register(..., kinds={cls: kind})`` may map a module class of the user's to
    this kind (:mod:`kfac_func.blocks.mapped`): the kind implements :meth:`mapped_spec`
    and :meth:`output`."""

    mapped_options: ClassVar[tuple[str, ...]] = ()
    """The options ``kinds={cls: (kind, {option: value})}`` may give (a norm's ``eps``)."""

    placeholder_a: ClassVar[bool] = False
    """Whether the A side is a placeholder: the ``1 × 1`` identity by construction (norms,
    whose unit blocks live wholly in G), not a curvature factor. A placeholder side is
    neither damped nor inverted: every method applies it as the identity, so that the
    inverse method solves ``(G + λI) x = m`` as the eigen method does (see
    :attr:`LayerSpec.placeholder`)."""

    # --- registration --------------------------------------------------------------

    def matches(self, module: nn.Module) -> bool:
        """Whether this kind handles ``module``."""
        return isinstance(module, self.module_types)

    @abstractmethod
    def spec(self, name: str, module: nn.Module) -> LayerSpec | str:
        """The spec of ``module`` (registered as ``name``), or why it cannot be handled."""

    def mapped_spec(self, name: str, module: nn.Module, options: Mapping[str, Any]) -> LayerSpec:
        """The spec of a module of a class ``kinds=`` maps to this kind (only if
        :attr:`mappable`), from its parameters and ``options``; a ValueError names the
        module unless its parameters are those the kind needs."""
        raise ValueError(f"layer kind {self.kind!r} cannot be given to a module class")

    def output(
        self, spec: LayerSpec, params: Mapping[str, torch.Tensor], x: torch.Tensor
    ) -> torch.Tensor:
        """The output of one call as this kind computes it from the input ``x`` and the
        layer's ``{"weight": ..., "bias": ...}`` (only if :attr:`mappable`): what the first
        call of a mapped module is checked against."""
        raise NotImplementedError(f"layer kind {self.kind!r} has no output")

    reads_attributes: ClassVar[bool] = False
    """Whether the spec of a module reads attributes that the forward of the kind's torch
    class does not use (an embedding's ``embed_scale``): every module of the kind is then
    checked on its first call, those of the torch class itself included."""

    formula_text: ClassVar[str] = ""
    """What the kind computes, as messages write it (``"weight[input]"``)."""

    @property
    def checkable(self) -> bool:
        """Whether the kind computes a call's output (:meth:`output`), so that the first
        call of a module it handles can be checked against it.

        Example:
            >>> from kfac_func.blocks import block_of
            >>> block_of("linear").checkable, block_of("conv2d").checkable
            (True, False)
        """
        return type(self).output is not LayerBlock.output

    def formula(self, spec: LayerSpec) -> str:
        """What the layer computes from its input, as messages write it.

        Example:
            >>> import torch
            >>> from kfac_func.blocks import register
            >>> spec = register(torch.nn.Embedding(3, 2))[""]
            >>> spec.block.formula(spec)
            'weight[input]'
        """
        return self.formula_text or f"what kind {self.kind!r} computes"

    def checked_calls(self, spec: LayerSpec) -> list[tuple[str, LayerSpec, bool]]:
        """``[(module name, spec, mapped)]``: the modules whose first call is checked for
        the layer ``spec`` (:func:`kfac_func.blocks.checks.check_hooks`), each with the spec
        whose :meth:`output` the module's output must equal, and whether ``kinds=`` (or
        :data:`~kfac_func.blocks.mapped.KNOWN_KINDS`) mapped it (a mismatch is then an
        error, else the layer is refused). By default the layer's own module, when it was
        mapped or when its class is not the kind's own (option ``"checked"``).

        Example:
            >>> import torch
            >>> from kfac_func.blocks import register
            >>> class Own(torch.nn.Linear): ...
            >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), Own(2, 2))
            >>> [c[0] for s in register(model).values() for c in s.block.checked_calls(s)]
            ['1']
        """
        if spec.option("mapped") is not None:
            return [(spec.module, spec, True)]
        if spec.option("checked") is not None:
            return [(spec.module, spec, False)]
        return []

    def mismatch_hint(self, spec: LayerSpec, call: CheckedCall) -> str | None:
        """What a module computes differently from the kind, when a call's output
        ``call.got`` (float64) differs from :meth:`output` of ``call.x`` by more than
        ``call.tol``: by default, a constant factor (``"it is 4 times what the kind
        computes"``), else None.

        Example:
            >>> import torch
            >>> from kfac_func.blocks import register
            >>> from kfac_func.blocks.spec import CheckedCall
            >>> spec = register(torch.nn.Linear(2, 2, bias=False))[""]
            >>> w, x = {"weight": torch.eye(2, dtype=torch.float64)}, torch.ones(1, 2).double()
            >>> spec.block.mismatch_hint(spec, CheckedCall(w, x, 4 * x, 1e-9))
            'it is 4 times what the kind computes'
        """
        got, tol = call.got, call.tol
        ref = self.output(spec, call.params, call.x)
        den = float((ref * ref).sum())
        if den == 0.0:
            return None
        c = float((got * ref).sum()) / den
        if c == 0.0 or float((got - c * ref).abs().max()) > tol * max(1.0, abs(c)):
            return None
        return f"it is {c:.6g} times what the kind computes"

    def specs(self, name: str, module: nn.Module) -> list[LayerSpec] | str:
        """Every layer ``module`` holds (one, but for modules made of several layers whose
        children are then not registered on their own), or why it cannot be handled."""
        spec = self.spec(name, module)
        return spec if isinstance(spec, str) else [spec]

    def tap(
        self,
        module: nn.Module,
        specs: Sequence[LayerSpec],
        site: Callable[[LayerSpec, torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> AbstractContextManager[None]:
        """While entered (around ``module``'s forward), report each call of the layers in
        ``specs`` as ``site(spec, input, output)``, whose result replaces the output (only
        if :attr:`taps`, or for children whose weights their parent's forward uses: a
        :class:`~kfac_func.blocks.used_weights.WeightUseTap`). A tap that is a
        :class:`~kfac_func.blocks.taps.OutputTap` reports its call once the forward has
        returned, with the module's output."""
        if specs[0].option("used_by_parent"):
            return WeightUseTap(module, specs, site)
        raise NotImplementedError(f"layer kind {self.kind!r} has no taps")

    def recompute(
        self,
        module: nn.Module,
        specs: Sequence[LayerSpec],
        site: Callable[[LayerSpec, torch.Tensor, torch.Tensor], torch.Tensor],
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
        out: Any,
    ) -> Any:
        """After ``module``'s forward on ``(args, kwargs)`` gave ``out``: the output that
        replaces it, recomputed so that each call of the layers in ``specs`` is reported
        as ``site(spec, input, output)`` (only if :attr:`recomputes`)."""
        raise NotImplementedError(f"layer kind {self.kind!r} does not recompute")

    def capturing(self) -> AbstractContextManager[None]:
        """A context the capture of this kind's layers runs in (for kinds whose modules
        have fused fast paths that would hide the calls from :meth:`tap`)."""
        return contextlib.nullcontext()

    # --- shapes --------------------------------------------------------------------

    def a_dim(self, spec: LayerSpec) -> int:
        """Side of one A factor: inputs per group times the kernel area, plus the bias."""
        per_group = spec.in_dim // spec.groups
        for k in spec.kernel_size:
            per_group *= k
        return per_group + int(spec.has_bias)

    def g_dim(self, spec: LayerSpec) -> int:
        """Side of one G factor: outputs per group."""
        return spec.out_dim // spec.groups

    def weight_shape(self, spec: LayerSpec) -> tuple[int, ...]:
        """Shape of the weight parameter: ``(out, in / groups, *kernel_size)`` by default
        (a convolution's; a Linear's ``(out, in)``)."""
        return (spec.out_dim, spec.in_dim // spec.groups, *spec.kernel_size)

    def notes(self, spec: LayerSpec) -> list[str]:
        """What the layer table says about the layer besides its factor shapes."""
        notes = [f"{spec.groups} groups"] if spec.groups > 1 else []
        notes += [f"diagonal {w}" for w, d in zip("AG", spec.diagonal) if d]
        if spec.option("used_by_parent"):  # kfac_func.blocks.used_weights
            bias = ", bias to the other optimizer" if spec.option("bias_apart") else ""
            notes.append(f"weight used in the forward of {spec.module!r}{bias}")
        return notes + (["reduce"] if self.reduced(spec) else [])

    def reduced(self, spec: LayerSpec) -> bool:
        """Whether the layer uses ``kfac_approx="reduce"``."""
        return self.reducible and spec.option("kfac_approx") == "reduce"

    # --- examples ------------------------------------------------------------------

    def examples(self, spec: LayerSpec, x: torch.Tensor) -> int | None:
        """The number of examples one call's input ``x`` holds, or None when the input
        does not tell (a flattened ``(N·T, d)`` input, ids of one unbatched sequence).

        The default fits inputs whose examples are the leading dimension (Linear-like
        ``(N, ..., d)``): ``N`` for inputs of two or more dimensions, 1 for an unbatched
        1-d input. The batch size of a forward pass is what its layers' calls say
        (:class:`kfac_func.blocks.examples.CallExamples`).

        Example:
            >>> import torch
            >>> from kfac_func.blocks import register
            >>> spec = register(torch.nn.Linear(3, 2))[""]
            >>> [spec.block.examples(spec, torch.ones(*s, 3)) for s in ((4, 7), (4,), ())]
            [4, 4, 1]
        """
        return int(x.shape[0]) if x.dim() >= 2 else 1

    def rows_only(self, spec: LayerSpec, x: torch.Tensor) -> bool:
        """Whether the input ``x`` is rows alone: one leading dimension before the
        features, which may be the examples ``(N, d)`` or their positions flattened
        ``(N·T, d)`` (OPT's MLP, a shared expert, the tokens routed to one expert). Such a
        call says the number of examples only when no other call does
        (:class:`~kfac_func.blocks.examples.CallExamples`); its factors do not depend on
        how the rows were grouped. False by default: the kinds whose rows are their
        leading dimensions say so.

        Example:
            >>> import torch
            >>> from kfac_func.blocks import register
            >>> spec = register(torch.nn.Linear(3, 2))[""]
            >>> [spec.block.rows_only(spec, torch.ones(s)) for s in ((20, 3), (4, 5, 3))]
            [True, False]
        """
        return False

    # --- statistics ----------------------------------------------------------------

    @abstractmethod
    def a_gram(self, spec: LayerSpec, x: torch.Tensor, dtype: torch.dtype) -> Gram:
        """Gram statistics of one call's input, bias column of ones included."""

    @abstractmethod
    def g_gram(self, spec: LayerSpec, r: torch.Tensor, dtype: torch.dtype) -> Gram:
        """Gram statistics of one call's raw output-gradient."""

    def a_gram_key(self, spec: LayerSpec) -> Hashable | None:
        """What :meth:`a_gram` reads besides its input: layers of equal keys make one Gram
        of one input (a linear layer's: its block, width, bias, diagonal, blocks and
        ``kfac_approx``); None, the default: never shared."""
        return None

    def joint_grams(
        self, spec: LayerSpec, x: torch.Tensor, r: torch.Tensor, dtype: torch.dtype
    ) -> tuple[Gram, Gram]:
        """The A and G statistics of one call from its input and raw output-gradient
        (only if :attr:`joint`)."""
        raise NotImplementedError(f"layer kind {self.kind!r} has separate statistics")

    def broadcast_call(
        self, spec: LayerSpec, x: torch.Tensor, out: Any, batch_size: int
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(input, output)`` expanded to ``batch_size`` examples for a call whose one input
        serves every example of the batch (learned positions), so that its output-gradient
        arrives per example; None (the default): the call is an ordinary one. The
        recording hooks replace the module's output by the expanded one, which holds the
        same values wherever it is broadcast against the batch."""
        return None

    def example_rows(
        self, spec: LayerSpec, x: torch.Tensor, r: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """One call's rows grouped by example, for EKFAC: ``(*batch_shape, N, T, a_dim)``
        inputs (bias column included) and ``(*batch_shape, N, T, g_dim)`` output-gradients,
        ``T`` the positions that share the weight; None when the kind has no per-example
        rows (EKFAC then keeps K-FAC's eigenvalues for it)."""
        return None

    def rows(
        self, spec: LayerSpec, inputs: Sequence[torch.Tensor], output_grads: Sequence[torch.Tensor]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``[(input rows, output-gradient rows)]`` of the calls (only if :attr:`has_rows`)."""
        raise NotImplementedError(f"layer kind {self.kind!r} has no rows")

    # --- gradient <-> matrix ---------------------------------------------------------

    def param_grads(
        self, spec: LayerSpec, grads: Mapping[str, torch.Tensor], checked: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layer's ``(weight, bias)`` gradients from ``{param name: grad}``; errors name
        the layer, the missing keys and the shapes (``checked``: the caller checked them
        already). A layer that owns only some rows of a parameter (options ``rows`` /
        ``bias_rows``: ``(start, stop)``, as the q, k and v parts of a packed attention
        weight) gets those rows."""
        missing = [] if checked else [p for p in spec.param_names() if p not in grads]
        if missing:
            raise ValueError(f"layer {spec.name!r}: no gradient for {missing} in grads")
        w = _rows(grads[spec.weight], spec.option("rows"))
        b = _rows(grads[spec.bias], spec.option("bias_rows")) if spec.bias else None
        if not checked:
            self.check_grads(spec, w, b)
        return w, b

    def write_grads(
        self,
        spec: LayerSpec,
        out: MutableMapping[str, torch.Tensor],
        grads: Mapping[str, torch.Tensor],
        weight_grad: torch.Tensor,
        bias_grad: torch.Tensor | None,
    ) -> None:
        """Put the layer's new gradients into ``out`` (a copy of ``grads``), in the dtypes
        of ``grads``; a layer owning rows of a parameter writes those rows of a copy of it."""
        _write_rows(out, grads, spec.weight, spec.option("rows"), weight_grad)
        if spec.bias is not None and bias_grad is not None:
            _write_rows(out, grads, spec.bias, spec.option("bias_rows"), bias_grad)

    def check_grads(
        self, spec: LayerSpec, weight_grad: torch.Tensor, bias_grad: torch.Tensor | None
    ) -> None:
        """Raise a ValueError naming the layer unless the gradients have its shapes."""
        if tuple(weight_grad.shape) != spec.weight_shape:
            raise shape_error(
                spec, "weight gradient", f"shape {spec.weight_shape}", weight_grad.shape
            )
        if spec.has_bias:
            if bias_grad is None:
                raise ValueError(f"layer {spec.name!r}: missing gradient for {spec.bias!r}")
            if tuple(bias_grad.shape) != (spec.out_dim,):
                raise shape_error(
                    spec, "bias gradient", f"shape ({spec.out_dim},)", bias_grad.shape
                )

    def to_matrix(
        self, spec: LayerSpec, weight_grad: torch.Tensor, bias_grad: torch.Tensor | None
    ) -> torch.Tensor:
        """The gradient matrix ``(*batch_shape, g_dim, a_dim)``; the bias is the last column."""
        m = weight_grad
        if m.dim() != 2 or spec.groups > 1:  # a kernel's dimensions, or groups: reshaped
            m = m.reshape(*spec.batch_shape, spec.g_dim, -1)
        if bias_grad is not None and spec.has_bias:
            if spec.groups > 1:
                b = bias_grad.reshape(*spec.batch_shape, spec.g_dim, 1)
            else:
                b = bias_grad.unsqueeze(-1)
            m = torch.cat([m, cast(b, m.dtype)], dim=-1)
        return m

    def from_matrix(
        self, spec: LayerSpec, m: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Inverse of :meth:`to_matrix`: ``(weight_grad, bias_grad or None)``."""
        w, b = (m[..., :-1], m[..., -1]) if spec.has_bias else (m, None)
        b = b if b is None or b.dim() == 1 else b.reshape(spec.out_dim)  # groups: reshaped
        shape = spec.weight_shape
        return (w if w.shape == shape else w.reshape(shape)), b


class JointBlock(LayerBlock):
    """A kind whose statistics need a call's input and output-gradient together
    (:attr:`~LayerBlock.joint`): it implements :meth:`~LayerBlock.joint_grams`, and
    :meth:`a_gram` and :meth:`g_gram` refuse.

    Example:
        >>> import torch
        >>> from kfac_func.blocks import register
        >>> spec = register(torch.nn.LayerNorm(3))[""]
        >>> isinstance(spec.block, JointBlock), spec.block.joint
        (True, True)
    """

    joint = True

    def a_gram(self, spec: LayerSpec, x: torch.Tensor, dtype: torch.dtype) -> Gram:
        raise TypeError(f"layer {spec.name!r} ({spec.kind}): statistics need joint_grams")

    def g_gram(self, spec: LayerSpec, r: torch.Tensor, dtype: torch.dtype) -> Gram:
        raise TypeError(f"layer {spec.name!r} ({spec.kind}): statistics need joint_grams")


def _rows(t: torch.Tensor, rows: tuple[int, int] | None) -> torch.Tensor:
    return t if rows is None else t[rows[0] : rows[1]]


def _write_rows(
    out: MutableMapping[str, torch.Tensor],
    grads: Mapping[str, torch.Tensor],
    name: str,
    rows: tuple[int, int] | None,
    value: torch.Tensor,
) -> None:
    original = grads[name]
    if rows is None:
        out[name] = cast(value, original.dtype)
        return
    if out[name] is original:  # the first part written: a copy of the whole parameter's
        out[name] = original.clone()
    out[name][rows[0] : rows[1]] = value
