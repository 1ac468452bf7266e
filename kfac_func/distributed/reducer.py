"""Ordered, bucketed sums of tensors across ranks, for keys that become ready in any order.

The factor reduction of the KAISA step: each layer's factors become ready in the backward
pass (or at ``step()``), in whatever order autograd reaches the layers; every rank must
still issue the same collectives. :class:`OrderedReducer` launches them strictly in the
plan's order, packed into buckets, through
:class:`~kfac_func.distributed.communicator.Communicator`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from kfac_func.distributed.communicator import Communicator, Pending

__all__ = ["OrderedReducer"]


class OrderedReducer:
    """Sums over ranks of a few tensors per key, launched key by key in a fixed order.

    Keys may become ready in any order (e.g. from autograd hooks); collectives are issued
    strictly in ``order``, each as soon as every earlier key is ready, packed into buckets
    of the communicator's cap, so every rank issues the same sequence. Each key holds the
    same number of tensors, ``symmetric[i]`` telling whether its i-th one may travel as an
    upper triangle (a key may narrow that when it is offered: a diagonal factor is a
    vector). With ``dst``, each key's sums go only to its rank (others get their
    input back). :meth:`finish` fills keys never offered, flushes and waits.

    Example:
        >>> from kfac_func.distributed.plan import make_plan
        >>> comm = Communicator(make_plan({"fc": (2, 2)}, world_size=1))
        >>> red = OrderedReducer(comm, ["fc"], symmetric=[False])
        >>> red.ready("fc", [torch.ones(2)])
        >>> red.finish(lambda key: [torch.zeros(2)])
        {'fc': [tensor([1., 1.])]}
    """

    def __init__(
        self,
        comm: Communicator,
        order: Sequence[str],
        *,
        symmetric: Sequence[bool],
        dst: dict[str, int] | None = None,
        kind: str = "factors",
    ) -> None:
        self.comm = comm
        self.order = list(order)
        self.sym = [s and comm.symmetry_aware for s in symmetric]
        self.dst = dst
        self.kind = kind
        self._next = 0
        self._waiting: dict[str, tuple[list[torch.Tensor], list[bool]]] = {}
        self._offered: set[str] = set()
        self._flat: list[torch.Tensor] = []
        self._flat_sym: list[bool] = []
        self._slots: dict[str, range] = {}
        self._bucket: list[int] = []
        self._size = 0
        self._pending = Pending()
        self._results: dict[int, torch.Tensor] = {}
        self._targets: list[int | None] = []

    def offered(self, key: str) -> bool:
        return key in self._offered

    def ready(
        self,
        key: str,
        tensors: Sequence[torch.Tensor],
        symmetric: Sequence[bool] | None = None,
    ) -> None:
        """Offer ``key``'s tensors (once per key); launches what the order allows.
        ``symmetric`` (default: the reducer's) says which of them are symmetric matrices."""
        if key in self._offered:
            raise ValueError(f"{key!r} was already offered to this reduction")
        if len(tensors) != len(self.sym):
            raise ValueError(f"{key!r}: expected {len(self.sym)} tensors, got {len(tensors)}")
        sym = (
            self.sym if symmetric is None else [a and bool(b) for a, b in zip(self.sym, symmetric)]
        )
        self._offered.add(key)
        self._waiting[key] = (list(tensors), list(sym))
        while self._next < len(self.order) and self.order[self._next] in self._waiting:
            self._add(self.order[self._next])
            self._next += 1

    def _add(self, key: str) -> None:
        tensors, syms = self._waiting.pop(key)
        target = self.dst[key] if self.dst is not None else None
        start = len(self._flat)
        for t, s in zip(tensors, syms):
            i = len(self._flat)
            nbytes = t.numel() * t.element_size()
            if self._bucket and (
                self.comm.bucket_cap_bytes == 0
                or self._size + nbytes > self.comm.bucket_cap_bytes
                or self._flat[self._bucket[0]].dtype != t.dtype
                or self._targets[self._bucket[0]] != target
            ):
                self._flush()
            self._flat.append(t)
            self._flat_sym.append(s)
            self._targets.append(target)
            self._bucket.append(i)
            self._size += nbytes
        self._slots[key] = range(start, len(self._flat))

    def _flush(self) -> None:
        if self._bucket and self.comm.active and self.comm.world_size > 1:
            self.comm.launch_reduce(
                self._bucket,
                self._flat,
                self._flat_sym,
                self._targets,
                self.kind,
                self._pending,
                self._results,
            )
        self._bucket, self._size = [], 0

    def finish(
        self, fill: Callable[[str], Sequence[torch.Tensor]]
    ) -> dict[str, list[torch.Tensor]]:
        """Offer ``fill(key)`` for keys never offered, then wait: ``{key: sums}``."""
        for key in self.order:
            if key not in self._offered:
                self.ready(key, fill(key))
        self._flush()
        if not self.comm.active or self.comm.world_size == 1:
            self._results = dict(enumerate(self._flat))
        else:
            self._pending.wait()
        return {k: [self._results[i] for i in r] for k, r in self._slots.items()}
