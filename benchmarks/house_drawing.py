"""The structure of ``kfac_func`` drawn from its imports, for the architecture page.

``python benchmarks/house_drawing.py`` reads every ``kfac_func/**/*.py`` of a checkout
(``--root``; default this one) as text, finds the modules each imports from ``kfac_func``
(``import``/``from ... import`` statements anywhere in the file, those under
``TYPE_CHECKING`` and inside functions too) and draws two pictures into ``--out-dir``
(default ``benchmarks/results``), named ``house{suffix}.png`` and
``house_step{suffix}.png``:

- the package: one box per subpackage or top-level module, its area proportional to its
  lines, and one arrow per pair of them that import each other, labelled with the number
  of importing files (when more than one);
- ``kfac_func/step``: one box per module, arrows between modules.

Boxes are placed in rows by depth: a box that imports nothing drawn here is in the lowest
row, and every other box one row above the highest box it imports (imports that close a
cycle are drawn, dashed, but do not raise a box). Nothing of the checkout is run.

    python benchmarks/house_drawing.py                      # this checkout
    python benchmarks/house_drawing.py --root OLD --suffix _before
"""

from __future__ import annotations

import argparse
import ast
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

Graph = dict[str, Counter[str]]
"""``{node: {imported node: files importing it}}``."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--root", type=Path, default=ROOT, help="the checkout drawn (default: this one)")
    p.add_argument(
        "--out-dir",
        type=Path,
        default=ROOT / "benchmarks" / "results",
        help="where the pictures go (default: benchmarks/results)",
    )
    p.add_argument("--suffix", default="", help="appended to the pictures' names (e.g. _before)")
    return p.parse_args(argv)


def modules(root: Path) -> dict[str, Path]:
    """``{dotted module name under kfac_func: file}`` (a package is its ``__init__``)."""
    package = root / "kfac_func"
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imports(root: Path) -> dict[str, set[str]]:
    """``{module: the kfac_func modules it imports}`` (names under ``kfac_func``, ``""``
    for the package itself; in ``from kfac_func.a import b``, ``b`` is module ``a.b`` when
    there is one, else a name of ``a``).

    Example:
        >>> deps = imports(ROOT)
        >>> "state" in deps["step.update"]
        True
    """
    known = modules(root)
    out: dict[str, set[str]] = {}
    for name, path in known.items():
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                # a name that is a module of its own is that module, else the one named
                targets = [
                    f"{node.module}.{alias.name}"
                    if _inner(f"{node.module}.{alias.name}") in known
                    else node.module
                    for alias in node.names
                ]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                continue
            mine = {_inner(t) for t in targets if t == "kfac_func" or t.startswith("kfac_func.")}
            found |= mine & known.keys()
        out[name] = found - {name}
    return out


def _inner(dotted: str) -> str:
    """A module's name under ``kfac_func`` (``""``: the package)."""
    return dotted.removeprefix("kfac_func").removeprefix(".")


def lines(root: Path) -> dict[str, int]:
    """Lines of each module."""
    return {name: len(path.read_text().splitlines()) for name, path in modules(root).items()}


def grouped(
    deps: dict[str, set[str]], size: dict[str, int], unit_of: dict[str, str]
) -> tuple[Graph, Counter[str]]:
    """The graph of ``unit_of``'s units (modules left out map to no unit) and their lines."""
    graph: Graph = {u: Counter() for u in set(unit_of.values())}
    total: Counter[str] = Counter()
    for module, targets in deps.items():
        unit = unit_of.get(module)
        if unit is None:
            continue
        total[unit] += size[module]
        for t in targets:
            other = unit_of.get(t)
            if other is not None and other != unit:
                graph[unit][other] += 1
    return graph, total


def rows_by_depth(graph: Graph) -> dict[str, int]:
    """Each node's row: 0 for nodes importing nothing in ``graph``, else one above the
    highest node it imports; edges that close a cycle (found depth-first, in name order)
    do not count."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    depth: dict[str, int] = {}

    def visit(n: str) -> int:
        if state.get(n) == 2:
            return depth[n]
        state[n] = 1
        d = 0
        for t in sorted(graph[n]):
            if state.get(t) == 1:
                continue  # closes a cycle
            d = max(d, visit(t) + 1)
        state[n], depth[n] = 2, d
        return d

    for n in sorted(graph):
        visit(n)
    return depth


def draw(graph: Graph, size: Counter[str], title: str, out: Path) -> None:
    """Boxes (area ∝ lines) in rows by depth, arrows labelled with their counts."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, Rectangle

    depth = rows_by_depth(graph)
    rows: dict[int, list[str]] = {}
    for n in sorted(graph, key=lambda n: (-size[n], n)):
        rows.setdefault(depth[n], []).append(n)
    biggest = max(size.values())
    width = max(len(r) for r in rows.values())
    width = max(width, 2)
    fig, ax = plt.subplots(figsize=(2.2 * width + 2, 1.4 * len(rows) + 1.5))
    place: dict[str, tuple[float, float, float]] = {}
    for d, names in rows.items():
        for i, n in enumerate(names):
            side = 0.35 + 1.05 * (size[n] / biggest) ** 0.5
            # rows of one box alternate sides, so that arrows past a row miss its box
            shift = 0.9 * (-1) ** d if len(names) == 1 and width > 1 else 0.0
            x = (i + 0.5) * (2.2 * width / len(names)) + shift
            y = 1.9 * d
            place[n] = (x, y, side)
            ax.add_patch(
                Rectangle((x - side / 2, y - side / 4), side, side / 2, fc="#dde8f3", ec="#345")
            )
            ax.text(x, y, f"{n}\n{size[n]:,} lines", ha="center", va="center", fontsize=8)
    for n, targets in graph.items():
        for t, count in targets.items():
            (x0, y0, s0), (x1, y1, s1) = place[n], place[t]
            back = depth[t] >= depth[n]
            arrow = FancyArrowPatch(
                (x0, y0 - s0 / 4 if not back else y0 + s0 / 4),
                (x1, y1 + s1 / 4 if not back else y1 - s1 / 4),
                arrowstyle="-|>",
                mutation_scale=9,
                lw=0.6 + 0.5 * min(count, 6),
                color="#a33" if back else "#567",
                linestyle="--" if back else "-",
                connectionstyle=f"arc3,rad={0.12 * (1 + abs(depth[n] - depth[t]) // 2)}",
                alpha=0.7,
            )
            ax.add_patch(arrow)
            if count > 1:
                ax.text((x0 + x1) / 2, (y0 + y1) / 2, str(count), fontsize=6, color="#333")
    ax.set_xlim(-0.5, 2.2 * width + 0.5)
    ax.set_ylim(-1.2, 1.9 * max(rows) + 1.2)
    ax.set_axis_off()
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    deps, size = imports(args.root), lines(args.root)
    units = {m: (m.split(".")[0] or "__init__") for m in deps}
    graph, total = grouped(deps, size, units)
    name = f"house{args.suffix}.png"
    draw(
        graph, total, "kfac_func: packages by lines, arrows = importing files", args.out_dir / name
    )
    step = {
        m: "__init__" if m == "step" else m.removeprefix("step.")
        for m in deps
        if m == "step" or m.startswith("step.")
    }
    graph, total = grouped(deps, size, step)
    name = f"house_step{args.suffix}.png"
    draw(graph, total, "kfac_func/step: modules by lines, arrows = imports", args.out_dir / name)
    print(f"wrote {args.out_dir / f'house{args.suffix}.png'} and house_step{args.suffix}.png")


if __name__ == "__main__":
    main()
