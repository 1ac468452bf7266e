"""MkDocs hooks: the benchmark plots of ``benchmarks/results`` in the site.

The pages link the plots where they live in the repository
(``../benchmarks/results/x.png``, which renders when the Markdown is read in place);
MkDocs publishes only what is inside ``docs/``, so the hooks add each plot to the site as
``assets/results/x.png`` and point the links there.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"
_LINK = re.compile(r"\]\((?:\.\./)+benchmarks/results/([\w.-]+\.png)\)")


def on_files(files: Files, config: Any) -> Files:
    for plot in sorted(RESULTS.glob("*.png")):
        files.append(File.generated(config, f"assets/results/{plot.name}", abs_src_path=str(plot)))
    return files


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    depth = page.file.src_uri.count("/")
    return _LINK.sub(lambda m: f"]({'../' * depth}assets/results/{m.group(1)})", markdown)
