"""Statistics from bfloat16 operands (``gram_dtype=torch.bfloat16``) against float64, at a
tolerance derived from the rounding: each operand entry rounded to bfloat16 (relative
error at most ``u = 2⁻⁸``: 8 significant bits, rounded to nearest), each product summed
in float32 and the sum rounded once more, so every entry of a Gram lies within
``(3u + n·2⁻²⁴) · Σ|x||y|`` of the exact one, with ``Σ|x||y|`` the Gram of the
absolute values (``n`` the rows summed). The factors that such Grams make are averages
of them, within the same bound of the averages; the optimizer face chooses them where
the CPU multiplies bfloat16 natively."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kfac_func as kf
from kfac_func.blocks import a_gram, g_gram
from kfac_func.core.hardware import native_bf16

F64, BF16 = torch.float64, torch.bfloat16
U = 2.0**-8
"""bfloat16's unit roundoff (8 significant bits, round to nearest)."""


def _bound(abs_gram: torch.Tensor, rows: int) -> torch.Tensor:
    """The allowed difference of each entry: ``(3u + rows·2⁻²⁴)`` times the Gram of the
    absolute values."""
    return (3 * U + rows * 2.0**-24) * abs_gram


CASES = {
    "linear": (lambda: nn.Linear(24, 7), (64, 24)),
    "linear-3d": (lambda: nn.Linear(24, 7, bias=False), (4, 16, 24)),
    "conv2d": (lambda: nn.Conv2d(3, 5, 3), (4, 3, 9, 9)),
    "conv2d-strided": (lambda: nn.Conv2d(3, 5, 2, stride=2), (4, 3, 8, 8)),
    "conv1d": (lambda: nn.Conv1d(3, 5, 3), (4, 3, 17)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_bfloat16_grams_within_the_derived_bound(name: str) -> None:
    torch.manual_seed(0)
    make, shape = CASES[name]
    module = make()
    spec = kf.register(nn.Sequential(module))["0"]
    x = torch.randn(shape) * torch.logspace(-2, 2, shape[-1])  # entries of many scales
    y = module(x)
    r = torch.randn_like(y)
    for which, gram, t in (("A", a_gram, x), ("G", g_gram, r)):
        exact = gram(spec, t.double(), F64)
        got = gram(spec, t, BF16)
        assert got.gram.dtype == torch.float32 and got.rows == exact.rows
        err = (got.gram.double() - exact.gram).abs()
        allowed = _bound(gram(spec, t.double().abs(), F64).gram, exact.rows)
        worst = float((err / allowed.clamp(min=1e-300)).max())
        assert bool((err <= allowed).all()), (which, worst)
        # and not float32 in disguise: bfloat16's rounding shows
        assert float(err.max()) > 1e-6 * float(exact.gram.abs().max()), which


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 5))


def test_preconditioner_factors_within_the_bound_and_autocast_activations_as_they_are() -> None:
    """The factors of one step of a ``KFACPreconditioner`` with
    ``settings=kf.Settings(gram_dtype=torch.bfloat16)`` are within the bound of the float32
    ones (the Grams' bound, scaled as the factors are); under ``torch.autocast`` the hooks
    take the layer's bfloat16 input as it is (its A is then the Gram of exactly those
    values, within the last rounding of the sum)."""
    torch.manual_seed(1)
    x, y = torch.randn(64, 16) * 3, torch.randint(0, 5, (64,))
    factors = {}
    for dtype in (None, BF16):
        model = _model()
        pre = kf.KFACPreconditioner(model, settings=kf.Settings(gram_dtype=dtype), factor_decay=0.0)
        F.cross_entropy(model(x), y).backward()
        pre.step()
        factors[dtype] = {n: ls.a_factor for n, ls in pre.state.layers.items()}
    ones = torch.ones(64, 1, dtype=F64)
    rows = torch.cat([x.double(), ones], 1)  # layer 0's input rows, bias column
    allowed = _bound(rows.abs().T @ rows.abs() / 64, 64)
    err = (factors[BF16]["0"].double() - factors[None]["0"].double()).abs()
    assert bool((err <= allowed + 2.0**-23 * rows.abs().T @ rows.abs() / 64).all())

    model = _model()
    pre = kf.KFACPreconditioner(model, settings=kf.Settings(gram_dtype=BF16), factor_decay=0.0)
    seen: list[torch.Tensor] = []
    model[2].register_forward_hook(lambda m, a, o: seen.append(a[0].detach()))
    with torch.autocast("cpu", dtype=BF16):
        out = model(x)
    assert seen[0].dtype == BF16
    F.cross_entropy(out.float(), y).backward()
    pre.step()
    h = torch.cat([seen[0].double(), ones], 1)
    want = h.T @ h / 64
    got = pre.state.layers["2"].a_factor.double()
    assert bool(((got - want).abs() <= (U + 64 * 2.0**-24) * (h.abs().T @ h.abs()) / 64).all())


def test_the_face_chooses_bfloat16_statistics_where_the_cpu_multiplies_it() -> None:
    native = native_bf16("cpu")
    assert kf.KFAC(_model()).preconditioner.gram_dtype == (BF16 if native else None)
    assert kf.KFAC(_model().double()).preconditioner.gram_dtype is None  # float64 asked for
    assert kf.KFAC(_model(), recipe="kfac-pytorch").preconditioner.gram_dtype is None
    assert kf.KFACPreconditioner(_model()).gram_dtype is None  # kfac-pytorch's, exact
    with pytest.raises(ValueError, match="gram_dtype must be a floating"):
        kf.KFACPreconditioner(_model(), settings=kf.Settings(gram_dtype=torch.int8))
    with pytest.raises(ValueError, match="gram_dtype must be a floating"):
        kf.StepOptions(gram_dtype="bfloat16")  # type: ignore[arg-type]


@pytest.mark.parametrize(("avx512_bf16", "amx"), [(False, False), (True, False), (False, True)])
def test_bfloat16_counts_as_native_only_with_its_instructions(
    monkeypatch: pytest.MonkeyPatch, avx512_bf16: bool, amx: bool
) -> None:
    """An AVX-512 CPU without AVX-512 BF16 or AMX emulates bfloat16 products (oneDNN
    answers that it supports them, and each takes about four times the float32 one):
    the face keeps float32 statistics and a float32 Newton–Schulz iteration there."""
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    native = avx512_bf16 or amx
    assert native_bf16("cpu") is native
    opt = kf.KFAC(nn.Sequential(nn.Linear(16, 600), nn.Tanh(), nn.Linear(600, 5)))
    assert opt.preconditioner.gram_dtype == (BF16 if native else None)
    ortho = opt.preconditioner.orthogonal
    assert ortho is not None and ortho.dtype == (BF16 if native else None)


@pytest.mark.parametrize(("major", "native"), [(7, False), (8, True), (9, True)])
def test_a_cuda_device_is_native_from_ampere_on(
    monkeypatch: pytest.MonkeyPatch, major: int, native: bool
) -> None:
    """``torch.cuda.is_bf16_supported()`` counts emulation too (a V100's, a T4's)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (major, 0))
    assert native_bf16("cuda:0") is native
    assert native_bf16("meta") is False


def test_the_functional_step_takes_the_setting() -> None:
    """``kf.update(..., gram_dtype=torch.bfloat16)`` builds the same factors as the
    preconditioner's hooks with it (the same Grams, the same scaling)."""
    model = _model()
    x, y = torch.randn(64, 16), torch.randint(0, 5, (64,))
    params = dict(model.named_parameters())
    state = kf.init(kf.register(model))
    _, grads, caps = kf.capture(model, params, x, lambda o: F.cross_entropy(o, y))
    _, state = kf.update(state, grads, captures=caps, gram_dtype=BF16, factor_decay=0.0)
    other = _model()
    pre = kf.KFACPreconditioner(
        other,
        settings=kf.Settings(gram_dtype=BF16, scaling="fisher"),
        factor_decay=0.0,
    )
    F.cross_entropy(other(x), y).backward()
    pre.step()
    for name, ls in state.layers.items():
        torch.testing.assert_close(ls.a_factor, pre.state.layers[name].a_factor)
        torch.testing.assert_close(ls.g_factor, pre.state.layers[name].g_factor)


class _TiedPair(nn.Module):
    """An embedding and a head sharing its weight (one ``"tied"`` layer)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(5, 3), nn.Linear(3, 5, bias=False)
        self.head.weight = self.emb.weight


@pytest.mark.parametrize("kind", ["embedding", "tied"])
def test_token_counts_with_16_bit_grams_are_exact(kind: str) -> None:
    """An embedding's A statistic is its token counts: integers, exact in float32, so a
    bfloat16 ``gram_dtype`` (8 significant bits: 257 would round to 256) leaves them
    exact. Token 0 is looked up 257 times, token 3 once, the others never."""
    ids = torch.cat([torch.zeros(257, dtype=torch.long), torch.tensor([3])])[None]
    if kind == "embedding":
        spec = kf.register(nn.Sequential(nn.Embedding(5, 3)))["0"]
        got = a_gram(spec, ids, BF16)
    else:
        spec = kf.register(_TiedPair())["head"]
        got = spec.block.joint_grams(spec, ids, torch.randn(1, ids.shape[1], 3), BF16)[0]
    assert got.gram.dtype == torch.float32
    assert got.gram.tolist() == [257.0, 0.0, 0.0, 1.0, 0.0]
