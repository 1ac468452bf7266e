"""Training steps per second of a small GPT, eager and ``torch.compile``d, with and without
``KFACPreconditioner``, side by side.

Run ``python benchmarks/compile_model.py`` (a few minutes on a 2-core CPU) or ``--quick``
(a tiny model, seconds plus the compiles: a smoke test, not a measurement).

One step: forward, cross-entropy, ``loss.backward()``, ``pre.step()`` (K-FAC rows only),
``SGD.step()``, ``zero_grad``. The model is nanoGPT's shape (token and position
embeddings, pre-norm blocks of causal attention and a GELU MLP, a linear head) with
``--depth`` blocks of width ``--width`` on ``--batch`` sequences of ``--seq`` tokens.
K-FAC updates the factors every ``F`` steps and the decompositions every ``I`` steps
(``--intervals``); the preconditioner is built before ``torch.compile(model)``.

The preconditioner's hooks run eagerly at graph breaks of the compiled model (see
:mod:`kfac_func.adapter.compiled`): the table shows what those breaks cost (compiled
K-FAC vs compiled SGD, vs eager K-FAC) and how many graphs the model became. Each
repetition times a block of ``lcm(F, I)``-aligned consecutive steps of every variant in
turn (order reversed every other repetition); times are medians per step over
``--reps``. Nothing is asserted; the numbers are printed for people to read.
"""

from __future__ import annotations

import argparse
import math
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.testing import CompileCounter

import kfac_func as kf


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (
            z.view(b, t, self.heads, c // self.heads).transpose(1, 2)
            for z in self.qkv(self.ln1(x)).split(c, dim=2)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, d: int, seq: int, depth: int, heads: int = 4) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList([Block(d, heads) for _ in range(depth)])
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(self.ln(x)).flatten(0, 1), targets.flatten())


def variant(args: argparse.Namespace, compiled: bool, kfac: bool) -> tuple[Callable[[], Any], Any]:
    """``(one training step, the compile counter or None)`` of a fresh model."""
    torch.manual_seed(0)
    model = GPT(args.vocab, args.width, args.seq, args.depth)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    f, i = args.intervals
    pre = (
        kf.KFACPreconditioner(
            model,
            factor_update_steps=f,
            inv_update_steps=i,
            settings=kf.Settings(scaling="fisher"),
            damping=1e-3,
        )
        if kfac
        else None
    )
    counter = CompileCounter() if compiled else None
    forward: Any = model
    if compiled:
        # the counter counts the frames and ops dynamo captures, then hands the graph to inductor
        def backend(gm: torch.fx.GraphModule, inputs: list[Any]) -> Any:
            assert counter is not None
            counter(gm, inputs)
            from torch._inductor.compile_fx import compile_fx

            return compile_fx(gm, inputs)

        forward = torch.compile(model, backend=backend)
    gen = torch.Generator().manual_seed(1)

    def step() -> None:
        idx = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
        forward(idx, torch.roll(idx, 1, 1)).backward()
        if pre is not None:
            pre.step()
        opt.step()
        opt.zero_grad()

    return step, counter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--depth", type=int, default=4, help="transformer blocks")
    parser.add_argument("--width", type=int, default=64, help="model width")
    parser.add_argument("--seq", type=int, default=32, help="tokens per sequence")
    parser.add_argument("--batch", type=int, default=8, help="sequences per batch")
    parser.add_argument("--vocab", type=int, default=256, help="vocabulary size")
    parser.add_argument("--intervals", default="10/50", help="F/I: factor and inverse steps")
    parser.add_argument(
        "--reps", type=int, default=3, help="timed repetitions (each step's time is their median)"
    )
    parser.add_argument("--quick", action="store_true", help="tiny model, two repetitions")
    args = parser.parse_args()
    if args.quick:
        args.depth, args.width, args.seq, args.batch, args.vocab, args.reps = 1, 16, 8, 4, 32, 2
        args.intervals = "2/4"
    args.intervals = tuple(int(v) for v in args.intervals.split("/"))
    block = math.lcm(*args.intervals)
    if block < 10:
        block *= math.ceil(10 / block)
    warm = min(block, 20)
    print(f"cpu: {platform.processor() or platform.machine()}, threads {torch.get_num_threads()}")
    print(
        f"GPT depth {args.depth} width {args.width} seq {args.seq} batch {args.batch}; "
        f"K-FAC F/I {args.intervals[0]}/{args.intervals[1]}; {block} steps per block"
    )
    names = ["eager sgd", "eager kfac", "compiled sgd", "compiled kfac"]
    variants = {}
    for name in names:
        start = time.perf_counter()
        step, counter = variant(args, "compiled" in name, "kfac" in name)
        for _ in range(warm):  # warm-up: compiles, first factors and decompositions
            step()
        graphs = "-" if counter is None else str(counter.frame_count)
        variants[name] = (step, graphs, time.perf_counter() - start)
    times: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(args.reps):
        for name in names if rep % 2 == 0 else reversed(names):
            step = variants[name][0]
            start = time.perf_counter()
            for _ in range(block):
                step()
            times[name].append((time.perf_counter() - start) / block)
    base = statistics.median(times["eager sgd"])
    head = ("ms/step", 9), ("steps/s", 9), ("vs eager sgd", 14), ("graphs", 8), ("warm-up s", 11)
    print(f"{'variant':<15}" + "".join(f"{h:>{w}}" for h, w in head))
    for name in names:
        t = statistics.median(times[name])
        _, graphs, warmup_s = variants[name]
        print(
            f"{name:<15}{1e3 * t:>9.2f}{1 / t:>9.1f}{t / base:>14.2f}{graphs:>8}{warmup_s:>11.1f}"
        )
    kfac_c, kfac_e = (
        statistics.median(times["compiled kfac"]),
        statistics.median(times["eager kfac"]),
    )
    sgd_c = statistics.median(times["compiled sgd"])
    print(f"ratio compiled kfac / compiled sgd: {kfac_c / sgd_c:.2f}")
    print(f"ratio compiled kfac / eager kfac: {kfac_c / kfac_e:.2f}")


if __name__ == "__main__":
    main()
