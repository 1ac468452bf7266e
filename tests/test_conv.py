"""The Conv2d path, proven exact in float64 against oracles written here.

The oracle is an explicit patch extractor built from plain Python loops over output
positions and kernel offsets (no ``F.unfold``, no library code): input pixel
``(i·stride_h + u·dil_h − pad_top, j·stride_w + v·dil_w − pad_left)``, with the index
mapping of each ``padding_mode``. It is itself checked against PyTorch's convolution before
being trusted. Factors, gradient matrices, the exact single-example Fisher block, the
``"kfac-pytorch"`` scaling, unbatched inputs, ``'same'`` padding and input validation are
all compared with it.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

import kfac_func as kf
from kfac_func.blocks.conv2d import conv_padding

DT = torch.float64
TOL = {"rtol": 1e-12, "atol": 1e-12}
H, W = 6, 7  # non-square, so height/width mix-ups show
N = 2


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny shapes: intra-op threads only add contention (restored afterwards)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _pair(v: int | tuple[int, int]) -> tuple[int, int]:
    return (v, v) if isinstance(v, int) else (int(v[0]), int(v[1]))


@dataclass(frozen=True)
class Case:
    kernel: int | tuple[int, int]
    stride: int | tuple[int, int] = 1
    padding: int | tuple[int, int] | str = 0
    dilation: int | tuple[int, int] = 1
    groups: int | str = 1  # "dw": depthwise (groups = in_channels)
    bias: bool = True
    mode: str = "zeros"
    cin: int = 4
    cout: int = 6

    @property
    def n_groups(self) -> int:
        return self.cin if self.groups == "dw" else int(self.groups)

    def module(self) -> nn.Conv2d:
        return nn.Conv2d(
            self.cin,
            self.cout,
            self.kernel,
            stride=self.stride,
            padding=self.padding,
            dilation=self.dilation,
            groups=self.n_groups,
            bias=self.bias,
            padding_mode=self.mode,
        ).to(DT)

    def __str__(self) -> str:
        return (
            f"k{self.kernel}-s{self.stride}-p{self.padding}-d{self.dilation}-g{self.groups}"
            f"-{'b' if self.bias else 'nob'}-{self.mode}"
        ).replace(" ", "")


# A hand-picked product: every stride, padding, dilation, groups, bias, padding_mode and
# kernel value appears, 'same' with odd and even kernels (symmetric and asymmetric total
# padding, with and without dilation), and every non-zero padding mode with groups.
CASES = [
    Case(1),
    Case(3, padding=1),
    Case(3, stride=2, padding=1, bias=False),
    Case(3, stride=(2, 1), padding=(1, 2)),
    Case(3, dilation=2),
    Case(3, padding=(1, 2), dilation=(2, 1)),
    Case((2, 3), stride=2, padding=(1, 2), dilation=2, bias=False),
    Case((2, 3), padding="same"),  # even kernel: asymmetric 'same' on the height
    Case(3, padding="same", dilation=2),
    Case((2, 3), padding="same", dilation=(2, 1), groups=2),
    Case(2, padding="same", bias=False),  # even on both sides
    Case((4, 2), padding="same", dilation=(1, 3)),  # even kernel, odd dilation: asymmetric
    Case((3, 2), padding="same", dilation=(2, 1), groups=2, bias=False),
    Case(3, padding="valid"),
    Case((2, 3), stride=2, padding="valid", dilation=2, groups=2, bias=False),
    Case(3, padding=1, groups=2),
    Case(3, stride=(1, 2), padding=1),  # unit vertical stride: the row-unfolded Gram
    Case((3, 2), stride=(1, 3), padding=(2, 0), dilation=(2, 1), groups=2),
    Case(3, stride=2, padding=(1, 2), groups="dw", cout=8),
    Case(1, stride=2, groups="dw", bias=False, cout=4),
    Case(3, padding="same", dilation=(2, 1), groups="dw", cout=8),
    Case(3, padding=1, mode="reflect"),
    Case(3, stride=2, padding=(1, 2), dilation=2, groups=2, bias=False, mode="reflect"),
    Case((2, 3), padding="same", mode="reflect"),
    Case(3, stride=(2, 1), padding=1, dilation=(2, 1), groups="dw", mode="reflect", cout=8),
    Case(3, padding=1, mode="replicate"),
    Case((2, 3), stride=(2, 1), padding=(1, 2), dilation=2, groups=2, mode="replicate"),
    Case(
        (4, 2), padding="same", dilation=(1, 3), groups="dw", bias=False, mode="replicate", cout=8
    ),
    Case(1, padding="valid", groups=2, mode="replicate"),
    Case(3, padding=1, dilation=2, mode="circular"),
    Case(3, stride=2, padding=(1, 2), groups=2, bias=False, mode="circular"),
    Case((2, 3), padding="same", groups="dw", mode="circular", cout=4),
    Case(3, padding="same", dilation=2, mode="circular"),
    Case(3, stride=(2, 1), groups=2, mode="circular"),
]


def _coverage() -> None:
    def seen(attr: str) -> set[object]:
        return {getattr(c, attr) for c in CASES}

    assert {1, 2, (2, 1)} <= seen("stride")
    assert {0, 1, (1, 2), "same", "valid"} <= seen("padding")
    assert {1, 2, (2, 1)} <= seen("dilation")
    assert {1, 2, "dw"} <= seen("groups")
    assert {True, False} <= seen("bias")
    assert {"zeros", "reflect", "replicate", "circular"} <= seen("mode")
    assert {1, 3, (2, 3)} <= seen("kernel")


_coverage()


# ---------------------------------------------------------------------------------------
# The oracle: explicit geometry and patch extraction.
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Geometry:
    kh: int
    kw: int
    sh: int
    sw: int
    dh: int
    dw: int
    top: int
    bottom: int
    left: int
    right: int

    def out_size(self, h: int, w: int) -> tuple[int, int]:
        oh = (h + self.top + self.bottom - self.dh * (self.kh - 1) - 1) // self.sh + 1
        ow = (w + self.left + self.right - self.dw * (self.kw - 1) - 1) // self.sw + 1
        return oh, ow


def geometry(case: Case) -> Geometry:
    """Explicit padding: 'same' pads d·(k−1) per dimension, the smaller half first."""
    kh, kw = _pair(case.kernel)
    sh, sw = _pair(case.stride)
    dh, dw = _pair(case.dilation)
    if case.padding == "valid":
        top = bottom = left = right = 0
    elif case.padding == "same":
        th, tw = dh * (kh - 1), dw * (kw - 1)
        top, bottom, left, right = th // 2, th - th // 2, tw // 2, tw - tw // 2
    else:
        ph, pw = _pair(case.padding)  # type: ignore[arg-type]
        top = bottom = ph
        left = right = pw
    return Geometry(kh, kw, sh, sw, dh, dw, top, bottom, left, right)


def source_index(p: int, size: int, mode: str) -> int | None:
    """Index of the input pixel that padded coordinate ``p`` reads, None for a zero."""
    if 0 <= p < size:
        return p
    if mode == "zeros":
        return None
    if mode == "reflect":  # mirror about the edge pixel, edge not repeated
        q = -p if p < 0 else 2 * (size - 1) - p
        assert 0 <= q < size
        return q
    if mode == "replicate":
        return 0 if p < 0 else size - 1
    if mode == "circular":
        return p % size
    raise AssertionError(mode)


def explicit_patches(x: torch.Tensor, case: Case) -> torch.Tensor:
    """Patch rows ``(groups, N·oh·ow, C/groups·kh·kw)``: rows (n, i, j), columns (c, u, v)."""
    g = geometry(case)
    n_, c_, h_, w_ = x.shape
    groups = case.n_groups
    cg = c_ // groups
    oh, ow = g.out_size(h_, w_)
    xs = x.tolist()
    out = []
    for k in range(groups):
        rows = []
        for n in range(n_):
            for i in range(oh):
                for j in range(ow):
                    row = []
                    for c in range(k * cg, (k + 1) * cg):
                        for u in range(g.kh):
                            for v in range(g.kw):
                                p = source_index(i * g.sh + u * g.dh - g.top, h_, case.mode)
                                q = source_index(j * g.sw + v * g.dw - g.left, w_, case.mode)
                                row.append(0.0 if p is None or q is None else xs[n][c][p][q])
                    rows.append(row)
        out.append(rows)
    return torch.tensor(out, dtype=DT)


def output_rows(r: torch.Tensor, groups: int) -> torch.Tensor:
    """Output-gradient rows ``(groups, N·oh·ow, out/groups)`` in the (n, i, j) order."""
    n_, o_, oh, ow = r.shape
    og = o_ // groups
    rs = r.tolist()
    return torch.tensor(
        [
            [
                [rs[n][o][i][j] for o in range(k * og, (k + 1) * og)]
                for n in range(n_)
                for i in range(oh)
                for j in range(ow)
            ]
            for k in range(groups)
        ],
        dtype=DT,
    )


def with_ones(a: torch.Tensor, bias: bool, value: float = 1.0) -> torch.Tensor:
    if not bias:
        return a
    return torch.cat([a, torch.full((*a.shape[:-1], 1), value, dtype=a.dtype)], dim=-1)


def unstack(t: torch.Tensor, groups: int) -> torch.Tensor:
    """The library drops the leading groups dimension when groups == 1."""
    return t[0] if groups == 1 else t


def explicit_conv(x: torch.Tensor, conv: nn.Conv2d, case: Case) -> torch.Tensor:
    """The convolution written with the explicit patches: out = patches · W_kᵀ + b."""
    patches = explicit_patches(x, case)
    groups = case.n_groups
    og = case.cout // groups
    oh, ow = geometry(case).out_size(x.shape[2], x.shape[3])
    w = conv.weight.detach().reshape(groups, og, -1)
    out = patches @ w.mT  # (groups, N·oh·ow, og)
    if conv.bias is not None:
        out = out + conv.bias.detach().reshape(groups, 1, og)
    out = out.reshape(groups, x.shape[0], oh, ow, og).permute(1, 0, 4, 2, 3)
    return out.reshape(x.shape[0], case.cout, oh, ow)


def fisher_oracle(a: torch.Tensor, r: torch.Tensor, bias: bool, batch: int, c: float):
    """``A = Σ aaᵀ / rows``, ``G = Σ rrᵀ / (N c²)`` per group."""
    ab = with_ones(a, bias)
    return ab.mT @ ab / a.shape[-2], r.mT @ r / (batch * c * c)


def seeded(seed: int) -> torch.Generator:
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)


def setup(case: Case, seed: int = 0, n: int = N):
    gen = seeded(seed)
    conv = case.module()
    x = torch.randn(n, case.cin, H, W, dtype=DT, generator=gen)
    return conv, x, gen


def loss_and_output_grad(conv: nn.Conv2d, x: torch.Tensor, target: torch.Tensor):
    """Mean over examples of ``½‖tanh(conv(x)) − t‖²``, and its raw output-gradient r."""
    out = conv(x)
    out_d = out.detach().requires_grad_(True)
    loss = 0.5 * ((torch.tanh(out_d) - target) ** 2).flatten(1).sum(1).mean()
    (r,) = torch.autograd.grad(loss, out_d)
    return out, r


# ---------------------------------------------------------------------------------------
# 1. The oracle is PyTorch's convolution; factors equal it under "fisher".
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=str)
def test_explicit_extractor_reproduces_conv2d(case: Case) -> None:
    conv, x, _ = setup(case)
    expected = conv(x)
    torch.testing.assert_close(explicit_conv(x, conv, case), expected, **TOL)
    if case.mode == "zeros":
        direct = F.conv2d(
            x,
            conv.weight,
            conv.bias,
            stride=case.stride,
            padding=case.padding,
            dilation=case.dilation,
            groups=case.n_groups,
        )
        torch.testing.assert_close(explicit_conv(x, conv, case), direct, **TOL)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_fisher_factors_equal_explicit(case: Case) -> None:
    conv, x, gen = setup(case, seed=1)
    model = nn.Sequential(OrderedDict([("conv", conv), ("act", nn.Tanh())]))
    spec = kf.register(model)["conv"]
    groups = case.n_groups
    target = torch.randn(conv(x).shape, dtype=DT, generator=gen)
    _, r = loss_and_output_grad(conv, x, target)

    a = explicit_patches(x, case)
    rows = output_rows(r, groups)
    c = 1.0 / N
    a_exp, g_exp = fisher_oracle(a, rows, case.bias, N, c)
    a_shape, g_shape = unstack(a_exp, groups).shape, unstack(g_exp, groups).shape
    assert spec.factor_shapes == (tuple(a_shape), tuple(g_shape))

    # Pure factor functions.
    a_got = kf.core.a_factor(spec, [x], "fisher", DT)
    g_got = kf.core.g_factor(spec, [r], "fisher", DT, batch_size=N, loss_scale=c)
    torch.testing.assert_close(a_got, unstack(a_exp, groups), **TOL)
    torch.testing.assert_close(g_got, unstack(g_exp, groups), **TOL)

    # capture + accumulate_factors (the whole pipeline) give the same factors.
    def loss_fn(y: torch.Tensor) -> torch.Tensor:
        return 0.5 * ((y - target) ** 2).flatten(1).sum(1).mean()

    params = dict(model.named_parameters())
    _, grads, caps = kf.capture(model, params, x, loss_fn)
    assert caps.batch_size == N and caps.loss_scale == c
    expected_grads = torch.autograd.grad(loss_fn(model(x)), list(params.values()))
    for key, eg in zip(params, expected_grads):
        torch.testing.assert_close(grads[key], eg, **TOL)
    torch.testing.assert_close(caps.layers["conv"].output_grads[0], r, **TOL)
    state = kf.init({"conv": spec}, factor_dtype=DT)
    state = kf.step.accumulate_factors(state, caps)
    torch.testing.assert_close(state.layers["conv"].a_factor, unstack(a_exp, groups), **TOL)
    torch.testing.assert_close(state.layers["conv"].g_factor, unstack(g_exp, groups), **TOL)


# ---------------------------------------------------------------------------------------
# 2. Gradient identity and the gradient ⇄ matrix round trip.
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=str)
def test_gradient_matrix_is_sum_of_row_outer_products(case: Case) -> None:
    conv, x, gen = setup(case, seed=2)
    spec = kf.register(nn.Sequential(OrderedDict([("conv", conv)])))["conv"]
    groups = case.n_groups
    out = conv(x)
    cot = torch.randn(out.shape, dtype=DT, generator=gen)
    params = [conv.weight] + ([conv.bias] if case.bias else [])
    grads = torch.autograd.grad(out, params, cot)
    wg, bg = grads[0], (grads[1] if case.bias else None)

    m = kf.blocks.grads_to_matrix(spec, wg, bg)
    a = with_ones(explicit_patches(x, case), case.bias)
    rows = output_rows(cot, groups)
    expected = rows.mT @ a  # Σ_rows r aᵀ, per group
    assert tuple(m.shape) == spec.matrix_shape
    torch.testing.assert_close(m, unstack(expected, groups), **TOL)

    w2, b2 = kf.blocks.matrix_to_grads(spec, m)
    assert torch.equal(w2, wg)
    if case.bias:
        assert b2 is not None and torch.equal(b2, bg)
    else:
        assert b2 is None


# ---------------------------------------------------------------------------------------
# 3. Exactness: one example, 1×1 output ⇒ the empirical Fisher block is G ⊗ A.
# ---------------------------------------------------------------------------------------

EXACT = [
    # (case, input (h, w)); every case has a 1×1 output.
    (Case(3, cout=5), (3, 3)),
    (Case((2, 3), dilation=2, bias=False, cout=3), (3, 5)),
    (Case(3, padding=1, cout=3), (1, 1)),
    (Case(3, stride=2, padding=(1, 0), mode="reflect", cout=3), (2, 3)),
    (Case(3, groups=2, cout=6), (3, 3)),
    (Case((2, 3), stride=2, groups=2, bias=False, cout=4), (2, 3)),
    (Case(3, dilation=(2, 1), padding=(0, 1), groups=2, mode="circular", cout=4), (5, 1)),
]


def vec_per_group(w: torch.Tensor, b: torch.Tensor | None, groups: int) -> list[torch.Tensor]:
    """Row-major vec of each group's ``[W_k | b_k]`` (rows: out channels; bias last)."""
    og = w.shape[0] // groups
    out = []
    for k in range(groups):
        mk = w[k * og : (k + 1) * og].reshape(og, -1)
        if b is not None:
            mk = torch.cat([mk, b[k * og : (k + 1) * og, None]], dim=1)
        out.append(mk.reshape(-1))
    return out


@pytest.mark.parametrize("case,hw", EXACT, ids=[f"{c}-in{hw}" for c, hw in EXACT])
def test_single_example_fisher_block_is_exact(case: Case, hw: tuple[int, int]) -> None:
    gen = seeded(3)
    conv = case.module()
    x = torch.randn(1, case.cin, *hw, dtype=DT, generator=gen)
    assert conv(x).shape[-2:] == (1, 1)
    y = torch.randint(0, case.cout, (1,), generator=gen)
    model = nn.Sequential(OrderedDict([("conv", conv), ("flat", nn.Flatten())]))

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out, y)

    params = {k: v.detach() for k, v in model.named_parameters()}
    g = torch.func.grad(lambda p: loss_fn(functional_call(model, p, (x,))))(params)
    vecs = vec_per_group(g["conv.weight"], g.get("conv.bias"), case.n_groups)

    spec = kf.register(model)["conv"]
    _, _, caps = kf.capture(model, params, x, loss_fn)
    state = kf.step.accumulate_factors(kf.init({"conv": spec}, factor_dtype=DT), caps)
    a_f = state.layers["conv"].a_factor
    g_f = state.layers["conv"].g_factor
    if case.n_groups == 1:
        a_f, g_f = a_f[None], g_f[None]
    for k, v in enumerate(vecs):
        dense = torch.outer(v, v)
        torch.testing.assert_close(torch.kron(g_f[k], a_f[k]), dense, rtol=1e-10, atol=1e-10)


# ---------------------------------------------------------------------------------------
# 4. Convention "kfac-pytorch": rows divided by S = out_h·out_w, covariance over N·S rows.
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES[::3], ids=str)
def test_kfac_pytorch_convention(case: Case) -> None:
    conv, x, gen = setup(case, seed=4)
    spec = kf.register(nn.Sequential(OrderedDict([("conv", conv)])))["conv"]
    groups = case.n_groups
    target = torch.randn(conv(x).shape, dtype=DT, generator=gen)
    out, r = loss_and_output_grad(conv, x, target)
    s = out.shape[-2] * out.shape[-1]
    a = with_ones(explicit_patches(x, case), case.bias) / s
    rows = output_rows(r, groups) / s
    n_rows = N * s
    assert a.shape[-2] == n_rows
    a_exp = a.mT @ a / n_rows
    g_exp = rows.mT @ rows / n_rows

    a_got = kf.core.a_factor(spec, [x], "kfac-pytorch", DT)
    g_got = kf.core.g_factor(spec, [r], "kfac-pytorch", DT, batch_size=N, loss_scale=1.0 / N)
    torch.testing.assert_close(a_got, unstack(a_exp, groups), **TOL)
    torch.testing.assert_close(g_got, unstack(g_exp, groups), **TOL)

    # Through the state: identity start, new = ½·I + ½·batch.
    model = nn.Sequential(OrderedDict([("conv", conv)]))

    def loss_fn(y: torch.Tensor) -> torch.Tensor:
        return 0.5 * ((torch.tanh(y) - target) ** 2).flatten(1).sum(1).mean()

    _, _, caps = kf.capture(model, dict(model.named_parameters()), x, loss_fn)
    state = kf.init({"conv": spec}, convention="kfac-pytorch", factor_dtype=DT)
    state = kf.step.accumulate_factors(state, caps, factor_decay=0.5)
    eye_a = torch.eye(spec.a_dim, dtype=DT).expand(spec.factor_shapes[0])
    eye_g = torch.eye(spec.g_dim, dtype=DT).expand(spec.factor_shapes[1])
    ls = state.layers["conv"]
    torch.testing.assert_close(ls.a_factor, 0.5 * eye_a + 0.5 * unstack(a_exp, groups), **TOL)
    torch.testing.assert_close(ls.g_factor, 0.5 * eye_g + 0.5 * unstack(g_exp, groups), **TOL)


# ---------------------------------------------------------------------------------------
# 5. Unbatched input; 'same' padding as PyTorch applies it.
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "case",
    [
        Case(3, stride=2, padding=(1, 2), dilation=(2, 1), groups=2),
        Case((2, 3), padding="same", groups="dw", mode="reflect", cout=8),
    ],
    ids=str,
)
@pytest.mark.parametrize("convention", ["fisher", "kfac-pytorch"])
def test_unbatched_input_equals_batch_of_one(case: Case, convention: str) -> None:
    conv, x, gen = setup(case, seed=5, n=1)
    spec = kf.register(nn.Sequential(OrderedDict([("conv", conv)])))["conv"]
    x3 = x[0]
    r = torch.randn(conv(x).shape, dtype=DT, generator=gen)
    a1 = kf.core.a_factor(spec, [x], convention, DT)
    a3 = kf.core.a_factor(spec, [x3], convention, DT)
    g1 = kf.core.g_factor(spec, [r], convention, DT, batch_size=1, loss_scale=1.0)
    g3 = kf.core.g_factor(spec, [r[0]], convention, DT, batch_size=1, loss_scale=1.0)
    torch.testing.assert_close(a3, a1, rtol=0, atol=0)
    torch.testing.assert_close(g3, g1, rtol=0, atol=0)
    if convention == "fisher":
        a_exp, g_exp = fisher_oracle(
            explicit_patches(x, case), output_rows(r, case.n_groups), case.bias, 1, 1.0
        )
        torch.testing.assert_close(a3, unstack(a_exp, case.n_groups), **TOL)
        torch.testing.assert_close(g3, unstack(g_exp, case.n_groups), **TOL)

    # The whole pipeline on an unbatched call (batch_size given: the default would read
    # the channel count as the batch size).
    model = nn.Sequential(OrderedDict([("conv", conv)]))
    target = torch.randn(conv(x3).shape, dtype=DT, generator=gen)

    def loss_fn(y: torch.Tensor) -> torch.Tensor:
        return 0.5 * ((torch.tanh(y) - target) ** 2).sum()

    params = dict(model.named_parameters())
    l3, gr3, c3 = kf.capture(model, params, x3, loss_fn, batch_size=1)
    l1, gr1, c1 = kf.capture(model, params, x, lambda y: loss_fn(y[0]), batch_size=1)
    torch.testing.assert_close(l3, l1, **TOL)
    for k in gr1:
        torch.testing.assert_close(gr3[k], gr1[k], **TOL)
    s3 = kf.step.accumulate_factors(
        kf.init({"conv": spec}, convention=convention, factor_dtype=DT), c3
    )
    s1 = kf.step.accumulate_factors(
        kf.init({"conv": spec}, convention=convention, factor_dtype=DT), c1
    )
    torch.testing.assert_close(s3.layers["conv"].a_factor, s1.layers["conv"].a_factor, **TOL)
    torch.testing.assert_close(s3.layers["conv"].g_factor, s1.layers["conv"].g_factor, **TOL)


@pytest.mark.parametrize(
    "kernel,dilation,mode",
    [
        ((2, 4), 1, "zeros"),
        (2, (3, 1), "zeros"),
        ((4, 3), (1, 2), "zeros"),
        ((2, 4), (1, 3), "reflect"),
        ((3, 2), 1, "circular"),
        (2, 1, "replicate"),
    ],
)
def test_same_padding_matches_pytorch(kernel, dilation, mode) -> None:
    gen = seeded(6)
    conv = nn.Conv2d(2, 3, kernel, padding="same", dilation=dilation, padding_mode=mode).to(DT)
    x = torch.randn(1, 2, 7, 8, dtype=DT, generator=gen)
    expected = conv(x)
    assert expected.shape[-2:] == x.shape[-2:]
    kh, kw = _pair(kernel)
    dh, dw = _pair(dilation)
    th, tw = dh * (kh - 1), dw * (kw - 1)
    pad_mode = "constant" if mode == "zeros" else mode
    matches = []
    for left, top in itertools.product(range(tw + 1), range(th + 1)):
        pad = (left, tw - left, top, th - top)
        try:
            padded = F.pad(x, pad, mode=pad_mode)
        except RuntimeError:  # reflect: a side too wide for the input cannot be PyTorch's
            continue
        y = F.conv2d(padded, conv.weight, conv.bias, dilation=dilation)
        if y.shape == expected.shape and torch.allclose(y, expected, rtol=0, atol=1e-12):
            matches.append(pad)
    assert len(matches) == 1, matches  # random input: exactly one split reproduces PyTorch
    spec = kf.register(nn.Sequential(OrderedDict([("conv", conv)])))["conv"]
    assert spec.padding == matches[0]
    assert conv_padding(conv) == matches[0]


# ---------------------------------------------------------------------------------------
# 6. Bad input.
# ---------------------------------------------------------------------------------------


def _stem_spec() -> kf.blocks.LayerSpec:
    model = nn.Sequential(OrderedDict([("stem", nn.Conv2d(3, 4, 3, groups=1))]))
    return kf.register(model)["stem"]


@pytest.mark.parametrize("shape", [(2, 5, 6, 6), (2, 3, 6, 6, 1), (3, 6)])
def test_a_factor_wrong_input_names_layer_and_shape(shape: tuple[int, ...]) -> None:
    spec = _stem_spec()
    with pytest.raises(ValueError) as err:
        kf.core.a_factor(spec, [torch.zeros(shape)])
    msg = str(err.value)
    assert "'stem'" in msg
    assert str(shape) in msg


def test_a_factor_wrong_unbatched_input_reports_the_shape_given() -> None:
    spec = _stem_spec()
    with pytest.raises(ValueError) as err:
        kf.core.a_factor(spec, [torch.zeros(5, 6, 6)])
    msg = str(err.value)
    assert "'stem'" in msg
    assert "(5, 6, 6)" in msg and "(1, 5, 6, 6)" not in msg, msg


def test_g_factor_wrong_output_grad_names_layer_and_shape() -> None:
    spec = _stem_spec()
    with pytest.raises(ValueError, match=r"'stem'.*\(2, 5, 4, 4\)"):
        kf.core.g_factor(spec, [torch.zeros(2, 5, 4, 4)], batch_size=2, loss_scale=0.5)
