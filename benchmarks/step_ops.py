"""What one optimizer step costs as the model gets deeper: aten operations and CPU time of
each kind of step, for the LM example's ``CharTransformer`` at two depths, side by side.

Run ``python benchmarks/step_ops.py`` (several minutes on a 2-core CPU, most of it
``torch.compile``) or ``--quick`` (tiny models, two repetitions, no compilation: a smoke
test, not a measurement). Writes ``--out`` (``benchmarks/results/step_ops.json``: the
command, the commit, the machine and every number) and prints the tables.

The model
---------
``examples/transformer_lm.py``'s ``CharTransformer`` (token and position embeddings,
pre-norm blocks of four attention ``nn.Linear`` layers, two LayerNorms and a GELU MLP, a
final LayerNorm and a linear head) with ``--depths`` blocks (12 and 24) of width
``--d-model`` (64), ``--heads`` heads, on batches of ``--batch`` (2) windows of
``--context`` (32) characters of the example's own text, drawn fresh before every step.
Every optimizer gets its own copy of the same initial model.

What is measured
----------------
Each step is split in two timed parts: ``zero_grad`` + forward + cross-entropy +
``backward`` ("forward+backward"), then everything after the backward pass ("step"):

- ``AdamW``: ``torch.optim.AdamW(foreach=True)`` over every parameter.
- ``Muon``: ``torch.optim.Muon`` (``adjust_lr_fn="match_rms_adamw"``) over the blocks'
  2-D weight matrices, ``AdamW(foreach=True)`` over the rest (embeddings, norms, biases,
  head), as usual.
- ``K-FAC``: ``KFACPreconditioner(settings=Settings(scaling="fisher", grouped=True))`` ``.step()`` +
  ``SGD(foreach=True)`` over the preconditioned parameters (+ ``AdamW(foreach=True)`` over
  any others; none in this model), in the LM example's two settings: ``eigen`` (its
  ``kfac``: SGD momentum 0.9, factor decay 0.95, KL clip 3e-5) and ``moments`` (its
  ``kfac-moments``: ``eigenbasis_moments=True``, β₁ 0.9, β₂ 0.95, factor decay 0.8, no KL
  clip, SGD without momentum), each eager and with ``sync_free=True, compile=True`` (the
  adapter compiles every step kind: factor, decomposition and precondition-only steps, a
  graph each). The preconditioner's ``lr`` (only the KL clip's scale) is the eigen SGD's
  0.3 in both settings (the moments have no clip): the compiled variants share the code
  Dynamo compiles for ``kfac_func.update``, and a float argument that differs from one call to
  the next (another preconditioner's ``lr``, or a schedule's) is recompiled as a symbolic
  float, on which ``check_hyper``'s ``math.isnan`` cannot be traced (torch 2.13:
  ``Unsupported: torch.* op returned non-Tensor``). A variant that fails to compile is
  recorded with its error (``compile`` in the JSON) and left untimed; its operations are
  still counted. Factors
  and decompositions are updated every 5 steps; three kinds of step are timed: steps that
  only precondition, steps that also update the factors (the hooks record statistics in
  that step's forward+backward), and steps that update the factors and recompute the
  decompositions. The kind of every timed step is chosen by ``factor_update_steps=`` and
  ``inv_update_steps=`` callables (the preconditioner's own schedule mechanism), so the
  factor-only step, which the 5/5 schedule never has, is measured as well. The amortized
  step of the 5/5 schedule is 1/5 factors+decomposition + 4/5 precondition-only.

aten operations per call are counted by a ``TorchDispatchMode`` that counts every
operation dispatched to it while the part runs (what runs, kernels and views alike,
after autograd and the composite decompositions; a ``foreach`` op counts once). The
compiled rows' counts are those of the eager ``sync_free=True`` path (a separate copy, for
counting only): what the compiled graph replaces. The counts are taken after the
warm-up, one step of each kind; the JSON keeps them by name. "syncs" are the scalars read
on the host among them (``aten._local_scalar_dense``: ``.item()``, ``float()``, ``bool()``
of a tensor), each a device synchronisation on a GPU.

CPU time: ``torch.set_num_threads(--threads)`` (1); after a warm-up (which compiles the
compiled variants: the recompile once the step counters change is part of it), each of
``--reps`` repetitions runs one step of every optimizer and of every K-FAC kind in turn,
the order reversed every other repetition, so machine noise hits them alike; the tables
give medians. Growth is the ratio of the deepest model's number to the shallowest's;
"ratio" is a row's time over AdamW's step (for the whole training step: over AdamW's
whole step; for forward+backward: over the plain forward+backward) at the same depth.
The compile times printed are warm-up wall times: inductor's on-disk cache shortens
them when the same graphs were compiled before on the machine. No time is
asserted anywhere; only ratios from one run compare (the CPU is printed).

The preconditioners run with ``grouped=True`` (layers of one shape computed together; the
default on accelerators, not on a CPU). ``benchmarks/results/step_ops_before.json`` is a
run of this script at a commit before the grouped step existed (the per-layer step); the
JSON of each run records its commit. The "syncs" column counts ``aten._local_scalar_dense`` only: a
``.tolist()`` read of a tensor, also a host synchronisation, is not dispatched and is not
counted.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]  # this checkout's kfac_func
from step_time import cpu_model, git_commit, load_example, print_table  # noqa: E402

import kfac_func as kf  # noqa: E402

lm = load_example("transformer_lm")

KINDS = {  # kind -> (update factors, update decompositions)
    "precondition": (False, False),
    "factors": (True, False),
    "factors+decomp": (True, True),
}
VARIANTS = ("eigen", "eigen compiled", "moments", "moments compiled")
SYNC = "aten._local_scalar_dense"  # the operation behind .item(), float(), bool() of a tensor
INTERVAL = 5  # factors and decompositions every 5 steps: 1 factors+decomp, 4 precondition


class OpCounter(TorchDispatchMode):
    """Counts every aten operation dispatched while it is active (by name in ``ops``).

    Example:
        >>> with OpCounter() as c:
        ...     _ = torch.ones(2) + 1
        >>> c.total >= 2
        True
    """

    def __init__(self) -> None:
        super().__init__()
        self.ops: dict[str, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = str(func.overloadpacket)
        self.ops[name] = self.ops.get(name, 0) + 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.ops.values())


@dataclass
class Part:
    """The samples (seconds) and the op count of one part of one kind of step."""

    seconds: list[float] = field(default_factory=list)
    ops: int | None = None
    by_op: dict[str, int] = field(default_factory=dict)  # every operation run, by name

    @property
    def syncs(self) -> int:
        """Host synchronisations: the scalars read from tensors (``.item()``, ``bool()``)."""
        return self.by_op.get(SYNC, 0)


class Stepper:
    """One optimizer (with or without K-FAC) on its own copy of the model."""

    def __init__(
        self,
        name: str,
        model: nn.Module,
        batch: Callable[[], tuple[torch.Tensor, torch.Tensor]],
        count_only: bool = False,
    ) -> None:
        self.name = name
        self.model = model
        self.batch = batch
        self.pre: kf.KFACPreconditioner | None = None
        self.opts: list[torch.optim.Optimizer] = []
        self.want = (True, True)  # the kind of the next K-FAC step
        params = list(model.parameters())
        if name == "adamw":
            self.opts = [torch.optim.AdamW(params, lr=2e-3, weight_decay=0.0, foreach=True)]
        elif name == "muon":
            hidden = [
                p for n, p in model.named_parameters() if p.dim() == 2 and n.startswith("blocks.")
            ]
            ids = {id(p) for p in hidden}
            rest = [p for p in params if id(p) not in ids]
            self.opts = [
                torch.optim.Muon(hidden, lr=0.02, adjust_lr_fn="match_rms_adamw"),
                torch.optim.AdamW(rest, lr=2e-3, weight_decay=0.0, foreach=True),
            ]
        else:
            self._kfac(name.split()[0], "compiled" in name, count_only)

    def _kfac(self, setting: str, compiled: bool, count_only: bool) -> None:
        moments = setting == "moments"
        lr, _, _, decay = lm.KFAC_DEFAULTS["kfac-moments" if moments else "kfac"]
        mine, rest = kf.register(self.model).split_parameters(self.model)
        sgd = torch.optim.SGD(mine, lr=lr, momentum=0.0 if moments else 0.9, foreach=True)
        self.opts = [sgd]
        if rest:
            self.opts.append(torch.optim.AdamW(rest, lr=2e-3, weight_decay=0.0, foreach=True))
        # k % (k + 1) != 0 for k >= 1: the callables pick the kind of each step (step 0
        # always updates the factors and computes the first decompositions)
        self.pre = kf.KFACPreconditioner(
            self.model,
            factor_update_steps=lambda k: 1 if self.want[0] else k + 1,
            inv_update_steps=lambda k: 1 if self.want[1] else k + 1,
            damping=1e-3,
            factor_decay=decay,
            kl_clip=None if moments else 3e-5,
            # the KL clip's scale: the eigen SGD's (constant here) in both settings, as the
            # moments have no clip; see the module docstring for why it must not differ
            lr=lm.KFAC_DEFAULTS["kfac"][0],
            settings=kf.Settings(
                scaling="fisher",
                eigenbasis_moments=moments,
                moment_beta2=0.95,
                moment_beta1=0.9 if moments else 0.0,
                sync_free=compiled,
                compile=compiled and not count_only,
                grouped=True,  # the grouped step, on a CPU too (not the default there)
            ),
            compute_method="eigen",
        )

    def step(
        self, kind: str = "step", counters: tuple[OpCounter, OpCounter] | None = None
    ) -> tuple[float, float]:
        """One training step of ``kind``: (forward+backward seconds, step seconds)."""
        if self.pre is not None:
            self.want = KINDS[kind]
        x, y = self.batch()
        c_fb, c_step = counters if counters is not None else (None, None)
        t0 = time.perf_counter()
        with c_fb if c_fb is not None else _null():
            for o in self.opts:
                o.zero_grad(set_to_none=True)
            loss = lm.lm_loss(self.model(x), y)
            loss.backward()
        t1 = time.perf_counter()
        with c_step if c_step is not None else _null():
            if self.pre is not None:
                self.pre.step()
            for o in self.opts:
                o.step()
        t2 = time.perf_counter()
        self.loss = float(loss.detach())
        return t1 - t0, t2 - t1


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *args: Any) -> None:
        return None


def kinds_of(name: str) -> list[str]:
    return ["step"] if name in ("adamw", "muon") else list(KINDS)


def graphs_compiled() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def measure_depth(
    depth: int, args: argparse.Namespace, data: Any, log: Callable[[str], None]
) -> dict[str, Any]:
    """Every part of every step kind of every optimizer at one depth."""
    torch.manual_seed(args.seed)
    base = lm.CharTransformer(data.vocab, args.context, args.d_model, depth, args.heads)
    gen = torch.Generator().manual_seed(args.seed + 1)

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        return data.batch(args.batch, args.context, gen)

    names = ["adamw", "muon", *(v for v in VARIANTS if args.compile or "compiled" not in v)]
    steppers = {n: Stepper(n, copy.deepcopy(base), batch) for n in names}
    # the eager sync-free path of each compiled variant, for counting its operations
    counting = {
        v: Stepper(v, copy.deepcopy(base), batch, count_only=True)
        for v in VARIANTS
        if "compiled" in v
    }
    pre = steppers["eigen"].pre
    assert pre is not None
    out: dict[str, Any] = {"layers": len(pre.layers), "compile": {}}
    parts: dict[tuple[str, str], tuple[Part, Part]] = {}

    # warm-up: step 0 (first factors and decompositions), then each kind in an order in
    # which the step counters change between the first two precondition-only steps, so
    # that a compiled variant's recompile happens here (see the module docstring)
    warm = [(n, s, False) for n, s in steppers.items()]
    warm += [(n, s, True) for n, s in counting.items()]
    for n, s, count_only in warm:
        what = f"{n} (eager sync_free copy, for counting)" if count_only else n
        start, graphs = time.perf_counter(), graphs_compiled()
        order = ["step"] if s.pre is None else ["factors+decomp"]
        order += (
            ["step"]
            if s.pre is None
            else ["precondition", "factors", "precondition", "factors+decomp"]
        ) * args.warmup
        try:
            for k in order:
                s.step(k)
        except Exception as e:  # a variant the adapter cannot compile: recorded, not timed
            if count_only or s.pre is None or not s.pre.compile:
                raise
            text = str(e).strip()
            where = [line.strip() for line in text.splitlines() if line.strip().startswith("File")]
            out["compile"][n] = {
                "error": f"{type(e).__name__}: {text.splitlines()[0] if text else ''}",
                "where": where[-1] if where else None,
                "message": text,
            }
            del steppers[n]
            names.remove(n)
            log(f"  depth {depth}: {n} failed to compile: {out['compile'][n]['error']}")
            continue
        if not count_only and "compiled" in n:
            out["compile"][n] = {
                "warmup_s": time.perf_counter() - start,
                "graphs": graphs_compiled() - graphs,
            }
        log(f"  depth {depth}: {what} warmed up ({time.perf_counter() - start:.1f} s)")

    # operation counts: one step of each kind
    for n in ["adamw", "muon", *VARIANTS]:
        counter_of = counting[n] if n in counting else steppers[n]
        for k in kinds_of(n):
            c = (OpCounter(), OpCounter())
            counter_of.step(k, c)
            fb, st = (Part(ops=x.total, by_op=dict(sorted(x.ops.items()))) for x in c)
            parts[n, k] = (fb, st)
    log(f"  depth {depth}: operations counted")

    # timing, interleaved
    units = [(n, k) for n in names for k in kinds_of(n)]
    graphs = graphs_compiled()
    for rep in range(args.reps):
        for n, k in units if rep % 2 == 0 else reversed(units):
            fb, st = steppers[n].step(k)
            parts[n, k][0].seconds.append(fb)
            parts[n, k][1].seconds.append(st)
        log(f"  depth {depth}: repetition {rep + 1}/{args.reps}")
    out["recompiles_while_timed"] = graphs_compiled() - graphs
    out["parts"] = parts
    out["final_loss"] = {n: s.loss for n, s in steppers.items()}
    return out


# --------------------------------------------------------------------------- the rows


def median_ms(seconds: list[float]) -> float | None:
    return 1e3 * statistics.median(seconds) if seconds else None


Term = tuple[float, str, str, int]  # (weight, optimizer, step kind, 0: forward+backward / 1: step)


def build_rows(per_depth: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    """One dict per row: its name, part, and per depth its operations, host
    synchronisations and milliseconds (weighted sums of the parts it is made of), with
    the growth from the shallowest to the deepest model and the ratio to AdamW."""
    depths = list(per_depth)
    specs: list[tuple[str, str, list[Term]]] = [
        ("forward+backward", "forward+backward", [(1.0, "adamw", "step", 0)])
    ]
    for v in VARIANTS:
        if "compiled" not in v:  # the model is not compiled: its hooks are the eager variant's
            for k, state in (("precondition", "idle"), ("factors", "recording")):
                specs.append(
                    (
                        f"forward+backward, K-FAC {v} hooks {state}",
                        "forward+backward",
                        [(1.0, v, k, 0)],
                    )
                )
    specs.append(("AdamW step (foreach)", "step", [(1.0, "adamw", "step", 1)]))
    specs.append(("Muon step (+AdamW on the rest)", "step", [(1.0, "muon", "step", 1)]))
    specs.append(("AdamW: whole step", "whole step", [(1.0, "adamw", "step", i) for i in (0, 1)]))
    specs.append(("Muon: whole step", "whole step", [(1.0, "muon", "step", i) for i in (0, 1)]))
    # the 5/5 schedule: 1 step in 5 updates the factors and decompositions, 4 precondition
    cycle = {"factors+decomp": 1 / INTERVAL, "precondition": (INTERVAL - 1) / INTERVAL}
    for v in VARIANTS:
        for k in KINDS:
            specs.append((f"K-FAC {v}: {k}", "step", [(1.0, v, k, 1)]))
        specs.append(
            (f"K-FAC {v}: amortized 5/5", "step", [(w, v, k, 1) for k, w in cycle.items()])
        )
        specs.append(
            (
                f"K-FAC {v}: amortized 5/5 (whole step)",
                "whole step",
                [(w, v, k, i) for k, w in cycle.items() for i in (0, 1)],
            )
        )
    rows: list[dict[str, Any]] = []
    for name, part, terms in specs:
        row: dict[str, Any] = {"name": name, "part": part, "ops": {}, "syncs": {}, "ms": {}}
        for d in depths:
            got = [(w, per_depth[d]["parts"][n, k][i]) for w, n, k, i in terms]
            row["ops"][d] = sum(w * (p.ops or 0) for w, p in got)
            row["syncs"][d] = sum(w * p.syncs for w, p in got)
            timed = all(p.seconds for _, p in got)
            row["ms"][d] = sum(w * (median_ms(p.seconds) or 0) for w, p in got) if timed else None
            if len(got) == 1:
                row.setdefault("ops_by_name", {})[d] = got[0][1].by_op
        rows.append(row)
    lo, hi = depths[0], depths[-1]
    ref = {
        "step": rows[[r["name"] for r in rows].index("AdamW step (foreach)")],
        "whole step": rows[[r["name"] for r in rows].index("AdamW: whole step")],
        "forward+backward": rows[0],
    }
    for r in rows:
        r["ops_growth"] = _ratio(r["ops"][hi], r["ops"][lo])
        r["ms_growth"] = _ratio(r["ms"][hi], r["ms"][lo])
        r["ms_vs"] = {
            "step": "the AdamW step",
            "whole step": "AdamW's whole step",
            "forward+backward": "the plain forward+backward",
        }[r["part"]]
        r["ms_vs_adamw"] = {d: _ratio(r["ms"][d], ref[r["part"]]["ms"][d]) for d in depths}
    return rows


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def print_rows(rows: list[dict[str, Any]], depths: list[int]) -> None:
    lo, hi = depths[0], depths[-1]
    for part, title in (
        ("forward+backward", "forward+backward (ratio: to the plain forward+backward)"),
        ("step", "step after backward (ratio: to the AdamW step)"),
        ("whole step", "whole training step (ratio: to AdamW's whole step)"),
    ):
        print(f"\n{title}:")
        table = []
        for r in rows:
            if r["part"] != part:
                continue
            star = "*" if "compiled" in r["name"] else ""
            table.append(
                [
                    r["name"],
                    *(_fmt(r["ops"][d], ".0f") + star for d in depths),
                    _fmt(r["ops_growth"], ".2f"),
                    *(_fmt(r["syncs"][d], ".0f") + star for d in depths),
                    *(_fmt(r["ms"][d], ".2f") for d in depths),
                    _fmt(r["ms_growth"], ".2f"),
                    *(_fmt(r["ms_vs_adamw"][d], ".2f") for d in depths),
                ]
            )
        print_table(
            [
                "row",
                *(f"ops {d}" for d in depths),
                f"ops x{hi}/{lo}",
                *(f"syncs {d}" for d in depths),
                *(f"ms {d}" for d in depths),
                f"ms x{hi}/{lo}",
                *(f"ratio {d}" for d in depths),
            ],
            table,
        )


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke test in seconds: depths 1 and 2, width 16, context 8, 2 repetitions, "
        "1 warm-up round, no compilation (compiled rows keep their operation counts)",
    )
    p.add_argument(
        "--depths",
        type=int,
        nargs="+",
        default=[12, 24],
        help="transformer blocks of the models compared (default: 12 24)",
    )
    p.add_argument("--d-model", type=int, default=64, help="model width (default: 64)")
    p.add_argument(
        "--heads", type=int, default=4, help="attention heads (default: 4, the LM example's)"
    )
    p.add_argument("--context", type=int, default=32, help="characters per window (default: 32)")
    p.add_argument("--batch", type=int, default=2, help="windows per batch (default: 2)")
    p.add_argument(
        "--reps", type=int, default=7, help="timed repetitions of every step kind (default: 7)"
    )
    p.add_argument(
        "--warmup", type=int, default=2, help="warm-up rounds of every step kind (default: 2)"
    )
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default: 1)")
    p.add_argument(
        "--no-compile",
        dest="compile",
        action="store_false",
        help="skip the compiled variants' timing (their operation counts remain)",
    )
    p.add_argument(
        "--seed", type=int, default=0, help="seed of the weights (batches: seed + 1; default: 0)"
    )
    p.add_argument(
        "--out",
        default=None,
        help="the JSON written (default: benchmarks/results/step_ops.json; --quick: a "
        "temporary folder)",
    )
    p.add_argument("--verbose", action="store_true", help="log progress to stderr")
    args = p.parse_args(argv)
    if args.quick:
        args.depths, args.d_model, args.heads, args.context = [1, 2], 16, 2, 8
        args.reps, args.warmup, args.compile = 2, 1, False
    if args.out is None:
        folder = Path(tempfile.mkdtemp()) if args.quick else ROOT / "benchmarks" / "results"
        args.out = str(folder / "step_ops.json")
    if args.reps < 1 or args.warmup < 1 or args.threads < 1 or len(args.depths) < 2:
        p.error("--reps, --warmup and --threads must be >= 1; give at least two --depths")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()

    def log(msg: str) -> None:
        if args.verbose:
            print(msg, file=sys.stderr, flush=True)

    machine = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "kfac_func": kf.__version__,
    }
    print("kfac_func step-ops benchmark: aten operations and CPU time per step kind, by depth")
    print(
        f"CPU {machine['cpu']} | {machine['threads']} thread(s) of {machine['cores']} cores "
        f"| torch {machine['torch']}"
    )
    if args.quick:
        print(
            "QUICK MODE: tiny models, 2 repetitions, no compilation; "
            "a smoke test, not a measurement"
        )
    data = lm.CharData()
    per_depth: dict[int, dict[str, Any]] = {}
    for depth in args.depths:
        log(f"depth {depth}")
        per_depth[depth] = measure_depth(depth, args, data, log)
    rows = build_rows(per_depth)
    depths = list(args.depths)
    layers = {d: per_depth[d]["layers"] for d in depths}
    print(
        f"\nCharTransformer d_model {args.d_model}, {args.heads} heads, context {args.context}, "
        f"batch {args.batch}; medians of {args.reps} repetitions; K-FAC factors and "
        f"decompositions every {INTERVAL} steps (amortized: 1/{INTERVAL} factors+decomp, "
        f"{INTERVAL - 1}/{INTERVAL} precondition)"
    )
    lo, hi = depths[0], depths[-1]
    print(
        "registered K-FAC layers: "
        + ", ".join(f"{layers[d]} at {d} blocks" for d in depths)
        + f" (x{layers[hi] / layers[lo]:.2f})"
    )
    print_rows(rows, depths)
    print(
        "\nops: aten operations per call; syncs: of them, scalars read on the host "
        f"({SYNC}); ms: median CPU milliseconds\n"
        "* compiled rows: operations of the eager sync_free path (what the compiled graph "
        "replaces); times compiled (every step kind; the hooks' statistics stay eager)"
    )
    for d in depths:
        for n, c in per_depth[d]["compile"].items():
            if "error" in c:
                print(
                    f"compile at {d} blocks, {n}: FAILED ({c['error']}, at {c['where']}); not timed"
                )
                continue
            print(
                f"compile at {d} blocks, {n}: warm-up {c['warmup_s']:.1f} s, {c['graphs']} graph(s)"
                " (compiling; inductor's on-disk cache shortens a rerun)"
            )
        if per_depth[d]["recompiles_while_timed"]:
            print(
                f"WARNING: {per_depth[d]['recompiles_while_timed']} recompile(s) while "
                f"timing at {d} blocks"
            )
    result = {
        "command": " ".join(
            ["python", "benchmarks/step_ops.py", *(sys.argv[1:] if argv is None else argv)]
        ),
        **git_commit(),
        "machine": machine,
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "depths": depths,
        "layers": {str(d): layers[d] for d in depths},
        "layers_growth": layers[hi] / layers[lo],
        "rows": [_jsonable(r) for r in rows],
        "samples_ms": {
            str(d): {
                f"{n} {k}": {
                    "forward+backward": [1e3 * s for s in fb.seconds],
                    "step": [1e3 * s for s in st.seconds],
                }
                for (n, k), (fb, st) in per_depth[d]["parts"].items()
            }
            for d in depths
        },
        "compile": {str(d): per_depth[d]["compile"] for d in depths},
        "recompiles_while_timed": {str(d): per_depth[d]["recompiles_while_timed"] for d in depths},
        "final_loss": {str(d): per_depth[d]["final_loss"] for d in depths},
        "seconds": time.perf_counter() - started,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nwrote {out} ({result['seconds']:.0f} s)")
    return 0


def _jsonable(row: dict[str, Any]) -> dict[str, Any]:
    """Depth keys as strings (JSON object keys)."""
    return {
        k: (
            {str(d): x for d, x in v.items()}
            if isinstance(v, dict) and all(isinstance(d, int) for d in v)
            else v
        )
        for k, v in row.items()
    }


if __name__ == "__main__":
    sys.exit(main())
