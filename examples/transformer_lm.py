"""A character-level transformer language model trained with SGD, Adam and K-FAC.

The text is Python's own help pages (``pydoc_data.topics``, part of the standard library,
about 465,000 characters), so nothing is downloaded. The topics are joined in name order;
the first 90 % of the characters train the model, the rest is the test text.

The model is a small decoder-only transformer: token and position embeddings, pre-norm
blocks of causal self-attention (query, key, value and output projections are separate
``nn.Linear`` layers) and a GELU MLP, and a linear output head. K-FAC
(:class:`kfac_func.KFACPreconditioner` in front of SGD with momentum) preconditions every
layer: the linears, the token and position embeddings (diagonal A) and the LayerNorms
(per-unit scale/shift blocks); ``--kfac-skip`` leaves modules to plain SGD, and
``--kfac-linear-only`` reproduces the earlier configuration (linears only). Every
optimizer starts from the same initialisation, sees the same batches and follows the same
learning-rate schedule (linear warm-up, cosine decay to 10 %).

The defaults were picked by short learning-rate / damping sweeps of each optimizer on this
task (SGD above 0.2 and Adam above 2e-3 get worse or diverge). K-FAC uses the per-example
Fisher convention (``scaling="fisher"``), in which the damping is relative to the curvature
of the loss; its step is bounded by the KL clip, whose bound follows the square of the
schedule so that K-FAC's step length warms up and decays like the others'.
``kfac-default`` is ``kf.KFAC(model)`` with no other argument (the recommended recipe at
its default learning rate, under the same schedule); none of the flags above changes it
but ``--kfac-skip``.

Each epoch is ``--steps`` training batches of random windows of the training text. After
each epoch the script prints the training loss (mean over the epoch's batches), the test
loss and bits per character on a fixed set of test windows, and the wall time, then
writes ``OUT.csv`` and ``OUT.png`` with the curves of every optimizer (losses against
training seconds) and ``OUT.json`` with the command, the commit and the machine.

    python examples/transformer_lm.py                       # sgd, adam and kfac
    python examples/transformer_lm.py --optimizers kfac --epochs 3 --steps 50
    python examples/transformer_lm.py --model torch         # nn.TransformerEncoderLayer
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import kfac_func as kf

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import OUT_HELP, HelpFormatter, format_table, progress, save_curves, save_provenance

OPTIMIZERS = ("sgd", "adam", "kfac", "kfac-moments", "kfac-default")
KFAC_DEFAULTS = {
    # (learning rate, factor_update_steps, inv_update_steps, factor_decay), from sweeps
    "kfac": (0.3, 1, 5, 0.95),
    "kfac-moments": (0.014, 5, 5, 0.8),
}
HEADER = "   optimizer  epoch  train_loss  test_loss  test_bpc  seconds"
ROW = (
    "{0:>12}  {epoch:5d}  {train_loss:10.4f}  {test_loss:9.4f}  {test_bits_per_char:8.4f}"
    "  {seconds:7.1f}"
)


# --------------------------------------------------------------------------- data


class CharData:
    """The help text of the standard library as int64 character ids, split train/test."""

    def __init__(self, test_fraction: float = 0.1) -> None:
        from pydoc_data.topics import topics

        text = "\n\n".join(topics[name] for name in sorted(topics))
        self.chars = sorted(set(text))
        index = {c: i for i, c in enumerate(self.chars)}
        ids = torch.tensor([index[c] for c in text], dtype=torch.int64)
        split = round(len(ids) * (1.0 - test_fraction))
        self.train, self.test = ids[:split], ids[split:]

    @property
    def vocab(self) -> int:
        return len(self.chars)

    def batch(
        self, batch_size: int, context: int, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``batch_size`` random windows of the training text: inputs and next characters."""
        starts = torch.randint(0, len(self.train) - context - 1, (batch_size,), generator=generator)
        rows = starts[:, None] + torch.arange(context + 1)
        window = self.train[rows]
        return window[:, :-1], window[:, 1:]

    def test_windows(self, context: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``count`` windows spread evenly over the test text (the same every epoch)."""
        starts = torch.linspace(0, len(self.test) - context - 1, count).long()
        rows = starts[:, None] + torch.arange(context + 1)
        window = self.test[rows]
        return window[:, :-1], window[:, 1:]


# --------------------------------------------------------------------------- model


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention built from four ``nn.Linear`` layers."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        if d_model % heads:
            raise ValueError(f"d_model={d_model} is not divisible by heads={heads}")
        self.heads = heads
        self.query = nn.Linear(d_model, d_model)
        self.key = nn.Linear(d_model, d_model)
        self.value = nn.Linear(d_model, d_model)
        self.out = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape

        def split(y: torch.Tensor) -> torch.Tensor:
            return y.view(b, t, self.heads, d // self.heads).transpose(1, 2)

        q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    """Pre-norm transformer block: attention and MLP, each with a residual connection."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, heads)
        self.norm2 = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, 4 * d_model)
        self.fc2 = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class CharTransformer(nn.Module):
    """Decoder-only transformer over characters; returns logits ``(batch, time, vocab)``."""

    def __init__(self, vocab: int, context: int, d_model: int, layers: int, heads: int) -> None:
        super().__init__()
        self.token_embedding = nn.Embedding(vocab, d_model)
        self.position_embedding = nn.Embedding(context, d_model)
        self.blocks = nn.Sequential(*(Block(d_model, heads) for _ in range(layers)))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.token_embedding(idx) + self.position_embedding(positions)
        return self.head(self.norm(self.blocks(x)))


class TorchCharTransformer(nn.Module):
    """The same model from PyTorch's own layers: ``nn.TransformerEncoderLayer`` blocks
    (``nn.MultiheadAttention`` with a causal mask, GELU MLP, pre-norm) between the same
    embeddings, final norm and head. K-FAC preconditions the attention's packed q, k, v and
    output projections as four Linear layers."""

    def __init__(self, vocab: int, context: int, d_model: int, layers: int, heads: int) -> None:
        super().__init__()
        self.token_embedding = nn.Embedding(vocab, d_model)
        self.position_embedding = nn.Embedding(context, d_model)
        layer = nn.TransformerEncoderLayer(
            d_model,
            heads,
            4 * d_model,
            dropout=0.0,
            activation="gelu",
            batch_first=True,
            norm_first=True,
        )
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(context))
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        for name, p in self.named_parameters():
            if name.endswith("in_proj_weight"):
                nn.init.normal_(p, std=0.02)
            elif name.endswith("in_proj_bias"):
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        positions = torch.arange(t, device=idx.device)
        x = self.token_embedding(idx) + self.position_embedding(positions)
        x = self.blocks(x, mask=self.mask[:t, :t], is_causal=True)
        return self.head(self.norm(x))


MODELS = {"custom": CharTransformer, "torch": TorchCharTransformer}


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean next-character cross-entropy (nats) over every position of the batch."""
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


# --------------------------------------------------------------------------- training


def lr_schedule(warmup: int, total: int) -> Callable[[int], float]:
    """Multiplier of the base learning rate: linear warm-up, then cosine decay to 10 %."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        done = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * done))

    return factor


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 64) -> float:
    """Mean cross-entropy (nats per character) on the test windows."""
    model.eval()
    total = 0.0
    for i in range(0, len(x), batch_size):
        logits = model(x[i : i + batch_size])
        total += float(
            F.cross_entropy(logits.flatten(0, 1), y[i : i + batch_size].flatten(), reduction="sum")
        )
    model.train()
    return total / y.numel()


def train(
    name: str, args: argparse.Namespace, data: CharData, device: torch.device
) -> list[dict[str, float]]:
    """Train one model with optimizer ``name``; one row of metrics per epoch."""
    torch.manual_seed(args.seed)  # the same initial weights for every optimizer
    make = MODELS[args.model]
    model = make(data.vocab, args.context, args.d_model, args.layers, args.heads)
    model.to(device)
    preconditioner = None
    total_steps = args.epochs * args.steps
    schedule = lr_schedule(round(args.warmup * total_steps), total_steps)
    optimizers: list[torch.optim.Optimizer] = []
    if name == "adam":
        optimizers.append(
            torch.optim.AdamW(model.parameters(), lr=args.adam_lr, weight_decay=args.weight_decay)
        )
    elif name == "sgd":
        optimizers.append(
            torch.optim.SGD(
                model.parameters(),
                lr=args.sgd_lr,
                momentum=args.momentum,
                weight_decay=args.weight_decay,
            )
        )
    elif name == "kfac-default":
        # the optimizer face with nothing but the model: the recommended recipe at its
        # default learning rate (the schedule below scales it like everyone's)
        skip = {"skip_layers": args.kfac_skip} if args.kfac_skip else {}
        optimizers.append(kf.KFAC(model, **skip))
    else:
        # The recipe: SGD with momentum on the parameters K-FAC preconditions, AdamW on
        # the others (modules named by --kfac-skip, or of kinds K-FAC does not know).
        lr, factor_steps, inv_steps, decay = KFAC_DEFAULTS[name]
        table = kf.register(model, args.kfac_skip)
        kfac_params, rest = table.split_parameters(model)
        moments = name == "kfac-moments"
        sgd = torch.optim.SGD(
            kfac_params,
            lr=args.kfac_lr or lr,
            # with eigenbasis moments the momentum is Adam's first moment, kept by the
            # preconditioner (averaged before the division, as Adam and SOAP do)
            momentum=0.0 if moments else args.momentum,
            weight_decay=args.weight_decay,
        )
        optimizers.append(sgd)
        if rest:
            optimizers.append(
                torch.optim.AdamW(rest, lr=args.adam_lr, weight_decay=args.weight_decay)
            )
        # Once the KL clip binds it holds lr² · Σ grad · preconditioned grad at kl_clip, so
        # the learning rate no longer sets the step of the preconditioned layers; scaling
        # kl_clip by the square of the schedule gives that step the same warm-up and decay
        # as the other optimizers. Eigenbasis moments give Adam's step length: no clip.
        kl_clip = 0.0 if moments else args.kl_clip
        preconditioner = kf.KFACPreconditioner(
            model,
            factor_update_steps=args.factor_update_steps or factor_steps,
            inv_update_steps=args.inv_update_steps or inv_steps,
            damping=args.damping,
            factor_decay=args.factor_decay or decay,
            kl_clip=(lambda step: kl_clip * schedule(step) ** 2) if kl_clip > 0 else None,
            lr=lambda step: sgd.param_groups[0]["lr"],
            skip_layers=args.kfac_skip,
            settings=kf.Settings(
                scaling=args.scaling,
                eigenbasis_moments=moments,
                moment_beta2=args.moment_beta2,
                moment_beta1=args.momentum,
            ),
            compute_method=args.kfac_method,
        )
        if args.verbose:
            print(preconditioner.layers)
    schedulers = [torch.optim.lr_scheduler.LambdaLR(o, schedule) for o in optimizers]
    batches = torch.Generator().manual_seed(args.seed + 1)  # the same batches for everyone
    x_test, y_test = data.test_windows(args.context, args.test_windows)
    x_test, y_test = x_test.to(device), y_test.to(device)

    rows: list[dict[str, float]] = []
    elapsed = 0.0
    for epoch in range(1, args.epochs + 1):
        start = time.perf_counter()
        losses = []
        for _ in progress(range(args.steps), total=args.steps, desc=f"{name} epoch {epoch}"):
            x, y = (t.to(device) for t in data.batch(args.batch_size, args.context, batches))
            for o in optimizers:
                o.zero_grad(set_to_none=True)
            loss = lm_loss(model(x), y)
            loss.backward()
            if preconditioner is not None:
                preconditioner.step()
            for o, sched in zip(optimizers, schedulers):
                o.step()
                sched.step()
            losses.append(loss.detach())
        train_loss = float(torch.stack(losses).mean())
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed += time.perf_counter() - start
        loss = evaluate(model, x_test, y_test)
        rows.append(
            {
                "epoch": epoch,
                "train_loss": train_loss,
                "test_loss": loss,
                "test_bits_per_char": loss / math.log(2),
                "seconds": elapsed,
            }
        )
        print(ROW.format(name, **rows[-1]), flush=True)
        if not math.isfinite(train_loss):
            print(f"{name}: the training loss is not finite; stopping this optimizer")
            break
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=HelpFormatter,
    )
    add = parser.add_argument
    add("--optimizers", default=",".join(OPTIMIZERS), help=f"comma-separated, from {OPTIMIZERS}")
    add("--epochs", type=int, default=5, help="epochs of each optimizer (--steps batches each)")
    add("--steps", type=int, default=100, help="training batches per epoch")
    add("--batch-size", type=int, default=32, help="windows per training batch")
    add("--context", type=int, default=64, help="characters per window")
    add("--d-model", type=int, default=96, help="width of the embeddings and blocks")
    add("--layers", type=int, default=2, help="transformer blocks")
    add("--heads", type=int, default=4, help="attention heads per block (must divide --d-model)")
    add("--test-windows", type=int, default=256, help="test windows evaluated per epoch")
    add("--warmup", type=float, default=0.05, help="share of all steps spent warming up")
    add("--weight-decay", type=float, default=0.0, help="weight decay of every optimizer")
    add(
        "--momentum",
        type=float,
        default=0.9,
        help="SGD momentum (sgd and kfac); kfac-moments: Adam's beta1 in the eigenbasis",
    )
    add("--sgd-lr", type=float, default=0.2, help="peak learning rate of the sgd run")
    add(
        "--adam-lr",
        type=float,
        default=2e-3,
        help="peak AdamW learning rate (adam, and the parameters K-FAC leaves alone)",
    )
    add(
        "--kfac-lr",
        type=float,
        default=None,
        help="learning rate of SGD under K-FAC (default: 0.3 kfac, 0.014 kfac-moments)",
    )
    add("--damping", type=float, default=0.001, help="K-FAC damping, relative to --scaling")
    add(
        "--factor-decay",
        type=float,
        default=None,
        help="running-average decay of the factors (default: 0.95 kfac, 0.8 kfac-moments)",
    )
    add(
        "--moment-beta2",
        type=float,
        default=0.95,
        help="kfac-moments: decay of the second moments in K-FAC's eigenbasis",
    )
    add(
        "--kl-clip",
        type=float,
        default=3e-5,
        help="KL clip at the peak of the schedule (scaled by its square); 0 disables it",
    )
    add(
        "--factor-update-steps",
        type=int,
        default=None,
        help="steps between factor updates (default: 1 kfac, 5 kfac-moments)",
    )
    add(
        "--inv-update-steps",
        type=int,
        default=None,
        help="steps between decompositions (default: 5)",
    )
    add(
        "--kfac-method",
        default="eigen",
        choices=("eigen", "inverse", "ekfac"),
        help="K-FAC's compute method (ekfac: corrected eigenvalues, needs --scaling fisher)",
    )
    add(
        "--scaling",
        default="fisher",
        choices=("kfac-pytorch", "fisher"),
        help="factor convention of the preconditioner (damping is relative to it)",
    )
    add(
        "--kfac-skip",
        nargs="*",
        default=[],
        help="regular expressions of module names/classes K-FAC leaves alone",
    )
    add(
        "--model",
        default="custom",
        choices=sorted(MODELS),
        help="custom: attention from nn.Linear layers; torch: nn.TransformerEncoderLayer",
    )
    add(
        "--kfac-linear-only",
        action="store_true",
        help="precondition the nn.Linear layers only (embeddings and norms left to SGD)",
    )
    add(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="torch device to train on (cuda when available, else cpu)",
    )
    add("--threads", type=int, default=1, help="CPU threads (0: PyTorch's default)")
    add("--seed", type=int, default=0, help="seed of the initial weights (batches: seed + 1)")
    add("--out", default="transformer_lm", help=OUT_HELP)
    add("--verbose", action="store_true", help="print the layers K-FAC registers")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.optimizers.split(",") if n.strip()]
    unknown = sorted(set(names) - set(OPTIMIZERS))
    if unknown or not names:
        parser.error(f"--optimizers: unknown {unknown}; choose from {OPTIMIZERS}")
    args.optimizers = names
    if args.kfac_linear_only:
        args.kfac_skip = [*args.kfac_skip, "Embedding", "LayerNorm", "MultiheadAttention"]
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    data = CharData()
    print(
        f"pydoc topics: {len(data.train):,} train / {len(data.test):,} test characters, "
        f"vocabulary {data.vocab}; {args.epochs} epochs x {args.steps} batches of "
        f"{args.batch_size} x {args.context} characters on {device}"
    )
    print(HEADER)
    results = {}
    for name in args.optimizers:
        results[name] = train(name, args, data, device)
    columns = ["optimizer", "epoch", "train_loss", "test_loss", "test_bits_per_char", "seconds"]
    table = [{"optimizer": n, **rows[-1]} for n, rows in results.items()]
    print("\nfinal epoch\n" + format_table(table, columns))
    csv_path, png_path = save_curves(
        results,
        args.out,
        title=f"character-level transformer on pydoc topics ({device})",
        x="seconds",  # loss against training seconds: what a step of each optimizer costs
    )
    json_path = save_provenance(csv_path, __file__, sys.argv[1:] if argv is None else argv)
    print(f"wrote {csv_path}, {png_path} and {json_path}")


if __name__ == "__main__":
    main()
