"""``KFACPreconditioner`` beside ``torch.compile`` of the model, as users apply it: the
preconditioner given ``torch.compile(model)``, or built first and the model compiled
after. The oracle is the same run in eager mode: gradients and factors within 1e-5.

Compiling takes 10-30 s the first time in a process and 2-5 s later: the compiling tests
are slow, few and small (a two-block GPT, Hugging Face's GPT-2 with two layers).
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.testing import CompileCounter

import kfac_func as kf
from kfac_func.adapter import recording
from kfac_func.adapter.coverage import MissingStatisticsWarning

Batch = tuple[torch.Tensor, torch.Tensor]


class _Block(nn.Module):
    def __init__(self, d: int, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (
            z.view(b, t, self.heads, c // self.heads).transpose(1, 2)
            for z in self.qkv(self.ln1(x)).split(c, dim=2)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class _GPT(nn.Module):
    """nanoGPT's shape: token and position embeddings, pre-norm blocks, a head."""

    def __init__(self, vocab: int = 32, d: int = 16, positions: int = 8, depth: int = 2) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(positions, d)
        self.blocks = nn.ModuleList([_Block(d) for _ in range(depth)])
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(self.ln(x)).flatten(0, 1), targets.flatten())


def _gpt(depth: int = 2) -> _GPT:
    torch.manual_seed(0)
    return _GPT(depth=depth)


def _batch(i: int) -> Batch:
    gen = torch.Generator().manual_seed(100 + i)
    idx = torch.randint(0, 32, (4, 8), generator=gen)
    return idx, torch.roll(idx, 1, 1)


Run = tuple[kf.KFACPreconditioner, list[dict[str, torch.Tensor]]]


def _setup(
    model: nn.Module, order: str, backend: Any = "inductor", **kwargs: Any
) -> tuple[kf.KFACPreconditioner, Any]:
    """The preconditioner (factor updates on every other step) and the forward to call.
    ``order``: eager, compile_first, pre_first or in_place (``model.compile()`` after)."""
    if order == "in_place":
        pre = kf.KFACPreconditioner(model, factor_update_steps=2, **kwargs)
        model.compile(backend=backend)
        return pre, model
    if order == "compile_first":
        forward: Any = torch.compile(model, backend=backend)
        return kf.KFACPreconditioner(forward, factor_update_steps=2, **kwargs), forward
    pre = kf.KFACPreconditioner(model, factor_update_steps=2, **kwargs)
    return pre, model if order == "eager" else torch.compile(model, backend=backend)


def _steps(pre: kf.KFACPreconditioner, forward: Any, loss_of: Any, steps: range) -> list[Any]:
    """Train steps; the preconditioned gradients of each."""
    grads = []
    for i in steps:
        loss_of(forward, i).backward()
        pre.step()
        grads.append(
            {n: p.grad.clone() for n, p in pre.model.named_parameters() if p.grad is not None}
        )
        pre.model.zero_grad()
    return grads


def _train(
    model: nn.Module, order: str, loss_of: Any, backend: Any = "inductor", **kwargs: Any
) -> Run:
    pre, forward = _setup(model, order, backend, **kwargs)
    return pre, _steps(pre, forward, loss_of, range(4))


def _gpt_loss(forward: Any, i: int) -> torch.Tensor:
    return forward(*_batch(i))  # type: ignore[no-any-return]


def _assert_same(eager: Run, compiled: Run) -> None:
    (pre_e, grads_e), (pre_c, grads_c) = eager, compiled
    assert list(pre_c.layers) == list(pre_e.layers)
    for k, (ge, gc) in enumerate(zip(grads_e, grads_c, strict=True)):
        assert ge.keys() == gc.keys()
        for name in ge:
            torch.testing.assert_close(gc[name], ge[name], rtol=1e-5, atol=1e-5, msg=f"{k} {name}")
    for name, le in pre_e.state.layers.items():
        lc = pre_c.state.layers[name]
        assert lc.factor_updates == le.factor_updates == 2, name
        for f in ("a_factor", "g_factor"):
            torch.testing.assert_close(getattr(lc, f), getattr(le, f), rtol=1e-5, atol=1e-6)


def test_a_compiled_model_registers_the_eager_names() -> None:
    model = _gpt()
    compiled = kf.KFACPreconditioner(torch.compile(model))
    assert list(compiled.layers) == list(kf.KFACPreconditioner(model).layers)
    assert not any("_orig_mod" in name for name in compiled.layers)
    assert compiled.model is model
    # so state dicts move between compiled and eager runs
    kf.KFACPreconditioner(model).load_state_dict(compiled.state_dict())


class _Bypass(nn.Module):
    """Calls ``fc2.forward`` directly: ``fc2``'s hooks never run."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2.forward(torch.tanh(self.fc1(x)))  # type: ignore[no-any-return]


def test_a_layer_whose_hooks_are_bypassed_is_named_at_the_step() -> None:
    torch.manual_seed(0)
    model = _Bypass()
    pre = kf.KFACPreconditioner(model)
    model(torch.randn(8, 3)).pow(2).mean().backward()
    raw = model.fc2.weight.grad.clone()
    with pytest.warns(MissingStatisticsWarning, match=r"layers \['fc2'\] received gradients") as w:
        pre.step()
    assert w[0].filename == __file__  # points at the step() call
    # left to the other optimizer from now on: out of the table and the state, its
    # gradient unchanged, and no warning at the next steps
    assert [ls.factor_updates for ls in pre.state.layers.values()] == [1]
    assert list(pre.layers) == ["fc1"] and "no statistics" in pre.layers.skipped["fc2"]
    assert torch.equal(model.fc2.weight.grad, raw)
    model(torch.randn(8, 3)).pow(2).mean().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error", MissingStatisticsWarning)
        pre.step()


def test_steps_without_statistics_on_purpose_do_not_warn() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    pre = kf.KFACPreconditioner(model, factor_update_steps=2, accumulation_steps=2)
    x = torch.randn(8, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", MissingStatisticsWarning)
        model(x).sum()  # a forward without backward
        for _ in range(2):  # a factor-update step, and one without
            for _ in range(2):
                model(x).pow(2).mean().backward()
            pre.step()
        model.eval()  # evaluation mode collects nothing, and expects nothing
        model(x).pow(2).mean().backward()
        pre.step()
        with torch.no_grad():
            model(x)
        pre.step()  # no gradients at all
    assert [ls.factor_updates for ls in pre.state.layers.values()] == [1, 1]


@pytest.mark.slow
@pytest.mark.parametrize("order", ["compile_first", "pre_first"])
@pytest.mark.parametrize("in_hook", [True, False], ids=["in_hook", "at_step"])
def test_compiled_model_preconditions_as_eager(order: str, in_hook: bool) -> None:
    kwargs = {"update_factors_in_hook": in_hook}
    eager = _train(_gpt(), "eager", _gpt_loss, **kwargs)
    _assert_same(eager, _train(_gpt(), order, _gpt_loss, **kwargs))


@pytest.mark.slow
@pytest.mark.parametrize("order", ["compile_first", "pre_first"])
def test_compiled_code_is_shared_by_blocks_and_steps(order: str) -> None:
    """No recompile storm: the blocks of a deep model run the graphs compiled for the
    first one (the hooks put no guard on the preconditioner's state), and steps with and
    without factor updates, in training and evaluation, compile nothing more."""
    frames = {}
    for depth in (2, 6):
        counter = CompileCounter()
        pre, forward = _setup(_gpt(depth), order, backend=counter)
        _steps(pre, forward, _gpt_loss, range(2))
        frames[depth] = counter.frame_count
    assert 0 < frames[2] == frames[6]
    _steps(pre, forward, _gpt_loss, range(2, 8))  # factor updates on and off
    assert counter.frame_count == frames[6]
    pre.model.eval()
    with torch.no_grad():
        forward(*_batch(0))
    evaluated = counter.frame_count
    assert evaluated <= 2 * frames[6]  # the training flag is guarded: once more for eval
    pre.model.train()
    _steps(pre, forward, _gpt_loss, range(4))
    assert counter.frame_count == evaluated
    assert all(ls.factor_updates == 6 for ls in pre.state.layers.values())


def _compile_another_instance(backend: Any) -> None:
    """Compile and run a model of the same class without a preconditioner (what an
    earlier run in the process did)."""
    other = torch.compile(_gpt(), backend=backend)
    other(*_batch(0)).backward()


@pytest.mark.slow
@pytest.mark.parametrize("order", ["compile_first", "pre_first", "in_place"])
def test_hooks_added_after_an_earlier_compile_collect(order: str) -> None:
    _compile_another_instance("eager")
    eager = _train(_gpt(), "eager", _gpt_loss, backend="eager")
    _assert_same(eager, _train(_gpt(), order, _gpt_loss, backend="eager"))


@pytest.mark.slow
def test_a_step_warns_naming_the_layers_whose_hooks_were_bypassed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # without dropping the code compiled before the hooks, dynamo runs it, hooks unseen
    monkeypatch.setattr(recording, "forget_compiled_code", lambda: False)
    torch._dynamo.reset()
    _compile_another_instance("eager")
    model = _gpt()
    pre = kf.KFACPreconditioner(model, factor_update_steps=2)
    forward = torch.compile(model, backend="eager")
    forward(*_batch(0)).backward()
    with pytest.warns(MissingStatisticsWarning) as caught:
        pre.step()
    message = str(caught[0].message)
    assert all(repr(name) in message for name in pre.layers), message
    assert all(ls.factor_updates == 0 for ls in pre.state.layers.values())
    forward(*_batch(1)).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error", MissingStatisticsWarning)
        pre.step()  # not a factor-update step: nothing expected, nothing said


@pytest.mark.slow
def test_compiled_gpt2_preconditions_as_eager() -> None:
    # the order that failed (the other is the small GPT's above), and 25 s to compile
    transformers = pytest.importorskip("transformers")

    def gpt2() -> nn.Module:
        torch.manual_seed(0)
        config = transformers.GPT2Config(
            n_layer=2, n_embd=64, n_head=2, vocab_size=96, n_positions=32,
            attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0,
        )  # fmt: skip
        return transformers.GPT2LMHeadModel(config)  # type: ignore[no-any-return]

    def loss_of(forward: Any, i: int) -> torch.Tensor:
        ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(i))
        return forward(input_ids=ids, labels=ids).loss  # type: ignore[no-any-return]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the tied embedding is skipped
        eager = _train(gpt2(), "eager", loss_of)
        compiled = _train(gpt2(), "compile_first", loss_of)
    _assert_same(eager, compiled)


class _Attention(nn.Module):
    """``nn.MultiheadAttention`` (whose projections are observed inside its forward) and a
    head: its forward runs eagerly inside the compiled model."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(32, 8)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, 32)

    def forward(self, idx: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        logits = self.head(self.attn(x, x, x, need_weights=False)[0])
        return nn.functional.cross_entropy(logits.reshape(-1, 32), y.reshape(-1))


@pytest.mark.slow
@pytest.mark.parametrize("order", ["compile_first", "pre_first"])
def test_compiled_attention_preconditions_as_eager(order: str) -> None:
    eager = _train(_Attention(), "eager", _gpt_loss)
    compiled = _train(_Attention(), order, _gpt_loss)
    assert {"attn.q_proj", "attn.out_proj"} <= set(compiled[0].layers)
    _assert_same(eager, compiled)
    compiled[0].remove()
    assert "forward" not in vars(compiled[0].model.attn)  # its own forward back
