"""The size of the library and the path of one step on one process, for the architecture page.

Run ``python benchmarks/house.py`` in a checkout (``--out``: the JSON written, default
``benchmarks/results/house.json``); run it with ``PYTHONPATH`` set to another checkout's
root and ``--root`` to that checkout to measure an older commit the same way. Seconds.

What is measured
----------------
- **Lines**: the lines of every ``kfac_func/**/*.py`` file, by package (the top-level
  modules under ``kfac_func``), and the modules of ``kfac_func/step``.
- **Names**: the entries of ``kfac_func.__all__`` (the top-level namespace).
- **The step's path on one process**: the modules of ``kfac_func`` whose functions a
  ``KFACPreconditioner.step()`` calls on one process (a profiler hook records every call
  during the second of two steps of a small MLP, factors and decompositions updated every
  step), with the number of calls in each; and those of them under ``distributed/``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--root", type=Path, default=ROOT, help="the checkout measured (default: this one)"
    )
    p.add_argument(
        "--out",
        type=Path,
        default=ROOT / "benchmarks" / "results" / "house.json",
        help="the JSON written (default: benchmarks/results/house.json)",
    )
    return p.parse_args(argv)


def line_counts(root: Path) -> dict[str, Any]:
    """Lines of ``kfac_func`` in all, by package, and by module of ``kfac_func/step``."""
    package = root / "kfac_func"
    by_unit: Counter[str] = Counter()
    step: dict[str, int] = {}
    for path in sorted(package.rglob("*.py")):
        n = len(path.read_text().splitlines())
        rel = path.relative_to(package)
        unit = rel.parts[0] if len(rel.parts) > 1 else rel.name
        by_unit[unit] += n
        if rel.parts[0] == "step":
            step[rel.name] = n
    return {"total": sum(by_unit.values()), "by_unit": dict(by_unit), "step": step}


def one_process_path() -> dict[str, Any]:
    """The modules a one-process ``KFACPreconditioner.step()`` enters, with their calls."""
    import torch
    from torch import nn

    import kfac_func as kf

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 4))
    pre = kf.KFACPreconditioner(model, factor_update_steps=1, inv_update_steps=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)

    def step() -> None:
        x, y = torch.randn(32, 8, generator=gen), torch.randint(0, 4, (32,), generator=gen)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        pre.step()
        opt.step()

    calls: Counter[str] = Counter()

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        path = frame.f_code.co_filename.replace("\\", "/")
        if event == "call" and "kfac_func/" in path:
            calls[path.rsplit("kfac_func/", 1)[1]] += 1

    step()
    sys.setprofile(profile)
    try:
        step()
    finally:
        sys.setprofile(None)
    modules = dict(sorted(calls.items()))
    return {
        "modules": modules,
        "distributed": {m: n for m, n in modules.items() if m.startswith("distributed/")},
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import kfac_func

    here = Path(kfac_func.__file__).resolve().parents[1]
    if here != args.root.resolve():
        raise SystemExit(f"kfac_func is imported from {here}, not --root {args.root}")
    commit = subprocess.run(
        ["git", "-C", str(args.root), "rev-parse", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    out = {
        # the checkout measured is named by its commit, not by where it lay
        "command": "python benchmarks/house.py"
        + ("" if args.root.resolve() == ROOT else " --root <a checkout of the commit>"),
        "commit": commit,
        "lines": line_counts(args.root),
        "top_level_names": len(kfac_func.__all__),
        "one_process_step": one_process_path(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    lines, path = out["lines"], out["one_process_step"]
    print(f"kfac_func: {lines['total']} lines, {out['top_level_names']} top-level names")
    print(f"one-process step: {len(path['modules'])} modules, distributed/: {path['distributed']}")


if __name__ == "__main__":
    main()
