"""One forward/backward through ``torch.func`` that returns loss, gradients and captures.

Each registered layer gets a forward hook for the duration of the call. The hook records
the layer's input (returned as aux, never stashed in a global) and adds a zero "probe"
tensor to its output; differentiating with respect to the parameters and the probes in
one VJP gives the parameter gradients and every layer's output-gradient at once. Backward
hooks are not used (they do not work inside torch.func transforms).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.utils._pytree as torch_pytree
from torch import nn

from kfac_func.blocks import LayerSpec, register
from kfac_func.blocks.checks import checking
from kfac_func.blocks.examples import CallExamples
from kfac_func.blocks.taps import Sites, call_sites, tap_hooks, tapped
from kfac_func.core.functional import functional_call
from kfac_func.core.pytree import register_dataclass

__all__ = ["Captures", "LayerCapture", "capture"]

Fisher = Literal["empirical", "mc"]
Likelihood = Literal["cross_entropy", "mse"]


@dataclass(frozen=True)
class LayerCapture:
    """What one layer saw in one forward/backward: one entry per call of the module."""

    inputs: tuple[torch.Tensor, ...]
    output_grads: tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class Captures:
    """Captured inputs and output-gradients of every registered layer for one batch.

    Attributes:
        layers: ``{name: LayerCapture}``.
        batch_size: number of examples ``N`` in the batch.
        loss_scale: ``c`` such that the differentiated loss is ``c · Σ_n ℓ_n``
            (``1/N`` for a mean-reduced loss, ``1`` for a sum); the ``"fisher"``
            convention divides it out of the output-gradients.
    """

    layers: dict[str, LayerCapture]
    batch_size: int
    loss_scale: float


register_dataclass(LayerCapture, data=("inputs", "output_grads"))
register_dataclass(Captures, data=("layers",), static=("batch_size", "loss_scale"))


class _ShapesChanged(Exception):
    """A layer was called more often, or with another output shape, than recorded."""


Shapes = dict[str, list[tuple[torch.Size, torch.dtype]]]
Tensors = tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]  # parameters, buffers

# Output shapes per model and call signature, so the shape pass runs once per signature.
_SHAPES: weakref.WeakKeyDictionary[nn.Module, dict[tuple[Any, ...], Shapes]] = (
    weakref.WeakKeyDictionary()
)
_MAX_SIGNATURES = 32


def _signature(model: nn.Module, names: tuple[str, ...], tree: Any) -> tuple[Any, ...] | None:
    """Hashable key of everything that decides the layers' output shapes, or None."""
    key: list[Any] = [model.training, names]
    for leaf in torch_pytree.tree_leaves(tree):
        if isinstance(leaf, torch.Tensor):
            key.append((tuple(leaf.shape), leaf.dtype, leaf.device))
        else:
            key.append(leaf)
    try:
        hash(tuple(key))
    except TypeError:
        return None
    return tuple(key)


def _names(sites: Sites) -> tuple[str, ...]:
    """The layers whose calls ``sites`` observe."""
    return tuple(spec.name for _, specs in sites.values() for spec in specs)


class _Calls:
    """Per-call bookkeeping shared by the forward hooks of one traced forward."""

    def __init__(self, sites: Sites, probes: Mapping[str, list[torch.Tensor]] | None):
        names = _names(sites)
        self.specs = {spec.name: spec for _, specs in sites.values() for spec in specs}
        self.seen = CallExamples()
        self.probes = probes
        self.inputs: dict[str, list[torch.Tensor]] = {n: [] for n in names}
        self.outputs: dict[str, list[tuple[torch.Size, torch.dtype]]] = {n: [] for n in names}

    def record(self, name: str, x: Any, out: torch.Tensor) -> torch.Tensor:
        """One call of layer ``name``: keep its input, add its probe to the output (a call
        that serves every example from one input expanded to the batch first, as the
        adapter's hooks do: :meth:`~kfac_func.blocks.LayerBlock.broadcast_call`)."""
        spec = self.specs[name]
        n = self.seen.known()
        wide = spec.block.broadcast_call(spec, x, out, n) if n else None
        if wide is not None:
            x, out = wide
        if isinstance(x, torch.Tensor):
            self.seen.add(spec, x)
        k = len(self.outputs[name])
        self.outputs[name].append((out.shape, out.dtype))
        if self.probes is None:
            return out
        probes = self.probes[name]
        if k >= len(probes) or probes[k].shape != out.shape:
            raise _ShapesChanged(name)
        self.inputs[name].append(x)
        return out + probes[k]

    def hook(self, name: str) -> Callable[..., Any]:
        def fn(module: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> Any:
            new = self.record(name, args[0], out)
            return None if new is out else new

        return fn

    def run(self, sites: Sites, fn: Callable[[], Any]) -> Any:
        handles: list[Any] = []

        def site(spec: LayerSpec, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
            return self.record(spec.name, x, out)

        for module, specs in sites.values():
            if tapped(specs):
                handles += tap_hooks(module, specs, lambda: site)
            else:
                handles.append(module.register_forward_hook(self.hook(specs[0].name)))
        try:
            return fn()
        finally:
            for h in handles:
                h.remove()


def _output_shapes(
    model: nn.Module,
    modules: Sites,
    tensors: Tensors,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    refresh: bool = False,
) -> Shapes:
    """Shape of every call's output, cached per model and call signature.

    Measured by a forward pass on meta tensors (no compute), or, for models that cannot
    run on the meta device, a real forward without gradients (buffers cloned, RNG
    restored).
    """
    key = _signature(model, _names(modules), (tensors, args, kwargs))
    cache = _SHAPES.setdefault(model, {})
    if key is not None and not refresh and key in cache:
        return cache[key]
    shapes = _measure_shapes(model, modules, (tensors, args, kwargs))
    if key is not None:
        if len(cache) >= _MAX_SIGNATURES:
            cache.clear()
        cache[key] = shapes
    return shapes


def _measure_shapes(
    model: nn.Module,
    modules: Sites,
    inputs: tuple[Tensors, tuple[Any, ...], dict[str, Any]],
) -> Shapes:
    """:func:`_output_shapes`'s measure of ``inputs``: ``(tensors, args, kwargs)``."""

    def to_meta(x: Any) -> Any:
        return x.to("meta") if isinstance(x, torch.Tensor) else x

    calls = _Calls(modules, None)
    meta = torch_pytree.tree_map(to_meta, inputs)
    try:
        with torch.no_grad():
            calls.run(modules, lambda: functional_call(model, meta[0], meta[1], meta[2]))
        return calls.outputs
    except Exception:
        pass
    calls = _Calls(modules, None)
    (params, buffers), args, kwargs = inputs
    cloned = {k: v.clone() for k, v in buffers.items()}
    devices = [t.device for t in params.values() if t.device.type == "cuda"][:1]
    with torch.no_grad(), torch.random.fork_rng(devices=devices):
        calls.run(modules, lambda: functional_call(model, (params, cloned), args, kwargs))
    return calls.outputs


def _mc_cotangent(
    out: Any, likelihood: str | None, loss_scale: float, generator: torch.Generator | None
) -> torch.Tensor:
    """``c · ∇_y ℓ(y, t̂)`` with ``t̂`` sampled from the model's predictive distribution."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"fisher='mc' needs the model to return one tensor, got {type(out)}")
    y = out.detach()
    dtype = torch.promote_types(y.dtype, torch.float32)
    if likelihood == "cross_entropy":
        p = torch.softmax(y.to(dtype), dim=-1).reshape(-1, y.shape[-1])
        t = torch.multinomial(p, 1, generator=generator).squeeze(-1)
        grad = p.clone()
        grad[torch.arange(p.shape[0], device=p.device), t] -= 1.0
    elif likelihood == "mse":
        # Unit-variance Gaussian: ℓ = ½‖y − t̂‖², t̂ = y + ε, ∇_y ℓ = −ε.
        grad = -torch.randn(y.shape, generator=generator, device=y.device, dtype=dtype)
    else:
        raise ValueError(
            f"fisher='mc' needs likelihood='cross_entropy' or 'mse', got {likelihood!r}"
        )
    return (loss_scale * grad).reshape(y.shape).to(y.dtype)


class _Output:
    """The model's output as the list of its floating-point tensors, which the VJP
    differentiates, and the rest (the object's structure and its other leaves: integer
    tensors, a ``DynamicCache``, strings), kept aside: :meth:`join` rebuilds the object as
    the model returned it, for ``loss_fn``. Containers are those of torch's pytrees
    (tuples, lists, dicts, transformers' ``ModelOutput``) and dataclasses."""

    def __init__(self) -> None:
        self.leaves: list[Any] = []
        self.where: list[int] = []
        self.rebuild: Callable[[list[Any]], Any] = lambda leaves: leaves[0]

    def split(self, out: Any) -> list[torch.Tensor]:
        leaves, self.rebuild = _flatten(out)
        self.where = [i for i, leaf in enumerate(leaves) if _differentiable(leaf)]
        if not self.where:
            raise TypeError(
                f"the model's output ({type(out).__name__}) holds no floating-point tensor "
                "to differentiate"
            )
        where = set(self.where)
        self.leaves = [None if i in where else leaf for i, leaf in enumerate(leaves)]
        return [leaves[i] for i in self.where]

    def join(self, tensors: list[torch.Tensor]) -> Any:
        leaves = list(self.leaves)
        for i, t in zip(self.where, tensors):
            leaves[i] = t
        return self.rebuild(leaves)


def _is_dataclass(x: Any) -> bool:
    """A dataclass instance that torch's pytrees do not know (a ``ModelOutput`` is one of
    theirs)."""
    return (
        dataclasses.is_dataclass(x)
        and not isinstance(x, type)
        and type(x) not in torch_pytree.SUPPORTED_NODES
    )


def _flatten(obj: Any) -> tuple[list[Any], Callable[[list[Any]], Any]]:
    """The leaves of ``obj`` (through torch's pytree containers and dataclasses) and a
    function that rebuilds ``obj`` from new leaves."""
    if _is_dataclass(obj):
        names = [f.name for f in dataclasses.fields(obj)]
        leaves, rebuild_fields = _flatten([getattr(obj, n) for n in names])

        def rebuild_dataclass(new: list[Any]) -> Any:
            out = copy.copy(obj)
            for name, value in zip(names, rebuild_fields(new)):
                object.__setattr__(out, name, value)
            return out

        return leaves, rebuild_dataclass
    top, spec = torch_pytree.tree_flatten(obj, is_leaf=_is_dataclass)
    if len(top) == 1 and top[0] is obj:
        return [obj], lambda new: new[0]
    parts = [_flatten(t) for t in top]

    def rebuild(new: list[Any]) -> Any:
        children, k = [], 0
        for leaves, join in parts:
            children.append(join(new[k : k + len(leaves)]))
            k += len(leaves)
        return torch_pytree.tree_unflatten(children, spec)

    return [leaf for leaves, _ in parts for leaf in leaves], rebuild


def _differentiable(leaf: Any) -> bool:
    return isinstance(leaf, torch.Tensor) and (leaf.is_floating_point() or leaf.is_complex())


def _scalar(loss: Any) -> torch.Tensor:
    """``loss`` if it is a one-element tensor (the loss ``loss_fn`` must return)."""
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"loss_fn must return a scalar tensor, got {type(loss).__name__}")
    if loss.numel() != 1:
        raise ValueError(
            f"loss_fn must return a scalar tensor (one element), got shape "
            f"{tuple(loss.shape)}: reduce it over the batch (e.g. .mean() or .sum(), and "
            "say which with loss_reduction=)"
        )
    if not (loss.is_floating_point() or loss.is_complex()):
        raise TypeError(f"loss_fn must return a floating-point scalar, got {loss.dtype}")
    return loss.reshape(())


def _batch_size(specs: Mapping[str, LayerSpec], inputs: Mapping[str, list[torch.Tensor]]) -> int:
    """What the captured calls say about the number of examples (see
    :class:`~kfac_func.blocks.examples.CallExamples`)."""
    seen = CallExamples()
    for name, xs in inputs.items():
        for x in xs:
            seen.add(specs[name], x)
    return seen.batch_size(what_to_do=_WHAT_TO_DO)


_WHAT_TO_DO = (
    "Pass batch_size= (the number of examples), keep the examples on the leading dimension "
    "of every registered layer's input, or leave the layers that do not out (layers=)"
)


def _unsupported(e: RuntimeError) -> RuntimeError:
    """The error of a model that torch.func cannot differentiate, explained when it is
    activation checkpointing (measured with torch 2.13: the non-reentrant kind uses
    saved-tensor hooks, which torch.func refuses; the reentrant kind is an
    ``autograd.Function`` without ``setup_context``)."""
    msg = str(e)
    if "saved tensor hooks" in msg or "setup_context" in msg:
        return RuntimeError(
            "kf.capture runs the model under torch.func, which supports neither activation "
            "checkpointing (torch.utils.checkpoint, checkpoint_wrapper, Hugging Face's "
            "gradient_checkpointing_enable()) nor other saved-tensor hooks or autograd."
            "Functions without setup_context. Turn checkpointing off for the capture "
            "(model.gradient_checkpointing_disable()), or use kfac_func.KFACPreconditioner, "
            f"whose hooks support it. torch.func said: {msg}"
        )
    return e


def check_loss_divisor(value: object) -> None:
    """Raise a ValueError unless ``value`` is a positive number."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
    if not ok or value != value:
        raise ValueError(f"loss_divisor must be a positive number, got {value!r}")


def capture(
    model: nn.Module,
    params: Mapping[str, torch.Tensor],
    args: Any,
    loss_fn: Callable[[Any], torch.Tensor],
    *,
    layers: Mapping[str, LayerSpec] | None = None,
    buffers: Mapping[str, torch.Tensor] | None = None,
    kwargs: dict[str, Any] | None = None,
    fisher: Fisher = "empirical",
    likelihood: Likelihood | None = None,
    loss_reduction: Literal["mean", "sum"] = "mean",
    loss_divisor: float = 1.0,
    batch_size: int | None = None,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor], Captures]:
    """Loss, parameter gradients and K-FAC captures from one forward/backward.

    Args:
        model: the module (its own parameters are replaced by ``params`` for the call).
        params: ``{name: tensor}`` to differentiate, e.g. ``dict(model.named_parameters())``.
        args: the model's positional input (a tensor or a tuple of them).
        loss_fn: ``outputs -> scalar loss`` (close over the targets).
        layers: layers to capture (default: ``register(model)``).
        buffers: buffers for the call (default: the model's own). In-place updates the
            forward makes to them (BatchNorm running statistics) are written back, as in
            an ordinary forward pass.
        kwargs: keyword arguments for the model.
        fisher: ``"empirical"`` uses the output-gradients of ``loss_fn``; ``"mc"`` samples
            targets from the model's predictive distribution (``likelihood``) and uses
            the output-gradients of that sampled loss. Parameter gradients are always
            those of ``loss_fn``.
        likelihood: for ``fisher="mc"``: ``"cross_entropy"`` (classes on the last
            dimension) or ``"mse"`` (unit-variance Gaussian, ``ℓ = ½‖y − t‖²``).
        loss_reduction: whether ``loss_fn`` averages (``"mean"``) or sums (``"sum"``) its
            per-example losses over the batch; recorded as ``Captures.loss_scale``.
        loss_divisor: what the loss was divided by besides that reduction: ``k`` when
            each of ``k`` accumulated micro-batches backpropagates ``loss / k`` (as
            DeepSpeed does with gradient accumulation). The ``"fisher"`` convention divides
            it out of the output-gradients, so G does not shrink ``k²``-fold.
        batch_size: number of examples (default: what the captured layers' inputs say, see
            :class:`~kfac_func.blocks.examples.CallExamples`; never guessed from ``args``
            or ``kwargs``; pass it for layouts whose batch is not the leading dimension
            of the layers' inputs).
        generator: random generator for ``fisher="mc"``.

    Returns:
        ``(loss, grads, captures)``; ``grads`` is keyed like ``params``. A module called
        several times contributes every call, in order, to ``captures.layers[name]``.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import kfac_func as kf
        >>> model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
        >>> x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
        >>> loss_fn = lambda out: nn.functional.cross_entropy(out, y)
        >>> loss, grads, caps = kf.capture(model, dict(model.named_parameters()), x, loss_fn)
        >>> sorted(caps.layers), caps.layers["0"].inputs[0].shape
        (['0', '2'], torch.Size([8, 4]))
    """
    if fisher not in ("empirical", "mc"):
        raise ValueError(f"fisher must be 'empirical' or 'mc', got {fisher!r}")
    if fisher == "mc" and likelihood not in ("cross_entropy", "mse"):
        raise ValueError(
            f"fisher='mc' needs likelihood='cross_entropy' or 'mse', got {likelihood!r}"
        )
    if loss_reduction not in ("mean", "sum"):
        raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
    check_loss_divisor(loss_divisor)
    args = args if isinstance(args, tuple) else (args,)
    kwargs = dict(kwargs or {})
    specs = register(model) if layers is None else layers
    modules = call_sites(model, specs)
    params = {k: v.detach() for k, v in params.items()}
    bufs = dict(model.named_buffers()) if buffers is None else dict(buffers)

    output = _Output()

    def forward(
        p: dict[str, torch.Tensor], pr: dict[str, list[torch.Tensor]]
    ) -> tuple[Any, tuple[dict[str, list[torch.Tensor]], dict[str, torch.Tensor]]]:
        # Buffers are cloned inside the transform so that in-place updates (BatchNorm
        # running statistics) are allowed; they are written back once the call is done.
        b = {k: v.clone() for k, v in bufs.items()}
        calls = _Calls(modules, pr)
        with checking(model, specs):
            out = calls.run(modules, lambda: functional_call(model, (p, b), args, kwargs))
        return output.split(out), (calls.inputs, b)

    device = next(iter(params.values())).device if params else torch.device("cpu")
    with contextlib.ExitStack() as stack:
        for block in {id(s.block): s.block for s in specs.values()}.values():
            stack.enter_context(block.capturing())
        for attempt in (0, 1):
            shapes = _output_shapes(
                model, modules, (params, bufs), args, kwargs, refresh=attempt > 0
            )
            probes = {
                name: [torch.zeros(s, dtype=dt, device=device) for s, dt in calls]
                for name, calls in shapes.items()
            }
            try:
                out, vjp_fn, (inputs, new_bufs) = torch.func.vjp(  # type: ignore[misc]
                    forward, params, probes, has_aux=True
                )
                break
            except RuntimeError as e:
                explained = _unsupported(e)
                if explained is e:
                    raise
                raise explained from e
            except _ShapesChanged as e:
                if attempt:
                    raise RuntimeError(
                        f"layer {e.args[0]!r} was called a different number of times, or "
                        "gave other output shapes, in two forward passes on the same inputs"
                    ) from None
    n = _batch_size(specs, inputs) if batch_size is None else int(batch_size)
    scale = (1.0 / n if loss_reduction == "mean" else 1.0) / loss_divisor
    with torch.no_grad():
        for k, v in new_bufs.items():
            bufs[k].copy_(v)
    dloss, loss = torch.func.grad_and_value(lambda t: _scalar(loss_fn(output.join(t))))(out)
    grads, output_grads = vjp_fn(dloss)
    if fisher == "mc":
        whole = output.join(out)
        _, output_grads = vjp_fn([_mc_cotangent(whole, likelihood, scale, generator)])

    captured = {
        name: LayerCapture(tuple(inputs[name]), tuple(output_grads[name][: len(inputs[name])]))
        for name in inputs
    }
    return loss.detach(), grads, Captures(captured, n, scale)
