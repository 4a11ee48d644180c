"""Keep large freed CPU buffers in the heap instead of unmapping them (glibc only).

glibc serves every allocation above its mmap threshold (128 KiB, adjusted up to 32 MiB) with
a fresh mmap and returns it with munmap on free. A CPU forward/backward allocates and frees
its activations on every batch, so every batch page-faults its activations in again: on the
small net at one thread that was a large share of the forward time and the largest source of
run-to-run drift in the latency predictor bench. Raising the mmap and trim thresholds keeps
those pages in the process: steadier and faster, at the cost of a resident size that stays
at its peak. `TTA_KEEP_FREED_MEMORY=0` in the environment turns it off.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

M_TRIM_THRESHOLD = -1  # glibc <malloc.h>
M_MMAP_THRESHOLD = -3
DEFAULT_THRESHOLD = 1 << 30  # 1 GiB: above any activation of the models we run


def keep_freed_memory(threshold_bytes: int = DEFAULT_THRESHOLD) -> bool:
    """Set glibc's mmap and trim thresholds; True when applied, False where not glibc or
    turned off by TTA_KEEP_FREED_MEMORY=0."""
    if not 0 < threshold_bytes < 2**31:
        raise ValueError(f"threshold_bytes must be in (0, 2**31), got {threshold_bytes!r}")
    if os.environ.get("TTA_KEEP_FREED_MEMORY", "1") == "0":
        return False
    if platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    ok = [libc.mallopt(opt, ctypes.c_int(threshold_bytes))
          for opt in (M_MMAP_THRESHOLD, M_TRIM_THRESHOLD)]
    return all(v == 1 for v in ok)


def return_freed_memory() -> bool:
    """Hand the heap's free pages back to the system (glibc malloc_trim over every arena):
    what keep_freed_memory keeps, released once the memory is no longer needed (a node's
    model freed by its lifecycle cleanup). True when memory was returned; False where not
    glibc or nothing was free."""
    if platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    return bool(libc.malloc_trim(ctypes.c_size_t(0)))
