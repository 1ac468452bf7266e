"""Text for a long run: the Python sources of the installed torch, read once.

The race's language models sample windows of the standard library's help text (about
0.6 M characters) with replacement, so a run of thousands of steps sees each window many
times and its test loss measures memorization as much as optimization. Here the text is
the ``.py`` files of torch's ``nn``, ``optim``, ``fx`` and ``utils`` packages (torch is
pinned, so every machine reads the same characters): files are taken in sorted order, the
training text is their concatenation but for every tenth file, which makes the test text
(files never trained on). A run draws its windows from a random permutation of the
training text's disjoint windows, one after the other: no window repeats within a run of
up to :attr:`SourceText.windows` windows, and the seed changes their order.

    data = SourceText(context=48)
    sample = data.sampler(batch_size=32)
    x, y = sample(torch.Generator().manual_seed(1))   # the next 32 windows of that run
"""

from __future__ import annotations

from pathlib import Path

import torch

PACKAGES = ("nn", "optim", "fx", "utils")
"""The packages of torch whose sources make the text."""

TEST_EVERY = 10
"""Every tenth file (in sorted order) is test text."""


def source_files() -> list[Path]:
    """The ``.py`` files of :data:`PACKAGES`, sorted by their path within torch."""
    root = Path(torch.__file__).resolve().parent
    files = [p for pkg in PACKAGES for p in (root / pkg).rglob("*.py")]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


class SourceText:
    """The training and test text as character ids, cut into windows of ``context + 1``.

    Attributes:
        chars: the characters, in id order (every character of the text).
        train, test: the two texts as int64 ids.
        windows: how many disjoint training windows there are.
    """

    def __init__(self, context: int) -> None:
        files = source_files()
        parts = [f.read_text(encoding="utf-8", errors="replace") for f in files]
        train = "\n".join(t for i, t in enumerate(parts) if i % TEST_EVERY)
        test = "\n".join(t for i, t in enumerate(parts) if not i % TEST_EVERY)
        self.chars = sorted(set(train) | set(test))
        index = {c: i for i, c in enumerate(self.chars)}
        self.train = torch.tensor([index[c] for c in train], dtype=torch.int64)
        self.test = torch.tensor([index[c] for c in test], dtype=torch.int64)
        self.context = context
        self.windows = (len(self.train) - 1) // context

    @property
    def vocab(self) -> int:
        return len(self.chars)

    def sampler(self, batch_size: int) -> SourceSampler:
        """The batches of one run after another: see :class:`SourceSampler`."""
        return SourceSampler(self, batch_size)

    def test_windows(self, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``count`` windows spread evenly over the test text (the same every time)."""
        starts = torch.linspace(0, len(self.test) - self.context - 1, count).long()
        rows = starts[:, None] + torch.arange(self.context + 1)
        window = self.test[rows]
        return window[:, :-1], window[:, 1:]


class SourceSampler:
    """``sampler(g)``: the next ``batch_size`` training windows (inputs, next characters)
    of the run whose batches ``g`` draws: a run (a new generator) starts a permutation of
    the disjoint windows drawn from ``g``, and takes them in that order."""

    def __init__(self, data: SourceText, batch_size: int) -> None:
        self.data, self.batch_size = data, batch_size
        self._generator: torch.Generator | None = None
        self._order = torch.empty(0, dtype=torch.int64)
        self._next = 0

    def __call__(self, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        if g is not self._generator:  # a new run
            self._generator = g
            self._order = torch.randperm(self.data.windows, generator=g)
            self._next = 0
        end = self._next + self.batch_size
        if end > len(self._order):
            raise RuntimeError(
                f"the run asked for more than the {self.data.windows} windows of the text: "
                "a window would repeat"
            )
        chosen = self._order[self._next : end]
        self._next = end
        c = self.data.context
        rows = chosen[:, None] * c + torch.arange(c + 1)
        window = self.data.train[rows]
        return window[:, :-1], window[:, 1:]
