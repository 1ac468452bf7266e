"""The Gram product ``rowsᵀ rows`` as one product against ``gram_of``'s upper block triangle.

Run ``python benchmarks/gram_blocks.py`` (about a minute on a 2-core CPU) or ``--quick``
(a smoke test, not a measurement). ``--out FILE`` keeps the run (command, commit, machine
with its bfloat16 flags, every row).

``kfac_func.blocks.spec.gram_of`` multiplies only the diagonal and upper blocks of a
symmetric product (four column blocks: five eighths of the multiply-adds) and copies the
upper blocks' transposes below the diagonal, on a CPU and above a size threshold. This
script times, for each (batch, rows, width) and dtype, the single product ``rows.mT @ rows``
and the four-block triangle, one thread, medians of ``--reps`` timings (each a mean over
enough calls to last 20 ms), in an order alternated between repetitions; ``blocked`` says
whether ``gram_of`` chooses the triangle for that shape and dtype (``blocked_work``: a
threshold of its own for 16-bit products on a CPU with AMX tiles). The hooks' statistics
are these products, in bfloat16 under bfloat16 autocast where the CPU multiplies it
natively.

No timing is asserted anywhere; the numbers are printed for people to read.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import race
from stage_arithmetic import bf16_flags
from step_time import checked_out, print_table

from kfac_func.blocks import spec

SHAPES = [
    (256, 128),
    (768, 192),
    (768, 256),
    (1536, 256),
    (768, 384),
    (256, 512),
    (1536, 512),
    (768, 768),
    (1536, 768),
    (4096, 768),
    (1536, 1024),
    (2, 768, 385),  # lm4x's block-diagonal A factors of its 768-wide inputs (with a bias)
]
QUICK_SHAPES = [(64, 16), (2, 600, 512)]
DTYPES = (torch.float32, torch.bfloat16)


def one_product(rows: torch.Tensor) -> torch.Tensor:
    return rows.mT @ rows


def mean_ms(fn: Callable[[], Any], budget: float) -> float:
    """Mean milliseconds of ``fn()`` over enough calls to last about ``budget`` seconds."""
    fn()
    t0 = time.perf_counter()
    fn()
    one = time.perf_counter() - t0
    calls = max(1, int(budget / max(one, 1e-7)))
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return 1e3 * (time.perf_counter() - t0) / calls


def measure(shape: tuple[int, ...], dtype: torch.dtype, reps: int, budget: float) -> dict:
    n, d = shape[-2:]
    rows = torch.randn(*shape, generator=torch.Generator().manual_seed(0)).to(dtype)
    exact = rows.double().mT @ rows.double()
    err = (spec._block_triangle(rows).double() - exact).abs().max() / exact.abs().max()
    times: dict[str, list[float]] = {"one": [], "triangle": []}
    for rep in range(reps):
        order = [("one", one_product), ("triangle", spec._block_triangle)]
        for name, fn in order if rep % 2 else order[::-1]:
            times[name].append(mean_ms(lambda fn=fn: fn(rows), budget))
    one, tri = (statistics.median(times[k]) for k in ("one", "triangle"))
    blocked = spec._in_blocks(rows)
    return {
        "batch": shape[0] if len(shape) == 3 else 1,
        "rows": n,
        "width": d,
        "dtype": str(dtype).removeprefix("torch."),
        "one_product_ms": one,
        "triangle_ms": tri,
        "triangle_over_one": tri / one,
        "blocked": blocked,
        "max_relative_error": float(err),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny shapes, one repetition")
    p.add_argument("--reps", type=int, default=5, help="timings per shape and dtype (median)")
    p.add_argument("--out", default=None, help="write the run as JSON here")
    p.add_argument("--require-clean", action="store_true", help="refuse a dirty tree")
    args = p.parse_args(argv)
    checkout = checked_out(("benchmarks/results",), args.require_clean)
    if checkout is None:
        return 1
    torch.set_num_threads(1)
    shapes = QUICK_SHAPES if args.quick else SHAPES
    reps, budget = (1, 0.002) if args.quick else (args.reps, 0.02)
    started = time.perf_counter()
    rows = [measure(s, dt, reps, budget) for dt in DTYPES for s in shapes]
    print_table(
        ["dtype", "batch", "rows", "width", "one ms", "triangle ms", "triangle/one", "blocked"],
        [
            [
                r["dtype"],
                str(r["batch"]),
                str(r["rows"]),
                str(r["width"]),
                f"{r['one_product_ms']:.3f}",
                f"{r['triangle_ms']:.3f}",
                f"{r['triangle_over_one']:.2f}",
                "yes" if r["blocked"] else "no",
            ]
            for r in rows
        ],
    )
    doc = {
        "benchmark": "gram_blocks",
        "quick": args.quick,
        "command": "python benchmarks/gram_blocks.py " + " ".join(argv or sys.argv[1:]),
        **checkout,
        "machine": race.machine(1),
        "bf16_flags": bf16_flags(),
        "threshold": {
            "blocks": spec._GRAM_BLOCKS,
            "work": {str(dt).removeprefix("torch."): spec.blocked_work(dt) for dt in DTYPES},
            "width": spec._BLOCKED_WIDTH,
        },
        "rows": rows,
        "seconds": time.perf_counter() - started,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
