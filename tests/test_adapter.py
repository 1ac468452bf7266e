"""`KFACPreconditioner` (the stateful kfac-pytorch drop-in) on one process.

The adapter owns no math: with the same hyperparameters it must give bit-identical
gradients and factors to the functional path (``kf.capture`` + ``kf.update``), for every
layer kind, scaling, compute method and hook mode. The rest checks the kfac-pytorch
surface: argument validation, when hooks collect, gradient accumulation, AMP (GradScaler,
bf16 autocast, overflow steps), checkpoints (``state_dict``/``load_state_dict`` and the
state pytree), ``LambdaParamScheduler``, ``memory_usage`` and ``repr``.
"""

from __future__ import annotations

import copy
import io
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from settings_keywords import with_settings
from torch import nn

import kfac_func as kf
from kfac_func import ComputeMethod, KFACPreconditioner
from kfac_func.adapter import LambdaParamScheduler
from kfac_func.distributed import AssignmentStrategy, DistributedStrategy

F64 = torch.float64
CPU = torch.device("cpu")
LR = 0.1
STEPS = 7
FACTOR_EVERY = 2
INV_EVERY = 3
HYPER: dict[str, Any] = dict(damping=0.01, factor_decay=0.9, kl_clip=1e-2, lr=LR)
METHODS = (("eigen", True), ("eigen", False), ("inverse", False))
SCALINGS = ("kfac-pytorch", "fisher")

Batch = tuple[torch.Tensor, torch.Tensor]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """Tiny tensors: on a shared 2-core machine, intra-op threads only add contention
    (measured: 17 s instead of 80 s for this module under load)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# --------------------------------------------------------------------------- models


class SeqModel(nn.Module):
    """(B, T) tokens -> Embedding -> Linear on (B, T, D) -> mean over T -> Linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.proj = nn.Linear(6, 8)
        self.mix = nn.Linear(8, 8, bias=False)
        self.head = nn.Linear(8, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.proj(self.embed(tokens)))
        h = F.relu(self.mix(h))
        return self.head(h.mean(1))


def mlp(bias: bool = True) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 10, bias=bias),
        nn.Tanh(),
        nn.Linear(10, 8, bias=bias),
        nn.ReLU(),
        nn.Linear(8, 3, bias=bias),
    ).double()


def cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1),
        nn.BatchNorm2d(6),
        nn.ReLU(inplace=True),
        nn.Conv2d(6, 6, 3, stride=2, groups=3),  # grouped, output modified in place below
        nn.ReLU(inplace=True),
        nn.Flatten(),
        nn.Linear(6 * 2 * 2, 3),
    ).double()


def seq() -> nn.Module:
    torch.manual_seed(0)
    return SeqModel().double()


def batches(kind: str, n: int, steps: int = STEPS, seed: int = 1) -> list[Batch]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        if kind == "cnn":
            x = torch.randn(n, 3, 6, 6, generator=g, dtype=F64)
        elif kind == "seq":
            x = torch.randint(0, 11, (n, 5), generator=g)
        else:
            x = torch.randn(n, 6, generator=g, dtype=F64)
        out.append((x, torch.randint(0, 3, (n,), generator=g)))
    return out


MODELS: dict[str, tuple[Callable[[], nn.Module], str, list[str] | None]] = {
    "mlp": (mlp, "mlp", None),
    "mlp_nobias": (lambda: mlp(bias=False), "mlp", None),
    "cnn": (cnn, "cnn", None),
    "seq": (seq, "seq", None),
    "seq_skip_class": (seq, "seq", ["Embedding"]),
    "seq_skip_name": (seq, "seq", ["embed"]),
}


def xent(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, y)


# --------------------------------------------------------------------------- helpers


def net_device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def sgd_(model: nn.Module, grads: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            p -= LR * grads[name]


def adapter_grads(pre: KFACPreconditioner, model: nn.Module, x: Any, y: Any) -> dict[str, Any]:
    model.zero_grad(set_to_none=True)
    xent(model(x), y).backward()
    pre.step()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def assert_states_equal(a: kf.KFACState, b: kf.KFACState, exact: bool = True) -> None:
    """Equal states: bit for bit when ``exact``; else factors equal to rounding and the
    decompositions present in both (their eigenvectors are not unique: compared through
    the gradients they give, by the caller)."""
    assert a.step == b.step
    assert list(a.layers) == list(b.layers)
    for name in a.layers:
        la, lb = a.layers[name], b.layers[name]
        assert la.factor_updates == lb.factor_updates, name
        assert (la.decomposition is None) == (lb.decomposition is None), name
        if not exact:
            torch.testing.assert_close(la.a_factor, lb.a_factor, rtol=1e-7, atol=1e-12)
            torch.testing.assert_close(la.g_factor, lb.g_factor, rtol=1e-7, atol=1e-12)
            continue
        assert torch.equal(la.a_factor, lb.a_factor), name
        assert torch.equal(la.g_factor, lb.g_factor), name
        if la.decomposition is not None:
            for k, v in vars(la.decomposition).items():
                w = getattr(lb.decomposition, k)
                assert (v is None and w is None) or torch.equal(v, w), (name, k)


def run_equivalence(
    make: Callable[[], nn.Module],
    data: list[Batch],
    *,
    scaling: str,
    method: str,
    outer: bool,
    hook: bool,
    skip: list[str] | None = None,
    hyper: dict[str, Any] | None = None,
    factor_every: Any = FACTOR_EVERY,
    inv_every: Any = INV_EVERY,
    dtype: torch.dtype = F64,
    device: torch.device = CPU,
) -> None:
    """Adapter and ``kf.capture`` + ``kf.update`` train two copies side by side; every
    step's gradients and the final states must be bit-identical (on the CPU; on a GPU,
    where reductions with atomics, as an embedding's backward, change the order of the
    sums from run to run, equal to rounding)."""
    hyper = HYPER if hyper is None else hyper
    exact = device.type == "cpu"
    net = make().to(device)
    data = [(x.to(device), y.to(device)) for x, y in data]
    ref = copy.deepcopy(net)
    pre = KFACPreconditioner(
        net,
        factor_update_steps=factor_every,
        inv_update_steps=inv_every,
        settings=kf.Settings(scaling=scaling),
        compute_method=method,
        compute_eigenvalue_outer_product=outer,
        update_factors_in_hook=hook,
        factor_dtype=dtype,
        inv_dtype=dtype,
        skip_layers=skip,
        **hyper,
    )
    layers = kf.register(ref, skip)
    assert list(layers) == list(pre.layers)
    state = kf.init(
        layers,
        convention=scaling,  # type: ignore[arg-type]
        compute_method=method,
        compute_eigenvalue_outer_product=outer,
        factor_dtype=pre.factor_dtype,
        inv_dtype=pre.inv_dtype,
        device=device,
    )

    def every(v: Any, step: int) -> int:
        return int(v(step) if callable(v) else v)

    for step, (x, y) in enumerate(data):
        got = adapter_grads(pre, net, x, y)
        params = dict(ref.named_parameters())
        _, grads, caps = kf.capture(ref, params, x, lambda out, y=y: xent(out, y), layers=layers)
        want, state = kf.update(
            state,
            grads,
            captures=caps,
            update_factors=step % every(factor_every, step) == 0,
            update_inverses=step % every(inv_every, step) == 0,
            **hyper,
        )
        assert sorted(got) == sorted(want)
        for name in got:
            assert got[name].device == want[name].device == net_device(net)
            if not exact:
                torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=1e-12)
                continue
            assert torch.equal(got[name], want[name]), (
                f"step {step} {name}: max diff {float((got[name] - want[name]).abs().max()):.3e}"
            )
        sgd_(net, got)
        sgd_(ref, want)
    assert_states_equal(pre.state, state, exact=exact)
    assert pre.steps == len(data)


# --------------------------------------------------------------------------- equivalence


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("scaling", SCALINGS)
def test_adapter_equals_functional(model: str, scaling: str, device: torch.device) -> None:
    make, kind, skip = MODELS[model]
    data = batches(kind, 8)
    for method, outer in METHODS:
        for hook in (True, False):
            try:
                run_equivalence(
                    make,
                    data,
                    scaling=scaling,
                    method=method,
                    outer=outer,
                    hook=hook,
                    skip=skip,
                    device=device,
                )
            except AssertionError as e:
                raise AssertionError(f"{method} outer={outer} hook={hook}: {e}") from e


def test_seq_model_equals_functional_without_kl_clip() -> None:
    """The sequence model without the kl_clip sum (see the next test) is bit-identical."""
    for scaling in SCALINGS:
        for hook in (True, False):
            run_equivalence(
                seq,
                batches("seq", 8),
                scaling=scaling,
                method="eigen",
                outer=True,
                hook=hook,
                skip=["embed"],
                hyper={**HYPER, "kl_clip": None},
            )


def test_kl_clip_sums_layers_in_registration_order() -> None:
    """Layers registered in an order that is not their sorted-name order ("proj", "mix",
    "head"): the kl_clip scale sums one term per layer and must sum them in the order
    ``kf.update`` does (the state's), else it rounds differently and the gradients are
    no longer bit-identical."""
    pre = KFACPreconditioner(seq(), skip_layers=["embed"])
    assert list(pre.layers) == ["proj", "mix", "head"] != sorted(pre.layers)
    data = batches("seq", 8, steps=6, seed=8)  # data on which the two orders round apart
    failures = []
    for scaling in SCALINGS:
        for method, outer in METHODS:
            try:
                run_equivalence(
                    seq,
                    data,
                    scaling=scaling,
                    method=method,
                    outer=outer,
                    hook=True,
                    skip=["embed"],
                    factor_every=1,
                    inv_every=1,
                )
            except AssertionError as e:
                failures.append(f"{scaling} {method} outer={outer}: {e}")
    assert not failures, "\n".join(failures)


def test_skip_layers_by_name_and_class() -> None:
    assert list(KFACPreconditioner(seq(), skip_layers=["embed"]).layers) == ["proj", "mix", "head"]
    assert list(KFACPreconditioner(seq(), skip_layers=["Embedding"]).layers) == [
        "proj",
        "mix",
        "head",
    ]
    pre = KFACPreconditioner(seq(), skip_layers=["mix", "head"])
    assert list(pre.layers) == ["embed", "proj"]


def test_adapter_equals_functional_with_defaults_in_float32() -> None:
    """No dtype or hyperparameter given on either side: the defaults agree."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 3))
    ref = copy.deepcopy(net)
    pre = KFACPreconditioner(net)
    layers = kf.register(ref)
    state = kf.init(layers, convention="kfac-pytorch")
    assert (pre.factor_dtype, pre.inv_dtype) == (torch.float32, torch.float32)
    for x, y in batches("mlp", 8, steps=3):
        x = x.float()
        got = adapter_grads(pre, net, x, y)
        _, grads, caps = kf.capture(ref, dict(ref.named_parameters()), x, lambda o, y=y: xent(o, y))
        want, state = kf.update(state, grads, captures=caps)
        assert all(torch.equal(got[k], want[k]) for k in got)
        sgd_(net, got)
        sgd_(ref, want)
    assert_states_equal(pre.state, state)


def test_adapter_equals_functional_with_callable_hyperparameters() -> None:
    hyper: dict[str, Any] = dict(
        damping=lambda s: 0.01 * (1 + s),
        factor_decay=lambda s: 0.8 if s < 3 else 0.9,
        kl_clip=lambda s: 1e-2,
        lr=lambda s: LR,
    )
    for scaling in SCALINGS:
        run_equivalence(
            mlp,
            batches("mlp", 8),
            scaling=scaling,
            method="eigen",
            outer=True,
            hook=True,
            hyper=hyper,
            factor_every=lambda s: 1 if s < 2 else 3,
            inv_every=lambda s: 2,
        )


@pytest.mark.parametrize("hook", [True, False])
def test_adapter_equals_functional_non_power_of_two_batch(hook: bool) -> None:
    """Batches of 6 examples: a ``"fisher"`` window's weight is its example count, and the
    adapter must not multiply the factors by it and divide again on one process (that
    rounds, so the result would no longer be bit-identical to ``kf.update``)."""
    for scaling in SCALINGS:
        try:
            run_equivalence(
                mlp, batches("mlp", 6), scaling=scaling, method="eigen", outer=True, hook=hook
            )
        except AssertionError as e:
            raise AssertionError(f"{scaling}: {e}") from e


# --------------------------------------------------------------------------- validation


def small() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 2))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(allreduce_bucket_cap_mb=-1), r"allreduce_bucket_cap_mb must be >= 0"),
        (dict(grad_worker_fraction=1.5), r"grad_worker_fraction must be in \[0, 1\], got 1.5"),
        (dict(grad_worker_fraction=-0.1), r"grad_worker_fraction must be in \[0, 1\]"),
        (dict(compute_method="cholesky"), r"compute_method must be one of eigen, inverse"),
        (dict(assignment_strategy="speed"), r"assignment_strategy must be one of compute, memory"),
        (
            dict(
                compute_method="eigen",
                compute_eigenvalue_outer_product=True,
                colocate_factors=False,
            ),
            r"colocate_factors must be True to use compute_eigenvalue_outer_product",
        ),
        (dict(factor_update_steps=0), r"factor_update_steps must be a positive int, got 0"),
        (dict(factor_update_steps=-2), r"factor_update_steps must be a positive int"),
        (dict(factor_update_steps=1.5), r"factor_update_steps must be a positive int"),
        (dict(inv_update_steps=0), r"inv_update_steps must be a positive int, got 0"),
        (dict(accumulation_steps=0), r"accumulation_steps must be a positive int, got 0"),
        (dict(accumulation_steps=-1), r"accumulation_steps must be a positive int"),
        (dict(factor_decay=1.5), r"factor_decay must be in \[0, 1\], got 1.5"),
        (dict(factor_decay=-0.5), r"factor_decay must be in \[0, 1\]"),
        (dict(lr=-0.1), r"lr must be >= 0, got -0.1"),
        (dict(damping=-1e-3), r"damping must be >= 0, got -0.001"),
        (dict(kl_clip=0.0), r"kl_clip must be > 0 \(or None to disable\)"),
        (dict(scaling="natural"), r"scaling must be one of \(.fisher., .kfac-pytorch.\)"),
        (dict(loss_reduction="max"), r"loss_reduction must be 'mean' or 'sum'"),
    ],
)
def test_validation_errors(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        KFACPreconditioner(small(), **with_settings(**kwargs))


def test_valid_boundaries_are_accepted() -> None:
    pre = KFACPreconditioner(
        small(),
        allreduce_bucket_cap_mb=0,
        grad_worker_fraction=0.0,
        factor_decay=1.0,
        lr=0.0,
        damping=0.0,
        kl_clip=None,
    )
    assert pre.grad_worker_fraction == 1.0  # 0 means 1/world_size, world 1 here
    pre = KFACPreconditioner(small(), grad_worker_fraction=1.0)
    assert pre.distributed_strategy is DistributedStrategy.COMM_OPT
    # the outer product needs colocated factors only for the eigen method
    pre = KFACPreconditioner(
        small(),
        compute_method="inverse",
        compute_eigenvalue_outer_product=True,
        colocate_factors=False,
    )
    assert pre.colocate_factors is False
    with pytest.raises(ValueError, match="no layer of ReLU can be preconditioned"):
        KFACPreconditioner(nn.ReLU())


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("eigen", ComputeMethod.EIGEN),
        ("EiGeN", ComputeMethod.EIGEN),
        ("INVERSE", ComputeMethod.INVERSE),
        (ComputeMethod.INVERSE, ComputeMethod.INVERSE),
    ],
)
def test_compute_method_case_insensitive_and_enum(value: Any, expected: ComputeMethod) -> None:
    pre = KFACPreconditioner(small(), compute_method=value)
    assert pre.compute_method is expected
    assert pre.state.config.compute_method == expected.name.lower()


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("compute", AssignmentStrategy.COMPUTE),
        ("Memory", AssignmentStrategy.MEMORY),
        (AssignmentStrategy.MEMORY, AssignmentStrategy.MEMORY),
    ],
)
def test_assignment_strategy_case_insensitive_and_enum(
    value: Any, expected: AssignmentStrategy
) -> None:
    assert KFACPreconditioner(small(), assignment_strategy=value).assignment_strategy is expected


def test_unequal_grad_worker_groups_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Needs a world size that a group size does not divide: ``make_plan`` directly, and
    the adapter with the world size it reads from the process group patched to 4."""
    layers = kf.register(small())
    with pytest.raises(ValueError, match=r"groups of 3 grad workers.*4 ranks into equal groups"):
        kf.distributed.make_plan(layers, 4, grad_worker_fraction=0.75)
    with pytest.raises(ValueError, match=r"equal groups"):
        kf.distributed.make_plan(layers, 3, grad_worker_fraction=0.5)
    assert kf.distributed.make_plan(layers, 4, grad_worker_fraction=0.5).worker_groups == (
        (0, 1),
        (2, 3),
    )

    monkeypatch.setattr(kf.distributed.Communicator, "current_world_size", staticmethod(lambda: 4))
    with pytest.raises(ValueError, match=r"world_size=4 gives groups of 3 grad workers"):
        KFACPreconditioner(small(), grad_worker_fraction=0.75)


def test_kl_clip_none_disables_clipping() -> None:
    def run(kl_clip: float | None) -> list[dict[str, torch.Tensor]]:
        net = mlp()
        pre = KFACPreconditioner(net, damping=1e-3, lr=10.0, kl_clip=kl_clip, inv_dtype=F64)
        out = []
        for x, y in batches("mlp", 8, steps=3):
            out.append(adapter_grads(pre, net, x, y))
            sgd_(net, out[-1])
        return out

    none, huge, clipped = run(None), run(1e30), run(1e-6)
    for a, b in zip(none, huge):
        assert all(torch.equal(a[k], b[k]) for k in a)
    # and clipping was active at all with these gradients
    assert not all(torch.equal(none[0][k], clipped[0][k]) for k in none[0])


# --------------------------------------------------------------------------- hooks


def factor_updates(pre: KFACPreconditioner) -> dict[str, int]:
    return {n: ls.factor_updates for n, ls in pre.state.layers.items()}


def one_batch(n: int = 8, seed: int = 3) -> Batch:
    return batches("mlp", n, steps=1, seed=seed)[0]


def test_hooks_collect_only_in_training_mode_with_grad() -> None:
    net = mlp()
    pre = KFACPreconditioner(net, factor_dtype=F64, inv_dtype=F64)
    x, y = one_batch()
    net.eval()
    xent(net(x), y).backward()
    assert pre.memory_usage()["hook_buffers"] == 0
    pre.step()
    assert set(factor_updates(pre).values()) == {0}

    net.train()
    with torch.no_grad():
        net(x)
    assert pre.memory_usage()["hook_buffers"] == 0
    net.zero_grad()
    xent(net(x), y).backward()
    assert pre.memory_usage()["hook_buffers"] > 0
    pre.step()
    assert set(factor_updates(pre).values()) == {1}
    assert pre.memory_usage()["hook_buffers"] == 0

    # the factors come from the one grad-enabled training forward only
    ref = mlp()
    layers = kf.register(ref)
    state = kf.init(layers, convention="kfac-pytorch", factor_dtype=F64, inv_dtype=F64)
    state = state.replace(step=1)
    _, _, caps = kf.capture(ref, dict(ref.named_parameters()), x, lambda o: xent(o, y))
    state = kf.step.accumulate_factors(state, caps, factor_decay=pre.factor_decay)
    for name in layers:
        assert torch.equal(pre.state.layers[name].a_factor, state.layers[name].a_factor)
        assert torch.equal(pre.state.layers[name].g_factor, state.layers[name].g_factor)


def test_no_collection_between_factor_update_steps() -> None:
    net = mlp()
    pre = KFACPreconditioner(net, factor_update_steps=3)
    x, y = one_batch()
    for step in range(6):
        net.zero_grad()
        xent(net(x), y).backward()
        assert (pre.memory_usage()["hook_buffers"] > 0) == (step % 3 == 0)
        pre.step()
    assert set(factor_updates(pre).values()) == {2}


def all_hooks(model: nn.Module) -> int:
    return sum(
        len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks)
        for m in model.modules()
    )


def test_remove_detaches_every_hook() -> None:
    net = cnn()
    before = all_hooks(net)
    pre = KFACPreconditioner(net)
    assert all_hooks(net) > before
    x, y = batches("cnn", 4, steps=1)[0]
    xent(net(x), y).backward()
    pre.step()
    done = factor_updates(pre)
    assert set(done.values()) == {1}
    xent(net(x), y).backward()  # collected, then dropped by remove()
    pre.remove()
    assert all_hooks(net) == 0
    assert pre.memory_usage()["hook_buffers"] == 0
    net.zero_grad()
    xent(net(x), y).backward()
    assert pre.memory_usage()["hook_buffers"] == 0
    pre.step()  # still preconditions with what it has, but updates no factor
    assert factor_updates(pre) == done
    pre.remove()  # idempotent


# --------------------------------------------------------------------------- accumulation


@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.parametrize("hook", [True, False])
def test_accumulation_equals_functional_list_of_captures(scaling: str, hook: bool) -> None:
    sizes = (5, 3)  # unequal micro-batches (8 in all, so the fisher weights are exact)
    k = len(sizes)
    net = mlp()
    ref = copy.deepcopy(net)
    pre = KFACPreconditioner(
        net,
        accumulation_steps=k,
        factor_update_steps=1,
        inv_update_steps=2,
        settings=kf.Settings(scaling=scaling),
        update_factors_in_hook=hook,
        factor_dtype=F64,
        inv_dtype=F64,
        **HYPER,
    )
    layers = kf.register(ref)
    state = kf.init(layers, convention=scaling, factor_dtype=F64, inv_dtype=F64)  # type: ignore[arg-type]
    g = torch.Generator().manual_seed(5)
    for step in range(4):
        micro = [
            (torch.randn(n, 6, generator=g, dtype=F64), torch.randint(0, 3, (n,), generator=g))
            for n in sizes
        ]
        net.zero_grad(set_to_none=True)
        for x, y in micro:
            (xent(net(x), y) / k).backward()
        pre.step()
        got = {n: p.grad.clone() for n, p in net.named_parameters()}

        caps, total = [], None
        for x, y in micro:
            _, grads, cap = kf.capture(
                ref, dict(ref.named_parameters()), x, lambda o, y=y: xent(o, y) / k
            )
            caps.append(cap)
            total = grads if total is None else {n: total[n] + grads[n] for n in grads}
        assert total is not None
        want, state = kf.update(state, total, captures=caps, update_inverses=step % 2 == 0, **HYPER)
        for name in got:
            assert torch.equal(got[name], want[name]), (step, name)
        sgd_(net, got)
        sgd_(ref, want)
    assert_states_equal(pre.state, state)


@pytest.mark.parametrize("scaling", SCALINGS)
def test_accumulation_weighting_rule(scaling: str) -> None:
    """``"kfac-pytorch"`` averages the micro-batch covariances equally, ``"fisher"``
    weights them by their example counts."""
    sizes = (6, 2)
    net = mlp()
    ref = copy.deepcopy(net)
    decay = 0.9
    pre = KFACPreconditioner(
        net,
        settings=kf.Settings(scaling=scaling),
        factor_decay=decay,
        factor_dtype=F64,
        inv_dtype=F64,
    )
    layers = kf.register(ref)
    g = torch.Generator().manual_seed(7)
    singles = []
    for n in sizes:
        x, y = torch.randn(n, 6, generator=g, dtype=F64), torch.randint(0, 3, (n,), generator=g)
        xent(net(x), y).backward()
        _, _, cap = kf.capture(ref, dict(ref.named_parameters()), x, lambda o, y=y: xent(o, y))
        fresh = kf.init(layers, convention=scaling, factor_dtype=F64)  # type: ignore[arg-type]
        singles.append(kf.step.accumulate_factors(fresh, cap, factor_decay=decay))
    pre.step()
    w = [n / sum(sizes) for n in sizes] if scaling == "fisher" else [0.5, 0.5]
    for name in layers:
        for attr in ("a_factor", "g_factor"):
            parts = [getattr(s.layers[name], attr) for s in singles]
            expected = w[0] * parts[0] + w[1] * parts[1]
            other = (
                (parts[0] + parts[1]) / 2
                if scaling == "fisher"
                else (sizes[0] * parts[0] + sizes[1] * parts[1]) / sum(sizes)
            )
            got = getattr(pre.state.layers[name], attr)
            torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-14)
            assert not torch.allclose(got, other, rtol=1e-6, atol=0), (name, attr)


# --------------------------------------------------------------------------- AMP


def amp_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 6 * 6, 16, bias=False),
        nn.ReLU(),
        nn.Linear(16, 3),
    )


def amp_data(steps: int = 3) -> list[Batch]:
    g = torch.Generator().manual_seed(11)
    return [
        (torch.randn(8, 3, 6, 6, generator=g), torch.randint(0, 3, (8,), generator=g))
        for _ in range(steps)
    ]


@pytest.mark.parametrize("scaling", SCALINGS)
def test_grad_scaler_factors_equal_unscaled_run(scaling: str) -> None:
    """Scales are powers of two, so scaling the loss and unscaling G and the gradients is
    exact: factors and parameters equal the unscaled float32 run bit for bit."""

    def run(mode: str) -> tuple[KFACPreconditioner, nn.Module]:
        net = amp_model()
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        scaler: Any = None
        if mode == "scaler":
            scaler = torch.amp.GradScaler("cpu")
        elif mode == "callable":
            scaler = lambda: 1024.0  # noqa: E731
        pre = KFACPreconditioner(
            net, grad_scaler=scaler, settings=kf.Settings(scaling=scaling), damping=0.01
        )
        for x, y in amp_data():
            opt.zero_grad()
            loss = xent(net(x), y)
            if mode == "scaler":
                scaler.scale(loss).backward()
                scaler.unscale_(opt)
                pre.step()
                scaler.step(opt)
                scaler.update()
            elif mode == "callable":
                (loss * 1024.0).backward()
                for p in net.parameters():
                    p.grad /= 1024.0
                pre.step()
                opt.step()
            else:
                loss.backward()
                pre.step()
                opt.step()
        return pre, net

    plain_pre, plain_net = run("plain")
    for mode in ("scaler", "callable"):
        pre, net = run(mode)
        for name, ls in pre.state.layers.items():
            assert ls.g_factor.dtype == torch.float32
            assert torch.equal(ls.a_factor, plain_pre.state.layers[name].a_factor), (mode, name)
            assert torch.equal(ls.g_factor, plain_pre.state.layers[name].g_factor), (mode, name)
        for (name, p), q in zip(net.named_parameters(), plain_net.parameters()):
            assert torch.equal(p, q), (mode, name)


# bf16 keeps 8 significant bits: unit roundoff u = 2**-8 ~ 3.9e-3. Activations after one
# bf16 layer carry errors of a few u per element; a factor is a sum of products of two such
# values, whose independent rounding errors partly average out in the sum. Measured
# relative Frobenius errors are 1e-3 to 1e-2 after 3 layers, so 5u ~ 2e-2 is the bound.
BF16_RTOL = 5 * 2.0**-8


def test_bf16_autocast_factors_close_to_float32(device: torch.device) -> None:
    """Same parameters and batches (no optimizer step), factors compared every step."""
    net32, net16 = amp_model().to(device), amp_model().to(device)
    kw: dict[str, Any] = dict(scaling="fisher", factor_decay=0.5, damping=0.01)
    kw = with_settings(**kw)
    pre32, pre16 = KFACPreconditioner(net32, **kw), KFACPreconditioner(net16, **kw)
    assert pre16.factor_dtype == torch.float32
    for step, (x, y) in enumerate(amp_data()):
        x, y = x.to(device), y.to(device)
        xent(net32(x), y).backward()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            out = net16(x)
            loss = xent(out, y)
        assert out.dtype == torch.bfloat16
        loss.backward()
        pre32.step()
        pre16.step()
        for name in pre32.layers:
            l32, l16 = pre32.state.layers[name], pre16.state.layers[name]
            for attr in ("a_factor", "g_factor"):
                f32, f16 = getattr(l32, attr), getattr(l16, attr)
                # factors accumulate in factor_dtype whatever the forward ran in
                assert f16.dtype == torch.float32, (step, name, attr, f16.dtype)
                assert bool(torch.isfinite(f16).all())
                rel = float((f16.double() - f32.double()).norm() / f32.double().norm())
                assert rel < BF16_RTOL, (step, name, attr, rel)
        # the first layer's input is the float32 batch, untouched by autocast: its A factor
        # is computed in float32 from the same numbers, so it is exact
        assert torch.equal(pre16.state.layers["0"].a_factor, pre32.state.layers["0"].a_factor)
        for net in (net32, net16):
            net.zero_grad()


class Overflow(torch.autograd.Function):
    """Identity whose backward overflows (as a too-large loss scale does)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * 2.0**127 * 2.0**127


class Boom(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return Overflow.apply(x) if self.armed else x


def test_overflow_step_skips_affected_layers_and_optimizer_step() -> None:
    torch.manual_seed(0)
    boom = Boom()
    net = nn.Sequential(
        nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 8), boom, nn.ReLU(), nn.Linear(8, 3)
    )
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    pre = KFACPreconditioner(net, grad_scaler=scaler, damping=0.01)
    g = torch.Generator().manual_seed(2)

    def step(armed: bool) -> None:
        boom.armed = armed
        x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
        opt.zero_grad()
        scaler.scale(xent(net(x), y)).backward()
        scaler.unscale_(opt)
        pre.step()
        scaler.step(opt)
        scaler.update()

    step(False)
    before = {n: (ls.a_factor.clone(), ls.g_factor.clone()) for n, ls in pre.state.layers.items()}
    params = [p.detach().clone() for p in net.parameters()]
    with pytest.warns(RuntimeWarning, match="non-finite") as record:
        step(True)
    messages = " ".join(str(w.message) for w in record)
    assert "layer '0'" in messages and "layer '2'" in messages and "layer '5'" not in messages
    # layers 0 and 2 saw the overflowed output-gradients: their update is skipped
    for name in ("0", "2"):
        ls = pre.state.layers[name]
        assert (ls.factor_updates, ls.skipped_updates) == (1, 1), name
        assert torch.equal(ls.a_factor, before[name][0])
        assert torch.equal(ls.g_factor, before[name][1])
    # layer 5 (after the overflow) is unaffected
    ls = pre.state.layers["5"]
    assert (ls.factor_updates, ls.skipped_updates) == (2, 0)
    assert not torch.equal(ls.a_factor, before["5"][0])
    # GradScaler found the infs, skipped the optimizer step and backed off
    assert all(torch.equal(p, q) for p, q in zip(net.parameters(), params))
    assert scaler.get_scale() == 2.0**15

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step(False)
    assert [ls.factor_updates for ls in pre.state.layers.values()] == [2, 2, 3]
    assert not all(torch.equal(p, q) for p, q in zip(net.parameters(), params))
    assert all(bool(torch.isfinite(p).all()) for p in net.parameters())


# --------------------------------------------------------------------------- checkpoints

HYPER_KEYS = {"factor_update_steps", "inv_update_steps", "damping", "factor_decay", "kl_clip", "lr"}


def test_state_dict_shape() -> None:
    net = cnn()
    pre = KFACPreconditioner(net, factor_update_steps=2, damping=lambda s: 0.01, kl_clip=None)
    for x, y in batches("cnn", 4, steps=3):
        adapter_grads(pre, net, x, y)
    sd = pre.state_dict(include_factors=False)
    # callables are not saved; "settings" says what the factors mean, "constructed" the
    # hyperparameters as built
    assert set(sd) == {"steps", "settings", "constructed"} | HYPER_KEYS - {"damping"}
    assert sd["steps"] == 3 and sd["kl_clip"] is None and sd["factor_update_steps"] == 2
    sd = pre.state_dict()
    # "checksums": a digest of each tensor, checked by load_state_dict
    keys = {"steps", "settings", "constructed", "layers", "checksums"}
    assert set(sd) == keys | HYPER_KEYS - {"damping"}
    assert list(sd["layers"]) == list(pre.layers)
    for name, entry in sd["layers"].items():
        a_shape, g_shape = pre.layers[name].factor_shapes
        assert tuple(entry["A"].shape) == a_shape and tuple(entry["G"].shape) == g_shape
        assert entry["A"].dtype == pre.factor_dtype
    # the grouped convolution stacks one (A, G) pair per group
    assert sd["layers"]["3"]["A"].shape == (3, 2 * 9 + 1, 2 * 9 + 1)
    # kfac-pytorch users save it with torch.save and load it with weights_only=True
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=True)
    assert torch.equal(back["layers"]["0"]["A"], sd["layers"]["0"]["A"])


def make_trainer(
    make: Callable[[], nn.Module], **kw: Any
) -> tuple[nn.Module, torch.optim.Optimizer, KFACPreconditioner]:
    net = make()
    opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9)
    pre = KFACPreconditioner(
        net,
        factor_update_steps=2,
        inv_update_steps=3,
        factor_dtype=F64,
        inv_dtype=F64,
        **with_settings(**kw),
    )
    return net, opt, pre


def train(
    trainer: tuple[nn.Module, torch.optim.Optimizer, KFACPreconditioner], data: list[Batch]
) -> Iterator[dict[str, torch.Tensor]]:
    net, opt, pre = trainer
    for x, y in data:
        opt.zero_grad()
        xent(net(x), y).backward()
        pre.step()
        yield {n: p.grad.detach().clone() for n, p in net.named_parameters()}
        opt.step()


def fresh_cnn() -> nn.Module:
    """Other weights: everything the resumed run uses comes from the checkpoint."""
    net = cnn()
    with torch.no_grad():
        for p in net.parameters():
            p.add_(1.0)
    return net


@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.parametrize(("method", "outer"), METHODS)
def test_resume_from_state_dict_is_bit_exact(scaling: str, method: str, outer: bool) -> None:
    kw: dict[str, Any] = dict(
        scaling=scaling, compute_method=method, compute_eigenvalue_outer_product=outer, **HYPER
    )
    data = batches("cnn", 4, steps=8)
    full = list(train(make_trainer(cnn, **kw), data))
    # 3: an inverse step; 4: factor but no inverse update; 5: neither
    for k in (3, 4, 5):
        net, opt, pre = trainer = make_trainer(cnn, **kw)
        list(train(trainer, data[:k]))
        buf = io.BytesIO()
        torch.save(
            {
                "model": net.state_dict(),
                "optimizer": opt.state_dict(),
                "preconditioner": pre.state_dict(),
            },
            buf,
        )
        buf.seek(0)
        ckpt = torch.load(buf, weights_only=True)
        net2, opt2, pre2 = resumed = make_trainer(fresh_cnn, **kw)
        net2.load_state_dict(ckpt["model"])
        opt2.load_state_dict(ckpt["optimizer"])
        pre2.load_state_dict(ckpt["preconditioner"])
        assert pre2.steps == k
        assert_states_equal(pre2.state, pre.state)
        for i, got in enumerate(train(resumed, data[k:]), start=k):
            for name in got:
                assert torch.equal(got[name], full[i][name]), (k, i, name)


def test_load_kfac_pytorch_style_state_dict_recomputes_decompositions() -> None:
    """A state dict holding only A and G (as kfac-pytorch writes) loads; decompositions
    are recomputed from the factors with the current damping."""
    trainer = make_trainer(cnn, scaling="fisher")
    pre = trainer[2]
    list(train(trainer, batches("cnn", 4, steps=3)))
    sd = pre.state_dict()
    sd["layers"] = {n: {"A": e["A"], "G": e["G"]} for n, e in sd["layers"].items()}
    _, _, pre2 = make_trainer(fresh_cnn, scaling="fisher")
    pre2.load_state_dict(sd)
    for name, ls in pre2.state.layers.items():
        assert ls.factor_updates == 1  # a fisher average does not restart
        assert torch.equal(ls.a_factor, pre.state.layers[name].a_factor)
        want = kf.decompose(pre.state, damping=pre.damping).layers[name].decomposition
        assert ls.decomposition is not None and want is not None
        for k, v in vars(ls.decomposition).items():
            w = getattr(want, k)
            assert (v is None and w is None) or torch.equal(v, w), (name, k)
    _, _, pre3 = make_trainer(fresh_cnn, scaling="fisher")
    pre3.load_state_dict(sd, compute_inverses=False)
    assert all(ls.decomposition is None for ls in pre3.state.layers.values())


def test_load_state_dict_rejects_other_layers() -> None:
    _, _, pre = make_trainer(cnn)
    sd = pre.state_dict()
    sd["layers"]["bogus"] = sd["layers"].pop("6")
    with pytest.raises(ValueError, match=r"missing \['6'\], unknown \['bogus'\]"):
        pre.load_state_dict(sd)
    sd = pre.state_dict()
    sd["layers"]["6"]["A"] = torch.zeros(3, 3, dtype=F64)
    with pytest.raises(ValueError, match=r"layer '6': state_dict factors have shapes \(3, 3\)"):
        pre.load_state_dict(sd)
    # hyperparameters (without layers) always load
    pre.load_state_dict({"steps": 4, "damping": 0.5})
    assert (pre.steps, pre.damping) == (4, 0.5)


def test_failed_load_state_dict_changes_nothing() -> None:
    """A refused state dict leaves the preconditioner as it was (hyperparameters too)."""
    _, _, pre = make_trainer(cnn, damping=0.1)
    sd = pre.state_dict()
    sd.update(damping=0.7, lr=0.3, steps=9)
    sd["layers"]["bogus"] = sd["layers"].pop("6")
    with pytest.raises(ValueError, match="unknown"):
        pre.load_state_dict(sd)
    assert (pre.damping, pre.lr, pre.steps) == (0.1, LR, 0)
    sd = pre.state_dict()
    sd.update(damping=0.7, steps=9)
    sd["layers"]["6"]["G"] = torch.zeros(2, 2, dtype=F64)
    with pytest.raises(ValueError, match="layer '6'"):
        pre.load_state_dict(sd)
    assert (pre.damping, pre.steps) == (0.1, 0)
    # a factor holding NaN is refused too: a NaN never enters the factors
    before = {n: ls.a_factor.clone() for n, ls in pre.state.layers.items()}
    sd = pre.state_dict()
    sd.update(damping=0.7)
    sd["layers"]["6"]["A"] = sd["layers"]["6"]["A"].clone()
    sd["layers"]["6"]["A"][0, 0] = float("nan")
    with pytest.raises(ValueError, match="layer '6': state_dict factor A holds NaN/Inf"):
        pre.load_state_dict(sd)
    assert pre.damping == 0.1
    assert all(torch.equal(ls.a_factor, before[n]) for n, ls in pre.state.layers.items())


def test_state_pytree_save_load_and_assign(tmp_path: Any) -> None:
    data = batches("cnn", 4, steps=7)
    kw: dict[str, Any] = dict(scaling="fisher", **HYPER)
    full = list(train(make_trainer(cnn, **kw), data))
    net, opt, pre = trainer = make_trainer(cnn, **kw)
    list(train(trainer, data[:4]))
    path = tmp_path / "kfac.safetensors"
    kf.save_state(pre.state, path, include_decompositions=True)
    net2, opt2, pre2 = resumed = make_trainer(fresh_cnn, **kw)
    net2.load_state_dict(net.state_dict())
    opt2.load_state_dict(opt.state_dict())
    pre2.state = kf.load_state(path, like=pre2.state)
    assert pre2.steps == 4
    assert_states_equal(pre2.state, pre.state)
    for i, got in enumerate(train(resumed, data[4:]), start=4):
        assert all(torch.equal(got[n], full[i][n]) for n in got), i
    with pytest.raises(ValueError, match="state layers"):
        pre2.state = kf.init(kf.register(small()))


# --------------------------------------------------------------------------- scheduler


def test_lambda_param_scheduler_multiplies() -> None:
    pre = KFACPreconditioner(
        small(), damping=0.1, lr=0.2, factor_decay=0.9, kl_clip=1e-3, inv_update_steps=10
    )
    sched = LambdaParamScheduler(
        pre,
        damping_lambda=lambda s: 0.5,
        lr_lambda=lambda s: 2.0,
        factor_decay_lambda=lambda s: 1.0,
        kl_clip_lambda=lambda s: 10.0,
        inv_update_steps_lambda=lambda s: 1.5,
    )
    sched.step()
    assert pre.damping == pytest.approx(0.05)
    assert pre.lr == pytest.approx(0.4)
    assert pre.factor_decay == pytest.approx(0.9)
    assert pre.kl_clip == pytest.approx(1e-2)
    assert pre.inv_update_steps == 15 and isinstance(pre.inv_update_steps, int)
    sched.step()
    assert pre.damping == pytest.approx(0.025)
    assert pre.inv_update_steps == 22
    assert pre.factor_update_steps == 1  # not scheduled
    # the new values are what the next step uses, and what state_dict saves
    assert pre.state_dict(include_factors=False)["damping"] == pytest.approx(0.025)


def test_lambda_param_scheduler_int_steps_stay_at_least_one() -> None:
    pre = KFACPreconditioner(small(), factor_update_steps=3)
    sched = LambdaParamScheduler(pre, factor_update_steps_lambda=lambda s: 0.5)
    # 3 → 1, then 0.5 kept at 1 (with a warning, once)
    with pytest.warns(UserWarning, match="factor_update_steps is kept at 1"):
        for expected in (1, 1, 1):
            sched.step()
            assert pre.factor_update_steps == expected
            assert type(pre.factor_update_steps) is int


def test_lambda_param_scheduler_step_argument() -> None:
    net = mlp()
    pre = KFACPreconditioner(net, damping=1.0)
    seen: list[int] = []

    def lam(s: int) -> float:
        seen.append(s)
        return 0.5

    sched = LambdaParamScheduler(pre, damping_lambda=lam)
    sched.step()  # default: the preconditioner's step count
    x, y = one_batch()
    adapter_grads(pre, net, x, y)
    adapter_grads(pre, net, x, y)
    sched.step()
    sched.step(step=17)
    assert seen == [0, 2, 17]
    assert pre.damping == pytest.approx(0.125)


def test_lambda_param_scheduler_refuses_callables_and_none() -> None:
    pre = KFACPreconditioner(small(), damping=lambda s: 0.1, kl_clip=None)
    with pytest.raises(ValueError, match=r"preconditioner.damping is already a callable"):
        LambdaParamScheduler(pre, damping_lambda=lambda s: 0.5)
    with pytest.raises(ValueError, match=r"preconditioner.kl_clip is None"):
        LambdaParamScheduler(pre, kl_clip_lambda=lambda s: 0.5)
    LambdaParamScheduler(pre, lr_lambda=lambda s: 0.5)  # others are fine


# --------------------------------------------------------------------------- housekeeping


def test_memory_usage() -> None:
    net = cnn()
    pre = KFACPreconditioner(net, factor_dtype=F64, inv_dtype=F64)
    keys = {"a_factors", "g_factors", "decompositions", "moments", "powers", "hook_buffers"}
    keys.add("total")

    def check() -> dict[str, int]:
        usage = pre.memory_usage()
        assert set(usage) == keys
        assert all(isinstance(v, int) and v >= 0 for v in usage.values())
        assert usage["total"] == sum(v for k, v in usage.items() if k != "total")
        return usage

    start = check()
    a_elems = sum(int(torch.Size(s.factor_shapes[0]).numel()) for s in pre.layers.values())
    assert start["a_factors"] == 8 * a_elems
    assert start["decompositions"] == 0 and start["hook_buffers"] == 0
    x, y = batches("cnn", 4, steps=1)[0]
    xent(net(x), y).backward()
    pending = check()
    assert pending["hook_buffers"] > 0
    pre.step()
    after = check()
    assert after["hook_buffers"] == 0 and after["decompositions"] > 0
    assert after["total"] > start["total"]


def test_repr_lists_hyperparameters() -> None:
    pre = KFACPreconditioner(
        small(), damping=0.02, factor_update_steps=5, inv_update_steps=50, kl_clip=None
    )
    text = repr(pre)
    for part in (
        "KFACPreconditioner(2 layers",
        "factor_update_steps=5",
        "inv_update_steps=50",
        "damping=0.02",
        "factor_decay=0.95",
        "kl_clip=None",
        "lr=0.1",
        "accumulation_steps=1",
        "compute_method=eigen",
        "distributed_strategy=COMM_OPT",
        "scaling='kfac-pytorch'",
    ):
        assert part in text, (part, text)
