"""A Griffe extension for the API reference: the package's docstrings as Google style.

The docstrings title their doctests ``Example:`` (which Griffe's Google parser reads as
an admonition, whose ``>>>`` lines Markdown would turn into nested quotes) and refer to
other objects with reStructuredText roles (``:func:`kfac_func.update```). Before a
docstring is parsed, this extension renames the section to ``Examples:`` (rendered as
code) and turns each role into inline code that links to its target when the reference
renders that object (an optional cross-reference: no link, and no warning, otherwise).
An ``Args:`` entry that documents several parameters at once (``min_damping,
max_damping: the bounds``) becomes one entry per parameter with the same description, so
that every name is checked against the signature.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_EXAMPLE = re.compile(r"^(\s*)Example:\s*$", flags=re.MULTILINE)
_SECTION = re.compile(r"^(\s*)(?:Args|Arguments|Parameters):\s*$")
_SHARED = re.compile(r"^(\s+)([A-Za-z_]\w*(?:,\s*[A-Za-z_]\w*)+):(.*)$")
_ROLE = re.compile(r":(?:func|class|meth|attr|mod|data|exc|obj):`(~?)([\w.]+)`")


def _role(match: re.Match[str]) -> str:
    short, target = match.group(1), match.group(2)
    title = target.rsplit(".", 1)[-1] if short else target
    return f'<autoref identifier="{target}" optional><code>{title}</code></autoref>'


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def split_shared(text: str) -> str:
    r"""Each ``a, b: description`` entry of an ``Args:`` section as two entries.

    Example:
        >>> print(split_shared("Args:\n    a, b: the bounds\n        (inclusive).\n    c: x"))
        Args:
            a: the bounds
                (inclusive).
            b: the bounds
                (inclusive).
            c: x
    """
    lines = text.split("\n")
    out: list[str] = []
    section: int | None = None  # the indentation of the Args: title we are in
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.strip() and section is not None and _indent(line) <= section:
            section = None
        title = _SECTION.match(line)
        shared = _SHARED.match(line) if section is not None else None
        if title:
            section = len(title.group(1))
        if shared is None:
            out.append(line)
            i += 1
            continue
        indent, names, rest = shared.groups()
        block = [rest]
        i += 1
        while i < len(lines) and (not lines[i].strip() or _indent(lines[i]) > len(indent)):
            block.append(lines[i])
            i += 1
        blank = 0  # blank lines after the entry stay after the last copy
        while len(block) > 1 and not block[-1 - blank].strip() and blank < len(block) - 1:
            blank += 1
        body = block[: len(block) - blank]
        for name in (n.strip() for n in names.split(",")):
            out.append(f"{indent}{name}:{body[0]}")
            out.extend(body[1:])
        out.extend([""] * blank)
    return "\n".join(out)


def rewrite(text: str) -> str:
    """The docstring ``text`` with ``Example:`` sections and roles rewritten.

    Example:
        >>> rewrite("Text.\\n\\nExample:\\n    >>> 1\\n    1")
        'Text.\\n\\nExamples:\\n    >>> 1\\n    1'
        >>> print(rewrite("See :func:`~kfac_func.update`."))
        See <autoref identifier="kfac_func.update" optional><code>update</code></autoref>.
    """
    return _ROLE.sub(_role, _EXAMPLE.sub(r"\1Examples:", split_shared(text)))


class SphinxToGoogle(griffe.Extension):
    """Rewrites every docstring of the loaded package before it is parsed."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = rewrite(obj.docstring.value)
