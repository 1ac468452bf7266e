"""K-FAC against the optimizers people train with: SGD, AdamW, Muon, SOAP and PSGD-Kron.

Run ``python benchmarks/optimizers.py`` (about 15 minutes on a 2-core CPU) or ``--quick``
(tiny models, a few steps, one seed: a smoke test, not a measurement).

Workloads
---------
- ``lm``: the character-level transformer of ``examples/transformer_lm.py`` (its data,
  model, loss and learning-rate schedule are imported, not copied), smaller than the
  example's default so that every optimizer, learning rate and seed fits the budget; K-FAC
  preconditions every layer. Metric: test loss (nats per character; bits = nats / ln 2).
- ``digits``: scikit-learn's 8×8 digits (1,438 training / 359 test images) with an MLP.
  Metric: test loss.

Optimizers
----------
``sgd`` (momentum 0.9), ``adamw``, ``muon`` (``torch.optim.Muon`` on the 2-d weights of
the hidden layers, AdamW on embeddings, norms, biases and the output layer: its documented
recipe), ``soap`` and ``kron`` (``heavyball.SOAP`` / ``heavyball.PSGDKron``, every
parameter; skipped with a note when heavyball is not installed: it is a benchmark-only
extra) and K-FAC in front of SGD with momentum: ``kfac`` (eigen, kl_clip following the
schedule as in the example), ``kfac-ekfac`` (corrected eigenvalues),
``kfac-moments`` (Adam's
step, first and second moments, in K-FAC's eigenbasis — SOAP's update with K-FAC's bases
— in front of SGD without momentum, factors and eigenbases every 5 steps),
``kfac-moments-fresh`` (``kfac-moments`` on SOAP's
schedule: factor statistics every step with decay 0.9 and eigenbases every 2 steps),
``kfac-moments-wide`` (``kfac-moments-fresh`` whose layers with a factor side wider than
512 take Muon's orthogonalized step on K-FAC's input curvature instead, their A factors
in diagonal blocks of at most 512: ``Orthogonal(wider_than=512, block=512)``, and
statistics every other step from step 256, every 4th from step 512; the recommended
recipe),
``kfac-moments-wide-whole`` (the same with every A factor whole),
``kfac-moments-wide-2`` (eigenbases every 2 steps, statistics every step, however long
the run), ``kfac-moments-wide-s2`` (factor statistics every 2 steps from the start, decay
0.81), ``kfac-moments-wide-p8`` (the wide layers' powers refreshed on the decomposition
steps that are multiples of 8: ``Orthogonal(every=8)``), ``kfac-moments-wide-nn`` (the
norm layers left out: their parameters on AdamW, as Muon's and SOAP's vectors) and
``kfac-adaptive`` (no optimizer: the quadratic model's learning rate and momentum,
Levenberg–Marquardt damping; its "learning rates" are the starting dampings). Every
optimizer gets the same schedule (linear warm-up, cosine decay to 10 %), the same
initialisation and the same batches per seed, and the same tuning budget: the learning
rates of its sweep (a factor of about 2–3 apart around a value found beforehand) on
seed 0; the best (lowest final test loss) is then run on every seed.

What is printed
---------------
Per workload: for each optimizer its learning rate, the final test loss (mean and range
over seeds), the steps and seconds at which it first reaches AdamW's mean final test loss
(mean over seeds; "never" if a seed does not), the same as ratios to AdamW's, and its
seconds per step relative to AdamW. The test loss is evaluated every ``--eval-every`` steps
(evaluation time excluded from the seconds). Outputs (``--out`` prefix, default
``benchmarks/out/optimizers``, a folder git ignores): ``.csv`` (one row per evaluation of
every run), ``_summary.csv`` (the table's numbers, one row per workload and optimizer;
``--replot`` writes it from a saved ``.csv``) and ``.png`` (test loss against seconds, best
learning rates, seed 0). The
committed results in ``benchmarks/results/`` are refreshed only when asked for by name:
``--out benchmarks/results/optimizers``.
"""

from __future__ import annotations

import argparse
import csv
import math
import re
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from race_report import first_reach  # noqa: E402
from stage_arithmetic import Muon32  # noqa: E402
from step_time import cpu_model, load_example  # noqa: E402

import kfac_func as kf  # noqa: E402
from kfac_func.adapter.settings import settings_from_keywords  # noqa: E402
from kfac_func.core.hardware import native_bf16  # noqa: E402

lm = load_example("transformer_lm")

LRS: dict[str, tuple[float, ...]] = {
    "sgd": (0.1, 0.3),
    "adamw": (1e-3, 3e-3),
    "muon": (0.02, 0.05),
    "soap": (3e-3, 1e-2),
    "kron": (1e-3, 3e-3),
    "kfac": (0.1, 0.3),
    "kfac-ekfac": (0.1, 0.3),
    "kfac-moments": (7e-3, 1.4e-2),
    "kfac-moments-fresh": (7e-3, 1.4e-2),
    "kfac-moments-wide": (7e-3, 1.4e-2),
    "kfac-moments-wide-whole": (7e-3, 1.4e-2),
    "kfac-moments-wide-2": (7e-3, 1.4e-2),
    "kfac-moments-wide-s2": (7e-3, 1.4e-2),
    "kfac-moments-wide-p8": (7e-3, 1.4e-2),
    "kfac-moments-wide-nn": (7e-3, 1.4e-2),
    "kfac-adaptive": (0.1, 1.0),  # the starting damping: no learning rate to sweep
    "kfac-muon": (0.02, 0.05),
    "kfac-muon-two-sided": (0.02, 0.05),
    "kfac-muon-kfac-head": (0.02, 0.05),
}
"""Learning-rate sweep per optimizer (Muon's is for its matrices; its AdamW part uses
AdamW's middle value)."""
OPTIMIZERS = tuple(LRS)

DEFAULT = "kfac-default"
"""``kf.KFAC(model)`` with no argument but the model: the recommended recipe untuned, its
default learning rate under the workload's schedule (``race_default.py`` evaluates it)."""


@dataclass
class Workload:
    """A model factory, its batches, its test loss, and which layers are hidden matrices."""

    name: str
    make: Callable[[], nn.Module]
    batch: Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    test_loss: Callable[[nn.Module], float]
    steps: int
    outputs: tuple[str, ...]  # names of output layers (AdamW under Muon)
    face: bool = False  # K-FAC through ``kf.KFAC`` (the optimizer face), not the parts
    # forward and loss under bfloat16 autocast, for every optimizer alike, where this CPU
    # multiplies bfloat16 natively (:data:`NATIVE_BF16`); float32 elsewhere
    autocast: bool = False


def lm_workload(
    quick: bool,
    size: tuple[int, int, int, int] = (48, 64, 2, 4),
    steps: int = 300,
    name: str = "lm",
    batch_size: int = 32,
) -> Workload:
    """The character LM; ``size``: context, d_model, blocks, heads; ``batch_size``
    windows a step (``quick``: tiny)."""
    data = lm.CharData()
    context, d_model, layers, heads = (16, 16, 1, 2) if quick else size
    batch_size = 8 if quick else batch_size
    x_test, y_test = data.test_windows(context, 8 if quick else 128)

    def make() -> nn.Module:
        return lm.CharTransformer(data.vocab, context, d_model, layers, heads)

    return Workload(
        name,
        make,
        lambda g: data.batch(batch_size, context, g),
        lm.lm_loss,
        lambda model: lm.evaluate(model, x_test, y_test),
        6 if quick else steps,
        ("head",),
    )


def digits_workload(quick: bool) -> Workload:
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x / 16.0, dtype=torch.float32)
    y = torch.tensor(y, dtype=torch.int64)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = x[perm], y[perm]
    split = round(0.8 * len(x))
    x_train, y_train, x_test, y_test = x[:split], y[:split], x[split:], y[split:]

    def make() -> nn.Module:
        return nn.Sequential(
            nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 10)
        )

    def batch(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.randint(0, split, (64,), generator=g)
        return x_train[idx], y_train[idx]

    test_loss = classifier_test_loss(x_test, y_test)
    return Workload("digits", make, batch, F.cross_entropy, test_loss, 6 if quick else 400, ("4",))


def classifier_test_loss(x: torch.Tensor, y: torch.Tensor) -> Callable[[nn.Module], float]:
    """The test loss of a classifier: cross-entropy on ``(x, y)`` in eval mode."""

    @torch.no_grad()
    def test_loss(model: nn.Module) -> float:
        model.eval()
        loss = float(F.cross_entropy(model(x), y))
        model.train()
        return loss

    return test_loss


WORKLOADS = {"lm": lm_workload, "digits": digits_workload}


def _heavyball() -> Any | None:
    try:
        import heavyball
    except ImportError:
        return None
    # eager: compiling its steps takes minutes on this CPU, and steps are what is measured
    heavyball.utils.compile_mode = None
    # its note that the schedule changes the learning rate between steps, every step
    warnings.filterwarnings("ignore", "Learning rate changed between steps", UserWarning)
    return heavyball


NATIVE_BF16 = native_bf16("cpu")
"""Whether this CPU multiplies bfloat16 natively (AVX-512 BF16 or AMX; the library's
:func:`~kfac_func.core.hardware.native_bf16`, as ``kf.KFAC`` decides). Where it does not,
Muon's Newton–Schulz iteration runs in float32 (``stage_arithmetic.Muon32``): emulated
bfloat16 products are many times slower than float32's, and a race against them would
time the emulation, not Muon."""

MUON_PRECISION = "bfloat16" if NATIVE_BF16 else "float32"
"""The dtype of the race's Muon iterations on this CPU (named in every results file)."""

WIDE = kf.Orthogonal(
    powers=(0.5, 0.0),
    wider_than=512,
    dtype=torch.bfloat16 if NATIVE_BF16 else None,
    block=512,
)
"""``kfac-moments-wide``'s orthogonalized step: the layers with a factor side wider than 512
(the race's wide MLP layers, the autoencoder's pixel-wide ones, the CNN's hidden layer)
take it, one-sided as the orthogonal recipes' (``(A + δI)^(-1/2)`` before the
Newton–Schulz iteration, G kept diagonal), in bfloat16 where this CPU multiplies it
natively, as Muon's; an A factor wider than 512 in diagonal blocks of at most 512
(``kfac-moments-wide-whole``: the same step with every A factor whole)."""

NORMS = "Norm$"
"""``kfac-moments-wide-nn``'s ``skip_layers``: the modules whose class (or name) ends in
``Norm`` (``nn.LayerNorm``, ``nn.RMSNorm``, ``nn.GroupNorm``)."""

STATISTICS = kf.adapter.recipes.STATISTICS
"""The recommended recipe's statistics schedule: every step, every other from step 256, every
4th from step 512."""

GRAM = {"gram_dtype": torch.bfloat16} if NATIVE_BF16 else {}
"""The recommended recipe's statistics: bfloat16 operands where this CPU multiplies them
natively (as ``kf.KFAC`` chooses for a float32 model)."""

MOMENTS = {"eigenbasis_moments": True, "moment_beta2": 0.95, "moment_beta1": 0.9}
"""The eigenbasis-moment settings of the ``kfac-moments-fresh`` family (Adam's step in
K-FAC's eigenbasis, β₁ 0.9 and β₂ 0.95, as SOAP's)."""


def _wide(inv: Any, orthogonal: kf.Orthogonal, factor: Any = 1, **extra: Any) -> tuple[Any, ...]:
    """A ``kfac-moments-wide`` variant of :data:`KFAC`: eigenbases every ``inv`` steps (or
    on that schedule), ``orthogonal`` on the wide layers, statistics every ``factor`` steps
    (or on that schedule) with the decay that keeps 0.9's memory in steps, and the
    preconditioner arguments ``extra``."""
    settings = {**MOMENTS, **GRAM, "orthogonal": orthogonal, **extra}
    decay = 0.9 if factor == 1 else kf.step.DecayPerStep(0.9, factor)
    return ("eigen", 0.0, 0.0, None, (factor, inv), decay, settings)


KFAC = {
    # name: (compute method, SGD momentum, dampening, kl_clip, factor/inverse update
    # steps, factor decay, settings of the preconditioner)
    "kfac": ("eigen", 0.9, 0.0, 3e-5, (1, 5), 0.95, {}),
    "kfac-ekfac": ("ekfac", 0.9, 0.0, 3e-5, (1, 5), 0.95, {}),
    # Adam in K-FAC's eigenbasis (SOAP's update with K-FAC's bases): the first moment
    # inside the preconditioner, so SGD takes no momentum
    "kfac-moments": (
        "eigen",
        0.0,
        0.0,
        None,
        (5, 5),
        0.8,
        {"eigenbasis_moments": True, "moment_beta2": 0.95, "moment_beta1": 0.9},
    ),
    # SOAP's schedule (statistics of every step, a short running average, the eigenbases
    # two steps old at most): a stale eigenbasis is what kept kfac-moments behind SOAP
    "kfac-moments-fresh": ("eigen", 0.0, 0.0, None, (1, 2), 0.9, MOMENTS),
    # the recommended recipe (kf.KFAC's): kfac-moments-fresh with the layers that have a
    # side wider than 512 on the orthogonalized step (no Gram and no eigh of their G
    # factors, their A factors in blocks), eigenbases every 2 steps, fewer in long runs,
    # and statistics every other step from step 256, every 4th from step 512
    "kfac-moments-wide": _wide(kf.step.GrowingInterval(), WIDE, factor=STATISTICS),
    # the same with the wide layers' A factors whole (decomposed as one matrix)
    "kfac-moments-wide-whole": _wide(
        kf.step.GrowingInterval(), WIDE._replace(block=None), factor=STATISTICS
    ),
    # the same with eigenbases every 2 steps and statistics every step however long the run
    "kfac-moments-wide-2": _wide(2, WIDE),
    # the same with statistics every 2 steps from the start (decay 0.81: the same memory
    # in steps)
    "kfac-moments-wide-s2": _wide(kf.step.GrowingInterval(), WIDE, factor=2),
    # the same with the wide layers' powers refreshed on every 8th step at most (on the
    # decomposition steps that are multiples of 8): their step reads the factors through
    # a smooth power, not an eigenbasis that must be fresh
    "kfac-moments-wide-p8": _wide(
        kf.step.GrowingInterval(), WIDE._replace(every=8), factor=STATISTICS
    ),
    # the same with the norm layers left out (skip_layers): their weights and biases on
    # AdamW, as Muon's and SOAP's vectors are, and no statistics of them in the hooks
    "kfac-moments-wide-nn": _wide(
        kf.step.GrowingInterval(), WIDE, factor=STATISTICS, skip_layers=[NORMS]
    ),
    # the quadratic model's learning rate and momentum, adaptive damping ("lr": its start)
    "kfac-adaptive": ("eigen", 0.0, 0.0, None, (1, 5), 0.95, {}),
}
"""The K-FAC variants, all with ``scaling="fisher"``."""

ORTHOGONAL: dict[str, tuple[str, tuple[float, float]]] = {
    "kfac-muon": ("orthogonal-two-sided", (0.5, 0.0)),
    "kfac-muon-two-sided": ("orthogonal-two-sided", (0.25, 0.25)),
    "kfac-muon-kfac-head": ("orthogonal-kfac-head", (0.5, 0.0)),
}
"""The orthogonal settings of ``kf.KFAC`` (Muon's step on K-FAC's curvature), by the name
they race under: the recipe and the powers of A and G (``kfac-muon`` is the two-sided
recipe made one-sided, what the retired recipe ``"orthogonal"`` was). As Muon's, their
hidden matrices take the learning rate swept and the parameters left to AdamW take
AdamW's middle value; the workload's output layers (``Workload.outputs``) are the head
(``ortho_skip``)."""


class Stepper:
    """One optimizer (and preconditioner) over a model: ``zero_grad``, ``step``, and the
    learning-rate scheduler stepping. K-FAC's variants follow the recipe: SGD on the
    parameters it preconditions, AdamW on the others (none in these workloads)."""

    def __init__(
        self,
        name: str,
        model: nn.Module,
        lr: float,
        w: Workload,
        steps: int,
        settings: dict[str, Any] | None = None,
    ) -> None:
        """``settings``: keyword arguments that replace the recipe's (``betas`` of AdamW,
        ``momentum`` of SGD or Muon, ``damping`` or a preconditioner argument of K-FAC,
        any argument of SOAP / PSGD-Kron); None: the recipe as it is."""
        self.pre: kf.KFACPreconditioner | None = None
        self.face: kf.KFAC | None = None
        self.opts: list[torch.optim.Optimizer] = []
        self.loss = w.loss
        self.model = model
        schedule = lm.lr_schedule(max(1, steps // 10), steps)
        params = list(model.parameters())
        s = dict(settings or {})
        if name == DEFAULT:
            if s:
                raise ValueError(f"{DEFAULT} takes no settings (it is kf.KFAC(model)), got {s}")
            self.face = kf.KFAC(model)
            self.pre = self.face.preconditioner
            self.opts = [self.face]
        elif name in KFAC:
            self._kfac(name, model, lr, schedule, s, w.face)
        elif name in ORTHOGONAL:
            self.face = _orthogonal_face(name, model, lr, s, w.outputs)
            self.pre = self.face.preconditioner
            self.opts = [self.face]
        elif name == "sgd":
            self.opts = [torch.optim.SGD(params, lr=lr, **{"momentum": 0.9, **s})]
        elif name == "adamw":
            self.opts = [torch.optim.AdamW(params, lr=lr, **{"weight_decay": 0.0, **s})]
        elif name == "muon":
            hidden = [
                p
                for n, p in model.named_parameters()
                if p.dim() == 2 and not n.startswith(w.outputs) and "embedding" not in n
            ]
            ids = {id(p) for p in hidden}
            rest = [p for p in params if id(p) not in ids]
            self.opts = [
                (torch.optim.Muon if NATIVE_BF16 else Muon32)(
                    hidden, lr=lr, **{"adjust_lr_fn": "match_rms_adamw", **s}
                ),
                torch.optim.AdamW(rest, lr=LRS["adamw"][-1], weight_decay=0.0),
            ]
        else:
            hb = _heavyball()
            assert hb is not None
            cls = hb.SOAP if name == "soap" else hb.PSGDKron
            self.opts = [cls(params, lr=lr, **s)]
        self.schedulers = [torch.optim.lr_scheduler.LambdaLR(o, schedule) for o in self.opts]

    def _kfac(
        self,
        name: str,
        model: nn.Module,
        lr: float,
        schedule: Callable[[int], float],
        settings: dict[str, Any],
        face: bool = False,
    ) -> None:
        method, momentum, dampening, clip, (fac, inv), decay, extra = KFAC[name]
        adaptive = name == "kfac-adaptive"
        damping = settings.pop("damping", lr if adaptive else 1e-3)
        kwargs: dict[str, Any] = {
            "damping": damping,
            "factor_decay": decay,
            "factor_update_steps": fac,
            "inv_update_steps": inv,
            "kl_clip": None if clip is None else (lambda step: clip * schedule(step) ** 2),
            "scaling": "fisher",
            "compute_method": method,
            **extra,
            **settings,
        }
        if face:  # one torch.optim.Optimizer: the preconditioner, SGD and AdamW inside
            if adaptive:
                raise ValueError("kfac-adaptive has no optimizer face")
            self.face = kf.KFAC(
                model,
                lr=lr,
                recipe="kfac-pytorch",  # every setting of the variant is given here
                base=torch.optim.SGD,
                base_kwargs={"momentum": momentum, "dampening": dampening},
                others=torch.optim.AdamW,
                others_kwargs={"lr": LRS["adamw"][-1], "weight_decay": 0.0},
                **kwargs,
            )
            self.pre = self.face.preconditioner
            self.opts = [self.face]
            return
        mine, rest = kf.register(model, kwargs.get("skip_layers")).split_parameters(model)
        sgd = torch.optim.SGD(mine, lr=lr, momentum=momentum, dampening=dampening)
        self.opts = [] if adaptive else [sgd]
        if rest:
            self.opts.append(torch.optim.AdamW(rest, lr=LRS["adamw"][-1], weight_decay=0.0))
        if adaptive:
            kwargs["adaptive"] = kf.adapter.AdaptiveStepper(model, loss="cross_entropy")
        # kfac-pytorch's arguments by name, the variant's other settings as one kf.Settings
        settings = settings_from_keywords(kwargs, name, warn=False)
        self.pre = kf.KFACPreconditioner(
            model, lr=lambda step: sgd.param_groups[0]["lr"], settings=settings, **kwargs
        )

    def zero_grad(self) -> None:
        self.model.zero_grad(set_to_none=True)

    def step(self, x: torch.Tensor, y: torch.Tensor, loss: torch.Tensor) -> None:
        if self.pre is not None and self.pre.adaptive is not None:
            self.pre.step(inputs=x, loss=loss, loss_closure=lambda: self.loss(self.model(x), y))
        elif self.pre is not None and self.face is None:  # the face steps its own
            self.pre.step()
        for o, s in zip(self.opts, self.schedulers):
            o.step()
            s.step()


def _orthogonal_face(
    name: str, model: nn.Module, lr: float, settings: dict[str, Any], outputs: tuple[str, ...]
) -> kf.KFAC:
    """``kf.KFAC`` with the orthogonal recipe and powers of ``name`` (:data:`ORTHOGONAL`),
    the powers from ``settings["ortho_powers"]`` when given, the layers under ``outputs``
    as the head; the other ``settings`` are preconditioner arguments."""
    recipe_name, default = ORTHOGONAL[name]
    recipe = kf.RECIPES[recipe_name]
    base = recipe.settings.orthogonal
    assert base is not None
    powers = tuple(settings.pop("ortho_powers", default))
    head = "^(" + "|".join(re.escape(o) for o in outputs) + r")(\.|$)"
    return kf.KFAC(
        model,
        lr=lr,
        recipe=recipe,
        orthogonal=base._replace(powers=powers, skip=head),
        others_kwargs={"lr": LRS["adamw"][-1]},
        **settings,
    )


def run(name: str, lr: float, w: Workload, seed: int, eval_every: int) -> list[dict[str, float]]:
    """Train once; one row per evaluation: step, seconds (training only), test loss."""
    return train(name, lr, w, seed, eval_every)[0]


def train(
    name: str,
    lr: float,
    w: Workload,
    seed: int,
    eval_every: int,
    settings: dict[str, Any] | None = None,
) -> tuple[list[dict[str, float]], dict[str, float]]:
    """Train once: the rows of :func:`run`, and the training seconds split into
    ``fwd_bwd_seconds`` (zero_grad, forward, loss, backward: K-FAC's statistics hooks run
    here) and ``optimizer_seconds`` (preconditioner, optimizers and schedulers), with
    ``steps``, the steps taken (fewer than ``w.steps`` where the loss stopped being
    finite). Batches and evaluations are not timed. ``settings``: see :class:`Stepper`."""
    torch.manual_seed(seed)
    model = w.make()
    stepper = Stepper(name, model, lr, w, w.steps, settings)
    batches = torch.Generator().manual_seed(1000 + seed)
    rows = [{"step": 0, "seconds": 0.0, "test_loss": w.test_loss(model)}]
    fwd_bwd = opt = 0.0
    step = 0
    for step in range(1, w.steps + 1):
        x, y = w.batch(batches)
        start = time.perf_counter()
        stepper.zero_grad()
        with torch.autocast("cpu", torch.bfloat16, enabled=w.autocast and NATIVE_BF16):
            loss = w.loss(model(x), y)
        loss.backward()
        middle = time.perf_counter()
        stepper.step(x, y, loss.detach())
        end = time.perf_counter()
        fwd_bwd += middle - start
        opt += end - middle
        if step % eval_every == 0 or step == w.steps:
            loss = w.test_loss(model)
            rows.append({"step": step, "seconds": fwd_bwd + opt, "test_loss": loss})
            if not math.isfinite(loss):
                break
    if stepper.pre is not None:
        stepper.pre.remove()
    return rows, {"fwd_bwd_seconds": fwd_bwd, "optimizer_seconds": opt, "steps": step}


def _fmt(v: float) -> str:
    if math.isinf(v):
        return "never"
    return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"


def summary(workload: str, results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per optimizer (the numbers of :func:`table`, unrounded); the targets are
    AdamW's final test loss on the same seed."""
    adam = results["adamw"]
    targets = [r[-1]["test_loss"] for r in adam["runs"]]
    adam_steps, adam_secs = zip(*(first_reach(r, t) for r, t in zip(adam["runs"], targets)))
    adam_per = statistics.mean(r[-1]["seconds"] / r[-1]["step"] for r in adam["runs"])
    rows = []
    for name, res in results.items():
        finals = [r[-1]["test_loss"] for r in res["runs"]]
        reach = [first_reach(r, t) for r, t in zip(res["runs"], targets)]
        steps = statistics.mean(s for s, _ in reach)
        secs = statistics.mean(t for _, t in reach)
        per = statistics.mean(r[-1]["seconds"] / max(1, r[-1]["step"]) for r in res["runs"])
        rows.append(
            {
                "workload": workload,
                "optimizer": name,
                "lr": res["lr"],
                "seeds": len(finals),
                "target_mean": statistics.mean(targets),
                "final_mean": statistics.mean(finals),
                "final_min": min(finals),
                "final_max": max(finals),
                "steps_to_target": steps,
                "seconds_to_target": secs,
                "steps_over_adamw": steps / statistics.mean(adam_steps),
                "seconds_over_adamw": secs / statistics.mean(adam_secs),
                "seconds_per_step_over_adamw": per / adam_per,
            }
        )
    return rows


def table(workload: str, results: dict[str, dict[str, Any]]) -> str:
    """One line per optimizer; targets are AdamW's final test loss on the same seed."""
    rows = summary(workload, results)
    lines = [
        f"{workload}: target = AdamW's final test loss on the same seed "
        f"(mean {rows[0]['target_mean']:.4f})",
        f"{'optimizer':>16} {'lr':>7} {'final (mean)':>12} {'range':>15} "
        f"{'steps to':>9} {'secs to':>8} {'steps/AdamW':>11} {'secs/AdamW':>10} {'s/step':>7}",
    ]
    for r in rows:
        lines.append(
            f"{r['optimizer']:>16} {r['lr']:>7.3g} {r['final_mean']:>12.4f} "
            f"{r['final_min']:>7.4f}-{r['final_max']:<7.4f} {_fmt(r['steps_to_target']):>9} "
            f"{_fmt(r['seconds_to_target']):>8} {_fmt(r['steps_over_adamw']):>11} "
            f"{_fmt(r['seconds_over_adamw']):>10} {r['seconds_per_step_over_adamw']:>7.2f}"
        )
    return "\n".join(lines)


def write_summary(path: Path, rows: list[dict[str, Any]]) -> None:
    """The rows of :func:`summary` of every workload as a CSV (the numbers the docs quote)."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def plot(path: Path, workload: str, results: dict[str, dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, res in results.items():
        rows = res["runs"][0]
        ax.plot([r["seconds"] for r in rows], [r["test_loss"] for r in rows], label=name)
    ax.set_xlabel("training seconds")
    ax.set_ylabel("test loss")
    ax.set_title(f"{workload}: best learning rate, seed 0")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="smoke test: tiny models, few steps")
    p.add_argument(
        "--workloads",
        nargs="+",
        choices=sorted(WORKLOADS),
        default=["lm", "digits"],
        help="tasks to train (default: lm digits)",
    )
    p.add_argument(
        "--optimizers",
        nargs="+",
        choices=OPTIMIZERS,
        default=list(OPTIMIZERS),
        help="optimizers to compare (default: all; adamw, the reference, is always added)",
    )
    p.add_argument(
        "--seeds",
        type=int,
        default=3,
        help="seeds 0..N-1 (default 3): seed 0 sweeps the learning rates, the rest rerun the best",
    )
    p.add_argument(
        "--eval-every", type=int, default=25, help="test loss every N steps (default 25)"
    )
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    p.add_argument(
        "--out",
        default=str(ROOT / "benchmarks" / "out" / "optimizers"),
        help="output prefix of the CSV and plots (default benchmarks/out/optimizers, "
        "untracked; --quick: a temporary folder); pass benchmarks/results/optimizers to "
        "refresh the committed results",
    )
    p.add_argument(
        "--replot", metavar="CSV", help="print the tables and draw the plots of a saved run"
    )
    args = p.parse_args(argv)
    if args.quick:
        args.seeds, args.eval_every = 1, 2
        args.out = str(Path(tempfile.mkdtemp()) / "optimizers")
    if "adamw" not in args.optimizers:
        args.optimizers = ["adamw", *args.optimizers]  # the reference
    return args


def replot(path: str, out: str) -> None:
    """The tables, plots and summary CSV (``OUT_summary.csv``) of a saved ``.csv`` (the best
    learning rate is the one run on every seed; with one seed, the lowest final test
    loss)."""
    summaries: list[dict[str, Any]] = []
    runs: dict[tuple[str, str, float, int], list[dict[str, float]]] = {}
    with open(path) as f:
        for row in csv.DictReader(f):
            key = (row["workload"], row["optimizer"], float(row["lr"]), int(row["seed"]))
            runs.setdefault(key, []).append(
                {k: float(row[k]) for k in ("step", "seconds", "test_loss")}
            )
    for workload in dict.fromkeys(k[0] for k in runs):
        results: dict[str, dict[str, Any]] = {}
        for name in dict.fromkeys(k[1] for k in runs if k[0] == workload):
            mine = {k: v for k, v in runs.items() if k[:2] == (workload, name)}
            seeded = {k[2] for k in mine if k[3] > 0}
            lrs = {k[2] for k in mine}
            best = (
                next(iter(seeded))
                if seeded
                else min(lrs, key=lambda lr: _final(mine[(workload, name, lr, 0)]))
            )
            seeds = sorted(k[3] for k in mine if k[2] == best)
            results[name] = {"lr": best, "runs": [mine[(workload, name, best, s)] for s in seeds]}
        print(table(workload, results))
        plot(Path(f"{out}_{workload}.png"), workload, results)
        summaries += summary(workload, results)
    write_summary(Path(f"{out}_summary.csv"), summaries)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    if args.replot:
        replot(args.replot, args.out)
        return
    torch.set_num_threads(args.threads)
    if _heavyball() is None:
        missing = [o for o in args.optimizers if o in ("soap", "kron")]
        if missing:
            print(f"heavyball is not installed: {missing} skipped (pip install heavyball)")
        args.optimizers = [o for o in args.optimizers if o not in ("soap", "kron")]
    print(f"torch {torch.__version__} | {cpu_model()} | threads {args.threads}")
    rows_out: list[dict[str, Any]] = []
    summaries: list[dict[str, Any]] = []
    for wname in args.workloads:
        w = WORKLOADS[wname](args.quick)
        results: dict[str, dict[str, Any]] = {}
        for name in args.optimizers:
            lrs = LRS[name][:1] if args.quick else LRS[name]
            sweep = {lr: run(name, lr, w, 0, args.eval_every) for lr in lrs}
            best = min(sweep, key=lambda lr: _final(sweep[lr]))
            runs = [sweep[best]] + [
                run(name, best, w, seed, args.eval_every) for seed in range(1, args.seeds)
            ]
            results[name] = {"lr": best, "runs": runs}
            for lr, rows in sweep.items():
                rows_out += [
                    {"workload": wname, "optimizer": name, "lr": lr, "seed": 0, **r} for r in rows
                ]
            for seed, rows in enumerate(runs[1:], start=1):
                rows_out += [
                    {"workload": wname, "optimizer": name, "lr": best, "seed": seed, **r}
                    for r in rows
                ]
        print(table(wname, results))
        plot(Path(f"{args.out}_{wname}.png"), wname, results)
        summaries += summary(wname, results)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(f"{args.out}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows_out[0]))
        writer.writeheader()
        writer.writerows(rows_out)
    write_summary(Path(f"{args.out}_summary.csv"), summaries)
    print(f"wrote {args.out}.csv, {args.out}_summary.csv and {args.out}_<workload>.png")


def _final(rows: list[dict[str, float]]) -> float:
    loss = rows[-1]["test_loss"]
    return loss if math.isfinite(loss) else math.inf


if __name__ == "__main__":
    main()
