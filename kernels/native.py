"""The ``native`` CPU path: DAF's per-element passes in C (daf_cpu.c) through ctypes.

`quantize_pack` is one fused pass (daf_quantize_pack_fused): for each group, its min/max
(AVX2 min/max lanes reduced by a register tree; a portable loop elsewhere), the scales, then
the codes and packing while the group is still in L1, so x is read from memory once instead
of three times (amin, amax, quantize). `quantize_pack_mask` adds, in the same pass, the 1-bit
band mask of the same tensor (a ReLU output saved as the ReLU's mask and as the next conv's
quantized input). `quantize_pack_two_pass` keeps the unfused form (PyTorch amin/amax and
scales, then daf_quantize_pack) as the baseline of benchmarks/speed/bench_kernels.py.
Both give the reference's bytes bit for bit (tests): the C code computes the scales as
PyTorch does (inv = (1 / rng) * L, the reciprocal-then-multiply of PyTorch's scalar /
tensor; scale = rng / L) and rounds the same float32 operations (-ffp-contract=off: no
fused multiply-add); a group holding a NaN gets NaN min and scale, as amin/amax give. One
difference in bits, not in value: a group whose min (or max) is a zero present with both
signs may carry the other sign than the one PyTorch's reduction order picks (codes and
decoded values are unaffected; torch.equal holds).
Unpack + dequantize is one C pass as well (the vectorised PyTorch path takes ~6);
`unpack_dequantize_relu` also makes a ReLU output's values agree with its exact mask in
that pass, so one decoded tensor serves the next conv's ∂W and the ReLU's backward.

The library is compiled on first use with the machine's C compiler (``CC``, default
``cc``) into a per-user cache (``TTA_KERNELS_CACHE``, default ``~/.cache/tta_kernels``),
keyed by the source, the flags, the compiler and the CPU, so a copied cache never runs code
built for another CPU; ``make setup`` builds it ahead (``python -m tta_kernels.native``).
Without a compiler, `library()` raises and the dispatcher falls back to the vectorised path
with one warning. Built with OpenMP where the compiler has it: a pass over a large tensor
splits its groups among torch's intra-op threads (``threads``); the paths are chosen with
``TTA_KERNELS_CPU``.
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

from .reference import Quantized, check_args, n_groups, padded_groups, scales

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


def library_path(compiler: str, extra: tuple[str, ...] = (), source: Path = SOURCE) -> Path:
    """The cached library for this source, flags (FLAGS + extra), compiler and CPU."""
    key = hashlib.sha256(b"\0".join(s.encode() for s in (
        source.read_text(), " ".join(FLAGS + extra), compiler, platform.machine(), _cpu_id()))
    ).hexdigest()[:16]
    return cache_dir() / f"lib{source.stem}-{key}.so"


def _compiler() -> str:
    cc = os.environ.get("CC", "cc")
    path = shutil.which(cc)
    if path is None:
        raise RuntimeError(f"no C compiler {cc!r} on PATH (set CC) for the native DAF kernels")
    return path


def build(extra: tuple[str, ...] = (), source: Path = SOURCE) -> Path:
    """Compile `source` (daf_cpu.c) into the cache (atomic: a half-written file is never
    loaded); `extra` compiler flags, e.g. -DDAF_PORTABLE (no x86 intrinsics: the generic
    loops)."""
    cc = _compiler()
    out = library_path(cc, extra, source)
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cc, *FLAGS, *extra, "-o", tmp, str(source)], capture_output=True,
                              text=True, check=False, timeout=120)
        if proc.returncode != 0:
            first = (proc.stderr.strip().splitlines() or ["(no output)"])[0]
            raise RuntimeError(f"{cc} failed on {source.name}: {first}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def build_threaded(source: Path = SOURCE) -> Path:
    """build() with OpenMP where the compiler has it, else without."""
    try:
        return build(("-fopenmp",), source)
    except RuntimeError:
        return build(source=source)


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL:
    """The loaded library (built first if needed); RuntimeError when it cannot be."""
    return load(build_threaded())


#: below this many values a pass runs on one thread (waking others costs more)
MIN_THREADED = 1 << 16


def threads(n: int) -> int:
    """OpenMP threads for a pass over n values: torch's intra-op count for large ones."""
    return torch.get_num_threads() if n >= MIN_THREADED else 1


def load(path: Path) -> ctypes.CDLL:
    """A built library with its functions' signatures declared."""
    lib = ctypes.CDLL(str(path))
    lib.daf_quantize_pack.argtypes = [_P, _I, _I, ctypes.c_int, _P, _P, _P]
    lib.daf_unpack_dequantize.argtypes = [_P, _P, _P, _I, _I, ctypes.c_int, _P,
                                          ctypes.c_int]
    lib.daf_quantize_pack.restype = lib.daf_unpack_dequantize.restype = ctypes.c_int
    lib.daf_mask_pack.argtypes = [_P, _I, ctypes.c_float, ctypes.c_float, _P]
    lib.daf_mask_unpack.argtypes = [_P, _I, ctypes.c_float, ctypes.c_float, _P]
    lib.daf_mask_pack.restype = lib.daf_mask_unpack.restype = None
    lib.daf_quantize_pack_fused.argtypes = [_P, _I, _I, ctypes.c_int, _P, _P, _P,
                                            ctypes.c_float, ctypes.c_float, _P, ctypes.c_int]
    lib.daf_quantize_pack_fused.restype = ctypes.c_int
    lib.daf_unpack_dequantize_relu.argtypes = [_P, _P, _P, _I, _I, ctypes.c_int, _P, _I, _P,
                                               ctypes.c_int]
    lib.daf_unpack_dequantize_relu.restype = ctypes.c_int
    return lib


def _check_cpu(*tensors: Tensor) -> None:
    for t in tensors:
        if t.device.type != "cpu":
            raise ValueError(f"the native DAF kernels run on CPU tensors, got {t.device}")


def quantize_pack_two_pass(x: Tensor, bits: int, group: int) -> Quantized:
    """Quantize + pack with min/max and scales by PyTorch (amin, amax: two passes over x)
    and the codes by one C pass: the unfused form, kept as the fused kernel's baseline."""
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


def _fused(x: Tensor, bits: int, group: int, band: tuple[float, float] | None
           ) -> tuple[Quantized, Tensor | None]:
    """daf_quantize_pack_fused on flat x (float32 copy only if x is not already one)."""
    check_args(bits, group)
    _check_cpu(x)
    if x.dim() != 1 or x.numel() == 0:
        raise ValueError(f"expected a non-empty 1-D tensor, got shape {tuple(x.shape)}")
    flat = x.contiguous() if x.dtype == torch.float32 else x.float().contiguous()
    n = flat.numel()
    rows = n_groups(n, group)
    codes = torch.empty(rows * group * bits // 8, dtype=torch.uint8)
    mn, scale = torch.empty(rows), torch.empty(rows)
    lo, hi = band if band is not None else (0.0, 0.0)
    mask = torch.empty((n + 7) // 8, dtype=torch.uint8) if band is not None else None
    if library().daf_quantize_pack_fused(
            flat.data_ptr(), n, group, bits, codes.data_ptr(), mn.data_ptr(),
            scale.data_ptr(), lo, hi, None if mask is None else mask.data_ptr(), threads(n)):
        raise MemoryError("daf_quantize_pack_fused could not allocate its scratch row")
    return Quantized(codes, mn, scale), mask


def quantize_pack(x: Tensor, bits: int, group: int) -> Quantized:
    """Fused quantize + pack (reference format): each group's min/max, scales and codes in
    one C pass that reads the group once (§3.2.3), no amin/amax passes."""
    return _fused(x, bits, group, None)[0]


def quantize_pack_mask(x: Tensor, bits: int, group: int, band: tuple[float, float]
                       ) -> tuple[Quantized, Tensor]:
    """quantize_pack(x) and the packed bits of band[0] < x < band[1] (mask_pack's layout)
    from one pass: a ReLU output's 1-bit mask and the next conv's quantized input."""
    lo, hi = band
    if not lo < hi:
        raise ValueError(f"band must satisfy lo < hi, got {band!r}")
    qt, mask = _fused(x, bits, group, (float(lo), float(hi)))
    return qt, mask  # type: ignore[return-value]


def unpack_dequantize(qt: Quantized, bits: int, group: int, n: int,
                      dtype: torch.dtype = torch.float32) -> Tensor:
    """Unpack + dequantize in C: the first n values (flat, dtype)."""
    return _unpack(qt, bits, group, n, None).to(dtype)


def unpack_dequantize_relu(qt: Quantized, bits: int, group: int, n: int, mask: Tensor
                           ) -> Tensor:
    """unpack_dequantize (float32) with each value made to agree with `mask` (mask_pack's
    bits of x > 0, the same tensor's exact ReLU mask) in the same C pass: where the bit is
    set a value <= 0 becomes 2**-64, where it is clear a value > 0 becomes 0 (as
    reference.relu_agree)."""
    if mask.dtype != torch.uint8 or mask.dim() != 1 or mask.numel() < (n + 7) // 8:
        raise ValueError(f"mask must be 1-D uint8 covering n={n}, got {mask.dtype} "
                         f"{tuple(mask.shape)}")
    return _unpack(qt, bits, group, n, mask)


def _unpack(qt: Quantized, bits: int, group: int, n: int, mask: Tensor | None) -> Tensor:
    """The first n float32 values of daf_unpack_dequantize(_relu)."""
    check_args(bits, group)
    codes, mn, scale = (t.contiguous() for t in qt)
    _check_cpu(codes, mn, scale)
    rows = mn.numel()
    if codes.numel() != rows * group * bits // 8 or scale.numel() != rows or mn.dtype != \
            torch.float32 or scale.dtype != torch.float32:
        raise ValueError(f"codes/mn/scale do not describe {rows} groups of {group} at {bits} "
                         f"bits (codes {codes.numel()}, scale {scale.numel()})")
    out = torch.empty(rows * group, dtype=torch.float32)
    lib = library()
    if mask is None:
        rc = lib.daf_unpack_dequantize(codes.data_ptr(), mn.data_ptr(), scale.data_ptr(),
                                       rows, group, bits, out.data_ptr(),
                                       threads(rows * group))
    else:
        _check_cpu(mask)
        mask = mask.contiguous()
        rc = lib.daf_unpack_dequantize_relu(codes.data_ptr(), mn.data_ptr(), scale.data_ptr(),
                                            rows, group, bits, mask.data_ptr(), n,
                                            out.data_ptr(), threads(rows * group))
    if rc:
        raise MemoryError("daf_unpack_dequantize could not allocate its scratch row")
    return out[:n]


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
        print(build_threaded())
        print(build_threaded(SOURCE.with_name("bn_stats.c")))  # robust BN's statistics pass
    except (RuntimeError, OSError) as exc:
        print(f"tta_kernels.native: not built ({exc}); the vectorised path will be used",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
