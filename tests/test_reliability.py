"""Reliability: resources stay flat, faults stay contained, random inputs stay finite.

A second-order optimizer must neither leak over a long run nor let one bad value corrupt
its state. This module injects each fault below and checks what must happen.

Resources (part a):

=================================  ======  ==========================================
fault / condition                  cases   what must happen
=================================  ======  ==========================================
2,000 steps, adapter               1       RSS growth after a 200-step warm-up < 2 MiB
2,000 steps, capture + update      1       same (each run in a fresh subprocess)
``remove()``                       1       no module, parameter or output-tensor hook
                                           is left; forward/backward/optimizer step
                                           work, give plain autograd gradients and
                                           leave the preconditioner's state alone
garbage collection                 3       the preconditioner is collected after
                                           ``remove()``, without it (its hooks hold it
                                           weakly and detach), and with its model
=================================  ======  ==========================================

The RSS bound: one step's captures of the 32-64-10 MLP on a batch of 32 are 21,760 bytes
(inputs and output-gradients of both layers, float32); leaking them on each of the 1,800
measured steps would add 37 MiB, about 19 times the bound. A plain SGD loop of the same
model drifts by about 80 KiB over those steps (allocator noise); the K-FAC runs grow by
0.1 to 0.4 MiB, so 2 MiB leaves room for noise and still catches any per-step leak of
more than about 1 KiB.

Non-finite values (part b), the model ``Linear 0 → Sanitize → Tanh → Linear 3 → Boom →
ReLU → Linear 6``: ``Sanitize`` zeroes non-finite activations (so a poisoned batch reaches
layer 0 only), ``Boom`` multiplies the gradient flowing back through it. Each case runs
through the adapter and through ``kf.capture`` + ``kf.update``, with and without a
``torch.amp.GradScaler`` (tests/test_update.py already poisons captures directly and
checks non-finite gradients of the functional path without a scaler; those are not
repeated):

=============================  ==============  ===========  ============================
fault                          values          layers hit   what must happen
=============================  ==============  ===========  ============================
input batch ``x[0, 0]``        NaN, ±Inf       0            contained, state untouched
output-gradients (Boom)        NaN, Inf        0, 3         contained, state untouched
one gradient entry             NaN, Inf        3            contained; the finite
                                                            captures still update A, G
a factor of the given state    NaN, Inf        3            contained; the running
                                                            factor restarts, finite
GradScaler scale 2**127        12 steps        varies       overflowing steps skip the
                                                            optimizer; no NaN in factors
=============================  ==============  ===========  ============================

"Contained": a warning names exactly the hit layers; every other layer updates its
factors and returns finite preconditioned gradients; a hit layer returns finite
gradients where its raw gradients were finite and passes them unchanged where they were
not; no NaN enters a factor; the GradScaler skips exactly the steps with non-finite
gradients; the next clean step updates every layer again. "State untouched": the hit
layers' factors are bit-identical to before, ``factor_updates`` is unchanged and
``skipped_updates`` grew by one (the hit layers' state after each fault is checked in
36 cases, see ``test_hit_layers_state_after_the_fault``). The 9 faults run on 2 paths ×
2 scaler settings: 36 state cases and 34 "contained" ones (less the 2 that tests/test_update.py
covers).

Random inputs (part c), property tests with hypothesis (tests/test_properties.py checks
the dense formula on tiny float64 layers and finite gradients of depthwise convolutions
with default hyperparameters; these go further):

=================================  ========  ============================================
what is drawn                      examples  what must happen
=================================  ========  ============================================
functional: Linear/Conv2d shapes,  40        every ``update`` returns finite gradients
batch 1-8, float32/float64/bf16,             of unchanged shape and dtype and finite
damping 1e-8..10, methods,                   factors and decompositions, or raises
conventions, factor/inverse                  ``kf.NonFiniteError`` / ``ValueError``
intervals, kl_clip                           with a message
adapter: the same with float32,    30        same for ``pre.step()`` (``.grad``)
float64, bf16 autocast, hook mode
batch 1-2, wide Linear (64-256     25        same, with rank-deficient factors
inputs), damping 1e-8..1e-5                  (``"fisher"`` starts from the batch factor)
damping 0 (allowed: ``>= 0``)      4         same (eigen: zero curvature gets the
                                             pseudo-inverse; inverse of a ~1e-40 factor
                                             overflows float32: no preconditioning)
=================================  ========  ============================================
"""

from __future__ import annotations

import copy
import gc
import json
import math
import os
import subprocess
import sys
import warnings
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import nn

import kfac_func as kf

NAN, INF = float("nan"), float("inf")
CPU = torch.device("cpu")


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """Tiny tensors: intra-op threads only add contention."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def finite(t: torch.Tensor) -> bool:
    return bool(torch.isfinite(t).all())


def state_finite(state: kf.KFACState) -> bool:
    """Every factor and decomposition tensor of every layer is finite."""
    for ls in state.layers.values():
        tensors = [ls.a_factor, ls.g_factor]
        if ls.decomposition is not None:
            tensors += [v for v in vars(ls.decomposition).values() if v is not None]
        if not all(finite(t) for t in tensors):
            return False
    return True


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equal, NaN positions included."""
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())
    )


# =========================================================================== (a) resources

STATM = Path("/proc/self/statm")
BATCH, D_IN, D_HID, D_OUT = 32, 32, 64, 10
STEPS, WARMUP, SAMPLE_EVERY = 2000, 200, 50
# inputs (32 and 64 wide) and output-gradients (64 and 10 wide) of one float32 batch
CAPTURE_BYTES = 4 * BATCH * (D_IN + D_HID + D_HID + D_OUT)
RSS_BOUND = 2 * 2**20


def rss_bytes() -> int:
    """Resident set size of this process (Linux)."""
    return int(STATM.read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def rss_worker(path: str) -> dict[str, Any]:
    """Train the MLP for STEPS steps; RSS after the warm-up and every SAMPLE_EVERY steps."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D_IN, D_HID), nn.ReLU(), nn.Linear(D_HID, D_OUT))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(0)
    xs = torch.randn(16, BATCH, D_IN, generator=g)
    ys = torch.randint(0, D_OUT, (16, BATCH), generator=g)
    pre = None
    state = kf.init(kf.register(model))
    if path == "adapter":
        pre = kf.KFACPreconditioner(model, factor_update_steps=1, inv_update_steps=5, damping=0.01)
    losses, samples, warm = [], [], 0
    for step in range(STEPS):
        x, y = xs[step % 16], ys[step % 16]
        opt.zero_grad()
        if pre is not None:
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            pre.step()
        else:
            params = dict(model.named_parameters())
            loss, grads, caps = kf.capture(model, params, x, lambda o, y=y: F.cross_entropy(o, y))
            grads, state = kf.update(
                state, grads, captures=caps, damping=0.01, update_inverses=step % 5 == 0
            )
            for name, p in params.items():
                p.grad = grads[name]
        opt.step()
        losses.append(float(loss.detach()))
        if step + 1 == WARMUP:
            warm = rss_bytes()
        elif step + 1 > WARMUP and (step + 1) % SAMPLE_EVERY == 0:
            samples.append(rss_bytes())
    final = pre.state if pre is not None else state
    return {
        "warm": warm,
        "samples": samples,
        "first_loss": sum(losses[:16]) / 16,
        "last_loss": sum(losses[-16:]) / 16,
        "factor_updates": [ls.factor_updates for ls in final.layers.values()],
    }


@pytest.mark.slow
@pytest.mark.skipif(not STATM.exists(), reason="needs /proc/self/statm (Linux)")
@pytest.mark.parametrize("path", ["adapter", "functional"])
def test_memory_stays_flat_over_2000_steps(path: str) -> None:
    # the bound is far below a leak of one step's captures per measured step
    assert CAPTURE_BYTES * (STEPS - WARMUP) > 10 * RSS_BOUND
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, __file__, "rss", path],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    growth = max(out["samples"]) - out["warm"]
    assert out["factor_updates"] == [STEPS, STEPS]  # K-FAC really ran every step
    assert out["last_loss"] < out["first_loss"]
    assert growth < RSS_BOUND, f"RSS grew by {growth / 2**10:.0f} KiB ({out})"


def small_mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def train_step(model: nn.Module, pre: kf.KFACPreconditioner | None, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(6, 5, generator=g), torch.randint(0, 3, (6,), generator=g)
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    if pre is not None:
        pre.step()


HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def hooks_left(model: nn.Module) -> list[str]:
    """Every module or parameter hook still registered on the model."""
    left = []
    for mname, m in model.named_modules():
        left += [f"{mname}.{d}" for d in HOOK_DICTS if getattr(m, d)]
    for pname, p in model.named_parameters():
        for d in ("_backward_hooks", "_post_accumulate_grad_hooks"):
            if getattr(p, d, None):
                left.append(f"{pname}.{d}")
    return left


def forward_with_spies(
    model: nn.Module, names: list[str], x: torch.Tensor, y: torch.Tensor
) -> tuple[torch.Tensor, list[bool]]:
    """The loss, and whether each named layer's output carries a gradient hook."""
    outputs: list[torch.Tensor] = []
    spies = [
        model.get_submodule(n).register_forward_hook(lambda m, a, o: outputs.append(o))
        for n in names
    ]
    try:
        loss = F.cross_entropy(model(x), y)
    finally:
        for h in spies:
            h.remove()
    assert len(outputs) == len(names)
    return loss, [bool(o._backward_hooks) for o in outputs]


def test_remove_detaches_everything() -> None:
    model = small_mlp()
    pre = kf.KFACPreconditioner(model, damping=0.01)
    names = list(pre.layers)
    assert hooks_left(model)
    train_step(model, pre, 0)
    x, y = torch.randn(6, 5), torch.randint(0, 3, (6,))
    loss, hooked = forward_with_spies(model, names, x, y)
    assert all(hooked)  # the adapter hooks every registered layer's output
    loss.backward()  # statistics collected, then dropped by remove()
    pre.remove()
    assert hooks_left(model) == []
    assert pre.memory_usage()["hook_buffers"] == 0
    state = pre.state
    reference = copy.deepcopy(model)  # no hooks to copy any more

    loss, hooked = forward_with_spies(model, names, x, y)
    assert not any(hooked)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.zero_grad()
    reference.zero_grad(set_to_none=True)
    loss.backward()
    F.cross_entropy(reference(x), y).backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad), name  # plain autograd gradients
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    assert all(not torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert pre.state is state and pre.steps == 1
    assert pre.memory_usage()["hook_buffers"] == 0


def test_preconditioner_is_collected_after_remove() -> None:
    model = small_mlp()
    pre = kf.KFACPreconditioner(model, damping=0.01)
    train_step(model, pre, 0)
    ref = weakref.ref(pre)
    pre.remove()
    del pre
    gc.collect()
    assert ref() is None
    train_step(model, None, 1)  # the model trains on without it


def test_preconditioner_is_collected_without_remove() -> None:
    model = small_mlp()
    pre = kf.KFACPreconditioner(model, damping=0.01)
    train_step(model, pre, 0)
    ref = weakref.ref(pre)
    del pre
    gc.collect()
    assert ref() is None


def test_model_and_preconditioner_are_collected_together() -> None:
    model = small_mlp()
    pre = kf.KFACPreconditioner(model, damping=0.01)
    train_step(model, pre, 0)
    refs = [weakref.ref(model), weakref.ref(pre)]
    del model, pre
    gc.collect()
    assert [r() for r in refs] == [None, None]


# =========================================================================== (b) non-finite


class Sanitize(nn.Module):
    """Zeroes non-finite activations (and the gradient flowing to them)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.where(torch.isfinite(x), x, torch.zeros_like(x))


class _Times(torch.autograd.Function):
    """Identity whose backward multiplies the gradient by ``factor`` (works under
    torch.func: forward and setup_context are separate)."""

    @staticmethod
    def forward(x: torch.Tensor, factor: float) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.factor = inputs[1]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.factor, None


class Boom(nn.Module):
    """Identity; when armed with ``value``, its backward multiplies the gradient by NaN,
    or overflows it to Inf (times 2**254) for an infinite ``value``."""

    def __init__(self) -> None:
        super().__init__()
        self.value: float | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.value is None:
            return x
        factor = 2.0**127 * 2.0**127 if math.isinf(self.value) else self.value
        return _Times.apply(x, factor)


LAYERS = ("0", "3", "6")
HIT = {"input": ("0",), "output_grad": ("0", "3"), "grad": ("3",), "factor": ("3",)}
HYPER: dict[str, Any] = dict(damping=0.01, factor_decay=0.9, kl_clip=1e-2, lr=0.1)


def fault_net(scale_head: bool = False, device: torch.device = CPU) -> nn.Sequential:
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Linear(6, 10),
        Sanitize(),
        nn.Tanh(),
        nn.Linear(10, 8),
        Boom(),
        nn.ReLU(),
        nn.Linear(8, 3),
    )
    if scale_head:  # large weights: output-gradients overflow at large loss scales
        with torch.no_grad():
            net[6].weight.mul_(8.0)
            net[3].weight.mul_(4.0)
    return net.to(device)


def fault_batches(
    n: int, steps: int, seed: int = 3, device: torch.device = CPU
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(n, 6, generator=g).to(device),
            torch.randint(0, 3, (n,), generator=g).to(device),
        )
        for _ in range(steps)
    ]


def unscale_captures(caps: kf.Captures, scale: float) -> kf.Captures:
    """The captures of the unscaled loss (as the adapter does with ``grad_scaler``)."""
    if scale == 1.0:
        return caps
    layers = {
        name: kf.captures.LayerCapture(lc.inputs, tuple(g / scale for g in lc.output_grads))
        for name, lc in caps.layers.items()
    }
    return kf.Captures(layers, caps.batch_size, caps.loss_scale)


class Trainer:
    """One training loop through the adapter or through capture + update, with or without
    a GradScaler (without one, the loop skips optimizer steps on non-finite gradients
    itself); ``step`` returns the gradients before and after K-FAC."""

    def __init__(
        self,
        path: str,
        net: nn.Module,
        scaler: torch.amp.GradScaler | None,
        reduction: str = "mean",
    ) -> None:
        self.path, self.net, self.scaler, self.reduction = path, net, scaler, reduction
        self.opt = torch.optim.SGD(net.parameters(), lr=0.1)
        if path == "adapter":
            self.pre = kf.KFACPreconditioner(
                net, grad_scaler=scaler, settings=kf.Settings(loss_reduction=reduction), **HYPER
            )
            self._state = self.pre.state
        else:
            device = next(net.parameters()).device
            self._state = kf.init(kf.register(net), convention="kfac-pytorch", device=device)

    @property
    def state(self) -> kf.KFACState:
        return self.pre.state if self.path == "adapter" else self._state

    @state.setter
    def state(self, value: kf.KFACState) -> None:
        if self.path == "adapter":
            self.pre.state = value
        else:
            self._state = value

    def loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out, y, reduction=self.reduction)

    def step(
        self, x: torch.Tensor, y: torch.Tensor, bad_grad: float | None = None
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        scale = float(self.scaler.get_scale()) if self.scaler is not None else 1.0
        params = dict(self.net.named_parameters())
        self.opt.zero_grad(set_to_none=True)
        caps = None
        if self.path == "adapter":
            loss = self.loss(self.net(x), y)
            (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
        else:

            def loss_fn(out: torch.Tensor) -> torch.Tensor:
                loss = self.loss(out, y)
                return self.scaler.scale(loss) if self.scaler is not None else loss

            _, grads, caps = kf.capture(
                self.net,
                params,
                x,
                loss_fn,
                loss_reduction=self.reduction,  # type: ignore[arg-type]
            )
            caps = unscale_captures(caps, scale)
            for name, p in params.items():
                p.grad = grads[name].detach().clone()
        if bad_grad is not None:
            params["3.weight"].grad[0, 0] = bad_grad
        if self.scaler is not None:
            self.scaler.unscale_(self.opt)
        raw = {n: p.grad.detach().clone() for n, p in params.items()}
        if self.path == "adapter":
            self.pre.step()
        else:
            grads = {n: p.grad for n, p in params.items()}
            out, self._state = kf.update(self._state, grads, captures=caps, **HYPER)
            for name, p in params.items():
                p.grad = out[name]
        new = {n: p.grad.detach().clone() for n, p in params.items()}
        if self.scaler is not None:
            self.scaler.step(self.opt)
            self.scaler.update()
        elif all(finite(g) for g in new.values()):  # without a scaler, the loop's own guard
            self.opt.step()
        return raw, new


def poison_factor(state: kf.KFACState, name: str, value: float) -> kf.KFACState:
    ls = state.layers[name]
    a = ls.a_factor.clone()
    a[0, 0] = value
    return state.replace(layers={**state.layers, name: ls.replace(a_factor=a)})


def layer_snapshot(ls: kf.state.LayerState) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    return ls.a_factor.clone(), ls.g_factor.clone(), ls.factor_updates, ls.skipped_updates


FAULTS = [
    ("input", NAN),
    ("input", INF),
    ("input", -INF),
    ("output_grad", NAN),
    ("output_grad", INF),
    ("grad", NAN),
    ("grad", INF),
    ("factor", NAN),
    ("factor", INF),
]


def run_fault(
    path: str, scaler: bool, kind: str, value: float, device: torch.device = CPU
) -> tuple[Trainer, dict[str, Any], list[str], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One clean step, then the faulty one. Returns the trainer, the layers before the
    fault, the RuntimeWarning messages and the gradients before/after K-FAC."""
    sc = torch.amp.GradScaler(device.type, init_scale=2.0**16) if scaler else None
    t = Trainer(path, fault_net(device=device), sc)
    (x0, y0), (x, y) = fault_batches(8, 2, device=device)
    t.step(x0, y0)  # every layer has factors and a decomposition now
    if kind == "factor":
        t.state = poison_factor(t.state, "3", value)
    before = {n: layer_snapshot(ls) for n, ls in t.state.layers.items()}
    if kind == "input":
        x = x.clone()
        x[0, 0] = value
    if kind == "output_grad":
        t.net[4].value = value
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        raw, new = t.step(x, y, bad_grad=value if kind == "grad" else None)
    t.net[4].value = None
    messages = [str(w.message) for w in record if issubclass(w.category, RuntimeWarning)]
    return t, before, messages, raw, new


def case_id(path: str, scaler: bool, kind: str, value: float) -> str:
    return f"{path}-{'scaler' if scaler else 'plain'}-{kind}-{value}"


def contained_cases() -> list[Any]:
    return [
        pytest.param(path, scaler, kind, value, id=case_id(path, scaler, kind, value))
        for path in ("adapter", "functional")
        for scaler in (False, True)
        for kind, value in FAULTS
        # the functional path without a scaler is covered by tests/test_update.py
        if not (path == "functional" and not scaler and kind == "grad")
    ]


@pytest.mark.parametrize(("path", "scaler", "kind", "value"), contained_cases())
def test_fault_is_contained(
    path: str, scaler: bool, kind: str, value: float, device: torch.device
) -> None:
    t, before, messages, raw, new = run_fault(path, scaler, kind, value, device)
    hit = HIT[kind]
    for name in LAYERS:
        named = any(f"layer {name!r}" in m for m in messages)
        assert named == (name in hit), (name, messages)
    state = t.state
    for name in LAYERS:
        ls = state.layers[name]
        if name not in hit:  # the other layers proceed
            assert ls.factor_updates == before[name][2] + 1, name
            assert not torch.equal(ls.a_factor, before[name][0]), name
            assert not torch.equal(new[f"{name}.weight"], raw[f"{name}.weight"]), name
        for pname in ls.spec.param_names():
            if finite(raw[pname]):
                assert finite(new[pname]), pname
            else:  # passed through unchanged, never turned into something else
                assert same(new[pname], raw[pname]), pname
    poisoned = {"3"} if kind == "factor" else set()
    assert state_finite(
        state.replace(layers={n: ls for n, ls in state.layers.items() if n not in poisoned})
    )
    if scaler:
        overflow = not all(finite(g) for g in raw.values())
        assert (t.scaler.get_scale() < 2.0**16) == overflow  # the scaler skipped the step

    # the next clean step updates every layer again (a poisoned factor stays poisoned)
    counts = {n: ls.factor_updates for n, ls in state.layers.items()}
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        raw, new = t.step(*fault_batches(8, 1, seed=9, device=device)[0])
    assert all(finite(g) for g in new.values())
    for name, ls in t.state.layers.items():
        if name not in poisoned:
            assert ls.factor_updates == counts[name] + 1, name


def hit_cases() -> list[Any]:
    return [
        pytest.param(path, scaler, kind, value, id=case_id(path, scaler, kind, value))
        for path in ("adapter", "functional")
        for scaler in (False, True)
        for kind, value in FAULTS
    ]


@pytest.mark.parametrize(("path", "scaler", "kind", "value"), hit_cases())
def test_hit_layers_state_after_the_fault(
    path: str, scaler: bool, kind: str, value: float, device: torch.device
) -> None:
    """Poisoned inputs or output-gradients: the hit layers' factors are untouched and the
    update counts as skipped. A poisoned gradient: the captures were finite, so their
    factors are folded in as usual (the gradient itself passes unchanged, see
    test_fault_is_contained). A poisoned running factor: restarted from the batch."""
    t, before, _, _, _ = run_fault(path, scaler, kind, value, device)
    for name in HIT[kind]:
        ls = t.state.layers[name]
        a, g, updates, skipped = before[name]
        if kind in ("input", "output_grad"):
            assert same(ls.a_factor, a) and same(ls.g_factor, g), name
            assert (ls.factor_updates, ls.skipped_updates) == (updates, skipped + 1), name
        else:
            assert finite(ls.a_factor) and finite(ls.g_factor), name
            assert (ls.factor_updates, ls.skipped_updates) == (updates + 1, skipped), name


@pytest.mark.parametrize("path", ["adapter", "functional"])
def test_grad_scaler_overflow_skips_steps_and_keeps_factors_finite(
    path: str, device: torch.device
) -> None:
    """A scale of 2**127 with a summed loss: weight gradients and, on the first steps,
    output-gradients overflow; the scaler backs off and regrows (growth_interval=1)."""
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0**127, growth_interval=1)
    t = Trainer(path, fault_net(scale_head=True, device=device), scaler, reduction="sum")
    overflowed = taken = 0
    for step, (x, y) in enumerate(fault_batches(32, 12, seed=0, device=device)):
        scale = scaler.get_scale()
        params = [p.detach().clone() for p in t.net.parameters()]
        before = {n: layer_snapshot(ls) for n, ls in t.state.layers.items()}
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            raw, _ = t.step(x, y)
        overflow = not all(finite(g) for g in raw.values())
        assert (scaler.get_scale() < scale) == overflow, step
        if overflow:
            overflowed += 1
            assert all(torch.equal(p, q) for p, q in zip(t.net.parameters(), params)), step
        else:
            taken += 1
        assert all(finite(p) for p in t.net.parameters())
        assert state_finite(t.state), step
        for name, ls in t.state.layers.items():
            assert ls.factor_updates + ls.skipped_updates == step + 1, (step, name)
            if ls.skipped_updates > before[name][3]:
                assert same(ls.a_factor, before[name][0]), (step, name)
                assert same(ls.g_factor, before[name][1]), (step, name)
    skipped = sum(ls.skipped_updates for ls in t.state.layers.values())
    # the scenario really exercises both kinds of steps and skipped factor updates
    assert overflowed >= 2 and taken >= 2 and skipped >= 2, (overflowed, taken, skipped)


# =========================================================================== (c) properties

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
dampings = st.floats(-8.0, 1.0).map(lambda e: 10.0**e)


def build(
    kind: str, a: int, b: int, k: int, stride: int, bias: bool, n: int, dtype: torch.dtype
) -> tuple[nn.Module, Callable[[torch.Generator], torch.Tensor]]:
    """A registered layer of the drawn shape, a Tanh and a Linear head (3 classes)."""
    if kind == "linear":
        body: list[nn.Module] = [nn.Linear(a, b, bias=bias)]
        shape: tuple[int, ...] = (n, a)
        features = b
    else:
        c_in, c_out = 1 + a % 4, 1 + b % 6
        body = [nn.Conv2d(c_in, c_out, k, stride, padding=k // 2, bias=bias), nn.Flatten()]
        shape = (n, c_in, 6, 6)
        side = (6 + 2 * (k // 2) - k) // stride + 1
        features = c_out * side * side
    model = nn.Sequential(*body, nn.Tanh(), nn.Linear(features, 3)).to(dtype)
    return model, lambda g: torch.randn(shape, generator=g).to(dtype)


def documented(err: Exception) -> bool:
    return isinstance(err, (kf.NonFiniteError, ValueError)) and bool(str(err))


def functional_run(
    model: nn.Module,
    make_x: Callable[[torch.Generator], torch.Tensor],
    n: int,
    steps: int,
    seed: int,
    init: dict[str, Any],
    update: dict[str, Any],
    factor_every: int,
    inv_every: int,
) -> None:
    """``steps`` updates; each returns finite gradients or raises a documented error."""
    g = torch.Generator().manual_seed(seed)
    state = kf.init(kf.register(model), **init)
    for step in range(steps):
        x, y = make_x(g), torch.randint(0, 3, (n,), generator=g)
        params = dict(model.named_parameters())
        _, grads, caps = kf.capture(model, params, x, lambda o, y=y: F.cross_entropy(o.float(), y))
        assert all(finite(v) for v in grads.values())
        try:
            out, state = kf.update(
                state,
                grads,
                captures=caps,
                update_factors=step % factor_every == 0,
                update_inverses=step % inv_every == 0,
                **update,
            )
        except Exception as err:
            assert documented(err), repr(err)
            return
        for name, v in out.items():
            assert v.shape == grads[name].shape and v.dtype == grads[name].dtype, name
            assert finite(v), (step, name)
        assert state_finite(state), step


@pytest.mark.slow
@settings(max_examples=40, deadline=None, database=None)
@example(
    kind="linear", a=48, b=24, k=1, stride=1, bias=True, n=1, dtype="float32", damping=1e-8,
    method="inverse", outer=False, convention="fisher", factor_every=1, inv_every=1,
    kl_clip=None, seed=0,
)  # fmt: skip
@given(
    kind=st.sampled_from(["linear", "conv"]),
    a=st.integers(1, 48),
    b=st.integers(1, 24),
    k=st.integers(1, 3),
    stride=st.integers(1, 2),
    bias=st.booleans(),
    n=st.integers(1, 8),
    dtype=st.sampled_from(list(DTYPES)),
    damping=dampings,
    method=st.sampled_from(["eigen", "inverse"]),
    outer=st.booleans(),
    convention=st.sampled_from(["fisher", "kfac-pytorch"]),
    factor_every=st.integers(1, 3),
    inv_every=st.integers(1, 3),
    kl_clip=st.sampled_from([None, 1e-3, 10.0]),
    seed=st.integers(0, 2**16),
)
def test_functional_update_is_finite_or_raises_documented_error(
    kind: str,
    a: int,
    b: int,
    k: int,
    stride: int,
    bias: bool,
    n: int,
    dtype: str,
    damping: float,
    method: str,
    outer: bool,
    convention: str,
    factor_every: int,
    inv_every: int,
    kl_clip: float | None,
    seed: int,
) -> None:
    torch.manual_seed(seed)
    model, make_x = build(kind, a, b, k, stride, bias, n, DTYPES[dtype])
    init = dict(
        convention=convention, compute_method=method, compute_eigenvalue_outer_product=outer
    )
    update = dict(damping=damping, kl_clip=kl_clip)
    functional_run(model, make_x, n, 4, seed, init, update, factor_every, inv_every)


@settings(max_examples=25, deadline=None, database=None)
@given(
    n=st.integers(1, 2),
    d_in=st.integers(64, 256),
    d_out=st.integers(8, 64),
    dtype=st.sampled_from(list(DTYPES)),
    damping=st.floats(-8.0, -5.0).map(lambda e: 10.0**e),
    method=st.sampled_from(["eigen", "inverse"]),
    outer=st.booleans(),
    factor_decay=st.sampled_from([0.5, 0.95]),
    kl_clip=st.sampled_from([None, 1e-3]),
    seed=st.integers(0, 2**16),
)
def test_tiny_damping_with_rank_deficient_factors(
    n: int,
    d_in: int,
    d_out: int,
    dtype: str,
    damping: float,
    method: str,
    outer: bool,
    factor_decay: float,
    kl_clip: float | None,
    seed: int,
) -> None:
    """A is (d_in+1)² from n ≤ 2 rows: rank ≤ 2 (≤ 6 after 3 updates) of up to 257."""
    torch.manual_seed(seed)
    model, make_x = build("linear", d_in, d_out, 1, 1, True, n, DTYPES[dtype])
    init = dict(convention="fisher", compute_method=method, compute_eigenvalue_outer_product=outer)
    update = dict(damping=damping, kl_clip=kl_clip, factor_decay=factor_decay)
    functional_run(model, make_x, n, 3, seed, init, update, 1, 1)


@pytest.mark.parametrize(
    ("method", "scale"), [("eigen", 1.0), ("eigen", 1e-20), ("inverse", 1.0), ("inverse", 1e-20)]
)
def test_zero_damping_with_rank_deficient_factors(method: str, scale: float) -> None:
    model, _ = build("linear", 16, 8, 1, 1, True, 1, torch.float32)
    init = dict(convention="fisher", compute_method=method)
    update = dict(damping=0.0, kl_clip=None)
    functional_run(
        model, lambda g: scale * torch.randn(1, 16, generator=g), 1, 2, 0, init, update, 1, 1
    )


@settings(max_examples=30, deadline=None, database=None)
@example(
    kind="linear", a=48, b=24, k=1, stride=1, bias=True, n=1, precision="bf16-autocast",
    damping=1e-8, method="eigen", outer=True, scaling="fisher", factor_every=1, inv_every=1,
    in_hook=True, kl_clip=None, seed=0,
)  # fmt: skip
@given(
    kind=st.sampled_from(["linear", "conv"]),
    a=st.integers(1, 48),
    b=st.integers(1, 24),
    k=st.integers(1, 3),
    stride=st.integers(1, 2),
    bias=st.booleans(),
    n=st.integers(1, 8),
    precision=st.sampled_from(["float32", "float64", "bf16-autocast"]),
    damping=dampings,
    method=st.sampled_from(["eigen", "inverse"]),
    outer=st.booleans(),
    scaling=st.sampled_from(["fisher", "kfac-pytorch"]),
    factor_every=st.integers(1, 3),
    inv_every=st.integers(1, 3),
    in_hook=st.booleans(),
    kl_clip=st.sampled_from([None, 1e-3, 10.0]),
    seed=st.integers(0, 2**16),
)
def test_adapter_step_is_finite_or_raises_documented_error(
    kind: str,
    a: int,
    b: int,
    k: int,
    stride: int,
    bias: bool,
    n: int,
    precision: str,
    damping: float,
    method: str,
    outer: bool,
    scaling: str,
    factor_every: int,
    inv_every: int,
    in_hook: bool,
    kl_clip: float | None,
    seed: int,
) -> None:
    torch.manual_seed(seed)
    dtype = torch.float64 if precision == "float64" else torch.float32
    model, make_x = build(kind, a, b, k, stride, bias, n, dtype)
    pre = kf.KFACPreconditioner(
        model,
        factor_update_steps=factor_every,
        inv_update_steps=inv_every,
        damping=damping,
        kl_clip=kl_clip,
        compute_method=method,
        compute_eigenvalue_outer_product=outer,
        settings=kf.Settings(scaling=scaling),
        update_factors_in_hook=in_hook,
    )
    g = torch.Generator().manual_seed(seed)
    for step in range(4):
        x, y = make_x(g), torch.randint(0, 3, (n,), generator=g)
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", torch.bfloat16, enabled=precision == "bf16-autocast"):
            loss = F.cross_entropy(model(x).float(), y)
        loss.backward()
        raw = {name: p.grad.clone() for name, p in model.named_parameters()}
        assert all(finite(v) for v in raw.values())
        try:
            pre.step()
        except Exception as err:
            assert documented(err), repr(err)
            return
        for name, p in model.named_parameters():
            assert p.grad.dtype == raw[name].dtype, name
            assert finite(p.grad), (step, name)
        assert state_finite(pre.state), step


if __name__ == "__main__":  # the subprocess of test_memory_stays_flat_over_2000_steps
    if len(sys.argv) == 3 and sys.argv[1] == "rss":
        print(json.dumps(rss_worker(sys.argv[2])))
