"""The batch size of one forward pass, from what its registered layers' calls say.

The batch size is never guessed from a model's arguments (keyword calls, dicts and
dataclasses of inputs hide them): each call of a registered layer tells how many examples
its input holds (:meth:`~kfac_func.blocks.base.LayerBlock.examples`), and the forward's
batch size is what they say together:

- calls that see one example (an unbatched input, or a leading dimension of 1 broadcast
  over the batch, as the ``(1, T)`` position ids of Hugging Face models) agree with any
  batch size;
- calls whose input does not tell (a flattened ``(N·T, d)`` attention output, ids of one
  unbatched sequence) are left out;
- calls on rows alone (:meth:`~kfac_func.blocks.base.LayerBlock.rows_only`: a Linear's
  ``(R, d)``, a norm's ``(R, *normalized_shape)``) say the number of examples only when no
  call says it otherwise: the rows of OPT's MLP (``(B·T, d)``), of Qwen2-MoE's shared
  expert, or the tokens routed to one expert, are rows of the examples the other layers
  see, and their factors are those of the unflattened layer (a row is a row: ``A``
  averages rows, ``G`` sums them over the batch's examples);
- every other call must say the same ``N``: when two say different numbers (a
  sequence-first ``(T, B, d)`` layout next to batch-first layers, a table of positions
  ``(T, T)`` broadcast over the batch), the batch size cannot be known and
  :meth:`CallExamples.batch_size` raises :class:`BatchSizeError`, naming the layers that
  disagree with the most common count.

A batch of one example is told apart from a batch of ``T`` broadcast over: when every
call that says a number says 1 and the calls on rows alone count as many rows as one of
those calls holds (``(T, d)`` beside ``(1, T, d)``: the flattened rows of the one
example), the batch size is 1.

Known limitation: with every call on rows alone, calls that disagree are an error.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kfac_func.blocks.spec import LayerSpec

__all__ = ["BatchSizeError", "CallExamples"]


class BatchSizeError(ValueError):
    """The registered layers of one forward pass do not tell its batch size."""


_WHAT_TO_DO = (
    "Keep the examples on the leading dimension of every registered layer's input "
    "(batch_first=True for torch.nn.Transformer layers), or leave the layers that do not "
    "out (skip_layers=[...])"
)

_SHOWN = 3
"""Layers named per count in an error (the rest are counted)."""


@dataclass
class CallExamples:
    """What the calls of one forward pass say about its number of examples: per layer,
    each distinct count (None: the input does not tell) with the first input shape that
    said it, apart for calls on rows alone (see the module docstring).

    Example:
        >>> import torch
        >>> from kfac_func.blocks import register
        >>> table = register(torch.nn.Sequential(torch.nn.Embedding(9, 4), torch.nn.Linear(4, 2)))
        >>> seen = CallExamples()
        >>> seen.add(table["0"], torch.zeros(3, 5, dtype=torch.long))
        >>> seen.add(table["0"], torch.arange(5))  # positions: 1-d ids do not tell
        >>> seen.add(table["1"], torch.zeros(15, 4))  # flattened rows of the 3 examples
        >>> seen.batch_size()
        3
        >>> seen.add(table["1"], torch.zeros(5, 3, 4))  # sequence first: 5 examples?
        >>> seen.batch_size()
        Traceback (most recent call last):
        ...
        kfac_func.blocks.examples.BatchSizeError: cannot tell the batch size: ...
    """

    said: dict[str, dict[int | None, tuple[int, ...]]] = field(default_factory=dict)
    rows: dict[str, dict[int | None, tuple[int, ...]]] = field(default_factory=dict)
    """The counts of calls on rows alone (:meth:`LayerBlock.rows_only`), per layer."""
    many: set[int] = field(default_factory=set)
    """The counts above 1 said so far (kept as calls are added: asked on every call)."""
    many_rows: set[int] = field(default_factory=set)
    """The same of calls on rows alone."""
    one_rows: set[int] = field(default_factory=set)
    """The rows held by the calls that say one example (a batch of one's rows)."""

    def add(self, spec: LayerSpec, x: torch.Tensor) -> None:
        """Record one call of ``spec`` on the input ``x``."""
        n = spec.block.examples(spec, x)
        if n is not None and spec.block.rows_only(spec, x):
            self.rows.setdefault(spec.name, {}).setdefault(n, tuple(x.shape))
            if n != 1:
                self.many_rows.add(n)
            return
        self.said.setdefault(spec.name, {}).setdefault(n, tuple(x.shape))
        if n is not None and n != 1:
            self.many.add(n)
        elif n == 1:  # ids count each entry as a row, features the entries of a row
            self.one_rows.add(x.numel() if not x.is_floating_point() else x.shape[:-1].numel())

    def known(self) -> int | None:
        """The number of examples the calls so far agree on, if one above 1 (else None:
        nothing to expand a broadcast call to, see :meth:`LayerBlock.broadcast_call`)."""
        many = self.many or self.many_rows
        return next(iter(many)) if len(many) == 1 else None

    def __bool__(self) -> bool:
        return bool(self.said or self.rows)

    def batch_size(self, required: bool = True, what_to_do: str = _WHAT_TO_DO) -> int:
        """The number of examples the calls agree on (see the module docstring).

        With ``required=False`` (the batch size does not enter the result: the
        ``"kfac-pytorch"`` scaling without EKFAC) nothing is raised: the largest count
        said, or 1. ``what_to_do`` ends the error's message.

        Raises:
            BatchSizeError: the calls say different numbers of examples, or none says
                any (only with ``required``); the message names the layers that disagree
                with the most common count.
        """
        for said in (self.said, self.rows):
            counts = {n for ns in said.values() for n in ns if n is not None}
            many = counts - {1}
            if len(many) == 1:
                return many.pop()
            if many:
                if not required:
                    return max(many)
                raise BatchSizeError(
                    "cannot tell the batch size: its registered layers' inputs hold "
                    f"different numbers of examples: {_disagreeing(said)}. {what_to_do}."
                )
            if counts and said is self.said and self.many_rows <= self.one_rows:
                return 1  # no rows beside, or the rows of the one example
        if any(1 in ns for ns in self.rows.values()):
            return 1
        if not required:
            return 1
        shapes = ", ".join(
            f"{name!r} saw {shape}" for name, ns in self.said.items() for shape in ns.values()
        )
        problem = f"no registered layer's input tells the number of examples ({shapes})"
        raise BatchSizeError(f"cannot tell the batch size: {problem}. {what_to_do}.")


def _disagreeing(said: dict[str, dict[int | None, tuple[int, ...]]]) -> str:
    """The layers by count: the most common count's first layer, then every other
    count's (a few named, the rest counted), as errors list them."""
    by_count: dict[int, list[str]] = {}
    for name, ns in said.items():
        for n, shape in ns.items():
            if n is not None and n != 1:
                by_count.setdefault(n, []).append(f"{name!r} saw {shape} ({n} examples)")
    ranked = sorted(by_count.items(), key=lambda kv: -len(kv[1]))
    (common, agree), others = ranked[0], ranked[1:]
    parts = []
    for _, layers in others:
        more = f" and {len(layers) - _SHOWN} more" if len(layers) > _SHOWN else ""
        parts.append(", ".join(layers[:_SHOWN]) + more)
    rest = f" and {len(agree) - 1} more" if len(agree) > 1 else ""
    return f"{'; '.join(parts)}; while {agree[0]}{rest} say {common}"
