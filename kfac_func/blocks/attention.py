"""``nn.MultiheadAttention`` (and so ``nn.TransformerEncoderLayer`` / ``DecoderLayer``): its
query, key, value and output projections as four Linear layers.

The module reads its weights directly (``in_proj_weight`` packs q, k and v; the
``out_proj`` Linear is never called), so hooks on it see nothing. Its forward calls
``torch.nn.functional.linear`` for the projections: the in-projections first (one packed
call for self-attention, two for encoder-decoder attention, three with separate weights or
different key/value widths), covering q, k and v in that order, then the output
projection. While the forward runs, :meth:`AttentionBlock.tap` puts a wrapper in place of
``F.linear`` that hands each projection's input and its slice of the output to the caller
(the capture adds a probe to it, the adapter a gradient hook). The wrapper is installed only
for the duration of one module's forward; another thread calling ``F.linear`` meanwhile
would be seen (and refused, its weight being none of the module's).

The layers are ``<name>.q_proj``, ``<name>.k_proj``, ``<name>.v_proj`` (rows of the packed
``in_proj_weight`` / ``in_proj_bias``, or ``q_proj_weight`` ...) and ``<name>.out_proj``;
their statistics are those of :class:`~kfac_func.blocks.linear.LinearBlock`. ``bias_k`` and
``bias_v`` (``add_bias_kv=True``) are left to the optimizer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kfac_func.blocks.linear import LinearBlock
from kfac_func.blocks.registry import register_block
from kfac_func.blocks.spec import LayerSpec
from kfac_func.blocks.taps import Site

__all__ = ["AttentionBlock"]


@register_block
class AttentionBlock(LinearBlock):
    """The four projections of ``nn.MultiheadAttention`` as Linear layers.

    Example:
        >>> import torch
        >>> from kfac_func.blocks import register
        >>> table = register(torch.nn.MultiheadAttention(8, 2))
        >>> [(name, spec.factor_shapes) for name, spec in table.items()][0]
        ('q_proj', ((9, 9), (8, 8)))
        >>> list(table)
        ['q_proj', 'k_proj', 'v_proj', 'out_proj']
    """

    kind = "attention"
    module_types: tuple[type[nn.Module], ...] = (nn.MultiheadAttention,)
    has_rows = False
    tensor_parallel = False
    model_parallel = False
    # the projections see (L, N, E) inputs and a flattened (L·N, E) one: expand only
    reducible = False
    taps = True
    mappable = False

    def spec(self, name: str, module: nn.Module) -> LayerSpec | str:
        specs = self.specs(name, module)
        return specs if isinstance(specs, str) else specs[0]

    def specs(self, name: str, module: nn.Module) -> list[LayerSpec] | str:
        assert isinstance(module, nn.MultiheadAttention)
        prefix = f"{name}." if name else ""
        e = module.embed_dim
        packed = module._qkv_same_embed_dim
        has_bias = module.in_proj_bias is not None
        out: list[LayerSpec] = []
        for i, (part, width) in enumerate((("q", e), ("k", module.kdim), ("v", module.vdim))):
            options: dict[str, Any] = {"module": name, "part": part, "rows": (i * e, (i + 1) * e)}
            weight = f"{prefix}in_proj_weight"
            if not packed:
                weight = f"{prefix}{part}_proj_weight"
                options["rows"] = None
            options["bias_rows"] = (i * e, (i + 1) * e)
            bias = f"{prefix}in_proj_bias" if has_bias else None
            out.append(
                LayerSpec(
                    f"{prefix}{part}_proj",
                    self.kind,
                    weight,
                    bias,
                    int(width),
                    e,
                    options=tuple(sorted(options.items())),
                )
            )
        proj = module.out_proj
        out.append(
            LayerSpec(
                f"{prefix}out_proj",
                self.kind,
                f"{prefix}out_proj.weight",
                f"{prefix}out_proj.bias" if proj.bias is not None else None,
                proj.in_features,
                proj.out_features,
                options=(("module", name), ("part", "out")),
            )
        )
        return out

    def example_rows(
        self, spec: LayerSpec, x: torch.Tensor, r: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        return None  # the projections' rows are not grouped by example (see reducible)

    def examples(self, spec: LayerSpec, x: torch.Tensor) -> int | None:
        """The in-projections see ``(L, N, E)`` whatever ``batch_first`` says (the module
        moves the batch to dimension 1 before them, and adds it for unbatched inputs):
        ``N``. The output projection sees the flattened ``(L·N, E)``, which does not tell."""
        if spec.option("part") == "out" or x.dim() != 3:
            return None
        return int(x.shape[1])

    def capturing(self) -> contextlib.AbstractContextManager[None]:
        """The fused fast path of ``nn.MultiheadAttention`` / ``TransformerEncoderLayer``
        (taken without training or gradients) computes the projections out of the tap's
        sight: it is off while a capture runs."""
        return _no_fast_path()

    # --- the calls inside the forward -------------------------------------------------

    def tap(
        self, module: nn.Module, specs: Sequence[LayerSpec], site: Site
    ) -> contextlib.AbstractContextManager[None]:
        parts = {spec.option("part"): spec for spec in specs}
        assert isinstance(module, nn.MultiheadAttention)
        return _projection_tap(module.embed_dim, parts, site)


@contextlib.contextmanager
def _no_fast_path() -> Iterator[None]:
    before = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(before)


@contextlib.contextmanager
def _projection_tap(e: int, parts: Mapping[str, LayerSpec], site: Site) -> Iterator[None]:
    """Route the ``F.linear`` calls of one attention forward to ``site``, by part."""
    original = F.linear
    in_width = 0  # output columns of the in-projections seen so far (q, k, v in order)
    done_out = False

    def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Any:
        nonlocal in_width, done_out
        y = original(x, weight, bias)
        if in_width < 3 * e:
            start, in_width = in_width, in_width + y.shape[-1]
            names = "qkv"[start // e : in_width // e]
            if start % e or in_width % e or in_width > 3 * e or not names:
                raise RuntimeError(_unexpected(parts, f"an in-projection of width {y.shape[-1]}"))
            pieces = [site(parts[p], x, y[..., i * e : (i + 1) * e]) for i, p in enumerate(names)]
            return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=-1)
        if done_out:
            raise RuntimeError(_unexpected(parts, "a second output projection"))
        done_out = True
        return site(parts["out"], x, y)

    F.linear = linear  # type: ignore[assignment]
    try:
        yield
    finally:
        F.linear = original
    if in_width != 3 * e or not done_out:
        raise RuntimeError(
            _unexpected(parts, "no projections (the fast path runs without training or grad)")
        )


def _unexpected(parts: Mapping[str, LayerSpec], what: str) -> str:
    module = parts["out"].module
    return (
        f"layer {module!r} (attention): its forward made {what}; K-FAC expects the "
        "q, k, v in-projections, then the output projection"
    )
