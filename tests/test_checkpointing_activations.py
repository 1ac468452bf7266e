"""Activation checkpointing re-runs forward passes inside the backward pass; the hooks count
each real call once (see :mod:`kfac_func.adapter.recompute`):

- non-reentrant checkpointing (``torch.utils.checkpoint``, FSDP2's ``checkpoint_wrapper``,
  Hugging Face's ``gradient_checkpointing_enable()``) used to fail the first ``step()``
  ("2 captured inputs but 1 output-gradients"): its recomputation's calls are not counted;
- reentrant checkpointing skips the real forward (run without gradients) and counts the
  recomputation, whose outputs carry the gradients;

so factors and preconditioned gradients equal those of the run without checkpointing
(float64, 1e-12) for eigen, inverse and EKFAC, with statistics built in the hooks or at
``step()``, over two accumulated micro-batches; the layer names are the model's own, without
``checkpoint_wrapper``'s ``_checkpoint_wrapped_module`` prefix.
"""

from __future__ import annotations

import copy
import functools
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from numerics import assert_same_decomposition, named
from settings_keywords import with_settings
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.utils.checkpoint import checkpoint

import kfac_func as kf

F64 = torch.float64
B, T, D = 3, 5, 8
TOL = {"rtol": 1e-12, "atol": 1e-12}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.attn = nn.MultiheadAttention(D, 2, batch_first=True)
        self.fc = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln(x)
        a, _ = self.attn(h, h, h, need_weights=False)
        return x + self.fc(torch.tanh(x + a))


class Net(nn.Module):
    def __init__(self, ckpt: Callable[..., Any] | None = None) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(D, 3)
        self.ckpt = ckpt

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h) if self.ckpt is None else self.ckpt(block, h)
        return self.head(h)


def _net(ckpt: Callable[..., Any] | None) -> nn.Module:
    torch.manual_seed(0)
    net = Net(ckpt).to(F64)
    return net


def _wrapped(impl: CheckpointImpl) -> nn.Module:
    net = _net(None)
    wrapper = functools.partial(checkpoint_wrapper, checkpoint_impl=impl)
    apply_activation_checkpointing(
        net, checkpoint_wrapper_fn=wrapper, check_fn=lambda m: isinstance(m, Block)
    )
    return net


MODELS: dict[str, Callable[[], nn.Module]] = {
    "none": lambda: _net(None),
    "non-reentrant": lambda: _net(functools.partial(checkpoint, use_reentrant=False)),
    "reentrant": lambda: _net(functools.partial(checkpoint, use_reentrant=True)),
    "checkpoint_wrapper": lambda: _wrapped(CheckpointImpl.NO_REENTRANT),
    "checkpoint_wrapper reentrant": lambda: _wrapped(CheckpointImpl.REENTRANT),
}


def _batches(vocab: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(4):
        if vocab is None:
            x = torch.randn(B, T, D, generator=g, dtype=F64)
            out.append((x, torch.randint(0, 3, (B, T), generator=g)))
        else:
            x = torch.randint(0, vocab, (B, T), generator=g)
            out.append((x, torch.randint(0, vocab, (B, T), generator=g)))
    return out


def _run(
    model: nn.Module,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    call: Callable[[nn.Module, torch.Tensor], torch.Tensor],
    **kwargs: Any,
) -> tuple[dict[str, Any], list[dict[str, torch.Tensor]]]:
    """Two steps of two accumulated micro-batches: the state's factors and the
    preconditioned gradients of each step."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pre = kf.KFACPreconditioner(
            model,
            accumulation_steps=2,
            settings=kf.Settings(scaling="fisher"),
            inv_dtype=F64,
            damping=0.01,
            **kwargs,
        )
        grads = []
        for step in range(2):
            model.zero_grad()
            for x, y in batches[2 * step : 2 * step + 2]:
                logits = call(model, x)
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)) / 2
                loss.backward()
            pre.step()
            grads.append(
                {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            )
    factors: dict[str, Any] = {n: (ls.a_factor, ls.g_factor) for n, ls in pre.state.layers.items()}
    for n, ls in pre.state.layers.items():
        factors[n + " decomposition"] = ls.decomposition
    return factors, grads


def _strip(name: str) -> str:
    return name.replace("_checkpoint_wrapped_module.", "")


def _assert_same(got: Any, want: Any) -> None:
    got_f, got_g = got
    want_f, want_g = want
    assert list(got_f) == list(want_f)
    for name in want_f:
        if name.endswith(" decomposition"):
            # eigenvectors of a repeated eigenvalue (a factor of fewer rows than its width)
            # are not unique: compared through what they determine
            assert (got_f[name] is None) == (want_f[name] is None), name
            if want_f[name] is not None:
                assert_same_decomposition(got_f[name], want_f[name], **TOL, what=name)
            continue
        for g, w in zip(got_f[name], want_f[name]):
            torch.testing.assert_close(g, w, **TOL, msg=named(name))
    for got_step, want_step in zip(got_g, want_g):
        assert {_strip(n) for n in got_step} == set(want_step)
        for n, g in got_step.items():
            torch.testing.assert_close(g, want_step[_strip(n)], **TOL, msg=named(n))


SETTINGS = [
    (method, in_hook) for method in ("eigen", "inverse", "ekfac") for in_hook in (True, False)
]


@pytest.mark.parametrize(("method", "in_hook"), SETTINGS)
@pytest.mark.parametrize("how", [k for k in MODELS if k != "none"])
def test_checkpointed_model_gives_the_factors_and_gradients_of_the_plain_one(
    how: str, method: str, in_hook: bool
) -> None:
    batches = _batches()
    kw = {"compute_method": method, "update_factors_in_hook": in_hook}
    call = lambda m, x: m(x)  # noqa: E731
    want = _run(MODELS["none"](), batches, call, **kw)
    _assert_same(_run(MODELS[how](), batches, call, **kw), want)


def test_checkpoint_wrapper_layer_names_are_the_models_own() -> None:
    pre = kf.KFACPreconditioner(MODELS["checkpoint_wrapper"]())
    assert list(pre.layers) == list(kf.KFACPreconditioner(MODELS["none"]()).layers)
    assert "blocks.0.attn.q_proj" in pre.state.layers


def test_state_saved_without_wrappers_resumes_with_them() -> None:
    """A run resumed with checkpoint_wrapper from a state dict saved without it (the
    layer names agree) continues exactly as the run without wrappers."""
    batches = _batches()
    kw: dict[str, Any] = {"accumulation_steps": 2, "scaling": "fisher", "inv_dtype": F64}

    def train(model: nn.Module, pre: Any, part: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        model.zero_grad()
        for x, y in part:
            F.cross_entropy(model(x).reshape(-1, 3), y.reshape(-1)).div(2).backward()
        pre.step()

    plain = MODELS["none"]()
    pre = kf.KFACPreconditioner(plain, **with_settings(**kw))
    train(plain, pre, batches[:2])
    wrapped = MODELS["checkpoint_wrapper"]()
    wrapped.load_state_dict(plain.state_dict())
    resumed = kf.KFACPreconditioner(wrapped, **with_settings(**kw))
    resumed.load_state_dict(pre.state_dict())
    train(plain, pre, batches[2:])
    train(wrapped, resumed, batches[2:])
    for name, ls in pre.state.layers.items():
        got = resumed.state.layers[name]
        torch.testing.assert_close(got.a_factor, ls.a_factor, **TOL)
        torch.testing.assert_close(got.g_factor, ls.g_factor, **TOL)
    params = {_strip(n): p for n, p in wrapped.named_parameters()}
    for n, p in plain.named_parameters():
        assert params[n].grad is not None and p.grad is not None, n
        torch.testing.assert_close(params[n].grad, p.grad, **TOL)


def _checkpointed(model: nn.Module, x: torch.Tensor, reentrant: bool) -> torch.Tensor:
    # (reentrant checkpointing differentiates only through inputs that require grad)
    out = checkpoint(model, x.clone().requires_grad_(), use_reentrant=reentrant)
    assert isinstance(out, torch.Tensor)
    return out


def test_whole_model_checkpointed() -> None:
    batches = _batches()
    want = _run(MODELS["none"](), batches, lambda m, x: m(x))
    for reentrant in (False, True):
        got = _run(
            MODELS["none"](),
            batches,
            functools.partial(_checkpointed, reentrant=reentrant),
        )
        _assert_same(got, want)


_GPT2: dict[str, nn.Module] = {}


def _gpt2() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    if "model" not in _GPT2:
        config = transformers.GPT2Config(
            n_layer=2,
            n_embd=64,
            n_head=2,
            vocab_size=65,
            n_positions=32,
            attn_implementation="eager",
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
        torch.manual_seed(0)
        _GPT2["model"] = transformers.GPT2LMHeadModel(config).to(F64)
    return copy.deepcopy(_GPT2["model"]).train()


@pytest.mark.slow
@pytest.mark.parametrize("reentrant", [None, True])
@pytest.mark.parametrize(
    ("method", "in_hook"), [("eigen", True), ("inverse", False), ("ekfac", True)]
)
def test_hugging_face_gradient_checkpointing(
    reentrant: bool | None, method: str, in_hook: bool
) -> None:
    batches = _batches(65)
    kw = {"compute_method": method, "update_factors_in_hook": in_hook}
    call = lambda m, x: m(input_ids=x).logits  # noqa: E731
    want = _run(_gpt2(), batches, call, **kw)
    model = _gpt2()
    ckpt_kwargs = None if reentrant is None else {"use_reentrant": reentrant}
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=ckpt_kwargs)
    assert model.is_gradient_checkpointing
    _assert_same(_run(model, batches, call, **kw), want)


@pytest.mark.parametrize("reentrant", [False, True])
def test_capture_of_a_checkpointed_model_says_torch_func_does_not_support_it(
    reentrant: bool,
) -> None:
    """torch.func (torch 2.13) refuses saved-tensor hooks (non-reentrant checkpointing) and
    autograd.Functions without setup_context (reentrant): the capture says so."""
    model = _net(functools.partial(checkpoint, use_reentrant=reentrant))
    x, y = _batches()[0]
    params = dict(model.named_parameters())
    loss_fn = lambda out: F.cross_entropy(out.reshape(-1, 3), y.reshape(-1))  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # reentrant: no input requires grad
        with pytest.raises(RuntimeError, match="supports neither activation checkpointing"):
            kf.capture(model, params, x, loss_fn)


class MLPBlocks(nn.Module):
    def __init__(self, ckpt: Callable[..., Any] | None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(D, D), nn.Tanh()) for _ in range(2))
        self.head = nn.Linear(D, 3)
        self.ckpt = ckpt

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x) if self.ckpt is None else self.ckpt(block, x)
        return self.head(x)


@pytest.mark.parametrize("in_hook", [True, False])
def test_parallel_preconditioner_on_a_checkpointed_model(in_hook: bool) -> None:
    """The parallel preconditioner's hooks (one process) count recomputed calls alike."""
    from kfac_func.parallel.preconditioner import ParallelKFACPreconditioner

    def run(ckpt: Callable[..., Any] | None) -> tuple[dict[str, Any], list[Any]]:
        model = MLPBlocks(ckpt).to(F64)
        pre = ParallelKFACPreconditioner(
            model,
            accumulation_steps=2,
            settings=kf.Settings(scaling="fisher"),
            factor_dtype=F64,
            inv_dtype=F64,
            update_factors_in_hook=in_hook,
        )
        grads = []
        for step in range(2):
            model.zero_grad()
            for x, y in _batches()[2 * step : 2 * step + 2]:
                F.cross_entropy(model(x).reshape(-1, 3), y.reshape(-1)).div(2).backward()
            pre.step()
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        return {n: (ls.a_factor, ls.g_factor) for n, ls in pre.state.layers.items()}, grads

    want = run(None)
    for reentrant in (False, True):
        _assert_same(run(functools.partial(_checkpointed, reentrant=reentrant)), want)
