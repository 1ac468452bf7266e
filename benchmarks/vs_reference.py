"""Step time and peak memory of kfac_func against a re-statement of kfac-pytorch 0.4.2.

Run ``python benchmarks/vs_reference.py`` (a few minutes on a 2-core CPU) or ``--quick``
(tiny models, two repetitions, seconds: a smoke test, not a measurement). ``--out
benchmarks/results/vs_reference.json`` keeps the run (command, commit, machine, every
table); ``--tables`` rewrites the block of ``docs/performance.md`` from that file.

The baseline
------------
:class:`ReferenceKFAC` below re-states kfac-pytorch 0.4.2's single-process step (its
``KFACPreconditioner`` with the default ``update_factors_in_hook=True``) in this file, so the
comparison needs no extra install: a forward hook saves each Linear/Conv2d input and a full
backward hook its ``grad_output``, and both turn them into a covariance at once (``A`` from
input rows with a ones column for the bias, ``G`` from raw output-gradient rows; Conv2d rows
are ``unfold`` patches, and every row is divided by ``out_h * out_w``; ``cov = rowsᵀ rows /
n_rows``, symmetrised). ``step()`` folds them into identity-started running averages
(``factor_decay``) every ``F`` steps, recomputes every ``I`` steps either float32
``torch.linalg.eigh`` (eigenvalues clamped at 0, ``dgda = 1 / (outer(dg, da) + damping)``
precomputed) or the damped inverses ``(G + λI)⁻¹`` and ``(A + λI)⁻¹``, preconditions
``v = qg ((qgᵀ grad qa) ⊙ dgda) qaᵀ`` (or ``G⁻¹ grad A⁻¹``), scales by ``min(1,
sqrt(kl_clip / |lr² Σ v ⊙ grad|))`` and writes the result into ``.grad`` in place.

The variants
------------
- ``sgd``: zero_grad + forward + cross-entropy + backward + ``SGD(lr, momentum=0.9).step()``.
- ``reference`` / ``reference-inv``: the same plus ``ReferenceKFAC.step()`` (eigen / inverse).
- ``adapter`` / ``adapter-inv``: the same plus ``kfac_func.KFACPreconditioner(model,
  factor_update_steps=F, inv_update_steps=I, ...).step()`` (scaling ``"kfac-pytorch"``;
  its default ``grouped``: layer by layer on a CPU).
- ``adapter-unchecked``: ``adapter`` with the finiteness checks of its batch factors and
  decompositions answering "finite" unread while its step runs (``all_finite_together``
  replaced, :func:`unchecked`): what those checks cost. Not a configuration of the
  library, which keeps them (they keep a NaN batch out of the running factors and a failed
  ``eigh`` out of the step); no peak memory is measured for it.
- ``adapter-grouped``: ``adapter`` with ``grouped=True`` (the layers of one shape stacked
  and computed together, the default on accelerators), eigen only.
- ``functional``: ``kf.capture`` + ``kf.update(..., donate=True)`` (state from
  ``kf.init(convention="kfac-pytorch")``, eigen) + writing ``p.grad`` + the same
  ``SGD.step()``.
- ``adapter-qr``: ``adapter`` with ``eigenbasis_refresh="qr"`` (after the first exact
  eigendecomposition, one warm-started QR iteration per refresh); its accuracy is measured
  against ``adapter`` on the same weights (relative error of the preconditioned gradients).
All K-FAC variants get the same damping, factor_decay, kl_clip and lr.

How the time is measured (as ``benchmarks/step_time.py``)
---------------------------------------------------------
Each kind of K-FAC step (factors+decomp, factors only, precondition only) is timed
separately and the amortized step time for intervals ``F/I`` is the weighted mean of the
per-kind medians, weighted by each kind's share of a cycle of ``lcm(F, I)`` steps. The
preconditioners are built with the largest intervals asked for; before each timed step their
step counter is set to the first step of a cycle that has the wanted kind (the adapter
through its public ``state`` setter), so all kinds are timed from one object. Each
repetition times one step of every (variant, kind), each K-FAC step directly preceded by an
SGD step, in an order reversed every other repetition; a fresh random batch is drawn before
the clock starts. Times are medians over the repetitions.

The 1/1 split
-------------
The same timed steps of factors+decomp (every step at 1/1) are also split in two: the
forward and backward passes (``zero_grad`` included, with each side's hooks: the
reference's covariances, the adapter's Gram products) and the preconditioner's
``step()`` (the reference's running averages, ``eigh``/``inv``, preconditioning, kl_clip
and write-back; the adapter's batch factors from its Grams, fold, decomposition and
preconditioning); medians of each part over the repetitions. ``adapter-unchecked``'s step
is reported beside them: the adapter's step less what its finiteness checks cost.

Peak memory
-----------
A fresh subprocess per (model, variant) builds the model and a batch, resets the kernel's
resident-set high-water mark (writing ``5`` to ``/proc/self/clear_refs``), runs a few steps
of the 1/1 schedule (every step updates factors and decompositions) and reports
``step peak`` = ``VmHWM`` after the steps minus ``VmRSS`` before them (what the steps add at
their peak: activations, gradients, factors, decompositions, temporaries), next to
``rss before`` (``VmRSS`` once the model and batch exist). ``resource.getrusage`` is not
used: Linux carries a parent's ``ru_maxrss`` over ``fork`` + ``exec``, so a child of this
(large) benchmark process would report the parent's peak. ``tracemalloc`` is not used: it
does not see tensor storage. ``--quick`` measures only sgd, reference and adapter on the MLP.

Correctness line
----------------
From the same initial model and the same batches, the reference and the adapter
(``scaling="kfac-pytorch"``) each run a few steps with F/I = 1/2; after every step the
preconditioned gradients are compared (max over parameters of ``max|ref - ours| /
max|ref|``) before both take the same SGD step.

No timing is asserted anywhere; the numbers are printed for people to read.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import cProfile
import io
import json
import math
import os
import platform
import pstats
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

HERE = Path(__file__).resolve().parent
try:
    import kfac_func as kf
except ImportError:  # a checkout without `pip install -e .`: use the repository's copy
    sys.path.insert(0, str(HERE.parent))
    import kfac_func as kf

from kfac_func.core import attempts  # noqa: E402  (adapter-unchecked replaces its check)
from kfac_func.step import accumulate  # noqa: E402

sys.path.insert(0, str(HERE))
from stage_arithmetic import bf16_flags  # noqa: E402
from step_time import (  # noqa: E402  (the sibling benchmark's plain helpers)
    KIND_NAMES,
    Kind,
    checked_out,
    cpu_model,
    kind_weights,
    make_cnn,
    make_mlp,
    median_ms,
    parse_intervals,
    print_table,
)

VARIANTS = [
    "sgd",
    "reference",
    "adapter",
    "adapter-unchecked",
    "adapter-grouped",
    "functional",
    "reference-inv",
    "adapter-inv",
    "adapter-qr",
]


# --------------------------------------------------------------------------- the reference


def _cov(rows: torch.Tensor) -> torch.Tensor:
    cov = rows.t() @ (rows / rows.shape[0])
    return (cov + cov.t()) / 2


class _RefLayer:
    """One Linear/Conv2d layer's kfac-pytorch 0.4.2 state and math."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.conv = isinstance(module, nn.Conv2d)
        self.bias = module.bias is not None
        self.a_batch: torch.Tensor | None = None
        self.g_batch: torch.Tensor | None = None
        self.a_count = 0
        self.g_count = 0
        self.a_factor: torch.Tensor | None = None
        self.g_factor: torch.Tensor | None = None
        self.qa = self.qg = self.da = self.dg = self.dgda = None  # eigen
        self.a_inv = self.g_inv = None  # inverse
        self.grad: torch.Tensor | None = None

    # factors
    def a_cov(self, x: torch.Tensor) -> torch.Tensor:
        m = self.module
        if self.conv:
            assert isinstance(m, nn.Conv2d)
            patches = F.unfold(x, m.kernel_size, m.dilation, m.padding, m.stride)  # type: ignore[arg-type]
            spatial = patches.shape[-1]
            rows = patches.transpose(1, 2).reshape(-1, patches.shape[1])
        else:
            spatial = 1
            rows = x.reshape(-1, x.shape[-1])
        if self.bias:
            rows = torch.cat([rows, rows.new_ones(rows.shape[0], 1)], dim=1)
        return _cov(rows / spatial)

    def g_cov(self, g: torch.Tensor) -> torch.Tensor:
        if self.conv:
            spatial = g.shape[2] * g.shape[3]
            rows = g.permute(0, 2, 3, 1).reshape(-1, g.shape[1]) / spatial
        else:
            rows = g.reshape(-1, g.shape[-1])
        return _cov(rows)

    def save_a(self, x: torch.Tensor) -> None:
        a = self.a_cov(x.detach().to(torch.float32))
        self.a_batch = a if self.a_batch is None else self.a_batch + a
        self.a_count += 1

    def save_g(self, g: torch.Tensor) -> None:
        gc = self.g_cov(g.detach().to(torch.float32))
        self.g_batch = gc if self.g_batch is None else self.g_batch + gc
        self.g_count += 1

    def update_factors(self, alpha: float) -> None:
        if self.a_batch is not None:
            a = self.a_batch / self.a_count
            if self.a_factor is None:
                self.a_factor = torch.eye(a.shape[0], dtype=a.dtype)
            self.a_factor = alpha * self.a_factor + (1 - alpha) * a
        if self.g_batch is not None:
            g = self.g_batch / self.g_count
            if self.g_factor is None:
                self.g_factor = torch.eye(g.shape[0], dtype=g.dtype)
            self.g_factor = alpha * self.g_factor + (1 - alpha) * g
        self.a_batch = self.g_batch = None
        self.a_count = self.g_count = 0

    # decompositions
    def compute_eigen(self, damping: float) -> None:
        assert self.a_factor is not None and self.g_factor is not None
        da, qa = torch.linalg.eigh(self.a_factor.to(torch.float32))
        dg, qg = torch.linalg.eigh(self.g_factor.to(torch.float32))
        self.qa, self.qg = qa, qg
        self.da, self.dg = torch.clamp(da, min=0.0), torch.clamp(dg, min=0.0)
        self.dgda = 1.0 / (torch.outer(self.dg, self.da) + damping)

    def compute_inverse(self, damping: float) -> None:
        assert self.a_factor is not None and self.g_factor is not None
        a, g = self.a_factor.to(torch.float32), self.g_factor.to(torch.float32)
        self.a_inv = torch.linalg.inv(a + damping * torch.eye(a.shape[0]))
        self.g_inv = torch.linalg.inv(g + damping * torch.eye(g.shape[0]))

    # gradients
    def grad_matrix(self) -> torch.Tensor:
        m = self.module
        assert m.weight.grad is not None
        g = m.weight.grad.reshape(m.weight.shape[0], -1)
        if self.bias:
            g = torch.cat([g, m.bias.grad.reshape(-1, 1)], dim=1)
        return g

    def precondition(self, inverse: bool) -> None:
        grad = self.grad_matrix()
        dtype = grad.dtype
        grad = grad.to(torch.float32)
        if inverse:
            v = self.g_inv @ grad @ self.a_inv
        else:
            v = self.qg @ ((self.qg.t() @ grad @ self.qa) * self.dgda) @ self.qa.t()
        self.grad = v.to(dtype)

    def write_grad(self, scale: float | None) -> None:
        assert self.grad is not None
        v = self.grad if scale is None else scale * self.grad
        m = self.module
        if self.bias:
            m.weight.grad.copy_(v[:, :-1].reshape(m.weight.shape))
            m.bias.grad.copy_(v[:, -1].reshape(m.bias.shape))
        else:
            m.weight.grad.copy_(v.reshape(m.weight.shape))
        self.grad = None


class ReferenceKFAC:
    """kfac-pytorch 0.4.2's per-step algorithm on one process (see the module docstring)."""

    def __init__(
        self,
        model: nn.Module,
        *,
        factor_update_steps: int,
        inv_update_steps: int,
        damping: float,
        factor_decay: float,
        kl_clip: float | None,
        lr: float,
        compute_method: str = "eigen",
    ) -> None:
        self.model = model
        self.factor_update_steps = factor_update_steps
        self.inv_update_steps = inv_update_steps
        self.damping = damping
        self.factor_decay = factor_decay
        self.kl_clip = kl_clip
        self.lr = lr
        self.inverse = compute_method == "inverse"
        self.steps = 0
        self.layers: dict[str, _RefLayer] = {}
        for name, m in model.named_modules():
            if isinstance(m, (nn.Linear, nn.Conv2d)):
                layer = _RefLayer(m)
                self.layers[name] = layer
                m.register_forward_hook(self._fwd(layer))
                m.register_full_backward_hook(self._bwd(layer))

    def _collect(self, forward: bool) -> bool:
        # the backward pass runs with grad mode off: only the forward hook checks it
        return (
            self.model.training
            and (torch.is_grad_enabled() or not forward)
            and self.steps % self.factor_update_steps == 0
        )

    def _fwd(self, layer: _RefLayer) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], out: Any) -> None:
            if self._collect(forward=True):
                layer.save_a(args[0])

        return hook

    def _bwd(self, layer: _RefLayer) -> Callable[..., None]:
        def hook(module: nn.Module, grad_in: Any, grad_out: tuple[torch.Tensor, ...]) -> None:
            if self._collect(forward=False):
                layer.save_g(grad_out[0])

        return hook

    @torch.no_grad()
    def step(self) -> None:
        layers = list(self.layers.values())[::-1]
        if self.steps % self.factor_update_steps == 0:
            for layer in layers:
                layer.update_factors(self.factor_decay)
        if self.steps % self.inv_update_steps == 0:
            for layer in layers:
                if self.inverse:
                    layer.compute_inverse(self.damping)
                else:
                    layer.compute_eigen(self.damping)
        for layer in layers:
            layer.precondition(self.inverse)
        scale = None
        if self.kl_clip is not None:
            vg = 0.0
            for layer in layers:
                assert layer.grad is not None
                vg += float((layer.grad * layer.grad_matrix() * self.lr**2).sum().item())
            if vg != 0.0:
                scale = min(1.0, math.sqrt(self.kl_clip / abs(vg)))
        for layer in layers:
            layer.write_grad(scale)
        self.steps += 1


# --------------------------------------------------------------------------- the variants


def make_model(name: str, args: argparse.Namespace) -> tuple[nn.Module, tuple[int, ...], int]:
    """The model ``name`` (``mlp``: width ``--width``; ``mlp-N``: width N; ``cnn``), the
    shape of its input batch and its class count."""
    if name.startswith("mlp"):
        width = int(name.removeprefix("mlp-")) if name != "mlp" else args.width
        return make_mlp(width, 10), (args.mlp_batch, width), 10
    return make_cnn(), (args.cnn_batch, 3, 32, 32), 10


def model_name(value: str) -> str:
    """``--models``'s type: ``mlp``, ``mlp-N`` (an MLP of width N) or ``cnn``.

    Example:
        >>> model_name("mlp-512"), model_name("cnn")
        ('mlp-512', 'cnn')
    """
    if value in ("mlp", "cnn") or (value.startswith("mlp-") and value[4:].isdigit()):
        return value
    raise argparse.ArgumentTypeError(f"--models: mlp, mlp-N or cnn, got {value!r}")


class Runner:
    """One variant of one model: a model copy, an SGD optimizer and the K-FAC object."""

    def __init__(
        self, variant: str, base: nn.Module, shape: tuple[int, ...], classes: int, args: Any
    ) -> None:
        self.variant = variant
        self.model = copy.deepcopy(base)
        self.shape, self.classes = shape, classes
        self.opt = torch.optim.SGD(self.model.parameters(), lr=args.lr, momentum=0.9)
        self.f, self.i = args.max_f, args.max_i
        self.cycle = math.lcm(self.f, self.i)
        hyper = dict(damping=args.damping, factor_decay=0.95, kl_clip=1e-3, lr=args.lr)
        self.hyper = hyper
        self.pre: Any = None
        method = "inverse" if variant.endswith("-inv") else "eigen"
        if variant.startswith("reference"):
            self.pre = ReferenceKFAC(
                self.model,
                factor_update_steps=self.f,
                inv_update_steps=self.i,
                compute_method=method,
                **hyper,
            )
        elif variant.startswith("adapter"):
            self.pre = kf.KFACPreconditioner(
                self.model,
                factor_update_steps=self.f,
                inv_update_steps=self.i,
                compute_method=method,
                settings=kf.Settings(
                    scaling="kfac-pytorch",
                    eigenbasis_refresh="qr" if variant == "adapter-qr" else "eigh",
                    grouped=True if variant == "adapter-grouped" else None,
                ),
                **hyper,
            )
        elif variant == "functional":
            self.layers = kf.register(self.model)
            self.state = kf.init(self.layers, convention="kfac-pytorch")
        self.loss = float("nan")
        self.split = (math.nan, math.nan)
        """The last step's seconds in the forward and backward passes (the hooks' statistics
        included) and in the preconditioner's step."""

    def batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(self.shape), torch.randint(0, self.classes, (self.shape[0],))

    def set_kind(self, kind: Kind) -> None:
        """Point the step counter at the first step of a cycle with this kind."""
        s = next(
            s for s in range(self.cycle) if (s % self.f == 0, s % self.i == 0) == kind
        ) + self.cycle * (1 + self._steps() // self.cycle)
        if isinstance(self.pre, ReferenceKFAC):
            self.pre.steps = s
        elif isinstance(self.pre, kf.KFACPreconditioner):
            self.pre.state = self.pre.state.replace(step=s)
        self.kind = kind

    def _steps(self) -> int:
        if isinstance(self.pre, ReferenceKFAC):
            return self.pre.steps
        if isinstance(self.pre, kf.KFACPreconditioner):
            return self.pre.steps
        return 0

    def step(self, x: torch.Tensor, y: torch.Tensor, kind: Kind = (True, True)) -> None:
        if self.variant == "functional":
            params = dict(self.model.named_parameters())
            loss, grads, caps = kf.capture(
                self.model, params, x, lambda out: F.cross_entropy(out, y), layers=self.layers
            )
            grads, self.state = kf.update(
                self.state,
                grads,
                captures=caps,
                update_factors=kind[0],
                update_inverses=kind[1],
                donate=True,  # the state is replaced at once: each layer's old tensors go early
                **self.hyper,
            )
            for name, p in params.items():
                p.grad = grads[name]
        else:
            t0 = time.perf_counter()
            self.opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(self.model(x), y)
            loss.backward()
            t1 = time.perf_counter()
            if self.variant == "adapter-unchecked":
                with unchecked():
                    self.pre.step()
            elif self.pre is not None:
                self.pre.step()
            self.split = (t1 - t0, time.perf_counter() - t1)
        self.opt.step()
        self.loss = float(loss.item())

    def timed(self, kind: Kind) -> float:
        if self.pre is not None:
            self.set_kind(kind)
        x, y = self.batch()
        t0 = time.perf_counter()
        self.step(x, y, kind)
        return time.perf_counter() - t0


@contextlib.contextmanager
def unchecked() -> Iterator[None]:
    """The library's finiteness checks of factors and decompositions answer True, unread,
    inside the block (``adapter-unchecked``)."""
    saved = attempts.all_finite_together
    attempts.all_finite_together = accumulate.all_finite_together = lambda tensors: True
    try:
        yield
    finally:
        attempts.all_finite_together = accumulate.all_finite_together = saved


# --------------------------------------------------------------------------- measurements


def measure(model: str, variants: list[str], kinds: list[Kind], args: Any) -> dict:
    torch.manual_seed(args.seed)
    base, shape, classes = make_model(model, args)
    runners = {v: Runner(v, base, shape, classes, args) for v in variants}
    samples: dict[str, dict[Kind, list[float]]] = {v: {k: [] for k in kinds} for v in variants}
    splits: dict[str, dict[Kind, list[tuple[float, float]]]] = {
        v: {k: [] for k in kinds} for v in variants
    }
    sgd = runners.get("sgd")
    kfac = [v for v in variants if v != "sgd"]
    for r in runners.values():  # warm-up; the first K-FAC step also decomposes
        for _ in range(args.warmup):
            for k in kinds:
                r.timed(k)
    for rep in range(args.reps):
        seq = [(v, k) for v in kfac for k in kinds]
        if rep % 2:
            seq.reverse()
        for v, k in seq:
            if sgd is not None:
                samples["sgd"][kinds[0]].append(sgd.timed(kinds[0]))
            samples[v][k].append(runners[v].timed(k))
            splits[v][k].append(runners[v].split)
        if args.verbose:
            print(f"  {model}: repetition {rep + 1}/{args.reps}", file=sys.stderr, flush=True)
    losses = {v: r.loss for v, r in runners.items()}
    return {"samples": samples, "splits": splits, "losses": losses, "runners": runners}


def split_record(model: str, method: str, splits: dict, suffix: str) -> dict[str, Any]:
    """The medians of the 1/1 step's two parts, forward+backward (with the hooks) and the
    preconditioner's step, of the reference and the adapter."""
    out: dict[str, Any] = {"model": model, "method": method}
    for v in ("reference", "adapter"):
        parts = splits[v + suffix][(True, True)]
        out[f"{v}_fb_ms"] = median_ms([fb for fb, _ in parts])
        out[f"{v}_step_ms"] = median_ms([st for _, st in parts])
    out["fb_adapter_over_reference"] = out["adapter_fb_ms"] / out["reference_fb_ms"]
    out["step_adapter_over_reference"] = out["adapter_step_ms"] / out["reference_step_ms"]
    if not suffix and "adapter-unchecked" in splits:
        parts = splits["adapter-unchecked"][(True, True)]
        out["unchecked_step_ms"] = median_ms([st for _, st in parts])
        out["step_unchecked_over_reference"] = out["unchecked_step_ms"] / out["reference_step_ms"]
    return out


def amortized(samples: dict[Kind, list[float]], iv: tuple[int, int], sgd: bool) -> float:
    if sgd:
        return median_ms([t for ts in samples.values() for t in ts])
    return sum(w * median_ms(samples[k]) for k, w in kind_weights(iv).items())


def _vm_kib(field_name: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field_name + ":"):
            return int(line.split()[1])
    return -1


def memory_child(model: str, variant: str, steps: int, args: Any) -> dict[str, int]:
    torch.manual_seed(args.seed)
    base, shape, classes = make_model(model, args)
    r = Runner(variant, base, shape, classes, args)
    x, y = r.batch()
    rss0 = _vm_kib("VmRSS")
    try:  # reset the high-water mark so import-time peaks do not hide the steps' peak
        Path("/proc/self/clear_refs").write_text("5")
        reset = True
    except OSError:
        reset = False
    for _ in range(steps):
        if r.pre is not None:
            r.set_kind((True, True))
        r.step(x, y, (True, True))
    return {
        "rss0_kib": rss0,
        "hwm_kib": _vm_kib("VmHWM") if reset else -1,
    }


def measure_memory(models: list[str], variants: list[str], args: Any) -> dict:
    jobs = [(m, v) for m in models for v in variants]
    common = [
        f"--width={args.width}",
        f"--mlp-batch={args.mlp_batch}",
        f"--cnn-batch={args.cnn_batch}",
        f"--damping={args.damping}",
        f"--lr={args.lr}",
        f"--threads={args.threads}",
        f"--seed={args.seed}",
    ]
    out: dict[tuple[str, str], dict[str, int]] = {}
    procs: list[tuple[tuple[str, str], subprocess.Popen]] = []
    parallel = max(1, min(args.mem_jobs, len(jobs)))
    pending = list(jobs)
    while pending or procs:
        while pending and len(procs) < parallel:
            m, v = pending.pop(0)
            cmd = [sys.executable, __file__, "--_memory-child", m, v, str(args.mem_steps)]
            cmd += common
            procs.append(((m, v), subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)))
        key, p = procs.pop(0)
        stdout, _ = p.communicate()
        if p.returncode != 0:
            raise RuntimeError(f"memory child {key} failed ({p.returncode})")
        out[key] = json.loads(stdout.strip().splitlines()[-1])
    return out


def check_correctness(args: Any, steps: int = 4) -> dict[str, float]:
    """Max relative difference of preconditioned gradients, reference vs adapter, on the
    same weights every step (the reference's update is applied to both models: left to
    their own updates, the two trajectories can part where a rounding-sized difference
    flips a ReLU, which then changes whole rows of the next gradient)."""
    result = {}
    for model in args.models:
        for method in ("eigen", "inverse") if args.inverse else ("eigen",):
            torch.manual_seed(args.seed)
            base, shape, classes = make_model(model, args)
            ref_m, our_m = copy.deepcopy(base), copy.deepcopy(base)
            hyper = dict(damping=args.damping, factor_decay=0.95, kl_clip=1e-3, lr=args.lr)
            ref = ReferenceKFAC(
                ref_m, factor_update_steps=1, inv_update_steps=2, compute_method=method, **hyper
            )
            ours = kf.KFACPreconditioner(
                our_m,
                factor_update_steps=1,
                inv_update_steps=2,
                compute_method=method,
                settings=kf.Settings(scaling="kfac-pytorch"),
                **hyper,
            )
            opt = torch.optim.SGD(ref_m.parameters(), lr=args.lr, momentum=0.9)
            worst = 0.0
            for _ in range(steps):
                x, y = torch.randn(shape), torch.randint(0, classes, (shape[0],))
                for m, pre in ((ref_m, ref), (our_m, ours)):
                    m.zero_grad(set_to_none=True)
                    F.cross_entropy(m(x), y).backward()
                    pre.step()
                for pr, po in zip(ref_m.parameters(), our_m.parameters(), strict=True):
                    assert pr.grad is not None and po.grad is not None
                    d = (pr.grad - po.grad).abs().max() / pr.grad.abs().max().clamp_min(1e-30)
                    worst = max(worst, float(d))
                opt.step()
                our_m.load_state_dict(ref_m.state_dict())
            result[f"{model} {method}"] = worst
    return result


def check_qr_accuracy(args: Any, steps: int = 12) -> dict[str, tuple[float, float]]:
    """Median and max over ``steps`` steps of 1/1 of ``‖P_qr − P_eigh‖ / ‖P_eigh‖`` for
    the preconditioned gradients of all layers; both preconditioners see the same
    weights and batches (the exact one's update is applied to both models)."""
    result = {}
    for model in args.models:
        torch.manual_seed(args.seed)
        base, shape, classes = make_model(model, args)
        models = [copy.deepcopy(base), copy.deepcopy(base)]
        hyper = dict(damping=args.damping, factor_decay=0.95, kl_clip=1e-3, lr=args.lr)
        pres = [
            kf.KFACPreconditioner(
                m, settings=kf.Settings(scaling="kfac-pytorch", eigenbasis_refresh=r), **hyper
            )
            for m, r in zip(models, ("eigh", "qr"))
        ]
        opt = torch.optim.SGD(models[0].parameters(), lr=args.lr, momentum=0.9)
        errors = []
        for _ in range(steps):
            x, y = torch.randn(shape), torch.randint(0, classes, (shape[0],))
            for m, pre in zip(models, pres):
                m.zero_grad(set_to_none=True)
                F.cross_entropy(m(x), y).backward()
                pre.step()
            exact = torch.cat([p.grad.reshape(-1) for p in models[0].parameters()])
            approx = torch.cat([p.grad.reshape(-1) for p in models[1].parameters()])
            errors.append(float((approx - exact).norm() / exact.norm()))
            opt.step()
            models[1].load_state_dict(models[0].state_dict())
        result[model] = (statistics.median(errors[1:]), max(errors[1:]))
    return result


def profile_adapter(args: Any, steps: int, top: int) -> None:
    """cProfile the adapter on the MLP over one lcm(F, I)-weighted set of steps."""
    torch.manual_seed(args.seed)
    base, shape, classes = make_model("mlp", args)
    r = Runner("adapter", base, shape, classes, args)
    iv = (10, 100) if (10, 100) in args.intervals else args.intervals[0]
    w = kind_weights(iv)
    for k in w:  # warm-up: the kinds of this schedule (the runner's cycle has no others)
        r.timed(k)
    prof = cProfile.Profile()
    for k, share in w.items():
        for _ in range(max(1, round(share * steps))):
            r.set_kind(k)
            x, y = r.batch()
            prof.enable()
            r.step(x, y, k)
            prof.disable()
    print(f"\n--- cProfile: adapter, mlp, {steps} steps in {iv[0]}/{iv[1]} proportions ---")
    for title, order in (("by cumulative time", "cumulative"), ("by own time", "tottime")):
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats(order).print_stats(top)
        keep = [
            ln.rstrip()
            for ln in s.getvalue().splitlines()
            if ln.strip() and not ln.strip().startswith(("Ordered by", "List reduced"))
        ]
        print(f"{title}:")
        print("\n".join(keep))


# --------------------------------------------------------------------------- main


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    pass


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=_HelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke test: tiny models, 2 reps")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    p.add_argument(
        "--models",
        nargs="+",
        type=model_name,
        default=["mlp", "cnn"],
        help="mlp: 4 Linear layers of --width; mlp-N: of width N; cnn: 3 Conv2d + Linear "
        "on 3x32x32 images",
    )
    p.add_argument("--intervals", nargs="+", default=["10/100", "1/1"], help="F/I intervals")
    p.add_argument("--no-inverse", dest="inverse", action="store_false", help="skip -inv variants")
    p.add_argument("--reps", type=int, default=9, help="timed repetitions")
    p.add_argument("--warmup", type=int, default=1, help="warm-up steps of each kind")
    p.add_argument("--width", type=int, default=1024, help="MLP width")
    p.add_argument("--mlp-batch", type=int, default=256, help="MLP batch size (rows)")
    p.add_argument("--cnn-batch", type=int, default=128, help="CNN batch size (images)")
    p.add_argument("--lr", type=float, default=0.01, help="SGD learning rate (momentum 0.9)")
    p.add_argument("--damping", type=float, default=1e-3, help="damping of every K-FAC variant")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the batches")
    p.add_argument("--no-memory", dest="memory", action="store_false", help="skip peak memory")
    p.add_argument("--mem-steps", type=int, default=3, help="steps per memory subprocess")
    p.add_argument("--mem-jobs", type=int, default=2, help="memory subprocesses at once")
    p.add_argument("--profile", action="store_true", help="cProfile the adapter on the MLP")
    p.add_argument("--profile-steps", type=int, default=20, help="steps profiled by --profile")
    p.add_argument("--verbose", action="store_true", help="progress on stderr")
    p.add_argument("--out", help="write the run's results file here (JSON)")
    p.add_argument(
        "--tables",
        action="store_true",
        help="rewrite the block of docs/performance.md from benchmarks/results/vs_reference.json",
    )
    p.add_argument("--_memory-child", nargs=3, metavar=("MODEL", "VARIANT", "STEPS"),
                   help=argparse.SUPPRESS)  # fmt: skip
    args = p.parse_args(argv)
    try:
        args.intervals = [parse_intervals(v) for v in args.intervals]
    except argparse.ArgumentTypeError as e:
        p.error(str(e))
    if args.quick:
        args.width, args.mlp_batch, args.cnn_batch = 64, 16, 8
        args.reps, args.warmup, args.mem_steps, args.profile_steps = 2, 1, 1, 3
    if args.reps < 1 or args.warmup < 0 or args.threads < 1:
        p.error("--reps and --threads must be >= 1, --warmup >= 0")
    args.max_f = max(f for f, _ in args.intervals)
    args.max_i = max(i for _, i in args.intervals)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # the first layer's input needs no gradient: its full backward hook still gets grad_output
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    if args.tables:
        changed = write_tables(RESULTS / "vs_reference.json", PAGE)
        print(f"{PAGE}: vs-reference block {'rewritten' if changed else 'unchanged'}")
        return 0
    command = " ".join(["python", "benchmarks/vs_reference.py", *(argv or sys.argv[1:])])
    torch.set_num_threads(args.threads)
    if args._memory_child:
        model, variant, steps = args._memory_child
        print(json.dumps(memory_child(model, variant, int(steps), args)))
        return 0
    variants = [v for v in VARIANTS if args.inverse or not v.endswith("-inv")]
    kinds = sorted({k for iv in args.intervals for k in kind_weights(iv)}, reverse=True)
    print("kfac_func vs a re-statement of kfac-pytorch 0.4.2 (see --help for the method)")
    print(
        f"torch {torch.__version__} | kfac_func {kf.__version__} | python "
        f"{platform.python_version()} | threads {torch.get_num_threads()} | CPU {cpu_model()} "
        f"({os.cpu_count()} cores)"
    )
    if args.quick:
        print("QUICK MODE: tiny models and 2 repetitions; a smoke test, not a measurement")
    print(
        f"reps {args.reps}, warm-up {args.warmup}; SGD lr {args.lr} momentum 0.9; damping "
        f"{args.damping}, factor_decay 0.95, kl_clip 1e-3; MLP 4xLinear width {args.width} "
        f"batch {args.mlp_batch}; CNN 3 conv + Linear, 3x32x32, batch {args.cnn_batch}"
    )
    print(flush=True)

    checkout = checked_out(("benchmarks/results",), False)
    corr = check_correctness(args)
    rows, losses, records, split_records = [], {}, [], []
    amortized_ms = {}  # (model, intervals) -> {variant: ms per step}
    for model in args.models:
        res = measure(model, variants, kinds, args)
        losses[model] = res["losses"]
        s = res["samples"]
        if (True, True) in kinds:
            split_records += [
                split_record(model, method, res["splits"], suffix)
                for method, suffix in (("eigen", ""), ("inverse", "-inv"))
                if args.inverse or not suffix
            ]
        for iv in args.intervals:
            ms = {v: amortized(s[v], iv, v == "sgd") for v in variants}
            amortized_ms[model, iv] = ms
            for method, suffix in (("eigen", ""), ("inverse", "-inv")):
                if suffix and not args.inverse:
                    continue
                ref, ours = ms[f"reference{suffix}"], ms[f"adapter{suffix}"]
                fn = ms["functional"] if not suffix else float("nan")
                grp = ms["adapter-grouped"] if not suffix else float("nan")
                unc = ms["adapter-unchecked"] if not suffix else float("nan")
                records.append(
                    {
                        "model": model,
                        "intervals": f"{iv[0]}/{iv[1]}",
                        "method": method,
                        "sgd_ms": ms["sgd"],
                        "reference_ms": ref,
                        "adapter_ms": ours,
                        "functional_ms": None if suffix else fn,
                        "grouped_ms": None if suffix else grp,
                        "adapter_over_reference": ours / ref,
                        "functional_over_reference": None if suffix else fn / ref,
                        "grouped_over_reference": None if suffix else grp / ref,
                        "unchecked_ms": None if suffix else unc,
                        "unchecked_over_reference": None if suffix else unc / ref,
                        "width": make_model(model, args)[1][1] if model != "cnn" else None,
                    }
                )
                rows.append(
                    [
                        model,
                        f"{iv[0]}/{iv[1]}",
                        method,
                        f"{ms['sgd']:.1f}",
                        f"{ref:.1f}",
                        f"{ours:.1f}",
                        "-" if suffix else f"{fn:.1f}",
                        "-" if suffix else f"{grp:.1f}",
                        f"{ours / ref:.2f}",
                        "-" if suffix else f"{fn / ref:.2f}",
                        "-" if suffix else f"{grp / ref:.2f}",
                        f"{ours / ms['sgd']:.2f}",
                        f"{ref / ms['sgd']:.2f}",
                    ]
                )
    print("amortized step time (ms per step, medians weighted by step kind):")
    print_table(
        [
            "model",
            "F/I",
            "method",
            "SGD",
            "reference",
            "adapter",
            "functional",
            "grouped",
            "adapter/ref",
            "functional/ref",
            "grouped/ref",
            "adapter/SGD",
            "ref/SGD",
        ],
        rows,
    )
    if split_records:
        print()
        print("1/1 step split (ms, medians): forward+backward with the hooks, and the step:")
        print_table(
            ["model", "method", *SPLIT_COLUMNS],
            [
                [r["model"], r["method"]]
                + [f"{r[k]:.2f}" for k in SPLIT_KEYS]
                + [f"{r['unchecked_step_ms']:.2f}" if "unchecked_step_ms" in r else "-"]
                for r in split_records
            ],
        )
    qr_rows, qr_records, qr_accuracy = [], [], {}
    for model in args.models:
        for iv in args.intervals:
            ms = amortized_ms[model, iv]
            if "adapter-qr" in ms:
                qr_records.append(
                    {"model": model, "intervals": f"{iv[0]}/{iv[1]}", "qr_ms": ms["adapter-qr"]}
                )
                qr_rows.append(
                    [
                        model,
                        f"{iv[0]}/{iv[1]}",
                        f"{ms['reference']:.1f}",
                        f"{ms['adapter']:.1f}",
                        f"{ms['adapter-qr']:.1f}",
                        f"{ms['adapter-qr'] / ms['reference']:.2f}",
                        f"{ms['adapter-qr'] / ms['adapter']:.2f}",
                    ]
                )
    if qr_rows:
        print()
        print("approximate eigenbasis refresh (eigenbasis_refresh='qr', eigen, ms per step):")
        print_table(
            ["model", "F/I", "reference", "adapter", "adapter-qr", "qr/ref", "qr/adapter"],
            qr_rows,
        )
        qr_accuracy = check_qr_accuracy(args)
        for model, (med, worst) in qr_accuracy.items():
            print(
                f"accuracy {model} adapter-qr vs adapter (same weights, 1/1): relative error "
                f"of the preconditioned gradients median {med:.2e}, max {worst:.2e}"
            )
    print()
    for name, d in corr.items():
        print(
            f"correctness {name}: max relative difference of preconditioned gradients, "
            f"reference vs adapter (scaling='kfac-pytorch'), 4 steps F/I=1/2: {d:.2e} "
            f"({'OK' if d < 1e-3 else 'MISMATCH'}, float32 tolerance 1e-3)"
        )
    memory: list[dict[str, Any]] = []
    if args.memory:
        mem_models = ["mlp"] if args.quick else args.models
        mem_variants = (
            ["sgd", "reference", "adapter"]
            if args.quick
            else [v for v in variants if v != "adapter-unchecked"]
        )
        mem = measure_memory(mem_models, mem_variants, args)
        mrows = []
        for model in mem_models:
            for v in mem_variants:
                d = mem[model, v]
                peak = (d["hwm_kib"] - d["rss0_kib"]) / 1024 if d["hwm_kib"] >= 0 else math.nan
                mrows.append([model, v, f"{d['rss0_kib'] / 1024:.0f}", f"{peak:.1f}"])
                memory.append({"model": model, "variant": v, "peak_mib": peak})
        print()
        print(
            f"peak memory (fresh subprocess per variant, {args.mem_steps} steps of 1/1): "
            "step peak = VmHWM after the steps minus VmRSS before them, with the high-water "
            "mark reset through /proc/self/clear_refs once the model and batch exist:"
        )
        print_table(["model", "variant", "rss before MiB", "step peak MiB"], mrows)
    print()
    for model, ls in losses.items():
        print(f"final loss {model}: " + ", ".join(f"{v} {x:.4f}" for v, x in ls.items()))
    print("step kinds timed: " + ", ".join(KIND_NAMES[k] for k in kinds))
    if args.out:
        settings = {k: getattr(args, k) for k in ("reps", "warmup", "width", "mlp_batch")}
        settings.update(cnn_batch=args.cnn_batch, damping=args.damping, lr=args.lr)
        doc = {
            "benchmark": "vs_reference",
            "quick": args.quick,
            "command": command,
            **(checkout or {}),
            "machine": {
                "cpu": cpu_model(),
                "cores": os.cpu_count(),
                "threads": torch.get_num_threads(),
                "torch": torch.__version__,
                "bf16_flags": bf16_flags(),
            },
            "settings": settings,
            "rows": records,
            "split": split_records,
            "qr": qr_records,
            "qr_accuracy": {m: list(v) for m, v in qr_accuracy.items()},
            "correctness": corr,
            "memory": memory,
            "final_loss": losses,
        }
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(doc, indent=1, allow_nan=False) + "\n")
        print(f"wrote {args.out}")
    if args.profile:
        profile_adapter(args, args.profile_steps, top=15)
    return 0


SPLIT_KEYS = ("reference_fb_ms", "adapter_fb_ms", "reference_step_ms", "adapter_step_ms")
"""The parts of :func:`split_record`, in the order the printed table shows them."""
SPLIT_COLUMNS = ("ref fwd+bwd", "adapter fwd+bwd", "ref step", "adapter step", "unchecked step")
"""The printed table's columns after the model and the method."""

RESULTS = HERE / "results"
PAGE = HERE.parent / "docs" / "performance.md"
MARKS = ("<!-- vs-reference:start -->", "<!-- vs-reference:end -->")
"""The comments around the block of ``docs/performance.md`` this benchmark writes."""


def render(doc: dict[str, Any]) -> str:
    """The docs block of a results file: the amortized step of each model, schedule and
    method against the reference's and SGD's, then the peak memory of a step."""
    import race_report as rr

    m, s = doc["machine"], doc["settings"]
    lines = [
        f"Results: `benchmarks/results/vs_reference.json` (`{doc['command']}`), commit "
        f"`{str(doc['commit'])[:10]}`; CPU `{m['cpu']}`{rr.bf16_phrase(m)}, "
        f"{m['threads']} thread(s), torch `{m['torch']}`; medians of {s['reps']} "
        "repetitions, milliseconds per step amortized over a cycle of F/I steps.",
        "",
        "| model | F/I | method | SGD | reference | adapter | functional | adapter, grouped | "
        "adapter / reference | functional / reference | grouped / reference |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def opt(v: float | None, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    for r in doc["rows"]:
        lines.append(
            f"| {r['model']} | {r['intervals']} | {r['method']} | {r['sgd_ms']:.1f} | "
            f"{r['reference_ms']:.1f} | {r['adapter_ms']:.1f} | "
            f"{opt(r['functional_ms'], '.1f')} | {opt(r.get('grouped_ms'), '.1f')} | "
            f"{r['adapter_over_reference']:.2f} | "
            f"{opt(r['functional_over_reference'], '.2f')} | "
            f"{opt(r.get('grouped_over_reference'), '.2f')} |"
        )
    if doc.get("split"):
        lines += [
            "",
            "Every step updating factors and decompositions (1/1), split: the forward and "
            "backward passes with the hooks' statistics, then the preconditioner's step "
            "(milliseconds, medians); unchecked: the adapter's step with the finiteness "
            "checks of its factors and decompositions skipped (what they cost).",
            "",
            "| model | method | forward+backward: reference | adapter | adapter / reference | "
            "step: reference | adapter | adapter / reference | unchecked / reference |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {r['model']} | {r['method']} | {r['reference_fb_ms']:.2f} | "
            f"{r['adapter_fb_ms']:.2f} | {r['fb_adapter_over_reference']:.2f} | "
            f"{r['reference_step_ms']:.2f} | {r['adapter_step_ms']:.2f} | "
            f"{r['step_adapter_over_reference']:.2f} | "
            f"{opt(r.get('step_unchecked_over_reference'), '.2f')} |"
            for r in doc["split"]
        ]
    if doc["memory"]:
        lines += ["", "| model | variant | step peak MiB |", "|---|---|---|"]
        lines += [f"| {r['model']} | {r['variant']} | {r['peak_mib']:.1f} |" for r in doc["memory"]]
    worst = max(doc["correctness"].values())
    lines += [
        "",
        f"Reference and adapter precondition alike: max relative difference {worst:.0e} "
        "over the models' preconditioned gradients (float32).",
    ]
    return "\n".join(lines)


def write_tables(results: Path, page: Path) -> bool:
    """Rewrite the block of ``page`` from the results file ``results``; whether it
    changed."""
    import race_report as rr

    doc = json.loads(results.read_text())
    if doc["quick"]:
        raise ValueError(f"{results}: --quick results are a smoke test, not for the docs")
    return rr.replace_block(page, MARKS, render(doc))


if __name__ == "__main__":
    sys.exit(main())
