"""Every result the README and the guides quote comes from a committed results file.

The rule, for the pages in ``PAGES`` (the README and every page of ``docs/``):

- A *quoted number* is a decimal number (``1.8514``, ``0.0624``, ``124439808``, ``1,438``)
  with at least 3 significant digits (leading zeros never count; trailing zeros of an
  integer do not count either: ``300`` has one), in a table row or in prose.
- Not quoted: anything in fenced code blocks, in inline code spans, in link targets and
  in HTML comments; version strings (``2.13.0``); numbers in scientific notation
  (``1e-3``); and every number on the line that follows a ``<!-- settings -->`` comment
  (mark a line of settings, sizes of a data set or a model, dates, with it; the comment
  can end the line before, whose own numbers are still checked, or a line of settings).
- Each quoted number must equal a value of a committed results file that the page names
  (``examples/results/NAME`` or ``benchmarks/results/NAME``, ``.csv`` or ``.json``: every
  numeric CSV cell and every number in a JSON document; naming ``examples/results/NAME``
  or ``NAME.csv`` with its folder counts for both files) rounded to the quoted number's
  decimal places.

So a number that no committed run produced cannot appear in the docs, and a results file
rewritten by a new run makes the pages that quote the old run fail until they are updated.
"""

from __future__ import annotations

import csv
import json
import re
from collections.abc import Iterator
from decimal import ROUND_HALF_EVEN, Decimal, InvalidOperation
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = ("README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")))
RESULTS = ("examples/results", "benchmarks/results")
SETTINGS = "<!-- settings -->"
MIN_DIGITS = 3

_NUMBER = re.compile(
    r"(?<![\w.,])(?<![eE]-)"  # not inside a word or a version, not the exponent of 1e-12
    r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"  # 1,438 / 1.8514 / 124439808
    r"(?!\w|[.,]\d)"
)


def significant_digits(text: str) -> int:
    """Significant digits of a number as written: ``"0.0624"`` 3, ``"300"`` 1, ``"2.10"`` 3.

    Example:
        >>> [significant_digits(t) for t in ("1.8514", "0.0624", "300", "1,438", "2.10")]
        [5, 3, 1, 4, 3]
    """
    digits = text.replace(",", "")
    if "." in digits:
        return len(digits.replace(".", "").lstrip("0"))
    return len(digits.strip("0"))


def _strip_markup(line: str) -> str:
    """The line without inline code, link targets, URLs and HTML comments."""
    line = re.sub(r"<!--.*?-->", " ", line)
    line = re.sub(r"`[^`]*`", " ", line)
    line = re.sub(r"\]\([^)]*\)", "] ", line)
    return re.sub(r"https?://\S+", " ", line)


def quoted_numbers(markdown: str) -> Iterator[tuple[int, str]]:
    """``(line number, number as written)`` of every quoted number of a page.

    Example:
        >>> page = "1.845 bits/char, `1.872`, 2.13.0, 1e-3, 0.014, 300 steps\\n"
        >>> page += "<!-- settings -->\\nlr 0.0125\\n```\\n3.024\\n```\\n| 2.4620 |\\n"
        >>> list(quoted_numbers(page))
        [(1, '1.845'), (7, '2.4620')]
    """
    fenced = exempt = False
    for number, line in enumerate(markdown.splitlines(), start=1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            continue
        if exempt and line.strip():
            exempt = SETTINGS in line  # a line of settings that marks the next one too
            continue
        if SETTINGS in line:  # the comment's own line is checked: it marks the next line
            exempt = True
        for match in _NUMBER.finditer(_strip_markup(line)):
            if significant_digits(match.group()) >= MIN_DIGITS:
                yield number, match.group()


def _values(obj: Any) -> Iterator[Decimal]:
    """Every number in a parsed JSON document or CSV cell (strings that parse as numbers)."""
    if isinstance(obj, dict):
        for v in obj.values():
            yield from _values(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _values(v)
    elif isinstance(obj, bool):
        return
    elif isinstance(obj, (int, float, str)):
        try:
            value = Decimal(str(obj).strip())
        except InvalidOperation:
            return
        if value.is_finite():
            yield value


def results_files() -> list[Path]:
    """The committed results files (CSV and JSON)."""
    return sorted(
        path
        for folder in RESULTS
        for path in (ROOT / folder).glob("*")
        if path.suffix in (".csv", ".json")
    )


def cited(markdown: str, files: list[Path]) -> list[Path]:
    """The files of ``files`` that a page names (``folder/stem``, with or without suffix).

    Example:
        >>> files = [ROOT / "examples/results/a.csv", ROOT / "examples/results/a_b.csv"]
        >>> [p.name for p in cited("see `examples/results/a.csv`", files)]
        ['a.csv']
    """
    names = []
    for path in files:
        stem = path.relative_to(ROOT).with_suffix("").as_posix()
        if re.search(re.escape(stem) + r"(?![\w-])", markdown):
            names.append(path)
    return names


def result_values(files: list[Path]) -> list[Decimal]:
    """Every number in ``files``."""
    values: list[Decimal] = []
    for path in files:
        if path.suffix == ".csv":
            with open(path, newline="") as f:
                values += [v for row in csv.reader(f) for cell in row for v in _values(cell)]
        else:
            values += list(_values(json.loads(path.read_text())))
    return values


def appears(quoted: str, values: list[Decimal]) -> bool:
    """Whether ``quoted`` equals one of ``values`` rounded to its decimal places.

    Example:
        >>> appears("1.851", [Decimal("1.85137")]), appears("1.85", [Decimal("1.8449")])
        (True, False)
    """
    text = quoted.replace(",", "")
    target = Decimal(text)
    places = Decimal(1).scaleb(-len(text.split(".")[1])) if "." in text else Decimal(1)
    for v in values:
        try:
            if v.quantize(places, rounding=ROUND_HALF_EVEN) == target:
                return True
        except InvalidOperation:  # too many digits for the context's precision
            continue
    return False


@pytest.mark.parametrize("page", PAGES)
def test_every_quoted_number_is_in_a_results_file(page: str) -> None:
    text = (ROOT / page).read_text()
    files = cited(text, results_files())
    values = result_values(files)
    missing = [
        f"{page}:{line}: {number}"
        for line, number in quoted_numbers(text)
        if not appears(number, values)
    ]
    assert not missing, (
        "numbers quoted that no committed results file the page names holds "
        f"({', '.join(p.name for p in files) or 'none named'}); mark lines of settings with "
        f"{SETTINGS!r}:\n" + "\n".join(missing)
    )


def test_a_settings_comment_exempts_the_next_line_only() -> None:
    page = "ends at 1.845 <!-- settings -->\n1,438 images, batch 256\n1.872\n"
    assert list(quoted_numbers(page)) == [(1, "1.845"), (3, "1.872")]
    page = "<!-- settings -->\nwidth 1024 <!-- settings -->\nbatch 256\n\n1.872\n"
    assert list(quoted_numbers(page)) == [(5, "1.872")]


def test_the_rule_catches_a_number_no_run_produced() -> None:
    page = "| kfac-moments | 1.845 |\n"
    assert list(quoted_numbers(page)) == [(1, "1.845")]
    assert not appears("1.845", [Decimal("1.8514"), Decimal("1.8721")])
    assert appears("1.851", [Decimal("1.8514")])
