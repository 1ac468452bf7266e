"""Everything worth measuring on a GPU, in one unattended command with a hard time budget.

Run on a CUDA machine::

    python benchmarks/gpu.py --budget 480

(``--quick``: tiny sizes on the CPU in well under a minute, a smoke test that keeps the
script working; the test suite runs it.)

Parts (each guarded: a part that fails records its error in the outputs and the others
still run; before it starts, each part checks the budget and is skipped with a note when
the budget is spent):

1. ``environment``: torch, CUDA, cuDNN, the device's name, the number of GPUs, TF32 flags.
2. ``tests``: ``python -m pytest -q -p no:cacheprovider -x`` on a subset of the test suite
   that exercises the math end to end (``TEST_FILES``), as a subprocess with a timeout:
   pass/fail counts and duration. The tests run on each test's default device (CPU tensors
   unless a test says otherwise): the part checks that the installation works here.
3. ``step_time``: median milliseconds per training step, peak CUDA memory and host
   synchronisations per step of SGD (momentum 0.9), AdamW and K-FAC
   (:class:`kfac_func.KFACPreconditioner` in front of SGD with momentum) on

   - ``lm``: a GPT-2-small-sized language model, the ``CharTransformer`` of
     ``examples/transformer_lm.py`` with 12 layers, d_model 768, 12 heads, context 512,
     batch 8 and a vocabulary of 256 characters (``--lm-vocab 50257`` gives GPT-2's;
     ``max_factor_dim=4096`` then keeps the vocabulary side of the head diagonal; at 256 it
     changes nothing: the widest factor side is the MLP's 3073);
   - ``cnn``: ResNet-50 (bottleneck blocks 3, 4, 6, 3, written out below: torchvision is
     not a dependency), batch 64, 3×224×224 inputs, 1000 classes (``--cnn-size 112``
     halves the side when the budget needs it).

   K-FAC variants: ``kfac 10/100`` (factors every 10 steps, decompositions every 100),
   ``kfac 1/1`` (both every step), ``kfac-qr 1/1`` (every step, eigenbases refreshed by one
   QR iteration after the first eigh: ``eigenbasis_refresh="qr"``) and
   ``kfac-moments 10/100`` (Adam's step in K-FAC's eigenbasis: ``eigenbasis_moments=True``,
   ``kl_clip=None``) and ``kfac-recommended 1/2`` (the preconditioner of ``kf.KFAC(model)``'s
   recommended recipe as the optimizer face sets it up for the model on the device, the
   switches it turns on by itself included: :func:`recommended_options`, in front of the
   same SGD). The switches that wait for a GPU to earn their place are each timed against
   the same step without them (:data:`SWITCHES`, a table of their own): ``kfac-per-layer
   10/100`` (``grouped=False``; ``grouped`` is the default off the CPU), ``kfac-sync-free
   10/100`` (``sync_free=True``), ``kfac-compiled 10/100`` (``sync_free=True,
   compile=True``; run after every model's other variants, as its warm-up compiles, and
   skipped by ``--quick``), ``kfac-recommended-synced 1/2`` and
   ``kfac-recommended-unbatched 1/2`` (the recipe without the ``sync_free`` or the batched
   ``eigh`` that the face turns on).

   Every variant starts from the same weights and draws a fresh random batch on the device
   before the clock starts. A repetition is one step of each kind the intervals produce
   (factors+decompositions, factors only, preconditioning only); the step counter of the
   preconditioner's state is moved forward to the next step of each kind, so a few
   repetitions sample every kind. The reported time is the per-kind median weighted by
   each kind's share of a cycle of ``lcm(F, I)`` steps (1 %, 9 % and 90 % at 10/100), as
   ``benchmarks/step_time.py`` does. Warm-up repetitions are excluded. On CUDA each step is
   timed with CUDA events after a ``torch.cuda.synchronize()``; on the CPU with
   ``time.perf_counter``. Peak memory is ``torch.cuda.max_memory_allocated`` over the timed
   steps (model, optimizer and K-FAC state included; "n/a" on the CPU). Host
   synchronisations are counted on one extra step of each kind under
   ``torch.cuda.set_sync_debug_mode("warn")`` (one warning per synchronising call;
   weighted like the time; "n/a" on the CPU). Kernel launches are counted on one more
   step of each kind under ``torch.profiler`` (the host's launch calls, ``cudaLaunchKernel``
   and kin, and the kernels that ran; forward and backward included; CUDA only).
   Ratios are to AdamW on the same model.
   Each variant of each model gets an equal share of the budget left when it starts: it
   stops repeating when its share is spent (after at least one timed repetition). The
   outputs are rewritten after every variant, so that a run stopped from outside keeps
   the variants measured before.
4. ``eigh_vs_qr``: ``torch.linalg.eigh`` of an n×n SPD float32 matrix against one QR
   refresh (:func:`kfac_func.core.decomposition.refresh_eigh`, warm-started from the
   eigenvectors of a nearby matrix) for n in 256, 768, 1024, 3072, 4096, on the device,
   with the refresh's largest relative eigenvalue error.
5. ``stages``: ``benchmarks/stages.py --device`` (as a subprocess, with the budget left
   as its timeout): the recommended recipe's step (what ``kf.KFAC(model)`` runs) split
   into its stages with their floors at the device's rates, beside Muon's, SOAP's and
   AdamW's steps, on the race's ``lm``, ``lm4x`` and ``gpt2``; the whole step at its
   floors against theirs, times the race's steps to their finals
   (``benchmarks/stages_report.py``'s two tables). Its JSON is ``OUT_stages.json``.
6. ``process_group``: the adapter under a one-rank process group (NCCL on CUDA, gloo on
   the CPU) with the model wrapped in ``DistributedDataParallel``: a few K-FAC steps on a
   small MLP, the preconditioned gradients compared with those of the same steps without
   a process group (maximum absolute difference), then the group is destroyed.

The cheap parts run first (1, 2, 6, 4, 5, then 3), so a short budget still gets them; the
outputs list the parts in the order above. The budget is checked before every part,
every matrix size of part 4 and every variant of part 3; a variant that starts runs at
least one warm-up and one timed repetition, so the script may end later than the budget
by about one repetition of the slowest variant (seconds on a GPU): under an outer time
limit, leave that margin (``--budget 420`` in a 10-minute slot). ``--test-timeout``
(150 s) bounds part 2.

Outputs: ``OUT.md`` (the tables, also printed at the end) and ``OUT.json`` (every number,
per-kind medians, errors with their tracebacks, notes) for the ``--out`` prefix (default
``benchmarks/results/gpu``; a temporary directory with ``--quick``), both rewritten after
every part, so a run stopped from outside keeps what it measured. Progress goes to
stderr. The exit status is 1 when a part or a variant recorded an error, 0 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import gc
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_time import cpu_model, load_example  # noqa: E402

try:
    import kfac_func as kf
except ImportError:  # a checkout without `pip install -e .`: use the repository's copy
    sys.path.insert(0, str(ROOT))
    import kfac_func as kf
from kfac_func.adapter.settings import settings_from_keywords  # noqa: E402
from kfac_func.core.decomposition import refresh_eigh  # noqa: E402

TEST_FILES = (
    "tests/test_oracle_linear.py",
    "tests/test_decomposition.py",
    "tests/test_adapter.py",
    "tests/test_basis_moments.py",
    "tests/test_ekfac.py",
    "tests/test_device.py",
    "tests/test_decompose_gpu.py",
    "tests/test_reliability.py",
)
QUICK_TEST_FILES = ("tests/test_decomposition.py",)
PART_ORDER = ("environment", "tests", "step_time", "stages", "eigh_vs_qr", "process_group")
RUN_ORDER = ("environment", "tests", "process_group", "eigh_vs_qr", "stages", "step_time")

Kind = tuple[bool, bool]  # (update factors, update decompositions)
KIND_NAMES: dict[Kind, str] = {
    (True, True): "factors+decomp",
    (True, False): "factors",
    (False, False): "precondition",
}


lm_example = load_example("transformer_lm")


# --------------------------------------------------------------------------- budget


class Budget:
    """Seconds left of ``--budget``, counted from the start of the script."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.start = time.perf_counter()

    def left(self) -> float:
        return self.seconds - (time.perf_counter() - self.start)


class Timer:
    """Milliseconds of one call: CUDA events around it on CUDA, perf_counter on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def ms(self, fn: Callable[[], object]) -> float:
        return self.run(fn)[0]

    def run(self, fn: Callable[[], Any]) -> tuple[float, Any]:
        """``(milliseconds, fn())``, the queue drained before and after."""
        self.sync()
        if self.cuda:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            end.record()
            torch.cuda.synchronize()
            return float(start.elapsed_time(end)), out
        t0 = time.perf_counter()
        out = fn()
        return 1e3 * (time.perf_counter() - t0), out


@contextlib.contextmanager
def count_syncs(device: torch.device) -> Iterator[list[int]]:
    """``[n]``: the CUDA synchronisations reported by the sync debug mode in the block."""
    found = [0]
    if device.type != "cuda":
        yield found
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield found
        finally:
            torch.cuda.set_sync_debug_mode("default")
    found[0] = sum("synchroniz" in str(w.message).lower() for w in caught)


# the CUDA runtime and driver calls that launch work on the device (kernels, a captured graph)
LAUNCH_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cudaGraphLaunch")


def count_launches(step: Callable[[], Any], device: torch.device) -> dict[str, int] | None:
    """``{"launches": ..., "kernels": ...}`` of one call of ``step`` on a GPU, from the
    profiler: the host's launch calls (:data:`LAUNCH_CALLS`: what costs ~5-10 µs each
    before any Python) and the kernels that ran on the device; None on a CPU."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    launches = kernels = 0
    for evt in prof.key_averages():
        if evt.key in LAUNCH_CALLS:
            launches += evt.count
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            kernels += evt.count
    return {"launches": launches, "kernels": kernels}


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------- models


class Bottleneck(nn.Module):
    """ResNet's bottleneck block: 1×1 → 3×3 (stride) → 1×1 (×4 channels) + shortcut."""

    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        out = 4 * width
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out)
        self.down: nn.Module | None = None
        if stride != 1 or cin != out:
            self.down = nn.Sequential(
                nn.Conv2d(cin, out, 1, stride, bias=False), nn.BatchNorm2d(out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return F.relu(y + (x if self.down is None else self.down(x)))


def resnet(
    blocks: tuple[int, ...] = (3, 4, 6, 3), base: int = 64, classes: int = 1000
) -> nn.Module:
    """ResNet-50 with the defaults (25.6 M parameters)."""
    layers: list[nn.Module] = [
        nn.Conv2d(3, base, 7, 2, 3, bias=False),
        nn.BatchNorm2d(base),
        nn.ReLU(),
        nn.MaxPool2d(3, 2, 1),
    ]
    cin = base
    for i, n in enumerate(blocks):
        width = base * 2**i
        for j in range(n):
            layers.append(Bottleneck(cin, width, 2 if i > 0 and j == 0 else 1))
            cin = 4 * width
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes)]
    return nn.Sequential(*layers)


@dataclass
class Workload:
    name: str
    description: str
    make: Callable[[], nn.Module]
    batch: Callable[[torch.device], tuple[torch.Tensor, torch.Tensor]]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def workloads(args: argparse.Namespace) -> list[Workload]:
    if args.quick:
        vocab, context, d, n, heads, lm_batch = 64, 16, 32, 2, 2, 2
        blocks, base, size, cnn_batch, classes = (1, 1, 1, 1), 4, 32, 2, 10
    else:
        vocab, context, d, n, heads, lm_batch = args.lm_vocab, 512, 768, 12, 12, 8
        blocks, base, size, cnn_batch, classes = (3, 4, 6, 3), 64, args.cnn_size, 64, 1000

    def lm_batch_fn(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randint(0, vocab, (lm_batch, context), device=device)
        return x, torch.randint(0, vocab, (lm_batch, context), device=device)

    def cnn_batch_fn(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(cnn_batch, 3, size, size, device=device)
        return x, torch.randint(0, classes, (cnn_batch,), device=device)

    found = {
        "lm": Workload(
            "lm",
            f"CharTransformer: {n} layers, d_model {d}, {heads} heads, context {context}, "
            f"vocabulary {vocab}, batch {lm_batch}, random tokens",
            lambda: lm_example.CharTransformer(vocab, context, d, n, heads),
            lm_batch_fn,
            lm_example.lm_loss,
        ),
        "cnn": Workload(
            "cnn",
            f"ResNet (bottleneck blocks {blocks}, base width {base}), {classes} classes, "
            f"3x{size}x{size} Gaussian inputs, batch {cnn_batch}",
            lambda: resnet(blocks, base, classes),
            cnn_batch_fn,
            F.cross_entropy,
        ),
    }
    return [found[m] for m in args.models]


def recommended_options(model: nn.Module) -> dict[str, Any]:
    """The preconditioner's arguments of ``kf.KFAC(model)``'s recommended recipe for
    ``model`` where it lies, as the optimizer face chooses them (its intervals are the
    variant's; its Adam betas are the eigenbasis moments'): the recipe's own and the
    switches the face turns on by itself for this model and device (batched ``eigh``;
    ``sync_free`` on one CUDA process; bfloat16 Grams and Newton–Schulz iteration where
    the device multiplies bfloat16 natively).

    Example:
        >>> options = recommended_options(nn.Sequential(nn.Linear(4, 4)))
        >>> options["moment_beta2"], options["batched_eigh"], "sync_free" in options  # a CPU
        (0.95, True, False)
    """
    face = kf.KFAC(model)
    settings = face.preconditioner.settings
    face.preconditioner.remove()  # the face's hooks go: the variant builds its own
    recipe = kf.RECIPES["recommended"]
    skip = ("factor_update_steps", "inv_update_steps")
    options = {k: v for k, v in recipe.kfac_kwargs.items() if k not in skip}
    decay = options["factor_decay"]  # per step: the variant's intervals are fixed
    options["factor_decay"] = decay.per_step if isinstance(decay, kf.step.DecayPerStep) else decay
    options.update({k: getattr(settings, k) for k in settings.named()})
    options["moment_beta1"], options["moment_beta2"] = recipe.betas
    return options


@dataclass(frozen=True)
class Variant:
    optimizer: str  # sgd, adamw, kfac, kfac-qr, kfac-moments, ...
    intervals: tuple[int, int] | None = None  # K-FAC's (factor, decomposition) intervals
    options: tuple[tuple[str, Any], ...] = ()  # more KFACPreconditioner arguments
    recipe: bool = False  # kf.KFAC(model)'s arguments (recommended_options), then options

    @property
    def label(self) -> str:
        return "-" if self.intervals is None else f"{self.intervals[0]}/{self.intervals[1]}"

    @property
    def name(self) -> str:
        return f"{self.optimizer} {self.label}"

    @property
    def compiles(self) -> bool:
        return ("compile", True) in self.options


VARIANTS = (
    Variant("sgd"),
    Variant("adamw"),
    Variant("kfac", (10, 100)),
    Variant("kfac-per-layer", (10, 100), (("grouped", False),)),
    Variant("kfac-sync-free", (10, 100), (("sync_free", True),)),
    Variant("kfac", (1, 1)),
    Variant("kfac-qr", (1, 1), (("eigenbasis_refresh", "qr"),)),
    Variant("kfac-moments", (10, 100), (("eigenbasis_moments", True), ("kl_clip", None))),
    Variant("kfac-recommended", (1, 2), recipe=True),
    Variant("kfac-recommended-synced", (1, 2), (("sync_free", False),), recipe=True),
    Variant("kfac-recommended-unbatched", (1, 2), (("batched_eigh", False),), recipe=True),
    # run after every model's other variants (part_step_time)
    Variant("kfac-compiled", (10, 100), (("sync_free", True), ("compile", True))),
)

SWITCHES = (
    ("grouped", "kfac-per-layer 10/100", "kfac 10/100"),
    ("sync_free", "kfac 10/100", "kfac-sync-free 10/100"),
    ("compile", "kfac-sync-free 10/100", "kfac-compiled 10/100"),
    ('eigenbasis_refresh="qr"', "kfac 1/1", "kfac-qr 1/1"),
    ("the recipe's sync_free", "kfac-recommended-synced 1/2", "kfac-recommended 1/2"),
    ("the recipe's batched_eigh", "kfac-recommended-unbatched 1/2", "kfac-recommended 1/2"),
)
"""The switches that wait for a GPU to earn their place (docs/optimizers.md): each as
``(switch, the variant without it, the variant with it)``. ``grouped`` is on by default
off the CPU, so ``kfac 10/100`` has it; the recommended recipe's variants are what
``kf.KFAC(model)`` turns on by itself, each with one switch turned off."""


def kind_weights(intervals: tuple[int, int] | None) -> dict[Kind, float]:
    """Each kind of step's share of a cycle of ``lcm(F, I)`` steps."""
    if intervals is None:
        return {(False, False): 1.0}
    f, i = intervals
    cycle = [(s % f == 0, s % i == 0) for s in range(math.lcm(f, i))]
    return {k: cycle.count(k) / len(cycle) for k in KIND_NAMES if k in cycle}


# --------------------------------------------------------------------------- part 3


class Trainer:
    """One model with one optimizer (and K-FAC in front of SGD for the K-FAC variants)."""

    def __init__(
        self, wl: Workload, v: Variant, device: torch.device, args: argparse.Namespace
    ) -> None:
        torch.manual_seed(args.seed)  # the same initial weights for every variant
        self.wl, self.v, self.device = wl, v, device
        self.model = wl.make().to(device)
        params = list(self.model.parameters())
        self.pre: kf.KFACPreconditioner | None = None
        if v.optimizer == "adamw":
            self.opt: torch.optim.Optimizer = torch.optim.AdamW(params, lr=1e-4)
        else:
            self.opt = torch.optim.SGD(params, lr=args.lr, momentum=0.9)
        if v.intervals is not None:
            options: dict[str, Any] = {
                "factor_update_steps": v.intervals[0],
                "inv_update_steps": v.intervals[1],
                "damping": 1e-3,
                "factor_decay": 0.95,
                "kl_clip": 1e-3,
                "lr": args.lr,
                "max_factor_dim": args.max_factor_dim,
                **(recommended_options(self.model) if v.recipe else {}),
                **dict(v.options),
            }
            settings = settings_from_keywords(options, v.optimizer, warn=False)
            self.pre = kf.KFACPreconditioner(self.model, settings=settings, **options)
        self.loss = torch.zeros((), device=device)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.opt.zero_grad(set_to_none=True)
        loss = self.wl.loss(self.model(x), y)
        loss.backward()
        if self.pre is not None:
            self.pre.step()
        self.opt.step()
        self.loss = loss.detach()

    def at_kind(self, kind: Kind) -> None:
        """Move the state's step counter forward to the next step of ``kind``."""
        if self.pre is None or self.v.intervals is None:
            return
        f, i = self.v.intervals
        s = self.pre.state.step
        while (s % f == 0, s % i == 0) != kind:
            s += 1
        if s != self.pre.state.step:
            self.pre.state = self.pre.state.replace(step=s)

    def close(self) -> None:
        if self.pre is not None:
            self.pre.remove()


def time_variant(
    wl: Workload,
    v: Variant,
    device: torch.device,
    args: argparse.Namespace,
    deadline: float,
) -> dict[str, Any]:
    """Warm-up, timed repetitions until ``deadline`` (perf_counter) or ``--steps``."""
    timer = Timer(device)
    cuda = device.type == "cuda"
    weights = kind_weights(v.intervals)
    trainer = Trainer(wl, v, device, args)
    try:

        def one(kind: Kind) -> float:
            trainer.at_kind(kind)
            x, y = wl.batch(device)
            return timer.ms(lambda: trainer.step(x, y))

        for rep in range(args.warmup):
            if rep and time.perf_counter() > deadline:
                break  # one warm-up repetition at least
            for k in weights:
                one(k)
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        samples: dict[Kind, list[float]] = {k: [] for k in weights}
        for _ in range(args.steps):
            t0 = time.perf_counter()
            for k in weights:
                samples[k].append(one(k))
            now = time.perf_counter()
            if now + (now - t0) > deadline:
                break  # another repetition would not fit; the sync count below still does
        peak = torch.cuda.max_memory_allocated(device) / 2**20 if cuda else None
        syncs: float | None = None
        launches: dict[str, dict[str, int] | None] = {}
        if cuda:
            syncs = 0.0
            for k, w in weights.items():
                trainer.at_kind(k)
                x, y = wl.batch(device)
                torch.cuda.synchronize()
                with count_syncs(device) as n:
                    trainer.step(x, y)
                torch.cuda.synchronize()
                syncs += w * n[0]
            for k in weights:  # kernel launches of each step kind (forward+backward too)
                trainer.at_kind(k)
                x, y = wl.batch(device)
                step = functools.partial(trainer.step, x, y)
                launches[KIND_NAMES[k]] = count_launches(step, device)
        medians = {k: statistics.median(s) for k, s in samples.items()}
        loss = float(trainer.loss)
        state_mib = trainer.pre.memory_usage()["total"] / 2**20 if trainer.pre is not None else None
        layers = len(trainer.pre.layers) if trainer.pre is not None else None
        return {
            "model": wl.name,
            "optimizer": v.optimizer,
            "intervals": v.label,
            "ms": sum(w * medians[k] for k, w in weights.items()),
            "ms_per_kind": {KIND_NAMES[k]: m for k, m in medians.items()},
            "kind_weights": {KIND_NAMES[k]: w for k, w in weights.items()},
            "reps": len(next(iter(samples.values()))),
            "peak_mib": peak,
            "syncs_per_step": syncs,
            "launches_per_kind": launches or None,
            "kfac_state_mib": state_mib,
            "kfac_layers": layers,
            "kfac_settings": _settings_of(trainer.pre),
            "final_loss": loss,
        }
    finally:
        trainer.close()


def _settings_of(pre: kf.KFACPreconditioner | None) -> dict[str, str] | None:
    """The preconditioner's settings that differ from their defaults, as text."""
    if pre is None:
        return None
    return {k: str(getattr(pre.settings, k)) for k in sorted(pre.settings.named())}


def part_step_time(
    args: argparse.Namespace,
    device: torch.device,
    budget: Budget,
    report: Callable[[dict[str, Any]], None] = lambda part: None,
) -> dict[str, Any]:
    """Every variant on every model; ``report`` gets the part as it stands after each
    variant (the outputs are rewritten then, so that a run stopped from outside, in a
    long compilation say, keeps the variants measured before)."""
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    wls = workloads(args)

    def part() -> dict[str, Any]:
        return {
            "models": {wl.name: wl.description for wl in wls},
            "rows": rows,
            "tracebacks": notes,
            "warmup_reps": args.warmup,
            "max_reps": args.steps,
        }

    # the compiling variants last, after every model's others: their warm-up compiles
    # (minutes, and more where a graph is compiled again) cannot starve the rest
    plan = [(wl, v) for late in (False, True) for wl in wls for v in VARIANTS if v.compiles == late]
    for n, (wl, v) in enumerate(plan):
        base = {"model": wl.name, "optimizer": v.optimizer, "intervals": v.label}
        if v.compiles and args.quick:
            rows.append({**base, "skipped": "--quick: compiling takes minutes on a CPU"})
            continue
        left = budget.left()
        if left <= 0:
            rows.append({**base, "skipped": "budget spent"})
            continue
        deadline = time.perf_counter() + left / (len(plan) - n)
        t0 = time.perf_counter()
        try:
            rows.append(time_variant(wl, v, device, args, deadline))
        except Exception as e:  # one variant's failure must not stop the others
            rows.append({**base, "error": f"{type(e).__name__}: {e}"})
            notes.append(traceback.format_exc())
        free_memory(device)  # the variant's model, optimizer and state are gone now
        got = rows[-1].get("ms", rows[-1].get("error"))
        print(
            f"  [{wl.name} {v.name}: {time.perf_counter() - t0:.1f} s; {got}]",
            file=sys.stderr,
            flush=True,
        )
        report({**part(), "partial": True})
    order = {wl.name: m for m, wl in enumerate(wls)}
    rows.sort(key=lambda r: order[r["model"]])  # each model's rows together (a stable sort)
    for r in rows:
        adamw = next(
            (a for a in rows if a["model"] == r["model"] and a["optimizer"] == "adamw"), {}
        )
        if "ms" in r and "ms" in adamw:
            r["ms_vs_adamw"] = r["ms"] / adamw["ms"]
        if r.get("peak_mib") is not None and adamw.get("peak_mib"):
            r["peak_vs_adamw"] = r["peak_mib"] / adamw["peak_mib"]
    return part()


# --------------------------------------------------------------------------- parts 1, 2


def part_environment(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    cuda = torch.cuda.is_available()
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "gpus": torch.cuda.device_count() if cuda else 0,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "matmul_tf32": torch.backends.cuda.matmul.allow_tf32,
        "cudnn_tf32": torch.backends.cudnn.allow_tf32,
        "kfac_func": kf.__version__,
        "python": platform.python_version(),
        "cpu": cpu_model(),
        "cpu_cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
    }


def part_tests(args: argparse.Namespace, budget: Budget) -> dict[str, Any]:
    files = [f for f in (QUICK_TEST_FILES if args.quick else TEST_FILES) if (ROOT / f).exists()]
    timeout = max(1.0, min(args.test_timeout, budget.left()))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", *files]
    out: dict[str, Any] = {
        "files": files,
        "note": "the tests run on each test's default device (CPU tensors unless a test "
        "says otherwise)",
        "timeout_s": timeout,
    }
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        out["seconds"] = time.perf_counter() - t0
        out["error"] = f"timed out after {timeout:.0f} s"
        return out
    out["seconds"] = time.perf_counter() - t0
    out["returncode"] = proc.returncode
    summary = (proc.stdout.strip().splitlines() or [""])[-1]
    out["summary"] = summary
    for count, what in re.findall(
        r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed)", summary
    ):
        out["test_errors" if what.startswith("error") else what] = int(count)
    if proc.returncode != 0:
        out["error"] = f"pytest exited with {proc.returncode}: {summary}"
        out["output_tail"] = (proc.stdout + proc.stderr)[-4000:]
    return out


# --------------------------------------------------------------------------- part 5


def part_stages(args: argparse.Namespace, device: torch.device, budget: Budget) -> dict[str, Any]:
    """``benchmarks/stages.py`` on ``device`` (``--quick``: its smoke test), its JSON
    beside the outputs."""
    out = Path(args.out)
    path = out.with_name(out.name + "_stages.json")
    timeout = max(1.0, budget.left())
    cmd = [sys.executable, str(ROOT / "benchmarks" / "stages.py"), "--device", str(device)]
    cmd += ["--out", str(path), *(["--quick"] if args.quick else ["--reps", "5"])]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s", "seconds": time.perf_counter() - t0}
    result: dict[str, Any] = {"seconds": time.perf_counter() - t0, "json": str(path)}
    if proc.returncode != 0:
        result["error"] = f"stages.py exited with {proc.returncode}"
        result["output_tail"] = (proc.stdout + proc.stderr)[-4000:]
        return result
    result["results"] = json.loads(path.read_text())
    return result


# --------------------------------------------------------------------------- part 4


def _eigh_vs_qr(n: int, reps: int, timer: Timer, gen: torch.Generator) -> dict[str, Any]:
    """Median times of eigh and of one QR refresh of an n×n SPD matrix on ``gen``'s device."""
    device = gen.device
    x = torch.randn(n, 2 * n, device=device, generator=gen) / math.sqrt(2 * n)
    factor = x @ x.T + 1e-3 * torch.eye(n, device=device)
    # the previous eigenbasis: that of a nearby factor, as between two refreshes
    e = torch.randn(n, n // 4 + 1, device=device, generator=gen) / math.sqrt(8 * n)
    _, q_prev = torch.linalg.eigh(factor + 0.05 * (e @ e.T))
    eigh_ms: list[float] = []
    qr_ms: list[float] = []
    for rep in range(reps + 1):  # the first of each is a warm-up
        t_eigh, exact = timer.run(lambda: torch.linalg.eigh(factor))
        t_qr, qr = timer.run(lambda: refresh_eigh(factor, q_prev, dtype=torch.float32))
        if rep:
            eigh_ms.append(t_eigh)
            qr_ms.append(t_qr)
    err = (qr[1].sort().values - exact[0].sort().values).abs().max() / exact[0].max()
    return {
        "n": n,
        "eigh_ms": statistics.median(eigh_ms),
        "qr_ms": statistics.median(qr_ms),
        "eigh_over_qr": statistics.median(eigh_ms) / statistics.median(qr_ms),
        "qr_eigenvalue_rel_error": float(err),
    }


def part_eigh_vs_qr(
    args: argparse.Namespace, device: torch.device, budget: Budget
) -> dict[str, Any]:
    timer = Timer(device)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    rows: list[dict[str, Any]] = []
    for n in args.sizes:
        if budget.left() <= 0:
            rows.append({"n": n, "skipped": "budget spent"})
            continue
        rows.append(_eigh_vs_qr(n, args.linalg_reps, timer, gen))
        free_memory(device)
    return {"dtype": "float32", "reps": args.linalg_reps, "rows": rows}


# --------------------------------------------------------------------------- part 5


def _adapter_grads(
    model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device
) -> list[list[torch.Tensor]]:
    """Preconditioned gradients (in ``model.parameters()`` order) of a few K-FAC steps."""
    pre = kf.KFACPreconditioner(
        model, factor_update_steps=1, inv_update_steps=2, damping=1e-2, lr=0.1
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    out = []
    try:
        for x, y in batches:
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x.to(device)), y.to(device)).backward()
            pre.step()
            out.append([p.grad.detach().cpu().clone() for p in model.parameters()])
            opt.step()
    finally:
        pre.remove()
    return out


def part_process_group(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    backend = "nccl" if device.type == "cuda" else "gloo"
    if dist.is_initialized():
        raise RuntimeError("a process group is already initialized")
    torch.manual_seed(args.seed)
    base = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh())
    base.append(nn.Linear(64, 10))
    gen = torch.Generator().manual_seed(args.seed)
    batches = [
        (torch.randn(16, 32, generator=gen), torch.randint(0, 10, (16,), generator=gen))
        for _ in range(3)
    ]
    alone = _adapter_grads(copy.deepcopy(base).to(device), batches, device)
    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        dist.init_process_group(backend, store=store, world_size=1, rank=0)
        try:
            probe = torch.ones(1, device=device)
            dist.all_reduce(probe)
            ddp = nn.parallel.DistributedDataParallel(
                copy.deepcopy(base).to(device),
                device_ids=[device.index or 0] if device.type == "cuda" else None,
            )
            grouped = _adapter_grads(ddp, batches, device)
        finally:
            dist.destroy_process_group()
    diff = max(float((a - b).abs().max()) for sa, sb in zip(alone, grouped) for a, b in zip(sa, sb))
    return {
        "backend": backend,
        "world_size": 1,
        "steps": len(batches),
        "all_reduce_probe": float(probe.item()),
        "max_abs_diff": diff,
        "note": "DistributedDataParallel over the group; with one rank the preconditioner "
        "takes its one-process path",
    }


# --------------------------------------------------------------------------- output


def _f(v: Any, fmt: str = ".1f") -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return format(v, fmt)
    return str(v)


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return lines + ["| " + " | ".join(r) + " |" for r in rows]


def _status(part: dict[str, Any]) -> list[str]:
    lines = []
    if "skipped" in part:
        lines.append(f"skipped: {part['skipped']}")
    if "error" in part:
        lines.append(f"ERROR: {part['error']}")
    return lines


SWITCH_HEADERS = ["model", "switch", "without", "with", "ms without", "ms with", "with / without"]
SWITCH_HEADERS += ["host syncs/step without", "with"]


def switch_rows(rows: list[dict[str, Any]]) -> list[list[str]]:
    """The table of :data:`SWITCHES` from the step-time rows: per model and switch, both
    variants' step times, their ratio and host synchronisations ("n/a" where a variant
    was not measured, or nothing was counted).

    Example:
        >>> rows = [{"model": "lm", "optimizer": o, "intervals": "10/100", "ms": ms,
        ...          "syncs_per_step": None} for o, ms in (("kfac", 4.0), ("kfac-per-layer", 5.0))]
        >>> switch_rows(rows)[0][1:]
        ['grouped', 'kfac-per-layer 10/100', 'kfac 10/100', '5.0', '4.0', '0.80', 'n/a', 'n/a']
    """
    measured = {(r["model"], f"{r['optimizer']} {r['intervals']}"): r for r in rows if "ms" in r}
    out = []
    for model in dict.fromkeys(r["model"] for r in rows):
        for switch, without, with_ in SWITCHES:
            a, b = measured.get((model, without), {}), measured.get((model, with_), {})
            ratio = b["ms"] / a["ms"] if "ms" in a and "ms" in b else None
            syncs = [_f(r.get("syncs_per_step"), ".2f") for r in (a, b)]
            times = [_f(r.get("ms")) for r in (a, b)]
            out.append([model, switch, without, with_, *times, _f(ratio, ".2f"), *syncs])
    return out


def markdown(results: dict[str, Any]) -> str:
    out = ["# kfac_func on a GPU: tests, step time, memory, decompositions", ""]
    env = results["environment"]
    if "torch" in env:
        out.append(
            f"torch {env['torch']} | CUDA {env['cuda']} | cuDNN {env['cudnn']} | "
            f"{env['gpus']} GPU(s) | device {env['device']} ({env['device_name'] or env['cpu']}) "
            f"| TF32 matmul {env['matmul_tf32']}, cuDNN {env['cudnn_tf32']} | kfac_func "
            f"{env['kfac_func']} | python {env['python']} | {env['cpu_cores']} CPU cores"
        )
    out += _status(env)
    if results.get("quick"):
        out.append("QUICK MODE: tiny sizes; a smoke test, not a measurement")
    out += ["", "## Test subset", ""]
    t = results["tests"]
    out += _status(t)
    if "summary" in t:
        out.append(f"{t['summary']} in {t['seconds']:.0f} s ({', '.join(t['files'])}); {t['note']}")

    out += ["", "## Step time and peak memory (ratios to AdamW on the same model)", ""]
    st = results["step_time"]
    out += _status(st)
    for name, desc in st.get("models", {}).items():
        out.append(f"- {name}: {desc}")
    if st.get("rows"):
        out.append("")
        rows = []
        for r in st["rows"]:
            if "ms" not in r:
                why = r.get("error") or r.get("skipped", "")
                rows.append([r["model"], r["optimizer"], r["intervals"], *["-"] * 7, why, ""])
                continue
            kinds = ", ".join(f"{k} {v:.1f}" for k, v in r["ms_per_kind"].items())
            counted = r.get("launches_per_kind") or {}
            launched = ", ".join(
                f"{k} {c['launches']}/{c['kernels']}" for k, c in counted.items() if c
            )
            rows.append(
                [
                    r["model"],
                    r["optimizer"],
                    r["intervals"],
                    f"{r['ms']:.1f}",
                    _f(r.get("ms_vs_adamw"), ".2f"),
                    _f(r["peak_mib"], ".0f"),
                    _f(r.get("peak_vs_adamw"), ".2f"),
                    _f(r["syncs_per_step"], ".2f"),
                    _f(r["kfac_state_mib"], ".1f"),
                    str(r["reps"]),
                    kinds if r["intervals"] != "-" else "",
                    launched,
                ]
            )
        out += _table(
            [
                "model",
                "optimizer",
                "F/I",
                "ms/step",
                "× AdamW",
                "peak MiB",
                "mem × AdamW",
                "host syncs/step",
                "K-FAC state MiB",
                "reps",
                "ms per step kind",
                "launches/kernels per step kind",
            ],
            rows,
        )
        out.append(
            f"\nms/step: per-kind medians weighted by each kind's share of a cycle; "
            f"{st['warmup_reps']} warm-up repetitions excluded, at most {st['max_reps']} timed."
        )
        out += ["", "## The switches that wait for a GPU", ""]
        out.append(
            "Each switch's step against the same step without it (the variants above); a "
            "switch not faster on either model, beyond the run-to-run noise, has not earned "
            "its place (docs/optimizers.md)."
        )
        out += ["", *_table(SWITCH_HEADERS, switch_rows(st["rows"]))]

    out += ["", "## The recommended recipe's stages (benchmarks/stages.py)", ""]
    sg = results["stages"]
    out += _status(sg)
    if "results" in sg:
        import stages_report  # the tables of docs/performance.md, from this run

        doc = sg["results"]
        headline = json.loads(stages_report.HEADLINE.read_text())
        source = f"`{Path(sg['json']).name}`"
        table = stages_report.render(doc, source)
        out += [table, "", stages_report.render_floors(doc, headline, source)]

    out += ["", "## eigh vs one QR refresh (float32, on the device)", ""]
    eq = results["eigh_vs_qr"]
    out += _status(eq)
    if eq.get("rows"):
        rows = [
            [str(r["n"]), "-", "-", "-", r["skipped"]]
            if "skipped" in r
            else [
                str(r["n"]),
                f"{r['eigh_ms']:.2f}",
                f"{r['qr_ms']:.2f}",
                f"{r['eigh_over_qr']:.1f}",
                f"{r['qr_eigenvalue_rel_error']:.1e}",
            ]
            for r in eq["rows"]
        ]
        out += _table(["n", "eigh ms", "QR refresh ms", "eigh / QR", "QR eigenvalue error"], rows)

    out += ["", "## Adapter under a one-rank process group", ""]
    pg = results["process_group"]
    out += _status(pg)
    if "max_abs_diff" in pg:
        out.append(
            f"{pg['backend']}, world size 1, {pg['steps']} K-FAC steps: max |preconditioned "
            f"grad with group − without| = {pg['max_abs_diff']:.2e} ({pg['note']})"
        )
    errors = [p for p in PART_ORDER if "error" in results[p]]
    errors += [
        f"step_time {r['model']} {r['optimizer']} {r['intervals']}"
        for r in st.get("rows", [])
        if "error" in r
    ]
    out += ["", f"parts with errors: {', '.join(errors) if errors else 'none'}"]
    out.append(f"total {results['seconds']:.0f} s of a {results['budget_s']:.0f} s budget")
    return "\n".join(out) + "\n"


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="tiny sizes on the CPU: a smoke test")
    p.add_argument("--budget", type=float, default=480.0, help="seconds for the whole script")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument(
        "--out",
        default=None,
        help="prefix of the outputs (default benchmarks/results/gpu; --quick: a temporary "
        "directory)",
    )
    p.add_argument("--no-tests", action="store_true", help="skip the test subset")
    p.add_argument("--test-timeout", type=float, default=150.0, help="seconds for pytest")
    p.add_argument(
        "--models",
        nargs="+",
        choices=["lm", "cnn"],
        default=["lm", "cnn"],
        help="step_time models: lm (GPT-2-small-sized transformer), cnn (ResNet-50); default both",
    )
    p.add_argument("--steps", type=int, default=10, help="timed repetitions at most")
    p.add_argument("--warmup", type=int, default=2, help="warm-up repetitions")
    p.add_argument("--lm-vocab", type=int, default=256, help="LM vocabulary (50257: GPT-2's)")
    p.add_argument("--cnn-size", type=int, default=224, help="CNN input side (224 or 112)")
    p.add_argument("--max-factor-dim", type=int, default=4096, help="wider factor sides: diagonal")
    p.add_argument(
        "--sizes",
        type=int,
        nargs="+",
        default=[256, 768, 1024, 3072, 4096],
        help="matrix sides n of the eigh_vs_qr part (--quick: 16 32)",
    )
    p.add_argument("--linalg-reps", type=int, default=3, help="timed eigh/QR repetitions")
    p.add_argument("--lr", type=float, default=1e-3, help="SGD learning rate")
    p.add_argument("--seed", type=int, default=0, help="seed of weights, batches, matrices")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    if p.parse_args(argv).quick:  # the quick mode's defaults; options given still count
        p.set_defaults(
            steps=3, warmup=1, sizes=[16, 32], linalg_reps=2, max_factor_dim=None, threads=1
        )
        p.set_defaults(device="cpu")
    args = p.parse_args(argv)
    if args.out is None:
        quick_dir = Path(tempfile.mkdtemp()) if args.quick else None
        args.out = str(quick_dir / "gpu" if quick_dir else ROOT / "benchmarks" / "results" / "gpu")
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    budget = Budget(args.budget)
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type == "cuda":
        torch.cuda.set_device(device)
    parts: dict[str, Callable[[], dict[str, Any]]] = {
        "environment": lambda: part_environment(args, device),
        "tests": lambda: part_tests(args, budget),
        "process_group": lambda: part_process_group(args, device),
        "eigh_vs_qr": lambda: part_eigh_vs_qr(args, device, budget),
        "step_time": lambda: part_step_time(args, device, budget, partial),
        "stages": lambda: part_stages(args, device, budget),
    }
    results: dict[str, Any] = {
        "quick": args.quick,
        "budget_s": args.budget,
        "argv": sys.argv[1:] if argv is None else argv,
        **{name: {"skipped": "not reached"} for name in PART_ORDER},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    md, js = out.with_name(out.name + ".md"), out.with_name(out.name + ".json")

    def partial(step_time: dict[str, Any]) -> None:  # the step-time part so far
        results["step_time"] = step_time
        write_outputs(results, budget, md, js)

    for name in RUN_ORDER:
        t0 = time.perf_counter()
        if name == "tests" and args.no_tests:
            results[name] = {"skipped": "--no-tests"}
        elif budget.left() <= 0:
            results[name] = {"skipped": "budget spent"}
        else:
            try:
                results[name] = parts[name]()
            except Exception as e:  # one part's failure must not stop the others
                results[name] = {
                    "error": f"{type(e).__name__}: {e}",
                    "traceback": traceback.format_exc(),
                }
                free_memory(device)
        results[name]["part_seconds"] = time.perf_counter() - t0
        print(f"[{name}: {results[name]['part_seconds']:.1f} s]", file=sys.stderr, flush=True)
        # written after every part, so that a run stopped from outside keeps what it measured
        text = write_outputs(results, budget, md, js)
    print(text)
    print(f"wrote {md} {js}")
    failed = any("error" in results[p] for p in PART_ORDER) or any(
        "error" in r for r in results["step_time"].get("rows", [])
    )
    return 1 if failed else 0


def write_outputs(results: dict[str, Any], budget: Budget, md: Path, js: Path) -> str:
    """Write the markdown and the JSON of the results so far; return the markdown."""
    results["seconds"] = time.perf_counter() - budget.start
    text = markdown(results)
    md.write_text(text)
    ordered = {k: results[k] for k in ("quick", "budget_s", "seconds", "argv", *PART_ORDER)}
    js.write_text(json.dumps(ordered, indent=1, default=str) + "\n")
    return text


if __name__ == "__main__":
    sys.exit(main())
