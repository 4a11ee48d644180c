"""The ``native`` CPU path: DAF's per-element passes in C (daf_cpu.c) through ctypes.

The vectorised PyTorch path spends ~9 passes over a tensor on quantize + pack (subtract,
scale, round, narrow, shift/OR) and ~6 on unpack + dequantize; the C loops do each in one
pass that the compiler vectorises for the machine it runs on (gcc -O3 -march=native).
Measured on the development VM (1 thread, 3.2 M post-ReLU floats, 4 bits): quantize + pack
0.28 vs 0.67 ms, unpack + dequantize 0.08 vs 0.38 ms (8 bits: 0.27 vs 0.54, 0.07 vs 0.23).
The per-group min/max and the scales stay PyTorch's (amin/amax, reference.scales), so the
bytes equal the reference's bit for bit (tests), NaN handling included; the C code rounds the
same two float32 operations per direction as PyTorch's separate kernels (-ffp-contract=off:
no fused multiply-add).

The library is compiled on first use with the machine's C compiler (``CC``, default
``cc``) into a per-user cache (``TTA_KERNELS_CACHE``, default ``~/.cache/tta_kernels``),
keyed by the source, the flags, the compiler and the CPU, so a copied cache never runs code
built for another CPU; ``make setup`` builds it ahead (``python -m tta_kernels.native``).
Without a compiler, `library()` raises and the dispatcher falls back to the vectorised path
with one warning. Single-threaded: the vectorised path may win with several torch threads
on large tensors; choose with ``TTA_KERNELS_CPU``.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from torch import Tensor

from .reference import Quantized, check_args, padded_groups, scales

SOURCE = Path(__file__).with_name("daf_cpu.c")
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-fast-math", "-fPIC", "-shared")
_P, _I = ctypes.c_void_p, ctypes.c_int64


def cache_dir() -> Path:
    """Where built libraries are kept (TTA_KERNELS_CACHE, else the user's cache)."""
    env = os.environ.get("TTA_KERNELS_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tta_kernels"


def _cpu_id() -> str:
    """The CPU's model and feature flags (Linux), else the platform's processor name."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    keep = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags", "Features"))]
    return "\n".join(dict.fromkeys(keep))


def library_path(compiler: str) -> Path:
    """The cached library for this source, flags, compiler and CPU."""
    key = hashlib.sha256(b"\0".join(s.encode() for s in (
        SOURCE.read_text(), " ".join(FLAGS), compiler, platform.machine(), _cpu_id()))
    ).hexdigest()[:16]
    return cache_dir() / f"libdaf_cpu-{key}.so"


def _compiler() -> str:
    cc = os.environ.get("CC", "cc")
    path = shutil.which(cc)
    if path is None:
        raise RuntimeError(f"no C compiler {cc!r} on PATH (set CC) for the native DAF kernels")
    return path


def build() -> Path:
    """Compile daf_cpu.c into the cache (atomic: a half-written file is never loaded)."""
    cc = _compiler()
    out = library_path(cc)
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cc, *FLAGS, "-o", tmp, str(SOURCE)], capture_output=True,
                              text=True, check=False, timeout=120)
        if proc.returncode != 0:
            first = (proc.stderr.strip().splitlines() or ["(no output)"])[0]
            raise RuntimeError(f"{cc} failed on {SOURCE.name}: {first}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL:
    """The loaded library (built first if needed); RuntimeError when it cannot be."""
    lib = ctypes.CDLL(str(build()))
    lib.daf_quantize_pack.argtypes = [_P, _I, _I, ctypes.c_int, _P, _P, _P]
    lib.daf_unpack_dequantize.argtypes = [_P, _P, _P, _I, _I, ctypes.c_int, _P]
    lib.daf_quantize_pack.restype = lib.daf_unpack_dequantize.restype = ctypes.c_int
    lib.daf_mask_pack.argtypes = [_P, _I, ctypes.c_float, ctypes.c_float, _P]
    lib.daf_mask_unpack.argtypes = [_P, _I, ctypes.c_float, ctypes.c_float, _P]
    lib.daf_mask_pack.restype = lib.daf_mask_unpack.restype = None
    return lib


def _check_cpu(*tensors: Tensor) -> None:
    for t in tensors:
        if t.device.type != "cpu":
            raise ValueError(f"the native DAF kernels run on CPU tensors, got {t.device}")


def quantize_pack(x: Tensor, bits: int, group: int) -> Quantized:
    """Quantize + pack (reference format): min/max and scales by PyTorch, the pass in C."""
    check_args(bits, group)
    _check_cpu(x)
    g = padded_groups(x, group).contiguous()
    mn, mx = g.amin(1), g.amax(1)
    scale, inv = scales(mn, mx, bits)
    inv = inv.contiguous()
    codes = torch.empty(g.numel() * bits // 8, dtype=torch.uint8)
    if library().daf_quantize_pack(g.data_ptr(), g.shape[0], group, bits, mn.data_ptr(),
                                   inv.data_ptr(), codes.data_ptr()):
        raise MemoryError("daf_quantize_pack could not allocate its scratch row")
    return Quantized(codes, mn, scale)


def unpack_dequantize(qt: Quantized, bits: int, group: int, n: int,
                      dtype: torch.dtype = torch.float32) -> Tensor:
    """Unpack + dequantize in C: the first n values (flat, dtype)."""
    check_args(bits, group)
    codes, mn, scale = (t.contiguous() for t in qt)
    _check_cpu(codes, mn, scale)
    rows = mn.numel()
    if codes.numel() != rows * group * bits // 8 or scale.numel() != rows or mn.dtype != \
            torch.float32 or scale.dtype != torch.float32:
        raise ValueError(f"codes/mn/scale do not describe {rows} groups of {group} at {bits} "
                         f"bits (codes {codes.numel()}, scale {scale.numel()})")
    out = torch.empty(rows * group, dtype=torch.float32)
    if library().daf_unpack_dequantize(codes.data_ptr(), mn.data_ptr(), scale.data_ptr(),
                                       rows, group, bits, out.data_ptr()):
        raise MemoryError("daf_unpack_dequantize could not allocate its scratch row")
    t = out[:n]
    return t if dtype == torch.float32 else t.to(dtype)


def mask_pack(flat: Tensor, lo: float, hi: float) -> Tensor:
    """Packed bits of lo < flat < hi (flat float32, contiguous, CPU), tta_core.memory.bits'
    layout: element 8k + j at bit j of byte k."""
    if flat.dtype != torch.float32 or flat.dim() != 1 or not flat.is_contiguous():
        raise ValueError(f"mask_pack needs a flat contiguous float32 tensor, got {flat.dtype} "
                         f"{tuple(flat.shape)}")
    _check_cpu(flat)
    n = flat.numel()
    out = torch.empty((n + 7) // 8, dtype=torch.uint8)
    library().daf_mask_pack(flat.data_ptr(), n, lo, hi, out.data_ptr())
    return out


def mask_unpack(bits: Tensor, n: int, lo: float, inside: float) -> Tensor:
    """float32 stand-in of a packed mask: `inside` where set, `lo` elsewhere, each as
    bit * (inside - lo) + lo in float32 (the PyTorch decode's two roundings)."""
    if bits.dtype != torch.uint8 or bits.dim() != 1 or not 0 <= n <= 8 * bits.numel():
        raise ValueError(f"mask_unpack needs 1-D uint8 bits covering n={n}, got {bits.dtype} "
                         f"{tuple(bits.shape)}")
    _check_cpu(bits)
    bits = bits.contiguous()
    out = torch.empty(n, dtype=torch.float32)
    d = float(torch.tensor(inside - lo, dtype=torch.float32))  # as a tensor op casts it
    library().daf_mask_unpack(bits.data_ptr(), n, d, float(torch.tensor(lo, dtype=torch.float32)),
                              out.data_ptr())
    return out


def main() -> int:
    """Build the library ahead of first use (make setup); prints its path."""
    try:
        print(build())
    except (RuntimeError, OSError) as exc:
        print(f"tta_kernels.native: not built ({exc}); the vectorised path will be used",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
