"""What K-FAC preconditions of each Hugging Face family people train.

Every family of ``tests/fixture_families.py`` (GPT-NeoX, T5, ViT, Whisper, Gemma 3,
Qwen2-MoE, Mixtral, Mamba, ModernBERT, Phi-3, OPT; tiny configs, random initialisation)
trained for two steps with the recommended recipe, ``kf.KFAC``'s defaults with no
argument but the model, called as Hugging Face trains (``model(**batch).loss``, keyword
arguments and labels):

    kf.KFAC(model)

Per family: whether it runs, the parameters preconditioned (after the steps: layers
demoted on their first call or first step count as left to the other optimizer), the
layers by kind, and the modules left to the other optimizer with their reasons; and the
families at their configs' default sizes, registered on the meta device (less the
layers of the classes the tiny models' steps refused). Writes ``OUT.json`` and prints the table.

    python benchmarks/families.py            # about half a minute
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # this checkout's kfac_func and fixtures
from fixture_families import FAMILIES, build  # noqa: E402

import kfac_func as kf  # noqa: E402

STEPS = 2


def _short(reason: str) -> str:
    """A reason's first clause (the table's column; the JSON keeps the whole)."""
    for stop in (": ", "; ", " (", " with ["):
        reason = reason.split(stop)[0]
    return reason


def family_row(family: str) -> dict[str, Any]:
    """One family: trained ``STEPS`` steps with the recipe, what is preconditioned."""
    model, batch = build(family)
    model.train()
    total = sum(p.numel() for p in model.parameters() if p.requires_grad)
    row: dict[str, Any] = {"family": family, "parameters": total}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt = kf.KFAC(model)
            for step in range(STEPS):
                opt.zero_grad()
                model(**batch(step)).loss.backward()
                opt.step()
    except Exception as e:  # reported in the table: the point of the benchmark
        row.update(runs=False, error=f"{type(e).__name__}: {e}"[:400])
        return row
    pre = opt.preconditioner
    mine, _ = pre.layers.split_parameters(model)
    ids = {id(p) for p in mine}
    done = sum(p.numel() for p in model.parameters() if p.requires_grad and id(p) in ids)
    demoted = sorted({type(model.get_submodule(name)).__qualname__ for name in pre.demoted})
    row.update(
        runs=True,
        demoted_classes=demoted,
        preconditioned=done,
        preconditioned_pct=100.0 * done / total,
        layers=len(pre.layers),
        kinds=dict(sorted(Counter(s.kind for s in pre.layers.values()).items())),
        skipped=dict(pre.layers.skipped),
    )
    return row


def _full_size_models() -> dict[str, tuple[Any, Any]]:
    """``{family: (model class, config class)}``: the families' classes at their configs'
    defaults."""
    import transformers as tr

    return {
        "GPT-NeoX": (tr.GPTNeoXForCausalLM, tr.GPTNeoXConfig),
        "T5": (tr.T5ForConditionalGeneration, tr.T5Config),
        "ViT": (tr.ViTForImageClassification, tr.ViTConfig),
        "Whisper": (tr.WhisperForConditionalGeneration, tr.WhisperConfig),
        "Gemma 3": (tr.Gemma3ForCausalLM, tr.Gemma3TextConfig),
        "Qwen2-MoE": (tr.Qwen2MoeForCausalLM, tr.Qwen2MoeConfig),
        "Mixtral": (tr.MixtralForCausalLM, tr.MixtralConfig),
        "Mamba": (tr.MambaForCausalLM, tr.MambaConfig),
        "ModernBERT": (tr.ModernBertForMaskedLM, tr.ModernBertConfig),
        "Phi-3": (tr.Phi3ForCausalLM, tr.Phi3Config),
        "OPT": (tr.OPTForCausalLM, tr.OPTConfig),
    }


def full_size_row(family: str, demoted_classes: list[str]) -> dict[str, Any]:
    """A family at its config's default size (GPT-NeoX 20B's, Mixtral 8x7B's, ...), built on
    the meta device and registered (no step: nothing is computed): the parameters of the
    layers registered, less those of the modules whose classes the tiny model's step left
    to the other optimizer (``demoted_classes``: refused on their first call)."""
    cls, config = _full_size_models()[family]
    with torch.device("meta"):
        model = cls(config())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        table = kf.register(model)
    left = {
        s.name
        for s in table.values()
        if type(model.get_submodule(s.module)).__qualname__ in demoted_classes
    }
    mine, _ = table.split_parameters(model)
    theirs = {
        id(model.get_parameter(n))
        for s in table.values()
        if s.name in left
        for n in s.param_names()
    }
    total = sum(p.numel() for p in model.parameters())
    done = sum(p.numel() for p in mine if id(p) not in theirs)
    return {
        "family": family,
        "parameters": total,
        "preconditioned": done,
        "preconditioned_pct": 100.0 * done / total,
        "kinds": dict(
            sorted(Counter(s.kind for s in table.values() if s.name not in left).items())
        ),
        "skipped": dict(table.skipped),
        "left_as_in_the_tiny_run": sorted(left),
    }


def _table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| family | parameters preconditioned | layers by kind | left to the other optimizer |",
        "|---|---|---|---|",
    ]
    for r in rows:
        if not r["runs"]:
            lines.append(f"| {r['family']} | fails: {r['error'][:80]} | | |")
            continue
        kinds = ", ".join(f"{k} {n}" for k, n in r["kinds"].items())
        reasons = Counter(_short(why) for why in r["skipped"].values())
        skipped = "; ".join(f"{n}× {why}" for why, n in reasons.items()) or "none"
        pct = f"{r['preconditioned_pct']:.1f} %"
        lines.append(f"| {r['family']} | {pct} | {kinds} | {skipped} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=ROOT / "benchmarks" / "results" / "families.json",
        help="the JSON file to write",
    )
    parser.add_argument(
        "--families", nargs="*", default=list(FAMILIES), help="which families (all by default)"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    import transformers

    rows = [family_row(f) for f in args.families]
    doc = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "recipe": "kf.KFAC(model)",
        "steps": STEPS,
        "families": rows,
        "full_size": [
            full_size_row(r["family"], r.get("demoted_classes", [])) for r in rows if r["runs"]
        ],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(_table(rows))
    for r in doc["full_size"]:
        print(
            f"{r['family']} at its config's default size: {r['preconditioned_pct']:.1f} % "
            f"of {r['parameters']}"
        )


if __name__ == "__main__":
    main()
