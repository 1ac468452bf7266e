"""The layer-kind protocol (:mod:`kfac_func.blocks.base`): the registry, and a new kind
added as one block, with nothing else changed, going through registration, ``capture`` +
``update``, the adapter and checkpoints exactly like the built-in Linear kind."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kfac_func as kf
from kfac_func.blocks import registry
from kfac_func.blocks import spec as spec_module
from kfac_func.blocks.base import LayerBlock
from kfac_func.blocks.registry import block_of, register_block
from kfac_func.blocks.spec import Gram, LayerSpec, row_gram

DT = torch.float64


class Dense(nn.Module):
    """A user's own fully connected layer (not an ``nn.Linear``)."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_out, d_in, dtype=DT) / d_in**0.5)
        self.bias = nn.Parameter(torch.zeros(d_out, dtype=DT))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.T + self.bias


class DenseBlock(LayerBlock):
    """The whole of what the new kind needs: which modules, the spec, the weight shape and
    the Gram statistics of one call."""

    kind = "dense"
    module_types = (Dense,)

    def spec(self, name: str, module: nn.Module) -> LayerSpec | str:
        assert isinstance(module, Dense)
        prefix = f"{name}." if name else ""
        d_out, d_in = module.weight.shape
        return LayerSpec(name, self.kind, f"{prefix}weight", f"{prefix}bias", d_in, d_out)

    def weight_shape(self, spec: LayerSpec) -> tuple[int, ...]:
        return (spec.out_dim, spec.in_dim)

    def a_gram(self, spec: LayerSpec, x: torch.Tensor, dtype: torch.dtype) -> Gram:
        rows = x.to(dtype).reshape(-1, spec.in_dim)
        return Gram(row_gram(rows, True), rows.shape[0], 1)

    def g_gram(self, spec: LayerSpec, r: torch.Tensor, dtype: torch.dtype) -> Gram:
        rows = r.to(dtype).reshape(-1, spec.out_dim)
        return Gram(rows.T @ rows, rows.shape[0], 1)


@pytest.fixture
def dense_kind(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setitem(registry._BLOCKS, DenseBlock.kind, DenseBlock())
    yield


def _models() -> tuple[nn.Module, nn.Module]:
    """The same network twice: with the new kind, and with nn.Linear."""
    torch.manual_seed(0)
    ours = nn.Sequential(Dense(5, 7), nn.Tanh(), Dense(7, 3))
    ref = nn.Sequential(nn.Linear(5, 7, dtype=DT), nn.Tanh(), nn.Linear(7, 3, dtype=DT))
    with torch.no_grad():
        for i in (0, 2):
            ref[i].weight.copy_(ours[i].weight)
            ref[i].bias.copy_(ours[i].bias)
    return ours, ref


def _batch(k: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(k)
    return torch.randn(8, 5, generator=g, dtype=DT), torch.randint(0, 3, (8,), generator=g)


def test_builtin_kinds_are_registered() -> None:
    assert {b.kind for b in registry.blocks()} >= {"linear", "conv2d"}
    assert block_of("linear").has_rows and block_of("linear").tensor_parallel
    assert not block_of("conv2d").has_rows


def test_unknown_kind_is_named() -> None:
    spec = LayerSpec("fc", "no-such-kind", "fc.weight", None, 2, 3)
    with pytest.raises(ValueError, match=r"unknown layer kind 'no-such-kind'.*'linear'"):
        _ = spec.a_dim


def test_a_kind_cannot_be_registered_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "_BLOCKS", dict(registry._BLOCKS))

    class Other(DenseBlock):
        kind = "linear"

    with pytest.raises(ValueError, match="'linear' is registered already"):
        register_block(Other)


def test_unregistered_module_is_skipped_with_its_reason() -> None:
    table = kf.register(nn.Sequential(Dense(2, 2)))
    assert list(table) == []
    assert table.skipped == {"0": f"unsupported kind {Dense.__module__}.Dense"}


def test_new_kind_matches_linear_through_capture_and_update(dense_kind: None) -> None:
    ours, ref = _models()
    table = kf.register(ours)
    assert [s.kind for s in table.values()] == ["dense", "dense"]
    assert table["0"].factor_shapes == kf.register(ref)["0"].factor_shapes
    states = [kf.init(kf.register(m), factor_dtype=DT, inv_dtype=DT) for m in (ours, ref)]
    for step in range(3):
        x, y = _batch(step)
        results = []

        def loss_fn(out: torch.Tensor, y: torch.Tensor = y) -> torch.Tensor:
            return F.cross_entropy(out, y)

        for i, model in enumerate((ours, ref)):
            params = dict(model.named_parameters())
            _, grads, caps = kf.capture(model, params, x, loss_fn)
            new, states[i] = kf.update(states[i], grads, captures=caps, damping=0.1, lr=0.1)
            results.append(new)
        for name in results[1]:
            torch.testing.assert_close(results[0][name], results[1][name], rtol=1e-12, atol=0)
    for name in ("0", "2"):
        torch.testing.assert_close(
            states[0].layers[name].a_factor, states[1].layers[name].a_factor, rtol=0, atol=0
        )


def test_new_kind_in_the_adapter_and_checkpoints(dense_kind: None) -> None:
    ours, ref = _models()
    pres = [kf.KFACPreconditioner(m, damping=0.1, lr=0.1) for m in (ours, ref)]
    for step in range(2):
        x, y = _batch(10 + step)
        for model, pre in zip((ours, ref), pres):
            model.zero_grad()
            F.cross_entropy(model(x), y).backward()
            pre.step()
        for p, q in zip(ours.parameters(), ref.parameters()):
            assert p.grad is not None and q.grad is not None
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=0)
    state = pres[0].state
    back = kf.state_from_dict(kf.state_to_dict(state), like=state)
    assert back.layers["0"].spec.kind == "dense"
    assert torch.equal(back.layers["0"].g_factor, state.layers["0"].g_factor)


def test_split_parameters_recipe() -> None:
    """Every parameter lands in exactly one list, in model order; K-FAC's list holds those
    of the registered layers (attention's packed projection included; the weight tied by
    an embedding and a head), skipped ones go to the other list."""

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(7, 4)
            self.attn = nn.MultiheadAttention(4, 2, batch_first=True)
            self.norm = nn.LayerNorm(4)
            self.head = nn.Linear(4, 7, bias=False)
            self.head.weight = self.emb.weight
            self.out = nn.Linear(4, 2)

    model = Tied()
    table = kf.register(model, skip_layers=["LayerNorm"])
    kfac, rest = table.split_parameters(model)
    names = {id(p): n for n, p in model.named_parameters()}
    assert [names[id(p)] for p in kfac] == [
        "emb.weight",
        "attn.in_proj_weight",
        "attn.in_proj_bias",
        "attn.out_proj.weight",
        "attn.out_proj.bias",
        "out.weight",
        "out.bias",
    ]
    assert [names[id(p)] for p in rest] == ["norm.weight", "norm.bias"]
    with pytest.raises(ValueError, match="registered from"):
        table.split_parameters(nn.Linear(2, 2))


@pytest.mark.parametrize(
    ("width", "blocks", "ones"),
    [(9, 3, True), (10, 2, False), (9, 2, True), (8, 3, False), (7, 3, True)],
    ids=["pad-and-ones", "exact", "exact-with-ones", "pad", "ones-alone-in-a-block"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_diagonal_statistics_are_the_blocks_of_the_whole(
    width: int, blocks: int, ones: bool, dtype: torch.dtype
) -> None:
    """``row_gram(..., blocks=k)`` (its column blocks built in one copy, or viewed in
    place) holds the diagonal blocks of the whole Gram (with the ones column where
    asked, zero where the last block is padded), each entry within the rounding of one
    sum over the rows (and of a bfloat16 result)."""
    torch.manual_seed(0)
    rows = torch.randn(3, 6, width, dtype=torch.float64).to(dtype)
    got = row_gram(rows, ones, blocks=blocks).double()
    r = rows.double()
    if ones:
        r = torch.cat([r, torch.ones(*r.shape[:-1], 1, dtype=r.dtype)], dim=-1)
    exact = spec_module.diagonal_blocks(r.mT @ r, blocks)
    absolute = spec_module.diagonal_blocks(r.abs().mT @ r.abs(), blocks)
    unit = torch.finfo(torch.float32).eps / 2
    bound = 6 * unit * absolute + exact.abs() * torch.finfo(dtype).eps / 2
    assert got.shape == exact.shape
    assert ((got - exact).abs() <= bound).all()


@pytest.mark.parametrize(
    "shape",
    [(800, 300), (2, 600, 512), (40, 16)],
    ids=["blocked-uneven", "blocked-batched", "one-product"],
)
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_gram_of_is_the_product_of_the_rows(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """``gram_of`` multiplies only the upper block triangle of large products (the
    blocked shapes here: widths that its four blocks do and do not divide, a leading
    batch dimension; in float64 at least ``blocked_work`` multiply-adds): every entry,
    of ``gram_of`` and of the block triangle itself, is the dot product of its two
    columns, within the rounding of one sum over the rows (and of the bfloat16 result),
    and each block below the diagonal is the transpose of its mirror; the ones column's
    row and column hold the column sums and the row count."""
    torch.manual_seed(0)
    rows = torch.randn(*shape, dtype=torch.float64).to(dtype)
    n, d = shape[-2], shape[-1]
    large = d >= 300
    if dtype == torch.float64:
        assert spec_module._in_blocks(rows) == large
    got = spec_module.gram_of(rows).double()
    r = rows.double()
    exact = r.mT @ r
    # a sum of n products rounds by at most n·u times the sum of their magnitudes
    unit = torch.finfo(torch.float32 if dtype == torch.bfloat16 else dtype).eps / 2
    bound = n * unit * (r.abs().mT @ r.abs())
    if dtype == torch.bfloat16:  # and the product is stored in bfloat16
        bound = bound + exact.abs() * torch.finfo(dtype).eps / 2
    assert ((got - exact).abs() <= bound).all()
    if large:
        triangle = spec_module._block_triangle(rows).double()
        assert ((triangle - exact).abs() <= bound).all()
        step = -(-d // spec_module._GRAM_BLOCKS)
        block = torch.arange(d) // step
        off = block[:, None] != block[None, :]
        assert torch.equal((triangle - triangle.mT)[..., off], torch.zeros_like(triangle[..., off]))
    # with the ones column (appended to narrow 32-bit rows, assembled around the product
    # otherwise): the same dot products, each within the rounding of one sum
    ones = row_gram(rows, True).double()
    assert ((ones[..., :d, :d] - exact).abs() <= bound).all()
    torch.testing.assert_close(ones[..., :d, d], r.sum(-2), rtol=0, atol=float(bound.max()))
    assert (ones[..., d, d] == n).all()
