"""Blocked A factors (``LayerSpec.a_blocks``, ``Orthogonal(block=...)``) against references
written out here in float64: the statistics are the whole Gram's diagonal blocks, sliced
by hand and zero-padded; the one-sided orthogonalized step equals Muon's step on the
power of the *dense* block-diagonal part of the unblocked A (``torch.block_diag`` of
its blocks, ``eigh`` of that, ``λ = δ·tr(A)/n``); states round-trip through state dicts,
DCP and two gloo ranks; what cannot be blocked is refused."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from fixture_models import FIXTURES, Fixture, T
from test_orthogonal import _matrices, _ns_reference
from torch import nn

import kfac_func as kf
from kfac_func.blocks import LayerSpec, a_gram, call_grams
from kfac_func.core.decomposition import EigenDecomposition
from kfac_func.core.orthogonal import apply_powers, factor_powers
from kfac_func.step.orthogonal import Orthogonal, orthogonal_layers, orthogonal_table

F64 = torch.float64


def _blocks_by_hand(full: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` diagonal blocks of ``full`` (``(..., n, n)``), each ``ceil(n/k)`` wide, the
    last zero-padded, stacked."""
    n = full.shape[-1]
    w = math.ceil(n / k)
    out = torch.zeros(*full.shape[:-2], k, w, w, dtype=full.dtype)
    for i in range(k):
        lo, hi = i * w, min((i + 1) * w, n)
        out[..., i, : hi - lo, : hi - lo] = full[..., lo:hi, lo:hi]
    return out


def _dense(blocks: torch.Tensor, n: int) -> torch.Tensor:
    """The ``n × n`` block-diagonal matrix of ``blocks`` (``(k, w, w)``), padding dropped."""
    return torch.block_diag(*blocks)[:n, :n]


def _blocked(spec: LayerSpec, k: int) -> LayerSpec:
    return dataclasses.replace(spec, diagonal=(False, True), a_blocks=k)


CALLS = {
    # kind: (module, input); a_dim 9 or 10 in 3 blocks: padding, and none
    "linear": (lambda: nn.Linear(9, 4), lambda: torch.randn(5, 7, 9, dtype=F64)),
    "linear-nobias": (lambda: nn.Linear(9, 4, bias=False), lambda: torch.randn(6, 9, dtype=F64)),
    "conv2d-patches": (lambda: nn.Conv2d(2, 3, 2), lambda: torch.randn(2, 2, 5, 5, dtype=F64)),
    "conv2d-strided": (
        lambda: nn.Conv2d(2, 3, 2, stride=2),
        lambda: torch.randn(2, 2, 6, 6, dtype=F64),
    ),
    "conv1d": (lambda: nn.Conv1d(3, 2, 3), lambda: torch.randn(2, 3, 8, dtype=F64)),
}


@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize("kind", sorted(CALLS))
def test_statistics_are_the_diagonal_blocks(kind: str, k: int) -> None:
    torch.manual_seed(0)
    module, x = CALLS[kind][0]().double(), CALLS[kind][1]()
    spec = kf.register(nn.Sequential(module))["0"]
    whole = a_gram(spec, x, F64)
    got = a_gram(_blocked(spec, k), x, F64)
    assert got.gram.shape == _blocked(spec, k).factor_shapes[0]
    torch.testing.assert_close(got.gram, _blocks_by_hand(whole.gram, k), rtol=1e-13, atol=1e-12)
    assert (got.rows, got.spatial) == (whole.rows, whole.spatial)


def test_statistics_of_a_joint_kind_and_of_the_functional_capture() -> None:
    """GPT-2's ``Conv1D`` (a transposed linear) through :func:`call_grams`, as the
    functional step builds them, against its whole Gram's blocks."""
    transformers = pytest.importorskip("transformers")
    conv = transformers.pytorch_utils.Conv1D(4, 7).double()
    spec = kf.register(nn.Sequential(conv))["0"]
    x = torch.randn(3, 5, 7, dtype=F64)
    (whole,), _ = call_grams(spec, [x], [torch.randn(3, 5, 4, dtype=F64)], F64)
    (got,), _ = call_grams(_blocked(spec, 3), [x], [torch.randn(3, 5, 4, dtype=F64)], F64)
    torch.testing.assert_close(got.gram, _blocks_by_hand(whole.gram, 3), rtol=1e-13, atol=1e-12)


def _dense_power(a: torch.Tensor, p: float, delta: float) -> torch.Tensor:
    """``(A + δ·mean(eig A)·I)^(-p)`` of a dense symmetric ``A`` (eigenvalues clamped at 0)."""
    d, q = torch.linalg.eigh(a.to(F64))
    d = d.clamp(min=0)
    return (q * (d + delta * d.mean()) ** -p) @ q.T


@pytest.mark.parametrize("rank", [3, 40])
def test_blocked_power_is_the_power_of_the_block_diagonal_part(rank: int) -> None:
    """A 10-wide side in 3 blocks of 4 (2 padding columns), full rank and rank 3 (the
    blocks' null spaces meet the padding's)."""
    torch.manual_seed(1)
    rows = torch.randn(rank, 10, dtype=F64)
    full = rows.T @ rows / rank
    blocks = _blocks_by_hand(full, 3)
    d, q = torch.linalg.eigh(blocks)
    dec = EigenDecomposition(q, d, None, torch.ones(5, dtype=F64))
    power = factor_powers(dec, (0.5, 0.0), 0.01, a_width=10).a
    assert power is not None and power.shape == (3, 4, 4)
    u = torch.randn(5, 10, dtype=F64)
    want = u @ _dense_power(_dense(blocks, 10), 0.5, 0.01)
    torch.testing.assert_close(apply_powers(u, kf.core.orthogonal.FactorPowers(power, None)), want,
                               rtol=1e-10, atol=1e-12)  # fmt: skip


def _reference(
    dense: kf.KFACState, matrices: list[dict[str, torch.Tensor]], names: list[str], o: Orthogonal,
    blocks: dict[str, int],
) -> dict[str, torch.Tensor]:  # fmt: skip
    """Each layer's orthogonalized step from its gradient matrices so far and the dense
    block-diagonal part of the *unblocked* run's A, block by block: each block of columns
    (the last padded with zero columns) times its part of the power, orthogonalized by the
    iteration's scalar polynomial on its singular values and scaled for its width."""
    out = {}
    for name in names:
        a = dense.layers[name].a_factor
        n, k = a.shape[-1], blocks[name]
        bd = _dense(_blocks_by_hand(a, k), n)
        b = torch.zeros_like(matrices[0][name])
        for ms in matrices:
            b = o.beta * b + ms[name]
        u = matrices[-1][name] + o.beta * b
        p = u @ _dense_power(bd, o.powers[0], o.damping)
        w = math.ceil(n / k)
        parts = []
        for i in range(k):
            part = F.pad(p[:, i * w : (i + 1) * w], (0, w - p[:, i * w : (i + 1) * w].shape[1]))
            parts.append((_ns_reference(part) * 0.2 * max(u.shape[0], w) ** 0.5)[:, : n - i * w])
        out[name] = torch.cat(parts, dim=1)
    return out


@pytest.mark.parametrize("block", [5, 12])
@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_blocked_steps_equal_the_float64_reference_on_fixture_models(name: str, block: int) -> None:
    pytest.importorskip("transformers")
    fx: Fixture = FIXTURES[name]
    o = Orthogonal((0.5, 0.0), block=block)
    s = {"orthogonal": True, "kl_clip": None, "damping": 0.01, "ortho_powers": (0.5, 0.0)}
    model = fx.build(F64)
    table = kf.register(model, **({} if fx.kinds is None else {"kinds": fx.kinds}))
    blocked = orthogonal_table(table, o, others=True)
    dense = orthogonal_table(table, o._replace(block=None), others=True)
    state = kf.init(blocked, factor_dtype=F64, inv_dtype=F64)
    plain = kf.init(dense, factor_dtype=F64, inv_dtype=F64)
    names = orthogonal_layers(state.layers, o)
    k = {n: state.layers[n].spec.a_blocks for n in names}
    assert any(v > 1 for v in k.values())
    assert all(v == math.ceil(state.layers[n].spec.a_dim / block) for n, v in k.items() if v > 1)
    params = {p: v.detach() for p, v in model.named_parameters()}
    seen: list[dict[str, torch.Tensor]] = []
    for step in range(3):
        _, grads, caps = kf.capture(
            model, params, (), fx.loss, layers=blocked, kwargs=fx.batch(step, 4), loss_divisor=T
        )
        seen.append(_matrices(state, grads))
        new, state = kf.update(state, grads, captures=caps, update_inverses=step != 1, **s)
        _, plain = kf.update(plain, grads, captures=caps, update_inverses=False, **s)
        for n in names:  # the blocked factor: the unblocked one's diagonal blocks
            want = _blocks_by_hand(plain.layers[n].a_factor, k[n]) if k[n] > 1 else None
            if want is not None:
                torch.testing.assert_close(state.layers[n].a_factor, want, rtol=1e-12, atol=1e-14)
        if step == 1:  # the decomposition of step 0 with the factors of step 1
            continue
        got = _matrices(state, new)
        want_steps = _reference(plain, seen, names, o, k)
        for n in names:
            scale = float(want_steps[n].abs().max())
            torch.testing.assert_close(got[n], want_steps[n], rtol=0, atol=1e-10 * scale, msg=n)


def test_identity_start_of_a_blocked_factor() -> None:
    """``"kfac-pytorch"`` starts a factor at the identity: a blocked one at the identity's
    blocks, the padding at zero."""
    table = orthogonal_table(kf.register(nn.Linear(9, 4)), Orthogonal(block=4), others=True)
    state = kf.init(table, convention="kfac-pytorch")
    a = state.layers[""].a_factor  # 10 inputs with the bias: 3 blocks of 4
    assert a.shape == (3, 4, 4)
    torch.testing.assert_close(_dense(a, 10), torch.eye(10))
    assert float(a[2, 2:, 2:].abs().sum()) == 0.0


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(12, 20), nn.Tanh(), nn.Linear(20, 20), nn.Tanh(), nn.Linear(20, 4),
    ).double()  # fmt: skip


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(16, 12, generator=g, dtype=F64), torch.randint(0, 4, (16,), generator=g)


BLOCKED = Orthogonal(powers=(0.5, 0.0), wider_than=8, block=8)
"""Every layer wider than 8 on the orthogonalized step, A in blocks of at most 8: 13
inputs in 2 blocks of 7, 21 in 3 of 7."""


def _face(model: nn.Module) -> kf.KFAC:
    return kf.KFAC(model, orthogonal=BLOCKED, inv_update_steps=2, factor_dtype=F64, inv_dtype=F64)


def _train(model: nn.Module, opt: Any, steps: range, rank: int | None = None) -> None:
    for step in steps:
        x, y = _batch(step)
        if rank is not None:
            x, y = x[rank * 8 : (rank + 1) * 8], y[rank * 8 : (rank + 1) * 8]
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()


def test_blocked_face_resumes_bit_for_bit_through_state_dicts_and_dcp(tmp_path: Path) -> None:
    straight = _model()
    opt = _face(straight)
    assert [opt.preconditioner.layers[n].a_blocks for n in ("0", "2", "4")] == [2, 3, 3]
    _train(straight, opt, range(6))

    for via in ("state_dict", "dcp"):
        model = _model()
        first = _face(model)
        _train(model, first, range(3))
        resumed_model = _model()
        resumed = _face(resumed_model)
        if via == "state_dict":
            resumed_model.load_state_dict(model.state_dict())
            resumed.load_state_dict(first.state_dict())
        else:
            import warnings

            with warnings.catch_warnings():  # DCP without a process group
                warnings.simplefilter("ignore", UserWarning)
                ckpt = tmp_path / via
                kf.save_dcp({"model": model.state_dict(), "optim": first.state_dict()}, ckpt)
                template = {"model": resumed_model.state_dict(), "optim": resumed.state_dict()}
                kf.load_dcp(template, ckpt)
            resumed.load_state_dict(template["optim"])
        saved = resumed.preconditioner.state.layers["2"]
        assert saved.a_factor.shape == (3, 7, 7) and saved.ortho_momentum is not None
        assert saved.basis_moment is None  # the orthogonalized step keeps no other moments
        _train(resumed_model, resumed, range(3, 6))
        for (n, p), q in zip(straight.named_parameters(), resumed_model.parameters()):
            assert torch.equal(p, q), (via, n)


def test_refused() -> None:
    with pytest.raises(ValueError, match="one-sided step"):
        kf.KFAC(_model(), orthogonal=Orthogonal(powers=(0.25, 0.25), block=8))
    with pytest.raises(ValueError, match="ortho_block must be a positive int"):
        kf.KFAC(_model(), orthogonal=Orthogonal(block=0))
    spec = kf.register(nn.Linear(9, 4))[""]
    with pytest.raises(ValueError, match=r"layer '': a blocked A factor \(a_blocks=2\) needs"):
        dataclasses.replace(spec, a_blocks=2)  # G dense


def _worker(rank: int, world: int, tmp: str) -> None:
    from datetime import timedelta

    from gloo import gloo_group, record_errors
    from torch.nn.parallel import DistributedDataParallel

    with (
        gloo_group(rank, world, tmp, timeout=timedelta(seconds=60)),
        record_errors(Path(tmp, f"rank{rank}.error")),
    ):
        model = DistributedDataParallel(_model())
        opt = _face(model)
        _train(model, opt, range(4), rank)
        params = {n.removeprefix("module."): p.detach() for n, p in model.named_parameters()}
        torch.save(params, Path(tmp, f"rank{rank}.pt"))


def test_two_gloo_ranks_equal_one_process(tmp_path: Path) -> None:
    from gloo import one_thread, spawn

    spawn(_worker, 2, tmp_path)
    with one_thread():
        model = _model()
        _train(model, _face(model), range(4))
    for r in range(2):
        got = torch.load(tmp_path / f"rank{r}.pt", weights_only=True)
        for n, p in model.named_parameters():
            torch.testing.assert_close(got[n], p.detach(), rtol=1e-9, atol=1e-12, msg=n)


def test_state_dicts_hold_each_layers_own_moments_and_share_the_state() -> None:
    """A layer on the orthogonalized step carries its momentum and no eigenbasis moments
    (in memory and in the state dict); the narrow layer Adam's moments and no momentum.
    ``state_dict()`` hands out the state's own tensors (no copy, as ``torch.optim``), and
    ``load_state_dict`` takes them as they are; a state dict of earlier versions, with
    zero eigenbasis moments marked not held on the wide layers, still loads."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 8), nn.Tanh(), nn.Linear(8, 24)).double()
    opt = kf.KFAC(model, orthogonal=BLOCKED._replace(wider_than=15), factor_dtype=F64)
    _train(model, opt, range(3))
    state = opt.preconditioner.state
    sd = opt.state_dict()
    layers = sd["param_groups"][0]["kfac"]["layers"]
    wide, narrow = layers["2"], layers["0"]  # 8 -> 24 is wider than 15; 12 -> 8 is not
    assert "ortho_momentum" in wide and "basis_moment" not in wide
    assert wide["moments_held"] == {"ortho_momentum": 1}
    assert {"basis_moment", "basis_momentum"} <= set(narrow) and "ortho_momentum" not in narrow
    assert wide["A"] is state.layers["2"].a_factor and wide["A"].shape == (2, 5, 5)
    assert wide["ortho_momentum"] is state.layers["2"].ortho_momentum

    fresh_model = nn.Sequential(nn.Linear(12, 8), nn.Tanh(), nn.Linear(8, 24)).double()
    fresh = kf.KFAC(fresh_model, orthogonal=BLOCKED._replace(wider_than=15), factor_dtype=F64)
    fresh.load_state_dict(sd)
    loaded = fresh.preconditioner.state.layers["2"]
    assert loaded.a_factor.data_ptr() == state.layers["2"].a_factor.data_ptr()

    old = {k: v for k, v in sd.items()}  # earlier versions' shape of the same state
    kfac = dict(sd["param_groups"][0]["kfac"])
    kfac.pop("checksums")
    entry = dict(kfac["layers"]["2"])
    entry["basis_moment"] = torch.zeros(24, 9, dtype=F64)
    entry["moments_held"] = {**entry["moments_held"], "basis_moment": 0}
    kfac["layers"] = {**kfac["layers"], "2": entry}
    old["param_groups"] = [{**sd["param_groups"][0], "kfac": kfac}, *sd["param_groups"][1:]]
    again = kf.KFAC(fresh_model, orthogonal=BLOCKED._replace(wider_than=15), factor_dtype=F64)
    again.load_state_dict(old)
    assert again.preconditioner.state.layers["2"].basis_moment is None


def test_a_checkpoint_with_whole_factors_loads_into_blocked_ones() -> None:
    """A state dict of the recipe before its wide layers' A factors were blocked (here:
    the same recipe with ``block=None``) loads into the blocked one: each A as its
    diagonal blocks, the decomposition recomputed from them at once (the face's load
    computes none otherwise), the momentum as saved; training goes on from there. The
    other way round is refused, naming the layer and the shapes."""
    whole_model = _model()
    whole = kf.KFAC(whole_model, orthogonal=BLOCKED._replace(block=None), factor_dtype=F64)
    _train(whole_model, whole, range(3))
    saved = whole.state_dict()
    model = _model()
    opt = _face(model)
    opt.load_state_dict(saved)
    for name, old in whole.preconditioner.state.layers.items():
        new = opt.preconditioner.state.layers[name]
        k = new.spec.a_blocks
        assert k > 1 and new.decomposition is not None and new.decomposition.qa.shape[-3] == k
        torch.testing.assert_close(new.a_factor, _blocks_by_hand(old.a_factor, k), rtol=0, atol=0)
        assert torch.equal(new.ortho_momentum, old.ortho_momentum)
    _train(model, opt, range(3, 5))
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    back = kf.KFAC(_model(), orthogonal=BLOCKED._replace(block=None), factor_dtype=F64)
    with pytest.raises(ValueError, match=r"layer '0': state_dict factors have shapes \(2, 7, 7\)"):
        back.load_state_dict(opt.state_dict())
