"""One weight held by several embedding modules and a head (T5's shared token table): one
tied layer (kfac_func.blocks.tied) whose embedding use pools every embedding module's calls.

Oracle: each module's statistics from plain forward and tensor hooks in float64 (token
counts and output-gradient Gram of an embedding; input Gram and output-gradient diagonal
of the head), scaled by the ``"fisher"`` convention as the standalone Embedding and Linear
layers are, the embedding modules' calls pooled as one module's, and the two uses combined
by the formula of the kind's docstring, written out here.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from torch import nn

import kfac_func as kf

V, D, F64 = 11, 4, torch.float64


class Tables(nn.Module):
    """``enc`` and ``dec`` (two ``nn.Embedding``) and ``head`` share one weight; with
    ``use_dec=False`` the target ids go through ``enc`` too (``dec`` is never called);
    ``alias`` makes ``dec`` the same module as ``enc``; ``second=False`` leaves it out."""

    def __init__(self, use_dec: bool = True, alias: bool = False, second: bool = True) -> None:
        super().__init__()
        self.enc = nn.Embedding(V, D)
        if second:
            self.dec = self.enc if alias else nn.Embedding(V, D)
            self.dec.weight = self.enc.weight
        self.mix = nn.Linear(D, D)
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight = self.enc.weight
        self.use_dec = use_dec and second

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        context = torch.tanh(self.mix(self.enc(src))).mean(1, keepdim=True)
        dec = self.dec if self.use_dec else self.enc
        return self.head(torch.tanh(dec(tgt) + context) * 0.5)


def _recorded(
    model: nn.Module, names: Sequence[str], run: Callable[[], torch.Tensor]
) -> dict[str, list[tuple[torch.Tensor, torch.Tensor]]]:
    """``{module: [(input, output-gradient)]}`` of every call of the modules ``names``,
    from forward hooks and tensor hooks on the outputs during ``run().backward()``."""
    calls: dict[str, list[Any]] = {n: [] for n in names}

    def hook(name: str) -> Callable[..., None]:
        def fn(module: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> None:
            pair: list[Any] = [args[0].detach(), None]
            calls[name].append(pair)
            out.register_hook(lambda g: pair.__setitem__(1, g.detach()))

        return fn

    handles = [model.get_submodule(n).register_forward_hook(hook(n)) for n in names]
    try:
        run().backward()
    finally:
        for h in handles:
            h.remove()
    return {n: [(x, r) for x, r in c] for n, c in calls.items()}


def _oracle(
    calls: dict[str, list[tuple[torch.Tensor, torch.Tensor]]],
    embeddings: Sequence[str],
    head: str,
    batch_size: int,
    loss_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(D, M)``: the tied layer's vocabulary-side and model-side batch factors."""
    (x, r), *more = calls[head]
    assert not more
    v, d = r.shape[-1], x.shape[-1]
    g_scale = 1.0 / (batch_size * loss_scale**2)  # "fisher": a G factor's scale
    counts, n_rows, grad_gram = torch.zeros(v, dtype=F64), 0, torch.zeros(d, d, dtype=F64)
    for name in embeddings:  # every embedding module's calls: one use
        for ids, r_e in calls[name]:
            counts += torch.bincount(ids.reshape(-1), minlength=v).to(F64)
            n_rows += ids.numel()
            rows = r_e.reshape(-1, d).to(F64)
            grad_gram += rows.T @ rows
    d_e, m_e = counts / n_rows, grad_gram * g_scale  # counts: an A factor's 1/rows
    xs, rs = x.reshape(-1, d).to(F64), r.reshape(-1, v).to(F64)
    d_h, m_h = (rs * rs).sum(0) * g_scale, xs.T @ xs / xs.shape[0]
    uses = [(d_h, m_h), (d_e, m_e)]
    # m_i = tr(M_i)/d, t_i = tr(D_i) m_i, T = Σ t_i, s = Σ t_i m_i / T
    ms = [m.trace() / d for _, m in uses]
    ts = [d.sum() * m for (d, _), m in zip(uses, ms)]
    total = sum(ts)
    s = sum(t * m for t, m in zip(ts, ms)) / total
    d_out = sum(m_i * d_i for (d_i, _), m_i in zip(uses, ms)) / s  # D = Σ m_i D_i / s
    m_out = s * sum(d_i.sum() * m_i for d_i, m_i in uses) / total  # M = s Σ tr(D_i) M_i / T
    return d_out, m_out


def _factors(
    model: nn.Module, args: Any, loss_fn: Callable[[Any], torch.Tensor], kwargs: Any = None
) -> tuple[Any, Any, Any]:
    layers = kf.register(model)
    state = kf.init(layers, factor_dtype=F64, inv_dtype=F64)
    params = dict(model.named_parameters())
    _, grads, caps = kf.capture(model, params, args, loss_fn, layers=layers, kwargs=kwargs)
    return kf.step.accumulate_factors(state, caps, factor_decay=0.0), grads, caps


def _tables_case(model: Tables) -> tuple[tuple[torch.Tensor, ...], Callable[..., torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    src, tgt = torch.randint(0, V, (5, 6), generator=g), torch.randint(0, V, (5, 4), generator=g)
    y = torch.randint(0, V, (5, 4), generator=g)

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out.reshape(-1, V), y.reshape(-1))

    return (src, tgt), loss_fn


def _check_tables(model: Tables) -> tuple[torch.Tensor, torch.Tensor]:
    args, loss_fn = _tables_case(model)
    state, _, caps = _factors(model, args, loss_fn)
    names = ["enc", "dec", "head"] if hasattr(model, "dec") else ["enc", "head"]
    calls = _recorded(model, names, lambda: loss_fn(model(*args)))
    assert (caps.batch_size, caps.loss_scale) == (5, 1 / 5)
    d, m = _oracle(calls, names[:-1], "head", caps.batch_size, caps.loss_scale)
    ls = state.layers["head"]
    torch.testing.assert_close(ls.g_factor, d, rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(ls.a_factor, m, rtol=1e-10, atol=1e-14)
    return ls.g_factor, ls.a_factor


def test_two_embedding_modules_and_a_head_are_one_tied_layer() -> None:
    torch.manual_seed(0)
    model = Tables().double()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        table = kf.register(model)
    assert sorted(table) == ["head", "mix"] and not table.skipped
    spec = table["head"]
    assert (spec.kind, spec.weight, spec.option("tied"), spec.option("tied_also")) == (
        "tied", "enc.weight", "enc", ("dec",)
    )  # fmt: skip
    assert "tied with 'enc', 'dec'" in str(table)
    _check_tables(model)


def test_an_embedding_module_never_called_adds_nothing() -> None:
    """``dec`` registered but never called: the factors are those of the same model
    without it (one embedding and the head), and the oracle's two uses."""
    torch.manual_seed(0)
    model = Tables(use_dec=False).double()
    assert kf.register(model)["head"].option("tied_also") == ("dec",)
    d, m = _check_tables(model)
    alone = Tables(second=False).double()
    alone.load_state_dict({k: v for k, v in model.state_dict().items() if k != "dec.weight"})
    assert kf.register(alone)["head"].option("tied_also") is None
    d2, m2 = _check_tables(alone)
    torch.testing.assert_close(d, d2, rtol=1e-12, atol=0.0)
    torch.testing.assert_close(m, m2, rtol=1e-12, atol=0.0)


def _hooked_factors(model: Tables) -> tuple[torch.Tensor, torch.Tensor]:
    """The tied layer's factors after one step of KFACPreconditioner (module hooks)."""
    args, loss_fn = _tables_case(model)
    pre = kf.KFACPreconditioner(
        model,
        factor_dtype=F64,
        inv_dtype=F64,
        factor_decay=0.0,
        settings=kf.Settings(scaling="fisher"),
    )
    loss_fn(model(*args)).backward()
    pre.step()
    ls = pre.state.layers["head"]
    return ls.g_factor, ls.a_factor


def test_hooks_give_the_same_factors_for_distinct_and_aliased_modules() -> None:
    """The preconditioner's hooks feed every embedding module's calls to the tied layer:
    the oracle's factors, the same as with ``dec`` the very module ``enc`` (one module
    under two names, whose calls are pooled as any module's)."""
    torch.manual_seed(0)
    model = Tables().double()
    aliased, ref = Tables(alias=True).double(), Tables().double()
    aliased.load_state_dict(model.state_dict())
    ref.load_state_dict(model.state_dict())
    assert kf.register(aliased)["head"].option("tied_also") is None
    want = _check_tables(ref)
    torch.testing.assert_close(_hooked_factors(model), want, rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(_hooked_factors(aliased), want, rtol=1e-10, atol=1e-14)


def test_a_weight_of_two_heads_keeps_the_warned_skip() -> None:
    model = Tables()
    model.head2 = nn.Linear(D, V, bias=False)
    model.head2.weight = model.enc.weight
    with pytest.warns(UserWarning, match="shared by layers"):
        table = kf.register(model)
    assert sorted(table) == ["mix"]
    assert "shares parameter 'enc.weight'" in table.skipped["dec"]


def test_t5_shared_table_is_one_tied_layer_with_the_oracle_factors() -> None:
    """T5 (tiny config, float64): ``shared``, ``encoder.embed_tokens`` and
    ``decoder.embed_tokens`` are distinct modules with ``lm_head``'s weight; the decoder's
    rescaling of its output (tied) is the head's input. ``shared`` is never called."""
    pytest.importorskip("transformers")
    from fixture_families import t5

    torch.manual_seed(0)
    model, batch = t5()
    model = model.double()
    names = ["shared", "encoder.embed_tokens", "decoder.embed_tokens"]
    mods = [model.get_submodule(n) for n in names]
    assert len({id(m) for m in mods}) == 3 and model.config.tie_word_embeddings
    assert all(m.weight is model.lm_head.weight for m in mods)
    table = kf.register(model)
    spec = table["lm_head"]
    assert (spec.kind, spec.weight) == ("tied", "shared.weight")
    assert [spec.option("tied"), *spec.option("tied_also")] == names
    assert all(n not in table and n not in table.skipped for n in names)
    kwargs = batch(0)
    state, grads, caps = _factors(model, (), lambda out: out.loss, kwargs)
    calls = _recorded(model, [*names, "lm_head"], lambda: model(**kwargs).loss)
    assert calls["shared"] == [] and len(calls["encoder.embed_tokens"]) == 1
    want = _oracle(calls, names, "lm_head", caps.batch_size, caps.loss_scale)
    ls = state.layers["lm_head"]
    torch.testing.assert_close(ls.g_factor, want[0], rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(ls.a_factor, want[1], rtol=1e-10, atol=1e-14)
    # the tied layer's rows (every use) add up to autograd's gradient of the shared weight
    total = torch.zeros(spec.weight_shape, dtype=F64)
    for x, r in zip(caps.layers["lm_head"].inputs, caps.layers["lm_head"].output_grads):
        rows = spec.block.example_rows(spec, x, r)
        assert rows is not None
        total += torch.einsum("ntv,ntd->vd", rows[1], rows[0])
    torch.testing.assert_close(total, grads["shared.weight"], rtol=1e-9, atol=1e-12)


def test_embeddings_of_different_kinds_or_scales_are_not_tied() -> None:
    from kfac_func.blocks import LayerSpec
    from kfac_func.blocks.tied import tied_specs

    def emb(name: str, kind: str = "embedding", scale: float | None = None) -> LayerSpec:
        options = () if scale is None else (("scale", scale),)
        return LayerSpec(
            name, kind, "e.weight", None, V, D, diagonal=(True, False), options=options
        )

    head = LayerSpec("head", "linear", "head.weight", None, D, V)
    why = tied_specs(emb("e"), head, "e.weight", also=[emb("d", "scaled_embedding", 2.0)])
    assert why == "the embeddings 'e' and 'd' are not of one kind and scale"
    scaled = emb("e", "scaled_embedding", 2.0)
    assert isinstance(
        tied_specs(scaled, head, "e.weight", also=[emb("d", "scaled_embedding", 3.0)]), str
    )
    spec = tied_specs(scaled, head, "e.weight", also=[emb("d", "scaled_embedding", 2.0)])
    assert not isinstance(spec, str) and spec.option("embedding_scale") == 2.0


def test_checkpoints_from_before_load_the_tied_layer_fresh() -> None:
    """A checkpoint saved when the shared table was skipped holds none of its modules."""
    from kfac_func.blocks.tied import newly_tied

    layers = kf.register(Tables())
    assert newly_tied(layers, saved=["mix"]) == {"head"}
    assert newly_tied(layers, saved=["mix", "dec"]) == set()
    assert newly_tied(layers, saved=["mix", "head"]) == set()
