"""Linear-layer K-FAC math checked against independent oracles, in float64.

Every expected value here is built from ``torch.func`` (``functional_call``, ``grad``,
``jacrev``, ``vmap``) or plain autograd applied to the model itself or to a manually
unrolled forward pass, never from ``kfac_func``'s own factor / decomposition code. The
library is only used as the system under test: ``capture`` → ``accumulate_factors`` →
``decompose`` / ``update`` / ``precondition_grads``.

Notation: for a Linear layer ``z = W a + b``; ``a`` is the layer input with a 1 appended
when there is a bias; the gradient of ``(W, b)`` is flattened row-major as the matrix
``[W | b]`` of shape ``(out, in + 1)``, so the per-example gradient is ``g ⊗ a`` with
``g = ∂ℓ/∂z`` and the empirical Fisher of one example is ``(g gᵀ) ⊗ (a aᵀ)``.
"""

from __future__ import annotations

import copy
import itertools
import math
import warnings
from collections.abc import Callable

import optree
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, jacrev, vmap

import kfac_func as kf

DT = torch.float64
CPU = torch.device("cpu")
TOL_EXACT = 1e-10  # factor identities that hold exactly (only float64 rounding)
TOL_SOLVE = 1e-9  # relative error of a preconditioned gradient vs a dense solve

ARCHS = ("linear", "linear_nobias", "tanh")
LOSSES = ("ce", "mse")
REDUCTIONS = ("mean", "sum")


# --------------------------------------------------------------------------- helpers


def make_model(
    arch: str, dims: tuple[int, ...] = (3, 4, 5, 3), seed: int = 0, device: torch.device = CPU
) -> nn.Sequential:
    """Stacked float64 Linear layers on ``device``; ``"tanh"`` puts a Tanh between
    consecutive layers."""
    torch.manual_seed(seed)
    bias = arch != "linear_nobias"
    mods: list[nn.Module] = []
    for i, (d_in, d_out) in enumerate(itertools.pairwise(dims)):
        if i and arch == "tanh":
            mods.append(nn.Tanh())
        mods.append(nn.Linear(d_in, d_out, bias=bias, dtype=DT))
    return nn.Sequential(*mods).to(device)


def linear_names(model: nn.Sequential) -> list[str]:
    return [n for n, m in model.named_children() if isinstance(m, nn.Linear)]


def make_data(
    loss: str, shape: tuple[int, ...], n_out: int, seed: int = 1, device: torch.device = CPU
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs of ``shape`` and targets for ``loss`` over the leading dims of ``shape``
    (drawn on the CPU, then moved to ``device``: the same numbers on every device)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=DT)
    lead = shape[:-1]
    if loss == "ce":
        return x.to(device), torch.randint(0, n_out, lead, generator=g).to(device)
    return x.to(device), torch.randn((*lead, n_out), generator=g, dtype=DT).to(device)


def user_loss(loss: str, reduction: str, out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The loss a user would write, reduced over everything but the class dim."""
    if loss == "ce":
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), t.reshape(-1), reduction=reduction)
    return F.mse_loss(out, t, reduction=reduction)


def per_example_loss(
    loss: str, reduction: str, out_n: torch.Tensor, t_n: torch.Tensor
) -> torch.Tensor:
    """``ℓ_n`` of one example, defined so that ``user_loss = c · Σ_n ℓ_n`` with ``c = 1/N``
    for ``"mean"`` and ``1`` for ``"sum"``: a mean over the per-example elements (sequence
    positions, or output coordinates for MSE) stays inside ``ℓ_n`` for ``"mean"``."""
    if loss == "ce":
        logp = torch.log_softmax(out_n, dim=-1)
        nll = -torch.gather(logp, -1, t_n.unsqueeze(-1)).squeeze(-1)
        return nll.mean() if reduction == "mean" else nll.sum()
    sq = (out_n - t_n) ** 2
    return sq.mean() if reduction == "mean" else sq.sum()


def unrolled_forward(
    model: nn.Sequential,
    params: dict[str, torch.Tensor],
    x: torch.Tensor,
    deltas: dict[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Hand-written forward of a Sequential of Linear / Tanh (no hooks, no functional_call).

    ``deltas[name]`` is added to each Linear's output, so ``∂loss/∂deltas[name]`` at zero
    is the layer's output-gradient. Returns ``(output, linear inputs, linear outputs)``.
    """
    h = x
    ins: dict[str, torch.Tensor] = {}
    outs: dict[str, torch.Tensor] = {}
    for name, mod in model.named_children():
        if isinstance(mod, nn.Linear):
            ins[name] = h
            h = F.linear(h, params[f"{name}.weight"], params.get(f"{name}.bias"))
            if deltas is not None:
                h = h + deltas[name]
            outs[name] = h
        elif isinstance(mod, nn.Tanh):
            h = torch.tanh(h)
        else:  # pragma: no cover - test models only hold Linear and Tanh
            raise TypeError(type(mod))
    return h, ins, outs


def plain_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def with_ones(a: torch.Tensor, bias: bool) -> torch.Tensor:
    """Rows ``a`` of shape ``(rows, in)``, with a column of ones appended for a bias."""
    if not bias:
        return a
    return torch.cat([a, torch.ones(a.shape[0], 1, dtype=a.dtype, device=a.device)], dim=1)


def flat_layer(grads: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """``vec([W | b])``, row-major over ``(out, in + 1)`` (bias as the last column)."""
    w = grads[f"{name}.weight"]
    b = grads.get(f"{name}.bias")
    m = w if b is None else torch.cat([w, b[:, None]], dim=1)
    return m.reshape(-1)


def oracle_grads(model: nn.Module, x: torch.Tensor, loss_fn: Callable) -> dict[str, torch.Tensor]:
    params = plain_params(model)
    return grad(lambda p: loss_fn(functional_call(model, p, (x,))))(params)


def kfac_state(
    model: nn.Module,
    x: torch.Tensor,
    loss_fn: Callable,
    *,
    reduction: str,
    convention: str = "fisher",
    factor_decay: float = 0.95,
    **capture_kw,
) -> tuple[kf.KFACState, dict[str, torch.Tensor], kf.Captures]:
    """Library under test: capture one batch and fold it into a fresh float64 state."""
    state = kf.init(
        kf.register(model),
        convention=convention,
        factor_dtype=DT,
        inv_dtype=DT,
        device=x.device,
    )
    _, grads, caps = kf.capture(
        model, plain_params(model), x, loss_fn, loss_reduction=reduction, **capture_kw
    )
    state = kf.step.accumulate_factors(state, caps, factor_decay=factor_decay)
    return state, grads, caps


def max_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Max abs error relative to ``max(1, max|expected|)``."""
    scale = max(1.0, expected.abs().max().item())
    return (actual - expected).abs().max().item() / scale


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return (torch.linalg.norm(actual - expected) / torch.linalg.norm(expected)).item()


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: float, what: str) -> None:
    assert actual.dtype == DT, f"{what}: dtype {actual.dtype}, expected float64"
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} vs {expected.shape}"
    err = max_err(actual, expected)
    assert err <= tol, f"{what}: scaled max error {err:.3e} > {tol:.0e}"


# ------------------------------------------------- 1. exact case: one datum, N = 1


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("arch", ARCHS)
def test_single_datum_kron_equals_dense_empirical_fisher(arch, loss, reduction, device):
    model = make_model(arch, device=device)
    x, t = make_data(loss, (1, 3), 3, device=device)
    loss_fn = lambda out: user_loss(loss, reduction, out, t)  # noqa: E731
    state, grads, _ = kfac_state(model, x, loss_fn, reduction=reduction)

    ref = oracle_grads(model, x, loss_fn)
    for k in ref:
        assert_close(grads[k], ref[k], TOL_EXACT, f"gradient {k}")
    for name in linear_names(model):
        v = flat_layer(ref, name)
        fisher = torch.outer(v, v)
        ls = state.layers[name]
        assert_close(torch.kron(ls.g_factor, ls.a_factor), fisher, TOL_EXACT, f"layer {name}")
        # The library's gradient matrix uses the same flattening as the oracle.
        spec = ls.spec
        m = kf.blocks.grads_to_matrix(spec, ref[spec.weight], ref[spec.bias] if spec.bias else None)
        assert torch.equal(m.reshape(-1), v)


# ------------------------------- 2. N > 1: per-example hand formulas ("fisher")


def per_example_output_grads(
    model: nn.Sequential, x: torch.Tensor, t: torch.Tensor, loss: str, reduction: str
) -> dict[str, torch.Tensor]:
    """``g_n[name] = ∂ℓ_n/∂z_name`` for every example (vmap over examples of grad)."""
    params = plain_params(model)
    names = linear_names(model)

    def ell(deltas, x_n, t_n):
        out, _, _ = unrolled_forward(model, params, x_n, deltas)
        return per_example_loss(loss, reduction, out, t_n)

    # deltas have the shape of one example's layer output (the input shape minus N).
    _, _, outs = unrolled_forward(model, params, x[0])
    zeros = {n: torch.zeros_like(outs[n]) for n in names}
    return vmap(grad(ell), in_dims=(None, 0, 0))(zeros, x, t)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("arch", ARCHS)
def test_batch_factors_match_per_example_formulas(arch, loss, reduction, device):
    n = 5
    model = make_model(arch, device=device)
    x, t = make_data(loss, (n, 3), 3, device=device)
    state, _, _ = kfac_state(
        model, x, lambda out: user_loss(loss, reduction, out, t), reduction=reduction
    )
    g = per_example_output_grads(model, x, t, loss, reduction)
    _, ins, _ = unrolled_forward(model, plain_params(model), x)
    for name in linear_names(model):
        a = with_ones(ins[name], state.layers[name].spec.has_bias)
        a_ref = torch.einsum("ni,nj->ij", a, a) / n
        g_ref = torch.einsum("ni,nj->ij", g[name], g[name]) / n
        ls = state.layers[name]
        assert_close(ls.a_factor, a_ref, TOL_EXACT, f"A of {name}")
        assert_close(ls.g_factor, g_ref, TOL_EXACT, f"G of {name}")


@pytest.mark.parametrize("arch", ARCHS)
def test_fisher_factors_do_not_depend_on_loss_reduction(arch):
    """Cross-entropy has the same ``ℓ_n`` for a mean and a sum: identical factors."""
    model = make_model(arch)
    x, t = make_data("ce", (5, 3), 3)
    s_mean, _, _ = kfac_state(model, x, lambda out: F.cross_entropy(out, t), reduction="mean")
    s_sum, _, _ = kfac_state(
        model, x, lambda out: F.cross_entropy(out, t, reduction="sum"), reduction="sum"
    )
    for name in linear_names(model):
        for which in ("a_factor", "g_factor"):
            m = getattr(s_mean.layers[name], which)
            s = getattr(s_sum.layers[name], which)
            assert_close(m, s, TOL_EXACT, f"{which} of {name}")


# ------------------------------------------- 3. Linear with rank-3 input (B, T, d)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("loss", LOSSES)
def test_rank3_input_rows_average_in_a_and_sum_in_g(loss, reduction):
    b, seq = 3, 4
    model = make_model("tanh")
    x, t = make_data(loss, (b, seq, 3), 3)
    state, _, _ = kfac_state(
        model, x, lambda out: user_loss(loss, reduction, out, t), reduction=reduction
    )
    g = per_example_output_grads(model, x, t, loss, reduction)  # (B, T, out)
    _, ins, _ = unrolled_forward(model, plain_params(model), x)
    for name in linear_names(model):
        a = with_ones(ins[name].reshape(b * seq, -1), True)
        a_ref = a.T @ a / (b * seq)
        gr = g[name].reshape(b * seq, -1)
        g_ref = gr.T @ gr / b
        ls = state.layers[name]
        assert_close(ls.a_factor, a_ref, TOL_EXACT, f"A of {name}")
        assert_close(ls.g_factor, g_ref, TOL_EXACT, f"G of {name}")


# ------------------------------------------------- 4. convention "kfac-pytorch"


@pytest.mark.parametrize("shape", [(5, 3), (2, 3, 3)], ids=["rank2", "rank3"])
@pytest.mark.parametrize("arch", ARCHS)
def test_kfac_pytorch_convention_from_plain_autograd(arch, shape, device):
    decay = 0.9
    model = make_model(arch, device=device)
    x, t = make_data("ce", shape, 3, device=device)
    loss_fn = lambda out: user_loss("ce", "mean", out, t)  # noqa: E731
    state, _, _ = kfac_state(
        model, x, loss_fn, reduction="mean", convention="kfac-pytorch", factor_decay=decay
    )

    # Oracle: plain autograd w.r.t. the Linear outputs of a hand-written forward.
    params = {k: v.requires_grad_(True) for k, v in plain_params(model).items()}
    out, ins, outs = unrolled_forward(model, params, x)
    names = linear_names(model)
    raw = torch.autograd.grad(loss_fn(out), [outs[n] for n in names])
    for name, r in zip(names, raw):
        spec = state.layers[name].spec
        a = with_ones(ins[name].detach().reshape(-1, spec.in_dim), spec.has_bias)
        r = r.reshape(-1, spec.out_dim)
        rows = a.shape[0]
        a_batch, g_batch = a.T @ a / rows, r.T @ r / rows
        a_ref = decay * torch.eye(a.shape[1], dtype=DT, device=device) + (1 - decay) * a_batch
        g_ref = decay * torch.eye(r.shape[1], dtype=DT, device=device) + (1 - decay) * g_batch
        ls = state.layers[name]
        assert_close(ls.a_factor, a_ref, TOL_EXACT, f"A of {name}")
        assert_close(ls.g_factor, g_ref, TOL_EXACT, f"G of {name}")
        assert ls.factor_updates == 1
    # A second update folds the batch factor again: decay·old + (1 − decay)·batch.
    _, _, caps = kf.capture(model, plain_params(model), x, loss_fn)
    twice = kf.step.accumulate_factors(state, caps, factor_decay=decay)
    for name, r in zip(names, raw):
        spec = state.layers[name].spec
        a = with_ones(ins[name].detach().reshape(-1, spec.in_dim), spec.has_bias)
        r = r.reshape(-1, spec.out_dim)
        a_batch, g_batch = a.T @ a / a.shape[0], r.T @ r / r.shape[0]
        a_ref = decay * state.layers[name].a_factor + (1 - decay) * a_batch
        g_ref = decay * state.layers[name].g_factor + (1 - decay) * g_batch
        assert_close(twice.layers[name].a_factor, a_ref, TOL_EXACT, f"A of {name}, step 2")
        assert_close(twice.layers[name].g_factor, g_ref, TOL_EXACT, f"G of {name}, step 2")


# ----------------------------------------------------------- 5. preconditioning


def _precond_setup(arch: str = "tanh", n: int = 6, device: torch.device = CPU):
    model = make_model(arch, device=device)
    x, t = make_data("ce", (n, 3), 3, device=device)
    loss_fn = lambda out: F.cross_entropy(out, t)  # noqa: E731
    _, grads, caps = kf.capture(model, plain_params(model), x, loss_fn)
    return model, grads, caps


def dense_eigen_solution(state, grads, name, damping):
    ls = state.layers[name]
    k = torch.kron(ls.g_factor, ls.a_factor)
    eye = torch.eye(k.shape[0], dtype=DT, device=k.device)
    return torch.linalg.solve(k + damping * eye, flat_layer(grads, name))


def dense_inverse_solution(state, grads, name, damping):
    ls = state.layers[name]
    dev = ls.a_factor.device
    ga = ls.g_factor + damping * torch.eye(ls.g_factor.shape[0], dtype=DT, device=dev)
    aa = ls.a_factor + damping * torch.eye(ls.a_factor.shape[0], dtype=DT, device=dev)
    return torch.kron(torch.linalg.inv(ga), torch.linalg.inv(aa)) @ flat_layer(grads, name)


@pytest.mark.parametrize("damping", [1e-3, 1e-1])
@pytest.mark.parametrize("outer_product", [True, False])
@pytest.mark.parametrize("arch", ARCHS)
def test_eigen_preconditioning_equals_dense_solve(arch, outer_product, damping, device):
    model, grads, caps = _precond_setup(arch, device=device)
    state = kf.init(
        kf.register(model),
        factor_dtype=DT,
        inv_dtype=DT,
        compute_eigenvalue_outer_product=outer_product,
        device=device,
    )
    before = copy.deepcopy(grads)
    out, new = kf.update(state, grads, captures=caps, damping=damping, kl_clip=None)
    # The same via the stages, and precondition_grads on the decomposed state.
    staged = kf.decompose(kf.step.accumulate_factors(state, caps), damping=damping)
    out2 = kf.step.precondition_grads(staged, grads, damping=damping, kl_clip=None)
    for name in linear_names(model):
        ls = new.layers[name]
        assert isinstance(ls.decomposition, kf.core.EigenDecomposition)
        assert (ls.decomposition.dgda is not None) == outer_product
        expected = dense_eigen_solution(new, before, name, damping)
        for got in (out, out2):
            err = rel_err(flat_layer(got, name), expected)
            assert err <= TOL_SOLVE, f"layer {name}: relative error {err:.3e}"


@pytest.mark.parametrize("damping", [1e-3, 1e-1])
@pytest.mark.parametrize("arch", ARCHS)
def test_inverse_preconditioning_equals_kron_of_damped_inverses(arch, damping, device):
    model, grads, caps = _precond_setup(arch, device=device)
    state = kf.init(
        kf.register(model), compute_method="inverse", factor_dtype=DT, inv_dtype=DT, device=device
    )
    out, new = kf.update(state, grads, captures=caps, damping=damping, kl_clip=None)
    for name in linear_names(model):
        assert isinstance(new.layers[name].decomposition, kf.core.InverseDecomposition)
        expected = dense_inverse_solution(new, grads, name, damping)
        err = rel_err(flat_layer(out, name), expected)
        assert err <= TOL_SOLVE, f"layer {name}: relative error {err:.3e}"


# ------------------------------------------------------------------- 6. kl_clip


@pytest.mark.parametrize("method", ["eigen", "inverse"])
@pytest.mark.parametrize("active", [True, False], ids=["clipping", "not-clipping"])
def test_kl_clip_scale_from_unclipped_preconditioned_grads(active, method, device):
    lr, damping = 0.3, 1e-2
    model, grads, caps = _precond_setup("tanh", device=device)
    state = kf.init(
        kf.register(model), compute_method=method, factor_dtype=DT, inv_dtype=DT, device=device
    )
    p, _ = kf.update(state, grads, captures=caps, damping=damping, kl_clip=None, lr=lr)
    names = linear_names(model)
    vg = lr**2 * sum(torch.dot(flat_layer(p, n), flat_layer(grads, n)) for n in names)
    vg = abs(vg.item())
    kl_clip = 0.25 * vg if active else 4.0 * vg
    expected_scale = min(1.0, math.sqrt(kl_clip / vg))
    assert (expected_scale < 0.9) == active  # the case is what its name says
    clipped, _ = kf.update(state, grads, captures=caps, damping=damping, kl_clip=kl_clip, lr=lr)
    for k in grads:
        assert_close(clipped[k], expected_scale * p[k], 1e-12, f"clipped {k}")


@pytest.mark.parametrize("outer_product", [True, False])
def test_callable_hyperparameters_equal_numbers(outer_product):
    """Callables are evaluated at ``state.step``; step-dependent values over two steps."""
    model = make_model("tanh")
    x, t = make_data("ce", (6, 3), 3)
    loss_fn = lambda out: F.cross_entropy(out, t)  # noqa: E731
    x2, t2 = make_data("ce", (6, 3), 3, seed=7)
    loss_fn2 = lambda out: F.cross_entropy(out, t2)  # noqa: E731
    p = plain_params(model)
    _, g1, c1 = kf.capture(model, p, x, loss_fn)
    _, g2, c2 = kf.capture(model, p, x2, loss_fn2)
    hyper = {
        "damping": [1e-2, 3e-2],
        "factor_decay": [0.9, 0.8],
        "kl_clip": [1e-3, 5e-4],
        "lr": [0.1, 0.2],
    }
    init = lambda: kf.init(  # noqa: E731
        kf.register(model),
        factor_dtype=DT,
        inv_dtype=DT,
        compute_eigenvalue_outer_product=outer_product,
    )
    s_num, s_fun = init(), init()
    for step, (g, c) in enumerate([(g1, c1), (g2, c2)]):
        nums = {k: v[step] for k, v in hyper.items()}
        funs = {k: (lambda s, v=v: v[s]) for k, v in hyper.items()}
        o_num, s_num = kf.update(s_num, g, captures=c, **nums)
        o_fun, s_fun = kf.update(
            s_fun,
            g,
            captures=c,
            update_factors=lambda s: True,
            update_inverses=lambda s: True,
            **funs,
        )
        for k in g:
            assert torch.equal(o_num[k], o_fun[k]), f"step {step}: {k}"
        assert s_num.step == s_fun.step == step + 1
        for a, b in zip(optree.tree_leaves(s_num), optree.tree_leaves(s_fun)):
            assert torch.equal(a, b)


# ------------------------------------------- 7. MC Fisher → exact Fisher (single datum)


def exact_fisher_blocks(model, x1, likelihood):
    """``Jᵀ H J`` per Linear layer for one datum, ``J = ∂logits/∂θ_layer`` (jacrev).

    ``H = diag(p) − ppᵀ`` for cross-entropy and ``I`` for ``ℓ = ½‖y − t‖²``. Also returns
    the RMS relative Frobenius error of an N-sample MC estimate, per sample count 1,
    ``sqrt((E‖g gᵀ‖² − ‖F‖²) / ‖F‖²)`` with ``g = Jᵀ ∇_y ℓ`` the sampled gradient.
    """
    params = plain_params(model)
    x1 = x1.reshape(-1)  # one datum, no batch dimension: logits of shape (C,)
    logits = functional_call(model, params, (x1,))
    jac = jacrev(lambda p: functional_call(model, p, (x1,)))(params)
    c = logits.shape[-1]
    blocks = {}
    for name in linear_names(model):
        parts = [jac[f"{name}.weight"]]
        if f"{name}.bias" in jac:
            parts.append(jac[f"{name}.bias"][..., None])
        j = torch.cat(parts, dim=-1).reshape(c, -1)  # (C, P) row-major [W | b]
        if likelihood == "cross_entropy":
            p = torch.softmax(logits, dim=-1)
            fisher = j.T @ (torch.diag(p) - torch.outer(p, p)) @ j
            # g_t = Jᵀ(p − e_t) with probability p_t: E‖g‖⁴ = Σ_t p_t ‖g_t‖⁴.
            gt = (p[None, :] - torch.eye(c, dtype=DT)) @ j
            fourth = (p * gt.pow(2).sum(-1).pow(2)).sum()
        else:
            fisher = j.T @ j
            # g = Jᵀε, ε ~ N(0, I): E‖g‖⁴ = 2 tr(M²) + tr(M)², M = J Jᵀ.
            m = j @ j.T
            fourth = 2 * torch.trace(m @ m) + torch.trace(m) ** 2
        f2 = fisher.pow(2).sum()
        blocks[name] = (fisher, math.sqrt(((fourth - f2) / f2).item()))
    return blocks


@pytest.mark.parametrize("likelihood", ["cross_entropy", "mse"])
def test_mc_fisher_converges_to_exact_fisher(likelihood):
    n = 40000
    model = make_model("tanh", dims=(3, 4, 3))
    g = torch.Generator().manual_seed(3)
    x1 = torch.randn(1, 3, generator=g, dtype=DT)
    x = x1.expand(n, 3).contiguous()
    if likelihood == "cross_entropy":
        t = torch.zeros(n, dtype=torch.long)
        loss_fn = lambda out: F.cross_entropy(out, t)  # noqa: E731
    else:
        t = torch.randn(1, 3, generator=g, dtype=DT).expand(n, 3)
        loss_fn = lambda out: 0.5 * ((out - t) ** 2).sum(-1).mean()  # noqa: E731
    mc, _, _ = kfac_state(
        model,
        x,
        loss_fn,
        reduction="mean",
        fisher="mc",
        likelihood=likelihood,
        generator=torch.Generator().manual_seed(0),
    )
    emp, _, _ = kfac_state(model, x, loss_fn, reduction="mean")
    for name, (fisher, rms1) in exact_fisher_blocks(model, x1, likelihood).items():
        # All N rows are the same datum, so A = a aᵀ exactly and kron(E[G], A) is the
        # exact Fisher block; the MC estimate of G averages N i.i.d. rank-one terms, so its
        # relative Frobenius error has RMS rms1/√N. Allow 4 RMS (Chebyshev: a miss would
        # have probability ≤ 1/16; the seed is fixed) and require that to be below 5 %.
        tol = 4 * rms1 / math.sqrt(n)
        assert tol < 0.05, f"layer {name}: MC tolerance {tol:.3f} too loose for the test"
        ls = mc.layers[name]
        err = rel_err(torch.kron(ls.g_factor, ls.a_factor), fisher)
        assert err < tol, f"layer {name}: MC Fisher relative error {err:.4f} >= {tol:.4f}"
        # Sanity: the empirical Fisher (rank one here) is not what MC converges to.
        le = emp.layers[name]
        err_emp = rel_err(torch.kron(le.g_factor, le.a_factor), fisher)
        assert err_emp > 10 * tol, f"layer {name}: empirical Fisher too close ({err_emp:.3f})"


def test_mc_cross_entropy_g_is_a_count_weighted_sum_of_class_gradients():
    """Exact float64 structure of the MC G for one repeated datum.

    With sampled class ``t_n`` the per-example output-gradient of layer ``k`` is
    ``v_t = J_kᵀ (p − e_t)`` (``J_k = ∂logits/∂z_k``), so ``G = Σ_t (k_t / N) v_t v_tᵀ``
    with integer counts ``k_t`` summing to ``N``; and the counts must follow ``p``.
    """
    n = 2000
    model = make_model("tanh", dims=(3, 4, 3))
    x1 = torch.randn(3, generator=torch.Generator().manual_seed(3), dtype=DT)
    x = x1.expand(n, 3).contiguous()
    t = torch.zeros(n, dtype=torch.long)
    mc, _, _ = kfac_state(
        model,
        x,
        lambda out: F.cross_entropy(out, t),
        reduction="mean",
        fisher="mc",
        likelihood="cross_entropy",
        generator=torch.Generator().manual_seed(0),
    )
    params = plain_params(model)
    logits, _, outs = unrolled_forward(model, params, x1)
    p = torch.softmax(logits, dim=-1)
    c = p.shape[0]
    names = linear_names(model)
    zeros = {k: torch.zeros_like(outs[k]) for k in names}
    jz = jacrev(lambda d: unrolled_forward(model, params, x1, d)[0])(zeros)
    counts = []
    for name in names:
        v = (p[None, :] - torch.eye(c, dtype=DT)) @ jz[name]  # (C, out): row t is v_t
        basis = torch.stack([torch.outer(vt, vt).reshape(-1) for vt in v], dim=1)
        g = mc.layers[name].g_factor
        k = torch.linalg.lstsq(basis, g.reshape(-1, 1)).solution[:, 0] * n
        assert (k - k.round()).abs().max().item() < 1e-6, f"layer {name}: counts {k}"
        k = k.round()
        assert k.sum().item() == n and (k >= 0).all()
        recon = (basis @ (k / n)).reshape(g.shape)
        assert_close(g, recon, TOL_EXACT, f"MC G of {name}")
        counts.append(k)
    # Every layer saw the same sampled classes.
    assert all(torch.equal(counts[0], k) for k in counts)
    # Pearson χ² with C − 1 = 2 degrees of freedom: P(χ² > 13.8) = 0.001.
    chi2 = ((counts[0] - n * p) ** 2 / (n * p)).sum().item()
    assert chi2 < 13.8, f"sampled class counts {counts[0].tolist()} do not follow p={p.tolist()}"


# ------------------------------------------------------------------------- 8. purity


def _leaves_with_versions(tree):
    leaves = optree.tree_leaves(tree)
    return leaves, [t._version for t in leaves]


@pytest.mark.parametrize(
    ("method", "outer_product"),
    [("eigen", True), ("eigen", False), ("inverse", False)],
)
@pytest.mark.parametrize("convention", ["fisher", "kfac-pytorch"])
def test_update_is_pure(convention, method, outer_product, device):
    model, grads, caps = _precond_setup("tanh", device=device)
    state = kf.init(
        kf.register(model),
        convention=convention,
        compute_method=method,
        compute_eigenvalue_outer_product=outer_product,
        factor_dtype=DT,
        inv_dtype=DT,
        device=device,
    )
    # Take one step first so that the state holds factors and decompositions.
    _, state = kf.update(state, grads, captures=caps, damping=1e-2, kl_clip=1e-4)
    tree = (state, grads, caps)
    snapshot = copy.deepcopy(tree)
    leaves, versions = _leaves_with_versions(tree)
    assert len(leaves) > 0
    kf.update(state, grads, captures=caps, damping=1e-2, kl_clip=1e-4)
    kf.step.accumulate_factors(state, caps)
    kf.decompose(state, damping=1e-2)
    with warnings.catch_warnings():
        # damped inverses keep their own damping (the same here); precondition_grads warns
        warnings.filterwarnings("ignore", "precondition_grads.damping", UserWarning)
        kf.step.precondition_grads(state, grads, damping=1e-2, kl_clip=1e-4)
    assert optree.tree_structure(tree) == optree.tree_structure(snapshot)
    after, versions_after = _leaves_with_versions(tree)
    assert versions_after == versions, "a leaf was modified in place"
    for a, b in zip(after, optree.tree_leaves(snapshot)):
        assert torch.equal(a, b)
        assert a.dtype == b.dtype
