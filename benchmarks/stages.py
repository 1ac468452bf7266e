"""Each stage of the recommended K-FAC step timed apart, beside Muon's, SOAP's and AdamW's
steps on the same model and batch, with each K-FAC stage's arithmetic floor.

``python benchmarks/stages.py`` times the race's language models (``lm``, ``lm4x``,
``gpt2``: ``race_workloads.py``'s builders, sizes and batches) and writes
``benchmarks/results/stages.json``; ``--quick`` (the race's tiny models, two
repetitions, a temporary folder) is the smoke test of the tests; ``--device cuda`` times
the same on a GPU (``benchmarks/gpu.py`` runs it there). Only ratios from one run
compare: the device, the thread count and the machine's load move every number.

The recipe
----------
The recommended recipe (``race_report.RECIPE``, ``kfac-moments-wide`` of
``benchmarks/optimizers.py``, what ``kf.KFAC(model)`` runs): ``KFACPreconditioner`` (on
``gpt2`` inside ``kf.KFAC``, as the race runs it) with ``scaling="fisher"``, Adam's first
and second moments in K-FAC's eigenbasis (β₁ 0.9, β₂ 0.95), factor statistics every step
with decay 0.9, eigendecompositions every 2 steps, SGD without momentum after it; the
layers with a factor side wider than 512 take Muon's step on K-FAC's input curvature
instead (``Orthogonal(powers=(0.5, 0), wider_than=512)``: their G factors diagonal, their
A factor's damped ``-1/2`` power recomputed at each decomposition); the library's
defaults otherwise (``grouped``: layers of one shape computed as stacks on accelerators,
one at a time on a CPU; the stage rows call the stages as the step does). On ``lm``
and ``gpt2`` no side is that wide and the recipe is ``kfac-moments-fresh`` exactly; on
``lm4x`` the attention's input projection and both MLP layers are wide.

What each row times (the library's own functions, called as the step calls them)
-------------------------------------------------------------------------------
The K-FAC stages run on a snapshot of the recipe's state taken after the warm-up (its
factors, eigenbases and moments as training left them), so every repetition does the
same work; the snapshot is never changed (each stage gets its own copy of the layer
dict, and the stage functions return new tensors).

- ``plain forward+backward``: ``zero_grad``, forward, loss, backward of a copy of the
  model without hooks.
- ``forward+backward with K-FAC's hooks``: the same on the recipe's model, whose hooks
  build each call's Gram matrices (``update_factors_in_hook``); ``statistics in the
  hooks`` is the difference of the two medians.
- ``batch factors``: ``KFACPreconditioner._settle`` and ``_batch_factors`` (what
  ``step()`` calls first: the calls' Grams summed and scaled per group,
  ``step/batch_factors.py``).
- ``fold``: ``step.accumulate.fold_layers`` (the running averages, their
  finiteness checks).
- ``decomposition: eigh``: ``step.decompose.decompose_layers`` (grouped, or with
  ``batched_eigh``: one batched ``eigh`` per shape, its checks, the precomputed
  ``1/(dg daᵀ + λ)``, the lone factors one by one; else factor by factor); ``of which the
  batched eighs``: ``step.decompose_groups.batched_eigenpairs``, the first thing that
  function calls; ``decomposition: QR refresh``: the same function
  with the state's ``eigenbasis_refresh="qr"`` (one warm-started power iteration + QR
  per factor, from the snapshot's eigenbases, factor by factor: refreshed sides are not
  batched; not the recipe's setting).
- ``carry moments``: ``step.basis.carry_moments`` (the moments rotated into the new
  eigenbases after an ``eigh``).
- ``powers of the wide layers``: ``step.orthogonal.prepare_layers`` on the freshly
  decomposed layers (the damped factor powers of the layers taking the orthogonalized
  step, after an ``eigh``; absent where no layer is that wide).
- ``precondition stage``: ``step.grouped.precondition_layers`` (gradients to
  matrices, stacking, the finiteness checks, the projections and the moments under
  ``vmap``, matrices back to gradients). The stage does not separate its parts, so two
  nearest separable units are timed beside it on the same stacks of each group (the
  groups of ``step.grouping.plan_groups``): ``projections``, the core functions
  ``core.basis_moments.to_basis`` + ``from_basis`` that the stage calls, and
  ``moments``, ``core.basis_moments.adam_in_basis`` with identity bases (its
  elementwise part only); on the wide layers, ``powers applied``
  (``core.orthogonal.apply_powers``) and ``Newton–Schulz``
  (``core.orthogonal.newton_schulz``, in the recipe's iteration dtype) on the same stacks
  of their momenta (a blocked layer's column blocks, as the step iterates them).
  ``rest of the precondition stage`` is the stage minus those.
- ``write-back to .grad``: ``adapter.grads.copy_back``; ``parameter update``: the
  recipe's base optimizers' ``step()`` (SGD; on ``gpt2`` AdamW too, for the tied
  embeddings).
- ``K-FAC optimizer part``: the real ``pre.step()`` + optimizers (the race's
  "optimizer" milliseconds), in training steps of their own, by kind: steps with and
  without an ``eigh``; ``amortized`` is the median over repetitions of the mean of two
  consecutive steps (one of each). ``not in a stage row`` is the amortized step minus
  the sum of the stage rows (the adapter's and ``update``'s bookkeeping).
- ``Muon, as the race runs it``: Muon over the hidden 2-D weights + AdamW over the rest,
  as the race builds it: ``torch.optim.Muon`` (its Newton–Schulz iteration in bfloat16)
  where the CPU multiplies bfloat16 natively, else the same step in float32
  (:class:`Muon32`, ``machine.muon_newton_schulz`` in the JSON); its floor at that
  precision's rate. ``Muon, float32 Newton–Schulz``: the float32 step wherever, so that
  a comparison never rests on a bfloat16 product the CPU only emulates (the JSON records
  the CPU's bfloat16 flags and both matmul rates).
  ``SOAP``: ``heavyball.SOAP`` (eager; its preconditioner every 2 steps: the mean of
  two consecutive steps, as K-FAC's amortized step). ``AdamW``: ``torch.optim.AdamW``.
- ``whole training step``: each optimizer's forward+backward and optimizer part in its
  own training steps.

Under bfloat16 autocast (``--autocast``)
---------------------------------------
Where the CPU multiplies bfloat16 natively, ``--autocast`` runs every forward and loss
(plain, with the hooks, and in every optimizer's training steps) under
``torch.autocast(..., torch.bfloat16)``, as people train, and writes
``benchmarks/results/stages_bf16.json``. Beside the recipe it times the recipe as it was
before its statistics and schedule changed (``before``: ``kfac-moments-wide-2``, eigenbases
every 2 steps, with ``gram_dtype=torch.float32``, the hooks' Grams in float32 inside the
autocast region), in training steps of its own; the recipe's step is also amortized
over ``HORIZON`` (2,000) steps of its schedule: its optimizer part from its medians with
and without an ``eigh``, the steps past 256 that gather no statistics as one without an
``eigh`` less the batch factors and the fold, their forward+backward the plain one. Each
workload's ``targets`` hold the ratios the precision issue set: the forward+backward with
the hooks over the plain one, and K-FAC's whole step over Muon's (both Muon and K-FAC
under the same autocast), before and after.

Floors
------
Next to each K-FAC stage, its arithmetic: the multiply-adds of its products and the
bytes its elementwise work must at least read and write, and the milliseconds these
take at the machine's rates measured in the same run (one large float32 matmul, and one
in bfloat16; one large elementwise add for the memory bandwidth; the higher of a
measurement before and after the workloads). The multiply-adds
(``benchmarks/stage_arithmetic.py``): a Gram of ``r`` rows of width ``n``, ``r·n²``
(full products, as torch computes them; at the bfloat16 rate where the recipe's
``gram_dtype`` is bfloat16); an ``n``-wide ``eigh``, ``(4/3)·n³``; a QR
refresh, ``(7/3)·n³``; the projections, the four products of ``Qgᵀ M Qa`` and
``Qg V Qaᵀ``; the carry, ``Q_newᵀ Q_old`` per side and the moments' two sandwiches.
Elementwise stages (batch factors, fold, moments, write-back, update) count bytes only.
Muon's floor is its Newton–Schulz products (5 iterations of ``2·m²·n + m³`` for an
``m × n`` matrix, ``m ≤ n``), at the rate of the precision its row runs in (bfloat16
for ``torch.optim.Muon``, float32 for :class:`Muon32`); the wide layers' iteration counts
the same, at the rate of its dtype, their powers ``n³`` per dense side (``Q diag Qᵀ``)
and the products applying them one matmul per side. ``× floor`` is a row's time over its floor.
``whole step at the floors`` adds the plain forward+backward (as measured: the model's
own arithmetic), the statistics at their floor and the amortized optimizer part at its
floor: what the recipe's step would cost with no overhead at all, to set beside the
other optimizers' whole steps.

Timing
------
``torch.set_num_threads(--threads)`` (1). After ``--warmup`` rounds, each of ``--reps``
repetitions runs every unit once, in an order reversed every other repetition, so that
the machine's noise hits them alike; the table gives medians (derived rows: differences
and sums of medians). Nothing is asserted about time anywhere.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]  # this checkout's kfac_func
import optimizers  # noqa: E402
import race  # noqa: E402
import race_report as rr  # noqa: E402
import race_workloads as rw  # noqa: E402
from stage_arithmetic import (  # noqa: E402
    EIGH_MACS,
    NS_STEPS,
    QR_MACS,
    Floor,
    bf16_flags,
    cube_macs,
    float32_muon,
    measure_rates,
    newton_schulz_macs,
    sided_macs,
    synchronize,
    tensor_bytes,
)
from step_time import checked_out, print_table  # noqa: E402

import kfac_func as kf  # noqa: E402
from kfac_func.adapter.grads import copy_back  # noqa: E402
from kfac_func.core.basis_moments import adam_in_basis, from_basis, to_basis  # noqa: E402
from kfac_func.core.orthogonal import FactorPowers, apply_powers, newton_schulz  # noqa: E402
from kfac_func.core.preconditioning import column_blocks  # noqa: E402
from kfac_func.state import KFACState, LayerState  # noqa: E402
from kfac_func.step.accumulate import fold_layers  # noqa: E402
from kfac_func.step.basis import basis_of, carry_moments, moment_bases  # noqa: E402
from kfac_func.step.checks import layer_grads  # noqa: E402
from kfac_func.step.decompose import decompose_layers  # noqa: E402
from kfac_func.step.decompose_groups import (  # noqa: E402
    batched_eigenpairs,
    needs_decomposition,
)
from kfac_func.step.grouped import precondition_layers  # noqa: E402
from kfac_func.step.grouping import grouped_here, plan_groups  # noqa: E402
from kfac_func.step.orthogonal import orthogonal_layers, prepare_layers  # noqa: E402

RECIPE = rr.RECIPE
BEFORE = "before"
"""The stepper of ``--autocast`` runs that times the recipe as it was before its statistics
and schedule changed: ``kfac-moments-wide-2`` (eigenbases every 2 steps however long the
run) with float32 statistics (``gram_dtype=torch.float32``: the hooks' Grams in float32
inside the autocast region)."""
NORMS = "kfac-moments-wide-nn"
"""The stepper of ``--autocast`` runs that times the recipe with its norm layers left out
(their parameters on AdamW, as Muon's and SOAP's vectors; ``benchmarks/optimizers.py``),
in training steps of its own beside the recipe's."""
HORIZON = 2000
"""The run over which the recipe's growing refresh interval is amortized (``lm_long``'s
steps)."""
QUICK_WIDE = 48
"""``--quick``'s ``wider_than`` for the recipe: the tiny models have no side wider than
512, so the smoke test makes their MLP and head layers the wide ones (their attention
and norms stay narrow) and times every row of the recipe."""
WORKLOADS = ("lm", "lm4x", "gpt2")
RESULTS = ROOT / "benchmarks" / "results"
EXCLUDE = ("benchmarks/results",)
"""Paths a run writes: changes there do not make the tree dirty."""


def recipe_overrides(quick: bool) -> dict[str, Any]:
    """The recipe's settings this run replaces: none, or under ``--quick`` its
    orthogonalized step with ``wider_than=QUICK_WIDE``.

    Example:
        >>> recipe_overrides(True)["orthogonal"].wider_than == QUICK_WIDE, recipe_overrides(False)
        (True, {})
    """
    if not quick:
        return {}
    wide = optimizers.KFAC[RECIPE][-1]["orthogonal"]
    return {"orthogonal": wide._replace(wider_than=QUICK_WIDE)}


# --------------------------------------------------------------------------- the bench


@dataclass
class Group:
    """One group's stacks for the projections and the moments (as the grouped step
    stacks them): gradient matrices, bases (None: identity), moments, count."""

    m: torch.Tensor
    qa: torch.Tensor | None
    qg: torch.Tensor | None
    moment: torch.Tensor
    first: torch.Tensor | None
    count: int
    v: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.v = to_basis(self.m, self.qa, self.qg)

    def projection_floor(self) -> Floor:
        # into the basis and out of it
        return Floor(2 * sided_macs(self.m, self.qg, self.qa))

    def moments_floor(self) -> Floor:
        # read V and the moments, write the moments and the scaled V
        return Floor(bytes=tensor_bytes([self.v, self.moment, self.first]) * 2)


@dataclass
class WideGroup:
    """One group of layers taking the orthogonalized step, stacked: their momenta's
    matrices (the gradients', in the iteration's dtype) and factor powers."""

    u: torch.Tensor
    pa: torch.Tensor | None
    pg: torch.Tensor | None

    def iterated(self) -> torch.Tensor:
        """What the Newton–Schulz iteration runs on: ``u``, or where the A power is blocked
        (one dimension more than ``u``, G kept diagonal) its column blocks, as
        :func:`kfac_func.core.orthogonal.blocked_step` iterates them."""
        if self.pa is None or self.pg is not None or self.pa.dim() <= self.u.dim():
            return self.u
        return column_blocks(self.u, self.pa.shape[-3], self.pa.shape[-1])

    def applied_floor(self) -> Floor:
        return Floor.products(sided_macs(self.u, self.pg, self.pa), self.u.dtype)

    def newton_schulz_floor(self) -> Floor:
        x = self.iterated()
        shapes = [x.shape[-2:]] * math.prod(x.shape[:-2])
        return Floor.products(newton_schulz_macs(shapes), self.u.dtype)


def _stack(ts: list[torch.Tensor | None]) -> torch.Tensor | None:
    if ts[0] is None:
        return None
    return ts[0] if len(ts) == 1 else torch.stack(ts)  # type: ignore[arg-type]


class Bench:
    """One workload: the models, optimizers, snapshot and units that are timed."""

    def __init__(self, w: rw.RaceWorkload, args: argparse.Namespace) -> None:
        self.w = w
        self.args = args
        self.device = torch.device(args.device)
        torch.manual_seed(args.seed)
        base = w.make().to(self.device)
        gen = torch.Generator().manual_seed(1000 + args.seed)
        self.x, self.y = (t.to(self.device) for t in w.batch(gen))
        self.samples: dict[str, list[float]] = {}
        self.autocast = args.autocast
        self.plain = copy.deepcopy(base)
        # the training steps of every optimizer: the race's recipes (learning rates at
        # the start of a long warm-up: small, so nothing diverges while timing)
        names = ["adamw", "muon", "muon-fp32", RECIPE, *([BEFORE, NORMS] if args.autocast else [])]
        if optimizers._heavyball() is not None:
            names.insert(3, "soap")
        self.steppers: dict[str, optimizers.Stepper] = {}
        self.overrides = recipe_overrides(args.quick)
        overrides = {
            RECIPE: self.overrides,
            BEFORE: {**self.overrides, "gram_dtype": torch.float32},
            NORMS: self.overrides,
        }
        for name in names:
            recipe = {"muon-fp32": "muon", BEFORE: "kfac-moments-wide-2"}.get(name, name)
            st = optimizers.Stepper(
                recipe,
                copy.deepcopy(base),
                optimizers.LRS[recipe][0],
                w,
                10**6,
                overrides.get(name),
            )
            if name == "muon-fp32":
                float32_muon(st)
            self.steppers[name] = st
        kfac = self.steppers[RECIPE]
        assert kfac.pre is not None
        self.pre = kfac.pre
        self.kfac_model = kfac.model
        self.base_opts = list(kfac.face.optimizers) if kfac.face is not None else kfac.opts
        self.rows_per_call = self.x.numel()
        self.kinds: dict[str, list[bool]] = {}
        self.snapshot: KFACState | None = None

    # ------------------------------------------------------------------ units

    def _time(self, key: str, fn: Callable[[], Any]) -> Any:
        synchronize(self.device)
        t0 = time.perf_counter()
        out = fn()
        synchronize(self.device)
        self.samples.setdefault(key, []).append(time.perf_counter() - t0)
        return out

    def _loss(self, model: nn.Module) -> torch.Tensor:
        """The loss of the batch, its forward under bfloat16 autocast with ``--autocast``."""
        with torch.autocast(self.device.type, torch.bfloat16, enabled=self.autocast):
            return self.w.loss(model(self.x), self.y)

    def _forward_backward(self, model: nn.Module) -> None:
        model.zero_grad(set_to_none=True)
        self._loss(model).backward()

    def plain_unit(self) -> None:
        self._time("plain", lambda: self._forward_backward(self.plain))

    def _collect(
        self, pre: kf.KFACPreconditioner, model: nn.Module, key: str, keep: bool = False
    ) -> tuple[Any, dict[str, Any]]:
        """Forward+backward with the hooks (timed as ``key``), then the batch factors
        (timed as ``key + ' batch'``); the statistics are then dropped, as ``step()``
        drops them (``keep``: returned too, by layer)."""
        self._time(key, lambda: self._forward_backward(model))
        stats: dict[str, Any] = {}

        def batch() -> Any:
            pre._settle()
            if keep:  # (in the warm-up only, whose times are dropped)
                stats.update({n: pre._layer_stats(n, s) for n, s in pre.layers.items()})
            return pre._batch_factors()

        out = self._time(key + " batch", batch)
        pre._micro, pre._grads_seen = [], set()
        return out, stats

    def stage_unit(self) -> None:
        """Every stage of the recipe's step, in the step's order, on the snapshot."""
        batch, _ = self._collect(self.pre, self.kfac_model, "hooks")
        s, cfg, opts = self.state, self.state.config, self.options
        decay, lam = opts.decay_at(s.step), opts.damping_at(s.step)
        layers = dict(s.layers)
        self._time(
            "fold",
            lambda: fold_layers(
                layers, lambda n, ls: batch.get(n), decay, cfg, opts.nonfinite, False, self.grouped
            ),
        )
        folded = dict(layers)
        before = moment_bases(folded)

        def decompose(config: Any) -> tuple[dict[str, LayerState], set[str]]:
            out = dict(folded)
            fresh = decompose_layers(
                out, lam, config, update_inverses=True, grouped=self.grouped or opts.batched_eigh
            )
            return out, fresh

        decomposed, fresh = self._time("eigh", lambda: decompose(cfg))
        sides = [
            (n, side)
            for n, ls in folded.items()
            if needs_decomposition(ls, cfg, update_inverses=True)
            for side in (0, 1)
        ]
        pairs = self._time("batched eigh", lambda: batched_eigenpairs(folded, cfg, sides))
        self.batched_floor = Floor(sum(cube_macs(q, EIGH_MACS) for q, _ in pairs.values()))
        self._time("qr", lambda: decompose(self.qr_config))
        self._time(
            "carry", lambda: carry_moments(dict(decomposed), before, fresh, grouped=self.grouped)
        )
        if self.wide:
            self._time(
                "powers", lambda: prepare_layers(dict(decomposed), self.wide, self.ortho, fresh)
            )
        new = self._time("precondition", self._precondition)
        self._time("projections", self._projections)
        self._time("moments", self._moments)
        if self.wide:
            self._time("applied", self._applied)
            self._time("newton-schulz", self._newton_schulz)
        live = self.pre._layer_grads()
        self._time("copy back", lambda: copy_back(live, new))
        self._time("update", lambda: [o.step() for o in self.base_opts])

    def _precondition(self) -> dict[str, torch.Tensor]:
        opts, s = self.options, self.state
        return precondition_layers(
            dict(s.layers),
            self.grads,
            opts.replace(sync_free=False).stage_settings(s.config.compute_method, s.step),
            kl_clip=opts.kl_clip,
            lr=opts.lr,
            changes={},
            grouped=self.grouped,
        )

    def _projections(self) -> None:
        for g in self.groups:
            from_basis(to_basis(g.m, g.qa, g.qg), g.qa, g.qg)

    def _applied(self) -> None:
        for g in self.wide_groups:
            apply_powers(g.u, FactorPowers(g.pa, g.pg))

    def _newton_schulz(self) -> None:
        assert self.ortho is not None
        for g in self.wide_groups:
            newton_schulz(g.iterated(), self.ortho.steps)

    def _moments(self) -> None:
        b = self.moment_settings
        for g in self.groups:
            adam_in_basis(
                g.v, None, None, g.moment, g.count, beta2=b.beta2, eps=b.eps,
                first=g.first, beta1=b.beta1,
            )  # fmt: skip

    def steps_unit(self, name: str) -> None:
        """Two consecutive training steps of ``name`` (one with and one without an eigh
        for the recipe; a whole preconditioner cycle for SOAP)."""
        st = self.steppers[name]
        for _ in range(2):
            if st.pre is not None:
                every = int(st.pre._value(st.pre.inv_update_steps))
                self.kinds.setdefault(name, []).append(st.pre.steps % every == 0)

            def fb() -> torch.Tensor:
                st.zero_grad()
                loss = self._loss(st.model)
                loss.backward()
                return loss.detach()

            loss = self._time(f"{name} fb", fb)
            self._time(f"{name} opt", lambda loss=loss: st.step(self.x, self.y, loss))

    # ------------------------------------------------------------------ setup

    def units(self) -> list[Callable[[], None]]:
        out = [self.plain_unit, self.stage_unit]
        out += [lambda n=n: self.steps_unit(n) for n in self.steppers]  # type: ignore[misc]
        return out

    def warm_up(self) -> None:
        """Training steps of every optimizer (the recipe's state gets factors, eigenbases
        and moments), then the snapshot and everything built from it, then ``--warmup``
        rounds of every unit; the samples of the warm-up are dropped."""
        for name in self.steppers:
            self.steps_unit(name)
            self.steps_unit(name)
        self.state = self.pre.state
        self.options = self.pre._step_options(
            damping=self.pre.damping, update_factors=True, update_inverses=True
        )
        self.grouped = grouped_here(self.options.grouped, self.state.layers)
        self.qr_config = dataclasses.replace(self.state.config, eigenbasis_refresh="qr")
        method = self.state.config.compute_method
        settings = self.options.basis_settings(method)
        assert settings is not None
        self.moment_settings = settings
        self.ortho = self.options.orthogonal_settings(method)
        self.wide = [] if self.ortho is None else orthogonal_layers(self.state.layers, self.ortho)
        _, self.stats = self._collect(self.pre, self.kfac_model, "hooks", keep=True)
        self.grads = {k: g.detach().clone() for k, g in self.pre._layer_grads().items()}
        self.groups = self._groups()
        self.wide_groups = self._wide_groups()
        for _ in range(self.args.warmup):
            for unit in self.units():
                unit()
        self.samples.clear()
        self.kinds.clear()

    def _groups(self) -> list[Group]:
        s = self.state
        names = [
            n for n, ls in s.layers.items() if ls.decomposition is not None and n not in self.wide
        ]
        out = []
        for members in plan_groups(s.layers, names, self.grads):
            states = [s.layers[n] for n in members]
            ms = []
            for ls in states:
                ms.append(self._matrix(ls))
            bases = [basis_of(ls.decomposition) for ls in states]  # type: ignore[arg-type]
            out.append(
                Group(
                    _stack(ms),  # type: ignore[arg-type]
                    _stack([b[0] for b in bases]),
                    _stack([b[1] for b in bases]),
                    _stack([ls.basis_moment for ls in states]),  # type: ignore[arg-type]
                    _stack([ls.basis_momentum for ls in states]),
                    states[0].moment_count,
                )
            )
        return out

    def _matrix(self, ls: LayerState) -> torch.Tensor:
        """The layer's gradient matrix (of the snapshot's gradients), in its factors'
        dtype."""
        w, b = layer_grads(ls.spec, self.grads)
        return ls.spec.block.to_matrix(ls.spec, w, b).to(ls.a_factor.dtype)

    def _wide_groups(self) -> list[WideGroup]:
        s, out = self.state, []
        for members in plan_groups(s.layers, self.wide, self.grads):
            us, pas, pgs = [], [], []
            for ls in (s.layers[n] for n in members):
                assert self.ortho is not None and ls.ortho_power is not None
                m = self._matrix(ls)
                dtype = self.ortho.dtype or m.dtype
                us.append(m.to(dtype))
                pas.append(None if ls.ortho_power.a is None else ls.ortho_power.a.to(dtype))
                pgs.append(None if ls.ortho_power.g is None else ls.ortho_power.g.to(dtype))
            out.append(WideGroup(_stack(us), _stack(pas), _stack(pgs)))  # type: ignore[arg-type]
        return out

    def run(self, log: Callable[[str], None]) -> None:
        self.warm_up()
        log(f"{self.w.name}: warmed up")
        units = self.units()
        for rep in range(self.args.reps):
            for unit in units if rep % 2 == 0 else reversed(units):
                unit()
            log(f"{self.w.name}: repetition {rep + 1}/{self.args.reps}")

    # ------------------------------------------------------------------ floors

    def floors(self) -> dict[str, Floor]:
        """The arithmetic of each K-FAC stage (see the module docstring)."""
        s = self.state
        macs = 0.0
        grams: list[torch.Tensor] = []
        for micro in self.stats.values():
            for mb in micro:
                for gram in (*mb.a, *mb.g):
                    macs += gram.rows * gram.gram.numel()
                    grams.append(gram.gram)
        # at the rate of the dtype the recipe's Gram products take their operands in
        stats = Floor.products(macs, self.pre._gram)
        factors = [t for ls in s.layers.values() for t in (ls.a_factor, ls.g_factor)]
        eigh, qr, carry, powers = Floor(), Floor(), Floor(), Floor()
        for name, ls in s.layers.items():
            if ls.decomposition is None:
                continue
            qa, qg = basis_of(ls.decomposition)
            eigh.macs += cube_macs(qa, EIGH_MACS) + cube_macs(qg, EIGH_MACS)
            qr.macs += cube_macs(qa, QR_MACS) + cube_macs(qg, QR_MACS)
            if name in self.wide:  # no moments to carry: its powers, Q diag Qᵀ per side
                assert ls.ortho_power is not None
                sides = ((qa, ls.ortho_power.a), (qg, ls.ortho_power.g))
                powers.macs += sum(cube_macs(q, 1.0) for q, p in sides if p is not None)
                continue
            carry.macs += cube_macs(qa, 1.0) + cube_macs(qg, 1.0)  # Q_newᵀ Q_old
            m = ls.basis_moment
            assert m is not None
            for moment in (m, ls.basis_momentum):  # the two sandwiches
                if moment is not None:
                    carry.macs += sided_macs(moment, qg, qa)
        projections = sum((g.projection_floor() for g in self.groups), Floor())
        moments = sum((g.moments_floor() for g in self.groups), Floor())
        applied = sum((g.applied_floor() for g in self.wide_groups), Floor())
        iterations = sum((g.newton_schulz_floor() for g in self.wide_groups), Floor())
        grads = list(self.grads.values())
        update = Floor()
        for o in self.base_opts:
            per = 7 if isinstance(o, torch.optim.AdamW) else 3  # tensors read + written
            params = [p for g in o.param_groups for p in g["params"]]
            update.bytes += per * tensor_bytes(params)
        muon = self.steppers["muon"].opts[0]
        hidden = [tuple(p.shape) for g in muon.param_groups for p in g["params"]]
        return {
            "statistics": stats,
            "batch factors": Floor(bytes=tensor_bytes(grams) + tensor_bytes(factors)),
            "fold": Floor(bytes=3 * tensor_bytes(factors)),
            "eigh": eigh,
            "qr": qr,
            "carry": carry,
            "projections": projections,
            "moments": moments,
            "precondition": projections + moments + applied + iterations,
            "powers": powers,
            "applied": applied,
            "newton-schulz": iterations,
            "copy back": Floor(bytes=2 * tensor_bytes(grads)),
            "update": update,
            "muon": Floor.products(
                newton_schulz_macs(hidden),
                torch.bfloat16 if optimizers.NATIVE_BF16 else torch.float32,
            ),
            "muon-fp32": Floor(macs=newton_schulz_macs(hidden)),
            "batched eigh": self.batched_floor,
        }

    # ------------------------------------------------------------------ rows

    def rows(self, rates: dict[str, float]) -> list[dict[str, Any]]:
        """The table's rows (see :func:`build_rows`)."""
        return build_rows(self.samples, self.kinds, self.floors(), rates, self)


def median_ms(samples: Sequence[float]) -> float:
    return 1e3 * statistics.median(samples)


def pair_ms(samples: Sequence[float]) -> float:
    """The median over repetitions of the mean of each repetition's two consecutive
    steps (milliseconds)."""
    pairs = [(a + b) / 2 for a, b in zip(samples[0::2], samples[1::2])]
    return 1e3 * statistics.median(pairs)


def kind_ms(samples: Sequence[float], kinds: Sequence[bool], eigh: bool) -> float | None:
    """The median of the steps of one kind (with or without an eigh)."""
    mine = [s for s, k in zip(samples, kinds) if k == eigh]
    return median_ms(mine) if mine else None


SECTIONS = (
    "forward+backward",
    "K-FAC stages (on the snapshot)",
    "K-FAC optimizer part (real steps)",
    "other optimizers' steps",
    "whole training step",
)


def build_rows(
    samples: dict[str, list[float]],
    kinds: dict[str, list[bool]],
    floors: dict[str, Floor],
    rates: dict[str, float],
    bench: Bench,
) -> list[dict[str, Any]]:
    """One dict per row: name, section, ms, ratios to the plain forward+backward and to
    Muon's optimizer step, floor (ms, multiply-adds, bytes) and its ratio, and the code
    it times."""
    ms = {k: median_ms(v) for k, v in samples.items() if v}
    rows: list[dict[str, Any]] = []

    def add(
        name: str,
        section: str,
        value: float | None,
        source: str,
        floor: Floor | None = None,
        key: str | None = None,
    ) -> None:
        rows.append(
            {
                "name": name,
                "key": key,
                "section": section,
                "ms": value,
                "source": source,
                "floor_macs": None if floor is None else floor.all_macs,
                "floor_bytes": None if floor is None else floor.bytes,
                "floor_ms": None if floor is None else floor.ms(rates),
            }
        )

    fb, st, kf_, ot, wh = SECTIONS
    statistics = ["hooks batch", "fold"]  # on the steps that gather statistics
    opt, kinds_ = samples[f"{RECIPE} opt"], kinds[RECIPE]
    share, gathered = eigh_share(HORIZON), statistics_share(HORIZON)
    eigh_ms, plain_ms = kind_ms(opt, kinds_, True), kind_ms(opt, kinds_, False)
    long_ms = long_fb = None
    if eigh_ms is not None and plain_ms is not None:
        # a step that gathers no statistics: one without an eigh less their two stages,
        # its forward+backward the plain one (the hooks record nothing then)
        bare_ms = plain_ms - sum(ms[k] for k in statistics)
        long_ms = share * eigh_ms + (gathered - share) * plain_ms + (1 - gathered) * bare_ms
        long_fb = gathered * median_ms(samples[f"{RECIPE} fb"]) + (1 - gathered) * ms["plain"]
    add("plain forward+backward", fb, ms["plain"], "model copy without hooks", key="plain")
    add("forward+backward, K-FAC hooks", fb, ms["hooks"], "the recipe's model", key="hooks")
    add(
        "statistics in the hooks",
        fb,
        ms["hooks"] - ms["plain"],
        "difference of the rows above",
        floors["statistics"],
        key="statistics",
    )
    before = BEFORE in bench.steppers
    if before:  # the hooks of the recipe, the recipe before and the norms variant, in steps
        for name, label in (
            (RECIPE, "bfloat16 statistics"),
            (BEFORE, "float32 statistics"),
            (NORMS, "bfloat16, norm layers on AdamW"),
        ):
            add(
                f"  in training steps, {label}",
                fb,
                median_ms(samples[f"{name} fb"]),
                f"{name} stepper" + (" (before)" if name == BEFORE else ""),
                key=f"{name} fb",
            )
    add(
        f"  amortized over {HORIZON:,} steps ({round(gathered * HORIZON)} with statistics)",
        fb,
        long_fb,
        "the recipe's training steps and the plain row, weighted by its schedule",
        key="kfac long fb",
    )
    stage_rows = [
        ("batch factors", "hooks batch", "HookRecorder._batch_factors"),
        ("fold (running average)", "fold", "fold_layers"),
        ("decomposition: eigh", "eigh", "decompose_layers"),
        ("  of which the batched eighs", "batched eigh", "batched_eigenpairs"),
        ('decomposition: QR refresh ("qr")', "qr", "decompose_layers, qr config"),
        ("carry moments into new bases", "carry", "carry_moments"),
        ("powers of the wide layers", "powers", "prepare_layers"),
        ("precondition stage", "precondition", "precondition_layers"),
        ("  projections in and out", "projections", "to_basis + from_basis"),
        ("  moments (Adam in the basis)", "moments", "adam_in_basis, identity bases"),
        ("  wide layers: powers applied", "applied", "apply_powers"),
        ("  wide layers: Newton-Schulz", "newton-schulz", "newton_schulz"),
        ("  rest of the precondition stage", "precondition rest", "difference"),
        ("write-back to .grad", "copy back", "copy_back"),
        ("parameter update", "update", "base optimizers' step()"),
    ]
    wide = "powers" in ms  # a layer takes the orthogonalized step
    parts = ["projections", "moments", *(["applied", "newton-schulz"] if wide else [])]
    ms["precondition rest"] = ms["precondition"] - sum(ms[k] for k in parts)
    for name, key, source in stage_rows:
        if key in ms:
            floor = floors.get(key if key != "hooks batch" else "batch factors")
            add(name, st, ms[key], source, floor, key)
    always = ["precondition", "copy back", "update"]  # on every step
    every_step = [*statistics, *always]

    def floor_of(keys: Sequence[str]) -> Floor:
        return sum((floors[k if k != "hooks batch" else "batch factors"] for k in keys), Floor())

    floor_every = floor_of(every_step)
    fresh = ["eigh", "carry", *(["powers"] if wide else [])]  # after a decomposition
    without = sum(ms[k] for k in every_step)
    with_eigh = without + sum(ms[k] for k in fresh)
    floor_fresh = sum((floors[k] for k in fresh), Floor())
    floor_eigh = floor_every + floor_fresh
    add("sum of stages, step with eigh", st, with_eigh, "sum", floor_eigh, "sum eigh")
    add("sum of stages, step without eigh", st, without, "sum", floor_every, "sum plain")
    amortized_floor = floor_every + floor_fresh.times(0.5)
    sum_amortized = (with_eigh + without) / 2
    add(
        "sum of stages, amortized (eigh every 2)",
        st,
        sum_amortized,
        "sum",
        amortized_floor,
        "sum amortized",
    )
    real = pair_ms(opt)
    add(
        "step with eigh",
        kf_,
        kind_ms(opt, kinds_, True),
        "pre.step() + optimizers",
        floor_eigh,
        "kfac eigh",
    )
    add(
        "step without eigh",
        kf_,
        kind_ms(opt, kinds_, False),
        "pre.step() + optimizers",
        floor_every,
        "kfac plain",
    )
    add("amortized (eigh every 2)", kf_, real, "mean of 2 steps", amortized_floor, "kfac")
    add("  not in a stage row", kf_, real - sum_amortized, "difference", key="kfac rest")
    add(
        f"amortized over {HORIZON:,} steps ({round(share * HORIZON)} with eigh, "
        f"{round(gathered * HORIZON)} with statistics)",
        kf_,
        long_ms,
        "the kinds of step weighted by the recipe's schedule",
        floor_of(always) + floor_of(statistics).times(gathered) + floor_fresh.times(share),
        "kfac long",
    )
    if before:
        add(
            "before: float32 statistics, eigh every 2",
            kf_,
            pair_ms(samples[f"{BEFORE} opt"]),
            "mean of 2 steps",
            key="before",
        )
    add(
        "Muon, as the race runs it, + AdamW",
        ot,
        pair_ms(samples["muon opt"]),
        f"{optimizers.MUON_PRECISION} Newton-Schulz",
        floors["muon"],
        "muon",
    )
    add(
        "Muon, float32 Newton-Schulz + AdamW",
        ot,
        pair_ms(samples["muon-fp32 opt"]),
        "Muon32 (this script)",
        floors["muon-fp32"],
        "muon-fp32",
    )
    if "soap opt" in samples:
        add("SOAP (2-step mean)", ot, pair_ms(samples["soap opt"]), "heavyball.SOAP", key="soap")
    add("AdamW", ot, pair_ms(samples["adamw opt"]), "torch.optim.AdamW", key="adamw")
    labels = {
        RECIPE: f"K-FAC ({RECIPE}), amortized (eigh every 2)",
        BEFORE: "K-FAC before: float32 statistics, eigh every 2",
        NORMS: "K-FAC, norm layers on AdamW, amortized (eigh every 2)",
    }
    for name in bench.steppers:
        whole = pair_ms([a + b for a, b in zip(samples[f"{name} fb"], samples[f"{name} opt"])])
        add(labels.get(name, name), wh, whole, "forward+backward + optimizer", key=f"{name} whole")
    if long_ms is not None and long_fb is not None:
        add(
            f"K-FAC ({RECIPE}), amortized over {HORIZON:,} steps",
            wh,
            long_fb + long_ms,
            "forward+backward (plain where no statistics) + the optimizer part above",
            key="kfac long whole",
        )
    at_floors = ms["plain"] + (floors["statistics"] + amortized_floor).ms(rates)
    add(
        "K-FAC's whole step at the floors",
        wh,
        at_floors,
        "plain forward+backward + statistics and amortized optimizer floors",
        key="floor whole",
    )
    plain, muon = ms["plain"], pair_ms(samples["muon opt"])
    for r in rows:
        v, f = r["ms"], r["floor_ms"]
        r["vs_plain"] = None if v is None else v / plain
        r["vs_muon"] = None if v is None else v / muon
        r["vs_floor"] = None if v is None or not f else v / f
    return rows


def eigh_share(horizon: int) -> float:
    """The share of the recipe's first ``horizon`` steps that decompose (its
    ``inv_update_steps``: a number, or a schedule of the step).

    Example:
        >>> round(eigh_share(2000), 4)
        0.1585
    """
    return _share(optimizers.KFAC[RECIPE][4][1], horizon)


def statistics_share(horizon: int) -> float:
    """The share of the recipe's first ``horizon`` steps that gather factor statistics (its
    ``factor_update_steps``).

    Example:
        >>> round(statistics_share(2000), 3)
        0.564
    """
    return _share(optimizers.KFAC[RECIPE][4][0], horizon)


def _share(interval: Any, horizon: int) -> float:
    every = interval if callable(interval) else (lambda _: interval)
    return sum(s % int(every(s)) == 0 for s in range(horizon)) / horizon


def targets(rows: list[dict[str, Any]]) -> dict[str, float | None]:
    """The precision issue's ratios from a workload's rows of an ``--autocast`` run: the
    forward+backward with the hooks over the plain one, and K-FAC's whole step over Muon's,
    before and after (None without the before rows).

    Example:
        >>> rows = [{"key": k, "ms": v} for k, v in (("plain", 10.0), ("before fb", 20.0),
        ...         (f"{RECIPE} fb", 12.0), ("muon whole", 20.0), ("before whole", 60.0),
        ...         (f"{RECIPE} whole", 40.0), ("kfac long whole", 30.0))]
        >>> targets(rows)["whole_over_muon_after"]
        1.5
    """
    ms = {r["key"]: r["ms"] for r in rows if r["key"] is not None}
    if "before fb" not in ms:
        return {}

    def over(a: str, b: str) -> float | None:
        return None if ms.get(a) is None or not ms.get(b) else ms[a] / ms[b]

    return {
        "hooks_over_plain_before": over("before fb", "plain"),
        "hooks_over_plain_after": over(f"{RECIPE} fb", "plain"),
        "hooks_over_plain_after_long": over("kfac long fb", "plain"),
        "whole_over_muon_before": over("before whole", "muon whole"),
        "whole_over_muon_after_every_2": over(f"{RECIPE} whole", "muon whole"),
        "whole_over_muon_after": over("kfac long whole", "muon whole"),
        "hooks_over_plain_norms_on_adamw": over(f"{NORMS} fb", "plain"),
        "whole_over_muon_norms_on_adamw_every_2": over(f"{NORMS} whole", "muon whole"),
    }


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def print_rows(rows: list[dict[str, Any]]) -> None:
    """The table of one workload, by section."""
    for section in SECTIONS:
        mine = [r for r in rows if r["section"] == section]
        if not mine:
            continue
        print(f"\n  {section}:")
        print_table(
            ["row", "ms", "x fwd+bwd", "x Muon", "floor ms", "x floor", "times"],
            [
                [
                    r["name"],
                    _fmt(r["ms"], ".2f"),
                    _fmt(r["vs_plain"], ".2f"),
                    _fmt(r["vs_muon"], ".2f"),
                    _fmt(r["floor_ms"], ".2f"),
                    _fmt(r["vs_floor"], ".1f"),
                    r["source"],
                ]
                for r in mine
            ],
        )


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke test: the race's tiny models, 2 repetitions, 1 warm-up round, small "
        "rate measurements, a temporary folder",
    )
    p.add_argument(
        "--workloads",
        nargs="+",
        choices=WORKLOADS,
        default=list(WORKLOADS),
        help="the race's language models to time (default: all three)",
    )
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    p.add_argument(
        "--device",
        default="cpu",
        help="where the models, batches and states live (default cpu; cuda on a GPU: the "
        "times then wait for the device, and the rates are the device's)",
    )
    p.add_argument(
        "--autocast",
        action="store_true",
        help="every forward and loss under bfloat16 autocast (where the CPU multiplies "
        "bfloat16 natively), and the recipe before its bfloat16 statistics and growing "
        "interval timed beside it",
    )
    p.add_argument("--reps", type=int, default=9, help="timed repetitions (default 9)")
    p.add_argument("--warmup", type=int, default=2, help="warm-up rounds (default 2)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the batch")
    p.add_argument(
        "--out",
        default=None,
        help="the JSON written (default benchmarks/results/stages.json; --quick: a "
        "temporary folder)",
    )
    p.add_argument(
        "--require-clean",
        action="store_true",
        help="refuse to run when tracked files outside the results differ from the commit",
    )
    p.add_argument("--verbose", action="store_true", help="log progress to stderr")
    args = p.parse_args(argv)
    if args.quick:
        args.reps, args.warmup = 2, 1
    if args.autocast and args.device == "cpu" and not optimizers.NATIVE_BF16:
        p.error("--autocast: this CPU does not multiply bfloat16 natively (no amx_bf16 or "
                "avx512_bf16); a bfloat16 run would time the emulation")  # fmt: skip
    rr.settle_out(args, RESULTS, "stages_bf16.json" if args.autocast else "stages.json", p.error)
    if args.reps < 1 or args.warmup < 1 or args.threads < 1:
        p.error("--reps, --warmup and --threads must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    checkout = checked_out(EXCLUDE, args.require_clean)
    if checkout is None:
        return 2
    previous = torch.get_num_threads()
    torch.set_num_threads(args.threads)

    def log(msg: str) -> None:
        if args.verbose:
            print(msg, file=sys.stderr, flush=True)

    try:
        info = race.machine(args.threads)
        info["bf16_flags"] = bf16_flags()
        device = torch.device(args.device)
        if device.type == "cuda":
            info["device"] = torch.cuda.get_device_name(device)
        n, elements = (256, 1 << 20) if args.quick else (2048, 1 << 24)
        rates_before = measure_rates(n, elements, device=device)
        print("kfac_func stage benchmark: the recommended step's stages, Muon, SOAP, AdamW")
        print(
            f"CPU {info['cpu']} | {args.threads} thread(s) of {info['cores']} cores | torch "
            f"{info['torch']} | bf16 flags: "
            + (", ".join(k for k, v in info["bf16_flags"].items() if v and "bf16" in k) or "none")
        )
        if args.quick:
            print("QUICK MODE: tiny models, 2 repetitions; a smoke test, not a measurement")
        benches = {}
        for name in args.workloads:
            w = rw.WORKLOADS[name](args.quick)
            bench = Bench(w, args)
            bench.run(log)
            benches[name] = bench
        rates_after = measure_rates(n, elements, device=device)
        rates = {k: max(rates_before[k], rates_after[k]) for k in rates_before}
        print(
            f"\nmatmul n={n}: float32 {2e-9 * rates['matmul_float32_macs_per_s']:.1f} "
            f"GFLOP/s, bfloat16 {2e-9 * rates['matmul_bfloat16_macs_per_s']:.1f} GFLOP/s; "
            f"memory {1e-9 * rates['memory_bytes_per_s']:.1f} GB/s"
        )
        workloads: dict[str, Any] = {}
        for name, bench in benches.items():
            rows = bench.rows(rates)
            print(
                f"\n{name}: {bench.w.description}; {len(bench.state.layers)} K-FAC layers, "
                f"{bench.rows_per_call} rows per call; medians of {args.reps} repetitions; "
                "x fwd+bwd: over the plain forward+backward; x Muon: over Muon's optimizer "
                "step; floor: the stage's arithmetic at the measured rates"
            )
            print_rows(rows)
            workloads[name] = {
                "description": bench.w.description,
                "layers": len(bench.state.layers),
                "rows_per_call": bench.rows_per_call,
                "rows": rows,
                "targets": targets(rows),
                "samples_ms": {k: [1e3 * s for s in v] for k, v in bench.samples.items()},
                "kinds": bench.kinds,
            }
        print(
            "\nDerived rows (statistics, rest, sums, not in a stage row) combine the medians "
            "of separately timed units: where the parts are within the noise a difference "
            "can come out negative."
        )
    finally:
        torch.set_num_threads(previous)
    result = {
        "benchmark": "stages",
        "quick": args.quick,
        "command": " ".join(
            ["python", "benchmarks/stages.py", *(sys.argv[1:] if argv is None else argv)]
        ),
        **checkout,
        "machine": info,
        "recipe": {"name": RECIPE, "settings": _recipe_settings(args.quick)},
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "rates": {"before": rates_before, "after": rates_after, "used": rates},
        "floors": {
            "eigh_macs_per_n3": EIGH_MACS,
            "qr_macs_per_n3": QR_MACS,
            "newton_schulz_steps": NS_STEPS,
        },
        "workloads": workloads,
        "seconds": time.perf_counter() - started,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, allow_nan=False) + "\n")
    print(f"\nwrote {out} ({result['seconds']:.0f} s)")
    return 0


def _recipe_settings(quick: bool) -> dict[str, Any]:
    method, momentum, _, clip, (fac, inv), decay, extra = optimizers.KFAC[RECIPE]
    extra = {**extra, **recipe_overrides(quick)}
    return {
        "compute_method": method,
        "sgd_momentum": momentum,
        "kl_clip": clip,
        "factor_update_steps": _plain(fac),
        "inv_update_steps": _plain(inv),
        "factor_decay": _plain(decay),
        **{k: _plain(v) for k, v in extra.items()},
    }


def _plain(value: Any) -> Any:
    """A setting as JSON holds it (an :class:`~kfac_func.Orthogonal`, a
    :class:`~kfac_func.step.GrowingInterval` or a :class:`~kfac_func.step.DecayPerStep` as
    a dict, a dtype as its name)."""
    if isinstance(value, kf.Orthogonal):
        return {k: _plain(v) for k, v in value._asdict().items()}
    if isinstance(value, kf.step.GrowingInterval):
        return {"growing_interval": dataclasses.asdict(value)}
    if isinstance(value, kf.step.DecayPerStep):
        return {"decay_per_step": value.per_step, "interval": _plain(value.interval)}
    return str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else value


if __name__ == "__main__":
    sys.exit(main())
