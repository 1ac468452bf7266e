"""Mixture-of-experts layers (:mod:`kfac_func.blocks.moe`): Hugging Face's fused experts
(``gate_up_proj (E, 2I, d)``, ``down_proj (E, d, I)``) as per-expert K-FAC factors, the
router as a Linear, against oracles built here by hand in float64:

- a hand-written forward of the same layer (routing, per-expert rows and products, the
  routing weight times each expert's output) whose per-expert inputs and output-gradients
  (autograd) give ``A_e`` (mean over the rows routed to ``e``) and ``G_e`` (their sum,
  over the batch's examples): the adapter's factors (hooks) and the capture's
  (``kf.capture`` + ``kf.update``) equal them, and the parameter gradients are those of
  the model without K-FAC;
- with one token, ``G_e ⊗ A_e`` is each routed expert's Fisher block (the outer product of
  its gradient);
- the model called by keyword gives the factors of the positional call;
- an ``nn.ModuleList`` of Linear experts (the older layout) gives the same factors, expert
  by expert, as Linear layers on their routed rows;
- two micro-batches, and DDP on 2 processes, that route different shares of their tokens
  to each expert give the factors of the whole batch on one process;
- Mixtral and Qwen2-MoE train with every parameter preconditioned, under the recommended
  recipe; a module that computes something else is an error naming it; layouts the kind
  does not compute are skipped with their reason.
"""

from __future__ import annotations

import copy
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kfac_func as kf
from kfac_func.step.grouping import plan_groups

transformers = pytest.importorskip("transformers")
from fixture_families import build  # noqa: E402
from gloo import gloo_group, one_thread, record_errors, spawn  # noqa: E402

F64 = torch.float64
N, T, D, E, K, I_ = 3, 5, 6, 4, 2, 3


def _config() -> Any:
    return transformers.MixtralConfig(
        hidden_size=D, intermediate_size=I_, num_local_experts=E, num_experts_per_tok=K,
        router_jitter_noise=0.0,
    )  # fmt: skip


class Net(nn.Module):
    """A Linear, Mixtral's sparse MoE block (router and fused experts), a Linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.moe = transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock(_config())
        self.head = nn.Linear(D, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.moe(self.inp(x)))


def _net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    net = Net()
    with torch.no_grad():
        for p in net.moe.parameters():
            p.normal_(0.0, 0.5)
    return net.to(F64)


def _data(n: int = N, t: int = T, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, t, D, generator=g, dtype=F64), torch.randint(0, 5, (n, t), generator=g)


def _loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _oracle(net: Net, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-expert A and G (``"fisher"``, mean loss: ``G = N Σ r rᵀ``) and the router's,
    from a forward written here, each expert's rows taken with autograd."""
    moe = net.moe
    n = x.shape[0]
    flat = net.inp(x).reshape(-1, D)
    flat.retain_grad()
    logits = flat @ moe.gate.weight.T
    logits.retain_grad()
    probs = logits.float().softmax(-1)  # as Mixtral routes: in float32
    top, idx = probs.topk(K, dim=-1)
    w = top / top.sum(-1, keepdim=True)
    out = torch.zeros_like(flat)
    rows: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = {}
    for e in range(E):
        tok, pos = (idx == e).nonzero(as_tuple=True)
        xe = flat[tok].detach()
        h = xe @ moe.experts.gate_up_proj[e].T
        h.retain_grad()
        gate, up = h.chunk(2, dim=-1)
        u = F.silu(gate) * up
        ye = u @ moe.experts.down_proj[e].T
        ye.retain_grad()
        out = out.index_add(0, tok, ye * w[tok, pos, None])
        rows[e] = (xe, h, u.detach(), ye)
    want = net(x)
    got = net.head(out.reshape(x.shape))
    torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-13)
    _loss(got, y).backward()
    oracle = {}
    for part, (a_of, g_of) in {
        "gate_up_proj": (lambda r: r[0], lambda r: r[1].grad),
        "down_proj": (lambda r: r[2], lambda r: r[3].grad),
    }.items():
        a = torch.stack([a_of(rows[e]).T @ a_of(rows[e]) / max(len(rows[e][0]), 1) for e in rows])
        g = torch.stack([n * g_of(rows[e]).T @ g_of(rows[e]) for e in rows])
        oracle[f"moe.experts.{part} A"], oracle[f"moe.experts.{part} G"] = a, g
    assert logits.grad is not None
    oracle["moe.gate A"] = flat.T @ flat / flat.shape[0]
    oracle["moe.gate G"] = n * logits.grad.T @ logits.grad
    return oracle


def _adapter(net: nn.Module, call: Any, **kw: Any) -> tuple[dict[str, torch.Tensor], Any]:
    pre = kf.KFACPreconditioner(net, settings=kf.Settings(scaling="fisher"), **kw)
    net.zero_grad()
    call(net).backward()
    grads = {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}
    pre.step()
    factors = {}
    for name, ls in pre.state.layers.items():
        factors[f"{name} A"], factors[f"{name} G"] = ls.a_factor, ls.g_factor
    return factors, (pre, grads)


def _assert_factors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    for key, w in want.items():
        # sums of the same products in another order: rounding of float64
        torch.testing.assert_close(got[key], w, rtol=1e-12, atol=1e-14, msg=key)


def test_registration_of_mixtral_block() -> None:
    table = kf.register(_net())
    assert {n: s.kind for n, s in table.items()} == {
        "inp": "linear",
        "moe.gate": "router",
        "moe.experts.gate_up_proj": "moe",
        "moe.experts.down_proj": "moe",
        "head": "linear",
    }
    spec = table["moe.experts.down_proj"]
    assert spec.factor_shapes == ((E, I_, I_), (E, D, D)) and spec.weight_shape == (E, D, I_)
    assert not table.skipped


def test_adapter_factors_equal_the_per_expert_oracle() -> None:
    x, y = _data()
    net = _net()
    want = _oracle(net, x, y)
    assert all(bool(want["moe.experts.gate_up_proj A"][e].any()) for e in range(E))
    net.zero_grad()
    _loss(net(x), y).backward()  # the module's own gradients, without K-FAC
    plain = {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}
    got, (_, grads) = _adapter(net, lambda m: _loss(m(x), y))
    _assert_factors(got, want)
    for n, g in plain.items():  # the recomputation's gradient is the module's
        torch.testing.assert_close(grads[n], g, rtol=1e-12, atol=1e-14, msg=n)


def test_capture_factors_equal_the_per_expert_oracle() -> None:
    x, y = _data()
    net = _net()
    want = _oracle(net, x, y)
    table = kf.register(net)
    params = dict(net.named_parameters())
    _, grads, caps = kf.capture(net, params, (x,), lambda out: _loss(out, y), layers=table)
    assert caps.batch_size == N
    state = kf.init(table, convention="fisher", factor_dtype=F64, inv_dtype=F64)
    _, state = kf.update(state, grads, captures=caps, damping=1e-3, lr=0.1)
    got = {}
    for name, ls in state.layers.items():
        got[f"{name} A"], got[f"{name} G"] = ls.a_factor, ls.g_factor
    _assert_factors(got, want)


def test_one_token_gives_each_routed_experts_fisher_block() -> None:
    """One example of one token: per routed expert, ``G_e ⊗ A_e`` is the outer product of
    the expert's gradient (K-FAC is exact), for both projections."""
    x, y = _data(n=1, t=1)
    net = _net()
    factors, (_, grads) = _adapter(net, lambda m: _loss(m(x), y))
    routed = 0
    for part in ("gate_up_proj", "down_proj"):
        grad = grads[f"moe.experts.{part}"]
        for e in range(E):
            v = grad[e].reshape(-1)
            a, g = factors[f"moe.experts.{part} A"][e], factors[f"moe.experts.{part} G"][e]
            if not v.any():
                assert not a.any() and not g.any()
                continue
            routed += 1
            torch.testing.assert_close(torch.kron(g, a), torch.outer(v, v), rtol=1e-12, atol=1e-15)
    assert routed == 2 * K


def test_keyword_call_gives_the_positional_factors() -> None:
    model, batch = build("Mixtral")  # float32: torch's grouped_mm has no float64 kernel
    ids = batch(0)["input_ids"]

    def positional(m: nn.Module) -> torch.Tensor:
        return _shifted(m(ids).logits, ids)

    want, _ = _adapter(copy.deepcopy(model), positional)
    got, _ = _adapter(copy.deepcopy(model), lambda m: m(input_ids=ids, labels=ids).loss)
    assert any(k.endswith("experts.gate_up_proj A") for k in want)
    _assert_factors(got, want)
    # kf.capture: the same calls' statistics by keyword and positionally
    params = dict(model.named_parameters())
    by_keyword = kf.capture(
        model, params, (), lambda o: o.loss, kwargs={"input_ids": ids, "labels": ids}
    )[2]
    by_position = kf.capture(model, params, (ids,), lambda o: _shifted(o.logits, ids))[2]
    assert by_keyword.batch_size == by_position.batch_size == ids.shape[0]
    for name, lc in by_position.layers.items():
        for got_, want_ in zip(by_keyword.layers[name].output_grads, lc.output_grads):
            torch.testing.assert_close(got_, want_, rtol=1e-6, atol=1e-9, msg=name)
        for got_, want_ in zip(by_keyword.layers[name].inputs, lc.inputs):
            assert torch.equal(got_, want_), name


def _shifted(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The causal-LM loss as Hugging Face computes it from ``labels=ids``."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


class _Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_up = nn.Linear(D, 2 * I_, bias=False)
        self.down = nn.Linear(I_, D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class _ListExperts(nn.Module):
    """The older layout: an ``nn.ModuleList`` of experts, called on their routed rows."""

    def __init__(self, fused: nn.Module) -> None:
        super().__init__()
        self.experts = nn.ModuleList(_Expert() for _ in range(E))
        with torch.no_grad():
            for e, ex in enumerate(self.experts):
                ex.gate_up.weight.copy_(fused.gate_up_proj[e])
                ex.down.weight.copy_(fused.down_proj[e])

    def forward(
        self, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        out = torch.zeros_like(hidden)
        for e, expert in enumerate(self.experts):
            tok, pos = (index == e).nonzero(as_tuple=True)
            out = out.index_add(0, tok, expert(hidden[tok]) * weights[tok, pos, None])
        return out


def test_module_list_experts_are_linears_with_the_fused_factors() -> None:
    x, y = _data()
    fused = _net()
    listed = copy.deepcopy(fused)
    listed.moe.experts = _ListExperts(fused.moe.experts).to(F64)
    want, _ = _adapter(fused, lambda m: _loss(m(x), y))
    got, _ = _adapter(listed, lambda m: _loss(m(x), y))
    for part, linear in (("gate_up_proj", "gate_up"), ("down_proj", "down")):
        for side in "AG":
            stacked = torch.stack(
                [got[f"moe.experts.experts.{e}.{linear} {side}"] for e in range(E)]
            )
            torch.testing.assert_close(
                stacked, want[f"moe.experts.{part} {side}"], rtol=1e-12, atol=1e-14
            )


@pytest.mark.parametrize("family", ["Mixtral", "Qwen2-MoE"])
def test_families_train_with_every_parameter_preconditioned(family: str) -> None:
    model, batch = build(family)
    opt = kf.KFAC(model, lr=1e-3, scaling="fisher", eigenbasis_moments=True, damping=0.01)
    with warnings.catch_warnings():
        warnings.simplefilter("error", kf.FallbackWarning)
        for step in range(2):
            opt.zero_grad()
            model(**batch(step)).loss.backward()
            opt.step()
    pre = opt.preconditioner
    _, rest = pre.layers.split_parameters(model)
    assert not [n for n, p in model.named_parameters() if any(p is q for q in rest)]
    kinds = {s.kind for s in pre.layers.values()}
    assert {"moe", "router"} <= kinds
    assert all(torch.isfinite(p).all() for p in model.parameters())


def _routed_share(caps: kf.Captures) -> torch.Tensor:
    """Each expert's share of the rows routed in ``caps`` (the experts' ids ride in the
    last column of the gate-up projection's recorded input)."""
    ids = caps.layers["moe.experts.gate_up_proj"].inputs[0][:, -1].round().long()
    counts = torch.bincount(ids, minlength=E).to(F64)
    return counts / counts.sum()


def test_experts_pooled_over_micro_batches_equal_the_whole_batch() -> None:
    """Two micro-batches that route different shares of their tokens to each expert:
    each expert's A is its mean over all of its rows, as for the whole batch (the
    functional accumulation and the adapter's, float64); pooling the micro-batches'
    per-expert means by examples would weight them wrongly."""
    x, y = _data(n=4)
    net = _net()
    table = kf.register(net)
    params = dict(net.named_parameters())

    def cap(sl: slice) -> kf.Captures:
        return kf.capture(net, params, (x[sl],), lambda o: _loss(o, y[sl]), layers=table)[2]

    state = kf.init(table, convention="fisher", factor_dtype=F64, inv_dtype=F64)
    full = kf.step.accumulate_factors(state, cap(slice(0, 4)), factor_decay=0.5)
    halves = [cap(slice(0, 2)), cap(slice(2, 4))]
    assert (_routed_share(halves[0]) - _routed_share(halves[1])).abs().max() > 0.05
    micro = kf.step.accumulate_factors(state, halves, factor_decay=0.5)
    got = kf.KFACPreconditioner(
        copy.deepcopy(net),
        settings=kf.Settings(scaling="fisher", loss_divisor=2),
        accumulation_steps=2,
    )
    for sl in (slice(0, 2), slice(2, 4)):  # the adapter: two backward passes, one step
        (_loss(got.model(x[sl]), y[sl]) / 2).backward()
    got.step()
    for name, ls in full.layers.items():
        for side in ("a_factor", "g_factor"):
            want = getattr(ls, side)
            for pooled in (micro.layers[name], got.state.layers[name]):
                torch.testing.assert_close(
                    getattr(pooled, side), want, rtol=1e-12, atol=1e-14, msg=f"{name} {side}"
                )


DDP_STEPS = 2


def _ddp_run(rank: int | None) -> dict[str, Any]:
    """The adapter on DDP's rank ``rank`` (its half of each global batch of 4 examples),
    or on one process with the whole batch (None): SGD steps on the preconditioned
    gradients; the factors and those gradients."""
    net = _net()
    model: nn.Module = net if rank is None else nn.parallel.DistributedDataParallel(net)
    pre = kf.KFACPreconditioner(
        model,
        settings=kf.Settings(scaling="fisher"),
        factor_dtype=F64,
        inv_dtype=F64,
        damping=0.01,
        lr=0.1,
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = []
    for step in range(DDP_STEPS):
        x, y = _data(n=4, seed=10 + step)
        if rank is not None:
            x, y = x[2 * rank : 2 * rank + 2], y[2 * rank : 2 * rank + 2]
        opt.zero_grad()
        _loss(model(x), y).backward()
        pre.step()
        grads.append(
            {n.removeprefix("module."): p.grad.clone() for n, p in model.named_parameters()}
        )
        opt.step()
    layers = pre.state_dict()["layers"]
    factors = {
        n.removeprefix("module."): (e["A"].clone(), e["G"].clone()) for n, e in layers.items()
    }
    return {"factors": factors, "grads": grads}


def _ddp_worker(rank: int, world: int, tmp: str) -> None:
    with (
        gloo_group(rank, world, tmp, timeout=timedelta(seconds=60)),
        record_errors(Path(tmp, f"rank{rank}.error")),
    ):
        torch.save(_ddp_run(rank), Path(tmp, f"rank{rank}.pt"))


def test_ddp_on_two_processes_equals_one_process(tmp_path: Path) -> None:
    """DDP on 2 gloo processes, each with half of every global batch (routing different
    shares of its tokens to each expert), against one process with the whole batch: the
    experts' factors (rank 0's state dict holds the global ones) and the preconditioned
    gradients on both ranks, float64."""
    spawn(_ddp_worker, 2, tmp_path)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    with one_thread():
        want = _ddp_run(None)
    assert any(k.startswith("moe.experts") for k in want["factors"])
    for key, (a, g) in want["factors"].items():
        got_a, got_g = ranks[0]["factors"][key]
        torch.testing.assert_close(got_a, a, rtol=1e-10, atol=1e-13, msg=f"{key} A")
        torch.testing.assert_close(got_g, g, rtol=1e-10, atol=1e-13, msg=f"{key} G")
    for r in ranks:
        for step, (got, ref) in enumerate(zip(r["grads"], want["grads"])):
            for n, gr in ref.items():
                torch.testing.assert_close(
                    got[n], gr, rtol=1e-9, atol=1e-12, msg=f"step {step} {n}"
                )


class _Relu(nn.Module):
    """Fused experts whose forward uses ReLU while ``act_fn`` says SiLU."""

    def __init__(self, fused: nn.Module) -> None:
        super().__init__()
        self.num_experts, self.act_fn = E, nn.SiLU()
        self.gate_up_proj = nn.Parameter(fused.gate_up_proj.detach().clone())
        self.down_proj = nn.Parameter(fused.down_proj.detach().clone())

    def forward(self, hidden: torch.Tensor, index: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden)
        for e in range(E):
            tok, pos = (index == e).nonzero(as_tuple=True)
            gate, up = (hidden[tok] @ self.gate_up_proj[e].T).chunk(2, dim=-1)
            y = (torch.relu(gate) * up) @ self.down_proj[e].T
            out = out.index_add(0, tok, y * w[tok, pos, None])
        return out


def test_experts_that_compute_something_else_are_an_error_naming_them() -> None:
    x, y = _data()
    net = _net()
    net.moe.experts = _Relu(net.moe.experts).to(F64)
    pre = kf.KFACPreconditioner(net, settings=kf.Settings(scaling="fisher"))
    with pytest.raises(RuntimeError, match=r"'moe.experts' \(_Relu, kind 'moe'\): its output"):
        _loss(net(x), y).backward()
    pre.remove()


def test_layouts_the_kind_does_not_compute_are_skipped_with_their_reason() -> None:
    net = _net()
    net.moe.experts.is_transposed = True
    table = kf.register(net)
    assert "moe.experts.gate_up_proj" not in table
    assert "its weights are stored transposed" in table.skipped["moe.experts"]


def test_experts_of_every_layer_are_one_group_and_equal_the_per_layer_step() -> None:
    """The stacked experts of the model's two layers are computed together (one group per
    projection), and the grouped step equals the per-layer one (float64)."""
    out = {}
    for grouped in (True, False):
        model, batch = build("Qwen2-MoE", F64)
        model.config._experts_implementation = "eager"  # grouped_mm has no float64 kernel
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            pre = kf.KFACPreconditioner(
                model,
                settings=kf.Settings(scaling="fisher", grouped=grouped),
                damping=0.01,
                inv_dtype=F64,
            )
        for step in range(2):
            model.zero_grad()
            model(**batch(step)).loss.backward()
            if grouped and step == 1:
                grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
                groups = plan_groups(pre.state.layers, list(pre.state.layers), grads)
                experts = [g for g in groups if any(n.endswith("experts.gate_up_proj") for n in g)]
                assert experts == [[f"model.layers.{i}.mlp.experts.gate_up_proj" for i in (0, 1)]]
            pre.step()
        out[grouped] = {n: p.grad.clone() for n, p in model.named_parameters()}
    for n, g in out[False].items():
        torch.testing.assert_close(out[True][n], g, rtol=1e-12, atol=1e-15, msg=n)


class _CastRouter(nn.Module):
    """A router that computes its logits from a copy of its weight (DeepSeek's shape)."""

    def __init__(self) -> None:
        super().__init__()
        self.top_k, self.num_experts = K, E
        self.weight = nn.Parameter(torch.randn(E, D))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        logits = F.linear(x.float(), self.weight.float())
        return logits, *torch.topk(logits.softmax(-1), self.top_k)


def test_routers_that_compute_their_logits_otherwise_are_not_registered() -> None:
    net = _net()
    net.moe.gate = _CastRouter()
    table = kf.register(net)
    assert "moe.gate" not in table and "unsupported kind" in table.skipped["moe.gate"]
