"""The documentation does not rot: its code runs, its site builds, its commands are CI's.

- Every ```python block of ``docs/*.md`` and ``README.md`` runs, the blocks of one page in
  order in one namespace (a page may build on its earlier blocks), in a temporary
  directory, with the warnings kfac_func raises made errors (``tests/library_warnings.py``:
  the documented code shows no warning of the library's). A block preceded by
  ``<!-- skip: reason -->`` is not run (it needs a process group, DeepSpeed, or is a
  fragment); the reason is required and the skips are counted.
- ``mkdocs build --strict`` passes (skipped when MkDocs is not installed), and the API
  reference has a page entry for every name of ``kfac_func.__all__`` (``::: kfac_func.NAME``)
  and of each subpackage's ``__all__`` (``::: kfac_func.SUB.NAME``, or a path through one of
  its modules, or the top level's entry when the top level exports the same object), and
  for every name that moved from the top level to a subpackage (at its new place).
- The README's set-up and test commands are the ones ``.ci/run`` runs.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from library_warnings import library_warnings_are_errors

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = [*sorted(DOCS.rglob("*.md")), ROOT / "README.md"]
SKIP = re.compile(r"^<!--\s*skip(?::\s*(?P<reason>.*?))?\s*-->$")
#: blocks that cannot run in a test (a process group, DeepSpeed, a fragment of a loop);
#: raise it only with a reason in the Markdown
MAX_SKIPPED = 8


@dataclass
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    source: str
    skip: str | None  # the reason, when marked


def python_blocks(path: Path) -> list[Block]:
    """The ```python blocks of a Markdown file, with their skip markers."""
    lines = path.read_text(encoding="utf-8").split("\n")
    blocks, i = [], 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            start = i
            j = i + 1
            while j < len(lines) and lines[j].strip() != "```":
                j += 1
            if j == len(lines):
                raise AssertionError(f"{path}:{start + 1}: unclosed ```python block")
            above = [line.strip() for line in lines[:start] if line.strip()]
            marker = SKIP.match(above[-1]) if above else None
            skip = (marker.group("reason") or "") if marker else None
            blocks.append(Block(path, start + 1, "\n".join(lines[start + 1 : j]) + "\n", skip))
            i = j
        i += 1
    return blocks


def _page_id(path: Path) -> str:
    return str(path.relative_to(ROOT))


def test_the_block_parser_sees_code_and_markers(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "text\n\n```python\nx = 1\n```\n\n<!-- skip: needs two ranks -->\n\n"
        "```python\ny = 2\n```\n\n```bash\nls\n```\n",
        encoding="utf-8",
    )
    blocks = python_blocks(page)
    assert [(b.line, b.source, b.skip) for b in blocks] == [
        (3, "x = 1\n", None),
        (9, "y = 2\n", "needs two ranks"),
    ]


@pytest.mark.parametrize("path", [p for p in PAGES if python_blocks(p)], ids=_page_id)
def test_python_blocks_run(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # blocks that write files write them here
    namespace: dict[str, object] = {"__name__": "__docs__"}
    for block in python_blocks(path):
        if block.skip is not None:
            continue
        code = compile(block.source, f"{_page_id(path)}:{block.line}", "exec")
        try:
            with library_warnings_are_errors():
                exec(code, namespace)
        except Exception as e:
            raise AssertionError(
                f"the block at {_page_id(path)}:{block.line} failed: {type(e).__name__}: {e}"
            ) from e


def test_skipped_blocks_are_few_and_say_why() -> None:
    skipped = [b for p in PAGES for b in python_blocks(p) if b.skip is not None]
    unexplained = [f"{_page_id(b.path)}:{b.line}" for b in skipped if not b.skip]
    assert not unexplained, f"<!-- skip --> without a reason at {unexplained}"
    assert len(skipped) <= MAX_SKIPPED, [f"{_page_id(b.path)}:{b.line}" for b in skipped]
    assert sum(len(python_blocks(p)) for p in PAGES) > 3 * len(skipped)


#: the subpackages whose ``__all__`` the reference documents, beside the top level's
SUBPACKAGES = ("adapter", "blocks", "checkpoint", "core", "distributed", "parallel", "step")


def _documented(paths: set[str], module: str, name: str) -> bool:
    """Whether a ``:::`` entry documents ``module.name``: the path itself or one through a
    module below ``module`` (``kfac_func.step.decompose.decompose``)."""
    prefix = module.removeprefix("kfac_func").lstrip(".")
    pattern = re.compile(rf"{re.escape(prefix)}\.(\w+\.)*{re.escape(name)}" if prefix else name)
    return any(pattern.fullmatch(path) for path in paths)


def test_the_reference_shows_every_public_name() -> None:
    import kfac_func

    reference = "".join(p.read_text(encoding="utf-8") for p in (DOCS / "api").glob("*.md"))
    paths = set(re.findall(r"^::: kfac_func\.([\w.]+)$", reference, flags=re.MULTILINE))
    missing = [n for n in kfac_func.__all__ if n != "__version__" and n not in paths]
    for sub in SUBPACKAGES:
        module = importlib.import_module(f"kfac_func.{sub}")
        for name in module.__all__:
            at_top = name in kfac_func.__all__ and getattr(kfac_func, name) is getattr(module, name)
            if not at_top and not _documented(paths, module.__name__, name):
                missing.append(f"{sub}.{name}")
    for name, module_name in kfac_func.MOVED.items():
        if not _documented(paths, module_name, name):
            missing.append(f"{module_name.removeprefix('kfac_func.')}.{name}")
    assert not missing, f"add these to a page of docs/api/: {sorted(set(missing))}"


def _commands(text: str) -> list[str]:
    """The commands of the ```bash blocks of ``text`` (comments stripped)."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.DOTALL):
        for line in block.splitlines():
            command = line.split("#", 1)[0].strip()
            if command:
                out.append(command)
    return out


def test_readme_set_up_and_test_commands_are_what_ci_runs() -> None:
    """The README's set-up command is one script, which pins torch; CI runs it and the
    README's test commands as written."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    commands = _commands(readme)
    set_up = "bash tools/setup.sh"
    script = [line.strip() for line in (ROOT / "tools" / "setup.sh").read_text().splitlines()]
    assert any(line.startswith('pip install "torch==2.13.0" -e') for line in script), script
    tests = ['python -m pytest -q -m "not slow"', "python -m pytest -q -m slow"]
    for command in [set_up, *tests, "mkdocs build --strict"]:
        assert command in commands, f"the README does not show {command!r}"
        assert command in ci, f".ci/run does not run the README's {command!r}"


def test_docstring_rewriting_for_the_reference() -> None:
    pytest.importorskip("griffe")
    import doctest

    spec = importlib.util.spec_from_file_location("griffe_sphinx", DOCS / "griffe_sphinx.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert doctest.testmod(module).failed == 0
    text = "Args:\n    a, b: bounds.\n\nExample:\n    >>> 1\n    1\n\nSee :class:`~x.Y`."
    out = module.rewrite(text)
    assert "    a: bounds.\n    b: bounds." in out and "Examples:\n" in out
    assert '<autoref identifier="x.Y" optional><code>Y</code></autoref>' in out


@pytest.mark.slow
def test_the_site_builds_strictly(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings_handlers.python")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    log = result.stdout + result.stderr
    assert result.returncode == 0, log
    assert "WARNING" not in log, log
    reference = (tmp_path / "api" / "adapter" / "index.html").read_text(encoding="utf-8")
    for argument in ("grad_worker_fraction", "colocate_factors"):  # the adapter's own
        assert f"<code>{argument}</code>" in reference, argument
    for argument in ("loglevel", "damping", "settings"):  # those every preconditioner shares
        assert f'title="kfac_func.adapter.SharedArguments.{argument}"' in reference, argument
    for setting in ("allreduce_method", "kinds", "eigenbasis_moments"):  # the rest, one value
        assert f'title="kfac_func.Settings.{setting}"' in reference, setting
    assert (tmp_path / "assets" / "results" / "convergence.png").is_file()
