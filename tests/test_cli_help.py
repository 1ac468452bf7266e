"""Every command-line option of the examples and benchmarks explains itself in ``--help``.

An ``ast`` scan finds the argparse options of every ``examples/*.py`` and
``benchmarks/*.py`` (calls of ``.add_argument`` or of a local alias of it, such as
``add = parser.add_argument``, whose first argument is a string starting with ``-``) and
requires a ``help=`` on each. Each example that builds a parser is then run with
``--help`` in a fresh interpreter (a few per interpreter, so that torch is imported a few
times, not once per example); its usage text must list the options the scan found.
The benchmarks are only scanned: some import optional packages.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted([*(ROOT / "examples").glob("*.py"), *(ROOT / "benchmarks").glob("*.py")])
EXAMPLES = [p for p in SCRIPTS if p.parent.name == "examples"]


class Option(NamedTuple):
    """One ``--flag`` definition found in a source file."""

    name: str  # the flag; an f-string flag as its source text, e.g. f'--lr-{name}'
    line: int
    literal: bool  # the name is a plain string (not an f-string)
    has_help: bool
    hidden: bool  # help=argparse.SUPPRESS: deliberately left out of --help


def _flag(node: ast.expr) -> tuple[str, bool] | None:
    """The option string of a first argument starting with ``-``: (text, is a literal)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return (node.value, True) if node.value.startswith("-") else None
    if isinstance(node, ast.JoinedStr) and node.values:
        head = node.values[0]
        if isinstance(head, ast.Constant) and str(head.value).startswith("-"):
            return ast.unparse(node), False
    return None


def scan_options(source: str) -> list[Option]:
    """The argparse options defined in ``source``, in order of appearance."""
    tree = ast.parse(source)
    aliases: set[str] = set()  # local names bound to some parser's add_argument
    for node in ast.walk(tree):
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        if isinstance(value, ast.Attribute) and value.attr == "add_argument":
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            aliases.update(t.id for t in targets if isinstance(t, ast.Name))
    options = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        func = node.func
        if not (
            (isinstance(func, ast.Attribute) and func.attr == "add_argument")
            or (isinstance(func, ast.Name) and func.id in aliases)
        ):
            continue
        flag = _flag(node.args[0])
        if flag is not None:
            helps = [k.value for k in node.keywords if k.arg == "help"]
            hidden = any(ast.unparse(h).endswith("SUPPRESS") for h in helps)
            options.append(Option(flag[0], node.lineno, flag[1], bool(helps), hidden))
    return sorted(options, key=lambda o: o.line)


def test_scan_finds_direct_calls_aliases_and_fstrings() -> None:
    source = """
import argparse
p = argparse.ArgumentParser()
add = p.add_argument
group = p.add_argument_group("g")
p.add_argument("--a", type=int)
p.add_argument("--b", help="documented")
add("--c", default=1)
add("-d", "--dee", help="documented")
group.add_argument("--e")
p.add_argument("--hidden", help=argparse.SUPPRESS)
for name in ("x", "y"):
    p.add_argument(f"--lr-{name}", type=float)
p.add_argument("positional")
other(p, "--not-an-option")
"""
    found = {o.name: o.has_help for o in scan_options(source)}
    assert found == {
        "--a": False,
        "--b": True,
        "--c": False,
        "-d": True,
        "--e": False,
        "--hidden": True,
        "f'--lr-{name}'": False,
    }


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_option_has_help(path: Path) -> None:
    source = path.read_text()
    options = scan_options(source)
    if "ArgumentParser(" in source:
        # the scan must see the options of a script that has a parser, or it checks nothing
        assert options, f"{path.relative_to(ROOT)} builds a parser but no option was found"
    missing = [f"{path.relative_to(ROOT)}:{o.line} {o.name}" for o in options if not o.has_help]
    assert not missing, "options without help=: " + ", ".join(missing)


class HelpRun(NamedTuple):
    returncode: int
    output: str


# Runs each script given on its command line as ``python <script> --help`` would (as
# ``__main__``, with that argv and its folder first on sys.path), in turn in one
# interpreter so that torch is imported once; sys.path and the modules the script
# imported from its own folder are restored in between. Prints a JSON object
# {script: [exit code, output]}.
DRIVER = """
import contextlib, io, json, os, runpy, sys, traceback
from pathlib import Path
results = {}
for script in sys.argv[1:]:
    folder = str(Path(script).parent)
    saved_path, saved_modules = list(sys.path), set(sys.modules)
    sys.argv, sys.path[0] = [script, "--help"], folder
    out = io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            traceback.print_exc()
            code = 1
    sys.path[:] = saved_path
    for name in set(sys.modules) - saved_modules:
        if str(getattr(sys.modules[name], "__file__", None) or "").startswith(folder + os.sep):
            del sys.modules[name]
    results[script] = [code, out.getvalue()]
print(json.dumps(results))
"""


def run_driver(scripts: list[Path]) -> dict[Path, HelpRun]:
    """Each script's exit code and output of ``--help``, from one :data:`DRIVER` run."""
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER, *map(str, scripts)],
        cwd=ROOT,
        env={**os.environ, "COLUMNS": "200"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads(proc.stdout.splitlines()[-1])
    return {p: HelpRun(int(results[str(p)][0]), str(results[str(p)][1])) for p in scripts}


def test_driver_reports_exit_codes_and_output(tmp_path: Path) -> None:
    (tmp_path / "helper.py").write_text("FLAG = '--size'\n")
    good = tmp_path / "good.py"
    good.write_text(
        "import argparse\nfrom helper import FLAG\n"
        "if __name__ == '__main__':\n"
        "    p = argparse.ArgumentParser()\n"
        "    p.add_argument(FLAG, help='how big')\n"
        "    p.parse_args()\n"
    )
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('broken on import')\n")
    runs = run_driver([good, broken])
    assert runs[good].returncode == 0 and "--size" in runs[good].output
    assert runs[broken].returncode == 1
    assert "RuntimeError: broken on import" in runs[broken].output


@pytest.fixture(scope="module")
def help_runs() -> dict[Path, HelpRun]:
    """``python <example> --help`` for every example with a parser: the examples split
    over one interpreter per CPU (at most), run in parallel."""
    scripts = [p for p in EXAMPLES if "ArgumentParser(" in p.read_text()]
    workers = max(1, min(len(scripts), os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        parts = pool.map(run_driver, [scripts[i::workers] for i in range(workers)])
    return {p: run for part in parts for p, run in part.items()}


@pytest.mark.parametrize(
    "path",
    [p for p in EXAMPLES if "ArgumentParser(" in p.read_text()],
    ids=lambda p: p.name,
)
def test_example_help_lists_its_options(path: Path, help_runs: dict[Path, HelpRun]) -> None:
    result = help_runs[path]
    assert result.returncode == 0, result.output
    assert result.output.startswith("usage:"), result.output
    literal = [o.name for o in scan_options(path.read_text()) if o.literal and not o.hidden]
    assert literal, f"no option found in {path.name}"
    absent = [name for name in literal if name not in result.output]
    assert not absent, f"{path.name} --help does not list {absent}:\n{result.output}"


@pytest.mark.parametrize(
    "path",
    [p for p in EXAMPLES if "ArgumentParser(" in p.read_text()],
    ids=lambda p: p.name,
)
def test_example_help_states_each_default_once(path: Path, help_runs: dict[Path, HelpRun]) -> None:
    """An option whose help states its default gets no second one appended by the
    formatter (``(default: 5) (default: None)``)."""
    text = help_runs[path].output
    options = re.split(r"\n  (?=-)", text.split("options:", 1)[-1])
    twice = [o.split()[0] for o in options if len(re.findall(r"\(default:", o)) > 1]
    assert not twice, f"{path.name} --help states a default twice for {twice}"
