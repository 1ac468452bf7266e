"""A small GPT-2 trained by the Hugging Face Trainer with AdamW and with K-FAC (kfac_func.KFAC).

The text is the source code of a few standard-library modules (read from the files under
``sysconfig.get_paths()["stdlib"]``, so nothing is downloaded), as bytes: the tokens are
the 256 byte values, no tokenizer. The modules are joined in name order; the first 90 %
of the bytes train the model (windows of ``--context`` bytes every ``context / 2``), the
rest is held out (non-overlapping windows) for the evaluation loss.

Both optimizers go through the same ``transformers.Trainer`` (``optimizers=(opt,
scheduler)``), from the same initial weights (``GPT2LMHeadModel`` built from its config,
random init), on the same batches, with the same schedule (linear warm-up, cosine decay)
and gradient clipping. K-FAC is ``kfac_func.KFAC``: a ``torch.optim.Optimizer`` holding a
``KFACPreconditioner`` and SGD on the layers it preconditions (Adam's step in K-FAC's
eigenbasis: ``eigenbasis_moments=True``, no KL clip) and AdamW on whatever it leaves out
(``--adam-lr``), so the Trainer steps it as it steps AdamW.

The learning rates are the best of a sweep of each (seed 0, the default settings): AdamW
1e-3 to 1e-2 (2e-3 best; 1.5e-3 and 3e-3 within 0.02 nats), SGD under K-FAC 1e-2 to 3e-2
(2e-2 best; 1.5e-2 and 3e-2 within 0.011 nats; 1e-2 0.1 nats worse).

Each epoch is ``--steps`` optimizer steps; after each the Trainer evaluates the held-out
loss. The script prints a row per epoch (mean training loss of the epoch, evaluation loss
in nats and bits per byte, training seconds without evaluation), then writes ``OUT.csv``
and ``OUT.png`` with the curves, and ``OUT.json`` with the command, the commit and the
machine.

    python examples/hf_trainer.py                      # adamw and kfac, about 2 minutes
    python examples/hf_trainer.py --quick              # a few steps, to check it runs
    python examples/hf_trainer.py --out examples/results/hf_trainer   # the committed results
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import sysconfig
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

import kfac_func as kf

if not torch.cuda.is_available():
    # the Trainer imports DeepSpeed where it is installed, which otherwise warns on every
    # run that it found no accelerator
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import OUT_HELP, format_table, save_curves, save_provenance

OPTIMIZERS = ("adamw", "kfac")
MODULES = ("calendar", "difflib", "fractions", "heapq", "shlex", "textwrap")
HEADER = "optimizer  epoch  train_loss  eval_loss  eval_bpb  seconds"
ROW = (
    "{0:>9}  {epoch:5d}  {train_loss:10.4f}  {eval_loss:9.4f}  "
    "{eval_bits_per_byte:8.4f}  {seconds:7.1f}"
)


# --------------------------------------------------------------------------- data


def stdlib_bytes(modules: tuple[str, ...] = MODULES) -> bytes:
    """The source files of ``modules`` from the standard library, joined in name order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return b"\n\n".join((root / f"{m}.py").read_bytes() for m in sorted(modules))


class Windows(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Windows of ``context`` byte ids every ``stride`` bytes, as the Trainer's dicts
    (``labels`` are the inputs: GPT-2 shifts them itself)."""

    def __init__(self, ids: torch.Tensor, context: int, stride: int) -> None:
        self.ids, self.context = ids, context
        self.starts = list(range(0, len(ids) - context + 1, stride))

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        window = self.ids[self.starts[i] : self.starts[i] + self.context]
        return {"input_ids": window, "labels": window}


def datasets(args: argparse.Namespace) -> tuple[Windows, Windows, int]:
    """Training and held-out windows, and the number of bytes of text."""
    text = stdlib_bytes()
    ids = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    split = round(len(ids) * 0.9)
    train = Windows(ids[:split], args.context, args.context // 2)
    held_out = Windows(ids[split:], args.context, args.context)
    held_out.starts = held_out.starts[: args.eval_windows]
    return train, held_out, len(ids)


# --------------------------------------------------------------------------- training


def make_model(args: argparse.Namespace) -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(args.seed)  # the same initial weights for every optimizer
    config = GPT2Config(
        vocab_size=256,
        n_positions=args.context,
        n_embd=args.d_model,
        n_layer=args.layers,
        n_head=args.heads,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config)


def make_optimizer(name: str, model: Any, args: argparse.Namespace) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=args.adam_lr, weight_decay=0.0)
    with warnings.catch_warnings():  # where tied layers are skipped, they go to AdamW
        warnings.filterwarnings("ignore", message=".*is shared by layers.*")
        return kf.KFAC(
            model,
            lr=args.kfac_lr,
            recipe="kfac-pytorch",  # every setting is given here, as for the committed results
            others_kwargs={"lr": args.adam_lr, "weight_decay": 0.0},
            damping=args.damping,
            kl_clip=None,
            eigenbasis_moments=True,
            moment_beta1=0.9,
            moment_beta2=0.95,
            factor_update_steps=args.factor_update_steps,
            inv_update_steps=args.inv_update_steps,
            factor_decay=args.factor_decay,
            scaling="fisher",
        )


def train(
    name: str, args: argparse.Namespace, train_set: Windows, held_out: Windows, out: Path
) -> list[dict[str, float]]:
    """Train one model with optimizer ``name`` in a Trainer; one row per epoch."""
    from transformers import (
        PrinterCallback,
        Trainer,
        TrainerCallback,
        TrainingArguments,
        get_cosine_schedule_with_warmup,
    )

    model = make_model(args)
    optimizer = make_optimizer(name, model, args)
    total = args.epochs * args.steps
    scheduler = get_cosine_schedule_with_warmup(optimizer, round(args.warmup * total), total)
    rows: list[dict[str, float]] = []

    class Record(TrainerCallback):  # type: ignore[misc]
        """Training seconds (steps only) and a row at each evaluation."""

        seconds = 0.0
        started = 0.0
        train_loss = math.nan

        def on_step_begin(self, *a: Any, **k: Any) -> None:
            self.started = time.perf_counter()

        def on_step_end(self, *a: Any, **k: Any) -> None:
            self.seconds += time.perf_counter() - self.started

        def on_log(self, _args: Any, state: Any, control: Any, logs: Any = None, **k: Any) -> None:
            if logs and "loss" in logs:
                self.train_loss = float(logs["loss"])

        def on_evaluate(self, _args: Any, state: Any, control: Any, metrics: Any, **k: Any) -> None:
            loss = float(metrics["eval_loss"])
            rows.append(
                {
                    "epoch": len(rows) + 1,
                    "train_loss": self.train_loss,
                    "eval_loss": loss,
                    "eval_bits_per_byte": loss / math.log(2),
                    "seconds": self.seconds,
                }
            )
            print(ROW.format(name, **rows[-1]), flush=True)

    training_args = TrainingArguments(
        output_dir=str(out),
        max_steps=total,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=64,
        eval_strategy="steps",
        eval_steps=args.steps,
        logging_steps=args.steps,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=not sys.stderr.isatty(),
        seed=args.seed + 1,  # the same batches for every optimizer
        data_seed=args.seed + 1,
        dataloader_num_workers=0,
    )
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train_set,
        eval_dataset=held_out,
        optimizers=(optimizer, scheduler),
        callbacks=[Record()],
    )
    trainer.remove_callback(PrinterCallback)  # the rows below instead of the log dicts
    trainer.train()
    if isinstance(optimizer, kf.KFAC):
        updates = {ls.factor_updates for ls in optimizer.preconditioner.state.layers.values()}
        print(
            f"{name}: {len(optimizer.preconditioner.layers)} layers preconditioned, "
            f"{optimizer.preconditioner.steps} steps, factor updates per layer {sorted(updates)}"
        )
    return rows


# --------------------------------------------------------------------------- output


def run_details() -> dict[str, Any]:
    """What the JSON beside the CSV records besides :func:`common.provenance`."""
    import transformers

    return {
        "transformers": transformers.__version__,
        "text": f"stdlib sources {', '.join(MODULES)} of Python {platform.python_version()}",
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = parser.add_argument
    add("--optimizers", default=",".join(OPTIMIZERS), help=f"comma-separated, from {OPTIMIZERS}")
    add("--epochs", type=int, default=6, help="epochs of each optimizer (--steps steps each)")
    add("--steps", type=int, default=50, help="optimizer steps per epoch")
    add("--batch-size", type=int, default=16, help="windows per training batch")
    add("--context", type=int, default=64, help="bytes per window (GPT-2's n_positions)")
    add("--d-model", type=int, default=64, help="GPT-2's n_embd")
    add("--layers", type=int, default=2, help="GPT-2's n_layer")
    add("--heads", type=int, default=4, help="GPT-2's n_head (must divide --d-model)")
    add("--eval-windows", type=int, default=256, help="held-out windows evaluated per epoch")
    add("--warmup", type=float, default=0.05, help="share of all steps spent warming up")
    add(
        "--adam-lr",
        type=float,
        default=2e-3,
        help="peak AdamW learning rate (adamw, and the parameters K-FAC leaves alone)",
    )
    add("--kfac-lr", type=float, default=2e-2, help="peak learning rate of SGD under K-FAC")
    add("--damping", type=float, default=1e-3, help="K-FAC damping (scaling='fisher')")
    add("--factor-decay", type=float, default=0.8, help="running-average decay of the factors")
    add("--factor-update-steps", type=int, default=5, help="steps between factor updates")
    add("--inv-update-steps", type=int, default=5, help="steps between eigendecompositions")
    add("--threads", type=int, default=1, help="CPU threads (0: PyTorch's default)")
    add("--seed", type=int, default=0, help="seed of the initial weights (batches: seed + 1)")
    add("--out", default="hf_trainer", help=OUT_HELP)
    add("--quick", action="store_true", help="2 epochs of 4 steps, 16 held-out windows")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.optimizers.split(",") if n.strip()]
    unknown = sorted(set(names) - set(OPTIMIZERS))
    if unknown or not names:
        parser.error(f"--optimizers: unknown {unknown}; choose from {OPTIMIZERS}")
    args.optimizers = names
    if args.quick:
        args.epochs, args.steps, args.eval_windows = 2, 4, 16
    return args


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    import transformers

    transformers.logging.set_verbosity_error()
    train_set, held_out, size = datasets(args)
    print(
        f"stdlib sources ({', '.join(MODULES)}): {size:,} bytes; {len(train_set):,} training "
        f"windows, {len(held_out)} held out; {args.epochs} epochs x {args.steps} steps of "
        f"{args.batch_size} x {args.context} bytes"
    )
    print(HEADER)
    results = {}
    with tempfile.TemporaryDirectory() as scratch:  # the Trainer's output_dir (nothing saved)
        for name in args.optimizers:
            results[name] = train(name, args, train_set, held_out, Path(scratch))
    columns = ["optimizer", "epoch", "train_loss", "eval_loss", "eval_bits_per_byte", "seconds"]
    table = [{"optimizer": n, **rows[-1]} for n, rows in results.items()]
    print("\nfinal epoch\n" + format_table(table, columns))
    csv_path, png_path = save_curves(
        results, args.out, title="GPT-2 on stdlib sources, Hugging Face Trainer (cpu)"
    )
    json_path = save_provenance(csv_path, __file__, argv, **run_details())
    print(f"wrote {csv_path}, {png_path} and {json_path}")


if __name__ == "__main__":
    main()
