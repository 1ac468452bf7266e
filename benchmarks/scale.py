"""Optimizers at the size people train: a GPT-2-small-shaped model built from its config.

For each optimizer, in a process of its own (so that its peak memory is its own), the
Hugging Face ``GPT2LMHeadModel`` of ``GPT2Config()`` (124 M parameters, 12 layers, d 768,
MLP 3,072 wide, the 50,257-row head tied to the embedding; random initialisation, nothing
downloaded) trains ``--steps`` steps on one fixed batch of random tokens, and then its
state goes through every checkpoint path a trainer uses:

- the step, split into forward+backward (with K-FAC's hooks where it has them) and the
  optimizer's step; the first step (which builds the state) is left out, and K-FAC's
  steps are also reported apart by whether they decompose;
- the state's bytes at run time (every tensor the optimizer keeps, K-FAC's derived
  powers included) and in ``state_dict()``, by field, over the parameters' bytes;
- the peak resident memory of the process (``ru_maxrss``) after the model is built and
  after the steps;
- ``state_dict()`` and ``load_state_dict()`` (into a fresh optimizer of a fresh model);
- ``torch.distributed.checkpoint`` save and load through ``get_state_dict`` /
  ``set_state_dict`` (one process), and their seconds per GiB over AdamW's;
- the checksum digest of the K-FAC state dicts over a 256 MiB tensor, beside the
  digest it replaced (the storage read through Python one byte at a time: timed on
  16 MiB and scaled by bytes, as it is linear in them).

The optimizers: ``adamw`` (torch's), ``muon`` (``torch.optim.Muon`` on the hidden
matrices, AdamW on the rest), ``soap`` (heavyball's, eager), ``kfac`` (``kf.KFAC(model)``,
the recommended recipe) and ``kfac-pytorch`` (``kf.KFACPreconditioner(model)`` with
kfac-pytorch's defaults in front of SGD), every one untuned at its defaults (learning
rate 1e-3 where one is needed): the benchmark measures cost, not training.

    python benchmarks/scale.py                                   # benchmarks/out/scale.json
    python benchmarks/scale.py --out benchmarks/results/scale.json
    python benchmarks/scale.py --quick                           # a tiny GPT-2, seconds
    python benchmarks/scale.py --tables     # docs/performance.md from the committed results

Only numbers from one run compare: the machine, its load and the thread count move all
of them. The results file names the CPU and whether it multiplies bfloat16 natively
(every product here is float32).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import importlib.util
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import optree
import torch
from torch import nn

import kfac_func as kf

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stage_arithmetic import bf16_flags
from step_time import cpu_model, git_commit

ROOT = Path(__file__).resolve().parents[1]
OPTIMIZERS = ("adamw", "muon", "soap", "kfac", "kfac-pytorch")
MiB = 2**20


def model_config(quick: bool) -> dict[str, int]:
    """The GPT-2 configuration: ``GPT2Config()``'s (GPT-2 small), or a tiny one."""
    if quick:
        return {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 1000, "n_positions": 64}
    return {}


def build(args: argparse.Namespace, seed: int = 0) -> nn.Module:
    """The model, from its config (random weights)."""
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging

    logging.set_verbosity_error()
    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(**model_config(args.quick))).train()


def make_optimizer(name: str, model: nn.Module) -> Any:
    """``name``'s optimizer of ``model`` (a ``(preconditioner, optimizer)`` pair for
    ``kfac-pytorch``)."""
    params = list(model.parameters())
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-3)
    if name == "muon":
        hidden = [p for n, p in model.named_parameters() if p.dim() == 2 and ".h." in f".{n}"]
        ids = {id(p) for p in hidden}
        rest = [p for p in params if id(p) not in ids]
        return [
            torch.optim.Muon(hidden, lr=1e-3, adjust_lr_fn="match_rms_adamw"),
            torch.optim.AdamW(rest, lr=1e-3),
        ]
    if name == "soap":
        import heavyball

        heavyball.utils.compile_mode = None  # eager, as the race runs it
        return heavyball.SOAP(params, lr=1e-3)
    if name == "kfac":
        return kf.KFAC(model)
    if name == "kfac-pytorch":
        return [kf.KFACPreconditioner(model), torch.optim.SGD(params, lr=1e-3)]
    raise ValueError(f"unknown optimizer {name!r}")


def optimizers(opt: Any) -> list[torch.optim.Optimizer]:
    """The torch optimizers of ``opt`` (whose ``state_dict`` is checkpointed)."""
    items = opt if isinstance(opt, list) else [opt]
    return [o for o in items if isinstance(o, torch.optim.Optimizer)]


def preconditioner(opt: Any) -> kf.KFACPreconditioner | None:
    if isinstance(opt, kf.KFAC):
        return opt.preconditioner
    items = opt if isinstance(opt, list) else []
    return next((o for o in items if isinstance(o, kf.KFACPreconditioner)), None)


def checkpointed(opt: Any) -> list[Any]:
    """What a trainer checkpoints of ``opt``: its optimizers and a lone preconditioner."""
    pre = preconditioner(opt)
    lone = [pre] if pre is not None and not isinstance(opt, kf.KFAC) else []
    return [*optimizers(opt), *lone]


def peak_mib() -> float:
    """The process's peak resident memory so far, MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def field_bytes(tree: Any, seen: set[int] | None = None) -> Counter[str]:
    """Bytes of the tensors in ``tree`` (nested dicts, lists, pytrees), by the name of
    their field (the last string key on the way; a storage counted once)."""
    seen = set() if seen is None else seen
    out: Counter[str] = Counter()

    def walk(x: Any, field: str) -> None:
        if isinstance(x, torch.Tensor):
            key = x.untyped_storage().data_ptr()
            if x.numel() and key not in seen:
                seen.add(key)
                out[field] += x.untyped_storage().nbytes()
        elif isinstance(x, dict):
            for k, v in x.items():
                walk(v, k if isinstance(k, str) and not k.isdigit() else field)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v, field)

    walk(tree, "?")
    return out


def kfac_runtime_bytes(pre: kf.KFACPreconditioner, seen: set[int]) -> Counter[str]:
    """Bytes of the preconditioner's live state by field (``ortho_power.a`` and the like
    for nested ones)."""
    out: Counter[str] = Counter()
    paths, leaves, _ = optree.tree_flatten_with_path(pre.state)  # type: ignore[arg-type]
    for path, leaf in zip(paths, leaves):
        key = leaf.untyped_storage().data_ptr()
        if not leaf.numel() or key in seen:
            continue
        seen.add(key)
        names = [str(p) for p in path]
        field = names[-1] if names[-2] not in ("ortho_power",) else ".".join(names[-2:])
        out[field] += leaf.untyped_storage().nbytes()
    return out


def power_seconds(pre: kf.KFACPreconditioner) -> float:
    """Seconds to recompute the orthogonalized step's factor powers from the layers'
    decompositions: what a load leaves to the next step, where saving them would add
    their bytes to every checkpoint."""
    from kfac_func.core.orthogonal import factor_powers

    o = pre.orthogonal
    start = time.perf_counter()
    for ls in pre.state.layers.values():
        if o is None or ls.ortho_power is None or ls.decomposition is None:
            continue
        blocked = {"a_width": ls.spec.a_dim} if getattr(ls.spec, "a_blocks", 1) > 1 else {}
        factor_powers(ls.decomposition, o.powers, o.damping, **blocked)  # type: ignore[arg-type]
    return time.perf_counter() - start


def runtime_bytes(opt: Any) -> Counter[str]:
    """Bytes of every tensor the optimizer keeps at run time, by field."""
    seen: set[int] = set()
    out: Counter[str] = Counter()
    for o in optimizers(opt):
        out += field_bytes({"state": dict(enumerate(o.state.values()))}, seen)
    pre = preconditioner(opt)
    if pre is not None:
        out += kfac_runtime_bytes(pre, seen)
    return out


def state_dicts(opt: Any) -> list[dict[str, Any]]:
    return [o.state_dict() for o in checkpointed(opt)]


def old_digest(t: torch.Tensor) -> str:
    """The digest the checksums used before: the storage's bytes through Python."""
    h = hashlib.sha256(f"{t.dtype} {tuple(t.shape)}".encode())
    data = t.detach().to("cpu", copy=True).contiguous().reshape(-1)
    h.update(bytes(data.view(torch.uint8).untyped_storage()))
    return h.hexdigest()


def digest_speed(quick: bool) -> dict[str, float]:
    """GiB/s of the library's digest over a 256 MiB tensor, and of :func:`old_digest`
    (on 16 MiB: it is linear in the bytes; seconds reported for 256 MiB)."""
    from kfac_func.checkpoint.checksums import tensor_digest

    big = torch.randn((16 if quick else 256) * MiB // 4)
    small = big[: (1 if quick else 16) * MiB // 4].clone()
    start = time.perf_counter()
    tensor_digest(big)
    new = time.perf_counter() - start
    start = time.perf_counter()
    old_digest(small)
    old = (time.perf_counter() - start) * big.numel() / small.numel()
    gib = big.numel() * 4 / 2**30
    return {
        "mib": big.numel() * 4 / MiB,
        "seconds": new,
        "old_seconds": old,
        "gib_s": gib / new,
        "old_gib_s": gib / old,
    }


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def batch(args: argparse.Namespace, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, vocab, (args.batch, args.length), generator=g)


def decomposes_at(every: Any, step: int) -> bool:
    """Whether a preconditioner with ``inv_update_steps=every`` (a number or a
    ``step -> interval`` schedule) decomposes at ``step``."""
    return step % int(every(step) if callable(every) else every) == 0


def train_step(model: nn.Module, opt: Any, ids: torch.Tensor) -> tuple[float, float]:
    """One step: (forward+backward seconds, optimizer seconds)."""
    for o in optimizers(opt):
        o.zero_grad(set_to_none=True)
    start = time.perf_counter()
    loss = model(ids, labels=ids).loss
    loss.backward()
    middle = time.perf_counter()
    pre = preconditioner(opt)
    if pre is not None and not isinstance(opt, kf.KFAC):
        pre.step()
    for o in optimizers(opt):
        o.step()
    return middle - start, time.perf_counter() - middle


def dcp_round_trip(
    model: nn.Module, opt: Any, fresh: Callable[[], tuple[nn.Module, Any]], folder: Path
) -> dict[str, float]:
    """Seconds of a DCP save of the optimizers' state (``get_optimizer_state_dict``
    included; a lone preconditioner's ``state_dict()`` beside it) and of a load into a
    fresh optimizer (its template, ``dcp.load``, ``set_optimizer_state_dict``)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    options = StateDictOptions(strict=False)

    def whole(m: nn.Module, o: Any) -> dict[str, Any]:
        sd = {"optim": get_optimizer_state_dict(m, optimizers(o), options=options)}
        pre = preconditioner(o)
        if pre is not None and not isinstance(o, kf.KFAC):
            sd["kfac"] = pre.state_dict()
        return sd

    start = time.perf_counter()
    dcp.save(whole(model, opt), checkpoint_id=str(folder))
    save = time.perf_counter() - start
    gc.collect()
    model2, opt2 = fresh()
    start = time.perf_counter()
    template = whole(model2, opt2)
    dcp.load(template, checkpoint_id=str(folder))
    set_optimizer_state_dict(model2, optimizers(opt2), template["optim"], options=options)
    if "kfac" in template:
        pre2 = preconditioner(opt2)
        assert pre2 is not None
        pre2.load_state_dict(template["kfac"])
    load = time.perf_counter() - start
    disk = sum(f.stat().st_size for f in folder.iterdir())
    return {"dcp_save_s": save, "dcp_load_s": load, "dcp_bytes": disk}


def load_seconds(targets: list[Any], sds: list[dict[str, Any]]) -> float:
    """Seconds of ``load_state_dict`` of each state dict into its target."""
    start = time.perf_counter()
    for target, sd in zip(targets, sds):
        target.load_state_dict(sd)
    return time.perf_counter() - start


def measure(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Everything of one optimizer (run in a process of its own)."""
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    model = build(args)
    params_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    ids = batch(args, model.config.vocab_size)
    row: dict[str, Any] = {
        "optimizer": name,
        "parameters": sum(p.numel() for p in model.parameters()),
        "param_bytes": params_bytes,
        "peak_model_mib": peak_mib(),
    }
    opt = make_optimizer(name, model)
    pre = preconditioner(opt)
    steps: list[dict[str, Any]] = []
    for i in range(args.steps):
        decomposes = pre is not None and decomposes_at(pre.inv_update_steps, pre.steps)
        fb, step = train_step(model, opt, ids)
        steps.append(
            {"step": i, "forward_backward_s": fb, "optimizer_s": step, "decomposes": decomposes}
        )
        print(f"  {name} step {i}: forward+backward {fb:.2f} s, optimizer {step:.2f} s", flush=True)
    row["steps"] = steps
    row["peak_train_mib"] = peak_mib()
    live = runtime_bytes(opt)
    row["runtime_bytes"] = dict(live)
    if pre is not None:
        row["powers_s"] = power_seconds(pre)

    def fresh() -> tuple[nn.Module, Any]:
        m = build(args, seed=5)
        return m, make_optimizer(name, m)

    seconds, sds = timed(lambda: state_dicts(opt))
    row["state_dict_s"] = seconds
    row["state_dict_bytes"] = dict(field_bytes({"sd": sds}))
    row["load_state_dict_s"] = load_seconds(checkpointed(fresh()[1]), sds)
    del sds
    gc.collect()
    with tempfile.TemporaryDirectory() as tmp:
        row.update(dcp_round_trip(model, opt, fresh, Path(tmp) / "ckpt"))
    row["peak_mib"] = peak_mib()
    return row


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _per_gib(row: dict[str, Any], key: str) -> float:
    return float(row[key]) / max(int(row["dcp_bytes"]), 1) * 2**30


def summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The table of one run, one entry per optimizer: the step's seconds (the first step
    left out; K-FAC's also by whether it decomposes), the state's bytes over the
    parameters' (run time and ``state_dict()``), the peak resident memory, the
    checkpoint seconds, and DCP's seconds per GiB over AdamW's (save, load)."""
    params = rows[0]["param_bytes"]
    adamw = next((r for r in rows if r["optimizer"] == "adamw"), None)
    out = []
    for r in rows:
        later = r["steps"][1:] or r["steps"]
        whole = [s["optimizer_s"] + s["forward_backward_s"] for s in later]
        entry: dict[str, Any] = {
            "optimizer": r["optimizer"],
            "forward_backward_s": _mean([s["forward_backward_s"] for s in later]),
            "optimizer_s": _mean([s["optimizer_s"] for s in later]),
            "step_s": _mean(whole),
            "decomposing_step_s": _mean([w for w, s in zip(whole, later) if s["decomposes"]]),
            "other_step_s": _mean([w for w, s in zip(whole, later) if not s["decomposes"]]),
            "state_over_params": sum(r["runtime_bytes"].values()) / params,
            "state_dict_over_params": sum(r["state_dict_bytes"].values()) / params,
            "peak_train_mib": r["peak_train_mib"],
            "state_dict_s": r["state_dict_s"],
            "load_state_dict_s": r["load_state_dict_s"],
            "dcp_save_s": r["dcp_save_s"],
            "dcp_load_s": r["dcp_load_s"],
            "powers_s": r.get("powers_s"),
            "mib_by_field": {
                f: [r["runtime_bytes"].get(f, 0) / MiB, r["state_dict_bytes"].get(f, 0) / MiB]
                for f in sorted(set(r["runtime_bytes"]) | set(r["state_dict_bytes"]))
            },
        }
        if adamw is not None:
            for key in ("dcp_save_s", "dcp_load_s"):
                entry[f"{key}_per_gib_over_adamw"] = _per_gib(r, key) / _per_gib(adamw, key)
        out.append(entry)
    return out


COLUMNS = (
    ("optimizer", "optimizer", "{}"),
    ("forward_backward_s", "fwd+bwd s", "{:.2f}"),
    ("optimizer_s", "optimizer s", "{:.2f}"),
    ("step_s", "step s", "{:.2f}"),
    ("decomposing_step_s", "decomposing s", "{:.2f}"),
    ("other_step_s", "other s", "{:.2f}"),
    ("state_over_params", "state / params", "{:.2f}"),
    ("state_dict_over_params", "state_dict / params", "{:.2f}"),
    ("peak_train_mib", "peak MiB", "{:.0f}"),
    ("state_dict_s", "state_dict s", "{:.2f}"),
    ("load_state_dict_s", "load s", "{:.2f}"),
    ("dcp_save_s", "DCP save s", "{:.2f}"),
    ("dcp_load_s", "DCP load s", "{:.2f}"),
    ("dcp_save_s_per_gib_over_adamw", "DCP save s/GiB / AdamW's", "{:.2f}"),
    ("dcp_load_s_per_gib_over_adamw", "DCP load s/GiB / AdamW's", "{:.2f}"),
)
"""The summary's columns: key, heading, format."""


def print_summary(rows: list[dict[str, Any]], table: list[dict[str, Any]]) -> None:
    """The summary as a Markdown table, then each optimizer's state by field."""
    params = rows[0]["param_bytes"]
    print(f"\nparameters: {rows[0]['parameters'] / 1e6:.1f} M ({params / MiB:.0f} MiB)")
    print("| " + " | ".join(h for _, h, _ in COLUMNS) + " |")
    print("|" + "---|" * len(COLUMNS))
    for entry in table:
        cells = ["-" if entry.get(k) is None else fmt.format(entry[k]) for k, _, fmt in COLUMNS]
        print("| " + " | ".join(cells) + " |")
    print("\nstate bytes by field (MiB; run time / state_dict):")
    for r in rows:
        fields = sorted(
            set(r["runtime_bytes"]) | set(r["state_dict_bytes"]),
            key=lambda f: -r["runtime_bytes"].get(f, 0) - r["state_dict_bytes"].get(f, 0),
        )
        parts = [
            f"{f} {r['runtime_bytes'].get(f, 0) / MiB:.0f}/"
            f"{r['state_dict_bytes'].get(f, 0) / MiB:.0f}"
            for f in fields[:10]
        ]
        print(f"  {r['optimizer']}: " + ", ".join(parts))


RESULTS = ROOT / "benchmarks" / "results"
PAGE = ROOT / "docs" / "performance.md"
MARKS = ("<!-- scale:start -->", "<!-- scale:end -->")
"""The comments around the scale tables of ``docs/performance.md``."""


def _cell(value: Any, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def render(before: dict[str, Any], after: dict[str, Any]) -> str:
    """The docs block of two runs (the library before and after, the same benchmark): the
    summary of each optimizer side by side, K-FAC's state by field, and the digest."""
    import race_report as rr

    machine = after["machine"]
    lines = [
        f"Results: `benchmarks/results/scale_before.json` and `benchmarks/results/scale.json` "
        f"(`{after['command']}`; before: the same script on the library at commit "
        f"`{str(before['commit'])[:10]}`, {before['note'].split(':', 1)[-1].strip()}).",
        "<!-- settings -->",
        f"GPT-2 from `{after['settings']['config']}`: {after['rows'][0]['parameters']:,} "
        "parameters, "
        f"batch {after['settings']['batch']}×{after['settings']['length']} tokens, "
        f"{after['settings']['steps']} steps (the first not timed); CPU `{machine['cpu']}`"
        f"{rr.bf16_phrase(machine)}, {machine['threads']} thread(s), torch "
        f"`{machine['torch']}`, commit `{str(after['commit'])[:10]}`.",
        "",
        "| optimizer | run | " + " | ".join(h for k, h, _ in COLUMNS[1:]) + " |",
        "|---|---|" + "---|" * (len(COLUMNS) - 1),
    ]
    old = {r["optimizer"]: r for r in before["summary"]}
    for entry in after["summary"]:
        for label, row in (("before", old.get(entry["optimizer"])), ("after", entry)):
            if row is None:
                continue
            cells = [_cell(row.get(k), fmt) for k, _, fmt in COLUMNS[1:]]
            lines.append(f"| {entry['optimizer']} | {label} | " + " | ".join(cells) + " |")
    lines += ["", "K-FAC's state by field, MiB at run time / in `state_dict()`:", ""]
    for name in ("kfac", "kfac-pytorch"):
        for label, doc in (("before", before), ("after", after)):
            row = next((r for r in doc["summary"] if r["optimizer"] == name), None)
            if row is None:
                continue
            fields = sorted(row["mib_by_field"].items(), key=lambda kv: -sum(kv[1]))
            parts = [f"`{f}` {rt:.0f} / {sd:.0f}" for f, (rt, sd) in fields if rt + sd >= 1]
            lines.append(f"- {name}, {label}: " + ", ".join(parts))
    d = after["digest"]
    lines += [
        "",
        f"The checksum digest over {d['mib']:.0f} MiB: {d['seconds']:.3f} s "
        f"({d['gib_s']:.2f} GiB/s); the digest it replaced, the storage read one byte at a "
        f"time through Python: {d['old_seconds']:.1f} s ({d['old_gib_s']:.4f} GiB/s).",
    ]
    return "\n".join(lines)


def write_tables() -> bool:
    """Rewrite the scale block of ``docs/performance.md`` from the committed results;
    whether it changed."""
    import race_report as rr

    before = json.loads((RESULTS / "scale_before.json").read_text())
    after = json.loads((RESULTS / "scale.json").read_text())
    return rr.replace_block(PAGE, MARKS, render(before, after))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--optimizers",
        default=",".join(OPTIMIZERS),
        help=f"comma-separated, of {', '.join(OPTIMIZERS)}",
    )
    p.add_argument("--steps", type=int, default=5, help="training steps (the first not timed)")
    p.add_argument("--batch", type=int, default=1, help="sequences per batch")
    p.add_argument("--length", type=int, default=32, help="tokens per sequence")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--quick", action="store_true", help="a tiny GPT-2 (the tests' smoke run)")
    p.add_argument(
        "--out",
        default=str(ROOT / "benchmarks" / "out" / "scale.json"),
        help="the results JSON (default benchmarks/out/, which git ignores)",
    )
    p.add_argument("--note", default="", help="a line the results file keeps with the run")
    p.add_argument(
        "--tables",
        action="store_true",
        help="rewrite the tables of docs/performance.md from benchmarks/results/scale*.json",
    )
    p.add_argument("--one", help=argparse.SUPPRESS)  # run one optimizer, print its row
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.tables:
        print(f"{PAGE}: scale tables {'rewritten' if write_tables() else 'unchanged'}")
        return 0
    if args.one:
        print("ROW " + json.dumps(measure(args.one, args)), flush=True)
        return 0
    names = [n for n in args.optimizers.split(",") if n]
    unknown = sorted(set(names) - set(OPTIMIZERS))
    if unknown:
        raise SystemExit(f"unknown optimizers {unknown}; choose from {OPTIMIZERS}")
    if "soap" in names and importlib.util.find_spec("heavyball") is None:
        print("heavyball is not installed (the bench extra): SOAP is left out")
        names.remove("soap")
    torch.set_num_threads(args.threads)
    digest = digest_speed(args.quick)
    print(
        f"digest over {digest['mib']:.0f} MiB: {digest['seconds']:.3f} s "
        f"({digest['gib_s']:.2f} GiB/s); the old one: {digest['old_seconds']:.1f} s "
        f"({digest['old_gib_s']:.4f} GiB/s)",
        flush=True,
    )
    rows = []
    forwarded = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--quick"]
    for name in names:
        cmd = [sys.executable, __file__, *forwarded, "--one", name]
        if args.quick:
            cmd.append("--quick")
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        lines = proc.stdout.splitlines()
        sys.stdout.write("".join(f"{text}\n" for text in lines if not text.startswith("ROW ")))
        if proc.returncode != 0:
            raise SystemExit(f"{name} failed:\n{proc.stderr}")
        [line] = [text for text in lines if text.startswith("ROW ")]
        rows.append(json.loads(line[4:]))
    table = summary(rows)
    print_summary(rows, table)
    doc = {
        "command": "python benchmarks/scale.py " + " ".join(sys.argv[1:] if argv is None else argv),
        **git_commit(("benchmarks/results",)),
        "machine": {
            "cpu": cpu_model(),
            "cores": os.cpu_count(),
            "threads": args.threads,
            "bf16_flags": bf16_flags(),
            "platform": platform.platform(),
            "torch": torch.__version__,
            "kfac_func": kf.__version__,
        },
        "note": args.note,
        "settings": {
            "config": model_config(args.quick) or "GPT2Config()",
            "batch": args.batch,
            "length": args.length,
            "steps": args.steps,
        },
        "digest": digest,
        "summary": table,
        "rows": rows,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
