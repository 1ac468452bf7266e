"""The batch size of a micro-batch comes from the registered layers' inputs, never from the
model's arguments:

- every fixture model called positionally, by keyword, with ``**batch`` and with a dict or
  a dataclass of inputs gives the same factors bit for bit, under both scalings
  (the old guess, the first positional tensor's leading dimension, made keyword calls a
  batch of one: G came out ``N``-fold too small under ``scaling="fisher"``);
- the G factor under ``"fisher"`` equals the per-example gradient covariance built here;
- a layer on flattened rows (``(B·T, d)``, as OPT's MLP) takes the other layers' batch
  size, at a batch of one too, and its factors equal the unflattened layer's (float64);
- layers that genuinely disagree (a sequence-first layer beside batch-first ones) raise a
  :class:`~kfac_func.blocks.examples.BatchSizeError` at ``step()`` naming those that
  disagree with the most common count (the others counted) and their input shapes, with
  the state unchanged; ``kf.capture`` raises the same, and takes ``batch_size=``;
- ``kf.capture`` tells the batch size of keyword, dict and dataclass inputs too.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kfac_func as kf
from kfac_func.blocks import register
from kfac_func.blocks.examples import BatchSizeError

F64 = torch.float64
B, T, D, V = 4, 5, 8, 11


@dataclasses.dataclass
class Inputs:
    x: torch.Tensor


def _unwrap(x: Any) -> torch.Tensor:
    if isinstance(x, dict):
        return x["x"]
    if isinstance(x, Inputs):
        return x.x
    return x


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D, 6), nn.Linear(6, 3)

    def forward(self, x: Any) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(_unwrap(x))))


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.norm = nn.GroupNorm(1, 3)
        self.bn = nn.BatchNorm2d(3)
        self.conv1d = nn.Conv1d(3, 2, 2)
        self.head = nn.Linear(2 * 15, 3)

    def forward(self, images: Any) -> torch.Tensor:
        h = self.bn(self.norm(torch.relu(self.conv(_unwrap(images)))))
        h = self.conv1d(h.flatten(2))  # (N, 3, 16) -> (N, 2, 15)
        return self.head(h.flatten(1))


class Transformer(nn.Module):
    """Linear, LayerNorm, nn.MultiheadAttention (batch first or sequence first), Linear."""

    def __init__(self, batch_first: bool) -> None:
        super().__init__()
        self.batch_first = batch_first
        self.inp = nn.Linear(D, D)
        self.ln = nn.LayerNorm(D)
        self.attn = nn.MultiheadAttention(D, 2, batch_first=batch_first)
        self.rms = nn.RMSNorm(D)
        self.head = nn.Linear(D, 3)

    def forward(self, x: Any) -> torch.Tensor:
        h = self.ln(self.inp(_unwrap(x)))
        q = h if self.batch_first else h.transpose(0, 1)
        a, _ = self.attn(q, q, q, need_weights=False)
        h = h + (a if self.batch_first else a.transpose(0, 1))
        return self.head(self.rms(h))


class TinyGPT(nn.Module):
    """nanoGPT's shape: token and position embeddings (positions 1-d, ``arange(T)``),
    ``forward(idx, targets=None)`` returning ``(logits, loss)``."""

    def __init__(self) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, D), nn.Embedding(T, D)
        self.ln = nn.LayerNorm(D)
        self.lm_head = nn.Linear(D, V)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        pos = torch.arange(idx.shape[1])
        logits = self.lm_head(self.ln(self.wte(idx) + self.wpe(pos)))
        loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss


_GPT2: dict[str, nn.Module] = {}


def _hf_gpt2() -> nn.Module:
    """GPT-2 from a config (random init, built once: its initialisation takes seconds)."""
    transformers = pytest.importorskip("transformers")
    if "model" not in _GPT2:
        config = transformers.GPT2Config(
            n_layer=2,
            n_embd=64,
            n_head=2,
            vocab_size=65,
            n_positions=32,
            attn_implementation="eager",
        )
        torch.manual_seed(0)
        _GPT2["model"] = transformers.GPT2LMHeadModel(config)
    return copy.deepcopy(_GPT2["model"])


def _logits(out: Any) -> torch.Tensor:
    if isinstance(out, tuple):
        return out[0]
    if isinstance(out, torch.Tensor):
        return out
    return out.logits  # a Hugging Face ModelOutput


Call = Callable[[nn.Module, torch.Tensor, torch.Tensor], Any]


def _factors(
    make: Callable[[], nn.Module],
    call: Call,
    x: torch.Tensor,
    y: torch.Tensor,
    scaling: str,
    **kwargs: Any,
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    model = make().to(F64)
    torch.manual_seed(0)  # the same dropout masks in every run
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tied weights, damping
        pre = kf.KFACPreconditioner(model, settings=kf.Settings(scaling=scaling), **kwargs)
        for _ in range(2):
            model.zero_grad()
            logits = _logits(call(model, x, y))
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
            loss.backward()
            pre.step()
    return {n: (ls.a_factor, ls.g_factor) for n, ls in pre.state.layers.items()}


def _assert_equal(
    got: dict[str, tuple[torch.Tensor, torch.Tensor]],
    want: dict[str, tuple[torch.Tensor, torch.Tensor]],
) -> None:
    assert set(got) == set(want)
    for name in want:
        for which, g, w in zip("AG", got[name], want[name]):
            assert torch.equal(g, w), (name, which, (g - w).abs().max())


def _positional(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Any:
    return model(x)


def _styles(keyword: str) -> dict[str, Call]:
    return {
        "keyword": lambda m, x, y: m(**{keyword: x}),
        "batch dict": lambda m, x, y: m(**dict({keyword: x})),
    }


def _wrapped_styles() -> dict[str, Call]:
    return {
        "dict": lambda m, x, y: m({"x": x}),
        "dict by keyword": lambda m, x, y: m(x={"x": x}),
        "dataclass": lambda m, x, y: m(Inputs(x)),
        "dataclass by keyword": lambda m, x, y: m(x=Inputs(x)),
    }


def _data(kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    if kind == "image":
        return torch.randn(B, 2, 4, 4, generator=g, dtype=F64), torch.randint(
            0, 3, (B,), generator=g
        )
    if kind == "sequence":
        return torch.randn(B, T, D, generator=g, dtype=F64), torch.randint(
            0, 3, (B, T), generator=g
        )
    if kind == "tokens":
        ids = torch.randint(0, V, (B, T), generator=g)
        return ids, torch.randint(0, V, (B, T), generator=g)
    if kind == "gpt2":
        ids = torch.randint(0, 65, (B, 8), generator=g)
        return ids, torch.randint(0, 65, (B, 8), generator=g)
    return torch.randn(B, D, generator=g, dtype=F64), torch.randint(0, 3, (B,), generator=g)


CASES: dict[str, tuple[Callable[[], nn.Module], str, dict[str, Call]]] = {
    "mlp": (MLP, "vector", {**_styles("x"), **_wrapped_styles()}),
    "conv": (ConvNet, "image", {**_styles("images"), "dict": lambda m, x, y: m({"x": x})}),
    "attention batch_first": (
        lambda: Transformer(True),
        "sequence",
        {**_styles("x"), "dataclass": lambda m, x, y: m(x=Inputs(x))},
    ),
    "attention sequence first": (lambda: Transformer(False), "sequence", _styles("x")),
    "nanogpt": (
        TinyGPT,
        "tokens",
        {**_styles("idx"), "idx and targets": lambda m, x, y: m(idx=x, targets=y)},
    ),
}


@pytest.mark.parametrize("scaling", ["fisher", "kfac-pytorch"])
@pytest.mark.parametrize("case", list(CASES))
def test_keyword_dict_and_dataclass_calls_give_the_positional_factors(
    case: str, scaling: str
) -> None:
    make, data, styles = CASES[case]
    x, y = _data(data)
    want = _factors(make, _positional, x, y, scaling)
    for style, call in styles.items():
        try:
            _assert_equal(_factors(make, call, x, y, scaling), want)
        except AssertionError as e:
            raise AssertionError(f"{case}, {style}: {e}") from None


@pytest.mark.parametrize("method", ["eigen", "ekfac"])
def test_ekfac_and_hook_free_statistics_by_keyword(method: str) -> None:
    x, y = _data("tokens")
    for in_hook in (True, False):
        kw = {"compute_method": method, "update_factors_in_hook": in_hook}
        want = _factors(TinyGPT, _positional, x, y, "fisher", **kw)
        got = _factors(TinyGPT, lambda m, x, y: m(idx=x, targets=y), x, y, "fisher", **kw)
        _assert_equal(got, want)


@pytest.mark.slow
@pytest.mark.parametrize("scaling", ["fisher", "kfac-pytorch"])
def test_hugging_face_gpt2_called_by_keyword(scaling: str) -> None:
    x, y = _data("gpt2")
    want = _factors(_hf_gpt2, _positional, x, y, scaling)
    calls: dict[str, Call] = {
        "input_ids=": lambda m, x, y: m(input_ids=x),
        "**batch": lambda m, x, y: m(**{"input_ids": x, "attention_mask": torch.ones_like(x)}),
        "with labels": lambda m, x, y: m(input_ids=x, labels=y),
    }
    for style, call in calls.items():
        try:
            _assert_equal(_factors(_hf_gpt2, call, x, y, scaling), want)
        except AssertionError as e:
            raise AssertionError(f"{style}: {e}") from None


def test_fisher_g_factor_is_the_per_example_gradient_covariance() -> None:
    """The oracle: under ``"fisher"`` (mean loss) the head's G is ``(1/N) Σ_n ∇_y ℓ_n ∇_y ℓ_nᵀ``
    of the per-example losses, whatever way the model is called."""
    torch.manual_seed(0)
    model = MLP().to(F64)
    x, y = _data("vector")
    pre = kf.KFACPreconditioner(model, settings=kf.Settings(scaling="fisher"))
    out = model(x=Inputs(x))
    out.retain_grad()
    F.cross_entropy(out, y).backward()
    pre.step()
    per_example = out.grad * B  # ∇_y of each example's own loss
    want = per_example.T @ per_example / B
    torch.testing.assert_close(pre.state.layers["fc2"].g_factor, want, rtol=1e-12, atol=0)


class Flattening(nn.Module):
    """A model that flattens ``(B, T, d)`` to ``(B·T, d)`` before its second layer (OPT's
    MLP, Qwen2-MoE's shared expert); ``flatten=False``: the same model without the
    reshape."""

    def __init__(self, flatten: bool = True) -> None:
        super().__init__()
        self.flatten = flatten
        self.inp, self.out = nn.Linear(D, D), nn.Linear(D, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        return self.out(h.reshape(-1, D) if self.flatten else h).reshape(-1, 3)


class SequenceFirst(nn.Module):
    """Batch-first layers, then one on the sequence-first ``(T, B, d)``: the layers
    disagree, and nothing says which count is the batch's."""

    def __init__(self, width: int = 2) -> None:
        super().__init__()
        self.body = nn.Sequential(*(nn.Linear(D, D) for _ in range(width)))
        self.out = nn.Linear(D, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.body(x).transpose(0, 1)).transpose(0, 1).reshape(-1, 3)


@pytest.mark.parametrize("n", [B, 1])
@pytest.mark.parametrize("moments", [False, True])
def test_flattened_rows_give_the_factors_of_the_unflattened_layer(moments: bool, n: int) -> None:
    """A flattened ``(B·T, d)`` input holds the rows of ``(B, T, d)``: under ``"fisher"`` the
    factors (and the preconditioned gradients) equal those of the same model without the
    reshape, and the batch size is the other layer's ``B`` (the old code raised), also
    at a batch of one, where the flattened layer sees ``(T, d)`` (the old code took
    ``T`` examples: G ``T``-fold too small)."""
    x, y = _data("sequence")
    x, y = x[:n], y[:n]
    got, want = {}, {}
    for flatten, out in ((True, got), (False, want)):
        torch.manual_seed(0)
        model = Flattening(flatten).to(F64)
        pre = kf.KFACPreconditioner(
            model, settings=kf.Settings(scaling="fisher", eigenbasis_moments=moments), damping=1e-3
        )
        F.cross_entropy(model(x=x), y.reshape(-1)).backward()
        pre.step()
        out.update({n: (ls.a_factor, ls.g_factor) for n, ls in pre.state.layers.items()})
        out.update({f"grad {n}": (p.grad, p.grad) for n, p in model.named_parameters()})
    assert set(got) == set(want)
    for name in want:
        for g, w in zip(got[name], want[name]):
            # the same rows in the same order: equal but for the summation order of Grams
            torch.testing.assert_close(g, w, rtol=1e-13, atol=1e-15)


def test_capture_of_flattened_rows_tells_the_batch_size() -> None:
    x, y = _data("sequence")
    torch.manual_seed(0)
    model = Flattening().to(F64)
    got = _capture(model, x, y)
    model.flatten = False
    want = _capture(model, x, y)
    assert got.batch_size == want.batch_size == B and got.loss_scale == want.loss_scale
    for name in want.layers:
        for g, w in zip(got.layers[name].output_grads, want.layers[name].output_grads):
            torch.testing.assert_close(g.reshape(w.shape), w, rtol=0, atol=0)


def test_layers_that_disagree_raise_at_step_and_leave_the_state() -> None:
    x, y = _data("sequence")
    model = SequenceFirst().to(F64)
    pre = kf.KFACPreconditioner(model, settings=kf.Settings(scaling="fisher"))
    before = {n: (ls.a_factor.clone(), ls.g_factor.clone()) for n, ls in pre.state.layers.items()}
    F.cross_entropy(model(x=x), y.reshape(-1)).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    with pytest.raises(BatchSizeError) as err:
        pre.step()
    msg = str(err.value)
    assert "'out' saw (5, 4, 8) (5 examples)" in msg, msg
    assert "'body.0' saw (4, 5, 8) (4 examples) and 1 more say 4" in msg, msg
    assert "skip_layers=" in msg and "state is unchanged" in msg
    assert pre.steps == 0
    _assert_equal({n: (ls.a_factor, ls.g_factor) for n, ls in pre.state.layers.items()}, before)
    for n, p in model.named_parameters():
        assert p.grad is not None and torch.equal(p.grad, grads[n])


def test_the_error_names_only_the_layers_that_disagree() -> None:
    """40 layers agree, one does not: the message names that one and counts the rest
    (the old message listed every layer)."""
    x, y = _data("sequence")
    model = SequenceFirst(width=40).to(F64)
    pre = kf.KFACPreconditioner(model, settings=kf.Settings(scaling="fisher"))
    F.cross_entropy(model(x), y.reshape(-1)).backward()
    with pytest.raises(BatchSizeError) as err:
        pre.step()
    msg = str(err.value)
    assert "'out' saw (5, 4, 8)" in msg and "and 39 more say 4" in msg, msg
    assert "body.1'" not in msg and len(msg) < 600, msg


def test_sequence_first_transformer_layers_raise_under_fisher() -> None:
    """``nn.TransformerEncoderLayer(batch_first=False)``: its attention sees the batch on
    dimension 1, its linears and norms say the sequence length: which is the batch cannot
    be known (the old guess took the sequence length)."""
    layer = nn.TransformerEncoderLayer(D, 2, 16, dropout=0.0, batch_first=False).to(F64)
    x = torch.randn(T, B, D, dtype=F64)
    pre = kf.KFACPreconditioner(layer, settings=kf.Settings(scaling="fisher"))
    layer(x).sum().backward()
    with pytest.raises(BatchSizeError) as err:
        pre.step()
    msg = str(err.value)
    assert "'self_attn.q_proj' saw (5, 4, 8) (4 examples)" in msg, msg
    assert "'norm1' saw (5, 4, 8) (5 examples) and 3 more say 5" in msg, msg
    layer = nn.TransformerEncoderLayer(D, 2, 16, dropout=0.0, batch_first=True).to(F64)
    pre = kf.KFACPreconditioner(layer, settings=kf.Settings(scaling="fisher"))
    layer(x.transpose(0, 1)).sum().backward()
    pre.step()
    assert pre.steps == 1


def test_layers_that_disagree_need_no_batch_size_under_kfac_pytorch_scaling() -> None:
    x, y = _data("sequence")
    model = SequenceFirst().to(F64)
    pre = kf.KFACPreconditioner(model)  # "kfac-pytorch": the factors do not use N
    F.cross_entropy(model(x), y.reshape(-1)).backward()
    pre.step()
    assert pre.steps == 1


def test_skipping_the_disagreeing_layer_resolves_the_error() -> None:
    x, y = _data("sequence")
    model = SequenceFirst().to(F64)
    pre = kf.KFACPreconditioner(
        model, settings=kf.Settings(scaling="fisher"), skip_layers=["^out$"]
    )
    F.cross_entropy(model(x), y.reshape(-1)).backward()
    pre.step()
    assert list(pre.state.layers) == ["body.0", "body.1"]


def _capture(model: nn.Module, args: Any, y: torch.Tensor, **kw: Any) -> kf.Captures:
    params = dict(model.named_parameters())
    loss_fn = lambda out: F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))  # noqa: E731
    return kf.capture(model, params, args, loss_fn, **kw)[2]


def test_capture_tells_the_batch_size_of_keyword_dict_and_dataclass_inputs() -> None:
    torch.manual_seed(0)
    model = MLP().to(F64)
    x, y = _data("vector")
    want = _capture(model, x, y)
    assert want.batch_size == B
    for args, kw in (
        ((), {"kwargs": {"x": x}}),
        ({"x": x}, {}),
        (Inputs(x), {}),
        ((), {"kwargs": {"x": Inputs(x)}}),
    ):
        got = _capture(model, args, y, **kw)
        assert (got.batch_size, got.loss_scale) == (want.batch_size, want.loss_scale)
        for name, lc in want.layers.items():
            assert all(map(torch.equal, got.layers[name].output_grads, lc.output_grads))


def test_capture_of_disagreeing_layers_raises_unless_given_batch_size() -> None:
    model = SequenceFirst().to(F64)
    x, y = _data("sequence")
    with pytest.raises(BatchSizeError, match=r"'out' saw \(5, 4, 8\).*batch_size="):
        _capture(model, x, y)
    assert _capture(model, x, y, batch_size=B).batch_size == B


@pytest.mark.parametrize(
    ("module", "shape", "want"),
    [
        (nn.Linear(3, 2), (4, 7, 3), 4),
        (nn.Linear(3, 2), (3,), 1),
        (nn.Conv2d(2, 2, 1), (4, 2, 5, 5), 4),
        (nn.Conv2d(2, 2, 1), (2, 5, 5), 1),
        (nn.Conv1d(2, 2, 1), (4, 2, 5), 4),
        (nn.Conv1d(2, 2, 1), (2, 5), 1),
        (nn.LayerNorm((5, 3)), (4, 5, 3), 4),
        (nn.LayerNorm((5, 3)), (5, 3), 1),
        (nn.GroupNorm(1, 2), (4, 2, 5), 4),
        (nn.BatchNorm1d(2), (4, 2), 4),
    ],
)
def test_examples_of_one_call_per_kind(
    module: nn.Module, shape: tuple[int, ...], want: int
) -> None:
    spec = register(module)[""]
    assert spec.block.examples(spec, torch.zeros(shape)) == want


def test_examples_of_embedding_ids_and_attention_projections() -> None:
    emb = register(nn.Embedding(5, 3))[""]
    ids = torch.zeros
    assert [emb.block.examples(emb, ids(s, dtype=torch.long)) for s in ((4, 7), (7,), ())] == [
        4,
        None,
        1,
    ]
    table = register(nn.MultiheadAttention(4, 1))
    q, out = table["q_proj"], table["out_proj"]
    assert q.block.examples(q, torch.zeros(7, 3, 4)) == 3  # (L, N, E)
    assert out.block.examples(out, torch.zeros(21, 4)) is None  # (L·N, E)
