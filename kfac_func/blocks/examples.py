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
- every other call must say the same ``N``: when two say different numbers (a model that
  flattens ``(B, T, d)`` to ``(B·T, d)`` before a layer, a sequence-first ``(T, B, d)``
  layout next to batch-first layers), the batch size cannot be known and
  :meth:`CallExamples.batch_size` raises :class:`BatchSizeError`, naming the layers and
  their input shapes.

Known limitation: a flattening layer at a batch of one (``(T, d)`` beside ``(1, T, d)``)
says ``T`` while the others say 1, and ``T`` is taken.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kfac_func.blocks.spec import LayerSpec

__all__ = ["BatchSizeError", "CallExamples"]


class BatchSizeError(ValueError):
    """The registered layers of one forward pass do not tell its batch size."""


_WHAT_TO_DO = (
    "Keep the examples on the leading dimension of every registered layer's input (call "
    "the layer on (B, T, d), not on the flattened (B*T, d); batch_first=True for "
    "torch.nn.Transformer layers), or leave the layers that do not out (skip_layers=[...])"
)


@dataclass
class CallExamples:
    """What the calls of one forward pass say about its number of examples: per layer,
    each distinct count (None: the input does not tell) with the first input shape that
    said it.

    Example:
        >>> import torch
        >>> from kfac_func.blocks import register
        >>> table = register(torch.nn.Sequential(torch.nn.Embedding(9, 4), torch.nn.Linear(4, 2)))
        >>> seen = CallExamples()
        >>> seen.add(table["0"], torch.zeros(3, 5, dtype=torch.long))
        >>> seen.add(table["0"], torch.arange(5))  # positions: 1-d ids do not tell
        >>> seen.add(table["1"], torch.zeros(3, 5, 4))
        >>> seen.batch_size()
        3
        >>> seen.add(table["1"], torch.zeros(15, 4))  # flattened
        >>> seen.batch_size()
        Traceback (most recent call last):
        ...
        kfac_func.blocks.examples.BatchSizeError: cannot tell the batch size: ...
    """

    said: dict[str, dict[int | None, tuple[int, ...]]] = field(default_factory=dict)
    many: set[int] = field(default_factory=set)
    """The counts above 1 said so far (kept as calls are added: asked on every call)."""

    def add(self, spec: LayerSpec, x: torch.Tensor) -> None:
        """Record one call of ``spec`` on the input ``x``."""
        n = spec.block.examples(spec, x)
        self.said.setdefault(spec.name, {}).setdefault(n, tuple(x.shape))
        if n is not None and n != 1:
            self.many.add(n)

    def known(self) -> int | None:
        """The number of examples the calls so far agree on, if one above 1 (else None:
        nothing to expand a broadcast call to, see :meth:`LayerBlock.broadcast_call`)."""
        return next(iter(self.many)) if len(self.many) == 1 else None

    def __bool__(self) -> bool:
        return bool(self.said)

    def batch_size(self, required: bool = True, what_to_do: str = _WHAT_TO_DO) -> int:
        """The number of examples the calls agree on (see the module docstring).

        With ``required=False`` (the batch size does not enter the result: the
        ``"kfac-pytorch"`` scaling without EKFAC) nothing is raised: the largest count
        said, or 1. ``what_to_do`` ends the error's message.

        Raises:
            BatchSizeError: the calls say different numbers of examples, or none says
                any (only with ``required``).
        """
        counts = {n for ns in self.said.values() for n in ns if n is not None}
        many = counts - {1}
        if len(many) == 1:
            return many.pop()
        if not many and counts:
            return 1
        if not required:
            return max(counts, default=1)
        if many:
            layers = ", ".join(
                f"{name!r} saw {shape} ({n} examples)"
                for name, ns in self.said.items()
                for n, shape in ns.items()
                if n is not None and n != 1
            )
            problem = f"its registered layers' inputs hold different numbers of examples: {layers}"
        else:
            shapes = ", ".join(
                f"{name!r} saw {shape}" for name, ns in self.said.items() for shape in ns.values()
            )
            problem = f"no registered layer's input tells the number of examples ({shapes})"
        raise BatchSizeError(f"cannot tell the batch size: {problem}. {what_to_do}.")
