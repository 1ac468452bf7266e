"""Whether a device multiplies bfloat16 natively, where the library's defaults take it.

:class:`~kfac_func.KFAC` takes bfloat16 operands for its statistics' Gram products and
runs Muon's Newton–Schulz iteration in bfloat16 only where that is faster than float32:
a CUDA device of compute capability 8.0 or newer (or a ROCm one), or a CPU with AVX-512
BF16 or AMX. Elsewhere a bfloat16 product is emulated: oneDNN still "supports" bfloat16
on any AVX-512 CPU (``torch.ops.mkldnn._is_mkldnn_bf16_supported()`` answers True there)
by widening each operand to float32, and on such a CPU a 768-wide bfloat16 product takes
about four times as long as the float32 one. ``torch.cuda.is_bf16_supported()`` likewise
counts the emulation of CUDA devices older than Ampere by default.
"""

from __future__ import annotations

import torch

__all__ = ["native_bf16"]


def native_bf16(device: torch.device | str) -> bool:
    """Whether ``device`` multiplies bfloat16 in hardware (at least as fast as float32):
    a CUDA device of compute capability 8.0 or newer, or a ROCm device; a CPU with the
    AVX-512 BF16 instructions or AMX tiles (Intel Cooper Lake and Sapphire Rapids on, AMD
    Zen 4 on). An AVX-512 CPU without them, an older CUDA device, a CPU of another
    architecture and any other device type answer False (bfloat16 emulated or unknown:
    the float32 path, slower nowhere).

    Example:
        >>> native_bf16("meta")
        False
        >>> isinstance(native_bf16("cpu"), bool)
        True
    """
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return False
        if torch.version.hip:
            return True
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.get_device_capability(index)[0] >= 8
    if device.type == "cpu":
        checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
        return any(bool(getattr(torch.cpu, name, lambda: False)()) for name in checks)
    return False
