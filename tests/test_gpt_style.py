"""A GPT-style model built from ``torch.nn`` (token and position ``nn.Embedding``,
``nn.TransformerEncoderLayer`` blocks with a causal mask, a final ``nn.LayerNorm`` and an
output head tied to the token embedding):

- every parameter tensor is preconditioned, the embedding/head weight as one tied layer;
- the adapter and ``capture`` + ``update`` agree bit for bit;
- the adapter under DistributedDataParallel on 2 gloo ranks equals one process on the
  global batch (1e-6, float64), COMM_OPT and MEM_OPT, the tied pair included (its two uses
  are averaged over the ranks apart and combined after).
"""

from __future__ import annotations

import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from gloo import gloo_group, one_thread, record_errors, spawn
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import kfac_func as kf

F64 = torch.float64
V, T, D, H = 13, 6, 8, 2
WORLD, LOCAL, STEPS = 2, 2, 3
TIED = "tok.weight"


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tok = nn.Embedding(V, D)
        self.pos = nn.Embedding(T, D)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(D, H, 2 * D, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(2)
        )
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight = self.tok.weight
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(T))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        # positions per example: K-FAC sees one row per (example, position)
        positions = torch.arange(idx.shape[1]).expand(idx.shape[0], -1)
        x = self.tok(idx) + self.pos(positions)
        for block in self.blocks:
            x = block(x, src_mask=self.mask, is_causal=True)
        return self.head(self.norm(x))


def make() -> nn.Module:
    return GPT().to(F64)


def loss_of(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, V), y.reshape(-1))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    n = LOCAL * WORLD
    return torch.randint(0, V, (n, T), generator=g), torch.randint(0, V, (n, T), generator=g)


def preconditioner(model: nn.Module, **kw: Any) -> kf.KFACPreconditioner:
    with warnings.catch_warnings():
        warnings.filterwarnings("error", "parameter .* is shared", UserWarning)
        return kf.KFACPreconditioner(
            model,
            damping=0.01,
            kl_clip=1e-2,
            lr=0.1,
            settings=kf.Settings(scaling="fisher"),
            factor_dtype=F64,
            inv_dtype=F64,
            **kw,
        )


def test_every_parameter_is_preconditioned() -> None:
    model = make()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", "parameter .* is shared", UserWarning)
        table = kf.register(model)
    covered = {p for spec in table.values() for p in spec.param_names()}
    assert covered == {n for n, _ in model.named_parameters()}
    assert not table.skipped and table["head"].weight == TIED
    kinds = {spec.kind for spec in table.values()}
    assert kinds == {"embedding", "attention", "linear", "layer_norm", "tied"}
    # one step changes the gradient of every preconditioned parameter, the tied one too
    pre = preconditioner(model)
    x, y = batch(0)
    loss_of(model(x), y).backward()
    before = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    pre.step()
    for n, p in model.named_parameters():
        assert p.grad is not None
        assert not torch.equal(p.grad, before[n]), n


def test_adapter_and_capture_update_agree_bit_for_bit() -> None:
    model, ref = make(), make()
    pre = preconditioner(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        table = kf.register(ref)
    state = kf.init(table, factor_dtype=F64, inv_dtype=F64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    params = {k: v.detach().clone() for k, v in ref.named_parameters()}
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        loss_of(model(x), y).backward()
        pre.step()
        _, grads, caps = kf.capture(ref, params, x, lambda o, y=y: loss_of(o, y), layers=table)
        out, state = kf.update(state, grads, captures=caps, damping=0.01, kl_clip=1e-2, lr=0.1)
        for n, p in model.named_parameters():
            assert torch.equal(p.grad, out[n]), (step, n)  # type: ignore[arg-type]
        opt.step()
        params = {k: v.add(out[k], alpha=-0.1) for k, v in params.items()}  # as SGD
    for n, ls in pre.state.layers.items():
        assert torch.equal(ls.a_factor, state.layers[n].a_factor), n
        assert torch.equal(ls.g_factor, state.layers[n].g_factor), n


def train(model: nn.Module, pre: kf.KFACPreconditioner, rank: int | None) -> list[dict[str, Any]]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for step in range(STEPS):
        x, y = batch(step)
        if rank is not None:
            x, y = x[rank * LOCAL : (rank + 1) * LOCAL], y[rank * LOCAL : (rank + 1) * LOCAL]
        opt.zero_grad()
        loss_of(model(x), y).backward()
        pre.step()
        out.append({n.removeprefix("module."): p.grad.clone() for n, p in model.named_parameters()})  # type: ignore[union-attr]
        opt.step()
    return out


STRATEGIES = ("comm-opt", "mem-opt")


def _worker(rank: int, world: int, tmp: str) -> None:
    with (
        gloo_group(rank, world, tmp, timeout=timedelta(seconds=60)),
        record_errors(Path(tmp, f"rank{rank}.error")),
    ):
        results = {}
        for strategy in STRATEGIES:
            ddp = DistributedDataParallel(make())
            fraction = 1.0 if strategy == "comm-opt" else 0.5
            pre = preconditioner(ddp, grad_worker_fraction=fraction)
            results[strategy] = train(ddp, pre, rank)
            pre.remove()
        torch.save(results, Path(tmp, f"rank{rank}.pt"))


def test_ddp_two_ranks_equal_one_process(tmp_path: Path) -> None:
    spawn(_worker, WORLD, tmp_path)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    with one_thread():
        model = make()
        reference = train(model, preconditioner(model), None)
    for strategy in STRATEGIES:
        for step, want in enumerate(reference):
            for got in (r[strategy][step] for r in ranks):
                err = max(float((got[n] - want[n]).abs().max()) for n in want)
                assert err < 1e-6, (strategy, step, err)
        for step in range(STEPS):
            a, b = (r[strategy][step] for r in ranks)
            assert all(torch.equal(a[n], b[n]) for n in a), (strategy, step)
