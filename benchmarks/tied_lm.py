"""The tied embedding/head weight preconditioned by K-FAC, against leaving it to AdamW.

A small Hugging Face ``GPT2LMHeadModel`` (``GPT2Config(n_layer=2, n_embd=64, n_head=2,
n_positions=32)``, random init, ``tie_word_embeddings=True`` by default) on the character
data of ``examples/transformer_lm.py`` (its data, loss, schedule and evaluation are
imported), trained with the ``kfac-moments`` recipe of that example: SGD (no momentum) on
the parameters K-FAC preconditions with eigenbasis moments (Adam's step in K-FAC's
eigenbasis, factors and eigenbases every 5 steps), AdamW on the rest. Two variants with
the same seeds, initialisation and batches:

- ``tied``: the shared weight is one K-FAC layer (kind ``"tied"``);
- ``skip``: the embedding and the head are left out (``skip_layers``), so that AdamW
  steps the shared weight — what K-FAC did before tied weights were supported.

Writes ``OUT.csv`` (one row per variant, seed and evaluation) and prints the final test
loss per variant (mean and range over seeds). A few minutes on a 2-core CPU.

    python benchmarks/tied_lm.py                     # 3 seeds, 400 steps each
    python benchmarks/tied_lm.py --quick               # smoke test
"""

from __future__ import annotations

import argparse
import csv
import math
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]  # this checkout's kfac_func and example
from transformer_lm import CharData, evaluate, lm_loss, lr_schedule  # noqa: E402

import kfac_func as kf  # noqa: E402

VARIANTS = ("tied", "skip")
SKIP = [r"(^|\.)wte$", r"(^|\.)lm_head$"]


class GPT2Chars(nn.Module):
    """``GPT2LMHeadModel`` over characters returning its logits (built from a
    ``GPT2Config``: tied head, random init, no dropout; 2 layers, n_embd 64, 2 heads unless
    told)."""

    def __init__(
        self, vocab: int, context: int, n_embd: int = 64, n_layer: int = 2, n_head: int = 2
    ) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(
            n_layer=n_layer,
            n_embd=n_embd,
            n_head=n_head,
            n_positions=context,
            vocab_size=vocab,
            bos_token_id=0,
            eos_token_id=0,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
        self.gpt = GPT2LMHeadModel(config)
        assert self.gpt.lm_head.weight is self.gpt.transformer.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.gpt(input_ids=idx).logits


def run(variant: str, seed: int, args: argparse.Namespace, data: CharData) -> list[dict]:
    torch.manual_seed(seed)
    model = GPT2Chars(data.vocab, args.context)
    skip = SKIP if variant == "skip" else []
    table = kf.register(model, skip)
    kfac_params, rest = table.split_parameters(model)
    sgd = torch.optim.SGD(kfac_params, lr=args.lr, momentum=0.0)
    optimizers: list[torch.optim.Optimizer] = [sgd]
    if rest:
        optimizers.append(torch.optim.AdamW(rest, lr=args.adam_lr, weight_decay=0.0))
    pre = kf.KFACPreconditioner(
        model,
        factor_update_steps=5,
        inv_update_steps=5,
        damping=1e-3,
        factor_decay=0.8,
        kl_clip=None,
        lr=lambda step: sgd.param_groups[0]["lr"],
        skip_layers=skip,
        settings=kf.Settings(
            scaling="fisher", eigenbasis_moments=True, moment_beta2=0.95, moment_beta1=0.9
        ),
    )
    schedule = lr_schedule(round(0.05 * args.steps), args.steps)
    schedulers = [torch.optim.lr_scheduler.LambdaLR(o, schedule) for o in optimizers]
    batches = torch.Generator().manual_seed(seed + 1)
    x_test, y_test = data.test_windows(args.context, args.test_windows)
    rows, elapsed = [], 0.0
    for step in range(1, args.steps + 1):
        start = time.perf_counter()
        x, y = data.batch(args.batch_size, args.context, batches)
        for o in optimizers:
            o.zero_grad(set_to_none=True)
        loss = lm_loss(model(x), y)
        loss.backward()
        pre.step()
        for o, sched in zip(optimizers, schedulers):
            o.step()
            sched.step()
        elapsed += time.perf_counter() - start
        if step % args.eval_every == 0 or step == args.steps:
            test = evaluate(model, x_test, y_test)
            rows.append(
                {
                    "variant": variant,
                    "seed": seed,
                    "step": step,
                    "train_loss": float(loss.detach()),
                    "test_loss": test,
                    "test_bits_per_char": test / math.log(2),
                    "seconds": round(elapsed, 2),
                    "kfac_params": sum(p.numel() for p in kfac_params),
                    "adamw_params": sum(p.numel() for p in rest),
                }
            )
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--steps", type=int, default=400, help="training steps per run")
    add("--seeds", default="0,1,2", help="comma-separated seeds (initial weights and batches)")
    add("--batch-size", type=int, default=32, help="windows per training batch")
    add("--context", type=int, default=32, help="characters per window (GPT-2's n_positions)")
    add("--lr", type=float, default=0.014, help="peak learning rate of SGD under K-FAC")
    add("--adam-lr", type=float, default=2e-3, help="peak learning rate of AdamW")
    add("--eval-every", type=int, default=100, help="steps between test-loss evaluations")
    add("--test-windows", type=int, default=256, help="test windows evaluated")
    add("--threads", type=int, default=1, help="CPU threads (0: PyTorch's default)")
    add("--quick", action="store_true", help="a smoke test: 20 steps, one seed")
    add(
        "--out",
        default=str(ROOT / "benchmarks" / "out" / "tied_lm"),
        help="prefix of the CSV written (benchmarks/results/tied_lm: the committed results)",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.seeds, args.eval_every, args.test_windows = 20, "0", 10, 32
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message=".*token_id.*")
    data = CharData()
    seeds = [int(s) for s in args.seeds.split(",")]
    rows = []
    for seed in seeds:
        for variant in VARIANTS:
            rows += run(variant, seed, args, data)
            last = rows[-1]
            print(
                f"{variant:>5} seed {seed}: test loss {last['test_loss']:.4f} nats "
                f"({last['test_bits_per_char']:.4f} bits/char), {last['seconds']:.1f} s",
                flush=True,
            )
    out = Path(args.out + ".csv")
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"\nfinal test loss after {args.steps} steps (nats/char; mean [min, max] over seeds)")
    for variant in VARIANTS:
        last = [r for r in rows if r["variant"] == variant and r["step"] == args.steps]
        final, secs = [r["test_loss"] for r in last], [r["seconds"] for r in last]
        print(
            f"{variant:>5}: {statistics.mean(final):.4f} [{min(final):.4f}, {max(final):.4f}]"
            f"  {statistics.mean(secs):.1f} s"
        )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
