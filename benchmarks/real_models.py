"""What K-FAC preconditions in model code this project did not write.

The fixture models of the tests (``tests/fixture_models.py``: Hugging Face GPT-2, Llama
with untied and tied heads, BERT, a nanoGPT-style GPT, all built from configs, random
initialisation) registered as users register them (``kf.register(model)``; the nanoGPT
model's own ``LayerNorm`` class mapped with ``kinds=``), and GPT-2 small at its real size:
per model, the registered layers by kind, the parameter tensors and the parameters
preconditioned, and the modules skipped with their reasons. Writes ``OUT.csv`` (one row
per model) and prints the table.

    python benchmarks/real_models.py            # a few seconds
"""

from __future__ import annotations

import argparse
import csv
import sys
import warnings
from collections import Counter
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # this checkout's kfac_func and fixtures
from fixture_models import fixtures  # noqa: E402

import kfac_func as kf  # noqa: E402


def kinds_of(table: kf.LayerTable) -> list[str]:
    """The kind of every registered layer."""
    return [spec.kind for spec in table.values()]


class FullGPT2:
    """GPT-2 small at its real size (124M parameters, ``GPT2Config()``'s defaults)."""

    name = "gpt2-124M"
    kinds = None

    @staticmethod
    def build(dtype: torch.dtype) -> torch.nn.Module:
        from transformers import GPT2Config, GPT2LMHeadModel

        torch.manual_seed(0)
        return GPT2LMHeadModel(GPT2Config()).to(dtype)


def coverage(fixture: object) -> dict[str, object]:
    """One row of the table for a :class:`fixture_models.Fixture`."""
    model = fixture.build(torch.float32)  # type: ignore[attr-defined]
    kinds = fixture.kinds  # type: ignore[attr-defined]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        table = kf.register(model, **({} if kinds is None else {"kinds": kinds}))
    mine, _ = table.split_parameters(model)
    params = list(model.parameters())
    return {
        "model": fixture.name,  # type: ignore[attr-defined]
        "class": type(model).__name__,
        "layers": len(table),
        "kinds": " ".join(
            f"{k}:{n}" for k, n in sorted(Counter(s.kind for s in table.values()).items())
        ),
        "tensors_preconditioned": len(mine),
        "tensors": len(params),
        "params_preconditioned": sum(p.numel() for p in mine),
        "params": sum(p.numel() for p in params),
        "skipped": "; ".join(f"{n}: {why}" for n, why in table.skipped.items()),
        "warnings": len(caught),
        "kinds_argument": "" if kinds is None else ", ".join(c.__name__ for c in kinds),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out",
        default=str(ROOT / "benchmarks" / "results" / "real_models"),
        help="prefix of the CSV file written",
    )
    args = parser.parse_args(argv)
    rows = [coverage(f) for f in [*fixtures(), FullGPT2()]]
    with open(f"{args.out}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"{'model':16} {'layers':>6} {'tensors':>9} {'parameters':>15}  skipped")
    for r in rows:
        tensors = f"{r['tensors_preconditioned']}/{r['tensors']}"
        count = f"{r['params_preconditioned']}/{r['params']}"
        print(f"{r['model']:16} {r['layers']:>6} {tensors:>9} {count:>15}  {r['skipped'] or '-'}")
    print(f"wrote {args.out}.csv")


if __name__ == "__main__":
    main()
