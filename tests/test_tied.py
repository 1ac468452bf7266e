"""The tied embedding and head (kfac_func.blocks.tied): one layer for the shared weight.

Oracles: the per-example Fisher of the shared weight built with torch.func (vmap of grad)
in float64, on constructions where the Kronecker combination is exact (one use vanishing;
both uses proportional, each example using one), and the factors of the same model untied
(a standalone Embedding and a Linear head with a diagonal G) for the combination's
defining properties otherwise.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

import kfac_func as kf
from kfac_func.core.tied_factors import combine_uses

V, D = 7, 4


class TiedLM(nn.Module):
    """``ids -> emb -> tanh(Linear) -> head`` with the head's weight the embedding's."""

    def __init__(self, tie: bool = True, bias: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.mix = nn.Linear(D, D)
        self.head = nn.Linear(D, V, bias=bias)
        if tie:
            self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.emb(ids))))


class Probe(nn.Module):
    """A tied pair whose uses are chosen by the loss: ``(emb(ids), head(h))``."""

    def __init__(self, bias: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.head = nn.Linear(D, V, bias=bias)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        e = self.emb(ids)  # (N, 1, D)
        logits = self.head(h)  # (N, 1, V)
        return torch.cat([e, logits], dim=-1)


def _per_example_fisher(model: nn.Module, args: tuple[torch.Tensor, ...], loss_n) -> torch.Tensor:
    """``(1/N) Σ_n vec(∇W ℓ_n) vec(∇W ℓ_n)ᵀ`` of the shared weight, float64 (torch.func);
    ``args``: the model's two inputs, then what ``loss_n(out, args_n)`` needs besides."""
    params = {k: v.detach() for k, v in model.named_parameters()}
    # the head's bias, if any, is the last column of the layer's gradient matrix
    shared = {k: v for k, v in params.items() if k in ("emb.weight", "head.bias")}

    def one(w: dict[str, torch.Tensor], *xs: torch.Tensor) -> torch.Tensor:
        p = dict(params, **w)
        out = functional_call(model, p, tuple(x.unsqueeze(0) for x in xs[:2]))
        return loss_n(out[0], xs)

    gs = vmap(grad(one), in_dims=(None,) + (0,) * len(args))(shared, *args)
    g = gs["emb.weight"]
    if "head.bias" in gs:
        g = torch.cat([g, gs["head.bias"].unsqueeze(-1)], dim=-1)
    g = g.reshape(g.shape[0], -1)
    return g.T @ g / g.shape[0]


def _factors(model: nn.Module, args, loss_fn, **init):
    layers = kf.register(model)
    state = kf.init(layers, factor_dtype=torch.float64, inv_dtype=torch.float64, **init)
    params = dict(model.named_parameters())
    _loss, grads, caps = kf.capture(model, params, args, loss_fn, layers=layers)
    state = kf.step.accumulate_factors(state, caps)
    return state, grads, caps


def _probe_case(which: str, bias: bool = False):
    """One token ``v`` and one input ``h`` for every example; ``which`` uses are active:
    ``"head"``: a squared error on logit ``v``; ``"emb"``: ``β hᵀ emb``; ``"both"``: the
    first example the head's, the second the embedding's (no cross terms)."""
    torch.manual_seed(0)
    model = Probe(bias).double()
    n, v = 2, 3
    ids = torch.full((n, 1), v)
    h = torch.randn(1, 1, D, dtype=torch.float64).expand(n, 1, D).clone()
    head_on = {"head": [1.0, 1.0], "emb": [0.0, 0.0], "both": [1.0, 0.0]}[which]
    mask = torch.tensor(head_on, dtype=torch.float64)
    y = torch.tensor([0.3, -0.2], dtype=torch.float64)
    beta = 1.7

    def per_example(out: torch.Tensor, hv: torch.Tensor, m: torch.Tensor, t: torch.Tensor):
        e, logit = out[..., :D], out[..., D + v]
        head_loss = 0.5 * (logit - t) ** 2
        emb_loss = beta * (e * hv).sum(-1)
        return (m * head_loss + (1 - m) * emb_loss).sum()

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        per = [per_example(out[i], h[i], mask[i], y[i]) for i in range(n)]
        return torch.stack(per).mean()

    def loss_n(out, xs):
        return per_example(out, xs[1], xs[2], xs[3])

    fisher = _per_example_fisher(model, (ids, h, mask, y), loss_n)
    return model, (ids, h), loss_fn, fisher


def _kron(state) -> torch.Tensor:
    ls = state.layers["head"]
    return torch.kron(torch.diag(ls.g_factor), ls.a_factor)


@pytest.mark.parametrize(
    ("which", "bias"),
    [("head", False), ("emb", False), ("both", False), ("head", True), ("emb", True)],
)
def test_factors_equal_the_fisher_where_exact(which: str, bias: bool) -> None:
    """Exact where the uses are proportional; with the head's bias (BERT's), the bias row
    and column of the model side come from the head's use alone."""
    model, args, loss_fn, fisher = _probe_case(which, bias)
    state, _, _ = _factors(model, args, loss_fn)
    assert list(state.layers) == ["head"]
    assert fisher.abs().max() > 0.1
    torch.testing.assert_close(_kron(state), fisher, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("method", ["eigen", "ekfac", "inverse"])
def test_update_is_the_damped_fisher_solve_where_exact(method: str) -> None:
    model, args, loss_fn, fisher = _probe_case("both" if method != "inverse" else "head")
    layers = kf.register(model)
    state = kf.init(
        layers,
        compute_method=method,
        factor_dtype=torch.float64,
        inv_dtype=torch.float64,
        compute_eigenvalue_outer_product=False,
    )
    _, grads, caps = kf.capture(model, dict(model.named_parameters()), args, loss_fn)
    lam = 0.1
    new, _ = kf.update(state, grads, captures=caps, damping=lam, kl_clip=None)
    g = grads["emb.weight"].reshape(-1)
    if method == "inverse":  # (G + λI)⁻¹ ⊗ (A + λI)⁻¹ of the head alone: G = diag(r²), A = hhᵀ
        h = args[1][0, 0]
        r2 = torch.zeros(V, dtype=torch.float64)
        out = model(*args)[..., D + 3]
        r2[3] = ((out - torch.tensor([[0.3], [-0.2]], dtype=torch.float64)) ** 2).mean()
        dense = torch.kron(
            torch.linalg.inv(torch.diag(r2) + lam * torch.eye(V, dtype=torch.float64)),
            torch.linalg.inv(torch.outer(h, h) + lam * torch.eye(D, dtype=torch.float64)),
        )
        want = dense @ g
    else:
        want = torch.linalg.solve(fisher + lam * torch.eye(V * D, dtype=torch.float64), g)
    torch.testing.assert_close(new["emb.weight"].reshape(-1), want, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize(
    "convention,max_dim", [("fisher", None), ("kfac-pytorch", None), ("fisher", 2)]
)
def test_combination_properties_on_a_real_model(convention: str, max_dim: int | None) -> None:
    """Tied factors against the factors of the same model untied (an Embedding and a
    Linear head with a diagonal G): trace kept, PSD, and each use alone exact; with
    ``max_factor_dim`` below the width, the model side is diagonal too."""
    torch.manual_seed(1)
    tied = TiedLM().double()
    untied = TiedLM(tie=False).double()
    untied.load_state_dict({**tied.state_dict(), "head.weight": tied.emb.weight.detach()})
    ids, y = torch.randint(0, V, (5, 6)), torch.randint(0, V, (5, 6))

    def loss_fn(out):
        return nn.functional.cross_entropy(out.reshape(-1, V), y.reshape(-1))

    def batch_factors(model: nn.Module, limit: int | None):
        layers = kf.register(model, max_factor_dim=limit)
        state = kf.init(layers, convention=convention, factor_dtype=torch.float64)
        _, _, caps = kf.capture(model, dict(model.named_parameters()), ids, loss_fn)
        return kf.step.accumulate_factors(state, caps, factor_decay=0.0)  # the batch's factors

    state = batch_factors(tied, max_dim)
    ustate = batch_factors(untied, max_dim or V - 1)  # the head's G (V) diagonal
    e, h = ustate.layers["emb"], ustate.layers["head"]
    assert h.g_factor.dim() == 1 and e.a_factor.dim() == 1
    uses = [(h.g_factor, h.a_factor), (e.a_factor, e.g_factor)]
    ls = state.layers["head"]
    assert ls.a_factor.dim() == (1 if max_dim else 2)
    d, m = combine_uses(uses)
    torch.testing.assert_close(ls.g_factor, d)
    torch.testing.assert_close(ls.a_factor, m)

    def tr(x: torch.Tensor) -> torch.Tensor:
        return x.sum() if x.dim() == 1 else x.trace()

    summed = sum(dd.sum() * tr(mm) for dd, mm in uses)
    torch.testing.assert_close(ls.g_factor.sum() * tr(ls.a_factor), summed)
    full = torch.diag(ls.a_factor) if max_dim else ls.a_factor
    assert (ls.g_factor >= 0).all() and torch.linalg.eigvalsh(full).min() > -1e-12

    def kron(dd: torch.Tensor, mm: torch.Tensor) -> torch.Tensor:
        return torch.kron(torch.diag(dd), torch.diag(mm) if mm.dim() == 1 else mm)

    # the uses are not proportional here: the product is an approximation
    exact = kron(*uses[0]) + kron(*uses[1])
    assert (kron(d, m) - exact).abs().max() > 1e-6


def test_combine_uses_properties() -> None:
    torch.manual_seed(2)
    d1, d2 = torch.rand(5, dtype=torch.float64), torch.rand(5, dtype=torch.float64)
    x1, x2 = torch.randn(3, 3, dtype=torch.float64), torch.randn(3, 3, dtype=torch.float64)
    m1, m2 = x1 @ x1.T, x2 @ x2.T
    for zero in [(torch.zeros_like(d2), m2), (d2, torch.zeros_like(m2))]:
        d, m = combine_uses([(d1, m1), zero])
        torch.testing.assert_close(d, d1)
        torch.testing.assert_close(m, m1)
        d, m = combine_uses([zero, (d1, m1)])
        torch.testing.assert_close(d, d1)
        torch.testing.assert_close(m, m1)
    d, m = combine_uses([(d1, m1), (0.3 * d1, 2.0 * m1)])
    torch.testing.assert_close(torch.kron(torch.diag(d), m), 1.6 * torch.kron(torch.diag(d1), m1))
    d, m = combine_uses([(d1, m1), (d2, m2)])
    torch.testing.assert_close(d.sum() * m.trace(), d1.sum() * m1.trace() + d2.sum() * m2.trace())
    d0, m0 = combine_uses([(torch.zeros(5), torch.zeros(3, 3)), (torch.zeros(5), m2)])
    assert not d0.any() and not m0.any()
    # a diagonal model side (max_factor_dim) combines as its diagonal
    dd, md = combine_uses([(d1, m1.diagonal()), (d2, m2.diagonal())])
    torch.testing.assert_close(dd, d)
    torch.testing.assert_close(md, m.diagonal())


def test_register_ties_the_pair_and_counts_it_preconditioned() -> None:
    model = TiedLM()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        table = kf.register(model)
    assert sorted(table) == ["head", "mix"]
    spec = table["head"]
    assert (spec.kind, spec.weight, spec.option("tied")) == ("tied", "emb.weight", "emb")
    assert "tied with 'emb'" in str(table)
    mine, rest = table.split_parameters(model)
    assert any(p is model.emb.weight for p in mine) and rest == []


def test_other_shared_parameters_warn_once_per_model() -> None:
    other = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 2))
    other[1].weight = other[0].weight
    with pytest.warns(UserWarning, match="not an embedding and a head") as record:
        table = kf.register(other)
        kf.KFACPreconditioner(other)
    assert len([w for w in record if "shared by layers" in str(w.message)]) == 1
    assert sorted(table.skipped) == ["0", "1"] and list(table) == ["2"]
    assert "shares parameter '0.weight'" in table.skipped["1"]


def test_a_head_with_a_bias_is_tied_and_keeps_its_bias() -> None:
    model = TiedLM(bias=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        table = kf.register(model)
    spec = table["head"]
    assert spec.kind == "tied" and spec.bias == "head.bias" and spec.a_dim == D + 1
    assert not table.skipped


def test_the_pair_is_registered_not_skipped() -> None:
    """The tied pair is one layer (the table used to skip both modules)."""
    table = kf.register(TiedLM())
    assert "head" in table and "emb" not in table.skipped and "head" not in table.skipped


def _lm_batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (4, 5), generator=g)
    y = torch.randint(0, V, (4, 5), generator=g)
    return ids, y


@pytest.mark.parametrize(
    "method,moments", [("eigen", False), ("inverse", False), ("ekfac", False), ("eigen", True)]
)
def test_preconditioner_matches_functional(method: str, moments: bool) -> None:
    """KFACPreconditioner (hooks) and capture + update (torch.func) agree on the tied layer."""
    torch.manual_seed(3)
    model = TiedLM().double()
    ref = TiedLM().double()
    ref.load_state_dict(model.state_dict())
    kw = dict(damping=0.01, kl_clip=None, lr=0.1)
    pre = kf.KFACPreconditioner(
        model,
        compute_method=method,
        settings=kf.Settings(eigenbasis_moments=moments, scaling="fisher"),
        factor_dtype=torch.float64,
        inv_dtype=torch.float64,
        factor_decay=0.9,
        **kw,
    )
    layers = kf.register(ref)
    state = kf.init(
        layers,
        compute_method=method,
        factor_dtype=torch.float64,
        inv_dtype=torch.float64,
    )
    for step in range(3):
        ids, y = _lm_batch(step)

        def loss_fn(out, y=y):
            return nn.functional.cross_entropy(out.reshape(-1, V), y.reshape(-1))

        model.zero_grad()
        loss_fn(model(ids)).backward()
        pre.step()
        _, grads, caps = kf.capture(ref, dict(ref.named_parameters()), ids, loss_fn, layers=layers)
        new, state = kf.update(
            state, grads, captures=caps, factor_decay=0.9, eigenbasis_moments=moments, **kw
        )
        assert new["emb.weight"].isfinite().all()
        assert not torch.allclose(new["emb.weight"], grads["emb.weight"])
        torch.testing.assert_close(model.emb.weight.grad, new["emb.weight"], rtol=1e-8, atol=1e-10)
    assert pre.state.layers["head"].factor_updates == 3


def test_state_serializes_by_the_heads_name(tmp_path) -> None:
    model = TiedLM().double()
    ids, y = _lm_batch(0)

    def loss_fn(out):
        return nn.functional.cross_entropy(out.reshape(-1, V), y.reshape(-1))

    state, _grads, _caps = _factors(model, ids, loss_fn)
    state = kf.decompose(state)
    path = tmp_path / "state.safetensors"
    kf.save_state(state, str(path))
    like = kf.init(kf.register(model), factor_dtype=torch.float64, inv_dtype=torch.float64)
    back = kf.load_state(str(path), like=like)
    torch.testing.assert_close(back.layers["head"].g_factor, state.layers["head"].g_factor)
    torch.testing.assert_close(back.layers["head"].a_factor, state.layers["head"].a_factor)


def test_checkpoints_from_before_the_tie_still_load(tmp_path) -> None:
    """A state saved when the pair was skipped (no tied layer) loads: the tied layer starts
    fresh, the others come from the file (functional and preconditioner state dicts)."""
    model = TiedLM().double()
    ids, y = _lm_batch(0)

    def loss_fn(out):
        return nn.functional.cross_entropy(out.reshape(-1, V), y.reshape(-1))

    state, _, _ = _factors(model, ids, loss_fn)
    old = state.replace(layers={"mix": state.layers["mix"]})  # as the old table had it
    path = tmp_path / "old.safetensors"
    kf.save_state(old, str(path))
    like = kf.init(kf.register(model), factor_dtype=torch.float64, inv_dtype=torch.float64)
    back = kf.load_state(str(path), like=like)
    assert back.layers["head"].factor_updates == 0
    torch.testing.assert_close(back.layers["mix"].a_factor, state.layers["mix"].a_factor)

    pre = kf.KFACPreconditioner(model, factor_dtype=torch.float64)
    model.zero_grad()
    loss_fn(model(ids)).backward()
    pre.step()
    sd = pre.state_dict()
    sd["layers"] = {"mix": sd["layers"]["mix"]}
    fresh = kf.KFACPreconditioner(TiedLM().double(), factor_dtype=torch.float64)
    fresh.load_state_dict(sd)
    with pytest.raises(ValueError, match="missing"):
        sd["layers"] = {}
        fresh.load_state_dict(sd)


def test_wrapped_uses_are_named_as_the_model_names_them() -> None:
    """Under FSDP2's activation checkpointing the tied layer's uses lose the wrappers'
    ``_checkpoint_wrapped_module`` parts, as its name and parameters do."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
    )

    torch.manual_seed(0)
    model = TiedLM()
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, nn.Embedding))
    pre = kf.KFACPreconditioner(model)
    plain = kf.KFACPreconditioner(TiedLM())
    assert list(pre.layers) == list(plain.layers)
    for name, spec in pre.layers.items():
        assert spec.options == plain.layers[name].options, name
        assert "_checkpoint_wrapped_module" not in repr(spec.options), spec.options
