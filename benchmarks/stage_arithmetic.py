"""The arithmetic side of ``benchmarks/stages.py``: the machine's rates, the floors of
the stages (multiply-adds and bytes), and Muon's step with its Newton–Schulz iteration
in float32.

Multiply-adds, per operation: ``A @ B`` of shapes ``(..., i, j)`` and ``(..., j, k)``,
``i·j·k`` per matrix of the batch; an ``n``-wide ``eigh`` with eigenvectors,
``(4/3)·n³`` (:data:`EIGH_MACS`: the tridiagonal reduction and the back-transformation
of the eigenvectors, ``(2/3)·n³`` each; LAPACK's whole solver does up to about 4.5 n³);
a warm-started QR refresh, ``(7/3)·n³`` (:data:`QR_MACS`: ``F·Q``, then a Householder QR
of an ``n × n`` matrix with ``Q`` formed); Muon's iteration, :func:`newton_schulz_macs`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

EIGH_MACS = 4.0 / 3.0
"""Multiply-adds of an ``eigh`` with eigenvectors, per ``n³``."""
QR_MACS = 7.0 / 3.0
"""Multiply-adds of a QR refresh (``F·Q``, Householder QR, ``Q`` formed), per ``n³``."""
NS_STEPS = 5
"""Newton–Schulz iterations of ``torch.optim.Muon`` (its default)."""


# --------------------------------------------------------------------------- machine


def bf16_flags() -> dict[str, bool]:
    """Whether the CPU advertises native bfloat16 arithmetic (``/proc/cpuinfo``'s flags;
    all False where the file is missing)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    flags = set()
    for line in text.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    return {f: f in flags for f in ("avx512_bf16", "amx_bf16", "amx_tile", "avx512f")}


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (a GPU's); nothing on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_seconds(fn: Callable[[], Any], reps: int, device: torch.device) -> float:
    """The fastest of ``reps`` calls of ``fn`` (after one untimed call), each waited for
    on ``device``."""
    fn()  # warm-up
    times = []
    for _ in range(reps):
        synchronize(device)
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return min(times)


def measure_rates(
    n: int, elements: int, reps: int = 3, device: torch.device | None = None
) -> dict[str, float]:
    """The rates of ``device`` (the CPU by default) now: multiply-adds per second of one
    ``n × n`` float32 (and bfloat16) matmul, and bytes per second of an elementwise
    float32 add of ``elements`` (two read, one written); the best of ``reps``."""
    device = device or torch.device("cpu")
    g = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=g).to(device)
    b = torch.randn(n, n, generator=g).to(device)
    out = {"matmul_n": float(n)}
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        x, y = a.to(dtype), b.to(dtype)
        out[f"matmul_{name}_macs_per_s"] = n**3 / _best_seconds(
            lambda x=x, y=y: x @ y, reps, device
        )
    u = torch.randn(elements, generator=g).to(device)
    v = torch.randn(elements, generator=g).to(device)
    w = torch.empty_like(u)
    out["memory_bytes_per_s"] = (
        3 * 4 * elements / _best_seconds(lambda: torch.add(u, v, out=w), reps, device)
    )
    return out


# --------------------------------------------------------------------------- Muon in float32


def orthogonalize_fp32(
    m: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float
) -> torch.Tensor:
    """Muon's quintic Newton–Schulz iteration towards the orthogonal factor of ``m``,
    computed in float32 throughout: with ``X`` normalised to unit Frobenius norm (the
    wide orientation), ``X ← a·X + (b·A + c·A²)·X`` with ``A = X Xᵀ``, ``steps`` times."""
    a, b, c = coefficients
    x = m.float()
    wide = x.shape[0] <= x.shape[1]
    if not wide:
        x = x.mT
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.mT
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a)
    return x if wide else x.mT


class Muon32(torch.optim.Muon):
    """``torch.optim.Muon`` with its Newton–Schulz iteration in float32
    (:func:`orthogonalize_fp32`) instead of bfloat16: the same momentum, Nesterov
    look-ahead, weight decay and learning-rate adjustment, read from its parameter
    groups."""

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = None if closure is None else closure()
        for group in self.param_groups:
            lr, decay, beta = group["lr"], group["weight_decay"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - beta)
                direction = p.grad.lerp(buf, beta) if group["nesterov"] else buf
                o = orthogonalize_fp32(
                    direction, group["ns_coefficients"], group["ns_steps"], group["eps"]
                )
                rows, cols = p.shape[:2]
                scale = _muon_lr_scale(group["adjust_lr_fn"], rows, cols)
                p.mul_(1 - lr * decay)
                p.add_(o.to(p.dtype), alpha=-lr * scale)
        return loss


def float32_muon(stepper: Any) -> None:
    """Give a race stepper of Muon (``optimizers.Stepper("muon", ...)``) :class:`Muon32`
    for its matrices, with the same parameter groups, settings and learning-rate schedule."""
    muon = stepper.opts[0]
    groups = [{"params": g["params"]} for g in muon.param_groups]
    stepper.opts[0] = Muon32(groups, **muon.defaults)
    schedule = stepper.schedulers[0].lr_lambdas[0]
    stepper.schedulers[0] = torch.optim.lr_scheduler.LambdaLR(stepper.opts[0], schedule)


def _muon_lr_scale(rule: str | None, rows: int, cols: int) -> float:
    """The factor ``torch.optim.Muon`` applies to the learning rate of a ``rows × cols``
    matrix under its ``adjust_lr_fn`` rule."""
    if rule is None or rule == "original":
        return math.sqrt(max(1.0, rows / cols))
    if rule == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    return 1.0


def newton_schulz_macs(shapes: Iterable[Sequence[int]], steps: int = NS_STEPS) -> float:
    """Multiply-adds of Muon's iterations over matrices of ``shapes``: per iteration of
    an ``m × n`` matrix (``m ≤ n``) ``X Xᵀ`` (m²n), ``A·A`` (m³) and ``B·X`` (m²n)."""
    total = 0.0
    for shape in shapes:
        m, n = sorted(shape[:2])
        total += steps * (2 * m * m * n + m**3)
    return total


# --------------------------------------------------------------------------- arithmetic


def matmul_macs(a: Sequence[int], b: Sequence[int]) -> float:
    """Multiply-adds of ``A @ B`` for shapes ``(..., i, j)`` and ``(..., j, k)``.

    Example:
        >>> matmul_macs((4, 2, 3), (3, 5))
        120.0
    """
    batch = torch.broadcast_shapes(tuple(a[:-2]), tuple(b[:-2]))
    return float(math.prod(batch) * a[-2] * a[-1] * b[-1])


def sided_macs(m: torch.Tensor, left: torch.Tensor | None, right: torch.Tensor | None) -> float:
    """Multiply-adds of ``left @ m`` and ``m @ right`` (a side of None: no product; a
    ``right`` of one dimension more than ``m``: its ``k`` diagonal blocks ``(..., k, w,
    w)``, each multiplying ``w`` columns of ``m``, the last block's padding included, as
    :func:`kfac_func.core.preconditioning.right_product` computes it).

    Example:
        >>> sided_macs(torch.zeros(2, 3), torch.zeros(2, 2), None)
        12.0
        >>> sided_macs(torch.zeros(2, 3), None, torch.zeros(2, 2, 2))  # 2 blocks of 2
        16.0
    """
    macs = 0.0
    if left is not None:
        macs += matmul_macs(left.shape, m.shape)
    if right is not None:
        shape = tuple(m.shape)
        if right.dim() > m.dim():
            shape = (*shape[:-2], right.shape[-3], shape[-2], right.shape[-1])
        macs += matmul_macs(shape, right.shape)
    return macs


def cube_macs(q: torch.Tensor | None, per_n3: float) -> float:
    """``per_n3 · n³`` for every ``n × n`` matrix of a (stacked) basis; 0 for None."""
    if q is None:
        return 0.0
    n = q.shape[-1]
    return per_n3 * math.prod(q.shape[:-2]) * n**3


def tensor_bytes(tensors: Iterable[torch.Tensor | None]) -> float:
    """The bytes of ``tensors`` (None: nothing)."""
    return float(sum(t.numel() * t.element_size() for t in tensors if t is not None))


@dataclass
class Floor:
    """A stage's arithmetic: multiply-adds at the float32 matmul rate (``macs``) and at the
    bfloat16 rate (``bf16_macs``), and bytes at the memory rate."""

    macs: float = 0.0
    bytes: float = 0.0
    bf16_macs: float = 0.0

    @classmethod
    def products(cls, macs: float, dtype: torch.dtype) -> Floor:
        """``macs`` multiply-adds in ``dtype`` (bfloat16's rate for bfloat16, else
        float32's).

        Example:
            >>> Floor.products(8.0, torch.bfloat16).bf16_macs
            8.0
        """
        return cls(bf16_macs=macs) if dtype == torch.bfloat16 else cls(macs=macs)

    @property
    def all_macs(self) -> float:
        """Every multiply-add, at either rate."""
        return self.macs + self.bf16_macs

    def ms(self, rates: dict[str, float]) -> float:
        """Milliseconds at ``rates`` (:func:`measure_rates`)."""
        return 1e3 * (
            self.macs / rates["matmul_float32_macs_per_s"]
            + self.bf16_macs / rates["matmul_bfloat16_macs_per_s"]
            + self.bytes / rates["memory_bytes_per_s"]
        )

    def __add__(self, other: Floor) -> Floor:
        return Floor(
            self.macs + other.macs, self.bytes + other.bytes, self.bf16_macs + other.bf16_macs
        )

    def times(self, k: float) -> Floor:
        """This floor ``k`` times."""
        return Floor(self.macs * k, self.bytes * k, self.bf16_macs * k)
