"""Embeddings whose ``forward`` computes the ids it looks up
(:mod:`kfac_func.blocks.recorded_embedding`) against oracles, in float64.

Notation: the module is called on some input and looks up ``y = W[x]`` with ids ``x`` its
forward computes (OPT's positions from the attention mask, plus 2); ``W`` is ``(V, d)``
and K-FAC's gradient matrix ``M = dWᵀ``. The factors are the Embedding kind's of the ids
actually looked up: ``A`` the counts of ``x`` over the rows, ``G`` the Gram of the
module's output-gradient rows (``"fisher"``: ``G = Σ r rᵀ / (N c²)``, ``r`` the raw
output-gradient, ``c = 1/N`` for a mean-reduced loss). The oracles take the ids from a
``TorchFunctionMode`` of this file (or from the mask as OPT defines them) and the
output-gradients from a plain autograd hook or from ``torch.func``, never from the
library. A forward that looks the weight up twice, uses it otherwise or computes on after
the lookup is refused, naming the layer.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from fixture_families import build
from torch import nn
from torch.func import grad, vmap
from torch.overrides import TorchFunctionMode

import kfac_func as kf

DT = torch.float64
V, D, C, SHIFT = 7, 4, 3, 2  # ids, width, classes, the shift the toy forward adds


class IdsSeen(TorchFunctionMode):
    """The ids of every ``F.embedding`` call on ``weight`` while entered (the oracle's)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight, self.ids = weight, []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is F.embedding and args[1] is self.weight:
            self.ids.append(args[0])
        return func(*args, **(kwargs or {}))


class Shifted(nn.Embedding):
    """Looks up its ids shifted by ``SHIFT`` (clamped to its rows: reading the weight's
    shape is no use of it)."""

    def __init__(self) -> None:
        super().__init__(V + SHIFT, D, dtype=DT)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward((ids + SHIFT).clamp(max=self.weight.shape[0] - 1))


class Net(nn.Module):
    def __init__(self, emb: Callable[[], nn.Embedding]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.out = emb(), nn.Linear(D, C, dtype=DT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.emb(x)))


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, C), y.reshape(-1))


def _toy_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, V, (5, 6), generator=g), torch.randint(0, C, (5, 6), generator=g)


def test_a_shifting_subclass_gets_the_factors_of_the_ids_it_looks_up() -> None:
    model = Net(Shifted)
    x, y = _toy_batch()
    spec = kf.register(model)["emb"]
    assert spec.kind == "recorded_embedding" and spec.factor_shapes == ((V + SHIFT,), (D, D))
    params = dict(model.named_parameters())
    _, _, caps = kf.capture(model, params, x, lambda o: _loss(o, y))
    state = kf.step.accumulate_factors(kf.init(kf.register(model), factor_dtype=DT), caps)
    ls = state.layers["emb"]
    n, t = x.shape
    counts = torch.bincount((x + SHIFT).reshape(-1), minlength=V + SHIFT).to(DT)
    torch.testing.assert_close(ls.a_factor, counts / (n * t), rtol=1e-12, atol=1e-14)

    # G: (1/N) Σ_n Σ_t g gᵀ, g the gradient of example n's own loss (a mean over its
    # tokens) at the looked-up rows, from a forward re-written here
    def example_loss(e: torch.Tensor, yn: torch.Tensor) -> torch.Tensor:
        out = F.linear(torch.tanh(e), params["out.weight"], params["out.bias"])
        return F.cross_entropy(out, yn)

    rows = vmap(grad(example_loss))(params["emb.weight"][x + SHIFT], y).reshape(-1, D)
    torch.testing.assert_close(ls.g_factor, rows.T @ rows / n, rtol=1e-10, atol=1e-14)
    # the drop-in preconditioner records the same call
    twin = Net(Shifted)
    pre = kf.KFACPreconditioner(
        twin, factor_dtype=DT, inv_dtype=DT, settings=kf.Settings(scaling="fisher")
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _loss(twin(x), y).backward()
        pre.step()
    for side in ("a_factor", "g_factor"):
        got, want = getattr(pre.state.layers["emb"], side), getattr(ls, side)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


def _twice(m: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
    return F.embedding(ids, m.weight) + F.embedding(ids + 1, m.weight)


REFUSED: dict[str, tuple[Callable[[nn.Embedding, torch.Tensor], torch.Tensor], str]] = {
    "twice": (_twice, "looks up its weight with F.embedding 2 times"),
    "sliced": (  # Whisper's positions: rows by position, whatever the ids
        lambda m, ids: m.weight[: ids.shape[1]].expand(ids.shape[0], -1, -1),
        "uses the weight otherwise",
    ),
    "times_weight": (
        lambda m, ids: F.embedding(ids, m.weight) * m.weight.mean(),
        "uses the weight otherwise",
    ),
    "computes_on": (
        lambda m, ids: 2.0 * F.embedding(ids, m.weight),
        "its output is not the output of the lookup",
    ),
    "max_norm": (lambda m, ids: F.embedding(ids, m.weight, max_norm=1.0), "max_norm=1.0"),
    "no_lookup": (lambda m, ids: torch.zeros(*ids.shape, D, dtype=DT), "0 times"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_other_uses_of_the_weight_are_refused_naming_the_layer(case: str) -> None:
    forward, why = REFUSED[case]

    class Odd(nn.Embedding):
        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return forward(self, ids)

    x, y = _toy_batch()
    model = Net(lambda: Odd(V + 1, D, dtype=DT))
    opt = kf.KFAC(model, lr=0.01, damping=0.01)
    with pytest.warns(kf.FallbackWarning) as caught:
        _loss(model(x), y).backward()
    message = str(caught[0].message)
    assert "'emb'" in message and "Odd overrides forward" in message and why in message, message
    opt.step()
    assert list(opt.preconditioner.layers) == ["out"] and "emb" in opt.preconditioner.demoted
    params = dict(model.named_parameters())
    with pytest.raises(ValueError, match=r"'emb' \(.*Odd\).*skip_layers=\['\^emb\$'\]"):
        kf.capture(model, params, x, lambda o: _loss(o, y))


def _opt_batch() -> dict[str, torch.Tensor]:
    """Ids with padding on either side: the positions OPT computes are not ``arange``."""
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(2, 40, (3, 8), generator=g)
    mask = torch.ones(3, 8, dtype=torch.long)
    mask[1, :3] = 0  # left padding
    mask[2, 6:] = 0  # right padding
    return {"input_ids": ids, "attention_mask": mask, "labels": ids}


def test_opt_learned_positions_get_the_factors_of_the_positions_looked_up() -> None:
    """OPT's ``embed_positions`` is called on the attention mask and looks up
    ``cumsum(mask) · mask - 1 + 2``: registered, and its factors are those of the ids it
    looked up (recorded by this file's mode) and of the output-gradient a plain autograd
    hook on the module sees."""
    name = "model.decoder.embed_positions"
    model, _ = build("OPT")
    model = model.to(DT).train()
    module = model.get_submodule(name)
    assert type(module).__name__ == "OPTLearnedPositionalEmbedding"
    table = kf.register(model)
    spec = table[name]
    assert spec.kind == "recorded_embedding"
    v, d = module.weight.shape
    assert spec.factor_shapes == ((v,), (d, d))
    batch = _opt_batch()
    seen = IdsSeen(module.weight)
    with torch.no_grad(), seen:
        model(**batch)
    assert len(seen.ids) == 1
    ids = seen.ids[0]
    mask = batch["attention_mask"]
    torch.testing.assert_close(ids, (torch.cumsum(mask, 1) * mask - 1) + 2, rtol=0, atol=0)

    pre = kf.KFACPreconditioner(
        model, factor_dtype=DT, inv_dtype=DT, settings=kf.Settings(scaling="fisher")
    )
    grads: list[torch.Tensor] = []

    def keep_grad(m: nn.Module, args: Any, out: torch.Tensor) -> None:
        out.register_hook(grads.append)

    handle = module.register_forward_hook(keep_grad)
    with warnings.catch_warnings():
        warnings.simplefilter("error", kf.FallbackWarning)
        model(**batch).loss.backward()
        pre.step()
    assert name in pre.layers and not pre.layers.skipped and not pre.demoted
    ls = pre.state.layers[name]
    n, t = ids.shape
    counts = torch.bincount(ids.reshape(-1), minlength=v).to(DT)
    torch.testing.assert_close(ls.a_factor, counts / (n * t), rtol=1e-14, atol=0)
    (r,) = grads
    rows = r.reshape(-1, d)
    want = n * rows.T @ rows  # Σ r rᵀ / (N c²), c = 1/N: HF's loss is a mean
    torch.testing.assert_close(ls.g_factor, want, rtol=1e-12, atol=1e-16)

    # kf.capture hands the kind the same ids (with the preconditioner's hooks still on)
    handle.remove()
    _, _, caps = kf.capture(
        model, dict(model.named_parameters()), (), lambda o: o.loss, layers=table, kwargs=batch
    )
    (x,) = caps.layers[name].inputs
    torch.testing.assert_close(x, ids, rtol=0, atol=0)
