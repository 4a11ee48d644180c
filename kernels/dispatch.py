"""Backend choice of the DAF kernels: Triton on CUDA, a fast PyTorch path on CPU.

CPU paths (tta_kernels.cpu; their speeds: benchmarks/speed/bench_kernels.py and bench_daf.py,
docs/results/kernels.md):
- ``native`` (tta_kernels.native: C, built once per machine with its C compiler, cached):
  quantize + pack in one fused pass (per-group min/max, scales and codes while the group
  is in L1), and unpack + dequantize;
- ``vectorised``: the same arithmetic as eager PyTorch ops, several passes;
- ``compiled``: the reference arithmetic under torch.compile (a compile of seconds per
  function, width and group size, once per process; no faster inside a training step);
- ``reference``: the readable oracle the others are tested bit for bit against.
So ``native`` is the default, ``vectorised`` its fallback where no C compiler is found (no
compile stall, nothing to build); ``TTA_KERNELS_CPU=vectorised|compiled|reference`` selects
another. A build or compile failure warns once and falls back to ``vectorised``. 1-bit
activation masks (tta_core.memory.packed) take the native path too (`native_masks`), and
`quantize_pack_mask` encodes a tensor both ways (1-bit band mask + quantized) in one pass.
CUDA: the Triton kernels, imported on first CUDA use; if triton cannot be imported (or a
launch fails), one warning and the vectorised path (plain torch ops run on CUDA too).
Importing this package never needs a GPU or a compiler.
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable
from types import ModuleType

import torch
from torch import Tensor

from . import cpu, native, reference
from .reference import Quantized

CPU_PATHS = ("native", "vectorised", "compiled", "reference")
FALLIBLE = ("triton", "compiled", "native")  # paths that may fail to build or launch
_FALLBACK_NOTED: set[str] = set()
_DISABLED: set[str] = set()  # paths that failed once: not tried again


def _notice(what: str, exc: BaseException) -> None:
    """One warning per unavailable path, then the vectorised fallback is used silently."""
    if what not in _FALLBACK_NOTED:
        _FALLBACK_NOTED.add(what)
        warnings.warn(f"tta_kernels: {what} unavailable ({type(exc).__name__}: "
                      f"{str(exc).splitlines()[0] if str(exc) else ''}); using the vectorised "
                      "PyTorch path", RuntimeWarning, stacklevel=3)


@functools.lru_cache(maxsize=1)
def triton_module() -> ModuleType | None:
    """tta_kernels.triton_kernels, or None (with one warning) when triton cannot load."""
    try:
        from . import triton_kernels
    except Exception as exc:  # any import failure means: no Triton
        _notice("triton", exc)
        return None
    return triton_kernels


def cpu_path() -> str:
    """The CPU path asked for (TTA_KERNELS_CPU, default native)."""
    path = os.environ.get("TTA_KERNELS_CPU", "native")
    if path not in CPU_PATHS:
        raise ValueError(f"TTA_KERNELS_CPU must be one of {CPU_PATHS}, got {path!r}")
    return path


def backend(x: Tensor) -> str:
    """Name of the path a call on x takes: triton | native | vectorised | compiled |
    reference."""
    if x.is_cuda:
        ok = "triton" not in _DISABLED and triton_module() is not None
        return "triton" if ok else "vectorised"
    path = cpu_path()
    return "vectorised" if path in _DISABLED else path


def _impls(path: str) -> tuple[Callable, Callable]:
    if path == "triton":
        mod = triton_module()
        return mod.quantize_pack, mod.unpack_dequantize  # type: ignore[union-attr]
    if path == "compiled":
        return cpu.quantize_pack_compiled, cpu.unpack_dequantize_compiled
    if path == "native":
        return native.quantize_pack, native.unpack_dequantize
    if path == "reference":
        return reference.quantize_pack, reference.unpack_dequantize
    return cpu.quantize_pack, cpu.unpack_dequantize


def _run(which: int, x: Tensor, args: tuple) -> object:
    """Call the quantize (0) or dequantize (1) function of x's path; a triton/compiled/native
    failure other than a bad argument disables that path (one warning) and falls back."""
    path = backend(x)
    if path in FALLIBLE:
        try:
            return _impls(path)[which](*args)
        except ValueError:
            raise
        except Exception as exc:  # compile/launch failure: fall back
            _DISABLED.add(path)
            _notice(path, exc)
            path = "vectorised"
    return _impls(path)[which](*args)


def native_masks(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the native C path packs and unpacks 1-bit masks of float32 CPU tensors here
    (the native path chosen and its library built; a build failure: one warning, False)."""
    if dtype != torch.float32 or device.type != "cpu" or cpu_path() != "native" \
            or "native" in _DISABLED:
        return False
    try:
        native.library()
    except Exception as exc:  # no compiler, no cache: the PyTorch packing serves
        _DISABLED.add("native")
        _notice("native", exc)
        return False
    return True


def quantize_pack(x: Tensor, bits: int, group: int) -> Quantized:
    """Quantize flat x per group (DAF Eq. 1) and bit-pack, on the fastest path for x."""
    return _run(0, x, (x, bits, group))  # type: ignore[return-value]


def unpack_dequantize(qt: Quantized, bits: int, group: int, n: int,
                      dtype: torch.dtype = torch.float32) -> Tensor:
    """Inverse of quantize_pack: the first n values (flat, dtype), on the fastest path."""
    return _run(1, qt.codes, (qt, bits, group, n, dtype))  # type: ignore[return-value]


def unpack_dequantize_relu(qt: Quantized, bits: int, group: int, n: int, mask: Tensor
                           ) -> Tensor:
    """unpack_dequantize (float32) of a ReLU output with its values made to agree with the
    same tensor's exact 1-bit mask `mask` (reference.relu_agree): one C pass on the native
    path, else the decode and then relu_agree."""
    if backend(qt.codes) == "native":
        try:
            return native.unpack_dequantize_relu(qt, bits, group, n, mask)
        except ValueError:
            raise
        except Exception as exc:  # build/load failure: fall back
            _DISABLED.add("native")
            _notice("native", exc)
    return reference.relu_agree(unpack_dequantize(qt, bits, group, n), mask)


def quantize_pack_mask(x: Tensor, bits: int, group: int, band: tuple[float, float]
                       ) -> tuple[Quantized, Tensor]:
    """quantize_pack(x) and the packed bits of band[0] < x < band[1] (tta_core.memory.bits'
    layout): in one fused C pass on the native path (float32 CPU x), else two passes."""
    if x.dtype == torch.float32 and backend(x) == "native":
        try:
            return native.quantize_pack_mask(x, bits, group, band)
        except ValueError:
            raise
        except Exception as exc:  # build/load failure: fall back
            _DISABLED.add("native")
            _notice("native", exc)
    return quantize_pack(x, bits, group), reference.mask_bits(x, band)


def group_minmax(x: Tensor, group: int) -> tuple[Tensor, Tensor]:
    """Per-group (min, max) of flat x in float32 (the reduction of Eq. 1)."""
    g = reference.padded_groups(x, group)
    return g.amin(1), g.amax(1)
