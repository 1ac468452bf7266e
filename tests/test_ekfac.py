"""EKFAC (``compute_method="ekfac"``) against a dense oracle in float64.

The oracle takes every example's own gradient of its loss with ``torch.func``
(``vmap(grad)`` over examples, nothing from the library), builds the empirical Fisher
``F = (1/N) Σ_n vec(M_n) vec(M_n)ᵀ`` of the layer's ``[W | b]`` and reads its diagonal in
the library's Kronecker eigenbasis ``Qg ⊗ Qa``: EKFAC's corrected eigenvalues must equal it
(a Linear on sequences, where per-example gradients sum over positions, and a grouped
Conv2d), and the preconditioned gradient must be ``Q diag(1/(s + λ)) Qᵀ vec(M)``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

import kfac_func as kf

DT = torch.float64


class Seq(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(3, 4).to(DT)
        self.out = nn.Linear(4, 2).to(DT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.fc(x)))


class Conv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(2, 4, 2, groups=2).to(DT)
        self.out = nn.Linear(4 * 2 * 2, 3).to(DT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.conv(x)).flatten(1))


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def _per_example(model: nn.Module, layer: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``(N, [groups,] g_dim, a_dim)``: each example's gradient of its own (mean) loss."""
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(w: torch.Tensor, b: torch.Tensor, xn: torch.Tensor, yn: torch.Tensor) -> torch.Tensor:
        p = {**params, f"{layer}.weight": w, f"{layer}.bias": b}
        return _loss(functional_call(model, p, (xn.unsqueeze(0),)), yn.unsqueeze(0))

    w, b = params[f"{layer}.weight"], params[f"{layer}.bias"]
    dw, db = vmap(grad(loss, argnums=(0, 1)), in_dims=(None, None, 0, 0))(w, b, x, y)
    spec = kf.register(model)[layer]
    return torch.stack([kf.blocks.grads_to_matrix(spec, dw[n], db[n]) for n in range(x.shape[0])])


def _data(kind: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if kind == "seq":
        return torch.randn(5, 4, 3, generator=g, dtype=DT), torch.randint(0, 2, (5, 4), generator=g)
    if kind == "mlp":  # one position per example
        return torch.randn(7, 3, generator=g, dtype=DT), torch.randint(0, 2, (7,), generator=g)
    return torch.randn(6, 2, 3, 3, generator=g, dtype=DT), torch.randint(0, 3, (6,), generator=g)


CASES = [("seq", Seq, "fc"), ("seq", Seq, "out"), ("mlp", Seq, "fc"), ("conv", Conv, "conv")]


@pytest.mark.parametrize(
    ("kind", "make", "layer"), CASES, ids=["seq-fc", "seq-out", "mlp-fc", "conv"]
)
def test_corrected_eigenvalues_are_the_fisher_diagonal_in_the_kfac_basis(
    kind: str, make: type[nn.Module], layer: str
) -> None:
    model = make()
    x, y = _data(kind, 1)
    table = kf.register(model)
    state = kf.init(table, compute_method="ekfac", factor_dtype=DT, inv_dtype=DT)
    params = dict(model.named_parameters())
    _, grads, caps = kf.capture(model, params, x, lambda o: _loss(o, y))
    lam = 0.03
    out, state = kf.update(state, grads, captures=caps, damping=lam, kl_clip=None)
    dec = state.layers[layer].decomposition
    assert isinstance(dec, kf.core.EKFACDecomposition)
    per = _per_example(model, layer, x, y)  # (N, [G,] g, a)
    proj = dec.qg.mT @ per @ dec.qa  # type: ignore[union-attr]
    torch.testing.assert_close(dec.scale, proj.pow(2).mean(dim=0), rtol=1e-10, atol=1e-14)
    # the same diagonal read off the dense Fisher in the Kronecker basis
    if per.dim() == 3:
        vecs = per.reshape(per.shape[0], -1)
        fisher = vecs.T @ vecs / per.shape[0]
        q = torch.kron(dec.qg, dec.qa)  # type: ignore[arg-type]
        torch.testing.assert_close(
            torch.diagonal(q.T @ fisher @ q), dec.scale.reshape(-1), rtol=1e-10, atol=1e-14
        )
    # preconditioning divides by scale + λ in that basis
    m = kf.blocks.grads_to_matrix(table[layer], grads[f"{layer}.weight"], grads[f"{layer}.bias"])
    want = dec.qg @ ((dec.qg.mT @ m @ dec.qa) / (dec.scale + lam)) @ dec.qa.mT  # type: ignore[union-attr]
    got = kf.blocks.grads_to_matrix(table[layer], out[f"{layer}.weight"], out[f"{layer}.bias"])
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-13)


def test_running_average_in_a_kept_basis_and_restart_in_a_new_one() -> None:
    model = Seq()
    state = kf.init(kf.register(model), compute_method="ekfac", factor_dtype=DT, inv_dtype=DT)
    params = dict(model.named_parameters())
    decay = 0.7
    moments = []
    for step in range(3):
        x, y = _data("seq", 10 + step)
        _, grads, caps = kf.capture(model, params, x, lambda o, y=y: _loss(o, y))
        state = kf.step.accumulate_factors(state, caps, factor_decay=decay)
        if step == 0:
            state = kf.decompose(state, damping=0.1)
        state = kf.step.correct_eigenvalues(state, caps, factor_decay=decay)
        dec = state.layers["fc"].decomposition
        per = _per_example(model, "fc", x, y)
        moments.append((dec.qg.mT @ per @ dec.qa).pow(2).mean(dim=0))  # type: ignore[union-attr]
    scale = state.layers["fc"].decomposition.scale  # type: ignore[union-attr]
    # decompose() leaves K-FAC's eigenvalues; the three corrections fold in with decay
    dec0 = (
        kf.decompose(
            kf.step.accumulate_factors(
                kf.init(kf.register(model), compute_method="eigen", factor_dtype=DT, inv_dtype=DT),
                kf.capture(
                    model, params, *_data("seq", 10)[:1], lambda o: _loss(o, _data("seq", 10)[1])
                )[2],
                factor_decay=decay,
            ),
            damping=0.1,
        )
        .layers["fc"]
        .decomposition
    )
    want = torch.outer(dec0.dg, dec0.da)  # type: ignore[union-attr]
    for m in moments:
        want = decay * want + (1 - decay) * m
    torch.testing.assert_close(scale, want, rtol=1e-10, atol=1e-14)
    # update() with a new basis restarts from the step's moments
    x, y = _data("seq", 20)
    _, grads, caps = kf.capture(model, params, x, lambda o: _loss(o, y))
    _, state = kf.update(state, grads, captures=caps, factor_decay=decay, update_inverses=True)
    dec = state.layers["fc"].decomposition
    per = _per_example(model, "fc", x, y)
    fresh = (dec.qg.mT @ per @ dec.qa).pow(2).mean(dim=0)  # type: ignore[union-attr]
    torch.testing.assert_close(dec.scale, fresh, rtol=1e-10, atol=1e-14)  # type: ignore[union-attr]


def test_checkpoints_and_what_is_refused() -> None:
    model = Seq()
    state = kf.init(kf.register(model), compute_method="ekfac", factor_dtype=DT, inv_dtype=DT)
    x, y = _data("seq", 3)
    _, grads, caps = kf.capture(model, dict(model.named_parameters()), x, lambda o: _loss(o, y))
    _, state = kf.update(state, grads, captures=caps)
    back = kf.state_from_dict(kf.state_to_dict(state, include_decompositions=True), like=state)
    for name, ls in state.layers.items():
        got = back.layers[name].decomposition
        assert isinstance(got, kf.core.EKFACDecomposition)
        assert torch.equal(got.scale, ls.decomposition.scale)  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="use convention='fisher'"):
        kf.init(kf.register(model), compute_method="ekfac", convention="kfac-pytorch")
    # one rank of update_distributed computes what update computes
    plan = kf.distributed.make_plan(kf.register(model), 1, compute_method="ekfac")
    comm = kf.distributed.Communicator(plan)
    out_d, state_d = kf.distributed.update_distributed(
        state, grads, captures=caps, plan=plan, comm=comm
    )
    out_u, state_u = kf.update(state, grads, captures=caps)
    for n in out_u:
        assert torch.equal(out_d[n], out_u[n]), n
    for n, ls in state_u.layers.items():
        assert torch.equal(ls.decomposition.scale, state_d.layers[n].decomposition.scale)  # type: ignore[union-attr]


def test_adapter_equals_capture_and_update() -> None:
    """One process: the adapter keeps each call's input and gradient and hands them to
    ``update`` as captures; parameters follow the same SGD steps."""
    model, ref = Seq(), Seq()
    pre = kf.KFACPreconditioner(
        model,
        compute_method="ekfac",
        settings=kf.Settings(scaling="fisher"),
        inv_dtype=DT,
        damping=0.01,
        inv_update_steps=2,
        kl_clip=None,
    )
    state = kf.init(kf.register(ref), compute_method="ekfac", factor_dtype=DT, inv_dtype=DT)
    params = {k: v.detach().clone() for k, v in ref.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(4):
        x, y = _data("seq", 30 + step)
        opt.zero_grad()
        _loss(model(x), y).backward()
        pre.step()
        _, grads, caps = kf.capture(ref, params, x, lambda o, y=y: _loss(o, y))
        out, state = kf.update(
            state, grads, captures=caps, damping=0.01, kl_clip=None, update_inverses=step % 2 == 0
        )
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad, out[n], rtol=1e-12, atol=1e-15)
        opt.step()
        params = {k: v.add(out[k], alpha=-0.1) for k, v in params.items()}
    for n, ls in pre.state.layers.items():
        got = ls.decomposition.scale  # type: ignore[union-attr]
        torch.testing.assert_close(got, state.layers[n].decomposition.scale, rtol=1e-12, atol=0)  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="scaling='fisher'"):
        kf.KFACPreconditioner(Seq(), compute_method="ekfac")


WORLD, LOCAL = 2, 2  # "seq" batches hold 5 examples: 4 are used
# MEM_OPT on 2 ranks: each layer's basis on one rank, lent to the other at factor steps
STRATEGIES = ("COMM_OPT", "MEM_OPT")


def _ddp_train(
    model: nn.Module, rank: int | None, strategy: str = "COMM_OPT"
) -> list[dict[str, torch.Tensor]]:
    pre = kf.KFACPreconditioner(
        model,
        grad_worker_fraction=kf.distributed.DistributedStrategy[strategy],
        compute_method="ekfac",
        settings=kf.Settings(scaling="fisher"),
        factor_dtype=DT,
        inv_dtype=DT,
        damping=0.01,
        inv_update_steps=2,
        kl_clip=1e-2,
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for step in range(4):
        x, y = _data("seq", 40 + step)
        x, y = x[: LOCAL * WORLD], y[: LOCAL * WORLD]
        if rank is not None:
            x, y = x[rank * LOCAL : (rank + 1) * LOCAL], y[rank * LOCAL : (rank + 1) * LOCAL]
        opt.zero_grad()
        _loss(model(x), y).backward()
        pre.step()
        out.append({n.removeprefix("module."): p.grad.clone() for n, p in model.named_parameters()})  # type: ignore[union-attr]
        opt.step()
    pre.remove()
    return out


def _worker(rank: int, world: int, tmp: str) -> None:
    from datetime import timedelta
    from pathlib import Path

    from gloo import gloo_group, record_errors
    from torch.nn.parallel import DistributedDataParallel

    with (
        gloo_group(rank, world, tmp, timeout=timedelta(seconds=60)),
        record_errors(Path(tmp, f"rank{rank}.error")),
    ):
        grads = {s: _ddp_train(DistributedDataParallel(Seq()), rank, s) for s in STRATEGIES}
        torch.save({"grads": grads}, Path(tmp, f"rank{rank}.pt"))


def test_ddp_two_ranks_equal_one_process(tmp_path: object) -> None:
    from pathlib import Path

    from gloo import one_thread, spawn

    tmp = Path(str(tmp_path))
    spawn(_worker, WORLD, tmp)
    ranks = [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    with one_thread():
        reference = _ddp_train(Seq(), None)
    for strategy in STRATEGIES:
        for step, want in enumerate(reference):
            for r in ranks:
                got = r["grads"][strategy][step]
                err = max(float((got[n] - want[n]).abs().max()) for n in want)
                assert err < 1e-6, (strategy, step, err)
            a, b = (r["grads"][strategy][step] for r in ranks)
            assert all(torch.equal(a[n], b[n]) for n in a)
